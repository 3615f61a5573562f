// grpc_health_probe: exits 0 when a gRPC server answers grpc.health.v1.Health/Check with SERVING.
//
// The container's HEALTHCHECK runs it against the server inside the same container, so the probe
// goes through the real gRPC stack rather than a side port. It is built in the Dockerfile's build
// stage from this one file against the gRPC library the server already links, and needs neither
// protobuf code generation nor Python in the runtime image: the request (an empty
// HealthCheckRequest, or one naming a service) and the response (field 1, enum ServingStatus) are
// encoded and decoded by hand. Wire format: grpc/health/v1/health.proto, protobuf encoding guide.
//
//   grpc_health_probe                                  # 127.0.0.1:50051, whole server
//   grpc_health_probe 127.0.0.1:50051 --service vlmgraph.v1.VlmGraph --timeout-ms 2000
//
// Exit status: 0 SERVING; 1 any other status, an RPC error or a timeout (message on stderr);
// 2 bad arguments.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/byte_buffer.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

namespace {

constexpr char kCheckMethod[] = "/grpc.health.v1.Health/Check";

// HealthCheckRequest { string service = 1; }: tag 0x0a, length, bytes. Services named by the
// health protocol are short (< 128 bytes), so the length is a one-byte varint.
std::string EncodeRequest(const std::string& service) {
  if (service.empty()) return "";
  return std::string{'\x0a', static_cast<char>(service.size())} + service;
}

// HealthCheckResponse { ServingStatus status = 1; }: tag 0x08, varint. Absent field = UNKNOWN (0).
// Returns -1 when the bytes are not a response of that shape.
int DecodeStatus(const std::string& bytes) {
  if (bytes.empty()) return 0;
  if (bytes.size() == 2 && bytes[0] == '\x08' && (bytes[1] & 0x80) == 0) return bytes[1];
  return -1;
}

const char* StatusName(int status) {
  switch (status) {
    case 0:
      return "UNKNOWN";
    case 1:
      return "SERVING";
    case 2:
      return "NOT_SERVING";
    case 3:
      return "SERVICE_UNKNOWN";
    default:
      return "malformed response";
  }
}

int Usage() {
  std::cerr << "usage: grpc_health_probe [ADDRESS=127.0.0.1:50051] [--service NAME] "
               "[--timeout-ms N=3000]\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string address = "127.0.0.1:50051";
  std::string service;
  long timeout_ms = 3000;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--service" && i + 1 < argc) {
      service = argv[++i];
    } else if (arg == "--timeout-ms" && i + 1 < argc) {
      timeout_ms = std::strtol(argv[++i], nullptr, 10);
      if (timeout_ms <= 0) return Usage();
    } else if (!arg.empty() && arg[0] != '-') {
      address = arg;
    } else {
      return Usage();
    }
  }
  if (service.size() >= 128) return Usage();

  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));

  const std::string request_bytes = EncodeRequest(service);
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::CompletionQueue cq;
  auto call = stub.PrepareUnaryCall(&context, kCheckMethod, request, &cq);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  if (!cq.Next(&tag, &ok) || !ok) {
    std::cerr << "grpc_health_probe: " << address << ": completion queue failed\n";
    return 1;
  }
  if (!status.ok()) {
    std::cerr << "grpc_health_probe: " << address << ": rpc failed: code "
              << static_cast<int>(status.error_code()) << ": " << status.error_message() << "\n";
    return 1;
  }
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (!response.Dump(&slices).ok()) {
    std::cerr << "grpc_health_probe: could not read the response\n";
    return 1;
  }
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  const int serving = DecodeStatus(bytes);
  if (serving != 1) {
    std::cerr << "grpc_health_probe: " << address << (service.empty() ? "" : " service " + service)
              << ": " << StatusName(serving) << "\n";
    return 1;
  }
  std::cout << "status: SERVING\n";
  return 0;
}
