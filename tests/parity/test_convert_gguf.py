#!/usr/bin/env python3
"""tools/convert_gguf.py on small synthetic GGUF files written with the gguf package's GGUFWriter
(no server): upstream's default config and key list (tests/fixtures), q/k rows back in Hugging
Face order, tied and untied heads, the vocabulary extension, the tokenizer, the cache stamp, and
the refusals (architecture, tokenizer model, pre-tokenizer, stray tensors, options)."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))

import e2e_util  # noqa: E402

import numpy as np  # noqa: E402

import convert_gguf  # noqa: E402

HIDDEN, HEADS, KV_HEADS, FFN, BLOCKS, CONTEXT = 64, 4, 2, 96, 2, 256
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
            "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}")


def setUpModule():
    for module in ("gguf", "safetensors", "tokenizers", "transformers"):
        e2e_util.require(importlib.util.find_spec(module) is not None, f"python package {module}")


def llama_cpp_permute(w, n_head):
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (the q/k row order it stores)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_vocab():
    """Control tokens, GPT-2's 256 byte characters, a few merges and a user-defined token."""
    alphabet = list(convert_gguf.byte_alphabet().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ 1", "1 2"]
    merged = ["Ġt", "he", "Ġthe", "in", "Ġa", "er", "on", "Ġ1", "12"]
    tokens = CONTROL + alphabet + merged + ["<think>"]
    types = [3] * len(CONTROL) + [1] * (len(alphabet) + len(merged)) + [4]
    return tokens, types, merges


def write_gguf(path, arch="llama", tokenizer_model="gpt2", pre="gpt2", tied=True, extra_tensor=None,
               quantize=True, rng_seed=0):
    """A 2-block llama GGUF; returns the Hugging Face-order weights it encodes by HF name."""
    import gguf

    rng = np.random.Generator(np.random.PCG64(rng_seed))
    tokens, types, merges = tiny_vocab()
    vocab = len(tokens)
    w = gguf.GGUFWriter(path, arch)
    w.add_name("Tiny Test Model")
    w.add_block_count(BLOCKS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    hf = {}
    kv = HIDDEN // HEADS * KV_HEADS

    def tensor(name, hf_name, shape, permute_heads=None, quant=None):
        a = rng.standard_normal(size=shape).astype(np.float32) * 0.05
        if len(shape) == 1:
            a += 1.0
        stored = llama_cpp_permute(a, permute_heads) if permute_heads else a
        if quant is not None and quantize:
            q = gguf.quants.quantize(stored, quant)
            a = gguf.quants.dequantize(q, quant).reshape(shape)
            if permute_heads:  # the HF-order values the quantized file encodes
                a = convert_gguf.reverse_permute(a, permute_heads)
            w.add_tensor(name, q, raw_dtype=quant)
        else:
            w.add_tensor(name, np.ascontiguousarray(stored))
        hf[hf_name] = a

    Q8 = gguf.GGMLQuantizationType.Q8_0
    tensor("token_embd.weight", "model.embed_tokens.weight", (vocab, HIDDEN), quant=Q8)
    for i in range(BLOCKS):
        s, h = f"blk.{i}.", f"model.layers.{i}."
        tensor(s + "attn_norm.weight", h + "input_layernorm.weight", (HIDDEN,))
        tensor(s + "attn_q.weight", h + "self_attn.q_proj.weight", (HIDDEN, HIDDEN), HEADS, Q8)
        tensor(s + "attn_k.weight", h + "self_attn.k_proj.weight", (kv, HIDDEN), KV_HEADS)
        tensor(s + "attn_v.weight", h + "self_attn.v_proj.weight", (kv, HIDDEN))
        tensor(s + "attn_output.weight", h + "self_attn.o_proj.weight", (HIDDEN, HIDDEN))
        tensor(s + "ffn_norm.weight", h + "post_attention_layernorm.weight", (HIDDEN,))
        tensor(s + "ffn_gate.weight", h + "mlp.gate_proj.weight", (FFN, HIDDEN), quant=Q8)
        tensor(s + "ffn_up.weight", h + "mlp.up_proj.weight", (FFN, HIDDEN))
        tensor(s + "ffn_down.weight", h + "mlp.down_proj.weight", (HIDDEN, FFN))
    tensor("output_norm.weight", "model.norm.weight", (HIDDEN,))
    if not tied:
        tensor("output.weight", "lm_head.weight", (vocab, HIDDEN))
    if extra_tensor:
        tensor(extra_tensor, extra_tensor, (HIDDEN,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def run_converter(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_gguf.py"), *args],
                          capture_output=True, text=True, timeout=600)


class UpstreamLayoutTest(unittest.TestCase):
    def test_default_config_is_upstreams(self):
        with open(os.path.join(FIXTURES, "nanovlm-default-config.json")) as fh:
            fixture = json.load(fh)
        ours = convert_gguf.upstream_default_config()
        self.assertEqual(list(ours), list(fixture))
        self.assertEqual(ours, fixture)
        self.assertEqual(list(ours["vlm_extra_tokens"]), list(fixture["vlm_extra_tokens"]))

    def test_key_list_is_upstreams(self):
        fixture = {}
        with open(os.path.join(FIXTURES, "nanovlm-default-keys.txt")) as fh:
            for line in fh:
                if line.startswith("#") or not line.strip():
                    continue
                name, shape, _ = line.rstrip("\n").split("\t")
                fixture[name] = tuple(json.loads(shape))
        cfg = convert_gguf.upstream_default_config()
        ours = {name: tuple(shape) for name, (shape, _) in convert_gguf.vision_shapes(cfg).items()}
        ours.update({k: tuple(v) for k, v in convert_gguf.language_shapes(cfg).items()})
        # The state dict names the tied matrix twice; the file stores it once (decoder.head.weight).
        ours["decoder.token_embedding.weight"] = ours["decoder.head.weight"]
        self.assertEqual(ours, fixture)


class ConvertTinyGgufTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = e2e_util.scratch_dir("convert-gguf")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def convert(self, name, *options, **gguf_kwargs):
        src = os.path.join(self.dir, name + ".gguf")
        hf = write_gguf(src, **gguf_kwargs)
        out = os.path.join(self.dir, name)
        run = run_converter(src, out, *options)
        return src, out, hf, run

    def load(self, out):
        from safetensors.numpy import load_file
        from safetensors import safe_open

        with open(os.path.join(out, "config.json")) as fh:
            cfg = json.load(fh)
        with safe_open(os.path.join(out, "model.safetensors"), "np") as f:
            metadata = f.metadata()
        return cfg, load_file(os.path.join(out, "model.safetensors")), metadata

    def test_tied_conversion(self):
        src, out, hf, run = self.convert("tied", "--seed", "3")
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertIn("tokenizer check PASS", run.stdout)
        cfg, t, metadata = self.load(out)
        vocab = len(tiny_vocab()[0])
        self.assertEqual((cfg["lm_hidden_dim"], cfg["lm_inter_dim"], cfg["lm_n_heads"], cfg["lm_n_kv_heads"],
                          cfg["lm_n_blocks"], cfg["lm_max_position_embeddings"], cfg["lm_max_length"]),
                         (HIDDEN, FFN, HEADS, KV_HEADS, BLOCKS, CONTEXT, CONTEXT))
        self.assertEqual((cfg["lm_base_vocab_size"], cfg["lm_vocab_size"]), (vocab, vocab + 66))
        self.assertEqual((cfg["lm_rms_eps"], cfg["lm_re_base"], cfg["lm_tie_weights"]), (1e-6, 10000, True))
        self.assertEqual(cfg["lm_model_type"], "Tiny-Test-Model")
        self.assertEqual(metadata.get("decoder.token_embedding.weight"), "decoder.head.weight")
        self.assertNotIn("decoder.token_embedding.weight", t)
        emb = t["decoder.head.weight"]
        self.assertEqual(emb.shape, (vocab + 66, HIDDEN))
        np.testing.assert_array_equal(emb[:vocab], hf["model.embed_tokens.weight"])
        self.assertLess(abs(float(emb[vocab:].std()) - 0.02), 0.005)
        for i in range(BLOCKS):
            for ours, theirs in [("attn.q_proj", "self_attn.q_proj"), ("attn.k_proj", "self_attn.k_proj"),
                                 ("attn.v_proj", "self_attn.v_proj"), ("attn.out_proj", "self_attn.o_proj"),
                                 ("mlp.gate_proj", "mlp.gate_proj"), ("mlp.up_proj", "mlp.up_proj"),
                                 ("mlp.down_proj", "mlp.down_proj"), ("norm1", "input_layernorm"),
                                 ("norm2", "post_attention_layernorm")]:
                np.testing.assert_array_equal(t[f"decoder.blocks.{i}.{ours}.weight"],
                                              hf[f"model.layers.{i}.{theirs}.weight"], err_msg=ours)
        expected = {n: tuple(s) for n, (s, _) in convert_gguf.vision_shapes(cfg).items()}
        expected.update({n: tuple(s) for n, s in convert_gguf.language_shapes(cfg).items()})
        self.assertEqual({n: a.shape for n, a in t.items()}, expected)
        self.assertTrue(all(a.dtype == np.float32 for a in t.values()))
        pos = t["vision_encoder.patch_embedding.position_embedding"]
        self.assertTrue(0.0 <= pos.min() and pos.max() < 1.0)
        self.assertEqual(float(np.abs(t["vision_encoder.blocks.0.attn.qkv_proj.bias"]).max()), 0.0)
        np.testing.assert_array_equal(t["vision_encoder.layer_norm.weight"], 1.0)
        self.assertLess(abs(float(t["MP.proj.weight"].std()) - 0.02), 0.002)

        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
        self.assertEqual(tok.token_to_id("<|image|>"), vocab)
        self.assertEqual(tok.token_to_id("<row_8_col_8>"), vocab + 65)
        self.assertEqual(tok.encode("<|im_start|>the<think>").ids[0], 1)
        with open(os.path.join(out, "tokenizer_config.json")) as fh:
            tc = json.load(fh)
        self.assertEqual((tc["bos_token"], tc["eos_token"], tc["chat_template"]),
                         ("<|im_start|>", "<|endoftext|>", TEMPLATE))
        self.assertEqual(tc["extra_special_tokens"]["r1c2"], "<row_1_col_2>")
        with open(os.path.join(out, "generation_config.json")) as fh:
            self.assertEqual(json.load(fh)["eos_token_id"], [0, 2])

        # Cached: a second run does nothing; another seed converts again, deterministically.
        again = run_converter(src, out, "--seed", "3")
        self.assertEqual(again.returncode, 0, again.stderr)
        self.assertIn("up to date", again.stdout)
        other = run_converter(src, out, "--seed", "4")
        self.assertIn("wrote", other.stdout)
        t4 = self.load(out)[1]
        self.assertFalse(np.array_equal(t4["MP.proj.weight"], t["MP.proj.weight"]))
        run_converter(src, out, "--seed", "3")
        np.testing.assert_array_equal(self.load(out)[1]["MP.proj.weight"], t["MP.proj.weight"])
        self.assertEqual(sorted(os.listdir(self.dir)), sorted(n for n in os.listdir(self.dir)
                                                             if not n.startswith(".")))

    def test_untied_head_and_bpe_variants(self):
        _, out, hf, run = self.convert("untied", tied=False, pre="llama-bpe", quantize=False)
        self.assertEqual(run.returncode, 0, run.stderr)
        cfg, t, _ = self.load(out)
        vocab = cfg["lm_base_vocab_size"]
        self.assertFalse(cfg["lm_tie_weights"])
        np.testing.assert_array_equal(t["decoder.head.weight"][:vocab], hf["lm_head.weight"])
        np.testing.assert_array_equal(t["decoder.token_embedding.weight"][:vocab],
                                      hf["model.embed_tokens.weight"])
        _, _, _, run = self.convert("smollm", pre="smollm")
        self.assertEqual(run.returncode, 0, run.stderr)

    def test_refusals(self):
        cases = [
            ({"arch": "qwen2"}, (), "architecture 'qwen2' is not supported"),
            ({"tokenizer_model": "llama"}, (), "tokenizer.ggml.model 'llama' is not supported"),
            ({"pre": "jais"}, (), "tokenizer.ggml.pre 'jais' is not supported"),
            ({"extra_tensor": "blk.0.attn_q.bias"}, (), "no place for: blk.0.attn_q.bias"),
            ({}, ("--lm-max-length", "512"), "--lm-max-length 512 must lie in [1, 256]"),
            ({}, ("--max-img-size", "8192"), "at most 8 x 8 tiles"),
        ]
        for k, (gguf_kwargs, options, message) in enumerate(cases):
            _, out, _, run = self.convert(f"bad{k}", *options, **gguf_kwargs)
            self.assertEqual(run.returncode, 1, run.stdout)
            self.assertIn(message, run.stderr)
            self.assertFalse(os.path.exists(out))
        # A directory the converter did not write is kept unless --force.
        foreign = os.path.join(self.dir, "foreign")
        os.makedirs(foreign)
        with open(os.path.join(foreign, "keep.txt"), "w") as fh:
            fh.write("x")
        src = os.path.join(self.dir, "tied-src.gguf")
        write_gguf(src)
        run = run_converter(src, foreign)
        self.assertEqual(run.returncode, 1)
        self.assertIn("pass --force", run.stderr)
        run = run_converter(src, foreign, "--force")
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertFalse(os.path.exists(os.path.join(foreign, "keep.txt")))


if __name__ == "__main__":
    unittest.main()
