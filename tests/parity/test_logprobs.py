#!/usr/bin/env python3
"""Log-probabilities over the OpenAI-compatible API (server/openai/requests.h: logprobs,
top_logprobs, echo, n, prompt batches), against transformers on the same weights.

The tiny random transformers Llama checkpoint of test_hf_checkpoint (tied head, byte-level BPE
tokenizer, SmolLM2's chat template; save_pretrained) is served as it is by the real
vlmgraph-server (float32; the CPU, or VLMGRAPH_E2E_DEVICE; loopback port 0), and compared with transformers' float32 forward
pass of the same directory:
- /v1/completions echo with logprobs: each prompt token's logprob (the first one's null) equals
  log_softmax of transformers' logits, for lm-evaluation-harness's payload (max_tokens 1, echo,
  logprobs 1, temperature 0, token ids), max_tokens 0 and a batch of prompts;
- generated tokens' logprobs (completions and chat) equal log_softmax of transformers' logits of
  the prompt and the tokens before them; top_logprobs are sorted and hold the token's own logprob
  where it is among them; greedy tokens are the most likely;
- n > 1 gives n choices with distinct indexes (equal at temperature 0); streamed chunks carry the
  logprobs of their tokens, the same as one response;
- bad values get 400 with OpenAI's error body naming the field;
- a chat request with an image and logprobs: true, top_logprobs: 5 (as lmms-eval sends) answers;
- lm-evaluation-harness's local-completions model (tokenized requests, the checkpoint's tokenizer,
  batch_size 1) on an offline multiple-choice task (tests/parity/lm_eval_task) gives the
  log-likelihoods of its own `hf` model on the directory, within float32 tolerance.

The served vocabulary has nanoVLM's 66 VLM tokens after the checkpoint's (their head rows are the
small ones nanoVLM initialises): they stay in the log-softmax's normaliser, below the tolerance.

CTest: `parity_logprobs` (tests/parity/run.py test_logprobs).
"""
import base64
import importlib.util
import io
import json
import os
import shutil
import sys
import unittest
import urllib.error
import urllib.request
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))

import e2e_util  # noqa: E402
from test_hf_checkpoint import tiny_llama, write_tokenizer  # noqa: E402

# float32 on the CPU: the served logits match transformers' to 1e-4 (test_hf_checkpoint); a
# logprob adds the log-sum-exp's rounding, relative to its size (this random model's logprobs reach
# -100 and its log-likelihoods -500).
ABS_TOLERANCE = 2e-4
REL_TOLERANCE = 1e-5


def close(got, want):
    return abs(got - want) <= ABS_TOLERANCE + REL_TOLERANCE * abs(want)
TASK_DIR = os.path.join(HERE, "lm_eval_task")
TEXT = "The capital of France is Paris. Write a haiku about the sea."


def server_config(directory):
    # The device is e2e_util's (VLMGRAPH_E2E_DEVICE=cuda: the GPU, with CUDA graphs).
    return {"model": directory, "dtype": "float32",
            # A chat image is 13 tiles of 64 tokens (nanoVLM resizes it to 2048 px): 893 tokens.
            "buckets": {"batch_sizes": [1, 2, 4], "seq_lens": [32, 128, 1024],
                        "context_lens": [256, 1024],
                        "tile_counts": [1, 2], "train_batch_sizes": [1], "train_seq_lens": [32]},
            "limits": {"max_new_tokens": 16, "default_max_new_tokens": 8}}


class Fixture:
    """The tiny checkpoint, transformers' model of it, and the server serving it (one per run)."""
    directory = model = tokenizer = server = base = None

    @classmethod
    def start(cls):
        if cls.server is not None:
            return cls
        for module in ("transformers", "tokenizers", "safetensors", "torch", "requests"):
            e2e_util.require(importlib.util.find_spec(module) is not None, f"python package {module}")
        import transformers
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        cls.scratch = e2e_util.scratch_dir("logprobs")
        cls.directory = os.path.join(cls.scratch, "tiny")
        cls.tokenizer = write_tokenizer(cls.directory)
        cls.model = tiny_llama(tied=True, seed=1, vocab=len(cls.tokenizer), rope_theta=5000.0,
                               max_position_embeddings=1024)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cls.model.save_pretrained(cls.directory)
        cls.server = e2e_util.Server(server_config(cls.directory), name="logprobs").start(timeout=300)
        cls.base = f"http://{cls.server.http_address}"
        return cls

    @classmethod
    def stop(cls):
        if cls.server is not None:
            cls.server.finish()
            shutil.rmtree(cls.scratch, ignore_errors=True)
            cls.server = None


def tearDownModule():
    Fixture.stop()


def post(path, body):
    """(status, parsed JSON body) of a POST."""
    req = urllib.request.Request(Fixture.base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def post_stream(path, body):
    """The parsed `data:` events of a streamed POST, up to [DONE]."""
    req = urllib.request.Request(Fixture.base + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return events
            events.append(json.loads(line[len("data: "):]))
    raise AssertionError("the stream ended without data: [DONE]")


def reference_logprobs(ids):
    """transformers' float32 log_softmax at every position of `ids`: (len, vocab) numpy."""
    import torch
    with torch.no_grad():
        logits = Fixture.model.float()(torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits, dim=-1).numpy()


def token_text(i):
    return Fixture.tokenizer.decode([i])


class LogprobsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        Fixture.start()
        cls.ids = Fixture.tokenizer.encode(TEXT)

    def assert_close(self, got, want, what):
        self.assertTrue(close(got, want), f"{what}: {got} vs {want}")

    def check_completion_top(self, top, chosen_logprob, k, what):
        """A completions top_logprobs object: the token itself and up to k others."""
        self.assertLessEqual(len(top), k + 1, what)
        self.assertIn(chosen_logprob, top.values(), what)
        self.assertTrue(all(v <= 0 for v in top.values()), what)

    def test_echo_gives_the_prompts_logprobs_as_lm_eval_asks(self):
        want = reference_logprobs(self.ids)
        # lm-evaluation-harness's local-completions payload for loglikelihood requests.
        status, r = post("/v1/completions", {"model": "tiny", "prompt": self.ids, "temperature": 0,
                                             "max_tokens": 1, "logprobs": 1, "seed": 1234,
                                             "echo": True})
        self.assertEqual(status, 200, r)
        choice = r["choices"][0]
        lp = choice["logprobs"]
        n = len(self.ids)
        self.assertEqual(len(lp["tokens"]), n + 1)  # the prompt, then the one new token
        self.assertEqual(lp["tokens"][:n], [token_text(i) for i in self.ids])
        self.assertIsNone(lp["token_logprobs"][0])
        self.assertIsNone(lp["top_logprobs"][0])
        for p in range(1, n):
            self.assert_close(lp["token_logprobs"][p], float(want[p - 1][self.ids[p]]), f"prompt {p}")
            self.check_completion_top(lp["top_logprobs"][p], lp["token_logprobs"][p], 1, f"prompt {p}")
        # The new token is the greedy one, with its logprob.
        new = int(want[n - 1].argmax())
        self.assertEqual(lp["tokens"][n], token_text(new))
        self.assert_close(lp["token_logprobs"][n], float(want[n - 1][new]), "new token")
        self.assertEqual(max(lp["top_logprobs"][n].values()), lp["token_logprobs"][n])
        self.assertTrue(choice["text"].startswith(Fixture.tokenizer.decode(self.ids)))
        # text_offset: characters of the token texts before each token.
        offsets = [0]
        for t in lp["tokens"][:-1]:
            offsets.append(offsets[-1] + len(t))
        self.assertEqual(lp["text_offset"], offsets)
        self.assertEqual(r["usage"], {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1})

    def test_echo_with_max_tokens_0_returns_the_prompt_alone(self):
        want = reference_logprobs(self.ids)
        status, r = post("/v1/completions", {"prompt": TEXT, "max_tokens": 0, "echo": True,
                                             "logprobs": 0})
        self.assertEqual(status, 200, r)
        choice = r["choices"][0]
        self.assertEqual(choice["text"], TEXT)
        self.assertEqual(choice["finish_reason"], "length")
        lp = choice["logprobs"]
        self.assertEqual(len(lp["token_logprobs"]), len(self.ids))
        for p in range(1, len(self.ids)):
            self.assert_close(lp["token_logprobs"][p], float(want[p - 1][self.ids[p]]), f"prompt {p}")
            self.assertEqual(list(lp["top_logprobs"][p].values()), [lp["token_logprobs"][p]])
        self.assertEqual(r["usage"]["completion_tokens"], 0)
        # Without echo, max_tokens 0 is refused.
        status, r = post("/v1/completions", {"prompt": TEXT, "max_tokens": 0})
        self.assertEqual(status, 400, r)
        self.assertEqual(r["error"]["param"], "max_tokens")

    def test_a_batch_of_prompts_with_n_choices_each(self):
        prompts = [self.ids[:5], self.ids[:9], self.ids]
        status, r = post("/v1/completions", {"prompt": prompts, "max_tokens": 3, "temperature": 0,
                                             "n": 2, "echo": True, "logprobs": 2,
                                             "ignore_eos": True})
        self.assertEqual(status, 200, r)
        choices = r["choices"]
        self.assertEqual([c["index"] for c in choices], list(range(6)))
        for i, c in enumerate(choices):
            prompt = prompts[i // 2]
            want = reference_logprobs(prompt)
            lp = c["logprobs"]
            for p in range(1, len(prompt)):
                self.assert_close(lp["token_logprobs"][p], float(want[p - 1][prompt[p]]),
                                  f"choice {i} prompt {p}")
            self.assertEqual(c["text"], choices[i - i % 2]["text"])  # greedy choices are equal
            self.assertEqual(lp, choices[i - i % 2]["logprobs"])
        self.assertEqual(r["usage"]["prompt_tokens"], sum(len(p) for p in prompts))
        self.assertEqual(r["usage"]["completion_tokens"], 18)
        status, r = post("/v1/completions", {"prompt": ["The capital", "Good morning"], "max_tokens": 2})
        self.assertEqual(status, 200, r)
        self.assertEqual([c["index"] for c in r["choices"]], [0, 1])

    def generated(self, ids, tokens):
        """log_softmax rows of transformers at the positions that chose `tokens` after `ids`."""
        want = reference_logprobs(ids + tokens)
        return [want[len(ids) - 1 + i] for i in range(len(tokens))]

    def test_new_tokens_logprobs_equal_transformers(self):
        # Sampled: logprobs are those of the raw logits, whatever the temperature.
        for temperature in (0, 0.8):
            status, r = post("/v1/completions", {"prompt": self.ids, "max_tokens": 6, "logprobs": 5,
                                                 "temperature": temperature, "seed": 7,
                                                 "ignore_eos": True})
            self.assertEqual(status, 200, r)
            lp = r["choices"][0]["logprobs"]
            self.assertEqual(len(lp["tokens"]), 6)
            for i, top in enumerate(lp["top_logprobs"]):
                self.check_completion_top(top, lp["token_logprobs"][i], 5, f"token {i}")
                if temperature == 0:
                    self.assertEqual(max(top.values()), lp["token_logprobs"][i])
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        status, r = post("/v1/chat/completions", {"messages": messages, "max_tokens": 6,
                                                  "temperature": 0, "logprobs": True,
                                                  "top_logprobs": 3, "ignore_eos": True})
        self.assertEqual(status, 200, r)
        content = r["choices"][0]["logprobs"]["content"]
        self.assertEqual(len(content), 6)
        prompt = Fixture.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                       tokenize=True, return_dict=False)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        ids = list(prompt)
        for i, entry in enumerate(content):  # greedy: the most likely token at each position
            row = reference_logprobs(ids)[-1]
            best = int(row.argmax())
            self.assertEqual(entry["token"], token_text(best), f"token {i}")
            self.assert_close(entry["logprob"], float(row[best]), f"token {i}")
            self.assertEqual(entry["bytes"], list(entry["token"].encode()))
            top = entry["top_logprobs"]
            self.assertEqual(len(top), 3)
            self.assertEqual([t["logprob"] for t in top], sorted((t["logprob"] for t in top), reverse=True))
            self.assertEqual(top[0]["logprob"], entry["logprob"])
            for t in top:
                self.assertEqual(t["bytes"], list(t["token"].encode()))
            ids.append(best)

    def test_sampled_completion_logprobs_equal_transformers_at_its_tokens(self):
        status, r = post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Write a haiku about the sea."}],
            "max_tokens": 6, "temperature": 1.0, "seed": 3, "logprobs": True, "top_logprobs": 20,
            "ignore_eos": True, "n": 3})
        self.assertEqual(status, 200, r)
        self.assertEqual([c["index"] for c in r["choices"]], [0, 1, 2])
        prompt = Fixture.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Write a haiku about the sea."}], add_generation_prompt=True,
            tokenize=True, return_dict=False)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        for c in r["choices"]:
            ids = list(prompt)
            for i, entry in enumerate(c["logprobs"]["content"]):
                row = reference_logprobs(ids)[-1]
                # The sampled token: the one whose text it is among the top 20 (or, when it is not
                # among them, any token with that text).
                candidates = [t for t in range(len(row)) if token_text(t) == entry["token"]]
                token = min(candidates, key=lambda t: abs(float(row[t]) - entry["logprob"]))
                self.assert_close(entry["logprob"], float(row[token]), f"choice {c['index']} token {i}")
                top = entry["top_logprobs"]
                self.assertEqual(len(top), 20)
                self.assertEqual([t["logprob"] for t in top], sorted((t["logprob"] for t in top), reverse=True))
                if entry["logprob"] >= top[-1]["logprob"]:
                    self.assertIn(entry["logprob"], [t["logprob"] for t in top])
                ids.append(token)

    def test_streamed_chunks_carry_the_logprobs_of_their_tokens(self):
        body = {"prompt": self.ids, "max_tokens": 5, "temperature": 0, "logprobs": 2, "echo": True,
                "ignore_eos": True}
        status, whole = post("/v1/completions", body)
        self.assertEqual(status, 200, whole)
        events = post_stream("/v1/completions", body)
        tokens, token_logprobs, text = [], [], ""
        for e in events:
            for c in e["choices"]:
                text += c["text"]
                if c["logprobs"]:
                    tokens += c["logprobs"]["tokens"]
                    token_logprobs += c["logprobs"]["token_logprobs"]
        want = whole["choices"][0]
        self.assertEqual(text, want["text"])
        self.assertEqual(tokens, want["logprobs"]["tokens"])
        self.assertEqual(token_logprobs, want["logprobs"]["token_logprobs"])
        chat = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0,
                "logprobs": True, "top_logprobs": 2, "ignore_eos": True, "n": 2}
        status, whole = post("/v1/chat/completions", chat)
        self.assertEqual(status, 200, whole)
        per_choice = {0: [], 1: []}
        for e in post_stream("/v1/chat/completions", chat):
            for c in e["choices"]:
                if c["logprobs"]:
                    per_choice[c["index"]] += c["logprobs"]["content"]
        for i in (0, 1):
            self.assertEqual(per_choice[i], whole["choices"][i]["logprobs"]["content"])

    def test_bad_values_get_400_with_openais_error_body(self):
        cases = [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                      "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "top_logprobs": 2}, "top_logprobs", "logprobs: true"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "logprobs": 1}, "logprobs", "true or false"),
            ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "[0, 20]"),
            ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs", "[0, 20]"),
            ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs", "an integer"),
            ("/v1/completions", {"prompt": "x", "n": 0}, "n", "[1, 64]"),
            ("/v1/completions", {"prompt": ["x"] * 33, "n": 2}, "prompt", "at most 64"),
            ("/v1/completions", {"prompt": ["x", [1, 2]]}, "prompt[1]", "all strings"),
            ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo", "true or false"),
        ]
        for path, body, param, message in cases:
            status, r = post(path, body)
            self.assertEqual(status, 400, (body, r))
            self.assertEqual(set(r["error"]), {"message", "type", "param", "code"})
            self.assertEqual(r["error"]["type"], "invalid_request_error")
            self.assertEqual(r["error"]["param"], param, body)
            self.assertIn(message, r["error"]["message"], body)

    def test_chat_with_an_image_and_logprobs_as_lmms_eval_asks(self):
        from PIL import Image
        buf = io.BytesIO()
        Image.new("RGB", (96, 64), (200, 30, 30)).save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        status, r = post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "What color is it?"}]}],
            "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 5})
        self.assertEqual(status, 200, r)
        content = r["choices"][0]["logprobs"]["content"]
        self.assertEqual(len(content), r["usage"]["completion_tokens"])
        for entry in content:
            self.assertEqual(len(entry["top_logprobs"]), 5)
            self.assertEqual(entry["top_logprobs"][0]["logprob"], entry["logprob"])  # greedy


class LmEvalTest(unittest.TestCase):
    """lm-evaluation-harness against the server, and against transformers through its `hf` model."""

    def test_local_completions_loglikelihoods_equal_transformers(self):
        e2e_util.require(importlib.util.find_spec("lm_eval") is not None,
                         "python package lm-eval (lm-evaluation-harness)")
        Fixture.start()
        cache = e2e_util.scratch_dir("lm-eval-cache")
        os.environ.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                           "HF_DATASETS_CACHE": cache, "TOKENIZERS_PARALLELISM": "false"})
        import lm_eval
        from lm_eval.tasks import TaskManager

        cwd = os.getcwd()
        os.chdir(TASK_DIR)  # the task's data_files are relative to it
        try:
            tasks = TaskManager(include_path=TASK_DIR)

            def run(model, model_args):
                out = lm_eval.simple_evaluate(model=model, model_args=model_args,
                                              tasks=["vlmgraph_capitals"], task_manager=tasks,
                                              batch_size=1, log_samples=True)
                samples = sorted(out["samples"]["vlmgraph_capitals"], key=lambda s: s["doc_id"])
                return [[resp[0][0] for resp in s["resps"]] for s in samples]

            served = run("local-completions",
                         f"model=tiny,base_url={Fixture.base}/v1/completions,"
                         f"tokenizer={Fixture.directory},tokenizer_backend=huggingface,"
                         f"max_retries=1,max_length=200")
            local = run("hf", f"pretrained={Fixture.directory},dtype=float32,device=cpu")
        finally:
            os.chdir(cwd)
            shutil.rmtree(cache, ignore_errors=True)
        self.assertEqual(len(served), 5)
        self.assertEqual([len(s) for s in served], [len(s) for s in local])
        worst = max(abs(a - b) for s, l in zip(served, local) for a, b in zip(s, l))
        print(f"lm-eval local-completions vs hf: max |log-likelihood diff| {worst:.3e}", flush=True)
        for doc, (s, l) in enumerate(zip(served, local)):
            for choice, (a, b) in enumerate(zip(s, l)):
                self.assertTrue(close(a, b), f"doc {doc} choice {choice}: {a} vs {b}")


if __name__ == "__main__":
    unittest.main()
