#include "server/core/status.h"

#include <c10/util/Exception.h>

#include <new>

#include "engine/engine_types.h"

namespace vlmgraph::server {
namespace {

grpc::StatusCode FromEngineCode(EngineError::Code code) {
  switch (code) {
    case EngineError::Code::kInvalidArgument:
      return grpc::StatusCode::INVALID_ARGUMENT;
    case EngineError::Code::kResourceExhausted:
      return grpc::StatusCode::RESOURCE_EXHAUSTED;
    case EngineError::Code::kFailedPrecondition:
      return grpc::StatusCode::FAILED_PRECONDITION;
    case EngineError::Code::kUnavailable:
      return grpc::StatusCode::UNAVAILABLE;
    case EngineError::Code::kInternal:
      return grpc::StatusCode::INTERNAL;
  }
  return grpc::StatusCode::INTERNAL;
}

}  // namespace

grpc::Status StatusFromException(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const ServerError& e) {
    return {e.code(), e.what()};
  } catch (const EngineError& e) {
    return {FromEngineCode(e.code()), e.what()};
  } catch (const std::invalid_argument& e) {  // ImageError, ConfigError, model input checks
    return {grpc::StatusCode::INVALID_ARGUMENT, e.what()};
  } catch (const c10::OutOfMemoryError& e) {
    return {grpc::StatusCode::RESOURCE_EXHAUSTED,
            std::string("device out of memory: ") + e.what_without_backtrace()};
  } catch (const c10::Error& e) {
    return {grpc::StatusCode::INTERNAL, e.what_without_backtrace()};
  } catch (const std::bad_alloc&) {
    return {grpc::StatusCode::RESOURCE_EXHAUSTED, "host out of memory"};
  } catch (const std::exception& e) {
    return {grpc::StatusCode::INTERNAL, e.what()};
  } catch (...) {
    return {grpc::StatusCode::INTERNAL, "unknown error"};
  }
}

const char* StatusCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN";
  }
}

}  // namespace vlmgraph::server
