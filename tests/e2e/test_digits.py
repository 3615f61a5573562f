"""End to end: a real-data training job. The handwritten digits of Debian's python3-sklearn stream
through the Train RPC as image + question -> answer examples; held-out accuracy, measured through
Forward (and Generate on a sample), must end far above chance (10%)."""
import json
import os
import subprocess
import sys
import unittest

from e2e_util import ROOT, Server, require, scratch_dir

DIGITS_CSV = os.environ.get("VLMGRAPH_DIGITS_CSV",
                            "/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz")
SCRIPT = os.path.join(ROOT, "clients", "python", "examples", "train_digits.py")


class DigitsTest(unittest.TestCase):
    def test_digits_accuracy_far_above_chance(self):
        require(os.path.isfile(DIGITS_CSV), "digits.csv.gz (Debian package python3-sklearn)")
        out = scratch_dir("digits")
        server = Server(name="digits").start()
        try:
            proc = subprocess.run([sys.executable, SCRIPT, "--address", server.address, "--steps", "150",
                                   "--out", out, "--min-accuracy", "0.6", "--digits", DIGITS_CSV], capture_output=True, text=True, timeout=600)
            self.assertEqual(proc.returncode, 0, f"train_digits failed:\n{proc.stdout}\n{proc.stderr}")
        finally:
            self.assertEqual(server.stop(), 0)
            server.cleanup()
        with open(os.path.join(out, "digits.json")) as fh:
            report = json.load(fh)
        self.assertEqual(report["steps"], 150)
        self.assertLess(report["last_loss"], report["first_loss"] / 4)
        self.assertGreaterEqual(report["accuracy_after"], 0.6)
        self.assertLessEqual(report["accuracy_before"], 0.2)
        self.assertEqual(report["generate_agrees_with_forward"], "20/20")
        self.assertTrue(os.path.getsize(os.path.join(out, "digits.png")) > 1000)


if __name__ == "__main__":
    unittest.main()
