#!/usr/bin/env python3
"""Tests for scripts/check_layering.py: it passes includes that go down a layer and fails one that
goes up or across to a sibling room (text/ and image/, server/grpc/ and server/openai/), a
benchmark that includes a tool, and the training entry point on a serving front.

Each case writes a tiny fake repository (model/, engine/, server/, tests/, and rooms as a case
needs them) into a temporary folder and runs the checker on it with --root. CTest runs this as `layering_check_selftest`.

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
        self.write("server/core/scheduler.cc", '#include "tests/test_util.h"\n')
        rc, out = self.check()
        self.assertEqual(rc, 1, out)
        self.assertIn("(layer server) includes tests/test_util.h (layer tests)", out)

    def test_relative_include_is_resolved(self):
        self.write("model/cuda/kernel.cuh", '#include "../../server/config.h"\n')
        rc, out = self.check()
        self.assertEqual(rc, 1, out)
        self.assertIn("model/cuda/kernel.cuh:1: model/cuda/kernel.cuh (layer model) includes server/config.h "
                      "(layer server)", out)

    def test_rooms_below_the_model_and_beside_each_other(self):
        self.write("base/log.h", "#pragma once\n")
        self.write("text/tokenizer.h", '#pragma once\n#include "base/log.h"\n#include "model/tensor.h"\n')
        self.write("image/decode.h", '#pragma once\n#include "model/tensor.h"\n')
        self.assertEqual(self.check()[0], 0)
        self.write("base/atomic_file.cc", '#include "model/tensor.h"\n')
        self.write("image/tiles.cc", '#include "text/tokenizer.h"\n')
        rc, out = self.check()
        self.assertEqual(rc, 1, out)
        self.assertEqual(out.splitlines(), [
            "base/atomic_file.cc:1: base/atomic_file.cc (layer base) includes model/tensor.h (layer model)",
            "image/tiles.cc:1: image/tiles.cc (layer image) includes text/tokenizer.h (layer text)"])

    def test_server_rooms(self):
        # config < http < the serving core < grpc, openai < main.cc; the APIs stay apart.
        self.write("server/config/listen_address.h", "#pragma once\n")
        self.write("server/http/http_server.h", '#pragma once\n#include "server/config/listen_address.h"\n')
        self.write("server/core/scheduler.h", '#pragma once\n#include "server/http/http_server.h"\n')
        self.write("server/grpc/service.h", '#pragma once\n#include "server/core/scheduler.h"\n')
        self.write("server/openai/openai_http.h", '#pragma once\n#include "server/core/scheduler.h"\n')
        self.write("server/main.cc", '#include "server/grpc/service.h"\n#include "server/openai/openai_http.h"\n')
        self.assertEqual(self.check()[0], 0, self.check()[1])
        self.write("server/config/flags.cc", '#include "server/core/scheduler.h"\n')
        self.write("server/core/generation.cc", '#include "server/grpc/service.h"\n')
        self.write("server/openai/errors.cc", '#include "server/grpc/service.h"\n')
        rc, out = self.check()
        self.assertEqual(rc, 1, out)
        self.assertEqual(sorted(out.splitlines()), [
            "server/config/flags.cc:1: server/config/flags.cc (layer server/config) includes server/core/scheduler.h "
            "(layer server)",
            "server/core/generation.cc:1: server/core/generation.cc (layer server) includes server/grpc/service.h "
            "(layer server/grpc)",
            "server/openai/errors.cc:1: server/openai/errors.cc (layer server/openai) includes "
            "server/grpc/service.h (layer server/grpc)"])

    def test_benchmarks_below_the_tools_and_training_off_the_fronts(self):
        self.write("launch/launch.h", "#pragma once\n")
        self.write("bench/synthetic.h", '#pragma once\n#include "launch/launch.h"\n')
        self.write("tools/diagnose/diagnose.cc", '#include "bench/synthetic.h"\n')
        self.write("server/core/text_prompt.h", '#pragma once\n#include "engine/bucket.h"\n')
        self.write("server/openai/requests.h", '#pragma once\n#include "server/core/text_prompt.h"\n')
        self.write("tools/train/dataset.cc", '#include "server/core/text_prompt.h"\n')
        self.write("tools/generate_main.cc", '#include "server/openai/requests.h"\n')
        self.assertEqual(self.check()[0], 0, self.check()[1])
        self.write("bench/train_bench.cc", '#include "tools/train/launch.h"\n')
        self.write("tools/train/launch.h", "#pragma once\n")
        self.write("tools/train/run.cc", '#include "server/openai/requests.h"\n')
        self.write("engine/trainer.cc", '#include "launch/launch.h"\n')
        rc, out = self.check()
        self.assertEqual(rc, 1, out)
        self.assertEqual(sorted(out.splitlines()), [
            "bench/train_bench.cc:1: bench/train_bench.cc (layer bench) includes tools/train/launch.h "
            "(layer tools)",
            "engine/trainer.cc:1: engine/trainer.cc (layer engine) includes launch/launch.h (layer launch)",
            "tools/train/run.cc:1: tools/train/run.cc (layer tools) includes server/openai/requests.h "
            "(layer server/openai)"])

    def test_root_without_layers_is_an_error(self):
        empty = tempfile.mkdtemp(prefix="layering-empty-")
        self.addCleanup(shutil.rmtree, empty)
        proc = subprocess.run([sys.executable, CHECKER, "--root", empty], capture_output=True, text=True)
        self.assertEqual(proc.returncode, 2)


if __name__ == "__main__":
    unittest.main()
