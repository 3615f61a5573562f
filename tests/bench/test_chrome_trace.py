"""bench/chrome_trace.py: a trace as torch.profiler writes it ({"traceEvents": [...]}), a bare
event list, and either gzipped, give the same events; the scripts that use it read a gzipped
trace as they read a plain one."""
import gzip
import json
import os
import subprocess
import sys
import tempfile
import unittest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
sys.path.insert(0, BENCH)
import chrome_trace  # noqa: E402

EVENTS = [
    {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 10, "pid": 0, "tid": 7},
    {"ph": "X", "cat": "kernel", "name": "ncclAllReduce", "ts": 5, "dur": 10, "pid": 0, "tid": 8},
    {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 20, "dur": 10, "pid": 0, "tid": 7},
]


class ChromeTraceTest(unittest.TestCase):
    def test_every_layout_gives_the_events(self):
        with tempfile.TemporaryDirectory() as d:
            paths = []
            for name, data in (("dict.json", {"traceEvents": EVENTS}), ("list.json", EVENTS)):
                for gz in (False, True):
                    path = os.path.join(d, name + (".gz" if gz else ""))
                    with (gzip.open(path, "wt") if gz else open(path, "w")) as f:
                        json.dump(data, f)
                    paths.append(path)
            for path in paths:
                self.assertEqual(chrome_trace.load_events(path), EVENTS, path)

    def test_a_script_reads_a_gzipped_trace(self):
        with tempfile.TemporaryDirectory() as d:
            plain, packed = os.path.join(d, "t.json"), os.path.join(d, "t.json.gz")
            with open(plain, "w") as f:
                json.dump({"traceEvents": EVENTS}, f)
            with gzip.open(packed, "wt") as f:
                json.dump({"traceEvents": EVENTS}, f)
            out = [subprocess.run([sys.executable, os.path.join(BENCH, "allreduce_overlap.py"), p, "--steps", "1",
                                   "--json"], capture_output=True, text=True, check=True).stdout for p in (plain, packed)]
            self.assertEqual(out[0], out[1])
            r = json.loads(out[0])
            self.assertAlmostEqual(r["all_reduce_busy_ms"], 0.010)
            self.assertAlmostEqual(r["all_reduce_overlapped_ms"], 0.005)


if __name__ == "__main__":
    unittest.main()
