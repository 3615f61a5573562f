"""End to end: streamed generation from a real photo equals the engine's direct output; concurrent
clients are batched together (visible in the batch-size metric); Forward agrees with Generate;
health and reflection answer."""
import threading
import unittest

import grpc

from e2e_util import CHELSEA, DEVICE, STEP_MODE, Server, chelsea, engine_generate
from vlmgraph_client import build_prompt, image_tiles

CONFIG = {
    # Requests wait up to 500 ms for company, so concurrent clients land in one prefill batch.
    "batching": {"max_queue_delay_us": 500000},
}


class GenerateTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.image = chelsea()
        cls.server = Server(CONFIG, name="generate").start()
        cls.client = cls.server.client()
        cls.info = cls.client.model_info()

    @classmethod
    def tearDownClass(cls):
        cls.server.finish(cls.client)

    def prompt(self, text_ids=(11, 12, 13)):
        return build_prompt(self.info, [image_tiles(self.image, self.info)], text_ids)

    def test_model_info_describes_the_tiny_model(self):
        i = self.info
        self.assertEqual(i.model, "nanovlm-tiny")
        self.assertEqual(i.device, DEVICE)
        self.assertEqual(i.vocab_size, 1066)
        self.assertEqual(i.image_token_id, 1000)
        self.assertEqual(i.mp_image_token_length, 4)
        self.assertEqual(i.vit_img_size, 64)
        self.assertEqual(list(i.batch_sizes), [1, 2, 4, 8])
        self.assertGreaterEqual(i.max_context, 256)
        self.assertEqual(image_tiles(self.image, i), 13)  # 451x300 -> 256x192 = 4x3 tiles + global

    def test_stream_equals_engine_output(self):
        # Sampled (seeded): with random weights greedy decoding mostly repeats the last prompt token,
        # while samples depend on every logit, so equality here checks the whole path.
        ids = self.prompt()
        params = dict(sample=True, temperature=1.0, seed=42)
        msgs = list(self.client.generate_stream(
            self.client.generate_request(ids, [self.image], max_new_tokens=40, **params)))
        kinds = [m.WhichOneof("kind") for m in msgs]
        self.assertEqual(kinds[-1], "summary")
        self.assertNotIn("summary", kinds[:-1])
        self.assertGreaterEqual(kinds.count("tokens"), 2, "tokens should arrive in several messages")
        streamed = [t for m in msgs[:-1] for t in m.tokens.token_ids]
        self.assertGreater(len(set(streamed)), 5)
        direct = engine_generate(self.server.config_path, ids, [CHELSEA], max_new_tokens=40, **params)
        self.assertEqual(direct["image_tiles"], 13)
        self.assertEqual(streamed, direct["tokens"])
        s = msgs[-1].summary
        self.assertEqual(s.generated_tokens, 40)
        self.assertEqual(s.prompt_tokens, len(ids))
        self.assertEqual(s.image_tiles, 13)
        self.assertEqual(self.client.pb.generate_pb2.FinishReason.Name(s.finish_reason), "FINISH_REASON_LENGTH")
        self.assertLessEqual(s.queue_seconds, s.time_to_first_token_seconds)
        self.assertLessEqual(s.time_to_first_token_seconds, s.total_seconds)

    def test_greedy_and_filtered_sampling_equal_engine_output(self):
        ids = self.prompt((5, 6))
        greedy, _ = self.client.generate_all(ids, [self.image], max_new_tokens=12)
        self.assertEqual(greedy, engine_generate(self.server.config_path, ids, [CHELSEA], max_new_tokens=12)["tokens"])
        params = dict(sample=True, temperature=0.9, top_k=40, top_p=0.95, seed=1234)
        a, _ = self.client.generate_all(ids, [self.image], max_new_tokens=24, **params)
        b, _ = self.client.generate_all(ids, [self.image], max_new_tokens=24, **params)
        self.assertEqual(a, b)
        direct = engine_generate(self.server.config_path, ids, [CHELSEA], max_new_tokens=24, **params)
        self.assertEqual(a, direct["tokens"])
        c, _ = self.client.generate_all(ids, [self.image], max_new_tokens=24, **dict(params, seed=1235))
        self.assertNotEqual(a, c)

    def test_stop_token_ends_the_stream(self):
        ids = self.prompt()
        tokens, _ = self.client.generate_all(ids, [self.image], max_new_tokens=20)
        stop = tokens[2]
        first = tokens.index(stop)
        cut, summary = self.client.generate_all(ids, [self.image], max_new_tokens=20, stop_token_ids=[stop])
        self.assertEqual(cut, tokens[:first + 1])
        self.assertEqual(self.client.pb.generate_pb2.FinishReason.Name(summary.finish_reason),
                         "FINISH_REASON_STOP_TOKEN")

    def test_concurrent_clients_are_batched(self):
        prompts = [self.prompt((20 + i, 30 + i)) for i in range(6)]
        # Seeded sampling: each request's tokens depend on its own logits and seed only, so they must
        # not change when it shares batches with others.
        params = [dict(sample=True, seed=100 + i) for i in range(6)]
        alone = [self.client.generate_all(p, [self.image], max_new_tokens=8, **params[i])[0]
                 for i, p in enumerate(prompts)]
        before = self.server.metrics_text()
        results = [None] * len(prompts)
        errors = []
        barrier = threading.Barrier(len(prompts))

        def run(i):
            try:
                with self.server.client() as c:
                    c.wait_ready(timeout=30)  # connected before the race starts
                    barrier.wait(timeout=30)
                    results[i] = c.generate_all(prompts[i], [self.image], max_new_tokens=8, **params[i])[0]
            except Exception as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        self.assertEqual(errors, [])
        self.assertEqual(results, alone)
        after = self.server.metrics_text()
        from e2e_util import sum_samples as s
        prefill_steps = s(after, "vlmgraph_batch_size_count", region="prefill") - \
            s(before, "vlmgraph_batch_size_count", region="prefill")
        prefill_seqs = s(after, "vlmgraph_batch_size_sum", region="prefill") - \
            s(before, "vlmgraph_batch_size_sum", region="prefill")
        self.assertEqual(prefill_seqs, 6)
        self.assertLess(prefill_steps, 6, "six concurrent requests should share prefill batches")
        decode_batched = (s(after, "vlmgraph_batch_size_count", region="decode")
                          - s(after, "vlmgraph_batch_size_bucket", region="decode", le="1")) - \
                         (s(before, "vlmgraph_batch_size_count", region="decode")
                          - s(before, "vlmgraph_batch_size_bucket", region="decode", le="1"))
        self.assertGreater(decode_batched, 0, "some decode steps should carry several sequences")

    def test_forward_agrees_with_generate(self):
        ids = self.prompt((7, 8, 9))
        tokens, _ = self.client.generate_all(ids, [self.image], max_new_tokens=1)
        r = self.client.forward(ids, [self.image], target_ids=[-100] * (len(ids) - 1) + [tokens[0]],
                                logits_positions=[len(ids) - 1])
        self.assertEqual(len(r.logits), 1)
        row = list(r.logits[0].logits)
        self.assertEqual(len(row), self.info.vocab_size)
        self.assertEqual(row.index(max(row)), tokens[0])  # greedy = argmax of the last logits
        self.assertEqual(r.loss_tokens, 1)
        self.assertGreater(r.loss, 0)
        self.assertTrue(r.bucket.startswith("b1xs"), r.bucket)

    def test_logprobs_stream_with_the_tokens(self):
        # The client's logprobs switches reach the server and come back: one TokenLogprob per new
        # token (the greedy token first in its top list), the prompt's once, before the tokens.
        ids = self.prompt((7, 8, 9))
        events = list(self.client.generate(ids, [self.image], max_new_tokens=3, logprobs=True, top_logprobs=2,
                                           prompt_logprobs=True))
        kinds = [k for k, _ in events]
        self.assertEqual(kinds[0], "prompt_logprobs")
        prompt = events[0][1]
        self.assertEqual(len(prompt), len(ids) - 1)
        tokens = [t for k, v in events if k == "tokens" for t in v]
        logprobs = [l for k, v in events if k == "logprobs" for l in v]
        self.assertEqual(len(tokens), 3)
        self.assertEqual(len(logprobs), 3)
        for token, l in zip(tokens, logprobs):
            self.assertEqual(len(l.top), 2)
            self.assertEqual(l.top[0].token_id, token)
            self.assertAlmostEqual(l.top[0].logprob, l.logprob, places=5)
            self.assertLessEqual(l.logprob, 0)
        # Without the switches, none: the stream is as before.
        plain = [k for k, _ in self.client.generate(ids, [self.image], max_new_tokens=3)]
        self.assertNotIn("logprobs", plain)
        self.assertNotIn("prompt_logprobs", plain)

    def test_health_and_reflection(self):
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        with grpc.insecure_channel(self.server.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for service in ("", "vlmgraph.v1.VlmGraph"):
                r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                self.assertEqual(r.status, health_pb2.HealthCheckResponse.SERVING)
            try:
                from grpc_reflection.v1alpha.proto_reflection_descriptor_database import \
                    ProtoReflectionDescriptorDatabase
            except ImportError:
                self.skipTest("grpcio-reflection not installed")
            services = ProtoReflectionDescriptorDatabase(ch).get_services()
            self.assertIn("vlmgraph.v1.VlmGraph", services)
            self.assertIn("grpc.health.v1.Health", services)

    def test_request_metrics_count_rpcs(self):
        before = self.server.metric("vlmgraph_requests_total", rpc="Forward", code="OK")
        self.client.forward([1, 2, 3], target_ids=[2, 3, -100])
        self.server.wait_metric("vlmgraph_requests_total", lambda v: v == before + 1, rpc="Forward", code="OK")
        text = self.server.metrics_text()
        self.assertIn("vlmgraph_time_to_first_token_seconds_count", text)
        self.assertIn('vlmgraph_step_latency_seconds_count{bucket="t17",gpu="0",mode="%s",region="vision"}' % STEP_MODE, text)


if __name__ == "__main__":
    unittest.main()
