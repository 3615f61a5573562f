"""vlmgraph-train on the CPU (gloo, one process per rank), on the tiny checkpoint with a byte-level
tokenizer (tests/train/tiny_text_model.py) and a JSONL of chat conversations with images:
2 ranks give the losses and weights of 1 rank accumulating the same global batch (within 1e-5),
through the built-in launcher and through torchrun's variables set by hand; the checkpoint loads
into the engine; a resumed job continues at the saved step and ends where an uninterrupted one
ends; a rank killed with SIGKILL (or stopped) ends the other with UNAVAILABLE and exit status 3
within distributed.timeout_seconds; the launcher stops the other ranks when one dies."""
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import unittest
import zlib

from e2e_util import GENERATE, ROOT, free_port, scratch_dir

TRAIN = os.environ.get("VLMGRAPH_TRAIN", os.path.join(ROOT, "build", "tools", "vlmgraph-train"))
sys.path.insert(0, os.path.join(ROOT, "tests", "train"))
from tiny_text_model import make_tiny_text_model  # noqa: E402

EXIT_UNAVAILABLE = 3


def png(width, height, seed):
    """An RGB PNG of noise (no imaging library needed)."""
    rows = b""
    x = seed
    for _ in range(height):
        row = bytearray([0])
        for _ in range(width * 3):
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF
            row.append(x >> 23)
        rows += bytes(row)

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def safetensors_metadata(path):
    """The "__metadata__" object of a safetensors file."""
    with open(path, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        return json.loads(fh.read(n)).get("__metadata__", {})


def read_safetensors(path):
    """{name: list of float} of a float32 safetensors file."""
    with open(path, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(n))
        data = fh.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", (name, t["dtype"])
        begin, end = t["data_offsets"]
        out[name] = struct.unpack(f"<{(end - begin) // 4}f", data[begin:end])
    return out


class TrainEntryTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.path.isfile(TRAIN):
            raise AssertionError(f"{TRAIN} not built")
        cls.dir = scratch_dir("train-entry")
        make_tiny_text_model(os.path.join(cls.dir, "model"), max_img_size=64)
        os.makedirs(os.path.join(cls.dir, "images"))
        with open(os.path.join(cls.dir, "images", "a.png"), "wb") as fh:
            fh.write(png(48, 40, 1))
        with open(os.path.join(cls.dir, "data.jsonl"), "w") as fh:
            for i in range(8):
                question = f"What is {i} + {i}?"
                user = ([{"type": "image_url", "image_url": {"url": "images/a.png"}}, {"type": "text", "text": question}]
                        if i % 2 == 0 else question)
                messages = [{"role": "system", "content": "Answer with a number."}] if i % 3 == 0 else []
                messages += [{"role": "user", "content": user}, {"role": "assistant", "content": str(2 * i)}]
                fh.write(json.dumps({"messages": messages}) + "\n")
        cls.config = os.path.join(cls.dir, "train.yaml")
        with open(cls.config, "w") as fh:
            fh.write("model: model\n"
                     "buckets:\n  train_batch_sizes: [1, 2, 4]\n  train_seq_lens: [64, 128]\n"
                     "train:\n  dataset: data.jsonl\n  global_batch_size: 4\n  steps: 4\n"
                     "  language_learning_rate: 0.002\n  vision_learning_rate: 0.002\n"
                     "  projector_learning_rate: 0.002\n  lr_schedule: cosine\n"
                     "distributed:\n  timeout_seconds: 20\n")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    # Every run with one OpenMP thread per rank (what the launcher and torchrun give each rank):
    # runs compared bit for bit must not depend on how many threads the CPU's GEMMs took.
    ENV = dict(os.environ, OMP_NUM_THREADS="1")

    def run_train(self, *sets, nproc=None, env=None, timeout=120):
        args = [TRAIN, "--config", self.config] + [f"--set={s}" for s in sets]
        if nproc:
            args += ["--nproc-per-node", str(nproc)]
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env or self.ENV)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        return out.stdout

    def rank_env(self, rank, world, port):
        env = dict(self.ENV, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        return env

    def start_ranks(self, world, *sets):
        """Ranks as separate processes with torchrun's variables set here (no launcher)."""
        port = free_port()
        args = [TRAIN, "--config", self.config] + [f"--set={s}" for s in sets]
        return [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=self.rank_env(r, world, port)) for r in range(world)]

    def losses(self, stdout):
        return [float(x) for x in re.findall(r"^step \d+/\d+ loss (\S+)", stdout, re.M)]

    def weights(self, directory):
        return read_safetensors(os.path.join(directory, "model.safetensors"))

    def assertWeightsClose(self, a, b, tol=1e-5):
        self.assertEqual(sorted(a), sorted(b))
        worst = max(max(abs(x - y) for x, y in zip(a[k], b[k])) for k in a)
        self.assertLess(worst, tol)

    def test_a_two_ranks_match_one_rank(self):
        one = os.path.join(self.dir, "one")
        out1 = self.run_train(f"train.save_dir={one}", "train.grad_accum_steps=2")
        two = os.path.join(self.dir, "two")
        out2 = self.run_train(f"train.save_dir={two}", nproc=2)
        l1, l2 = self.losses(out1), self.losses(out2)
        self.assertEqual(len(l1), 4, out1)
        self.assertEqual(len(l2), 4, out2)
        for a, b in zip(l1, l2):
            self.assertAlmostEqual(a, b, delta=1e-5)
        self.assertLess(l1[-1], l1[0])
        self.assertWeightsClose(self.weights(one), self.weights(two))
        # The same with the variables set by hand, one process per rank.
        three = os.path.join(self.dir, "three")
        procs = self.start_ranks(2, f"train.save_dir={three}")
        outs = [p.communicate(timeout=120) for p in procs]
        self.assertEqual([p.returncode for p in procs], [0, 0], outs)
        self.assertEqual(outs[1][0], "")  # rank 1 prints nothing
        self.assertWeightsClose(self.weights(one), self.weights(three))
        # The checkpoint: nanoVLM's config.json, trainer state, tokenizer; the engine loads it.
        with open(os.path.join(two, "trainer_state.json")) as fh:
            state = json.load(fh)
        self.assertEqual((state["step"], state["position"], state["world_size"]), (4, 16, 2))
        for name in ("config.json", "model.safetensors", "optimizer.safetensors", "tokenizer.json"):
            self.assertTrue(os.path.isfile(os.path.join(two, name)), name)
        with open(os.path.join(two, "config.json")) as fh, \
                open(os.path.join(self.dir, "model", "config.json")) as fh0:
            self.assertEqual(json.load(fh)["lm_hidden_dim"], json.load(fh0)["lm_hidden_dim"])
        if os.path.isfile(GENERATE):
            g = subprocess.run([GENERATE, "--model", two, "--device", "cpu", "--ids", "256,117,10",
                                "--max-new-tokens", "2"], capture_output=True, text=True, timeout=120)
            self.assertEqual(g.returncode, 0, g.stderr)
            self.assertEqual(len(json.loads(g.stdout)["tokens"]), 2)

    def test_b_resume_continues_at_the_saved_step(self):
        constant = "train.lr_schedule=constant"  # a schedule spans train.steps, which differs here
        full = os.path.join(self.dir, "full")
        self.run_train(f"train.save_dir={full}", "train.grad_accum_steps=2", constant)
        half = os.path.join(self.dir, "half")
        out = self.run_train(f"train.save_dir={half}", "train.steps=2", "train.save_every_steps=1",
                             "train.grad_accum_steps=2", constant)
        self.assertEqual(re.findall(r"^step (\d+)/2", out, re.M), ["1", "2"])
        with open(os.path.join(half, "trainer_state.json")) as fh:
            self.assertEqual((json.load(fh)["step"]), 2)
        # Each part's rate and the rate its last step took (docs/training.md, "Learning rates").
        meta = safetensors_metadata(os.path.join(half, "optimizer.safetensors"))
        for part in ("language", "vision", "projector"):
            self.assertEqual(float(meta[f"learning_rate.{part}"]), 0.002, part)
            self.assertEqual(float(meta[f"scheduled_learning_rate.{part}"]), 0.002, part)
        # The resumed job continues with the checkpoint's rates, not the other ones it was given.
        resumed = os.path.join(self.dir, "resumed")
        no_omp = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        out = self.run_train(f"train.save_dir={resumed}", f"train.resume={half}", constant,
                             "train.language_learning_rate=0.5", "train.projector_learning_rate=0.3", nproc=2,
                             env=no_omp)
        self.assertEqual(re.findall(r"^step (\d+)/4", out, re.M), ["3", "4"])
        # The start-up summary; the launcher gives each rank one OpenMP thread, as torchrun does.
        self.assertRegex(out, r"vlmgraph-train: 2 rank\(s\) on cpu, float32; parameters [0-9.]+M trained, "
                              r"[0-9.]+M frozen; dataset \d+ examples; 4 examples per step \(2 per rank\), "
                              r"step 2 of 4; 1 OpenMP thread\(s\) per rank")
        self.assertWeightsClose(self.weights(full), self.weights(resumed))
        # Resuming a finished job does nothing.
        out = self.run_train(f"train.resume={resumed}", constant)
        self.assertIn("nothing to do: step 4 of 4", out)
        self.assertIn("vlmgraph-train: done: step 4, no step taken", out)
        self.assertNotIn("final loss", out)

    def test_c_a_killed_rank_ends_the_job_with_unavailable(self):
        for how in (signal.SIGKILL, signal.SIGSTOP):
            with self.subTest(signal=how.name):
                procs = self.start_ranks(2, "train.steps=100000", "distributed.timeout_seconds=5")
                try:
                    line = ""
                    deadline = time.time() + 60
                    while time.time() < deadline and not line.startswith("step 3/"):
                        line = procs[0].stdout.readline()
                        if procs[0].poll() is not None:
                            self.fail(f"rank 0 ended: {procs[0].stderr.read()}")
                    self.assertTrue(line.startswith("step 3/"), line)
                    os.kill(procs[1].pid, how)
                    t0 = time.time()
                    procs[0].wait(timeout=30)
                    elapsed = time.time() - t0
                    err = procs[0].stderr.read()
                    self.assertEqual(procs[0].returncode, EXIT_UNAVAILABLE, err)
                    self.assertIn("vlmgraph-train: rank 0: UNAVAILABLE: ", err)
                    self.assertLess(elapsed, 5 + 10)
                finally:
                    for p in procs:
                        if p.poll() is None:
                            p.kill()
                        p.wait(timeout=30)
                        p.stdout.close()
                        p.stderr.close()

    def test_d_the_launcher_stops_the_others_when_a_rank_dies(self):
        p = subprocess.Popen([TRAIN, "--config", self.config, "--nproc-per-node", "2", "--set=train.steps=100000"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = ""
            deadline = time.time() + 60
            while time.time() < deadline and not line.startswith("step 2/"):
                line = p.stdout.readline()
            self.assertTrue(line.startswith("step 2/"), line)
            with open(f"/proc/{p.pid}/task/{p.pid}/children") as fh:
                children = [int(x) for x in fh.read().split()]
            self.assertEqual(len(children), 2)
            os.kill(children[1], signal.SIGKILL)
            p.wait(timeout=30)
            err = p.stderr.read()
            # The killed rank's status, or the survivor's UNAVAILABLE if the launcher saw it first.
            self.assertIn(p.returncode, (128 + signal.SIGKILL, EXIT_UNAVAILABLE), err)
            self.assertIn("stopping the other ranks", err)
            for c in children:
                self.assertFalse(os.path.exists(f"/proc/{c}") and open(f"/proc/{c}/stat").read().split()[2] != "Z",
                                 f"rank pid {c} still runs")
        finally:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
            p.stdout.close()
            p.stderr.close()

    def test_e_bad_settings_say_what_to_change(self):
        cases = [(["--set=train.dataset_path=x"], "train.dataset_path: --set: unknown key"),
                 (["--set=train.global_batch_size=0"], "train.global_batch_size: must be >= 1, got 0"),
                 (["--set=train.lr_schedule=linear"], "train.lr_schedule: must be one of"),
                 (["--set=train.vision_learning_rate=-1"],
                  "train.vision_learning_rate: must lie in [0, 1], got -1; set a rate in that range (0 freezes"),
                 (["--set=train.language_learning_rate=0", "--set=train.vision_learning_rate=0",
                   "--set=train.projector_learning_rate=0"], "every learning rate is 0: nothing to train"),
                 (["--set=train.global_batch_size=3", "--nproc-per-node", "2"], "must be a multiple of the number of ranks")]
        for args, text in cases:
            with self.subTest(args=args):
                out = subprocess.run([TRAIN, "--config", self.config, *args], capture_output=True, text=True,
                                     timeout=120)
                self.assertEqual(out.returncode, 2, out.stderr)
                self.assertIn(text, out.stderr)

    def test_f_the_whole_dataset_is_checked_before_the_first_step(self):
        """A malformed line and a missing image far into the file stop the job before its first
        step, each named by its line, not when a step reaches them."""
        bad = os.path.join(self.dir, "bad.jsonl")
        with open(os.path.join(self.dir, "data.jsonl")) as fh:
            good = fh.read().splitlines()
        lines = good * 3  # 24 lines; line 17 malformed, line 21 names a missing image
        lines[16] = '{"messages": [{"role": "user", "content": "unterminated'
        lines[20] = json.dumps({"messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "images/missing.png"}},
                                         {"type": "text", "text": "What is this?"}]},
            {"role": "assistant", "content": "A cat."}]})
        with open(bad, "w") as fh:
            fh.write("\n".join(lines) + "\n")
        out = subprocess.run([TRAIN, "--config", self.config, f"--set=train.dataset={bad}", "--set=train.steps=1"],
                             capture_output=True, text=True, timeout=120, env=self.ENV)
        self.assertEqual(out.returncode, 2, out.stdout + out.stderr)
        self.assertNotRegex(out.stdout, r"(?m)^step ")
        self.assertIn("2 of 24 examples cannot be used", out.stderr)
        self.assertIn("bad.jsonl:17", out.stderr)
        self.assertIn("bad.jsonl:21", out.stderr)
        self.assertIn("images/missing.png", out.stderr)


if __name__ == "__main__":
    unittest.main()
