// server/openai/errors.h: the OpenAI-compatible API's errors: ApiError (a ServerError with an HTTP
// status and OpenAI's error fields), the one mapping of every exception to them
// (ErrorFromException) and OpenAI's error body {"error": {"message", "type", "param", "code"}}.
// The requests and responses are in server/openai/requests.h and server/openai/responses.h; the
// HTTP endpoints in server/openai/openai_http.h.
//
//   try { ... } catch (...) {
//     const ErrorInfo e = ErrorFromException(std::current_exception());
//     reply(e.http_status, Dump(ErrorJson(e)));
//   }
//
// Thread rules: pure functions, safe from any thread.
#pragma once

#include <exception>
#include <nlohmann/json.hpp>
#include <string>

#include "server/core/status.h"

namespace vlmgraph::server::openai {

using nlohmann::json;

// --- errors
// ---------------------------------------------------------------------------------------

// One error response: the HTTP status and the fields of OpenAI's error object ("" = null).
struct ErrorInfo {
  int http_status = 500;
  std::string type;  // "invalid_request_error", "authentication_error", "server_error", ...
  std::string message;
  std::string param;  // the request field at fault, e.g. "messages[0].content[1].image_url.url"
  std::string code;   // OpenAI's codes: "model_not_found", "invalid_api_key",
                      // "context_length_exceeded"; "" otherwise
};

// An error with its own HTTP status and OpenAI fields. Its gRPC code (ServerError::code) is the
// status's namesake, so code that only knows ServerError still reads it right.
class ApiError : public ServerError {
 public:
  explicit ApiError(ErrorInfo info);
  const ErrorInfo& info() const { return info_; }

 private:
  ErrorInfo info_;
};

// 400 invalid_request_error.
ApiError BadRequest(const std::string& message, const std::string& param = "",
                    const std::string& code = "");

// HTTP status 499: the client closed the connection before the response was complete (nginx's
// code). Never sent; recorded in metrics and logs.
inline constexpr int kClientClosedRequest = 499;

// The one mapping from an exception to an error response:
//   ApiError                                  its own status and fields
//   INVALID_ARGUMENT, OUT_OF_RANGE,           400 invalid_request_error (bad input; a missing
//     FAILED_PRECONDITION                         tokenizer is permanent, so not 503)
//   UNAUTHENTICATED                           401 authentication_error
//   PERMISSION_DENIED                         403 permission_error
//   NOT_FOUND                                 404 invalid_request_error
//   ALREADY_EXISTS, ABORTED                   409 invalid_request_error
//   RESOURCE_EXHAUSTED                        429 rate_limit_error (queue full, out of memory)
//   CANCELLED                                 499 (client gone)
//   UNIMPLEMENTED                             501 server_error
//   UNAVAILABLE                               503 server_error (shutting down)
//   DEADLINE_EXCEEDED                         504 server_error
//   anything else (INTERNAL, ...)             500 server_error
// gRPC codes come from StatusFromException (server/core/status.h): ServerError, EngineError,
// ImageError and other std::invalid_argument (400), bad_alloc (429), the rest INTERNAL (500).
ErrorInfo ErrorFromException(std::exception_ptr error);
// The error body: {"error": {"message", "type", "param", "code"}}.
json ErrorJson(const ErrorInfo& error);

// JSON text; invalid UTF-8 (never expected) becomes U+FFFD instead of throwing.
std::string Dump(const json& j);

}  // namespace vlmgraph::server::openai
