"""End to end on SmolLM2-135M-Instruct (real weights, chat): the publish gate refuses the weights
that broke chat in the reported attack (finite, near 1e26: what a learning rate of 1e30 leaves)
and those of an in-range but destructive job (every weight moved by 1, as one AdamW step of
learning rate 1 does), with the measured held-out losses, and every chat answer stays what it was;
a rollback after a healthy publish restores the previous answers.

The job weights come from checkpoints (Train's resume_from) crafted from a saved copy of the served
weights, so no test pays for SmolLM2 training steps on a CPU."""
import os
import shutil
import unittest

import grpc

from e2e_util import Server, converted_model, scratch_dir

QUESTIONS = ["What is the capital of France?", "How many legs does a spider have?"]


class ChatPublishGateTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        model = converted_model()
        cls.ckpt = scratch_dir("publish-ckpt")
        cls.server = Server({"model": model, "train": {"checkpoint_dir": cls.ckpt}}, name="publish-chat")
        cls.server.start(timeout=300)
        cls.client = cls.server.client(timeout=600)
        cls.before = cls.answers()
        # The served weights as a checkpoint that Train can resume from (no step taken).
        c = cls.client
        list(c.train(c.train_config(language_learning_rate=1e-6, trainable_parts=["language"]),
                     iter([c.train_save("base")])))

    @classmethod
    def tearDownClass(cls):
        cls.server.finish(cls.client)
        shutil.rmtree(cls.ckpt, ignore_errors=True)

    @classmethod
    def answers(cls):
        return [cls.client.chat([{"role": "user", "content": q}], max_new_tokens=12)[0] for q in QUESTIONS]

    def craft(self, name, change):
        """Checkpoint `name`: the base one with `change(name, array)` applied to every weight."""
        import numpy
        from safetensors.numpy import load_file, save_file
        src, dst = os.path.join(self.ckpt, "base"), os.path.join(self.ckpt, name)
        os.makedirs(dst, exist_ok=True)
        for f in ("config.json", "optimizer.safetensors"):
            shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))
        weights = load_file(os.path.join(src, "model.safetensors"))
        out = {k: (v if k.endswith("inv_freq") else change(k, v).astype(numpy.float32)) for k, v in weights.items()}
        save_file(out, os.path.join(dst, "model.safetensors"))
        return name

    def publish(self, checkpoint):
        c = self.client
        cfg = c.train_config(language_learning_rate=1e-6, trainable_parts=["language"], resume_from=checkpoint)
        return [r.published for r in c.train(cfg, iter([c.train_publish()])) if r.HasField("published")]

    def test_a_weights_that_break_chat_are_refused(self):
        import numpy
        rng = numpy.random.default_rng(0)
        cases = [
            ("huge", lambda k, v: v * numpy.float32(1e26), "max_abs_weight", "train.publish_gate_max_abs_weight"),
            ("moved", lambda k, v: v + (rng.integers(0, 2, size=v.shape, dtype=numpy.int8) * 2 - 1),
             None, "held-out"),
        ]
        for name, change, reason, text in cases:
            with self.subTest(name):
                checkpoint = self.craft(name, change)
                refused = self.server.metric("vlmgraph_train_publish_refused_total")
                with self.assertRaises(grpc.RpcError) as ctx:
                    self.publish(checkpoint)
                details = ctx.exception.details()
                self.assertEqual(ctx.exception.code(), grpc.StatusCode.FAILED_PRECONDITION, details)
                self.assertIn("publish refused by the publish gate", details)
                self.assertIn(text, details)
                self.assertRegex(details, r"held-out loss [0-9.]+ nats/token served, \S+ with the job's weights")
                self.assertEqual(self.server.metric("vlmgraph_train_publish_refused_total"), refused + 1)
                if reason:
                    self.assertEqual(self.server.metric("vlmgraph_train_publish_refused_total", reason=reason), 1)
                self.assertEqual(self.answers(), self.before)  # chat unchanged, never ""
        self.assertTrue(all(self.before))
        self.assertEqual(self.server.metric("vlmgraph_train_publishes_total"), 0)

    def test_b_rollback_restores_the_previous_answers(self):
        import numpy
        # A healthy model that cannot say " Paris": the tied embedding / head row of that token is 0.
        paris = self.client.forward(text="The capital of France is Paris").input_ids[-1]

        def no_paris(k, v):
            if k != "decoder.head.weight":
                return v
            v = v.copy()
            v[paris] = 0
            return v

        published = self.publish(self.craft("no-paris", no_paris))
        self.assertEqual(len(published), 1)
        gate = published[0].gate
        self.assertEqual(gate.prompts, 4)  # the built-in chat questions
        self.assertLess(gate.published_loss, gate.served_loss + 1.0)
        changed = self.answers()
        self.assertNotEqual(changed[0], self.before[0])
        self.assertNotIn("Paris", changed[0])
        self.assertTrue(changed[0])
        r = self.client.rollback_weights()
        self.assertGreater(r.tensors, 0)
        self.assertEqual(self.answers(), self.before)
        self.assertIn("Paris", self.before[0])
        with self.assertRaises(grpc.RpcError) as ctx:
            self.client.rollback_weights()
        self.assertEqual(ctx.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)

    def test_c_rollback_over_http(self):
        """POST /v1/admin/rollback (the publish scope; no keys here) restores what served before."""
        import requests

        def no_paris(k, v):
            if k != "decoder.head.weight":
                return v
            v = v.copy()
            v[self.client.forward(text="The capital of France is Paris").input_ids[-1]] = 0
            return v

        self.assertEqual(len(self.publish(self.craft("no-paris-http", no_paris))), 1)
        self.assertNotEqual(self.answers()[0], self.before[0])
        url = f"http://{self.server.http_address}/v1/admin/rollback"
        r = requests.post(url, json={}, timeout=120)
        self.assertEqual(r.status_code, 200, r.text)
        self.assertEqual(r.json()["object"], "rollback")
        self.assertGreater(r.json()["tensors"], 0)
        self.assertEqual(self.answers(), self.before)
        again = requests.post(url, json={}, timeout=120)
        self.assertEqual(again.status_code, 400, again.text)
        self.assertEqual(set(again.json()["error"]), {"message", "type", "param", "code"})
        # A form post (what a web page could send without a CORS preflight) is refused unread.
        self.assertEqual(requests.post(url, data="x=1", timeout=30).status_code, 415)


if __name__ == "__main__":
    unittest.main()
