#!/usr/bin/env bash
# Multi-GPU checks of one host, called by scripts/gpu-check.sh (parts dptrain, dpserve) with
#   multi_gpu.sh BIN_DIR OUT_DIR dptrain|dpserve
# dptrain: the data-parallel *_CUDA tests (NCCL ranks as processes against one rank); the graphed
#   training step of nanovlm-460m bf16 at 8 x 1024 per GPU on 1, 2, 4, 8 GPUs (as many as the host
#   has) under torchrun, tokens/s per GPU, with bench/allreduce_overlap.py on each trace; then
#   vlmgraph-train on 2 GPUs under torchrun (a chat JSONL), and the same job with rank 1 killed
#   by SIGKILL: rank 0 must exit with status 3 within the timeout (20 s).
# dpserve: vlmgraph-server with --data-parallel-size N (1, 2, 4, 8 as the host allows) on
#   SmolLM2-135M's shape (bench/make_smol_checkpoint.py), 256 streams per GPU, 128 tokens per
#   request: gRPC with one vlmgraph-grpc-load process per GPU, HTTP with $HTTP_LOAD (default
#   ../shared/tools/http_load.py, skipped when absent) with 8 processes per GPU.
# Prints one summary line per figure; logs go to OUT_DIR. Exit status: the number of failed checks.
set -uo pipefail
BIN=$1 OUT=$2 WHAT=$3
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} PYTHONUNBUFFERED=1
NG=$(nvidia-smi -L | wc -l)
WORLDS=$(for w in 1 2 4 8; do [ "$w" -le "$NG" ] && echo $w; done)
failed=0
TOKENIZER=${VLMGRAPH_TOKENIZER:-}
smol() {  # the SmolLM2-135M-shaped checkpoint (random weights) in /tmp/vlmgraph-smol
  [ -f /tmp/vlmgraph-smol/model.safetensors ] || python3 bench/make_smol_checkpoint.py "$ROOT" /tmp/vlmgraph-smol >"$OUT/smol.log" 2>&1
}
case $WHAT in
  dptrain)
    "$BIN/tests/trainer_test" --gtest_filter='DataParallel.*CUDA*' >"$OUT/dp_tests.log" 2>&1 || failed=$((failed + 1))
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |nccl rank" "$OUT/dp_tests.log"
    B=(--mode graph --batch 8 --seq 1024 --steps 20)
    for w in $WORLDS; do
      if [ "$w" = 1 ]; then
        "$BIN/bench/vlmgraph-train-bench" "${B[@]}" --json "$OUT/dp_train_w1.json" >"$OUT/dp_train_w1.log" 2>&1
      else
        python3 -m torch.distributed.run --nproc_per_node="$w" --master_port=$((29600 + w)) --no-python \
          "$BIN/bench/vlmgraph-train-bench" "${B[@]}" --json "$OUT/dp_train_w$w.json" \
          --profile-trace "$OUT/dp_trace_w$w" >"$OUT/dp_train_w$w.log" 2>&1
      fi || failed=$((failed + 1))
      python3 -c "import json; d = json.load(open('$OUT/dp_train_w$w.json'))['graph']; print('train $w GPU(s): %.2f ms, %.0f tokens/s per GPU' % (d['median_step_ms'], d['tokens_per_second_per_gpu']))"
      if [ -f "$OUT/dp_trace_w$w.graph.json" ]; then
        python3 bench/allreduce_overlap.py "$OUT/dp_trace_w$w.graph.json" --steps 3 --json
        gzip -f "$OUT/dp_trace_w$w.graph.json"
      fi
    done
    if [ "$NG" -ge 2 ] && [ -n "$TOKENIZER" ]; then
      smol
      python3 - "$OUT" <<'PY'
import json, sys
with open(sys.argv[1] + "/dp_chat.jsonl", "w") as f:
    for i in range(256):
        f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                         {"role": "assistant", "content": f"{i} plus {i} is {2 * i}. " * 8}]}) + "\n")
PY
      printf 'model: /tmp/vlmgraph-smol\ndtype: bfloat16\nbuckets:\n  train_batch_sizes: [8]\n  train_seq_lens: [128, 256]\ntrain:\n  dataset: %s\n  global_batch_size: 16\n  steps: 30\ndistributed:\n  timeout_seconds: 20\n' \
        "$OUT/dp_chat.jsonl" >"$OUT/dp_train.yaml"
      python3 -m torch.distributed.run --nproc_per_node=2 --master_port=29650 --no-python "$BIN/tools/vlmgraph-train" \
        --config "$OUT/dp_train.yaml" --set "tokenizer=$TOKENIZER" >"$OUT/dp_entry.log" 2>&1 || failed=$((failed + 1))
      tail -1 "$OUT/dp_entry.log"
      for r in 0 1; do
        RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=29700 timeout 120 "$BIN/tools/vlmgraph-train" \
          --config "$OUT/dp_train.yaml" --set "tokenizer=$TOKENIZER" --set train.steps=100000 >"$OUT/dp_kill_r$r.log" 2>&1 &
        eval "pid$r=\$!"
      done
      sleep 30
      kill -9 "$pid1"
      t0=$(date +%s.%N)
      wait "$pid0"
      rc=$?
      echo "SIGKILL of rank 1: rank 0 exit status $rc after $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s (want 3 within 20 s)"
      [ "$rc" = 3 ] || failed=$((failed + 1))
      grep -h UNAVAILABLE "$OUT/dp_kill_r0.log" | tail -1
    fi
    ;;
  dpserve)
    smol
    HTTP_LOAD=${HTTP_LOAD:-$ROOT/../shared/tools/http_load.py}
    for w in $WORLDS; do
      "$BIN/server/vlmgraph-server" --config deploy/config.yaml --model /tmp/vlmgraph-smol \
        ${TOKENIZER:+--tokenizer "$TOKENIZER"} --data-parallel-size "$w" --grpc-address 127.0.0.1:0 \
        --metrics-address 127.0.0.1:0 --http-address 127.0.0.1:0 --set 'auth.api_keys_file=""' \
        >"$OUT/dp_serve_w$w.out" 2>"$OUT/dp_serve_w$w.log" &
      pid=$!
      for _ in $(seq 900); do grep -q ready "$OUT/dp_serve_w$w.out" 2>/dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 0.2; done
      grpc=$(sed -n 's/.* grpc \([^ ]*\).*/\1/p' "$OUT/dp_serve_w$w.out")
      http=$(sed -n 's/.* http \([^ ]*\).*/\1/p' "$OUT/dp_serve_w$w.out")
      [ -n "$grpc" ] || { echo "server on $w GPU(s) did not start"; failed=$((failed + 1)); kill $pid; continue; }
      if [ -n "$TOKENIZER" ] && [ -f "$HTTP_LOAD" ]; then
        python3 "$HTTP_LOAD" --url "http://$http" --model auto --concurrency $((256 * w)) --procs $((8 * w > 32 ? 32 : 8 * w)) \
          --seconds 15 --warmup 3 --max-tokens 128 2>&1 | tail -1 | sed "s/^/http $w GPU(s): /"
      fi
      if [ -n "$TOKENIZER" ]; then
        for i in $(seq "$w"); do
          "$BIN/bench/vlmgraph-grpc-load" --address "$grpc" --concurrency 256 --seconds 15 --warmup 3 \
            --max-tokens 128 >"$OUT/dp_grpc_w${w}_$i.json" 2>&1 &
        done
        wait $(jobs -p | grep -vx "$pid")
        python3 -c "import glob, json; rows = [json.loads(l) for f in glob.glob('$OUT/dp_grpc_w${w}_*.json') for l in open(f) if l.startswith('{')]; print('grpc $w GPU(s): %.0f tokens/s, %d errors, TTFT p99 (worst process) %.1f ms' % (sum(r['tok_per_s'] for r in rows), sum(r['errors'] for r in rows), max(r['ttft_p99_ms'] for r in rows)))"
      fi
      kill -TERM $pid
      wait $pid
    done
    ;;
esac
exit "$failed"
