"""End to end on a GPU (VLMGRAPH_E2E_DEVICE=cuda; skipped otherwise): the server captures every
bucket at start-up, then serves a mix of request shapes (text only, one raw tile, a photo of many
tiles, 1 to 12 concurrent streams, greedy and sampled, short and long generations) with graph
replays only: vlmgraph_graph_captures_total does not move after warm-up and nothing falls back to
eager. Prints the figures it saw (captures, capture time, time to first token) for the docs.

VLMGRAPH_E2E_GPU_CONFIG=path.yaml runs the same traffic against a deployment config (for example
deploy/config.yaml on nanovlm-460m) instead of the tiny model; its addresses are overridden.
"""
import os
import random
import statistics
import threading
import time
import unittest

from e2e_util import DEVICE, Server, chelsea, sum_samples
from vlmgraph_client import build_prompt, image_tiles, tensor_image

GPU_CONFIG = os.environ.get("VLMGRAPH_E2E_GPU_CONFIG")


@unittest.skipIf(DEVICE == "cpu", "needs a GPU: set VLMGRAPH_E2E_DEVICE=cuda")
class CudaGraphServingTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if GPU_CONFIG:
            cls.server = Server(config_file=GPU_CONFIG, name="gpu").start(timeout=600)
        else:
            cls.server = Server({"batching": {"max_queue_delay_us": 2000}}, name="gpu").start(timeout=300)
        cls.client = cls.server.client()
        cls.info = cls.client.model_info()
        cls.photo = chelsea()

    @classmethod
    def tearDownClass(cls):
        cls.server.finish(cls.client)

    def requests(self, rng, n):
        """n requests of mixed shapes that all fit the configured buckets."""
        info = self.info
        s = info.vit_img_size
        photo_tiles = image_tiles(self.photo, info)
        largest_prompt = max(info.seq_lens)
        out = []
        for i in range(n):
            kind = i % 3
            text = [rng.randrange(3, min(info.vocab_size, 900)) for _ in range(rng.randrange(1, 40))]
            if kind == 0:  # text only
                images, tiles = [], []
            elif kind == 1:  # one raw tile
                images = [tensor_image([1, 3, s, s], [rng.random() for _ in range(3 * s * s)])]
                tiles = [1]
            else:  # the photo, as many tiles as the model's image processor makes of it
                images, tiles = [self.photo], [photo_tiles]
            ids = build_prompt(info, tiles, text)
            if len(ids) > largest_prompt:
                ids, images = text, []
            params = dict(max_new_tokens=rng.choice([1, 3, 9, 17, 40]))
            if rng.random() < 0.5:
                params.update(sample=True, temperature=0.8, top_k=rng.choice([0, 20]), seed=i)
            out.append((ids, images, params))
        return out

    def run_concurrently(self, reqs):
        results, errors = [None] * len(reqs), []

        def run(i):
            ids, images, params = reqs[i]
            try:
                with self.server.client(timeout=120) as c:
                    results[i] = c.generate_all(ids, images, **params)
            except Exception as e:  # reported by the caller
                errors.append(f"request {i}: {e!r}")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        self.assertFalse(any(t.is_alive() for t in threads), "a stream did not finish in 300 s")
        self.assertEqual(errors, [])
        for (ids, _, params), (tokens, summary) in zip(reqs, results):
            self.assertEqual(len(tokens), params["max_new_tokens"])
            self.assertEqual(summary.generated_tokens, params["max_new_tokens"])
        return results

    def test_mixed_shapes_replay_without_new_captures(self):
        m0 = self.server.metrics_text()
        captures = sum_samples(m0, "vlmgraph_graph_captures_total")
        self.assertGreater(captures, 0, "start-up should have captured every bucket")
        rng = random.Random(7)
        ttft = []
        t0 = time.time()
        waves = [1, 2, 3, 5, 8, 12, 4, 12, 1, 7]
        for n in waves:
            for tokens, summary in self.run_concurrently(self.requests(rng, n)):
                ttft.append(summary.time_to_first_token_seconds)
        elapsed = time.time() - t0
        m1 = self.server.metrics_text()
        self.assertEqual(sum_samples(m1, "vlmgraph_graph_captures_total"), captures,
                         "mixed shapes after warm-up must not capture new graphs")
        self.assertEqual(sum_samples(m1, "vlmgraph_eager_fallbacks_total"), 0)
        for region in ("vision", "prefill", "decode"):
            replays = (sum_samples(m1, "vlmgraph_graph_replays_total", region=region)
                       - sum_samples(m0, "vlmgraph_graph_replays_total", region=region))
            eager = (sum_samples(m1, "vlmgraph_eager_runs_total", region=region)
                     - sum_samples(m0, "vlmgraph_eager_runs_total", region=region))
            self.assertGreater(replays, 0, region)
            self.assertEqual(eager, 0, region)
        batched = (sum_samples(m1, "vlmgraph_batch_size_count", region="decode")
                   - sum_samples(m1, "vlmgraph_batch_size_bucket", region="decode", le="1"))
        self.assertGreater(batched, 0, "concurrent streams should share decode steps")
        print(f"\n[gpu-e2e] model {self.info.model} dtype {self.info.dtype} device {self.info.device}: "
              f"{int(captures)} graphs captured at start-up in "
              f"{sum_samples(m0, 'vlmgraph_capture_seconds_total'):.2f} s, graph pool "
              f"{sum_samples(m0, 'vlmgraph_graph_pool_bytes') / 2**30:.2f} GiB; {len(ttft)} requests in "
              f"{len(waves)} waves of 1-12 streams, {elapsed:.1f} s; captures after warm-up "
              f"{int(sum_samples(m1, 'vlmgraph_graph_captures_total') - captures)}; time to first token "
              f"median {statistics.median(ttft) * 1e3:.1f} ms, max {max(ttft) * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    unittest.main()
