"""vlmgraph-train's validation split and metrics file, on the CPU (gloo), on the tiny checkpoint with a
byte-level tokenizer (tests/train/tiny_text_model.py): the metrics file holds one record per step
with the learning rate of the schedule, eval_loss before the first step, every --eval-every steps
and after the last, all finite; evaluating changes no weight and no training loss; 2 ranks
(built-in launcher) report the eval loss of 1 rank; a resumed job appends and drops the lines a
killed job wrote past its checkpoint; scripts/train_plot.py draws the PNG and writes TensorBoard
events that tensorboard's EventAccumulator reads back, also while following a growing file."""
import json
import math
import os
import re
import shutil
import subprocess
import sys
import unittest

from e2e_util import ROOT, require, scratch_dir

TRAIN = os.environ.get("VLMGRAPH_TRAIN", os.path.join(ROOT, "build", "tools", "vlmgraph-train"))
PLOT = os.path.join(ROOT, "scripts", "train_plot.py")
sys.path.insert(0, os.path.join(ROOT, "tests", "train"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from tiny_text_model import make_tiny_text_model  # noqa: E402

STEPS = 6
RATE = 0.002


def cosine_scale(it, max_steps):
    """Upstream nanoVLM's get_lr as a factor, its warm-up at least one step and capped at 1
    (tools/train/train_run.cc, CosineScale)."""
    warmup = max_steps * 0.03
    if it < warmup:
        return min(1.0, (it + 1) / max(warmup, 1.0))
    if it > max_steps:
        return 0.1
    ratio = (it - warmup) / (max_steps - warmup)
    return 0.1 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * 0.9


def read_metrics(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh]


def event_scalars(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(log_dir)
    acc.Reload()
    if tag not in acc.Tags()["scalars"]:
        return []
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def have(module):
    try:
        __import__(module)
        return True
    except ImportError:
        return False


class TrainMetricsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.path.isfile(TRAIN):
            raise AssertionError(f"{TRAIN} not built")
        cls.dir = scratch_dir("train-metrics")
        make_tiny_text_model(os.path.join(cls.dir, "model"), max_img_size=64)
        with open(os.path.join(cls.dir, "data.jsonl"), "w") as fh:
            for i in range(12):
                messages = [{"role": "user", "content": f"What is {i} + {i}?"},
                            {"role": "assistant", "content": str(2 * i)}]
                fh.write(json.dumps({"messages": messages}) + "\n")
        with open(os.path.join(cls.dir, "val.jsonl"), "w") as fh:
            for i in range(3):
                messages = [{"role": "user", "content": f"What is {i} times 3?"},
                            {"role": "assistant", "content": str(3 * i)}]
                fh.write(json.dumps({"messages": messages}) + "\n")
        cls.config = os.path.join(cls.dir, "train.yaml")
        with open(cls.config, "w") as fh:
            fh.write("model: model\n"
                     "buckets:\n  train_batch_sizes: [1, 2, 4]\n  train_seq_lens: [64, 128]\n"
                     f"train:\n  dataset: data.jsonl\n  global_batch_size: 2\n  steps: {STEPS}\n"
                     f"  language_learning_rate: {RATE}\n  vision_learning_rate: {RATE}\n"
                     f"  projector_learning_rate: {RATE}\n  lr_schedule: cosine\n"
                     "distributed:\n  timeout_seconds: 30\n")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    ENV = dict(os.environ, OMP_NUM_THREADS="1")  # bit-for-bit comparisons: one GEMM thread

    def run_train(self, *args, nproc=None, expect=0):
        cmd = [TRAIN, "--config", self.config, *args]
        if nproc:
            cmd += ["--nproc-per-node", str(nproc)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=self.ENV)
        self.assertEqual(out.returncode, expect, out.stdout + out.stderr)
        return out

    def test_a_metrics_file_has_every_step_and_the_evaluations(self):
        run = os.path.join(self.dir, "run-a")
        out = self.run_train(f"--set=train.save_dir={run}", "--val-fraction", "0.25", "--eval-every", "2").stdout
        records = read_metrics(os.path.join(run, "metrics.jsonl"))  # the default path
        # Step 0: the loss before training (eval only); then one record per step.
        self.assertEqual([r["step"] for r in records], list(range(STEPS + 1)))
        self.assertEqual(set(records[0]), {"step", "time", "eval_loss", "eval_tokens", "eval_examples",
                                           "eval_seconds"})
        evaluated = [r["step"] for r in records if "eval_loss" in r]
        self.assertEqual(evaluated, [0, 2, 4, 6])
        for r in records:
            if "eval_loss" in r:
                self.assertTrue(math.isfinite(r["eval_loss"]) and r["eval_loss"] > 0, r)
                self.assertEqual(r["eval_examples"], 3)  # round(0.25 x 12) held out
        # The model learns the training set; the held-out loss moves too.
        self.assertNotEqual(records[0]["eval_loss"], records[-1]["eval_loss"])
        for r in records[1:]:
            self.assertTrue(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]), r)
            self.assertGreater(r["tokens_per_second"], 0)
            self.assertNotIn("mfu", r)  # no peak on the CPU
            want = RATE * cosine_scale(r["step"] - 1, STEPS)
            self.assertEqual(set(r["learning_rate"]), {"language", "vision", "projector"})
            for part, rate in r["learning_rate"].items():
                self.assertAlmostEqual(rate, want, delta=want * 1e-6, msg=(r["step"], part))
            self.assertEqual(r["examples"], 2 * r["step"])
        # The terminal shows the same: the learning rate, the evaluations, the saves, the summary.
        self.assertRegex(out, r"(?m)^step 1/6 loss \S+ lr language=\S+,vision=\S+,projector=\S+ grad_norm ")
        self.assertRegex(out, r"(?m)^eval step 0/6 eval_loss [0-9.]+ \(3 examples, \d+ tokens, ")
        self.assertRegex(out, r"(?m)^eval step 6/6 eval_loss ")
        self.assertIn(f"saved checkpoint to {run} (step 6)", out)
        self.assertRegex(out, r"9 training examples, validation 3 examples \(held out of the dataset\), "
                              r"evaluated every 2 steps and at the end; up to 256 tokens per step")
        self.assertIn(f"metrics {run}/metrics.jsonl", out)
        self.assertRegex(out, r"done: step 6, final loss \S+, eval_loss \S+, saved to")
        self.__class__.metrics_a = os.path.join(run, "metrics.jsonl")

    def test_b_evaluating_changes_no_training_loss_or_weight(self):
        plain, evaluated = os.path.join(self.dir, "plain"), os.path.join(self.dir, "evaluated")
        self.run_train(f"--set=train.save_dir={plain}")
        self.run_train(f"--set=train.save_dir={evaluated}", "--val-file", os.path.join(self.dir, "val.jsonl"),
                       "--eval-every", "1")
        a, b = read_metrics(os.path.join(plain, "metrics.jsonl")), read_metrics(os.path.join(evaluated, "metrics.jsonl"))
        self.assertEqual([r["loss"] for r in a], [r["loss"] for r in b if r["step"] > 0])
        self.assertEqual(len([r for r in b if "eval_loss" in r]), STEPS + 1)
        self.assertTrue(all("eval_loss" not in r for r in a))
        with open(os.path.join(plain, "model.safetensors"), "rb") as fa, \
                open(os.path.join(evaluated, "model.safetensors"), "rb") as fb:
            self.assertEqual(fa.read(), fb.read())

    def test_c_two_ranks_report_the_eval_loss_of_one(self):
        one, two = os.path.join(self.dir, "one"), os.path.join(self.dir, "two")
        common = ["--val-fraction", "0.25", "--eval-every", "3"]
        self.run_train(f"--set=train.save_dir={one}", "--set=train.grad_accum_steps=2", *common)
        self.run_train(f"--set=train.save_dir={two}", *common, nproc=2)
        a, b = read_metrics(os.path.join(one, "metrics.jsonl")), read_metrics(os.path.join(two, "metrics.jsonl"))
        ea = [(r["step"], r["eval_loss"], r["eval_tokens"]) for r in a if "eval_loss" in r]
        eb = [(r["step"], r["eval_loss"], r["eval_tokens"]) for r in b if "eval_loss" in r]
        self.assertEqual([e[0] for e in ea], [0, 3, 6])
        self.assertEqual([e[0] for e in eb], [0, 3, 6])
        self.assertEqual([e[2] for e in ea], [e[2] for e in eb])  # every held-out token, once
        self.assertAlmostEqual(ea[0][1], eb[0][1], delta=1e-6)  # the same weights
        for x, y in zip(ea[1:], eb[1:]):
            self.assertAlmostEqual(x[1], y[1], delta=1e-4)

    def test_d_a_resumed_job_appends_and_drops_what_it_takes_again(self):
        run = os.path.join(self.dir, "resumed")
        self.run_train(f"--set=train.save_dir={run}", "--set=train.steps=2", "--val-fraction", "0.25",
                       "--set=train.lr_schedule=constant")
        path = os.path.join(run, "metrics.jsonl")
        with open(path, "a") as fh:  # a killed job's steps past its last save, and a torn line
            fh.write(json.dumps({"step": 3, "loss": -1.0}) + "\n" + '{"step": 4, "lo')
        self.run_train(f"--set=train.save_dir={run}", f"--set=train.resume={run}", "--set=train.steps=4",
                       "--val-fraction", "0.25", "--set=train.lr_schedule=constant")
        records = read_metrics(path)
        self.assertEqual([r["step"] for r in records], [0, 1, 2, 3, 4])
        self.assertTrue(all(r.get("loss", 1) > 0 for r in records), records)
        self.assertEqual([r["step"] for r in records if "eval_loss" in r], [0, 2, 4])
        with open(os.path.join(run, "trainer_state.json")) as fh:
            state = json.load(fh)
        self.assertEqual((state["train_examples"], state["validation_examples"]), (9, 3))

    def test_e_bad_validation_settings_say_what_to_change(self):
        cases = [(["--eval-every", "2"], "train.eval_every_steps: needs a validation set"),
                 (["--val-fraction", "0.6"], "train.val_fraction: must lie in [0, 0.5], got 0.6"),
                 (["--val-fraction", "0.1", "--val-file", "v.jsonl"], "set either train.val_fraction or"),
                 (["--val-file", os.path.join(self.dir, "missing.jsonl")], "train.val_dataset: "),
                 (["--set=train.save_dir=/proc/x", "--set=train.steps=1"], "train.metrics_file: metrics file /proc/x")]
        for args, text in cases:
            with self.subTest(args=args):
                out = self.run_train(*args, expect=2)
                self.assertIn(text, out.stderr)

    def test_f_the_plot_tool_draws_the_png_and_writes_tensorboard_events(self):
        require(have("matplotlib"), "matplotlib (pip)")
        require(have("tensorboard"), "tensorboard (pip)")
        if not getattr(self, "metrics_a", None):
            self.test_a_metrics_file_has_every_step_and_the_evaluations()
        records = read_metrics(self.metrics_a)
        png, tb = os.path.join(self.dir, "plot", "loss.png"), os.path.join(self.dir, "tb", "run-a")
        out = subprocess.run([sys.executable, PLOT, self.metrics_a, "-o", png, "--tensorboard", tb],
                             capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        with open(png, "rb") as fh:
            self.assertEqual(fh.read(8), b"\x89PNG\r\n\x1a\n")
        self.assertGreater(os.path.getsize(png), 10000)
        evals = event_scalars(tb, "eval/loss")
        self.assertEqual([s for s, _ in evals], [0, 2, 4, 6])
        for (_, value), r in zip(evals, [r for r in records if "eval_loss" in r]):
            self.assertAlmostEqual(value, r["eval_loss"], places=5)
        self.assertEqual([s for s, _ in event_scalars(tb, "train/loss")], list(range(1, STEPS + 1)))
        rates = event_scalars(tb, "train/learning_rate/projector")
        self.assertAlmostEqual(rates[-1][1], records[-1]["learning_rate"]["projector"], places=9)
        # Converting again replaces the steps instead of adding them twice (purge_step).
        subprocess.run([sys.executable, PLOT, self.metrics_a, "--tensorboard", tb], check=True,
                       capture_output=True, timeout=120)
        self.assertEqual([s for s, _ in event_scalars(tb, "eval/loss")], [0, 2, 4, 6])

    def test_g_follow_converts_a_growing_file(self):
        require(have("tensorboard"), "tensorboard (pip)")
        import train_plot
        d = scratch_dir("follow")
        path, tb = os.path.join(d, "metrics.jsonl"), os.path.join(d, "tb")
        line = lambda step, loss: json.dumps({"step": step, "loss": loss, "time": 1e9 + step}) + "\n"  # noqa: E731
        follower, writer = train_plot.Follower(path), None
        writer = train_plot.follow_once(follower, writer, tb, None)  # no file yet
        with open(path, "w") as fh:
            fh.write(line(1, 3.0) + line(2, 2.5) + '{"step": 3, "lo')  # the last line half written
        writer = train_plot.follow_once(follower, writer, tb, None)
        self.assertEqual(event_scalars(tb, "train/loss"), [(1, 3.0), (2, 2.5)])
        with open(path, "a") as fh:
            fh.write('ss": 2.0}\n' + line(4, 1.5))
        writer = train_plot.follow_once(follower, writer, tb, None)
        self.assertEqual(event_scalars(tb, "train/loss"), [(1, 3.0), (2, 2.5), (3, 2.0), (4, 1.5)])
        # A resumed job rewrote the file up to its checkpoint (step 2), then took step 3 again.
        with open(path + ".new", "w") as fh:
            fh.write(line(1, 3.0) + line(2, 2.5) + line(3, 1.75))
        os.replace(path + ".new", path)
        writer = train_plot.follow_once(follower, writer, tb, None)
        writer.close()
        self.assertEqual(event_scalars(tb, "train/loss"), [(1, 3.0), (2, 2.5), (3, 1.75)])
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
