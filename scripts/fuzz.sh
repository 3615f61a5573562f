#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz (clang++-14; the decoders compiled with
# -fsanitize=fuzzer-no-link,address,undefined, the targets linked with -fsanitize=fuzzer) into
# ./build-fuzz, then for each target: runs its regression inputs (tests/fuzz/<target>/regressions/)
# and its seed corpus once, then fuzzes it for the given time. Prints executions, exec/s and
# crashes per target; exits 1 when any target crashed (the crashing input is left in
# build-fuzz/artifacts/<target>/ and named in the output), 2 on a usage or build error.
#
#   scripts/fuzz.sh 60                   # every target, 60 s each
#   scripts/fuzz.sh --smoke              # CI-sized: regressions, seeds, then 20 s each
#   scripts/fuzz.sh 300 image config     # only these targets
#   scripts/fuzz.sh --list               # the targets
#
# Environment: FUZZ_BUILD_DIR (build-fuzz), JOBS (parallel compile jobs, default nproc),
# CXX (clang++-14), FUZZ_ARGS (extra libFuzzer flags, e.g. "-max_len=65536").
# New inputs that reach new code are kept in build-fuzz/corpus/<target>/, so a later run goes on
# from there; the committed seeds in tests/fuzz/<target>/ are only read. Needs clang-14 and
# libclang-rt-14-dev (libFuzzer) on Debian bookworm. docs/security.md ("Fuzzing") has the figures.
set -euo pipefail
cd "$(dirname "$0")/.."

TARGETS=(image convert safetensors config tokenizer_json tokenizer_text openai chat_prompt)
usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

seconds=""
smoke=0
selected=()
for arg in "$@"; do
  case "$arg" in
    --smoke) smoke=1; seconds=${FUZZ_SMOKE_SECONDS:-20} ;;
    --list) printf '%s\n' "${TARGETS[@]}"; exit 0 ;;
    -h|--help) usage ;;
    *[!0-9]*)
      [[ " ${TARGETS[*]} " == *" $arg "* ]] || { echo "fuzz.sh: unknown target '$arg'" >&2; usage; }
      selected+=("$arg") ;;
    *) seconds=$arg ;;
  esac
done
[ -n "$seconds" ] || usage
[ ${#selected[@]} -gt 0 ] || selected=("${TARGETS[@]}")

BUILD_DIR=${FUZZ_BUILD_DIR:-build-fuzz}
CXX=${CXX:-clang++-14}
command -v "$CXX" >/dev/null || { echo "fuzz.sh: $CXX not found (apt-get install clang-14 libclang-rt-14-dev)" >&2; exit 2; }

# Sanitizer options, each for a reason:
#   ASan abort_on_error=1: a report ends the run with a signal libFuzzer records as a crash.
#   ASan max_malloc_fill_size=16777216: new heap blocks are filled with 0xbe up to 16 MiB, not
#     4 KiB, so a read of uninitialized heap memory sees the same bytes on every run and a crash
#     input replays.
#   UBSan print_stacktrace=1: every report names the line and its callers (the code is built with
#     -fno-sanitize-recover=undefined, so any report is fatal).
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:max_malloc_fill_size=16777216}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

build_start=$(date +%s)
mkdir -p "$BUILD_DIR"
if ! cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_CXX_COMPILER="$CXX" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" \
  -DVLMGRAPH_BUILD_FUZZERS=ON -DVLMGRAPH_BUILD_TESTS=OFF -DVLMGRAPH_CUDA=OFF \
  >"$BUILD_DIR/configure.log" 2>&1; then
  cat "$BUILD_DIR/configure.log" >&2
  exit 2
fi
cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}" --target $(printf 'fuzz_%s ' "${selected[@]}") ||
  exit 2
echo "fuzz.sh: build took $(( $(date +%s) - build_start )) s"

status=0
summary=()
for t in "${selected[@]}"; do
  bin="$BUILD_DIR/tests/fuzz/fuzz_$t"
  seeds="tests/fuzz/$t"
  corpus="$BUILD_DIR/corpus/$t"
  artifacts="$BUILD_DIR/artifacts/$t/"
  log="$BUILD_DIR/logs/$t.log"
  mkdir -p "$corpus" "$artifacts" "$(dirname "$log")"
  # Regression inputs and seeds, each run once (a fixed bug that comes back fails here).
  inputs=()
  for f in "$seeds"/* "$seeds"/regressions/*; do [ -f "$f" ] && inputs+=("$f"); done
  if [ ${#inputs[@]} -gt 0 ] &&
    ! "$bin" -artifact_prefix="$artifacts" -timeout=25 "${inputs[@]}" >"$log.replay" 2>&1; then
    echo "fuzz.sh: $t fails on a seed or regression input:" >&2
    tail -n 40 "$log.replay" >&2
    summary+=("$(printf '%-15s %12s %10s %8s  %s' "$t" - - 1 "seed/regression input fails (see $log.replay)")")
    status=1
    continue
  fi
  # -timeout: one input running over 10 s counts as a crash (a hang); -rss_limit_mb: LibTorch's
  # baseline plus ASan's shadow stays far below it, so only a runaway allocation reaches it.
  set +e
  "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$artifacts" ${FUZZ_ARGS:-} "$corpus" "$seeds" >"$log" 2>&1
  rc=$?
  set -e
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  crashes=0
  note=""
  if [ $rc -ne 0 ]; then
    crashes=1
    status=1
    artifact=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -1)
    note="crash: ${artifact:-see $log}"
    echo "fuzz.sh: $t crashed (exit $rc):" >&2
    grep -E 'ERROR: |runtime error|unexpected exception|SUMMARY|==ERROR' "$log" | head -n 5 >&2 || true
  fi
  summary+=("$(printf '%-15s %12s %10s %8s  %s' "$t" "${execs:-?}" "${rate:-?}" "$crashes" "$note")")
done

echo
printf '%-15s %12s %10s %8s\n' target executions exec/s crashes
printf '%s\n' "${summary[@]}"
exit $status
