"""Command-line client: python3 -m vlmgraph_client [--address HOST:PORT] COMMAND ...

    info                                   model, limits and buckets (JSON)
    chat "Hello!" [--image cat.png]        stream a reply (a model with a tokenizer)
    generate --image cat.png --ids 5,6,7   stream new tokens (image tokens are prepended for you)
    demo                                   chat about (or, without a tokenizer, generate from)
                                           Debian's chelsea.png photo (python3-skimage)
    score --ids 5,6,7,8 [--image F]        loss of the prompt (next-token targets unless --targets)
    train --file data.jsonl                stream a training job; one line per example:
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}},
                      {"type": "text", "text": "What is this?"}]}, {"role": "assistant", "content": "A cat."}]}
                                           a chat (OpenAI format; image paths relative to the file or
                                           data URLs), tokenized by the server, loss on the assistant
        {"text_ids": [...], "images": ["a.png"]}           prompt + next-token targets built for you
        {"input_ids": [...], "target_ids": [...], "images": [...]}   or exactly these
    rollback                               serve the weights from before the last publish
"""
import argparse
import base64
import json
import os
import sys

import grpc
from google.protobuf import json_format

from .client import VlmGraphClient
from .prompt import build_prompt, image_tiles

CHELSEA = "/usr/lib/python3/dist-packages/skimage/data/chelsea.png"


def _ids(text):
    return [int(x) for x in text.split(",") if x.strip()] if text else []


def _read(path):
    with open(path, "rb") as fh:
        return fh.read()


def _prompt(client, info, image_paths, ids, raw):
    images = [_read(p) for p in image_paths]
    if raw:
        return ids, images
    return build_prompt(info, [image_tiles(img, info) for img in images], ids), images


def next_token_targets(input_ids, image_token_id):
    """target[i] = input_ids[i + 1]; -100 for the last position and where the next id is an image token."""
    targets = list(input_ids[1:]) + [-100]
    return [-100 if t == image_token_id else t for t in targets]


def cmd_info(client, args):
    print(json_format.MessageToJson(client.model_info(), preserving_proto_field_name=True))


def cmd_generate(client, args):
    info = client.model_info()
    prompt, images = _prompt(client, info, args.image, _ids(args.ids), args.raw_prompt)
    sampling = dict(max_new_tokens=args.max_new_tokens, sample=args.sample, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_token_ids=_ids(args.stop_ids))
    print(f"prompt: {len(prompt)} tokens, {len(images)} image(s)", file=sys.stderr, flush=True)
    started = False
    for kind, value in client.generate(prompt, images, **sampling):
        if kind == "tokens":
            if not started:
                print("tokens:", end="", flush=True)
                started = True
            print("", " ".join(str(t) for t in value), end="", flush=True)
        else:
            print()
            s = value
            print(f"summary: {s.generated_tokens} tokens, finish {client.pb.generate_pb2.FinishReason.Name(s.finish_reason)}, "
                  f"queue {s.queue_seconds * 1e3:.1f} ms, first token {s.time_to_first_token_seconds * 1e3:.1f} ms, "
                  f"total {s.total_seconds * 1e3:.1f} ms")


def cmd_chat(client, args):
    content = [_read(p) for p in args.image] + [args.message]
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": content}]
    sampling = dict(max_new_tokens=args.max_new_tokens, sample=args.sample, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop)
    summary = None
    for kind, value in client.generate(messages=messages, **{k: v for k, v in sampling.items() if v is not None}):
        if kind == "text":
            print(value, end="", flush=True)
        elif kind == "summary":
            summary = value
    print()
    s = summary
    print(f"[{s.generated_tokens} tokens, finish {client.pb.generate_pb2.FinishReason.Name(s.finish_reason)}, "
          f"first token {s.time_to_first_token_seconds * 1e3:.1f} ms, total {s.total_seconds * 1e3:.1f} ms]",
          file=sys.stderr)


def cmd_demo(client, args):
    if not os.path.isfile(args.image[0]):
        sys.exit(f"{args.image[0]} not found: apt-get install python3-skimage, or pass --image FILE")
    if client.model_info().tokenizer:
        args.message, args.system, args.stop = "Describe this picture in one sentence.", "", []
        args.max_new_tokens = max(args.max_new_tokens or 0, 48)
        cmd_chat(client, args)
        return
    # Seeded sampling by default: a random-weight preset decoded greedily mostly repeats the last
    # prompt token, which looks broken; samples show the stream (and are reproducible).
    args.sample = args.sample or not args.greedy
    cmd_generate(client, args)


def cmd_score(client, args):
    info = client.model_info()
    prompt, images = _prompt(client, info, args.image, _ids(args.ids), args.raw_prompt)
    targets = _ids(args.targets) if args.targets else next_token_targets(prompt, info.image_token_id)
    r = client.forward(prompt, images, target_ids=targets, logits_positions=_ids(args.logits_at))
    out = {"loss": r.loss, "loss_tokens": r.loss_tokens, "bucket": r.bucket, "graphed": r.graphed,
           "total_seconds": r.total_seconds}
    if r.logits:
        out["logits"] = {str(row.position): list(row.logits) for row in r.logits}
    print(json.dumps(out))


def _image_url_bytes(url, base_dir, where):
    """An image_url's bytes: a data URL, a file:// URL or a path relative to `base_dir`."""
    if url.startswith("data:"):
        head, _, data = url.partition(",")
        if not head.endswith(";base64"):
            sys.exit(f"{where}: the data URL must be base64-encoded (data:image/png;base64,...)")
        return base64.b64decode(data)
    if url.startswith(("http://", "https://")):
        sys.exit(f"{where}: remote image URLs are not fetched; give a path relative to the file")
    path = url[len("file://"):] if url.startswith("file://") else url
    return _read(os.path.join(base_dir, path))


def chat_example_messages(messages, base_dir, where):
    """OpenAI-format messages -> the client's message dicts (text parts as str, images as bytes)."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content", "")
        if isinstance(content, str):
            parts = [content]
        else:
            parts = []
            for k, part in enumerate(content):
                if part.get("type") == "text":
                    parts.append(part["text"])
                elif part.get("type") == "image_url":
                    url = part["image_url"]["url"] if isinstance(part["image_url"], dict) else part["image_url"]
                    parts.append(_image_url_bytes(url, base_dir, f"{where}: messages[{i}].content[{k}]"))
                else:
                    sys.exit(f"{where}: messages[{i}].content[{k}].type: use text or image_url")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": parts})
    return out


def _examples(client, info, path):
    base_dir = os.path.dirname(os.path.abspath(path))
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            e = json.loads(line)
            if "messages" in e:
                messages = chat_example_messages(e["messages"], base_dir, f"{path}:{n}")
                images = [p for m in messages for p in m["content"] if isinstance(p, bytes)]
                yield {"messages": messages, "images": images}
                continue
            images = [_read(p) for p in e.get("images", [])]
            if "text_ids" in e:
                ids = build_prompt(info, [image_tiles(img, info) for img in images], e["text_ids"])
                yield {"input_ids": ids, "target_ids": next_token_targets(ids, info.image_token_id), "images": images}
            elif "input_ids" in e and "target_ids" in e:
                yield {"input_ids": e["input_ids"], "target_ids": e["target_ids"], "images": images}
            else:
                sys.exit(f"{path}:{n}: needs messages, text_ids, or input_ids and target_ids")


RATE_FIELDS = ("language_learning_rate", "vision_learning_rate", "projector_learning_rate")


def learning_rates(args):
    """The TrainConfig rates the flags set: --<part>-learning-rate, else --lr for every part; a rate
    neither sets stays unset (the server's defaults, upstream nanoVLM's: docs/training.md)."""
    rates = {}
    for field in RATE_FIELDS:
        value = getattr(args, field)
        if value is None:
            value = args.lr
        if value is not None:
            rates[field] = value
    return rates


def cmd_train(client, args):
    info = client.model_info()
    examples = list(_examples(client, info, args.file))
    # The tile buffer of the graphed step is sized by the example with the most tiles.
    most_tiles = max([sum(image_tiles(img, info) for img in e["images"]) for e in examples] + [1])
    cfg = {"max_tiles_per_example": most_tiles}
    cfg.update(learning_rates(args))
    if args.parts:
        cfg["trainable_parts"] = args.parts.split(",")
    if args.publish:
        cfg["publish_on_end"] = True

    def requests():
        for _ in range(args.epochs):
            for i in range(0, len(examples), args.batch_size):
                yield client.train_batch(examples[i:i + args.batch_size])
        if args.save:
            yield client.train_save(args.save)

    for r in client.train(client.train_config(**cfg), requests()):
        if r.HasField("step"):
            s = r.step
            print(f"step {s.step}: loss {s.loss:.4f} ({s.loss_tokens} tokens), grad norm {s.grad_norm:.3f}, "
                  f"{s.step_seconds * 1e3:.1f} ms, bucket {s.bucket}" + (" (skipped: non-finite gradients)"
                                                                          if s.skipped else ""), flush=True)
        elif r.HasField("published"):
            p = r.published
            gate = (f" (held-out loss {p.gate.served_loss:.4f} -> {p.gate.published_loss:.4f})"
                    if p.HasField("gate") else "")
            print(f"published the weights after {p.step} steps{gate}", flush=True)
        else:
            print(f"saved {r.saved.directory} after {r.saved.step} steps", flush=True)


def cmd_rollback(client, args):
    r = client.rollback_weights()
    print(f"restored {r.tensors} tensors ({r.bytes} bytes) in {r.seconds * 1e3:.1f} ms", flush=True)


def build_parser():
    """The command line's parser (every subcommand and flag)."""
    p = argparse.ArgumentParser(prog="python3 -m vlmgraph_client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default=os.environ.get("VLMGRAPH_ADDRESS", "127.0.0.1:50051"))
    p.add_argument("--timeout", type=float, default=None, help="per-call deadline, seconds")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="model and limits").set_defaults(fn=cmd_info)
    c = sub.add_parser("chat", help="stream the reply to a message (a model with a tokenizer)")
    c.add_argument("message")
    c.add_argument("--image", action="append", default=[], help="an image before the message")
    c.add_argument("--system", default="", help="a system message")
    c.add_argument("--max-new-tokens", type=int, default=256)
    c.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    c.add_argument("--temperature", type=float)
    c.add_argument("--top-k", type=int, default=0)
    c.add_argument("--top-p", type=float)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    c.set_defaults(fn=cmd_chat)
    for name, fn in (("generate", cmd_generate), ("demo", cmd_demo)):
        g = sub.add_parser(name, help="stream generated tokens")
        g.add_argument("--image", action="append", default=[CHELSEA] if name == "demo" else [])
        g.add_argument("--ids", default="1,2,3" if name == "demo" else "", help="text token ids, comma-separated")
        g.add_argument("--raw-prompt", action="store_true", help="--ids is the whole prompt (image tokens included)")
        g.add_argument("--max-new-tokens", type=int, default=16 if name == "demo" else None)
        g.add_argument("--sample", action="store_true")
        if name == "demo":
            g.add_argument("--greedy", action="store_true", help="greedy decoding instead of seeded sampling")
        g.add_argument("--temperature", type=float)
        g.add_argument("--top-k", type=int, default=0)
        g.add_argument("--top-p", type=float)
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--stop-ids", default="")
        g.set_defaults(fn=fn)
    s = sub.add_parser("score", help="loss and logits of a prompt")
    s.add_argument("--image", action="append", default=[])
    s.add_argument("--ids", required=True)
    s.add_argument("--raw-prompt", action="store_true")
    s.add_argument("--targets", default="", help="target ids (default: next-token targets)")
    s.add_argument("--logits-at", default="", help="positions whose logits to print")
    s.set_defaults(fn=cmd_score)
    t = sub.add_parser("train", help="stream a training job from a JSON-lines file")
    t.add_argument("--file", required=True)
    t.add_argument("--batch-size", type=int, default=4)
    t.add_argument("--epochs", type=int, default=1)
    for part, name in (("language", "language model"), ("vision", "vision encoder"), ("projector", "modality projector")):
        t.add_argument(f"--{part}-learning-rate", type=float, default=None, dest=f"{part}_learning_rate",
                       help=f"{name}'s learning rate in [0, 1], 0 freezes it (default: the server's, upstream nanoVLM's)")
    t.add_argument("--lr", type=float, default=None,
                   help="every part's learning rate, where --<part>-learning-rate does not set it")
    t.add_argument("--parts", default="", help="vision,projector,language (default: all)")
    t.add_argument("--save", default="", help="checkpoint directory under the server's train.checkpoint_dir")
    t.add_argument("--publish", action="store_true",
                   help="serve the trained weights when the job ends (TrainConfig.publish_on_end)")
    t.set_defaults(fn=cmd_train)
    sub.add_parser("rollback", help="serve the weights from before the last publish (publish scope)"
                   ).set_defaults(fn=cmd_rollback)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.command == "demo" and len(args.image) > 1:
        args.image = args.image[1:]  # --image given: replace the default photo
    with VlmGraphClient(args.address, timeout=args.timeout) as client:
        try:
            args.fn(client, args)
        except grpc.RpcError as e:
            sys.exit(f"error: {e.code().name}: {e.details()}")
    return 0
