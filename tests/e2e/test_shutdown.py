"""End to end: graceful shutdown on SIGTERM. In-flight generation finishes within the drain
deadline; work still open at the deadline is cancelled; the process exits 0 either way; a bad
config fails at start with the key path."""
import queue
import subprocess
import threading
import time
import unittest

import grpc

from e2e_util import SERVER, Server


class ShutdownTest(unittest.TestCase):
    def test_in_flight_generation_finishes_after_sigterm(self):
        server = Server({"shutdown_timeout_seconds": 60}, name="drain").start()
        try:
            client = server.client()
            call = client.generate_stream(client.generate_request([1, 2, 3], max_new_tokens=400, sample=True))
            it = iter(call)
            first = next(it)  # running now
            server.proc.send_signal(15)
            rest = list(it)
            tokens = list(first.tokens.token_ids) + [t for m in rest[:-1] for t in m.tokens.token_ids]
            self.assertTrue(rest[-1].HasField("summary"))
            self.assertEqual(len(tokens), 400)
            self.assertEqual(server.proc.wait(timeout=60), 0)
            # Nothing listens any more.
            with self.assertRaises(grpc.RpcError) as ctx:
                client.model_info()
            self.assertEqual(ctx.exception.code(), grpc.StatusCode.UNAVAILABLE)
            client.close()
            self.assertIn("stopped:", server.log())
        finally:
            server.cleanup()

    def test_open_work_is_cancelled_at_the_deadline(self):
        server = Server({"shutdown_timeout_seconds": 1}, name="deadline").start()
        try:
            client = server.client()
            t = client.pb.train_pb2
            pending = queue.Queue()

            def job():  # a training job that stays open until the server ends it
                yield t.TrainRequest(config=client.train_config(language_learning_rate=1e-3))
                while True:
                    item = pending.get()
                    if item is None:
                        return
                    yield item

            responses = client.stub.Train(job(), timeout=120)
            pending.put(client.train_batch([{"input_ids": [1, 2, 3], "target_ids": [2, 3, -100]}]))
            self.assertTrue(next(responses).HasField("step"))
            result = {}

            def read_rest():
                try:
                    list(responses)
                    result["code"] = grpc.StatusCode.OK
                except grpc.RpcError as e:
                    result["code"] = e.code()

            reader = threading.Thread(target=read_rest)
            reader.start()
            start = time.time()
            server.proc.send_signal(15)
            self.assertEqual(server.proc.wait(timeout=30), 0)
            elapsed = time.time() - start
            reader.join(timeout=30)
            pending.put(None)
            self.assertGreaterEqual(elapsed, 0.9)  # the drain waited for the job...
            self.assertLess(elapsed, 15)           # ...then cancelled it
            self.assertIn(result.get("code"), (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE))
            client.close()
        finally:
            server.cleanup()

    def test_generation_cut_at_the_deadline_is_logged_as_cut_by_it(self):
        server = Server({"shutdown_timeout_seconds": 0, "log_level": "debug"}, name="cut").start()
        try:
            client = server.client()
            call = client.generate_stream(client.generate_request([1, 2, 3], max_new_tokens=500, sample=True))
            it = iter(call)
            next(it)  # running now
            server.proc.send_signal(15)
            with self.assertRaises(grpc.RpcError):  # cut: the summary never comes
                list(it)
            self.assertEqual(server.proc.wait(timeout=30), 0)
            client.close()
            log = server.log()
            self.assertRegex(log, r"Generate from \S+ -> UNAVAILABLE: cut by the shutdown deadline")
            self.assertNotIn("cancelled by the client", log)
        finally:
            server.cleanup()

    def test_draining_server_says_not_serving_and_lets_a_train_job_finish(self):
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        import urllib.error
        import urllib.request
        server = Server({"shutdown_timeout_seconds": 60}, name="drain-train").start()
        try:
            client = server.client()
            health = health_pb2_grpc.HealthStub(client.channel)
            t = client.pb.train_pb2
            pending = queue.Queue()

            def job():
                yield t.TrainRequest(config=client.train_config(language_learning_rate=1e-3))
                while True:
                    item = pending.get(timeout=60)
                    if item is None:
                        return
                    yield item

            batch = client.train_batch([{"input_ids": [1, 2, 3], "target_ids": [2, 3, -100]}])
            responses = client.stub.Train(job(), timeout=120)
            pending.put(batch)
            self.assertEqual(next(responses).step.step, 1)
            server.proc.send_signal(15)
            # Draining: the ports stay open and say NOT_SERVING; new work is refused...
            deadline = time.time() + 10
            status = None
            while time.time() < deadline:
                status = health.Check(health_pb2.HealthCheckRequest(service="vlmgraph.v1.VlmGraph"), timeout=5).status
                if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                time.sleep(0.05)
            self.assertEqual(status, health_pb2.HealthCheckResponse.NOT_SERVING)
            with self.assertRaises(urllib.error.HTTPError) as ctx:
                urllib.request.urlopen(f"http://{server.http_address}/health", timeout=5)
            self.assertEqual(ctx.exception.code, 503)
            with self.assertRaises(grpc.RpcError) as ctx:
                list(client.generate([1, 2, 3], max_new_tokens=2))
            self.assertEqual(ctx.exception.code(), grpc.StatusCode.UNAVAILABLE)
            # ...while the running job keeps training until its client ends it.
            pending.put(batch)
            self.assertEqual(next(responses).step.step, 2)
            pending.put(None)
            self.assertEqual(list(responses), [])
            self.assertEqual(server.proc.wait(timeout=30), 0)
            client.close()
        finally:
            server.cleanup()

    def test_bad_config_fails_at_start_with_the_key_path(self):
        server = Server({"buckets": {"batch_sizes": [1, 2, 0]}}, name="badcfg")
        try:
            out = subprocess.run(server.args, capture_output=True, text=True, timeout=60)
            self.assertEqual(out.returncode, 2)
            self.assertIn("buckets.batch_sizes[2]: must be >= 1, got 0", out.stderr)
        finally:
            server.cleanup()
        out = subprocess.run([SERVER, "--no-such-flag"], capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 2)
        self.assertIn("--no-such-flag", out.stderr)


if __name__ == "__main__":
    unittest.main()
