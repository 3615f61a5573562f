#!/usr/bin/env python3
"""Runs parity suites for CTest: `run.py test_transformers_parity`. Exit status 0 when it passed,
1 when a test failed, 77 (CTest: skipped) when every test was skipped (a package or the model is
missing outside CI, see tests/e2e/e2e_util.require)."""
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))


def main(names):
    suite = unittest.defaultTestLoader.loadTestsFromNames(names)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    if not result.wasSuccessful():
        return 1
    if result.testsRun > 0 and len(result.skipped) == result.testsRun:
        return 77
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
