#include "server/grpc_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include <chrono>
#include <stdexcept>

namespace vlmgraph::server {

GrpcServer::GrpcServer(const ServerConfig& config, grpc::Service* service) {
  const std::string& address = config.server.grpc_address;
  host_ = address.substr(0, address.rfind(':'));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port_);
  builder.RegisterService(service);
  builder.SetMaxReceiveMessageSize(static_cast<int>(config.limits.max_request_bytes));
  server_ = builder.BuildAndStart();
  if (!server_ || port_ == 0) {
    throw std::runtime_error("server.grpc_address: cannot listen on " + address +
                             " (address in use or not local?)");
  }
  SetServing(false);  // until main() says warm-up is over
}

GrpcServer::~GrpcServer() { Shutdown(0); }

std::string GrpcServer::address() const { return host_ + ":" + std::to_string(port_); }

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
