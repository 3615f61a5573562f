#include "server/grpc/grpc_server.h"

#include <google/protobuf/descriptor.h>
#include <grpc/support/log.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/support/server_interceptor.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <stdexcept>

#include "base/log.h"
#include "server/core/auth.h"

namespace vlmgraph::server {
namespace {

// Why `address` cannot be bound: the error of a plain TCP bind to it ("Address already in use"),
// for a start-up message that says what to do.
std::string BindError(const ListenAddress& address) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(address.port());
  const int rc = ::getaddrinfo(address.host().c_str(), port.c_str(), &hints, &found);
  if (rc != 0) return std::string("cannot resolve it (") + ::gai_strerror(rc) + ")";
  std::string error = "gRPC could not bind it (see its log above)";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    const int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0) {
      error = errno == EADDRINUSE
                  ? "the address is already in use (is another vlmgraph-server running?)"
                  : std::string(std::strerror(errno));
      ::close(fd);
      break;
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return error;
}

// Plaintext, or TLS from tls.cert_file / key_file; with tls.client_ca_file every client must
// present a certificate that CA signed (gRPC's REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY).
std::shared_ptr<grpc::ServerCredentials> Credentials(const ServerConfig& config) {
  const ServerConfig::Tls& tls = config.tls;
  if (tls.cert_file.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(
      tls.client_ca_file.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                 : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_key_cert_pairs.push_back(
      {ReadPemFile(tls.key_file, "tls.key_file"), ReadPemFile(tls.cert_file, "tls.cert_file")});
  if (!tls.client_ca_file.empty())
    options.pem_root_certs = ReadPemFile(tls.client_ca_file, "tls.client_ca_file");
  return grpc::SslServerCredentials(options);
}

// Note [gRPC listener]: gRPC's log, forwarded at its severity, and watched for a failed accept.
std::mutex g_listener_mu;
std::atomic<bool> g_listener_failed{false};
std::function<void()> g_on_listener_failed;  // g_listener_mu

void ForwardGrpcLog(gpr_log_func_args* args) {
  const std::string message = std::string("gRPC: ") + (args->message ? args->message : "");
  if (args->severity == GPR_LOG_SEVERITY_ERROR) {
    LogError(message);
  } else if (args->severity == GPR_LOG_SEVERITY_INFO) {
    LogInfo(message);
  } else {
    LogDebug(message);
  }
  if (message.find("Failed accept4") == std::string::npos || g_listener_failed.exchange(true)) {
    return;
  }
  std::function<void()> fn;
  {
    std::lock_guard<std::mutex> lock(g_listener_mu);
    fn = g_on_listener_failed;
  }
  LogError("gRPC's listener stopped accepting connections (" + message +
           "): gRPC does not retry a failed accept; the server must restart");
  if (fn) fn();
}

// Note [Malformed requests] (grpc_server.h).
class MalformedRequests final : public grpc::experimental::Interceptor {
 public:
  // `method`: "/package.Service/Method" as gRPC names it.
  MalformedRequests(std::string method, Metrics* metrics)
      : method_(std::move(method)),
        slash_(method_.rfind('/')),
        metrics_(metrics),
        started_(std::chrono::steady_clock::now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using Hook = grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(Hook::POST_RECV_MESSAGE) && !first_seen_) {
      first_seen_ = true;
      malformed_ = methods->GetRecvMessage() == nullptr;
    }
    if (malformed_ && methods->QueryInterceptionHookPoint(Hook::PRE_SEND_STATUS)) {
      const grpc::Status sent = methods->GetSendStatus();
      if (sent.error_message().empty() && (sent.error_code() == grpc::StatusCode::INTERNAL ||
                                           sent.error_code() == grpc::StatusCode::UNIMPLEMENTED)) {
        methods->ModifySendStatus(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, Message()));
        if (metrics_) {
          metrics_->ObserveRequest(
              RpcName(), grpc::StatusCode::INVALID_ARGUMENT,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count());
        }
        LogDebug(method_ + " -> INVALID_ARGUMENT: a request that protobuf could not parse");
      }
    }
    methods->Proceed();
  }

 private:
  std::string RpcName() const {
    return slash_ == std::string::npos ? method_ : method_.substr(slash_ + 1);
  }

  std::string Message() const {
    std::string type;
    if (slash_ != std::string::npos && slash_ > 1) {
      // The method's request type from the generated descriptors; the service's own may not be
      // linked in, and then vlmgraph.v1's naming (<Method>Request) is looked up among the
      // messages, which are.
      const auto* pool = google::protobuf::DescriptorPool::generated_pool();
      const std::string service_name = method_.substr(1, slash_ - 1);
      const std::string method = RpcName();
      if (const auto* service = pool->FindServiceByName(service_name)) {
        if (const auto* m = service->FindMethodByName(method)) type = m->input_type()->full_name();
      } else if (const size_t dot = service_name.rfind('.'); dot != std::string::npos) {
        const std::string guess = service_name.substr(0, dot + 1) + method + "Request";
        if (pool->FindMessageTypeByName(guess) != nullptr) type = guess;
      }
    }
    return "the request of " + method_ + " is not a valid serialized " +
           (type.empty() ? std::string("protobuf message") : type) +
           " (protobuf could not parse it): send a message of that type, built with the "
           "service's .proto files (proto/vlmgraph/v1)";
  }

  const std::string method_;
  const size_t slash_;  // before the method's name; npos when gRPC gave none
  Metrics* const metrics_;
  const std::chrono::steady_clock::time_point started_;
  bool first_seen_ = false;
  bool malformed_ = false;
};

class MalformedRequestsFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit MalformedRequestsFactory(Metrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new MalformedRequests(info->method() ? info->method() : "", metrics_);
  }

 private:
  Metrics* const metrics_;
};

void InstallGrpcLog() {
  static std::once_flag once;
  std::call_once(once, [] { gpr_set_log_function(ForwardGrpcLog); });
}

}  // namespace

void GrpcServer::OnListenerFailed(std::function<void()> fn) {
  InstallGrpcLog();
  {
    std::lock_guard<std::mutex> lock(g_listener_mu);
    g_on_listener_failed = fn;
  }
  if (g_listener_failed.load() && fn) fn();
}

bool GrpcServer::listener_failed() { return g_listener_failed.load(); }

GrpcServer::GrpcServer(const ServerConfig& config, grpc::Service* service, Metrics* metrics) {
  InstallGrpcLog();
  const ListenAddress& address = config.server.grpc_address;
  address_ = address;
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address.ToString(), Credentials(config), &port_);
  builder.RegisterService(service);
  builder.SetMaxReceiveMessageSize(static_cast<int>(config.limits.max_request_bytes));
  // Note [gRPC buffers].
  grpc::ResourceQuota quota("vlmgraph-grpc");
  quota.Resize(static_cast<size_t>(kGrpcBufferRequests * config.limits.max_request_bytes));
  builder.SetResourceQuota(quota);
  // gRPC sets SO_REUSEPORT by default: a second server on the same address would then start and
  // take part of the traffic. Without it the second bind fails, as it should.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<MalformedRequestsFactory>(metrics));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  server_ = builder.BuildAndStart();
  if (!server_ || port_ == 0) {
    throw std::runtime_error("server.grpc_address: cannot listen on " + address.ToString() + ": " +
                             BindError(address));
  }
  SetServing(false);  // until main() says warm-up is over
}

GrpcServer::~GrpcServer() { Shutdown(0); }

std::string GrpcServer::address() const { return address_.WithPort(port_).ToString(); }

void GrpcServer::SetServing(bool serving) {
  if (auto* health = server_->GetHealthCheckService()) {
    health->SetServingStatus(serving);
    health->SetServingStatus(kServiceName, serving);
  }
}

void GrpcServer::Shutdown(double timeout_seconds) {
  if (shut_down_) return;
  shut_down_ = true;
  SetServing(false);
  const auto deadline = std::chrono::system_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
  server_->Shutdown(deadline);
  server_->Wait();
}

}  // namespace vlmgraph::server
