#!/usr/bin/env python3
"""Tests for scripts/check_layering.py: it passes includes that go down a layer and fails one that goes up.

Each case writes a tiny fake repository (model/, engine/, server/, tests/) into a temporary
folder and runs the checker on it with --root. CTest runs this as `layering_check_selftest`.

  tests/layering/test_check_layering.py
"""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKER = os.path.join(os.path.dirname(os.path.dirname(HERE)), "scripts", "check_layering.py")


class CheckLayeringTest(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="layering-")
        self.addCleanup(shutil.rmtree, self.root)
        # Allowed: engine includes model, server includes engine, tests include server.
        self.write("model/tensor.h", "#pragma once\n")
        self.write("engine/bucket.h", '#pragma once\n#include "model/tensor.h"\n#include <vector>\n')
        self.write("server/config.h", '#pragma once\n#include "engine/bucket.h"\n')
        self.write("tests/config_test.cc", '#include "server/config.h"\n#include "model/tensor.h"\n')

    def write(self, rel, text):
        path = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)

    def check(self):
        proc = subprocess.run([sys.executable, CHECKER, "--root", self.root], capture_output=True, text=True)
        return proc.returncode, proc.stdout

    def test_includes_down_the_layers_pass(self):
        rc, out = self.check()
        self.assertEqual(rc, 0, out)
        self.assertIn("4 files, 4 project includes, none goes up a layer", out)

    def test_include_up_a_layer_fails_with_file_line_and_layers(self):
        self.write("model/layers.cc", '#include "model/tensor.h"\n\n#include "engine/bucket.h"\n')
        rc, out = self.check()
        self.assertEqual(rc, 1, out)
        self.assertEqual(out.splitlines(),
                         ["model/layers.cc:3: model/layers.cc (layer model) includes engine/bucket.h (layer engine)"])

    def test_cuda_subfolder_is_its_parent_layer(self):
        self.write("model/cuda/gemv.cu", '#include "model/tensor.h"\n')
        self.assertEqual(self.check()[0], 0)
        self.write("engine/cuda/runner.cc", '#include "server/config.h"\n')
        rc, out = self.check()
        self.assertEqual(rc, 1, out)
        self.assertIn("engine/cuda/runner.cc:1: engine/cuda/runner.cc (layer engine) includes server/config.h "
                      "(layer server)", out)

    def test_library_layer_must_not_include_tests(self):
        self.write("tests/test_util.h", "#pragma once\n")
        self.write("server/scheduler.cc", '#include "tests/test_util.h"\n')
        rc, out = self.check()
        self.assertEqual(rc, 1, out)
        self.assertIn("(layer server) includes tests/test_util.h (layer tests)", out)

    def test_relative_include_is_resolved(self):
        self.write("model/cuda/kernel.cuh", '#include "../../server/config.h"\n')
        rc, out = self.check()
        self.assertEqual(rc, 1, out)
        self.assertIn("model/cuda/kernel.cuh:1: model/cuda/kernel.cuh (layer model) includes server/config.h "
                      "(layer server)", out)

    def test_root_without_layers_is_an_error(self):
        empty = tempfile.mkdtemp(prefix="layering-empty-")
        self.addCleanup(shutil.rmtree, empty)
        proc = subprocess.run([sys.executable, CHECKER, "--root", empty], capture_output=True, text=True)
        self.assertEqual(proc.returncode, 2)


if __name__ == "__main__":
    unittest.main()
