#!/usr/bin/env python3
"""Writes the handwritten digits of Debian's python3-sklearn package as a vlmgraph-train dataset: one
chat conversation per digit (JSONL, OpenAI message format, docs/training.md "Dataset").

The 1,797 8x8 digits (sklearn/datasets/data/digits.csv.gz, 64 pixel values 0..16 then the label)
become, by default, text: the digit drawn as 8 lines of ASCII art, the question "Which digit is
this?" and the answer, the digit. With --images each digit is a PNG (upscaled to 64 x 64) in an
image_url part instead, for a vision-language model.

    python3 clients/python/examples/digits_chat.py digits            # digits/digits.jsonl
    vlmgraph-train --set model=MODEL --set train.dataset=digits/digits.jsonl --val-fraction 0.1 ...

The lines keep the file's order; vlmgraph-train shuffles and holds out its validation split.
"""
import argparse
import csv
import gzip
import json
import os

DIGITS_CSV = "/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz"
RAMP = " .:-=+*#%@"  # 0..16 -> darker characters
SYSTEM = "You read handwritten digits. Answer with the digit only."


def load_digits(path):
    with gzip.open(path, "rt") as fh:
        rows = [[int(float(v)) for v in line] for line in csv.reader(fh) if line]
    return [(row[:64], row[64]) for row in rows]


def ascii_art(pixels):
    return "\n".join("".join(RAMP[min(len(RAMP) - 1, v * len(RAMP) // 17)] for v in pixels[y * 8:y * 8 + 8])
                     for y in range(8))


def write_png(path, pixels, size=64):
    from PIL import Image
    img = Image.new("L", (8, 8))
    img.putdata([255 - v * 255 // 16 for v in pixels])
    img.resize((size, size), Image.NEAREST).convert("RGB").save(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="directory to write digits.jsonl (and images/) into")
    ap.add_argument("--digits", default=DIGITS_CSV)
    ap.add_argument("--images", action="store_true", help="the digit as a PNG image part, not ASCII art")
    args = ap.parse_args()
    data = load_digits(args.digits)
    os.makedirs(args.out, exist_ok=True)
    if args.images:
        os.makedirs(os.path.join(args.out, "images"), exist_ok=True)
    with open(os.path.join(args.out, "digits.jsonl"), "w") as fh:
        for i, (pixels, label) in enumerate(data):
            if args.images:
                name = f"images/{i:04d}.png"
                write_png(os.path.join(args.out, name), pixels)
                user = [{"type": "image_url", "image_url": {"url": name}},
                        {"type": "text", "text": "Which digit is this?"}]
            else:
                user = f"Which digit is this?\n{ascii_art(pixels)}"
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user},
                        {"role": "assistant", "content": str(label)}]
            fh.write(json.dumps({"messages": messages}) + "\n")
    print(f"wrote {len(data)} conversations to {os.path.join(args.out, 'digits.jsonl')}")


if __name__ == "__main__":
    main()
