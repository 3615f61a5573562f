#!/usr/bin/env python3
"""Checks that no source file is longer than a newcomer can read in one sitting.

Limits: 700 lines for a source file outside tests/ (C++ and CUDA sources and headers, Python and
shell scripts under base/ model/ text/ image/ engine/ launch/ server/ tools/ bench/ scripts/
proto/), 1,200 for a file under tests/. A file that grows past its limit is split along its seams
(docs/design/overview.md names the rooms). Fixtures and generated files are not counted
(tests/fixtures/, tests/fuzz/ corpora).

Each violation is printed as
  FILE: N lines (limit L)
and the exit status is 1; 0 when there is none. CTest runs it as `file_length_check`.

  scripts/check_file_lengths.py [--root REPO]
"""
import argparse
import os
import sys

SOURCE_ROOTS = ["base", "model", "text", "image", "engine", "launch", "server", "tools", "bench",
                "scripts", "proto"]
TEST_ROOT = "tests"
SUFFIXES = (".h", ".cc", ".cu", ".cuh", ".py", ".sh", ".proto")
SOURCE_LIMIT = 700
TEST_LIMIT = 1200
SKIPPED = ("tests/fixtures/", "tests/fuzz/")  # data, corpora and generated inputs


def files_under(root, top):
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(SUFFIXES):
                rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
                if not rel.startswith(SKIPPED):
                    yield rel


def violations(root):
    """(files counted, violation lines)."""
    found, counted = [], 0
    for top, limit in [(t, SOURCE_LIMIT) for t in SOURCE_ROOTS] + [(TEST_ROOT, TEST_LIMIT)]:
        for rel in files_under(root, top):
            counted += 1
            with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
                lines = sum(1 for _ in f)
            if lines > limit:
                found.append(f"{rel}: {lines} lines (limit {limit})")
    return counted, found


def main(argv=None):
    default_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--root", default=default_root, help="repository root")
    args = parser.parse_args(argv)
    counted, found = violations(os.path.abspath(args.root))
    for line in found:
        print(line)
    if found:
        print(f"check_file_lengths.py: {len(found)} files too long; split them along their seams "
              f"(limits: {SOURCE_LIMIT} lines, {TEST_LIMIT} under tests/)", file=sys.stderr)
        return 1
    print(f"check_file_lengths.py: {counted} files, none over its limit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
