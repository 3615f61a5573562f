"""End to end: every kind of bad input gets its precise status and message, cancelled and vanished
clients free their sequence, a full queue answers RESOURCE_EXHAUSTED, and requests around them
are unaffected."""
import os
import struct
import subprocess
import sys
import threading
import unittest
import zlib

import grpc

from e2e_util import ROOT, Server, chelsea
from vlmgraph_client import build_prompt, image_tiles

CONFIG = {
    # The tiny model's longest context (512), so the streams that get cancelled are still running
    # when they are: 500 tokens take a good fraction of a second.
    "buckets": {"seq_lens": [32, 64, 128], "context_lens": [256, 512], "oversize": "reject"},
    "limits": {"max_image_bytes": 300000, "max_image_pixels": 1000000, "max_new_tokens": 500,
               "max_images_per_request": 2},
    "log_level": "debug",  # each Generate logs its request_id; refusals log their status
}
LONG = 500


def png(width, height, pixels=None, declared=None):
    """A PNG with stored (uncompressed) RGB rows; `declared` = (w, h) to lie in the header."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    w, h = declared or (width, height)
    raw = pixels if pixels is not None else os.urandom(width * height * 3)
    rows = b"".join(b"\x00" + raw[y * width * 3:(y + 1) * width * 3] for y in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(rows, 0)) + chunk(b"IEND", b""))


class ErrorsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.image = chelsea()
        cls.server = Server(CONFIG, name="errors").start()
        cls.client = cls.server.client()
        cls.info = cls.client.model_info()
        cls.good = build_prompt(cls.info, [image_tiles(cls.image, cls.info)], [11, 12, 13])
        cls.baseline = cls.sampled()

    @classmethod
    def tearDownClass(cls):
        cls.server.finish(cls.client)

    @classmethod
    def sampled(cls):
        return cls.client.generate_all(cls.good, [cls.image], max_new_tokens=16, sample=True, seed=5)[0]

    def assertGenerateFails(self, code, text, input_ids, images=(), **sampling):
        with self.assertRaises(grpc.RpcError) as ctx:
            self.client.generate_all(input_ids, list(images), **sampling)
        self.assertEqual(ctx.exception.code(), code, ctx.exception.details())
        self.assertIn(text, ctx.exception.details())
        return ctx.exception.details()

    def test_bad_images(self):
        INVALID = grpc.StatusCode.INVALID_ARGUMENT
        self.assertGenerateFails(INVALID, "images[0]: unknown image format", [1, 2], [b"GIF89a" + b"\0" * 100])
        self.assertGenerateFails(INVALID, "corrupt png", [1, 2], [self.image[:1000]])
        big = png(400, 300)
        self.assertGreater(len(big), 300000)
        self.assertGenerateFails(INVALID, "limits.max_image_bytes", [1, 2], [big])
        self.assertGenerateFails(INVALID, "limits.max_image_pixels", [1, 2], [png(2, 2, declared=(5000, 5000))])
        self.assertGenerateFails(INVALID, "limits.max_images_per_request", [1, 2], [self.image] * 3)
        empty = self.client.pb.image_pb2.Image()
        self.assertGenerateFails(INVALID, "images[0]: empty image", [1, 2], [empty])

    def test_bad_prompts(self):
        INVALID = grpc.StatusCode.INVALID_ARGUMENT
        self.assertGenerateFails(INVALID, "outside the vocabulary", [1, 5000, 2])
        self.assertGenerateFails(INVALID, "outside the vocabulary", [1, -3, 2])
        self.assertGenerateFails(INVALID, "no prompt: set input_ids, text or messages", [])
        n = len(self.good) - 3
        more = [self.info.image_token_id] * (n + 1) + [11]
        details = self.assertGenerateFails(INVALID, "image tokens", more, [self.image])
        self.assertIn(str(n + 1), details)
        fewer = [self.info.image_token_id] * (n - 4) + [11]
        self.assertGenerateFails(INVALID, "image tokens", fewer, [self.image])
        self.assertGenerateFails(INVALID, "image tokens", [self.info.image_token_id, 5])  # no image at all
        self.assertGenerateFails(INVALID, "largest prefill bucket", list(range(1, 201)))

    def test_bad_sampling(self):
        INVALID = grpc.StatusCode.INVALID_ARGUMENT
        self.assertGenerateFails(INVALID, "sampling.max_new_tokens", [1, 2], max_new_tokens=0)
        self.assertGenerateFails(INVALID, "sampling.max_new_tokens", [1, 2], max_new_tokens=-4)
        self.assertGenerateFails(INVALID, "limits.max_new_tokens", [1, 2], max_new_tokens=10 ** 9)
        self.assertGenerateFails(INVALID, "longest context bucket", list(range(1, 101)), max_new_tokens=420)
        self.assertGenerateFails(INVALID, "sampling.temperature", [1, 2], sample=True, temperature=0.0)
        self.assertGenerateFails(INVALID, "sampling.top_p", [1, 2], sample=True, top_p=1.5)
        self.assertGenerateFails(INVALID, "stop token id", [1, 2], stop_token_ids=[99999])

    def test_bad_forward(self):
        with self.assertRaises(grpc.RpcError) as ctx:
            self.client.forward([1, 2, 3], target_ids=[2, 3])
        self.assertEqual(ctx.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("target_ids", ctx.exception.details())
        with self.assertRaises(grpc.RpcError) as ctx:
            self.client.forward([1, 2, 3], logits_positions=[3])
        self.assertEqual(ctx.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("logits position", ctx.exception.details())
        with self.assertRaises(grpc.RpcError) as ctx:  # would otherwise run eagerly at any length
            self.client.forward(list(range(1, 900)) * 100)
        self.assertEqual(ctx.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("longest context", ctx.exception.details())

    def test_request_ids_cannot_forge_or_flood_log_lines(self):
        forged = "id-1\n2030-01-01T00:00:00.000Z E vlmgraph] forged line\r\x1b[2J"
        self.client.generate_all([1, 2, 3], max_new_tokens=1, request_id=forged)
        self.client.generate_all([1, 2, 3], max_new_tokens=1, request_id="y" * (1 << 20))
        lines = self.server.log().splitlines()
        self.assertFalse([line for line in lines if line.startswith("2030-01-01")])
        mentions = [line for line in lines if "forged line" in line]
        self.assertEqual(len(mentions), 1, mentions)
        self.assertIn("Generate id-1\\n2030-01-01T00:00:00.000Z E vlmgraph] forged line\\r\\x1b[2J from", mentions[0])
        self.assertIn("...(1048576 bytes) from", "\n".join(lines))
        self.assertLess(max(len(line) for line in lines), 4096)

    def wait_idle(self):
        self.server.wait_metric("vlmgraph_active_sequences", lambda v: v == 0)

    def test_cancelled_stream_frees_its_sequence(self):
        before = self.server.metric("vlmgraph_requests_total", rpc="Generate", code="CANCELLED")
        call = self.client.generate_stream(self.client.generate_request([1, 2, 3], max_new_tokens=LONG))
        first = next(iter(call))
        self.assertTrue(first.HasField("tokens"))
        call.cancel()
        with self.assertRaises(grpc.RpcError) as ctx:
            for _ in call:
                pass
        self.assertEqual(ctx.exception.code(), grpc.StatusCode.CANCELLED)
        self.server.wait_metric("vlmgraph_requests_total", lambda v: v == before + 1, rpc="Generate", code="CANCELLED")
        self.wait_idle()

    def test_deadline_exceeded(self):
        # 1 ms: no server finishes 500 tokens that fast (on an H100 the tiny model did in 50 ms).
        with self.assertRaises(grpc.RpcError) as ctx:
            self.client.generate_all([1, 2, 3], max_new_tokens=LONG, timeout=0.001)
        self.assertEqual(ctx.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.wait_idle()

    def run_client_until(self, script, marker):
        """Runs `script` (argv[1] = server address) in its own Python process until it prints
        `marker`, then kills it without closing its calls, as a client that disappears does."""
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.join(ROOT, "clients", "python")] + sys.path))
        proc = subprocess.Popen([sys.executable, "-c", script, self.server.address], stdout=subprocess.PIPE,
                                text=True, env=env)
        try:
            self.assertEqual(proc.stdout.readline().strip(), marker)
            proc.kill()
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()

    def test_client_that_vanishes_mid_stream(self):
        before = self.server.metric("vlmgraph_requests_total", rpc="Generate", code="CANCELLED")
        script = (
            "import sys, time\n"
            "from vlmgraph_client import VlmGraphClient\n"
            "c = VlmGraphClient(sys.argv[1])\n"
            f"call = c.generate_stream(c.generate_request([4, 5, 6], max_new_tokens={LONG}))\n"
            "next(iter(call))\n"
            "print('streaming', flush=True)\n"
            "time.sleep(60)\n")
        self.run_client_until(script, "streaming")
        self.server.wait_metric("vlmgraph_requests_total", lambda v: v >= before + 1, rpc="Generate", code="CANCELLED")
        self.wait_idle()

    def test_training_client_that_vanishes(self):
        before = self.server.metric("vlmgraph_requests_total", rpc="Train", code="CANCELLED")
        script = (
            "import queue, sys, time\n"
            "from vlmgraph_client import VlmGraphClient\n"
            "c = VlmGraphClient(sys.argv[1])\n"
            "t = c.pb.train_pb2\n"
            "def job():\n"
            "    yield t.TrainRequest(config=c.train_config(language_learning_rate=1e-9))\n"
            "    yield c.train_batch([{'input_ids': [1, 2, 3], 'target_ids': [2, 3, -100]}])\n"
            "    time.sleep(60)\n"
            "responses = c.stub.Train(job())\n"
            "next(responses)\n"
            "print('training', flush=True)\n"
            "time.sleep(60)\n")
        self.run_client_until(script, "training")
        self.server.wait_metric("vlmgraph_requests_total", lambda v: v == before + 1, rpc="Train", code="CANCELLED")
        # The job ended with its client: a new one is accepted.
        steps = list(self.client.train(self.client.train_config(language_learning_rate=1e-9),
                                       iter([self.client.train_batch([{"input_ids": [1, 2], "target_ids": [2, -100]}])])))
        self.assertEqual(len(steps), 1)

    def test_zz_other_requests_unaffected(self):
        # Runs last (alphabetical order): after every refusal and cancellation above.
        self.assertEqual(self.sampled(), self.baseline)
        self.assertGreater(self.server.metric("vlmgraph_requests_total", rpc="Generate", code="INVALID_ARGUMENT"), 0)


class QueueFullTest(unittest.TestCase):
    def test_full_queue_answers_resource_exhausted(self):
        # Requests wait up to 10 s to be batched, so two fill a queue of two.
        server = Server({"batching": {"max_queue_delay_us": 10000000, "max_queue_size": 2}}, name="queue").start()
        try:
            client = server.client()
            calls = [client.generate_stream(client.generate_request([1, 2, 3], max_new_tokens=4)) for _ in range(2)]
            readers = [threading.Thread(target=lambda c=c: list(_drain(c))) for c in calls]
            for r in readers:
                r.start()
            server.wait_metric("vlmgraph_queue_depth", lambda v: v == 2)
            with self.assertRaises(grpc.RpcError) as ctx:
                client.generate_all([1, 2, 3], max_new_tokens=4)
            self.assertEqual(ctx.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
            self.assertIn("batching.max_queue_size", ctx.exception.details())
            for c in calls:
                c.cancel()
            for r in readers:
                r.join(timeout=30)
            server.wait_metric("vlmgraph_queue_depth", lambda v: v == 0)
            client.close()
            self.assertEqual(server.stop(), 0)
        finally:
            server.cleanup()


def _drain(call):
    try:
        yield from call
    except grpc.RpcError:
        return


if __name__ == "__main__":
    unittest.main()
