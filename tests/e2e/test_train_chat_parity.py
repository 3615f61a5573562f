"""Chat conversations -> training ids and targets (text/chat_format.h TokenizeForTraining, through
`vlmgraph-train --dump-examples`) against the reference: upstream nanoVLM's masking code
(data/datasets.py: BaseDataset._get_prefix_len, _prepare_inputs_and_loss_mask, VQADataset._get_labels,
reproduced below) run with transformers' apply_chat_template and the Hugging Face tokenizer of
SmolLM2-135M-Instruct (tools/convert_gguf.py's checkpoint), and transformers' rendering of
SmolLM2's own template (its default system message) for the ids."""
import json
import os
import shutil
import subprocess
import unittest

from e2e_util import converted_model, require, scratch_dir
from test_train_entry import TRAIN, png

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Count to three.\n"},
     {"role": "assistant", "content": " One, two, three.\n\n"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "square.png"}},
                                  {"type": "text", "text": "Describe the image."}]},
     {"role": "assistant", "content": "Noise, mostly. 42 dots; café ☕"},
     {"role": "user", "content": "Thanks"}],
    [{"role": "assistant", "content": "I start the conversation."},
     {"role": "user", "content": "ok"},
     {"role": "assistant", "content": ""}],
]


def upstream_inputs_and_labels(tokenizer, messages):
    """Upstream nanoVLM's BaseDataset masking and VQADataset labels, on transformers."""
    probe = "xzyvd"
    templated = tokenizer.apply_chat_template([{"role": "assistant", "content": probe}], tokenize=False,
                                              add_special_tokens=False)
    prefix_len = len(tokenizer.encode(templated[:templated.find(probe)]))
    conv_ids = tokenizer.apply_chat_template(messages, tokenize=True, add_special_tokens=False, return_dict=True)
    ids = list(conv_ids["input_ids"])
    mask = [0] * len(ids)
    cursor = 0
    for msg in messages:
        seg_len = len(tokenizer.apply_chat_template([msg], tokenize=True, add_special_tokens=False,
                                                    return_dict=True)["input_ids"])
        if msg["role"] == "assistant":
            mask[cursor + prefix_len:cursor + seg_len] = [1] * (seg_len - prefix_len)
        cursor += seg_len
    labels = [t if m else -100 for t, m in zip(ids, mask)]
    labels = labels[1:] + labels[:1]  # roll(-1)
    labels[-1] = -100
    return ids, labels


class ChatTrainingParityTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        try:
            import transformers  # noqa: F401
        except ImportError:
            require(False, "Python package transformers")
        require(os.path.isfile(TRAIN), f"{TRAIN}")
        cls.model_dir = os.path.abspath(converted_model())
        from transformers import AutoTokenizer
        with open(os.path.join(cls.model_dir, "config.json")) as fh:
            cls.cfg = json.load(fh)
        # As upstream's get_tokenizer: nanoVLM's ChatML template (no default system message).
        cls.upstream = AutoTokenizer.from_pretrained(cls.model_dir, chat_template=cls.cfg["lm_chat_template"])
        cls.smollm2 = AutoTokenizer.from_pretrained(cls.model_dir)  # SmolLM2's own template
        cls.dir = scratch_dir("chat-parity")
        with open(os.path.join(cls.dir, "square.png"), "wb") as fh:
            fh.write(png(32, 32, 7))
        with open(os.path.join(cls.dir, "data.jsonl"), "w") as fh:
            for messages in CONVERSATIONS:
                fh.write(json.dumps({"messages": messages}) + "\n")
        with open(os.path.join(cls.dir, "train.yaml"), "w") as fh:
            fh.write(f"model: {cls.model_dir}\ntrain:\n  dataset: data.jsonl\n")
        out = subprocess.run([TRAIN, "--config", os.path.join(cls.dir, "train.yaml"), "--dump-examples"],
                             capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise AssertionError(out.stderr)
        cls.dumped = [json.loads(line) for line in out.stdout.splitlines()]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def image_string(self, grids):
        """Upstream's get_image_string for one prompt."""
        tok = self.cfg["vlm_extra_tokens"]
        out = ""
        for i, (rows, cols) in enumerate(grids):
            if len(grids) > 1:
                out += f"<image: {i}>"
            out += tok["global_image_token"] + tok["image_token"] * self.cfg["mp_image_token_length"]
            if rows == 1 and cols == 1:
                continue
            for r in range(rows):
                for c in range(cols):
                    out += tok[f"r{r + 1}c{c + 1}"] + tok["image_token"] * self.cfg["mp_image_token_length"]
        return out

    def reference_messages(self, messages, tiles):
        """The conversation as upstream's dataset hands it to apply_chat_template: string contents,
        the image string in place of the image part, SmolLM2's default system message first when
        the conversation has none (what SmolLM2's template renders)."""
        self.assertIn(tiles, (0, 1))  # a 32 px square is one tile: grid 1 x 1
        out = []
        for m in messages:
            content = m["content"]
            if not isinstance(content, str):
                content = "".join(p["text"] if p["type"] == "text" else self.image_string([(1, 1)]) for p in content)
            out.append({"role": m["role"], "content": content})
        if out[0]["role"] != "system":
            default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
            out.insert(0, {"role": "system", "content": default})
        return out

    def test_ids_and_targets_match_upstream(self):
        self.assertEqual(len(self.dumped), len(CONVERSATIONS))
        for messages, got in zip(CONVERSATIONS, self.dumped):
            with self.subTest(conversation=got["index"]):
                ref = self.reference_messages(messages, got["tiles"])
                ids, labels = upstream_inputs_and_labels(self.upstream, ref)
                self.assertEqual(got["input_ids"], ids)
                self.assertEqual(got["targets"], labels)
                self.assertGreater(sum(t != -100 for t in labels), 0)

    def test_ids_match_smollm2_template(self):
        for messages, got in zip(CONVERSATIONS, self.dumped):
            if got["tiles"]:
                continue
            with self.subTest(conversation=got["index"]):
                ids = self.smollm2.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
                self.assertEqual(got["input_ids"], list(ids))

    def test_assistant_turn_targets_are_content_end_of_turn_and_newline(self):
        im_end = self.upstream.convert_tokens_to_ids("<|im_end|>")
        got = self.dumped[0]
        counted = [t for t in got["targets"] if t != -100]
        answer = self.upstream.encode("Paris.", add_special_tokens=False)
        newline = self.upstream.encode("\n", add_special_tokens=False)
        self.assertEqual(counted, answer + [im_end] + newline)


if __name__ == "__main__":
    unittest.main()
