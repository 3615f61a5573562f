#!/usr/bin/env python3
"""Checks that no source file includes a project header from a layer above its own.

The layers, lowest first (docs/design/overview.md, "Layers"):

  model/  <  engine/  <  server/  <  tools/, bench/, tests/

A file may include headers of its own layer and of the layers below it, never of a layer above:
model/ includes neither engine/ nor server/, engine/ does not include server/, and none of the
three includes a header of tools/, bench/ or tests/. tools/, bench/ and tests/ sit side by side on
top and may include anything. Subfolders belong to their top folder's layer (model/cuda/ is
model/, engine/cuda/ is engine/).

Every `#include "..."` line of the *.h, *.cc, *.cu and *.cuh files under those six folders is
read. An include names a project header when its first path component is one of the six folders
(`#include "engine/bucket.h"`), or when it resolves, relative to the including file's folder, to
a file under one of them (`#include "../engine/bucket.h"`). Other includes (system headers, the
generated `vlmgraph/v1/*.pb.h`) are not checked.

Each violation is printed as
  FILE:LINE: FILE (layer X) includes HEADER (layer Y)
and the exit status is 1; 0 when there is none; 2 when --root holds none of the six folders.
CTest runs it as `layering_check` (label unit).

  scripts/check_layering.py [--root REPO]
"""
import argparse
import os
import re
import sys

# Folder -> rank; a file may include a header whose rank is at most its own.
LAYER_RANK = {"model": 0, "engine": 1, "server": 2, "tools": 3, "bench": 3, "tests": 3}
SOURCE_SUFFIXES = (".h", ".cc", ".cu", ".cuh")
INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')


def layer_of(rel_path):
    """The layer folder of a repository-relative path, or None outside the six folders."""
    top = rel_path.replace(os.sep, "/").split("/", 1)[0]
    return top if top in LAYER_RANK else None


def included_header(root, including_rel, name):
    """The repository-relative path of an included project header, or None for any other include."""
    name = name.replace("\\", "/")
    if layer_of(name):
        return os.path.normpath(name).replace(os.sep, "/")
    local = os.path.normpath(os.path.join(os.path.dirname(including_rel), name))
    if not local.startswith("..") and layer_of(local) and os.path.isfile(os.path.join(root, local)):
        return local.replace(os.sep, "/")
    return None


def source_files(root):
    """Repository-relative paths of the C++ and CUDA sources under the layer folders, sorted."""
    for layer in sorted(LAYER_RANK):
        top = os.path.join(root, layer)
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for filename in sorted(filenames):
                if filename.endswith(SOURCE_SUFFIXES):
                    yield os.path.relpath(os.path.join(dirpath, filename), root).replace(os.sep, "/")


def violations(root):
    """(files scanned, project includes seen, list of violation lines)."""
    files = includes = 0
    found = []
    for rel in source_files(root):
        files += 1
        own = layer_of(rel)
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                m = INCLUDE_RE.match(line)
                if not m:
                    continue
                header = included_header(root, rel, m.group(1))
                if header is None:
                    continue
                includes += 1
                theirs = layer_of(header)
                if LAYER_RANK[theirs] > LAYER_RANK[own]:
                    found.append(f"{rel}:{lineno}: {rel} (layer {own}) includes {header} (layer {theirs})")
    return files, includes, found


def main(argv=None):
    default_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--root", default=default_root, help="repository root (default: this script's repository)")
    args = parser.parse_args(argv)
    root = os.path.abspath(args.root)
    if not any(os.path.isdir(os.path.join(root, layer)) for layer in LAYER_RANK):
        print(f"check_layering.py: {root} holds none of {', '.join(sorted(LAYER_RANK))}; pass the "
              "repository root with --root", file=sys.stderr)
        return 2
    files, includes, found = violations(root)
    for line in found:
        print(line)
    if found:
        print(f"check_layering.py: {len(found)} includes go up a layer (model < engine < server < "
              "tools, bench, tests); move the code to the lower layer or the include out of it",
              file=sys.stderr)
        return 1
    print(f"check_layering.py: {files} files, {includes} project includes, none goes up a layer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
