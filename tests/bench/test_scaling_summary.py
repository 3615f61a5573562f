"""bench/scaling_summary.py on hand-made result files of `gpu-check.sh dpscale`: training scaling
against the mean of the two 1-GPU runs, the upstream ratio, serving scaling summed over the gRPC
loaders with the worst TTFT p99, the fixed-threads row, and the exit status on load errors."""
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import scaling_summary  # noqa: E402


def write(d, name, text):
    with open(os.path.join(d, name), "w") as f:
        f.write(text)


def train(d, name, step_ms, tps):
    write(d, name + ".json", json.dumps({"graph": {"median_step_ms": step_ms, "step_ms_spread": 0.01,
                                                   "tokens_per_second_per_gpu": tps}}))


def grpc(d, name, i, tps, ttft, errors=0):
    write(d, f"{name}_grpc_{i}.json", "warming up\n" + json.dumps(
        {"api": "grpc", "tok_per_s": tps, "requests": 10, "errors": errors, "ttft_p99_ms": ttft}) + "\n")


def http(d, name, tps, ttft):
    write(d, f"{name}_http.json", "noise\n" + json.dumps({"tok_per_s": tps, "errors": 0, "ttft_p99_ms": ttft}) + "\n")


class ScalingSummaryTest(unittest.TestCase):
    def files(self, d, errors=0):
        train(d, "scale_train_w1a", 80.0, 100.0)
        train(d, "scale_train_w1b", 80.0, 102.0)
        train(d, "scale_train_w2", 82.0, 99.0)
        train(d, "scale_train_w4", 83.0, 96.0)
        write(d, "scale_upstream.log", "RESULT " + json.dumps({"step_ms_w1": 160, "tok_per_s_per_gpu_w1": 50.0}) + "\n"
              + "RESULT " + json.dumps({"step_ms_w1": 160, "tok_per_s_per_gpu_w1": 50.0, "step_ms_w4": 190,
                                        "tok_per_s_per_gpu_w4": 40.0}) + "\n")
        write(d, "scale_overlap_w4.json", json.dumps({"step_span_ms": 83.0, "compute_busy_fraction": 0.95,
                                                      "all_reduce_busy_ms": 12.0, "all_reduce_exposed_ms": 0.5}) + "\n")
        grpc(d, "scale_w1", 1, 130.0, 40.0)
        http(d, "scale_w1", 128.0, 30.0)
        for i, t in enumerate([126.0, 124.0, 125.0, 121.0], 1):
            grpc(d, "scale_w4", i, t, 40.0 + i, errors=errors if i == 2 else 0)
        http(d, "scale_w4", 480.0, 36.0)
        write(d, "scale_w4_threads.json", json.dumps({"total_cores": 9.5, "threads_above_90_percent": 1}) + "\n")
        grpc(d, "scale_w4_fixed", 1, 230.0, 90.0)
        grpc(d, "scale_w4_fixed", 2, 230.0, 95.0)
        http(d, "scale_w4_fixed", 400.0, 80.0)

    def test_figures(self):
        with tempfile.TemporaryDirectory() as d:
            self.files(d)
            s = scaling_summary.summarize(d)
            self.assertAlmostEqual(s["training_baseline"]["tokens_per_second_per_gpu"], 101.0)
            by_w = {r["gpus"]: r for r in s["training"]}
            self.assertEqual(sorted(by_w), [1, 2, 4])
            self.assertAlmostEqual(by_w[4]["scaling"], 96.0 / 101.0)
            self.assertAlmostEqual(by_w[4]["vs_upstream"], 96.0 / 40.0)
            self.assertAlmostEqual(by_w[1]["vs_upstream"], 101.0 / 50.0)
            self.assertNotIn("vs_upstream", by_w[2])  # upstream ran no 2-GPU row here
            serving = {r["gpus"]: r for r in s["serving"]}
            self.assertEqual(serving[4]["grpc"]["loaders"], 4)
            self.assertAlmostEqual(serving[4]["grpc"]["tok_per_s"], 496.0)
            self.assertAlmostEqual(serving[4]["grpc"]["scaling"], 496.0 / 130.0)
            self.assertAlmostEqual(serving[4]["grpc"]["ttft_p99_vs_1gpu"], 44.0 / 40.0)
            self.assertAlmostEqual(serving[4]["http"]["scaling"], 480.0 / 128.0)
            self.assertAlmostEqual(s["fixed_threads"]["grpc"]["scaling"], 460.0 / 130.0)
            self.assertEqual(s["overlap"]["all_reduce_exposed_ms"], 0.5)
            table = scaling_summary.render(s)
            self.assertIn("| 4 | 83.00 ms | 1.0% | 96 | 95.0% (target 94%) | 40 (190.00 ms) | 2.40x |", table)
            self.assertIn("3.82x (target 3.8x)", table)
            self.assertIn("4, fronts' threads fixed at 2", table)

    def test_exit_status(self):
        with tempfile.TemporaryDirectory() as d:
            self.files(d)
            sys.argv = ["scaling_summary.py", d]
            self.assertEqual(scaling_summary.main(), 0)
            self.assertTrue(os.path.exists(os.path.join(d, "scale_summary.json")))
        with tempfile.TemporaryDirectory() as d:
            self.files(d, errors=3)
            sys.argv = ["scaling_summary.py", d]
            self.assertEqual(scaling_summary.main(), 1)
        with tempfile.TemporaryDirectory() as d:
            sys.argv = ["scaling_summary.py", d]
            self.assertEqual(scaling_summary.main(), 2)


if __name__ == "__main__":
    unittest.main()
