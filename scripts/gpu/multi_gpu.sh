#!/usr/bin/env bash
# Multi-GPU checks of one host, called by scripts/gpu-check.sh (parts dptrain, dpserve, dpsoak,
# dpscale) with
#   multi_gpu.sh BIN_DIR OUT_DIR dptrain|dpserve|dpsoak|dpscale
# dptrain: the data-parallel *_CUDA tests (NCCL ranks as processes against one rank); the graphed
#   training step of nanovlm-460m bf16 at 8 x 1024 per GPU on 1, 2, 4, 8 GPUs (as many as the host
#   has) under torchrun, tokens/s per GPU with the GPU's clock and power, with
#   bench/allreduce_overlap.py on each trace, the unsharded optimizer and float32 gradient
#   reduction beside the default (bf16 reduction, ZeRO stage 1) and, on 1
#   GPU, tiles converted on the step's path beside staged ones; 200-step loss curves of 2 GPUs
#   against 1 on the same global batch ($VLMGRAPH_DPTRAIN_CURVES=0 skips them); then
#   vlmgraph-train on 2 GPUs under torchrun (a chat JSONL), and the same job with rank 1's process
#   (not its `timeout` wrapper) killed by SIGKILL: rank 0 must exit with status 3 within the
#   timeout (20 s).
# dpserve: vlmgraph-server with --data-parallel-size N (1, 2, 4, 8 as the host allows) on
#   SmolLM2-135M's shape (bench/make_smol_checkpoint.py), 128 tokens per request: gRPC alone at
#   128 streams per GPU (one vlmgraph-grpc-load), then HTTP at 256 per GPU with $HTTP_LOAD (default
#   ../shared/tools/http_load.py, skipped when absent; 8 processes per GPU), then gRPC at 256 per
#   GPU (one loader per GPU). Any gRPC error, a server that died, a device fault in its log or an
#   unclean shutdown fails the check.
# dpsoak: the server on every GPU under gRPC and HTTP at once (128 streams per GPU each) for
#   $VLMGRAPH_DPSOAK_SECONDS (default 600): 0 errors, no device fault, a clean shutdown.
# dpscale: the scaling curve, 1 to N GPUs of the host (docs/benchmarks.md, "Scaling"): training
#   as dptrain's default step at each world, the 1-GPU step measured first and last (its mean is
#   the baseline), the largest world traced (bench/allreduce_overlap.py --steady), and upstream
#   nanoVLM under DDP (eager) at the same worlds when $VLMGRAPH_PEERS holds
#   upstream_ddp_scaling.py; serving as dpserve's last two loads (HTTP at 256 streams per GPU,
#   then gRPC at 256 per GPU with one loader per GPU) with the server's busiest threads sampled
#   during the gRPC load (bench/thread_cpu.py), and at N GPUs once more with the fronts' threads
#   fixed at 2 (server.stream_threads, http.io_threads) as they were before they grew with the
#   GPUs. Ends with one table (scale_summary.txt, scale_summary.json).
# dpserve, dpsoak and dpscale need $VLMGRAPH_TOKENIZER (a SmolLM2 tokenizer.json).
# Prints one summary line per figure; logs go to OUT_DIR. Exit status: the number of failed checks.
set -uo pipefail
BIN=$1 OUT=$2 WHAT=$3
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} PYTHONUNBUFFERED=1
NG=$(nvidia-smi -L | wc -l)
# $VLMGRAPH_WORLDS ("1 4") picks worlds; default 1, 2, 4, 8 as the host allows.
WORLDS=${VLMGRAPH_WORLDS:-$(for w in 1 2 4 8; do [ "$w" -le "$NG" ] && echo $w; done)}
failed=0
TOKENIZER=${VLMGRAPH_TOKENIZER:-}
smol() {  # the SmolLM2-135M-shaped checkpoint (random weights) in /tmp/vlmgraph-smol
  [ -f /tmp/vlmgraph-smol/model.safetensors ] || python3 bench/make_smol_checkpoint.py "$ROOT" /tmp/vlmgraph-smol >"$OUT/smol.log" 2>&1
}
case $WHAT in
  dptrain | dpscale)
    B=(--mode graph --batch 8 --seq 1024 --steps 20)
    train() {  # train NAME WORLD ARGS...: one bench run, its summary line
      local name=$1 w=$2
      shift 2
      if [ "$w" = 1 ]; then
        "$BIN/bench/vlmgraph-train-bench" "$@" --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1
      else
        python3 -m torch.distributed.run --nproc_per_node="$w" --master_port=$((29600 + w)) --no-python \
          "$BIN/bench/vlmgraph-train-bench" "$@" --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1
      fi || failed=$((failed + 1))
      python3 -c "import json; d = json.load(open('$OUT/$name.json'))['graph']; g = d.get('gpu', {}); print('$name: %d GPU(s) %.2f ms (spread %.1f%%%s), %.0f tokens/s per GPU, SM clock median %s MHz, power median %s W, throttle %s' % ($w, d['median_step_ms'], 100 * d['step_ms_spread'], ' UNSTABLE' if d['unstable'] else '', d['tokens_per_second_per_gpu'], (g.get('sm_clock_mhz') or {}).get('median'), (g.get('power_w') or {}).get('median'), g.get('throttle_reasons', g.get('nvml'))))"
    }
    ;;&
  dptrain)
    "$BIN/tests/trainer_test" --gtest_filter='DataParallel.*CUDA*' >"$OUT/dp_tests.log" 2>&1 || failed=$((failed + 1))
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |nccl rank" "$OUT/dp_tests.log"
    # Each world: the default step (bf16 gradient reduction, the optimizer sharded over the ranks,
    # tiles staged ahead) with its overlap trace; with 2+ GPUs every rank running the whole
    # optimizer (--shard-optimizer off) and float32 reduction beside it; on 1 GPU the tiles
    # converted on the step's path beside it (Note [Staged tiles], engine/trainer.h).
    for w in $WORLDS; do
      if [ "$w" = 1 ]; then
        train dp_train_w1 1 "${B[@]}" --profile-trace "$OUT/dp_trace_w1"
        train dp_train_w1_unstaged 1 "${B[@]}" --stage-tiles off
      else
        train dp_train_w$w "$w" "${B[@]}" --profile-trace "$OUT/dp_trace_w$w"
        train dp_train_w${w}_unsharded "$w" "${B[@]}" --shard-optimizer off
        train dp_train_w${w}_f32reduce "$w" "${B[@]}" --reduce-dtype float32
      fi
      if [ -f "$OUT/dp_trace_w$w.graph.json" ]; then
        python3 bench/allreduce_overlap.py "$OUT/dp_trace_w$w.graph.json" --steps 3 --json
        gzip -f "$OUT/dp_trace_w$w.graph.json"
      fi
    done
    # 200-step loss curves: 2 GPUs (8 per GPU, bf16 reduction) against 1 GPU taking the same
    # global batch of 16 in one micro-batch.
    if [ "$NG" -ge 2 ] && [ "${VLMGRAPH_DPTRAIN_CURVES:-1}" = 1 ]; then
      C=(--mode graph --seq 1024 --steps 199 --global-batch on)
      train dp_curve_w1 1 "${C[@]}" --batch 16
      train dp_curve_w2 2 "${C[@]}" --batch 8
      python3 - "$OUT" <<'PY' || failed=$((failed + 1))
import json, sys
one = json.load(open(sys.argv[1] + "/dp_curve_w1.json"))["graph"]["losses"]
two = json.load(open(sys.argv[1] + "/dp_curve_w2.json"))["graph"]["losses"]
diff = [abs(a - b) for a, b in zip(one, two)]
tail = sum(diff[-50:]) / 50
print("loss curves, 200 steps, 1 GPU x 16 vs 2 GPUs x 8 (bf16 reduction): first %.4f / %.4f, last %.4f / %.4f, "
      "max |diff| %.4f, mean |diff| over the last 50 %.4f" % (one[0], two[0], one[-1], two[-1], max(diff), tail))
sys.exit(0 if len(one) == len(two) == 200 and max(diff) < 0.05 * max(one) else 1)
PY
    fi
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
      # $pid1 is the `timeout` wrapper: kill the rank itself, its child.
      rank1=$(pgrep -P "$pid1" -x vlmgraph-train)
      [ -n "$rank1" ] || { echo "rank 1 is not running (see $OUT/dp_kill_r1.log)"; failed=$((failed + 1)); }
      kill -9 $rank1
      t0=$(date +%s.%N)
      wait "$pid0"
      rc=$?
      took=$(python3 -c "print(round($(date +%s.%N) - $t0, 1))")
      echo "SIGKILL of rank 1: rank 0 exit status $rc after $took s (want 3 within 25 s: the 20 s timeout, and the step watchdog's 5 s)"
      { [ "$rc" = 3 ] && python3 -c "import sys; sys.exit($took > 25)"; } || failed=$((failed + 1))
      grep -h UNAVAILABLE "$OUT/dp_kill_r0.log" | tail -1
    fi
    ;;
  dpserve | dpsoak | dpscale)
    smol
    HTTP_LOAD=${HTTP_LOAD:-$ROOT/../shared/tools/http_load.py}
    [ -n "$TOKENIZER" ] || { echo "$WHAT needs VLMGRAPH_TOKENIZER (the loads send chat messages)"; exit 1; }
    serve() {  # serve W [ARGS...]: the server on W GPUs in the background; sets pid, grpc, http
      # Logs: dp_serve_wW$SERVE_TAG.{out,log}.
      local w=$1 log="$OUT/dp_serve_w$1${SERVE_TAG:-}"
      shift
      "$BIN/server/vlmgraph-server" --config deploy/config.yaml --model /tmp/vlmgraph-smol \
        --tokenizer "$TOKENIZER" --data-parallel-size "$w" --grpc-address 127.0.0.1:0 \
        --metrics-address 127.0.0.1:0 --http-address 127.0.0.1:0 --set 'auth.api_keys_file=""' "$@" \
        >"$log.out" 2>"$log.log" &
      pid=$!
      for _ in $(seq 900); do grep -q ready "$log.out" 2>/dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 0.2; done
      grpc=$(sed -n 's/.* grpc \([^ ]*\).*/\1/p' "$log.out")
      http=$(sed -n 's/.* http \([^ ]*\).*/\1/p' "$log.out")
      [ -n "$grpc" ] || { echo "server on $1 GPU(s) did not start"; failed=$((failed + 1)); kill $pid 2>/dev/null; return 1; }
    }
    grpc_load() {  # grpc_load NAME PROCS STREAMS_EACH SECONDS: PROCS vlmgraph-grpc-load processes
      for i in $(seq "$2"); do
        "$BIN/bench/vlmgraph-grpc-load" --address "$grpc" --concurrency "$3" --seconds "$4" --warmup 3 \
          --max-tokens 128 >"$OUT/$1_$i.json" 2>&1 &
        loaders+=($!)
      done
    }
    grpc_report() {  # grpc_report NAME LABEL: the figures of grpc_load NAME; errors fail the check
      python3 - "$OUT" "$1" "$2" <<'PY' || failed=$((failed + 1))
import glob, json, sys
out, name, label = sys.argv[1:]
rows = [json.loads(l) for f in glob.glob(f"{out}/{name}_*.json") for l in open(f) if l.startswith("{")]
errors = sum(r["errors"] for r in rows) if rows else -1
print("%s: %.0f tokens/s, %d requests, %d errors, TTFT p99 (worst process) %.1f ms"
      % (label, sum(r["tok_per_s"] for r in rows), sum(r["requests"] for r in rows), errors,
         max((r["ttft_p99_ms"] for r in rows), default=0)))
sys.exit(errors != 0)
PY
    }
    stop_server() {  # stop_server W: SIGTERM, exit status 0, and no device fault in its log
      if ! kill -0 $pid 2>/dev/null; then
        echo "the server on $1 GPU(s) died"; failed=$((failed + 1))
      fi
      kill -TERM $pid 2>/dev/null
      wait $pid
      local rc=$?
      local log="$OUT/dp_serve_w$1${SERVE_TAG:-}.log"
      grep -E "device|stopped|fault|assert" "$log" | grep -v "ready on" | head -5
      if [ "$rc" != 0 ] || grep -qE "failed and cannot run|device-side assert|stopped after a device fault" "$log"; then
        echo "server on $1 GPU(s): exit status $rc, or a device fault in its log"; failed=$((failed + 1))
      fi
    }
  ;;&
  dpserve)
    for w in $WORLDS; do
      serve "$w" || continue
      # gRPC alone first, at 128 streams per GPU: a load that once brought every GPU down.
      loaders=(); grpc_load "dp_grpc128_w$w" 1 $((128 * w)) 15; wait "${loaders[@]}"
      grpc_report "dp_grpc128_w$w" "grpc $w GPU(s), 128 streams per GPU"
      if [ -f "$HTTP_LOAD" ]; then
        python3 "$HTTP_LOAD" --url "http://$http" --model auto --concurrency $((256 * w)) --procs $((8 * w > 32 ? 32 : 8 * w)) \
          --seconds 15 --warmup 3 --max-tokens 128 2>&1 | tail -1 | sed "s/^/http $w GPU(s): /"
      fi
      loaders=(); grpc_load "dp_grpc_w$w" "$w" 256 15; wait "${loaders[@]}"
      grpc_report "dp_grpc_w$w" "grpc $w GPU(s), 256 streams per GPU"
      stop_server "$w"
    done
    ;;
  dpsoak)
    # gRPC and HTTP at once on every GPU for $VLMGRAPH_DPSOAK_SECONDS (default 600): 128 gRPC and
    # 128 HTTP streams per GPU; 0 errors, no device fault, a clean shutdown.
    secs=${VLMGRAPH_DPSOAK_SECONDS:-600}
    serve "$NG" || exit "$failed"
    loaders=(); grpc_load dp_soak_grpc 1 $((128 * NG)) "$secs"
    python3 "$HTTP_LOAD" --url "http://$http" --model auto --concurrency $((128 * NG)) --procs 16 \
      --seconds "$secs" --warmup 3 --max-tokens 128 >"$OUT/dp_soak_http.json" 2>&1
    wait "${loaders[@]}"
    grpc_report dp_soak_grpc "soak $NG GPU(s), $secs s: grpc"
    tail -1 "$OUT/dp_soak_http.json" | sed "s/^/soak $NG GPU(s), $secs s: http /"
    python3 -c "import json, sys; r = json.loads(open('$OUT/dp_soak_http.json').read().strip().splitlines()[-1]); sys.exit(r['errors'] != 0)" || failed=$((failed + 1))
    stop_server "$NG"
    ;;
  dpscale)
    # $VLMGRAPH_DPSCALE_PARTS: "train serve" (default), or either alone (two shorter calls; the
    # summary reads what the OUT_DIR holds).
    parts=" ${VLMGRAPH_DPSCALE_PARTS:-train serve} "
    if [[ $parts == *" train "* ]]; then
      # Training: the 1-GPU step first and last, each larger world between, the largest traced.
      train scale_train_w1a 1 "${B[@]}"
      for w in $WORLDS; do
        [ "$w" = 1 ] && continue
        if [ "$w" = "$NG" ]; then
          train "scale_train_w$w" "$w" "${B[@]}" --profile-trace "$OUT/scale_trace_w$w"
          python3 bench/allreduce_overlap.py "$OUT/scale_trace_w$w.graph.json" --steps 3 --steady --json \
            >"$OUT/scale_overlap_w$w.json" 2>&1 && tail -1 "$OUT/scale_overlap_w$w.json"
          gzip -f "$OUT/scale_trace_w$w.graph.json"
        else
          train "scale_train_w$w" "$w" "${B[@]}"
        fi
      done
      train scale_train_w1b 1 "${B[@]}"
      if [ -f "${VLMGRAPH_PEERS:-/nonexistent}/upstream_ddp_scaling.py" ]; then
        (cd "$VLMGRAPH_PEERS" && timeout 400 python3 upstream_ddp_scaling.py eager 8 1024) >"$OUT/scale_upstream.log" 2>&1
        grep RESULT "$OUT/scale_upstream.log" | tail -1
      fi
    fi
    if [[ $parts == *" serve "* ]]; then
      # Serving: HTTP, then gRPC with one loader per GPU and the server's threads sampled.
      scale_serve() {  # scale_serve W NAME [SERVER ARGS...]
        local w=$1 name=$2
        shift 2
        serve "$w" "$@" || return 0
        python3 "$HTTP_LOAD" --url "http://$http" --model auto --concurrency $((256 * w)) \
          --procs $((8 * w > 32 ? 32 : 8 * w)) --seconds 15 --warmup 3 --max-tokens 128 >"$OUT/${name}_http.json" 2>&1
        tail -1 "$OUT/${name}_http.json" | sed "s/^/$name http: /"
        loaders=(); grpc_load "${name}_grpc" "$w" 256 15
        sleep 8
        python3 bench/thread_cpu.py "$pid" --seconds 5 --top 16 --json >"$OUT/${name}_threads.json"
        wait "${loaders[@]}"
        grpc_report "${name}_grpc" "$name grpc, 256 streams per GPU"
        stop_server "$w"
      }
      for w in $WORLDS; do scale_serve "$w" "scale_w$w"; done
      # $VLMGRAPH_DPSCALE_FIXED=0 leaves this comparison out.
      if [ "${VLMGRAPH_DPSCALE_FIXED:-1}" = 1 ]; then
        SERVE_TAG=_fixed scale_serve "$NG" "scale_w${NG}_fixed" --set server.stream_threads=2 --set http.io_threads=2
      fi
    fi
    python3 bench/scaling_summary.py "$OUT" | tee "$OUT/scale_summary.txt" || failed=$((failed + 1))
    ;;
esac
exit "$failed"
