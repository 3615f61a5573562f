#!/usr/bin/env bash
# Builds vlmgraph-server (Release, Ninja, into ./build; only the server and what it links) and runs
# it with the given flags. With none: the built-in nanovlm-tiny model on CPU, gRPC on
# 127.0.0.1:50051, metrics on http://127.0.0.1:9464/metrics. The README's quick start:
#
#   scripts/install-deps.sh && scripts/serve.sh
#   PYTHONPATH=clients/python python3 -m vlmgraph_client demo     # in another terminal
#
#   scripts/serve.sh --config deploy/config.yaml                  # a GPU deployment
#   scripts/serve.sh --help                                       # every flag
# Environment: BUILD_DIR (default build), JOBS (parallel compile jobs), VLMGRAPH_CMAKE_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${VLMGRAPH_CMAKE_ARGS:-}
cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}" --target vlmgraph-server
echo "serve: starting $BUILD_DIR/server/vlmgraph-server $*"
echo "serve: try it from another terminal: PYTHONPATH=clients/python python3 -m vlmgraph_client demo"
exec "$BUILD_DIR/server/vlmgraph-server" "$@"
