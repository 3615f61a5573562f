"""End to end: one vlmgraph-server with two engines (`--data-parallel-size 2`, two CPU engines of the
tiny preset) behind its one gRPC and HTTP front.

Concurrent Generate calls spread over both engines and give the tokens one engine gives alone;
/metrics labels each engine's series with gpu="0" / gpu="1"; /health lists both engines with their
load; GetModelInfo and Forward answer; a Train job trains on both engines (each on half of every
batch, server/train/train_ranks.h) and its publish is served by both, then rolled back on both; SIGTERM
drains both. (An engine whose GPU fails, and a training rank that fails, are tested in process with
injected faults: tests/server_data_parallel_test.cc, tests/server_train_data_parallel_test.cc.)"""
import concurrent.futures
import json
import unittest
import urllib.request

from e2e_util import Server


class DataParallelTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server({"model": "nanovlm-tiny", "device": "cpu"},
                            args=["--data-parallel-size", "2"], name="data_parallel").start()
        cls.client = cls.server.client()

    @classmethod
    def tearDownClass(cls):
        cls.server.finish(cls.client)

    def health(self):
        with urllib.request.urlopen(f"http://{self.server.http_address}/health", timeout=10) as r:
            return r.status, json.loads(r.read())

    def test_health_lists_both_engines(self):
        status, body = self.health()
        self.assertEqual(status, 200)
        self.assertEqual(body["status"], "serving")
        self.assertEqual([e["gpu"] for e in body["engines"]], ["0", "1"])
        for e in body["engines"]:
            self.assertEqual(e["device"], "cpu")
            self.assertTrue(e["healthy"])
            self.assertIn("running", e)
            self.assertIn("waiting", e)

    def test_requests_spread_over_both_engines(self):
        ids = [5, 17, 29, 41, 53, 65, 77, 89]
        alone, _ = self.client.generate_all(ids, max_new_tokens=48)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: self.client.generate_all(ids, max_new_tokens=48)[0],
                                    range(8)))
        # Both engines hold the same weights: every request gets the same greedy tokens.
        for tokens in results:
            self.assertEqual(tokens, alone)
        for gpu in ("0", "1"):
            self.assertGreater(self.server.metric("vlmgraph_batch_size_count", gpu=gpu, region="decode"),
                               0, f"engine gpu={gpu} decoded nothing")
            self.assertEqual(self.server.metric("vlmgraph_engine_healthy", gpu=gpu), 1)
        self.assertGreater(self.client.forward(ids, target_ids=ids[1:] + [0]).loss_tokens, 0)

    def test_train_job_runs_on_both_engines_and_both_serve_its_publish(self):
        ids = [5, 17, 29, 41, 53, 65, 77, 89]

        def logits():
            # Ties between idle engines go round robin: consecutive calls alternate between them.
            return [list(self.client.forward(ids, logits_positions=[7]).logits[0].logits)
                    for _ in range(4)]

        before = logits()
        self.assertTrue(all(row == before[0] for row in before))
        train_steps = [self.server.metric("vlmgraph_step_latency_seconds_count", gpu=gpu, region="train")
                       for gpu in ("0", "1")]
        examples = [{"input_ids": [(r * 31 + i * 7) % 200 for i in range(6 + 3 * r)]} for r in range(4)]
        for e in examples:
            e["target_ids"] = e["input_ids"][1:] + [-100]
        cfg = self.client.train_config(language_learning_rate=1e-2, trainable_parts=["language"])
        requests = [self.client.train_batch(examples) for _ in range(5)] + [self.client.train_publish()]
        responses = list(self.client.train(cfg, iter(requests)))
        steps = [r.step for r in responses if r.HasField("step")]
        self.assertEqual([s.step for s in steps], [1, 2, 3, 4, 5])
        # The whole batch's targets, over both engines.
        self.assertEqual({s.loss_tokens for s in steps}, {sum(len(e["input_ids"]) - 1 for e in examples)})
        self.assertLess(steps[-1].loss, steps[0].loss)
        self.assertEqual(sum(r.HasField("published") for r in responses), 1)
        for k, gpu in enumerate(("0", "1")):
            self.assertEqual(self.server.metric("vlmgraph_step_latency_seconds_count", gpu=gpu, region="train"),
                             train_steps[k] + 5, f"engine gpu={gpu} did not train")

        after = logits()
        for row in after:  # both engines serve the published weights
            self.assertEqual(len(row), len(before[0]))
            self.assertLess(max(abs(a - b) for a, b in zip(row, after[0])), 1e-5)
        self.assertGreater(max(abs(a - b) for a, b in zip(after[0], before[0])), 1e-3)
        self.client.rollback_weights()
        self.assertEqual(logits(), before)  # both engines back to the weights before, bit for bit


if __name__ == "__main__":
    unittest.main()
