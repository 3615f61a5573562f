#!/usr/bin/env python3
"""Real-data training through the Train RPC: handwritten digits -> image + question -> answer.

The 1,797 8x8 digit images of Debian's python3-sklearn package (sklearn/datasets/data/digits.csv.gz,
64 pixel values 0..16 then the label per line) are split into a training and a held-out set. Each
example is one image tile (the digit upscaled to the model's tile size), a fixed question and the
digit's answer token:

    input_ids  = [image_token] * tokens_per_tile + QUESTION + [answer]
    target_ids = -100 everywhere except the last question position, whose target is the answer

Batches stream through VlmGraph.Train; held-out accuracy is measured before and after with Forward
(argmax of the logits over the whole vocabulary at the last question position) and checked against
Generate on a sample. Writes <out>/digits.json (numbers) and <out>/digits.png (the curve).

    python3 clients/python/examples/train_digits.py --address 127.0.0.1:50051 --steps 300 --out /tmp/digits
"""
import argparse
import csv
import gzip
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from vlmgraph_client.client import VlmGraphClient, tensor_image  # noqa: E402

DIGITS_CSV = "/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz"
QUESTION = [20, 21, 22]  # "which digit is this ?" as fixed token ids (the server has no tokenizer)
ANSWER_BASE = 100        # the answer for digit d is token ANSWER_BASE + d


def load_digits(path):
    with gzip.open(path, "rt") as fh:
        rows = [[float(v) for v in line] for line in csv.reader(fh) if line]
    return [(row[:64], int(row[64])) for row in rows]


def tile(pixels, size):
    """An 8x8 digit (0..16) upscaled (nearest) to one size x size RGB tile in [0, 1], as [1, 3, S, S]."""
    scale = size // 8
    plane = []
    for y in range(size):
        src = pixels[(min(y // scale, 7)) * 8:(min(y // scale, 7)) * 8 + 8]
        plane.extend(src[min(x // scale, 7)] / 16.0 for x in range(size))
    return tensor_image([1, 3, size, size], plane * 3)


def example(info, pixels, label):
    prompt = [info.image_token_id] * info.mp_image_token_length + QUESTION
    return {"input_ids": prompt + [ANSWER_BASE + label],
            "target_ids": [-100] * (len(prompt) - 1) + [ANSWER_BASE + label, -100],
            "images": [tile(pixels, info.vit_img_size)]}


def accuracy(client, info, samples):
    prompt = [info.image_token_id] * info.mp_image_token_length + QUESTION
    correct = 0
    for pixels, label in samples:
        res = client.forward(prompt, [tile(pixels, info.vit_img_size)], logits_positions=[len(prompt) - 1])
        row = res.logits[0].logits
        correct += max(range(len(row)), key=row.__getitem__) == ANSWER_BASE + label
    return correct / len(samples)


def plot(path, losses, acc_before, acc_after, held_out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plot_with_pillow(path, losses, acc_before, acc_after)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(losses) + 1), losses, lw=1)
    ax.set_xlabel("optimizer step (Train RPC)")
    ax.set_ylabel("training loss (nats)")
    ax.set_title(f"digits: held-out accuracy {acc_before:.1%} -> {acc_after:.1%} ({held_out} images)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_with_pillow(path, losses, acc_before, acc_after):
    from PIL import Image, ImageDraw
    w, h, m = 720, 400, 50
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    d.rectangle([m, m, w - m, h - m], outline="black")
    top = max(losses)
    pts = [(m + (w - 2 * m) * i / max(1, len(losses) - 1), h - m - (h - 2 * m) * v / top) for i, v in enumerate(losses)]
    d.line(pts, fill="blue", width=2)
    d.text((m, 15), f"training loss per step (max {top:.2f}); held-out accuracy {acc_before:.1%} -> {acc_after:.1%}",
           fill="black")
    img.save(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", default="127.0.0.1:50051")
    ap.add_argument("--digits", default=DIGITS_CSV)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--held-out", type=int, default=297)
    ap.add_argument("--out", default="digits-out")
    ap.add_argument("--min-accuracy", type=float, default=0.0, help="exit 1 below this held-out accuracy")
    args = ap.parse_args()

    data = load_digits(args.digits)
    random.Random(0).shuffle(data)
    held, train = data[:args.held_out], data[args.held_out:]
    os.makedirs(args.out, exist_ok=True)
    with VlmGraphClient(args.address, timeout=600) as client:
        client.wait_ready()
        info = client.model_info()
        before = accuracy(client, info, held)
        print(f"held-out accuracy before training: {before:.1%} ({len(held)} images, chance 10%)", flush=True)
        rng = random.Random(1)

        def batches():
            for _ in range(args.steps):
                yield client.train_batch([example(info, *rng.choice(train)) for _ in range(args.batch)])

        config = client.train_config(language_learning_rate=args.lr, vision_learning_rate=args.lr,
                                     projector_learning_rate=args.lr, max_grad_norm=1.0, publish_on_end=True)
        losses, modes, t0 = [], {}, time.time()
        for resp in client.train(config, batches()):
            if resp.HasField("step"):
                s = resp.step
                losses.append(s.loss)
                modes[s.mode] = modes.get(s.mode, 0) + 1
                if s.step % 25 == 0 or s.step == 1:
                    print(f"step {s.step:4d} loss {s.loss:.4f} ({s.bucket}, {s.step_seconds * 1e3:.1f} ms)", flush=True)
        train_seconds = time.time() - t0
        after = accuracy(client, info, held)
        # Generate agrees with Forward's argmax on a sample.
        prompt = [info.image_token_id] * info.mp_image_token_length + QUESTION
        agree = 0
        sample = held[:20]
        for pixels, label in sample:
            tokens, _ = client.generate_all(prompt, [tile(pixels, info.vit_img_size)], max_new_tokens=1)
            fwd = client.forward(prompt, [tile(pixels, info.vit_img_size)], logits_positions=[len(prompt) - 1]).logits[0].logits
            agree += tokens[0] == max(range(len(fwd)), key=fwd.__getitem__)
    print(f"held-out accuracy after {len(losses)} steps ({train_seconds:.0f} s): {after:.1%}; "
          f"Generate agrees with Forward on {agree}/{len(sample)}", flush=True)
    report = {"train_examples": len(train), "held_out": len(held), "steps": len(losses), "batch": args.batch,
              "lr": args.lr, "train_seconds": train_seconds, "accuracy_before": before, "accuracy_after": after,
              "generate_agrees_with_forward": f"{agree}/{len(sample)}", "first_loss": losses[0] if losses else None,
              "last_loss": losses[-1] if losses else None, "losses": losses,
              "step_modes": {str(k): v for k, v in modes.items()}}
    with open(os.path.join(args.out, "digits.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    plot(os.path.join(args.out, "digits.png"), losses, before, after, len(held))
    print(f"wrote {args.out}/digits.json and {args.out}/digits.png")
    return 0 if after >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
