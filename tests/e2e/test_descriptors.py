"""End to end: the server under a low file descriptor limit (`ulimit -n`), Note [Descriptor reserve]
and Note [gRPC listener]. Idle HTTP connections up to the limit leave room for gRPC: the HTTP front
refuses what its share cannot hold, and gRPC and /health keep answering. A flood of idle gRPC
connections that exhausts the descriptors stops gRPC's listener for good (gRPC 1.51 does not retry
a failed accept): the server then reports NOT_SERVING, drains and exits with status 1, so the
container is restarted, instead of serving HTTP with a dead gRPC port."""
import socket
import time
import unittest
import urllib.error
import urllib.request

from e2e_util import Server


def connect_many(address, count):
    """Up to `count` idle TCP connections to host:port (fewer when the test process runs out)."""
    host, port = address.rsplit(":", 1)
    socks = []
    for _ in range(count):
        try:
            socks.append(socket.create_connection((host, int(port)), timeout=5))
        except OSError:
            break
    return socks


def health(http_address):
    try:
        with urllib.request.urlopen(f"http://{http_address}/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


class DescriptorTest(unittest.TestCase):
    def test_idle_http_connections_leave_room_for_grpc(self):
        server = Server({"shutdown_timeout_seconds": 2}, name="fds-http", nofile=512).start()
        socks = []
        try:
            self.assertIn("http.max_connections 16384 lowered to", server.log())
            socks = connect_many(server.http_address, 480)
            # The front took its share and refused the rest (503, Connection: close).
            server.wait_metric("vlmgraph_http_refused_connections_total", lambda v: v > 0)
            self.assertLess(server.metric("vlmgraph_http_open_connections"), 480)
            self.assertGreater(server.metric("process_max_fds"), 0)
            # gRPC still accepts a new connection, and /health answers on a fresh one.
            client = server.client()
            tokens, _ = client.generate_all([1, 2, 3, 4], max_new_tokens=4)
            self.assertEqual(len(tokens), 4)
            client.close()
        finally:
            for s in socks:
                s.close()
        self.assertEqual(health(server.http_address), 200)
        server.finish()

    def test_a_grpc_connection_flood_ends_the_server_for_a_restart(self):
        server = Server({"shutdown_timeout_seconds": 2}, name="fds-grpc", nofile=256).start()
        socks = connect_many(server.address, 320)
        try:
            deadline = time.time() + 30
            while time.time() < deadline and server.proc.poll() is None:
                time.sleep(0.1)
            status = server.proc.poll()
        finally:
            for s in socks:
                s.close()
        log = server.log()
        server.cleanup()
        self.assertEqual(status, 1, log[-2000:])
        self.assertIn("gRPC's listener stopped accepting connections", log)
        self.assertIn("Too many open files", log)


if __name__ == "__main__":
    unittest.main()
