#include "server/openai/errors.h"

#include <exception>
#include <string>

namespace vlmgraph::server::openai {
namespace {

// --- errors
// ---------------------------------------------------------------------------------------

grpc::StatusCode GrpcCodeOf(int http_status) {
  switch (http_status) {
    case 400:
    case 413:
      return grpc::StatusCode::INVALID_ARGUMENT;
    case 401:
      return grpc::StatusCode::UNAUTHENTICATED;
    case 403:
      return grpc::StatusCode::PERMISSION_DENIED;
    case 404:
    case 405:
      return grpc::StatusCode::NOT_FOUND;
    case 429:
      return grpc::StatusCode::RESOURCE_EXHAUSTED;
    case kClientClosedRequest:
      return grpc::StatusCode::CANCELLED;
    case 503:
      return grpc::StatusCode::UNAVAILABLE;
    default:
      return grpc::StatusCode::INTERNAL;
  }
}

ErrorInfo FromGrpc(grpc::StatusCode code, const std::string& message) {
  ErrorInfo e;
  e.message = message;
  e.type = "invalid_request_error";
  switch (code) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::OUT_OF_RANGE:
    case grpc::StatusCode::FAILED_PRECONDITION:
      e.http_status = 400;
      break;
    case grpc::StatusCode::UNAUTHENTICATED:
      e.http_status = 401;
      e.type = "authentication_error";
      break;
    case grpc::StatusCode::PERMISSION_DENIED:
      e.http_status = 403;
      e.type = "permission_error";
      break;
    case grpc::StatusCode::NOT_FOUND:
      e.http_status = 404;
      break;
    case grpc::StatusCode::ALREADY_EXISTS:
    case grpc::StatusCode::ABORTED:
      e.http_status = 409;
      break;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      e.http_status = 429;
      e.type = "rate_limit_error";
      break;
    case grpc::StatusCode::CANCELLED:
      e.http_status = kClientClosedRequest;
      break;
    case grpc::StatusCode::UNIMPLEMENTED:
      e.http_status = 501;
      e.type = "server_error";
      break;
    case grpc::StatusCode::UNAVAILABLE:
      e.http_status = 503;
      e.type = "server_error";
      break;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      e.http_status = 504;
      e.type = "server_error";
      break;
    default:
      e.http_status = 500;
      e.type = "server_error";
      break;
  }
  return e;
}

}  // namespace

// --- errors
// ---------------------------------------------------------------------------------------

ApiError::ApiError(ErrorInfo info)
    : ServerError(GrpcCodeOf(info.http_status), info.message), info_(std::move(info)) {}

ApiError BadRequest(const std::string& message, const std::string& param, const std::string& code) {
  return ApiError({400, "invalid_request_error", message, param, code});
}

ErrorInfo ErrorFromException(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const ApiError& e) {
    return e.info();
  } catch (...) {
    const grpc::Status s = StatusFromException(std::current_exception());
    return FromGrpc(s.error_code(), s.error_message());
  }
}

json ErrorJson(const ErrorInfo& error) {
  auto or_null = [](const std::string& s) { return s.empty() ? json(nullptr) : json(s); };
  return {{"error",
           {{"message", error.message},
            {"type", error.type},
            {"param", or_null(error.param)},
            {"code", or_null(error.code)}}}};
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

}  // namespace vlmgraph::server::openai
