#!/usr/bin/env python3
"""Tests for scripts/check_file_lengths.py on fake trees: a source over 700 lines or a test over
1,200 fails, a file at its limit passes, fixtures are not counted. CTest runs this as
`file_length_check_selftest`.

  tests/layering/test_check_file_lengths.py
"""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(HERE)), "scripts")
CHECKER = os.path.join(SCRIPTS, "check_file_lengths.py")


class CheckFileLengthsTest(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="lengths-")
        self.addCleanup(shutil.rmtree, self.root)

    def write(self, rel, lines):
        path = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write("// line\n" * lines)

    def check(self):
        proc = subprocess.run([sys.executable, CHECKER, "--root", self.root], capture_output=True, text=True)
        return proc.returncode, proc.stdout

    def test_files_at_their_limits_pass(self):
        self.write("engine/bucket.cc", 700)
        self.write("tests/bucket_test.cc", 1200)
        self.write("tests/fixtures/big.py", 5000)  # data, not counted
        rc, out = self.check()
        self.assertEqual(rc, 0, out)
        self.assertIn("2 files, none over its limit", out)

    def test_files_over_their_limits_fail(self):
        self.write("server/core/generation.cc", 701)
        self.write("scripts/tool.py", 900)
        self.write("tests/bucket_test.cc", 1201)
        rc, out = self.check()
        self.assertEqual(rc, 1, out)
        self.assertEqual(sorted(out.splitlines()), [
            "scripts/tool.py: 900 lines (limit 700)",
            "server/core/generation.cc: 701 lines (limit 700)",
            "tests/bucket_test.cc: 1201 lines (limit 1200)"])


if __name__ == "__main__":
    unittest.main()
