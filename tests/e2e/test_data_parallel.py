"""End to end: one vlmgraph-server with two engines (`--data-parallel-size 2`, two CPU engines of the
tiny preset) behind its one gRPC and HTTP front.

Concurrent Generate calls spread over both engines and give the tokens one engine gives alone;
/metrics labels each engine's series with gpu="0" / gpu="1"; /health lists both engines with their
load; GetModelInfo and Forward answer; SIGTERM drains both. (An engine whose GPU fails is tested in
process with an injected fault: tests/server_data_parallel_test.cc.)"""
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


if __name__ == "__main__":
    unittest.main()
