#!/usr/bin/env python3
"""Single-thread encoding speed of the C++ tokenizer (vlmgraph-tokenize --bench) against the Python
`tokenizers` package, on the text of the parity test (corpus.py): each Debian line encoded on its
own, and the whole documents. Not a CTest test: timings belong in a benchmark.

  bench_encode.py --tokenize build/tools/vlmgraph-tokenize [--repeat 3] [--variants smollm2,llama3]

Only encoding is timed (no file reading, process start or JSON): tokenizers' `encode` in a Python
loop and `encode_batch` with RAYON_NUM_THREADS=1 (both single-threaded), and the C++ loop inside
vlmgraph-tokenize. Each side encodes every text `repeat` times; the first pass fills the BPE word
caches of both. Prints MB/s (10^6 bytes of UTF-8 input per second).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# tokenizers reads these when its thread pool starts: one thread.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import corpus  # noqa: E402
import make_smollm2_tokenizer as maker  # noqa: E402


def hf_speed(tok, texts, repeat, batch):
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    start = time.perf_counter()
    for _ in range(repeat):
        if batch:
            tok.encode_batch(texts, add_special_tokens=False)
        else:
            for t in texts:
                tok.encode(t, add_special_tokens=False)
    return nbytes * repeat / (time.perf_counter() - start) / 1e6


def ours_speed(cli, path, texts, repeat):
    stdin = "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in texts).encode("utf-8")
    proc = subprocess.run([cli, path, "--bench", "--repeat", str(repeat)], input=stdin,
                          capture_output=True, check=True, timeout=1200)
    return json.loads(proc.stdout)["bytes_per_second"] / 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenize", required=True, help="the vlmgraph-tokenize binary")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--variants", default="smollm2,llama3,gpt2")
    args = parser.parse_args()
    from tokenizers import Tokenizer
    import tokenizers

    lines, _ = corpus.debian_lines()
    sets = [("lines", lines), ("documents", corpus.debian_documents())]
    work_dir = tempfile.mkdtemp(prefix="tokenizer_bench-")
    print(f"tokenizers {tokenizers.__version__}, {os.cpu_count()} CPUs, repeat {args.repeat}, "
          f"single thread")
    print(f"{'tokenizer':9s} {'text':9s} {'MB':>6s} {'tokenizers encode':>18s} "
          f"{'encode_batch(1 thr)':>20s} {'vlmgraph':>9s} {'ratio':>6s}")
    for variant in args.variants.split(","):
        path = os.path.join(work_dir, f"{variant}.json")
        maker.build(variant).save(path)
        tok = Tokenizer.from_file(path)
        for name, texts in sets:
            nbytes = sum(len(t.encode("utf-8")) for t in texts)
            hf_loop = hf_speed(tok, texts, args.repeat, batch=False)
            hf_batch = hf_speed(tok, texts, args.repeat, batch=True)
            ours = ours_speed(args.tokenize, path, texts, args.repeat)
            print(f"{variant:9s} {name:9s} {nbytes / 1e6:6.2f} {hf_loop:13.2f} MB/s "
                  f"{hf_batch:15.2f} MB/s {ours:4.2f} MB/s {ours / max(hf_loop, hf_batch):5.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
