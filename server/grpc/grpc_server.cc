#include "server/grpc/grpc_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "server/auth.h"

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

}  // namespace

GrpcServer::GrpcServer(const ServerConfig& config, grpc::Service* service) {
  const ListenAddress& address = config.server.grpc_address;
  address_ = address;
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address.ToString(), Credentials(config), &port_);
  builder.RegisterService(service);
  builder.SetMaxReceiveMessageSize(static_cast<int>(config.limits.max_request_bytes));
  // gRPC sets SO_REUSEPORT by default: a second server on the same address would then start and
  // take part of the traffic. Without it the second bind fails, as it should.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
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
