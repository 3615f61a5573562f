#!/usr/bin/env python3
"""Checks grpc_health_probe (the container's HEALTHCHECK) against a real grpc.health.v1 server.

A grpcio server with the reference health servicer runs on a free loopback port; the probe must
exit 0 while the server (or a named service) is SERVING and 1 when it is NOT_SERVING, the service is
unknown, or nothing listens. Only 127.0.0.1 is contacted.

  tests/deploy/test_health_probe.py PATH/TO/grpc_health_probe
"""
import socket
import subprocess
import sys
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def probe(binary, *args):
    r = subprocess.run([binary, *args, "--timeout-ms", "3000"], capture_output=True, text=True,
                       timeout=30)
    return r.returncode, (r.stdout + r.stderr).strip()


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    binary = sys.argv[1]
    failures = []

    def expect(want_rc, args, why):
        rc, out = probe(binary, *args)
        verdict = "ok  " if rc == want_rc else "FAIL"
        print(f"{verdict} probe {' '.join(args)} -> rc {rc} (want {want_rc}: {why}) {out}")
        if rc != want_rc:
            failures.append(why)

    port = free_port()
    address = f"127.0.0.1:{port}"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(address)
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        servicer.set("vlmgraph.v1.VlmGraph", health_pb2.HealthCheckResponse.SERVING)
        expect(0, [address], "server SERVING")
        expect(0, [address, "--service", "vlmgraph.v1.VlmGraph"], "named service SERVING")
        expect(1, [address, "--service", "no.such.Service"], "unknown service")
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        expect(1, [address], "server NOT_SERVING")
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        expect(0, [address], "SERVING again")
    finally:
        server.stop(None)
    expect(1, [f"127.0.0.1:{free_port()}"], "nothing listening")
    expect(2, ["--bogus"], "bad arguments")
    if failures:
        print(f"test_health_probe: {len(failures)} failed: {', '.join(failures)}")
        return 1
    print("test_health_probe: all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
