"""The nanovlm-tiny fixture checkpoint with a small byte-level BPE tokenizer of its vocabulary, so
that chat examples can be tokenized for it (tests/server_text_test.cc builds the same tokenizer in
C++): ids 0..255 are the bytes (GPT-2's byte-to-unicode symbols), <|im_start|> / <|im_end|> are 256 /
257, nanoVLM's extra tokens start at lm_base_vocab_size. The chat template is the model's
lm_chat_template (ChatML without a default system message)."""
import json
import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.normpath(os.path.join(HERE, "..", "fixtures", "nanovlm-tiny"))


def byte_symbols():
    """GPT-2's bytes_to_unicode: byte -> printable symbol."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def tokenizer_json(config):
    sym = byte_symbols()
    vocab = {sym[b]: b for b in range(256)}
    added = []

    def add(i, text):
        added.append({"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True})

    add(256, "<|im_start|>")
    add(257, "<|im_end|>")
    for k, text in enumerate(config["vlm_extra_tokens"].values()):
        add(config["lm_base_vocab_size"] + k, text)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                      "merges": []}}


def make_tiny_text_model(out_dir, max_img_size=None):
    """Copies the fixture to `out_dir` with tokenizer.json; `max_img_size` (pixels) lowers the
    image resize so one small image is one tile. Returns out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    shutil.copy(os.path.join(FIXTURE, "model.safetensors"), out_dir)
    with open(os.path.join(FIXTURE, "config.json")) as fh:
        config = json.load(fh)
    if max_img_size is not None:
        config["max_img_size"] = max_img_size
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(config, fh)
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as fh:
        json.dump(tokenizer_json(config), fh)
    return out_dir
