#!/usr/bin/env python3
"""Tests for check_wiring.py: it passes the repository's files and catches each kind of mismatch.

Every case copies the deployment files (compose.yaml, Dockerfile, .dockerignore, .ci/run, deploy/,
and the repository paths the Dockerfile names) into a temporary root, breaks one thing, and expects
check_wiring.py to fail on it, and only on it.

  tests/deploy/test_check_wiring.py
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CHECKER = os.path.join(HERE, "check_wiring.py")
COPIED = ["compose.yaml", "Dockerfile", ".dockerignore", ".ci/run", "deploy", "scripts/install-deps.sh",
          "scripts/test.sh", "tests/deploy/grpc_health_probe.cc"]


def make_root():
    tmp = tempfile.mkdtemp(prefix="wiring-")
    for rel in COPIED:
        src, dst = os.path.join(ROOT, rel), os.path.join(tmp, rel)
        if not os.path.exists(src):
            continue
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.isdir(src):
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("models"))
        else:
            shutil.copy2(src, dst)
    return tmp


def edit(root, rel, old, new, count=1):
    path = os.path.join(root, rel)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if old not in text:
        raise AssertionError(f"test setup: '{old}' not in {rel}")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace(old, new, count))


def edit_re(root, rel, pattern, new):
    path = os.path.join(root, rel)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    text2 = re.sub(pattern, new, text, count=1, flags=re.M)
    if text2 == text:
        raise AssertionError(f"test setup: /{pattern}/ not in {rel}")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text2)


def check(root):
    r = subprocess.run([sys.executable, CHECKER, "--root", root], capture_output=True, text=True,
                       timeout=60)
    return r.returncode, r.stdout + r.stderr


def main():
    # (name, mutation, text the failure must mention)
    cases = [
        ("prometheus scrapes the wrong port",
         lambda r: edit(r, "deploy/prometheus.yml", '"vlmgraph:9464"', '"vlmgraph:9465"'),
         "metrics port"),
        ("prometheus scrapes an unknown host",
         lambda r: edit(r, "deploy/prometheus.yml", '"vlmgraph:9464"', '"server:9464"'),
         "not a compose service"),
        ("config listens on loopback only",
         lambda r: edit_re(r, "deploy/config.yaml", r"grpc_address:\s*\S+",
                           "grpc_address: 127.0.0.1:50051"),
         "listens on 127.0.0.1"),
        ("config on CPU while compose reserves a GPU",
         lambda r: edit_re(r, "deploy/config.yaml", r"^device:\s*\S+", "device: cpu"),
         "use cuda"),
        ("throughput config has a key config.yaml lacks",
         lambda r: edit(r, "deploy/config-throughput.yaml", "batching:\n",
                        "batching:\n  max_queue_delay_ms: 5\n"),
         "batching.max_queue_delay_ms"),
        ("grafana dashboards mounted elsewhere",
         lambda r: edit(r, "compose.yaml", "./deploy/grafana/dashboards:/etc/grafana/dashboards:ro",
                        "./deploy/grafana/dashboards:/var/dashboards:ro"),
         "provider path"),
        ("grafana data source points at a wrong host",
         lambda r: edit(r, "deploy/grafana/provisioning/datasources/prometheus.yml",
                        "http://prometheus:9090", "http://localhost:9090"),
         "not a compose service"),
        ("no GPU reservation",
         lambda r: edit(r, "compose.yaml", "capabilities: [gpu]", "capabilities: [utility]"),
         "reserves no NVIDIA GPU"),
        ("every GPU in the config, one reserved by compose",
         lambda r: edit(r, "compose.yaml", "count: all", "count: 1"),
         "count: all"),
        ("the config's model is not converted into the image",
         lambda r: edit(r, "Dockerfile", "/stage/opt/vlmgraph/models/smollm2-135m-instruct;",
                        "/stage/opt/vlmgraph/models/other;"),
         "not converted into the image"),
        ("compose --config names a missing file",
         lambda r: edit(r, "compose.yaml", "${VLMGRAPH_CONFIG:-config.yaml}",
                        "${VLMGRAPH_CONFIG:-server.yaml}"),
         "--config /etc/vlmgraph/server.yaml"),
        ("Dockerfile skips the dependency script",
         lambda r: edit(r, "Dockerfile", "RUN scripts/install-deps.sh", "RUN apt-get update"),
         "does not RUN scripts/install-deps.sh"),
        (".ci/run uses another dependency script",
         lambda r: edit(r, ".ci/run", "scripts/install-deps.sh", "scripts/other-deps.sh"),
         ".ci/run does not run scripts/install-deps.sh"),
        ("Dockerfile build stage is not CUDA 13.0",
         lambda r: edit(r, "Dockerfile", "ARG CUDA_VERSION=13.0.1", "ARG CUDA_VERSION=12.8.1"),
         "not NVIDIA CUDA 13.0 devel"),
        ("runtime runs as root",
         lambda r: edit(r, "Dockerfile", "USER vlmgraph:vlmgraph", "USER root"),
         "non-root USER"),
        ("health check on a wrong port",
         lambda r: edit(r, "Dockerfile", "VLMGRAPH_HEALTH_ADDRESS=127.0.0.1:50051",
                        "VLMGRAPH_HEALTH_ADDRESS=127.0.0.1:50052"),
         "VLMGRAPH_HEALTH_ADDRESS"),
        (".dockerignore drops a file the build needs",
         lambda r: edit(r, ".dockerignore", ".git\n", ".git\nscripts\n"),
         "keeps scripts/install-deps.sh"),
    ]
    failures = []
    root = make_root()
    try:
        rc, out = check(root)
        ok = rc == 0
        print(f"{'ok  ' if ok else 'FAIL'} repository files pass: rc {rc}")
        if not ok:
            failures.append("baseline")
            print("    " + out.strip().replace("\n", "\n    "))
    finally:
        shutil.rmtree(root)
    for name, mutate, expect in cases:
        root = make_root()
        try:
            mutate(root)
            rc, out = check(root)
        except (AssertionError, OSError) as e:  # the file to break is missing or changed shape
            rc, out = -1, f"FAIL test setup: {e}"
        finally:
            shutil.rmtree(root)
        problems = [ln for ln in out.splitlines() if ln.startswith("FAIL")]
        ok = rc == 1 and any(expect in ln for ln in problems)
        print(f"{'ok  ' if ok else 'FAIL'} {name}: rc {rc}, {len(problems)} problems")
        if not ok or os.environ.get("VERBOSE"):
            print("    " + out.strip().replace("\n", "\n    "))
        if not ok:
            failures.append(name)
    total = len(cases) + 1
    print(f"test_check_wiring: {total - len(failures)} of {total} cases as expected")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
