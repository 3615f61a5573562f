#!/usr/bin/env python3
"""A transformers Llama checkpoint served as it is (model/hf_checkpoint.h), against transformers.

Tiny random LlamaForCausalLM models (2 layers, hidden 64, 4 query / 2 key-value heads, vocabulary
1000, norm weights away from 1 so that a swapped norm shows) are written by transformers'
save_pretrained: one with a tied head in one model.safetensors, one with its own head in bfloat16
shards with model.safetensors.index.json. Each directory is served by the real
vlmgraph-server (`model: <dir>`, float32, CPU) and compared with transformers' float32 forward pass:
- logits: gRPC Forward at every prompt position vs the model's logits, max |difference| <= 1e-4
  over the model's own vocabulary (the served model adds nanoVLM's 66 VLM tokens after it);
- greedy tokens: gRPC Generate (8 tokens) vs transformers' generate, identical.
The tied model's directory also holds a byte-level BPE tokenizer.json and SmolLM2's chat template
(chat_template.jinja), as a fine-tuned SmolLM2 saved by transformers 5 does: the OpenAI-compatible
chat endpoint answers, and its prompt has the token count of transformers' apply_chat_template.

CTest: `parity_hf_checkpoint` (tests/parity/run.py test_hf_checkpoint).
"""
import importlib.util
import json
import os
import shutil
import sys
import unittest
import urllib.request
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))

import e2e_util  # noqa: E402

LOGIT_BOUND = 1e-4
GREEDY_TOKENS = 8
VOCAB = 1000
VLM_TOKENS = 66  # nanoVLM's extra tokens: image, global image, 8 x 8 grid
PROMPT = [1, 17, 993, 250, 4, 4, 731, 88, 402, 999, 0, 612, 37, 845, 123, 9, 560, 77, 301, 42]
# SmolLM2-135M-Instruct's chat template (ChatML with a default system turn).
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = ["The capital of France is Paris.", "Write a haiku about the sea.",
          "List three prime numbers greater than 10.", "Explain why the sky is blue.",
          "Good morning, how are you today?",
          "You are a helpful AI assistant named SmolLM, trained by Hugging Face"] * 20


def tiny_llama(tied, seed, vocab=VOCAB, **overrides):
    """A random float32 LlamaForCausalLM. Norm weights are drawn around 1 (transformers starts them
    at 1, where input_layernorm and post_attention_layernorm could be swapped unseen). Embedding and
    head rows are drawn N(0, 1), not N(0, 0.02): as in a trained model, the vocabulary's logits
    stand out from those of nanoVLM's VLM token rows (N(0, 0.02), never in transformers' argmax),
    so greedy decoding picks the same tokens on both sides."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    overrides.setdefault("max_position_embeddings", 256)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         rms_norm_eps=1e-5, tie_word_embeddings=tied, bos_token_id=1,
                         eos_token_id=2, **overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                p.normal_(0.0, 1.0)
    return model


def write_tokenizer(directory):
    """A byte-level BPE tokenizer.json (< VOCAB tokens, ChatML markers as special tokens),
    tokenizer_config.json and SmolLM2's chat template, as transformers saves a SmolLM2 tokenizer
    (transformers 5: in chat_template.jinja)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                  "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = SMOLLM2_CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def server_config(directory):
    return {"model": directory, "device": "cpu", "dtype": "float32",
            "buckets": {"batch_sizes": [1], "seq_lens": [128], "context_lens": [256],
                        "tile_counts": [1], "train_batch_sizes": [1], "train_seq_lens": [32]},
            "limits": {"max_logits_positions": 32, "max_new_tokens": GREEDY_TOKENS,
                       "default_max_new_tokens": GREEDY_TOKENS}}


class HfCheckpointParityTest(unittest.TestCase):
    """Each directory served and compared with transformers (module docstring)."""

    @classmethod
    def setUpClass(cls):
        for module in ("transformers", "tokenizers", "safetensors", "torch"):
            e2e_util.require(importlib.util.find_spec(module) is not None, f"python package {module}")
        import transformers
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        cls.dir = e2e_util.scratch_dir("hf-checkpoint")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def save(self, name, model, **kwargs):
        directory = os.path.join(self.dir, name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.save_pretrained(directory, **kwargs)
        return directory

    def reference(self, model, prompt):
        """transformers' float32 logits at every prompt position and its greedy tokens (the end of
        sequence id given is one past the vocabulary: it never comes)."""
        import torch

        ids = torch.tensor([prompt])
        never = model.config.vocab_size
        with torch.no_grad():
            logits = model.float()(ids).logits[0].numpy()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=GREEDY_TOKENS, eos_token_id=never,
                                 pad_token_id=never)
        return logits, [int(t) for t in out[0, len(prompt):]]

    def check_served(self, directory, model):
        """Serves `directory`; its logits and greedy tokens against `model`'s."""
        import numpy as np

        vocab = model.config.vocab_size
        prompt = [i % vocab for i in PROMPT]
        want_logits, want_tokens = self.reference(model, prompt)
        server = e2e_util.Server(server_config(directory), name="hf-checkpoint").start(timeout=300)
        client = server.client(timeout=120)
        try:
            info = client.model_info()
            self.assertEqual(info.vocab_size, vocab + VLM_TOKENS)
            self.assertEqual(info.image_token_id, vocab)
            resp = client.forward(prompt, logits_positions=range(len(prompt)))
            got = np.array([list(p.logits)[:vocab] for p in resp.logits], dtype=np.float32)
            self.assertEqual(got.shape, want_logits.shape)
            diff = float(np.abs(got - want_logits).max())
            print(f"{os.path.basename(directory)}: max |logit diff| {diff:.3e}", flush=True)
            self.assertLessEqual(diff, LOGIT_BOUND)
            tokens, _ = client.generate_all(prompt, max_new_tokens=GREEDY_TOKENS, sample=False,
                                            ignore_eos=True)
            self.assertEqual(tokens, want_tokens)
            return server, client
        except BaseException:
            server.finish(client)
            raise

    def test_tied_single_file_with_tokenizer(self):
        from transformers import AutoTokenizer

        # The vocabulary is the tokenizer's, as SmolLM2's is, so every generated id decodes.
        directory = os.path.join(self.dir, "tied")
        tokenizer = write_tokenizer(directory)
        model = tiny_llama(tied=True, seed=1, vocab=len(tokenizer), rope_theta=5000.0)
        self.save("tied", model)
        server, client = self.check_served(directory, model)
        try:
            messages = [{"role": "user", "content": "What is the capital of France?"}]
            body = json.dumps({"model": "tied", "messages": messages, "max_tokens": 4,
                               "temperature": 0}).encode()
            req = urllib.request.Request(f"http://{server.http_address}/v1/chat/completions",
                                         data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                answer = json.load(r)
            want = AutoTokenizer.from_pretrained(directory).apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            if hasattr(want, "keys"):
                want = want["input_ids"]
            self.assertEqual(answer["usage"]["prompt_tokens"], len(want))
            finish = answer["choices"][0]["finish_reason"]
            completion = answer["usage"]["completion_tokens"]
            self.assertIn(finish, ("stop", "length"))
            self.assertEqual(completion == 4, finish == "length", answer)
            self.assertIsInstance(answer["choices"][0]["message"]["content"], str)
        finally:
            server.finish(client)

    def test_untied_sharded_bfloat16(self):
        import torch

        model = tiny_llama(tied=False, seed=2).to(torch.bfloat16)
        directory = self.save("untied-sharded-bf16", model, max_shard_size="50KB")
        self.assertTrue(os.path.isfile(os.path.join(directory, "model.safetensors.index.json")))
        # The server converts the stored bfloat16 weights to float32, as transformers' float().
        server, client = self.check_served(directory, model)
        server.finish(client)

if __name__ == "__main__":
    unittest.main()
