#!/usr/bin/env python3
"""Checks that no source file includes a project header from a layer above its own.

The layers ("rooms"), lowest first (docs/design/overview.md, "Layers"):

  base/  <  model/  <  text/, image/  <  engine/, launch/
         <  server/config/  <  server/http/  <  server/core/ (the serving core)  <  server/train/
         <  server/grpc/, server/openai/  <  server/main.cc  <  bench/  <  tools/  <  tests/

A file may include headers of its own room and of the rooms below it, never of a room above, and
never of a sibling room of the same rank (text/ and image/ stay apart, as do engine/ and the
launcher in launch/, and the gRPC API in server/grpc/ and the OpenAI API in server/openai/). The
benchmarks sit below the tools (vlmgraph-diagnose measures with bench/synthetic.h; no benchmark
includes a tool), and tests/ on top may include anything. Besides, the training entry point
(tools/train/) stays off the serving fronts: it may not include server/http/ or server/openai/
(KEPT_APART). A path belongs to the room of its longest matching prefix: server/grpc/service.h is
server/grpc, server/core/scheduler.h is server; other subfolders belong to their folder's room
(model/cuda/ is model/, engine/cuda/ is engine/).

Every `#include "..."` line of the *.h, *.cc, *.cu and *.cuh files under the top folders is read.
An include names a project header when its first path component is one of the top folders
(`#include "engine/bucket.h"`), or when it resolves, relative to the including file's folder, to
a file under one of them (`#include "../engine/bucket.h"`). Other includes (system headers, the
generated `vlmgraph/v1/*.pb.h`) are not checked.

Each violation is printed as
  FILE:LINE: FILE (layer X) includes HEADER (layer Y)
and the exit status is 1; 0 when there is none; 2 when --root holds none of the top folders.
CTest runs it as `layering_check` (label unit).

  scripts/check_layering.py [--root REPO]
"""
import argparse
import os
import re
import sys

# Room (a path prefix) -> rank; a file may include a header of its own room or of a lower rank.
LAYER_RANK = {
    "base": 0,
    "model": 1,
    "text": 2, "image": 2,
    "engine": 3, "launch": 3,
    "server/config": 4,
    "server/http": 5,
    "server": 6,
    "server/train": 7,
    "server/grpc": 8, "server/openai": 8,
    "server/main.cc": 9,
    "bench": 10,
    "tools": 11,
    "tests": 12,
}
# Folders (path prefixes) whose files may not include the rooms listed, though they rank lower.
KEPT_APART = {
    "tools/train": ("server/http", "server/openai"),
}
TOP_FOLDERS = sorted({room.split("/", 1)[0] for room in LAYER_RANK})
SOURCE_SUFFIXES = (".h", ".cc", ".cu", ".cuh")
INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')


def layer_of(rel_path):
    """The room of a repository-relative path (its longest prefix in LAYER_RANK), or None outside
    the top folders."""
    path = rel_path.replace(os.sep, "/")
    parts = path.split("/")
    for n in range(len(parts), 0, -1):
        prefix = "/".join(parts[:n])
        if prefix in LAYER_RANK:
            return prefix
    return None


def allowed(rel, own, theirs):
    """Whether file `rel` of room `own` may include a header of room `theirs`."""
    for folder, rooms in KEPT_APART.items():
        if rel.startswith(folder + "/") and theirs in rooms:
            return False
    return own == theirs or LAYER_RANK[theirs] < LAYER_RANK[own]


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
    for layer in TOP_FOLDERS:
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
                if not allowed(rel, own, theirs):
                    found.append(f"{rel}:{lineno}: {rel} (layer {own}) includes {header} (layer {theirs})")
    return files, includes, found


def main(argv=None):
    default_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--root", default=default_root, help="repository root (default: this script's repository)")
    args = parser.parse_args(argv)
    root = os.path.abspath(args.root)
    if not any(os.path.isdir(os.path.join(root, layer)) for layer in TOP_FOLDERS):
        print(f"check_layering.py: {root} holds none of {', '.join(TOP_FOLDERS)}; pass the "
              "repository root with --root", file=sys.stderr)
        return 2
    files, includes, found = violations(root)
    for line in found:
        print(line)
    if found:
        print(f"check_layering.py: {len(found)} includes go up a layer or across to a sibling (base < "
              "model < text, image < engine, launch < server/config < server/http < server < "
              "server/grpc, server/openai < server/main.cc < bench < tools < tests; tools/train off "
              "server/http and server/openai); move the code to the lower layer or the include out "
              "of it",
              file=sys.stderr)
        return 1
    print(f"check_layering.py: {files} files, {includes} project includes, none goes up a layer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
