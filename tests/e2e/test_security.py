"""End to end: API keys with scopes (gRPC and HTTP), the exposure rule, TLS and mutual TLS, and
training that cannot hurt serving (hyperparameter ranges, the publish scope, the publish gate,
rollback, skipped non-finite steps, idle timeout, autosave and resume). Each refusal keeps the
server serving."""
import json
import math
import os
import queue
import shutil
import ssl
import subprocess
import time
import unittest
import urllib.error
import urllib.request

import grpc

from e2e_util import SERVER, Server, require, scratch_dir

INFERENCE_KEY = "inference-key-0123456789abcdef"
TRAIN_KEY = "train-only-key-0123456789abcdef"
PUBLISH_KEY = "train-publish-key-0123456789abcdef"
ALL_KEY = "all-scopes-key-0123456789abcdef"
EXAMPLE = {"input_ids": [1, 2, 3, 4, 5, 6], "target_ids": [2, 3, 4, 5, 6, -100]}
PROBE = [1, 2, 3, 4, 5, 6, 7, 8]


def served(client):
    """What the server serves now: a Forward loss and greedy tokens (equal only for equal weights)."""
    loss = client.forward(EXAMPLE["input_ids"], target_ids=EXAMPLE["target_ids"]).loss
    tokens, _ = client.generate_all(PROBE, max_new_tokens=8)
    return loss, tokens


def poisoned_checkpoint(client, root, name, scale):
    """A checkpoint under `root` whose weights are a saved job's times `scale`: what a job of
    learning rate 1e30 leaves (finite weights near 1e26) without its out-of-range config."""
    import numpy
    from safetensors.numpy import load_file, save_file
    base = name + "-base"
    list(client.train(client.train_config(language_learning_rate=1e-12), iter([client.train_save(base)])))
    src, dst = os.path.join(root, base), os.path.join(root, name)
    os.makedirs(dst, exist_ok=True)
    for f in ("config.json", "optimizer.safetensors"):
        shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))
    weights = load_file(os.path.join(src, "model.safetensors"))
    save_file({k: (v * numpy.float32(scale)).astype(v.dtype) for k, v in weights.items()},
              os.path.join(dst, "model.safetensors"))
    return name


def http_get(url, key=None, context=None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30, context=context) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def code_of(fn):
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


class ApiKeyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = scratch_dir("keys")
        keys = os.path.join(cls.dir, "api-keys")
        with open(keys, "w") as fh:
            fh.write(f"# scopes key\ninference {INFERENCE_KEY}\ntrain {TRAIN_KEY}\n"
                     f"train,publish {PUBLISH_KEY}\nall {ALL_KEY}\n")
        cls.server = Server({"auth": {"api_keys_file": keys}}, name="auth").start()

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()
        cls.server.cleanup()

    def client(self, key):
        from vlmgraph_client import VlmGraphClient
        return VlmGraphClient(self.server.address, timeout=60, api_key=key)

    def train_once(self, client):
        cfg = client.train_config(language_learning_rate=1e-4)
        return list(client.train(cfg, iter([client.train_batch([EXAMPLE])])))

    def test_grpc_keys_and_scopes(self):
        none, wrong, inference, full = (self.client(k) for k in ("", "x" * 30, INFERENCE_KEY, ALL_KEY))
        code, details = code_of(none.model_info)
        self.assertEqual(code, grpc.StatusCode.UNAUTHENTICATED)
        self.assertIn("missing API key", details)
        code, _ = code_of(lambda: list(none.generate([1, 2, 3], max_new_tokens=2)))
        self.assertEqual(code, grpc.StatusCode.UNAUTHENTICATED)
        code, details = code_of(wrong.model_info)
        self.assertEqual((code, details), (grpc.StatusCode.UNAUTHENTICATED, "incorrect API key"))
        code, details = code_of(lambda: self.train_once(inference))
        self.assertEqual(code, grpc.StatusCode.PERMISSION_DENIED)
        self.assertIn("'train' scope", details)
        # The right keys work, and the refusals changed nothing.
        self.assertGreater(inference.model_info().vocab_size, 0)
        self.assertEqual(len(list(inference.generate([1, 2, 3], max_new_tokens=2))) > 0, True)
        steps = self.train_once(full)
        self.assertEqual(steps[0].step.step, 1)

    def test_train_scope_cannot_publish(self):
        train, publish, inference = (self.client(k) for k in (TRAIN_KEY, PUBLISH_KEY, INFERENCE_KEY))
        before = served(inference)
        self.assertEqual(self.train_once(train)[0].step.step, 1)  # training needs train only
        cfg = train.train_config(language_learning_rate=1e-3)
        seen = []

        def job(client, config, *extra):
            for r in client.train(config, iter([client.train_batch([EXAMPLE])] + list(extra))):
                seen.append(r)

        # A publish request: refused when it arrives, after the step before it.
        code, details = code_of(lambda: job(train, cfg, train.train_publish()))
        self.assertEqual(code, grpc.StatusCode.PERMISSION_DENIED, details)
        self.assertIn("Train publish: it needs the 'publish' scope", details)
        self.assertEqual([r.step.step for r in seen], [1])
        # publish_on_end: refused with the config, before any step.
        seen.clear()
        on_end = train.train_config(language_learning_rate=1e-3, publish_on_end=True)
        code, details = code_of(lambda: job(train, on_end))
        self.assertEqual(code, grpc.StatusCode.PERMISSION_DENIED, details)
        self.assertIn("'publish' scope", details)
        self.assertEqual(seen, [])
        for client in (train, inference):
            code, details = code_of(client.rollback_weights)
            self.assertEqual(code, grpc.StatusCode.PERMISSION_DENIED, details)
            self.assertIn("RollbackWeights: it needs the 'publish' scope", details)
        self.assertEqual(served(inference), before)  # nothing was published
        # train,publish may publish, and roll back.
        seen.clear()
        job(publish, on_end)
        # The step, then the publish's answer after the half-close.
        self.assertEqual([r.step.step for r in seen if r.HasField("step")], [1])
        self.assertTrue(seen[-1].HasField("published"), seen[-1])
        self.assertEqual(seen[-1].published.step, 1)
        self.assertNotEqual(served(inference), before)
        self.assertGreater(publish.rollback_weights().tensors, 0)
        self.assertEqual(served(inference), before)
        for c in (train, publish, inference):
            c.close()

    def test_http_keys(self):
        base = f"http://{self.server.http_address}"
        status, body = http_get(base + "/v1/models")
        self.assertEqual(status, 401)
        self.assertEqual(body["error"]["code"], "invalid_api_key")
        self.assertEqual(http_get(base + "/v1/models", "y" * 30)[0], 401)
        self.assertEqual(http_get(base + "/v1/models", INFERENCE_KEY)[0], 200)
        self.assertEqual(http_get(base + "/health")[0], 200)  # probes need no key
        # Rolling the served weights back needs the publish scope; refused from the head.
        import requests
        url = base + "/v1/admin/rollback"
        for key, status in ((None, 401), (INFERENCE_KEY, 403), (TRAIN_KEY, 403)):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = requests.post(url, json={}, headers=headers, timeout=30)
            self.assertEqual(r.status_code, status, r.text)
        r = requests.post(url, json={}, headers={"Authorization": f"Bearer {PUBLISH_KEY}"}, timeout=60)
        self.assertEqual(r.status_code, 400, r.text)  # allowed, but nothing published to roll back
        self.assertIn("roll back", r.json()["error"]["message"])


class ExposureTest(unittest.TestCase):
    def run_server(self, *args):
        return subprocess.run([SERVER, "--grpc-address", "0.0.0.0:0", "--metrics-address", "127.0.0.1:0",
                               "--http-address", "", *args], capture_output=True, text=True, timeout=60)

    def test_public_address_without_keys_is_refused(self):
        r = self.run_server()
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("server.grpc_address", r.stderr)
        self.assertIn("auth.api_keys_file", r.stderr)

    def test_open_on_purpose_starts(self):
        s = Server(args=["--grpc-address", "0.0.0.0:0", "--allow-unauthenticated"], name="open").start()
        try:
            with s.client() as c:
                self.assertGreater(c.model_info().vocab_size, 0)
            self.assertEqual(s.stop(), 0)
        finally:
            s.cleanup()


def openssl(*args):
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_pki(d):
    """A CA, a server certificate for 127.0.0.1 / localhost, and a client certificate, all PEM."""
    require(subprocess.run(["which", "openssl"], capture_output=True).returncode == 0, "openssl")
    p = lambda n: os.path.join(d, n)  # noqa: E731
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", p("ca.key"), "-out", p("ca.pem"),
            "-days", "2", "-subj", "/CN=vlmgraph test CA")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"), ("client", "extendedKeyUsage=clientAuth")):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", p(f"{name}.key"), "-out", p(f"{name}.csr"),
                "-subj", f"/CN={name}")
        with open(p(f"{name}.ext"), "w") as fh:
            fh.write(ext + "\n")
        openssl("x509", "-req", "-in", p(f"{name}.csr"), "-CA", p("ca.pem"), "-CAkey", p("ca.key"),
                "-CAcreateserial", "-out", p(f"{name}.pem"), "-days", "2", "-extfile", p(f"{name}.ext"))
    return {n: open(p(n), "rb").read() for n in ("ca.pem", "client.key", "client.pem")}, p


class TlsTest(unittest.TestCase):
    def test_tls_and_client_certificates(self):
        from vlmgraph_client import VlmGraphClient
        d = scratch_dir("tls")
        pem, p = make_pki(d)
        tls = {"cert_file": p("server.pem"), "key_file": p("server.key")}
        s = Server({"tls": tls}, name="tls").start()
        try:
            with VlmGraphClient(s.address, timeout=30, root_certificates=pem["ca.pem"]) as c:
                self.assertGreater(c.model_info().vocab_size, 0)
            with VlmGraphClient(s.address, timeout=5) as plain:
                self.assertEqual(code_of(plain.model_info)[0], grpc.StatusCode.UNAVAILABLE)
            ctx = ssl.create_default_context(cafile=p("ca.pem"))
            self.assertEqual(http_get(f"https://{s.http_address}/v1/models", context=ctx)[0], 200)
            with self.assertRaises((urllib.error.URLError, ConnectionError, OSError)):
                urllib.request.urlopen(f"http://{s.http_address}/health", timeout=5).read()
            self.assertEqual(s.stop(), 0)
        finally:
            s.cleanup()
        # Mutual TLS: a client without a certificate signed by client_ca_file is refused.
        s = Server({"tls": dict(tls, client_ca_file=p("ca.pem"))}, name="mtls").start()
        try:
            with VlmGraphClient(s.address, timeout=5, root_certificates=pem["ca.pem"]) as anonymous:
                self.assertEqual(code_of(anonymous.model_info)[0], grpc.StatusCode.UNAVAILABLE)
            with VlmGraphClient(s.address, timeout=30, root_certificates=pem["ca.pem"],
                                private_key=pem["client.key"], certificate_chain=pem["client.pem"]) as c:
                self.assertGreater(c.model_info().vocab_size, 0)
            self.assertEqual(s.stop(), 0)
        finally:
            s.cleanup()


class TrainingIsolationTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.ckpt = scratch_dir("durable")
        cls.server = Server({"train": {"checkpoint_dir": cls.ckpt, "idle_timeout_seconds": 2}},
                            name="isolation").start()
        cls.client = cls.server.client()

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()
        cls.server.cleanup()

    def loss(self):
        return self.client.forward(EXAMPLE["input_ids"], target_ids=EXAMPLE["target_ids"]).loss

    def test_a_poisonous_job_never_reaches_serving(self):
        c = self.client
        before = served(c)
        # The reported settings are outside their ranges: refused before the job starts.
        for field in ("language_learning_rate", "weight_decay"):
            cfg = c.train_config(**{field: 1e30}, publish_on_end=True)
            code, details = code_of(lambda: list(c.train(cfg, iter([c.train_batch([EXAMPLE])]))))
            self.assertEqual(code, grpc.StatusCode.INVALID_ARGUMENT, details)
            self.assertIn(f"config.{field}: must lie in [0, 1], got 1e+30", details)
        # The weights such a job leaves (finite, near 1e26) come from a checkpoint instead: the
        # publish gate refuses them, with the losses it measured, and serving is unchanged.
        huge = poisoned_checkpoint(c, self.ckpt, "poison/huge", 1e26)
        refused = self.server.metric("vlmgraph_train_publish_refused_total", reason="max_abs_weight")
        cfg = c.train_config(language_learning_rate=1e-4, resume_from=huge)
        code, details = code_of(lambda: list(c.train(cfg, iter([c.train_publish()]))))
        self.assertEqual(code, grpc.StatusCode.FAILED_PRECONDITION, details)
        self.assertIn("publish refused by the publish gate", details)
        self.assertIn("above train.publish_gate_max_abs_weight 1000", details)
        self.assertRegex(details, r"held-out loss [0-9.]+ nats/token served, \S+ with the job's weights")
        self.assertEqual(served(c), before)  # bit-identical loss, same tokens
        self.assertEqual(self.server.metric("vlmgraph_train_publish_refused_total", reason="max_abs_weight"),
                         refused + 1)
        # Trained on, such weights give non-finite gradients: every step is skipped, and
        # max_consecutive_skipped_steps of them end the job before publish_on_end.
        cfg = c.train_config(language_learning_rate=1e-4, resume_from=huge, max_consecutive_skipped_steps=2,
                             publish_on_end=True)
        seen = []
        with self.assertRaises(grpc.RpcError) as ctx:
            for r in c.train(cfg, iter([c.train_batch([EXAMPLE])] * 6)):
                seen.append(r.step)
        self.assertEqual(ctx.exception.code(), grpc.StatusCode.ABORTED, ctx.exception.details())
        self.assertIn("in a row", ctx.exception.details())
        self.assertEqual([s.skipped for s in seen], [True, True])
        self.assertEqual(seen[-1].consecutive_skipped_steps, 2)
        self.assertGreaterEqual(self.server.metric("vlmgraph_train_skipped_steps_total"), 2)
        self.assertEqual(served(c), before)

    def test_e_rollback_restores_the_previous_answers(self):
        c = self.client
        before = served(c)
        code, details = code_of(c.rollback_weights)  # no publish yet: nothing to restore
        self.assertEqual(code, grpc.StatusCode.FAILED_PRECONDITION, details)
        self.assertIn("nothing to roll back", details)
        cfg = c.train_config(language_learning_rate=3e-3, trainable_parts=["language"])
        published = [r.published for r in c.train(cfg, iter([c.train_batch([EXAMPLE])] * 8 + [c.train_publish()]))
                     if r.HasField("published")]
        self.assertEqual([p.step for p in published], [8])
        gate = published[0].gate
        self.assertEqual(gate.prompts, 4)  # the built-in held-out sequences
        self.assertTrue(math.isfinite(gate.served_loss) and math.isfinite(gate.published_loss))
        self.assertGreater(published[0].max_abs_weight, 0)
        trained = served(c)
        self.assertLess(trained[0], before[0])  # it learned EXAMPLE
        self.assertNotEqual(trained, before)
        r = c.rollback_weights()
        self.assertGreater(r.tensors, 0)
        self.assertGreater(r.bytes, 0)
        self.assertEqual(served(c), before)  # the previous answers, bit for bit
        code, details = code_of(c.rollback_weights)  # one level
        self.assertEqual(code, grpc.StatusCode.FAILED_PRECONDITION, details)
        self.assertIn("nothing to roll back", details)
        self.assertGreaterEqual(self.server.metric("vlmgraph_weights_rollbacks_total"), 1)

    def test_b_idle_job_times_out_and_frees_the_slot(self):
        c = self.client
        pending = queue.Queue()

        def job():
            # One unsaved step: the job's end includes a final autosave, so it takes a while.
            yield c.pb.train_pb2.TrainRequest(config=c.train_config(
                language_learning_rate=1e-4, save_every_steps=100, save_directory="durable/idle"))
            yield c.train_batch([EXAMPLE])
            item = pending.get(timeout=30)  # never sent: the server ends the idle job
            if item is not None:
                yield item

        start = time.time()
        with self.assertRaises(grpc.RpcError) as ctx:
            list(c.stub.Train(job(), timeout=60))
        pending.put(None)
        # gRPC's synchronous server can only cancel a blocked read: the client sees CANCELLED; the
        # server logs and counts the reason as DEADLINE_EXCEEDED.
        self.assertEqual(ctx.exception.code(), grpc.StatusCode.CANCELLED, ctx.exception.details())
        self.assertLess(time.time() - start, 20)
        # The slot is free as soon as the cancel is reported: a new job started at once waits for
        # the old one's final autosave instead of getting RESOURCE_EXHAUSTED.
        steps = list(c.train(c.train_config(language_learning_rate=1e-4), iter([c.train_batch([EXAMPLE])])))
        self.assertEqual(steps[0].step.step, 1)
        self.assertTrue(os.path.isfile(os.path.join(self.ckpt, "durable", "idle", "model.safetensors")))
        self.assertEqual(self.server.metric("vlmgraph_requests_total", rpc="Train", code="DEADLINE_EXCEEDED"), 1)

    def test_d_oversize_batch_is_refused_before_it_holds_the_gpu_thread(self):
        c = self.client
        ids = [(7 * i) % 200 + 1 for i in range(300)]
        big = [{"input_ids": ids, "target_ids": ids[1:] + [-100]}] * 64  # 64 x 300 > 8 x 256
        start = time.time()
        with self.assertRaises(grpc.RpcError) as ctx:
            list(c.train(c.train_config(language_learning_rate=1e-4), iter([c.train_batch(big)])))
        self.assertEqual(ctx.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("limits.max_train_batch_tokens", ctx.exception.details())
        self.assertLess(time.time() - start, 10)
        self.assertTrue(math.isfinite(c.forward(ids[:16], target_ids=ids[1:17]).loss))  # still serving

    def test_c_autosave_and_resume(self):
        c = self.client
        cfg = c.train_config(language_learning_rate=1e-3, save_every_steps=2, save_directory="durable/run")
        responses = list(c.train(cfg, iter([c.train_batch([EXAMPLE])] * 3)))
        auto = [r.saved for r in responses if r.HasField("saved")]
        self.assertEqual([(s.step, s.automatic) for s in auto], [(2, True)])
        saved = os.path.join(self.ckpt, "durable", "run")
        self.assertTrue(os.path.isfile(os.path.join(saved, "optimizer.safetensors")))
        # The job ended after step 3: the final autosave holds it, and a new job resumes there.
        cfg = c.train_config(language_learning_rate=1e-3, resume_from="durable/run")
        steps = [r.step.step for r in c.train(cfg, iter([c.train_batch([EXAMPLE])] * 2))]
        self.assertEqual(steps, [4, 5])
        with self.assertRaises(grpc.RpcError) as ctx:
            list(c.train(c.train_config(resume_from="durable/none"), iter([c.train_batch([EXAMPLE])])))
        self.assertEqual(ctx.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("config.resume_from", ctx.exception.details())


if __name__ == "__main__":
    unittest.main()
