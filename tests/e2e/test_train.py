"""End to end: a training stream whose loss goes down, on image + text examples; the trained weights
serve Forward at once; a checkpoint saved in nanoVLM's format loads into a fresh server with the
same loss; protocol errors and a second concurrent job are refused; chat examples (messages) are
tokenized by the server with the loss on the assistant turns, by the RPC and the CLI."""
import json
import os
import queue
import random
import shutil
import subprocess
import sys
import unittest

import grpc

from e2e_util import DEVICE, ROOT, Server, chelsea, scratch_dir
from vlmgraph_client import build_prompt, image_tiles
from vlmgraph_client.cli import build_parser, learning_rates, next_token_targets


class TrainTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.image = chelsea()
        cls.ckpt_root = scratch_dir("ckpt")
        cls.server = Server({"train": {"checkpoint_dir": cls.ckpt_root}}, name="train").start()
        cls.client = cls.server.client()
        cls.info = cls.client.model_info()
        rng = random.Random(0)
        tiles = image_tiles(cls.image, cls.info)
        cls.tiles = tiles
        cls.examples = []
        for i in range(8):
            text = [rng.randrange(0, 60) for _ in range(10)]
            images = [cls.image] if i % 2 == 0 else []
            ids = build_prompt(cls.info, [tiles] * len(images), text)
            cls.examples.append({"input_ids": ids, "target_ids": next_token_targets(ids, cls.info.image_token_id),
                                 "images": images})

    @classmethod
    def tearDownClass(cls):
        cls.server.finish(cls.client)

    def config(self, lr=2e-3):
        return self.client.train_config(language_learning_rate=lr, vision_learning_rate=lr, projector_learning_rate=lr,
                                        max_tiles_per_example=self.tiles)

    def score(self, client, example):
        return client.forward(example["input_ids"], example["images"], target_ids=example["target_ids"]).loss

    def test_a_loss_goes_down_and_checkpoint_round_trips(self):
        c = self.client
        before = self.score(c, self.examples[0])
        batches = [c.train_batch(self.examples[:4]), c.train_batch(self.examples[4:])]
        requests = batches * 8
        steps, saved, published = [], [], []
        served_mid_job = []

        def stream():
            yield from requests
            # The job trains its own copy: until it publishes, clients get the old weights.
            served_mid_job.append(self.score(c, self.examples[0]))
            yield c.train_publish()
            yield c.train_save("run1/final")

        for r in c.train(self.config(), stream()):
            if r.HasField("published"):
                published.append(r.published)
            else:
                (steps if r.HasField("step") else saved).append(r.step if r.HasField("step") else r.saved)
        self.assertEqual(served_mid_job, [before])
        self.assertEqual([p.step for p in published], [16])
        self.assertEqual([s.step for s in steps], list(range(1, 17)))
        losses = [s.loss for s in steps]
        first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
        self.assertLess(last, first * 0.8, f"loss did not go down: {losses}")
        modes = [self.client.pb.train_pb2.StepMode.Name(s.mode) for s in steps]
        if DEVICE == "cpu":
            self.assertEqual(set(modes), {"STEP_MODE_EAGER"})
        else:  # configured buckets are captured at the job's start, others by their first step
            seen = set()
            for s, mode in zip(steps, modes):
                allowed = {"STEP_MODE_GRAPH_REPLAY"}
                if s.bucket not in seen:
                    allowed.add("STEP_MODE_GRAPH_CAPTURE")
                self.assertIn(mode, allowed, (s.step, s.bucket, modes))
                seen.add(s.bucket)
        for s in steps:
            self.assertGreater(s.loss_tokens, 0)
            self.assertGreater(s.step_seconds, 0)
            self.assertRegex(s.bucket, r"^b\d+xs\d+$")
        # After the publish the serving model is the trained one.
        after = self.score(c, self.examples[0])
        self.assertLess(after, before)
        # nanoVLM-format checkpoint under train.checkpoint_dir, loadable by a fresh server.
        self.assertEqual(len(saved), 1)
        self.assertEqual(saved[0].step, 16)
        path = saved[0].directory
        self.assertTrue(path.startswith(os.path.realpath(self.ckpt_root)) or path.startswith(self.ckpt_root), path)
        self.assertTrue(os.path.isfile(os.path.join(path, "config.json")))
        self.assertTrue(os.path.isfile(os.path.join(path, "model.safetensors")))
        fresh = Server({"model": path}, name="reload").start()
        try:
            with fresh.client() as fc:
                self.assertAlmostEqual(self.score(fc, self.examples[0]), after, places=4)
            self.assertEqual(fresh.stop(), 0)
        finally:
            fresh.cleanup()
        self.assertGreaterEqual(self.server.metric("vlmgraph_train_steps_total"), 16)
        self.assertGreater(self.server.metric("vlmgraph_train_tokens_total"), 0)

    def assertTrainFails(self, code, text, messages):
        with self.assertRaises(grpc.RpcError) as ctx:
            list(self.client.stub.Train(iter(messages), timeout=60))
        self.assertEqual(ctx.exception.code(), code, ctx.exception.details())
        self.assertIn(text, ctx.exception.details())

    def test_protocol_errors(self):
        t = self.client.pb.train_pb2
        INVALID = grpc.StatusCode.INVALID_ARGUMENT
        batch = self.client.train_batch(self.examples[:1])
        self.assertTrainFails(INVALID, "first message must be TrainRequest{config}", [batch])
        self.assertTrainFails(INVALID, "before its first message", [])
        cfg = t.TrainRequest(config=self.config())
        self.assertTrainFails(INVALID, "only be sent once", [cfg, cfg])
        self.assertTrainFails(INVALID, "must not contain '..'", [cfg, self.client.train_save("../escape")])
        self.assertTrainFails(INVALID, "must be relative", [cfg, self.client.train_save("/tmp/x")])
        bad = dict(self.examples[1], target_ids=self.examples[1]["target_ids"][:-1])
        self.assertTrainFails(INVALID, "batch.examples[0].target_ids", [cfg, self.client.train_batch([bad])])
        frozen = t.TrainRequest(config=self.client.train_config(language_learning_rate=0, vision_learning_rate=0,
                                                                projector_learning_rate=0))
        self.assertTrainFails(INVALID, "nothing to train", [frozen, batch])
        self.assertTrainFails(INVALID, "config.beta1", [t.TrainRequest(config=t.TrainConfig(beta1=1.0))])
        projector = t.TrainConfig(recompute_parts=[t.MODEL_PART_PROJECTOR])
        self.assertTrainFails(INVALID, "config.recompute_parts[0]", [t.TrainRequest(config=projector)])
        unspecified = t.TrainConfig(trainable_parts=[t.MODEL_PART_UNSPECIFIED])
        self.assertTrainFails(INVALID, "config.trainable_parts[0]: must be MODEL_PART_VISION, MODEL_PART_PROJECTOR",
                              [t.TrainRequest(config=unspecified)])
        # Enum numbers that name no value: every enum field refuses them alike.
        self.assertTrainFails(INVALID, "config.optimizer", [t.TrainRequest(config=t.TrainConfig(optimizer=7))])
        self.assertTrainFails(INVALID, "config.bucket_policy",
                              [t.TrainRequest(config=t.TrainConfig(bucket_policy=9))])

    def test_unset_rates_are_upstream_nanovlms_and_the_cli_sets_only_what_it_is_given(self):
        """docs/training.md, "Learning rates": an unset rate is upstream nanoVLM's default (the
        language model's 5e-5 is the one a step reports); the client's train command has no rates
        of its own: --<part>-learning-rate sets a part, --lr the parts those leave."""
        cfg = self.client.train_config(vision_learning_rate=0, projector_learning_rate=0)
        steps = list(self.client.train(cfg, iter([self.client.train_batch(self.examples[1:2])])))
        self.assertAlmostEqual(steps[0].step.learning_rate, 5e-5, delta=1e-12)
        parse = build_parser().parse_args
        self.assertEqual(learning_rates(parse(["train", "--file", "x"])), {})
        self.assertEqual(learning_rates(parse(["train", "--file", "x", "--lr", "1e-3", "--vision-learning-rate", "0"])),
                         {"language_learning_rate": 1e-3, "vision_learning_rate": 0.0,
                          "projector_learning_rate": 1e-3})
        self.assertEqual(learning_rates(parse(["train", "--file", "x", "--projector-learning-rate", "2e-3"])),
                         {"projector_learning_rate": 2e-3})

    def test_hyperparameters_outside_their_ranges(self):
        """Every number of TrainConfig has a documented range (train.proto): INVALID_ARGUMENT names
        the field, the range and the value, before the job starts; the bounds themselves pass."""
        INVALID = grpc.StatusCode.INVALID_ARGUMENT
        t = self.client.pb.train_pb2
        nan, inf = float("nan"), float("inf")
        cases = [("language_learning_rate", 1e30, "must lie in [0, 1], got 1e+30"),
                 ("vision_learning_rate", -1e-3, "must lie in [0, 1], got -0.001"),
                 ("projector_learning_rate", nan, "must lie in [0, 1], got nan"),
                 ("weight_decay", 1e30, "must lie in [0, 1], got 1e+30"),
                 ("weight_decay", 1.5, "must lie in [0, 1], got 1.5"),
                 ("beta1", 1.0, "must lie in [0, 1), got 1"),
                 ("beta2", -0.5, "must lie in [0, 1), got -0.5"),
                 ("eps", 0.0, "must lie in [1e-12, 1], got 0"),
                 ("eps", 2.0, "must lie in [1e-12, 1], got 2"),
                 ("max_grad_norm", inf, "must lie in [0, 1e+06], got inf"),
                 ("max_grad_norm", -1.0, "must lie in [0, 1e+06], got -1"),
                 ("max_consecutive_skipped_steps", 0, "must lie in [1, 1000], got 0"),
                 ("max_consecutive_skipped_steps", 1001, "must lie in [1, 1000], got 1001")]
        for field, value, text in cases:
            with self.subTest(field=field, value=value):
                cfg = t.TrainRequest(config=t.TrainConfig(**{field: value}))
                self.assertTrainFails(INVALID, f"config.{field}: {text}", [cfg, self.client.train_batch(self.examples[1:2])])
        # The bounds are in range: a job with every one of them starts (and takes no step).
        edge = t.TrainConfig(language_learning_rate=1, vision_learning_rate=0, projector_learning_rate=1, weight_decay=1,
                             beta1=0, beta2=0, eps=1e-12, max_grad_norm=1e6, max_consecutive_skipped_steps=1000)
        self.assertEqual(list(self.client.stub.Train(iter([t.TrainRequest(config=edge)]), timeout=60)), [])

    def test_a_refused_first_batch_allocates_nothing(self):
        """Note [A job allocates late] (server/grpc/train_rpc.cc): a job's ranks (weights, AdamW
        state, graphs) are made by its first accepted request, not by its config."""
        t = self.client.pb.train_pb2
        cfg = t.TrainRequest(config=self.config(lr=1e-12))
        bad = dict(self.examples[1], target_ids=self.examples[1]["target_ids"][:-1])
        started = self.server.log().count("Train job started")
        self.assertTrainFails(grpc.StatusCode.INVALID_ARGUMENT, "batch.examples[0].target_ids",
                              [cfg, self.client.train_batch([bad])])
        self.assertEqual(list(self.client.stub.Train(iter([cfg]), timeout=60)), [])  # a config alone
        self.assertEqual(self.server.log().count("Train job started"), started)
        # An accepted batch makes the job.
        self.assertEqual(len(list(self.client.train(self.config(lr=1e-12),
                                                    iter([self.client.train_batch(self.examples[:1])])))), 1)
        self.assertEqual(self.server.log().count("Train job started"), started + 1)

    def test_saves_stay_inside_the_checkpoint_dir(self):
        t = self.client.pb.train_pb2
        INVALID = grpc.StatusCode.INVALID_ARGUMENT
        cfg = t.TrainRequest(config=self.config(lr=1e-12))
        outside = scratch_dir("outside")
        try:
            os.symlink(outside, os.path.join(self.ckpt_root, "link"))
            with open(os.path.join(self.ckpt_root, "afile"), "w") as fh:
                fh.write("not a directory")
            for name, text in [("link", "must stay inside train.checkpoint_dir"),
                               ("link/run1", "must stay inside train.checkpoint_dir"),
                               ("afile/run1", "is a file"), ("a" * 300, "at most 255"),
                               ("run1/" * 300 + "x", "at most 1024"), (".", "'.' component"),
                               ("run1/./x", "'.' component"), ("run1//x", "empty")]:
                self.assertTrainFails(INVALID, text, [cfg, self.client.train_save(name)])
            self.assertEqual(os.listdir(outside), [])
            self.assertNotIn("config.json", os.listdir(self.ckpt_root))  # nothing written into the root itself
        finally:
            shutil.rmtree(outside, ignore_errors=True)
            for name in ("link", "afile"):
                if os.path.lexists(os.path.join(self.ckpt_root, name)):
                    os.unlink(os.path.join(self.ckpt_root, name))

    def test_recompute_parts_give_the_same_loss(self):
        """Activation recomputation changes memory, not results: the same first-step loss."""
        losses = []
        for parts in ([], ["vision", "language"]):
            cfg = self.client.train_config(language_learning_rate=1e-12, vision_learning_rate=1e-12,
                                           projector_learning_rate=1e-12, recompute_parts=parts,
                                           max_tiles_per_example=self.tiles)
            steps = [r.step for r in self.client.train(cfg, iter([self.client.train_batch(self.examples[:2])]))
                     if r.HasField("step")]
            self.assertEqual(len(steps), 1)
            losses.append(steps[0].loss)
        self.assertAlmostEqual(losses[0], losses[1], delta=1e-4 * abs(losses[0]))

    def test_one_job_at_a_time(self):
        t = self.client.pb.train_pb2
        pending = queue.Queue()
        # A valid job whose steps barely move the weights (this server's other tests score them).
        cfg = self.client.train_config(language_learning_rate=1e-12, trainable_parts=["language"],
                                       max_tiles_per_example=self.tiles)

        def job():
            yield t.TrainRequest(config=cfg)
            while True:
                item = pending.get(timeout=60)
                if item is None:
                    return  # half-close: the job ends cleanly
                yield item

        responses = self.client.stub.Train(job(), timeout=120)
        pending.put(self.client.train_batch(self.examples[:1]))
        self.assertTrue(next(responses).HasField("step"))  # the first job is running now
        with self.assertRaises(grpc.RpcError) as ctx:
            list(self.client.train(cfg, iter([self.client.train_batch(self.examples[:1])])))
        self.assertEqual(ctx.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertIn("already running", ctx.exception.details())
        pending.put(None)
        self.assertEqual(list(responses), [])
        # Once it ended, a new job is accepted.
        steps = list(self.client.train(cfg, iter([self.client.train_batch(self.examples[:1])])))
        self.assertEqual(len(steps), 1)


class SaveFailureTest(unittest.TestCase):
    def test_a_save_the_file_system_refuses_is_not_internal(self):
        # mkdir fails under /proc, for root too: the file system's answer, not a server bug.
        server = Server({"train": {"checkpoint_dir": "/proc"}}, name="train-proc").start()
        try:
            client = server.client()
            t = client.pb.train_pb2
            job = [t.TrainRequest(config=client.train_config(language_learning_rate=1e-9)), client.train_save("run1")]
            with self.assertRaises(grpc.RpcError) as ctx:
                list(client.stub.Train(iter(job), timeout=60))
            self.assertEqual(ctx.exception.code(), grpc.StatusCode.FAILED_PRECONDITION, ctx.exception.details())
            self.assertIn("save.directory: cannot write the checkpoint to /proc/run1", ctx.exception.details())
            client.close()
            self.assertEqual(server.stop(), 0)
        finally:
            server.cleanup()


class CheckpointQuotaTest(unittest.TestCase):
    """train.checkpoint_quota_bytes: a save that would take train.checkpoint_dir past the quota is
    refused with RESOURCE_EXHAUSTED before it writes a file; a checkpoint saved again into its own
    directory replaces itself and counts once."""

    @staticmethod
    def tree_bytes(root):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)

    def save_job(self, server, names):
        client = server.client()
        try:
            t = client.pb.train_pb2
            job = [t.TrainRequest(config=client.train_config(language_learning_rate=1e-9))]
            job += [client.train_save(name) for name in names]
            return [r.saved.directory for r in client.stub.Train(iter(job), timeout=120) if r.HasField("saved")]
        finally:
            client.close()

    def test_saves_past_the_quota_are_refused(self):
        # The size of one checkpoint of this model, from a server without a quota.
        probe_root = scratch_dir("quota-probe")
        server = Server({"train": {"checkpoint_dir": probe_root, "checkpoint_quota_bytes": 0}},
                        name="train-quota-probe").start()
        try:
            self.assertEqual(len(self.save_job(server, ["probe"])), 1)
            self.assertEqual(server.stop(), 0)
        finally:
            server.cleanup()
        one = self.tree_bytes(probe_root)
        shutil.rmtree(probe_root, ignore_errors=True)
        self.assertGreater(one, 100_000)
        # Room for one checkpoint and a half.
        root = scratch_dir("quota")
        server = Server({"train": {"checkpoint_dir": root, "checkpoint_quota_bytes": one * 3 // 2}},
                        name="train-quota").start()
        try:
            self.assertEqual(len(self.save_job(server, ["run1", "run1"])), 2)  # the second replaces the first
            used = self.tree_bytes(root)
            self.assertEqual(used, one)
            with self.assertRaises(grpc.RpcError) as ctx:
                self.save_job(server, ["run2"])
            self.assertEqual(ctx.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED, ctx.exception.details())
            self.assertIn("train.checkpoint_quota_bytes", ctx.exception.details())
            self.assertIn("Delete older checkpoints", ctx.exception.details())
            self.assertEqual(self.tree_bytes(root), used)  # nothing written for run2
            # Making room lets the next save through.
            shutil.rmtree(os.path.join(root, "run1"))
            self.assertEqual(len(self.save_job(server, ["run2"])), 1)
            self.assertEqual(server.stop(), 0)
        finally:
            server.cleanup()
            shutil.rmtree(root, ignore_errors=True)


class ChatTrainTest(unittest.TestCase):
    """TrainExample.messages on the tiny checkpoint with a byte-level tokenizer
    (tests/train/tiny_text_model.py): ids 0..255 are bytes, so an assistant turn "42" has the
    targets '4', '2', <|im_end|>, '\\n' (upstream nanoVLM's mask: content, end of turn, newline)."""

    @classmethod
    def setUpClass(cls):
        sys.path.insert(0, os.path.join(ROOT, "tests", "train"))
        from tiny_text_model import make_tiny_text_model
        cls.model_dir = make_tiny_text_model(os.path.join(scratch_dir("tiny-text"), "model"), max_img_size=64)
        # The tokenizer files a transformers checkpoint has beside tokenizer.json.
        with open(os.path.join(cls.model_dir, "config.json")) as fh:
            template = json.load(fh)["lm_chat_template"]
        with open(os.path.join(cls.model_dir, "chat_template.jinja"), "w") as fh:
            fh.write(template)
        with open(os.path.join(cls.model_dir, "generation_config.json"), "w") as fh:
            json.dump({"eos_token_id": 257}, fh)
        cls.ckpt = scratch_dir("train-chat-ckpt")
        cls.server = Server({"model": cls.model_dir, "train": {"checkpoint_dir": cls.ckpt}}, name="train-chat").start()
        cls.client = cls.server.client()
        cls.image = chelsea()

    @classmethod
    def tearDownClass(cls):
        cls.server.finish(cls.client)
        shutil.rmtree(os.path.dirname(cls.model_dir), ignore_errors=True)

    def chat(self, i, image=False):
        user = [self.image, f"What is {i} + {i}?"] if image else f"What is {i} + {i}?"
        return [{"role": "user", "content": user}, {"role": "assistant", "content": str(2 * i)},
                {"role": "user", "content": "And doubled?"}, {"role": "assistant", "content": str(4 * i)}]

    def test_chat_examples_train_on_the_assistant_turns(self):
        c = self.client
        examples = [{"messages": self.chat(i, image=i % 2 == 0)} for i in range(10, 14)]
        # The first step's loss is the loss before any update: Forward of the same conversation with
        # the targets of the assistant turns built here must give it.
        first = examples[0]["messages"]
        ids = list(c.forward(messages=first).input_ids)
        im_start, im_end, newline = 256, 257, 10
        header = [im_start] + list(b"assistant\n")
        counted = [False] * len(ids)
        k = 0
        while k < len(ids):
            if ids[k:k + len(header)] == header:
                end = ids.index(im_end, k)
                for j in range(k + len(header), end + 2):
                    counted[j] = True
                k = end
            k += 1
        targets = [ids[j + 1] if j + 1 < len(ids) and counted[j + 1] else -100 for j in range(len(ids))]
        expected = c.forward(ids, [self.image], target_ids=targets)
        self.assertEqual(expected.loss_tokens, len("20") + 2 + len("40") + 2)
        cfg = c.train_config(language_learning_rate=1e-3, vision_learning_rate=1e-3, projector_learning_rate=1e-3)
        steps = [r.step for r in c.train(cfg, iter([c.train_batch(examples[:1])] + [c.train_batch(examples)] * 6))]
        self.assertEqual(steps[0].loss_tokens, expected.loss_tokens)
        self.assertAlmostEqual(steps[0].loss, expected.loss, places=4)
        # Every assistant turn "2i" / "4i" (two digits) counts 2 + 2 tokens.
        self.assertEqual(steps[1].loss_tokens, 4 * 2 * (2 + 2))
        self.assertLess(steps[-1].loss, steps[1].loss)

    def test_a_saved_checkpoint_serves_chat_as_it_is(self):
        """A Train job's checkpoint carries the tokenizer files the server was started with, so a
        server started on the directory answers chat requests, with the trained weights."""
        c = self.client
        examples = [{"messages": self.chat(i)} for i in range(20, 24)]
        cfg = c.train_config(language_learning_rate=3e-3, vision_learning_rate=0, projector_learning_rate=0)
        saved = [r.saved for r in c.train(cfg, iter([c.train_batch(examples)] * 8 + [c.train_save("chat/run1")]))
                 if r.HasField("saved")]
        self.assertEqual(len(saved), 1)
        path = saved[0].directory
        self.assertEqual(os.path.dirname(os.path.dirname(path)), os.path.realpath(self.ckpt))
        for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
            with open(os.path.join(self.model_dir, name), "rb") as a, open(os.path.join(path, name), "rb") as b:
                self.assertEqual(a.read(), b.read(), name)
        before = c.forward(messages=examples[0]["messages"], target_next_tokens=True).loss
        server = Server({"model": path}, name="train-chat-served").start()
        try:
            client = server.client()
            info = client.model_info()
            self.assertEqual(info.tokenizer, os.path.join(path, "tokenizer.json"))
            self.assertEqual(info.chat_format, "chatml")
            self.assertIn(257, info.suggested_stop_token_ids)  # <|im_end|>, from the copied files
            reply, summary = client.chat([{"role": "user", "content": "What is 20 + 20?"}], max_new_tokens=4)
            self.assertGreater(summary.generated_tokens, 0)
            # The trained weights: the conversation it learned costs less than on the served model.
            after = client.forward(messages=examples[0]["messages"], target_next_tokens=True).loss
            self.assertLess(after, before)
            client.close()
            self.assertEqual(server.stop(), 0)
        finally:
            server.cleanup()

    def test_bad_chat_examples_are_refused(self):
        c = self.client
        t = c.pb.train_pb2
        INVALID = grpc.StatusCode.INVALID_ARGUMENT
        cfg = t.TrainRequest(config=c.train_config(language_learning_rate=1e-3))

        def refused(example, text, code=INVALID):
            with self.assertRaises(grpc.RpcError) as ctx:
                list(c.stub.Train(iter([cfg, c.train_batch([{"input_ids": [1], "target_ids": [1]}, example])]),
                                  timeout=60))
            self.assertEqual(ctx.exception.code(), code, ctx.exception.details())
            self.assertIn(text, ctx.exception.details())

        refused({"messages": [{"role": "user", "content": "Hi"}]},
                "batch.examples[1].messages: no assistant message")
        refused({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [self.image]}]},
                "batch.examples[1].messages[1]: an assistant message has an image part")
        refused({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]},
                "batch.examples[1].messages[0].role: 'tool' is not supported")
        long_text = "x" * (self.client.model_info().max_context + 10)
        refused({"messages": [{"role": "user", "content": long_text}, {"role": "assistant", "content": "y"}]},
                "batch.examples[1].messages")
        both = t.TrainExample(input_ids=[1], target_ids=[1], messages=[])
        both.messages.add(role="user").content.add(text="Hi")
        with self.assertRaises(grpc.RpcError) as ctx:
            list(c.stub.Train(iter([cfg, t.TrainRequest(batch=t.TrainBatch(examples=[both]))]), timeout=60))
        self.assertEqual(ctx.exception.code(), INVALID)
        self.assertIn("set either messages or input_ids", ctx.exception.details())

    def test_chat_needs_a_tokenizer(self):
        server = Server({}, name="train-notok").start()
        try:
            client = server.client()
            t = client.pb.train_pb2
            job = [t.TrainRequest(config=client.train_config(language_learning_rate=1e-3)),
                   client.train_batch([{"messages": self.chat(1)}])]
            with self.assertRaises(grpc.RpcError) as ctx:
                list(client.stub.Train(iter(job), timeout=60))
            self.assertEqual(ctx.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("no tokenizer", ctx.exception.details())
            client.close()
            self.assertEqual(server.stop(), 0)
        finally:
            server.cleanup()

    def test_cli_trains_on_a_chat_jsonl(self):
        d = scratch_dir("chat-jsonl")
        with open(os.path.join(d, "cat.png"), "wb") as fh:
            fh.write(self.image)
        with open(os.path.join(d, "data.jsonl"), "w") as fh:
            for i in range(4):
                content = [{"type": "image_url", "image_url": {"url": "cat.png"}}, {"type": "text", "text": "Name?"}]
                fh.write(json.dumps({"messages": [{"role": "user", "content": content},
                                                  {"role": "assistant", "content": f"Cat {i}"}]}) + "\n")
            fh.write(json.dumps({"input_ids": [1, 2, 3], "target_ids": [2, 3, -100]}) + "\n")
        out = subprocess.run([sys.executable, "-m", "vlmgraph_client", "--address", self.server.address, "train",
                              "--file", os.path.join(d, "data.jsonl"), "--batch-size", "5"],
                             capture_output=True, text=True, timeout=120)
        shutil.rmtree(d, ignore_errors=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        # 4 chats x ("Cat i" = 5 bytes + <|im_end|> + newline) + the id example's 2 targets.
        self.assertIn("step 1: loss", out.stdout)
        self.assertIn(f"({4 * 7 + 2} tokens)", out.stdout)


if __name__ == "__main__":
    unittest.main()
