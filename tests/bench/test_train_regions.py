"""bench/train_regions.py on a hand-made trace: forward kernels go to the profiler range around
their launch, backward kernels to their autograd node's region by sequence number (a custom
function's node, which no forward op numbers, to the region of the nearest lower number), the
optimizer to its range, the rest to "other"."""
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import train_regions  # noqa: E402


def op(name, ts, dur, tid, cat="cpu_op", **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def launch(ts, tid, corr, driver=False):
    if driver:  # cuBLASLt's kernels
        return op("cuLaunchKernelEx", ts, 1, tid, cat="cuda_driver", correlation=corr)
    return op("cudaLaunchKernel", ts, 1, tid, cat="cuda_runtime", correlation=corr)


def kernel(corr, ts, dur):
    return op(f"k{corr}", ts, dur, 99, cat="kernel", correlation=corr)


def trace():
    fwd, bwd = 1, 2
    return [
        op("vlmgraph::vision_encoder", 0, 100, fwd, cat="user_annotation"),
        op("aten::mm", 10, 10, fwd, **{"Sequence number": 0}),
        launch(12, fwd, 1), kernel(1, 1000, 5),
        op("vlmgraph::decoder", 100, 100, fwd, cat="user_annotation"),
        op("aten::mm", 110, 10, fwd, **{"Sequence number": 1}),
        launch(112, fwd, 2), kernel(2, 1010, 7),
        launch(115, fwd, 8, driver=True), kernel(8, 1015, 19),
        op("autograd::engine::evaluate_function: MmBackward0", 300, 20, bwd, **{"Sequence number": 1}),
        launch(305, bwd, 3), kernel(3, 1020, 11),
        launch(310, bwd, 9, driver=True), kernel(9, 1035, 23),
        op("autograd::engine::evaluate_function: MmBackward0", 330, 10, bwd, **{"Sequence number": 0}),
        launch(335, bwd, 4), kernel(4, 1040, 13),
        op("autograd::engine::evaluate_function: CustomBackward", 350, 10, bwd, **{"Sequence number": 5}),
        launch(355, bwd, 5), kernel(5, 1060, 17),
        op("vlmgraph::optimizer", 400, 50, fwd, cat="user_annotation"),
        launch(410, fwd, 6), kernel(6, 1080, 3),
        launch(500, fwd, 7), kernel(7, 1090, 2),
    ]


class TrainRegionsTest(unittest.TestCase):
    def test_every_kernel_lands_in_its_region(self):
        out = train_regions.split(trace(), steps=1)
        want = {"vision_encoder forward": 5, "decoder forward": 7 + 19, "decoder backward": 11 + 23 + 17,
                "vision_encoder backward": 13, "optimizer": 3, "other": 2}
        self.assertEqual({r: round(ms * 1e3) for r, ms in out["regions_ms"].items()}, want)
        self.assertAlmostEqual(out["device_busy_ms"], sum(want.values()) / 1e3)

    def test_a_trace_without_ranges_is_refused(self):
        events = [e for e in trace() if not e["name"].startswith("vlmgraph::")]
        with self.assertRaises(SystemExit):
            train_regions.split(events, steps=1)


if __name__ == "__main__":
    unittest.main()
