#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets, tests/fuzz/<target>/*, from small real inputs.

    python3 tests/fuzz/make_seeds.py        # rewrites every seed (regressions/ is left alone)

Needs Pillow, numpy and grpcio-tools (scripts/install-deps.sh installs them). The output is
deterministic, so re-running it changes nothing unless this script changed. Seeds per target:
  image           tiny PNGs (RGB, RGBA, grey, palette, 16-bit) and JPEGs (baseline, progressive, grey)
  safetensors     small files of every supported dtype, with metadata, an empty one
  config          deploy/config*.yaml and a few short configurations
  tokenizer_json  the tiny byte-level tokenizer of fuzz_util.h and one with every component
  tokenizer_text  a flags byte, then text (ASCII, added tokens, digits, Unicode, invalid UTF-8)
  openai          an endpoint byte, then a JSON body of /v1/chat/completions (with a data-URL
                  image), /v1/completions, /tokenize or /detokenize
  convert         a message-type byte, then a serialized GenerateRequest / ForwardRequest /
                  TrainRequest (input ids, text, chat, encoded and tensor images, SaveCheckpoint)
  chat_prompt     FuzzedDataProvider input: the nanoVLM ChatML template, then message bytes
"""
import base64
import io
import json
import os
import shutil
import struct
import sys

import numpy as np
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))


def write(target, name, data):
    d = os.path.join(HERE, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def clear(target):
    d = os.path.join(HERE, target)
    if os.path.isdir(d):
        for f in os.listdir(d):
            if os.path.isfile(os.path.join(d, f)):
                os.remove(os.path.join(d, f))


# --- images -----------------------------------------------------------------------------------

def gradient(w, h, mode):
    rng = np.random.default_rng(w * 1000 + h)
    a = rng.integers(0, 256, size=(h, w, 4), dtype=np.uint8)
    img = Image.fromarray(a, "RGBA")
    return img.convert(mode) if mode != "RGBA" else img


def encode(img, fmt, **kw):
    b = io.BytesIO()
    img.save(b, fmt, **kw)
    return b.getvalue()


def images():
    out = {
        "rgb_1x1.png": encode(gradient(1, 1, "RGB"), "PNG"),
        "rgb_5x3.png": encode(gradient(5, 3, "RGB"), "PNG"),
        "rgba_4x7.png": encode(gradient(4, 7, "RGBA"), "PNG"),
        "grey_9x2.png": encode(gradient(9, 2, "L"), "PNG"),
        "grey_alpha_3x3.png": encode(gradient(3, 3, "LA"), "PNG"),
        "palette_6x6.png": encode(gradient(6, 6, "RGB").convert("P"), "PNG"),
        "grey16_4x4.png": encode(Image.frombytes(
            "I;16", (4, 4), (np.arange(16, dtype="<u2") * 4000).tobytes()), "PNG"),
        "rgb_70x20.png": encode(gradient(70, 20, "RGB"), "PNG"),
        "rgb_8x8.jpg": encode(gradient(8, 8, "RGB"), "JPEG", quality=90),
        "rgb_17x5_progressive.jpg": encode(gradient(17, 5, "RGB"), "JPEG", progressive=True),
        "grey_12x12.jpg": encode(gradient(12, 12, "L"), "JPEG"),
        "rgb_16x16_420.jpg": encode(gradient(16, 16, "RGB"), "JPEG", subsampling=2),
    }
    return out


# --- safetensors ------------------------------------------------------------------------------

def safetensors(tensors, metadata=None):
    header, blobs, offset = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, (dtype, arr) in tensors.items():
        raw = arr.tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def safetensors_seeds():
    a = np.arange(6)
    return {
        "floats.safetensors": safetensors({
            "w.f32": ("F32", a.astype("<f4").reshape(2, 3)),
            "w.f64": ("F64", a.astype("<f8")),
            "w.f16": ("F16", a.astype("<f2").reshape(3, 2)),
            "w.bf16": ("BF16", (a.astype("<f4").view("<u4") >> 16).astype("<u2")),
        }, {"format": "pt"}),
        "ints.safetensors": safetensors({
            "i64": ("I64", a.astype("<i8")), "i32": ("I32", a.astype("<i4")),
            "i16": ("I16", a.astype("<i2")), "i8": ("I8", a.astype("i1")),
            "u8": ("U8", a.astype("u1").reshape(1, 2, 3)), "b": ("BOOL", (a % 2).astype("u1")),
            "scalar": ("F32", np.array(1.5, dtype="<f4")),
            "empty": ("F32", np.zeros((0, 4), dtype="<f4")),
        }),
        "empty.safetensors": safetensors({}),
        "metadata_only.safetensors": safetensors({}, {"a": "b", "step": "12"}),
    }


# --- tokenizers -------------------------------------------------------------------------------

def byte_level_text(b):
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    if b in printable:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


def tiny_config():
    with open(os.path.join(ROOT, "tests", "fixtures", "nanovlm-tiny", "config.json")) as f:
        return json.load(f)


def tiny_tokenizer():
    """The same tokenizer as fuzz_util.h's TinyTokenizerJson()."""
    cfg = tiny_config()
    vocab = {byte_level_text(b): b for b in range(256)}
    sp = byte_level_text(ord(" "))
    merges = [("t", "h"), ("h", "e"), ("th", "e"), ("i", "n"), (sp, "t")]
    for i, (a, b) in enumerate(merges):
        vocab[a + b] = 258 + i

    def added(i, text, special=True, single_word=False, lstrip=False, rstrip=False,
              normalized=False):
        return {"id": i, "content": text, "single_word": single_word, "lstrip": lstrip,
                "rstrip": rstrip, "normalized": normalized, "special": special}

    tokens = [added(256, "<|im_start|>"), added(257, "<|im_end|>")]
    image_token_id = cfg.get("image_token_id", cfg["lm_base_vocab_size"])
    for k, text in enumerate(cfg["vlm_extra_tokens"].values()):
        tokens.append(added(image_token_id + k, text))
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": tokens,
            "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None,
            "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges]}}, added


def full_tokenizer():
    j, added = tiny_tokenizer()
    j["added_tokens"] = j["added_tokens"][:2] + [
        added(263, "<s>"), added(264, "word", special=False, single_word=True),
        added(265, "<mask>", lstrip=True, rstrip=True),
        added(266, "\ufb01x", special=False, normalized=True)]
    j["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFKC"}]}
    j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\p{N}{1,3}| ?\p{L}+|\s+(?!\S)|\s+"},
         "behavior": "Isolated", "invert": False},
        {"type": "Split", "pattern": {"String": "--"}, "behavior": "Removed", "invert": False},
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": False}]}
    j["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "trim_offsets": False},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [263], "tokens": ["<s>"]}}}]}
    j["model"]["merges"] = [m.split(" ") for m in j["model"]["merges"]]  # the [a, b] form
    # Bytes 0xf8..0xff (never in UTF-8) are left out of the vocab: they encode as <unk>.
    for b in range(0xF8, 0x100):
        del j["model"]["vocab"][byte_level_text(b)]
    j["model"]["vocab"]["<unk>"] = 267
    j["model"]["unk_token"] = "<unk>"
    j["model"]["fuse_unk"] = True
    return j


# --- requests ---------------------------------------------------------------------------------

def data_url(png):
    return "data:image/png;base64," + base64.b64encode(png).decode()


def openai_seeds(png):
    chat, completion, tokenize, detokenize = b"\x00", b"\x01", b"\x02", b"\x03"
    bodies = {
        "chat_text.json": chat + json.dumps({
            "model": "tiny-chat", "messages": [
                {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 3,
            "stop": ["\n\n", "the"], "stop_token_ids": [257], "stream": True,
            "stream_options": {"include_usage": True}}).encode(),
        "chat_image.json": chat + json.dumps({
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": data_url(png)}}]},
                {"role": "assistant"}, {"role": "developer", "content": "x"}],
            "max_completion_tokens": 4.0, "n": 1}).encode(),
        "completion_text.json": completion + json.dumps({
            "model": "tiny-chat", "prompt": "Once upon a time", "max_tokens": 16,
            "temperature": 0, "ignore_eos": True}).encode(),
        "completion_ids.json": completion + json.dumps({"prompt": [[1, 2, 3, 300]]}).encode(),
        "tokenize_prompt.json": tokenize + json.dumps(
            {"prompt": "<|im_start|>hi the thing", "add_special_tokens": False}).encode(),
        "tokenize_messages.json": tokenize + json.dumps({
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": data_url(png)}, {"type": "text", "text": "x"}]}],
            "add_generation_prompt": False}).encode(),
        "detokenize.json": detokenize + json.dumps({"tokens": [104, 105, 257, 1000, 5.0]}).encode(),
    }
    return bodies


def convert_seeds(png, jpg):
    from vlmgraph_client import protos
    pb = protos.load()
    g, f, t = pb.generate_pb2, pb.forward_pb2, pb.train_pb2
    img = pb.image_pb2
    cfg = tiny_config()
    image_token = cfg.get("image_token_id", cfg["lm_base_vocab_size"])
    tokens = cfg["mp_image_token_length"]
    tensor = img.Image(tensor=img.FloatTensor(shape=[3, 2, 3], values=[0.5] * 18))
    out = {
        "generate_ids_png.bin": b"\x00" + g.GenerateRequest(
            input_ids=[1, 2] + [image_token] * tokens + [3],
            images=[img.Image(encoded=png)],
            sampling=g.SamplingParams(max_new_tokens=4, sample=True, temperature=0.8, top_k=3,
                                      top_p=0.9, seed=1, stop_token_ids=[7], stop=["x"]),
        ).SerializeToString(),
        "generate_text_jpeg.bin": b"\x00" + g.GenerateRequest(
            text="Describe:", images=[img.Image(encoded=jpg), tensor]).SerializeToString(),
        "generate_chat.bin": b"\x00" + g.GenerateRequest(
            messages=[pb.chat_pb2.ChatMessage(role="user", content=[
                pb.chat_pb2.ContentPart(text="What is in "),
                pb.chat_pb2.ContentPart(image=img.Image(encoded=png)),
                pb.chat_pb2.ContentPart(text="?")])],
            add_generation_prompt=True).SerializeToString(),
        "forward_ids.bin": b"\x01" + f.ForwardRequest(
            input_ids=[5, 6, 7, 8], logits_positions=[0, 3], target_next_tokens=True
        ).SerializeToString(),
        "forward_chat_tensor.bin": b"\x01" + f.ForwardRequest(
            messages=[pb.chat_pb2.ChatMessage(role="user", content=[
                pb.chat_pb2.ContentPart(image=tensor)])], target_ids=[1]).SerializeToString(),
        "train_batch.bin": b"\x02" + t.TrainRequest(batch=t.TrainBatch(examples=[
            t.TrainExample(input_ids=[image_token] * tokens + [9, 10],
                           target_ids=[-100] * tokens + [10, 11], images=[img.Image(encoded=png)]),
            t.TrainExample(input_ids=[1, 2, 3], target_ids=[2, 3, -100])])).SerializeToString(),
        "train_save.bin": b"\x02" + t.TrainRequest(
            save=t.SaveCheckpoint(directory="run1/step_100")).SerializeToString(),
        "generate_no_tokenizer.bin": b"\x04" + g.GenerateRequest(text="hi").SerializeToString(),
    }
    return out


def chat_prompt_seeds():
    # FuzzedDataProvider: ConsumeRandomLengthString reads up to a backslash followed by another
    # character (a doubled backslash is one backslash); integers are taken from the end.
    tmpl = tiny_config()["lm_chat_template"]
    smollm = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' "
              "%}{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by "
              "Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' "
              "+ message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if "
              "add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

    def seed(t, rest):
        return t.replace("\\", "\\\\").encode() + b"\\x" + rest

    body = b"hello <|image|> world\\xthe prompt" + bytes(range(0, 64, 3))
    return {"nanovlm_template.bin": seed(tmpl, body),
            "smollm2_template.bin": seed(smollm, body[::-1]),
            "not_chatml.bin": seed("{{ messages }}", body)}


def main():
    png = images()["rgb_5x3.png"]
    jpg = images()["rgb_8x8.jpg"]
    seeds = {
        "image": images(),
        "safetensors": safetensors_seeds(),
        "config": {
            "config.yaml": open(os.path.join(ROOT, "deploy", "config.yaml"), "rb").read(),
            "config-throughput.yaml":
                open(os.path.join(ROOT, "deploy", "config-throughput.yaml"), "rb").read(),
            "minimal.yaml": "model: nanovlm-tiny\n",
            "flow.yaml": "{model: nanovlm-tiny, buckets: {seq_lens: [16, 32], context_lens: [64]},"
                         " limits: {max_image_bytes: 1024}, server: {http_address: ''}}\n",
            "empty.yaml": "",
        },
        "tokenizer_json": {
            "tiny.json": json.dumps(tiny_tokenizer()[0], ensure_ascii=False),
            "full.json": json.dumps(full_tokenizer(), ensure_ascii=False),
        },
        "tokenizer_text": {
            "ascii.txt": b"\x00Hello world, the thing is in the thin inn.",
            "special.txt": b"\x01<|im_start|>user\nhi<s> a word <mask> \xef\xac\x81x<|im_end|>",
            "digits_unicode.txt": "\x0312345 caf\u00e9 \u00bd \U0001F600 \u0661\u0662\n\n\t x".encode(),
            "invalid_utf8.txt": b"\x06ab\xc3(\xff\xfe\xed\xa0\x80z",
        },
        "openai": openai_seeds(png),
        "convert": convert_seeds(png, jpg),
        "chat_prompt": chat_prompt_seeds(),
    }
    for target, files in seeds.items():
        clear(target)
        for name, data in files.items():
            write(target, name, data)
        print(f"{target}: {len(files)} seeds")


if __name__ == "__main__":
    main()
