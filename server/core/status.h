// server/core/status.h: errors of the server layer and their one conversion to gRPC status.
//
// Error policy of server/: code throws (ServerError for the server's own conditions, EngineError
// from the engine, ImageError / std::invalid_argument from the model); every gRPC call ends in
// exactly one place, VlmGraphService::FinishRpc (server/grpc/service.cc; synchronous handlers reach
// it through RpcGuard, which catches everything), which calls StatusFromException below. Nothing
// else builds a grpc::Status from an exception.
//
//   throw ServerError(grpc::StatusCode::RESOURCE_EXHAUSTED, "queue full: ...");
//   grpc::Status s = StatusFromException(std::current_exception());
//
// Thread rules: pure functions.
#pragma once

#include <grpcpp/support/status.h>

#include <exception>
#include <stdexcept>
#include <string>

namespace vlmgraph::server {

class ServerError : public std::runtime_error {
 public:
  ServerError(grpc::StatusCode code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  grpc::StatusCode code() const { return code_; }

 private:
  grpc::StatusCode code_;
};

// Shorthand for the most common error: bad input.
inline ServerError InvalidArgument(const std::string& message) {
  return ServerError(grpc::StatusCode::INVALID_ARGUMENT, message);
}

// Maps an exception to a status: ServerError -> its code; EngineError -> its code's gRPC
// namesake; ImageError and other std::invalid_argument -> INVALID_ARGUMENT; std::bad_alloc and
// device out-of-memory errors -> RESOURCE_EXHAUSTED; anything else -> INTERNAL with its message.
grpc::Status StatusFromException(std::exception_ptr error);

// "OK", "INVALID_ARGUMENT", ... (the metric label and log spelling of a code).
const char* StatusCodeName(grpc::StatusCode code);

}  // namespace vlmgraph::server
