"""End to end: a second vlmgraph-server on an address that a running one holds (gRPC or metrics)
exits with status 1 and a message naming the config key and the address, instead of sharing the
port (gRPC's default SO_REUSEPORT would let it take part of the traffic); the first keeps serving.
Every listener serves on the IPv6 loopback ([::1]:PORT, no API key needed there), and a malformed
address stops the start with a message that says what to write."""
import socket
import subprocess
import unittest
import urllib.request

from e2e_util import Server, free_port


class PortsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.grpc_address = f"127.0.0.1:{free_port()}"
        cls.metrics_address = f"127.0.0.1:{free_port()}"
        # Later flags win: these replace the free ports (port 0) that Server passes first.
        cls.first = Server(args=["--grpc-address", cls.grpc_address, "--metrics-address", cls.metrics_address],
                           name="ports-first").start()
        cls.client = cls.first.client()

    @classmethod
    def tearDownClass(cls):
        cls.first.finish(cls.client)

    def assertSecondServerRefused(self, key, address, args):
        second = Server(args=args, name="ports-second")
        proc = subprocess.Popen(second.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            first_line = proc.stdout.readline()  # "" when it exits; the ready line when it serves
            if first_line.startswith("vlmgraph-server ready"):
                proc.kill()
                proc.communicate(timeout=30)
                self.fail(f"a second server started on {address}: {first_line.strip()}")
            _, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            second.cleanup()
        self.assertEqual(proc.returncode, 1, stderr)
        self.assertIn(f"{key}: cannot listen on {address}", stderr)
        if key == "server.grpc_address":
            self.assertIn("already in use", stderr)
        # The first server still answers, and alone.
        self.assertEqual(self.first.address, self.grpc_address)
        self.assertEqual(len(self.client.generate_all([1, 2, 3], max_new_tokens=2)[0]), 2)
        self.assertGreater(self.first.metric("vlmgraph_requests_total", rpc="Generate"), 0)

    def test_second_server_on_the_grpc_address_exits(self):
        self.assertSecondServerRefused("server.grpc_address", self.grpc_address,
                                       ["--grpc-address", self.grpc_address])

    def test_second_server_on_the_metrics_address_exits(self):
        self.assertSecondServerRefused("server.metrics_address", self.metrics_address,
                                       ["--metrics-address", self.metrics_address])


def has_ipv6_loopback():
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


class Ipv6Test(unittest.TestCase):
    @unittest.skipUnless(has_ipv6_loopback(), "no IPv6 loopback on this machine")
    def test_every_listener_serves_on_the_ipv6_loopback(self):
        s = Server(args=["--grpc-address", "[::1]:0", "--metrics-address", "[::1]:0",
                         "--http-address", "[::1]:0"], name="ports-ipv6").start()
        client = s.client()
        try:
            for address in (s.address, s.metrics_address, s.http_address):
                self.assertRegex(address, r"^\[::1\]:[1-9][0-9]*$")
            self.assertEqual(len(client.generate_all([1, 2, 3], max_new_tokens=2)[0]), 2)
            self.assertGreater(s.metric("vlmgraph_requests_total", rpc="Generate"), 0)
            with urllib.request.urlopen(f"http://{s.http_address}/health", timeout=10) as r:
                self.assertEqual(r.status, 200)
        finally:
            s.finish(client)

    def test_a_malformed_address_says_what_to_write(self):
        s = Server(args=["--http-address", "::1:8000"], name="ports-bad")
        try:
            r = subprocess.run(s.args, capture_output=True, text=True, timeout=60)
        finally:
            s.cleanup()
        self.assertEqual(r.returncode, 2, r.stderr)  # a config error
        self.assertIn("server.http_address: '::1:8000' has an IPv6 address without brackets; "
                      "write [::1]:8000", r.stderr)


if __name__ == "__main__":
    unittest.main()
