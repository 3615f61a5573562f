#!/usr/bin/env bash
# Builds vlmgraph (Release, Ninja) into ./build and runs every test through CTest: the GoogleTest
# suites (GPU tests named *_CUDA are skipped without a GPU) and the end-to-end server tests.
# This is the README's test command and what .ci/run calls.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${VLMGRAPH_CMAKE_ARGS:-}
cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "${TEST_JOBS:-2}" "$@"
