#!/usr/bin/env bash
# Builds vlmgraph (Release, Ninja) into ./build and runs every test through CTest: the GoogleTest
# suites (GPU tests named *_CUDA are skipped without a GPU) and the end-to-end server tests, then
# the fuzz smoke (below).
# This is the README's test command and what .ci/run calls.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${VLMGRAPH_CMAKE_ARGS:-}
cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "${TEST_JOBS:-2}" "$@"

# The fuzz smoke (scripts/fuzz.sh --smoke: every decoder of untrusted bytes built with libFuzzer,
# ASan and UBSan into ./build-fuzz, its regression inputs and seeds replayed, then 20 s of fuzzing
# each; the build takes 250 s of CPU time, the runs 200 s, docs/security.md). Runs when no ctest
# arguments were given and clang-14 with libFuzzer is installed (install-deps.sh installs it on
# Debian, as CI runs); VLMGRAPH_FUZZ_SMOKE=0 skips it.
if [ $# -eq 0 ] && [ "${VLMGRAPH_FUZZ_SMOKE:-1}" != 0 ]; then
  if command -v clang++-14 >/dev/null &&
    compgen -G '/usr/lib/llvm-14/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a' >/dev/null; then
    scripts/fuzz.sh --smoke
  else
    echo "test.sh: fuzz smoke skipped: no clang++-14 with libFuzzer (apt-get install clang-14 libclang-rt-14-dev)"
  fi
fi
