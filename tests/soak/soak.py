#!/usr/bin/env python3
"""Soak test of vlmgraph-server: a bounded mixed load for a fixed time, with a PASS/FAIL verdict.

    python3 tests/soak/soak.py --duration 1800 --json /tmp/soak-cpu.json          # start a server
    python3 tests/soak/soak.py --server-arg=--model --server-arg=DIR ...           # a checkpoint
    python3 tests/soak/soak.py --grpc H:P --http H:P --metrics H:P --pid PID ...   # attach to one
    python3 tests/soak/soak.py --ops train,forward --duration 600 ...              # part of the mix

It starts `--server` (default build/server/vlmgraph-server, the built-in nanovlm-tiny model on the
CPU unless --server-arg says otherwise) on free loopback ports and reads its ready line, or
attaches to a running server. For --duration seconds, --concurrency worker threads (default 8)
each send one request at a time, drawn at random from a fixed mix:
  - gRPC Generate: token ids (greedy and sampled, short and long prompts), with a small PNG made
    in-process and with skimage's chelsea.png when present; Forward with target_ids and logits;
    short Train jobs (a few steps on tiny examples; one job runs at a time on the server, so
    RESOURCE_EXHAUSTED for a concurrent second job is expected);
  - bad requests (empty prompt, out-of-vocabulary ids, bad and truncated image bytes, image-token
    count mismatch, max_new_tokens 0, too long, bad targets): INVALID_ARGUMENT expected;
  - cancellations (a Generate stream cancelled after its first message) and vanished clients (a
    stream whose channel is closed abruptly, after the first message or at once);
  - HTTP: GET /v1/models, /health, bad JSON (400), unknown path (404), and a request cut off
    mid-body. With a tokenizer (GetModelInfo.tokenizer): OpenAI chat/completions (plain,
    streamed, with an image) through the `openai` SDK, a streamed chat whose socket is closed
    after the first bytes, and gRPC text/chat Generate and Forward. Without a tokenizer the text
    endpoints answer 400 (HTTP) / FAILED_PRECONDITION (gRPC), which is expected.
Every request has a deadline (--deadline). Each outcome is expected-OK, expected-error (with its
status code) or UNEXPECTED (any other status, any exception, a deadline passed = a hang).

Every --sample-seconds (default 30) it samples the server's RSS (/proc/PID/status VmRSS), thread
and fd counts, GPU memory of the pid (`nvidia-smi`, when present), /metrics counters and gauges
(vlmgraph_graph_captures_total, vlmgraph_requests_total by rpc/code,
vlmgraph_http_requests_total by endpoint/status, vlmgraph_queue_depth,
vlmgraph_active_sequences), and the p50/p99 client latency of successful Generate calls that
finished in the window. At the end the load stops, the gauges must return to 0, and a server the
script started gets SIGTERM and must exit with status 0 within --shutdown-timeout.

Verdict: PASS only if every check holds:
  memory     Let S be the RSS samples taken under load at or after --warmup-seconds from the
             load's start (default: min(120, 20% of --duration)). S needs at least 3 samples, and
             the drift, (median of S's last third - median of its first third) / median of its
             first third, is at most 2%. Medians of thirds, not single samples: a sample under
             load also holds the buffers of the requests and Train jobs in flight at that moment
             (tens of MiB on the GPU server), which come and go; a leak moves the whole last
             third. The highest single sample and the sample after the load are reported.
             (Skipped, not failed, when attached without --pid.)
  captures   the serving graphs' captures, sum(vlmgraph_graph_captures_total{region!="train"}), are
             the same at S[0] and at the end. Each Train job captures graphs of its own when it
             starts (it trains its own copy of the weights): reported, region train, not a failure.
  outcomes   zero UNEXPECTED outcomes (hangs included).
  answered   no request passed its deadline, no worker was stuck (a call running longer than
             --deadline + 30 s), the gauges vlmgraph_queue_depth and vlmgraph_active_sequences
             were back to 0 within 30 s of the load's end, and (server started by the script) for
             each RPC the server's vlmgraph_requests_total counted every call the server certainly
             received and none it cannot have received.
  exit       (server started by the script) exit status 0 within --shutdown-timeout of SIGTERM.
Exit status 0 on PASS, 1 on FAIL (2 when the server could not be started or reached).

Output: a Markdown summary on stdout (memory series, statuses by code, captures, Generate latency
per window, server warnings/errors) and, with --json FILE, every series as JSON.
"""
import argparse
import base64
import collections
import datetime
import http.client
import json
import math
import os
import random
import re
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zlib

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))

import grpc  # noqa: E402

from vlmgraph_client import VlmGraphClient  # noqa: E402
from vlmgraph_client.prompt import build_prompt, image_tiles  # noqa: E402

CHELSEA = "/usr/lib/python3/dist-packages/skimage/data/chelsea.png"
READY_RE = re.compile(r"vlmgraph-server ready: grpc (\S+) metrics (\S+)(?: http (\S+))?")
SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)$")
MEMORY_LIMIT = 0.02  # relative RSS drift allowed after warm-up (medians of thirds)


# --- small helpers -----------------------------------------------------------------------------

def make_png(width, height, seed=0):
    """An RGB PNG of random pixels, encoded with zlib (no imaging library needed)."""
    rng = random.Random(seed)
    raw = b"".join(b"\x00" + bytes(rng.randrange(256) for _ in range(width * 3)) for _ in range(height))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def parse_metrics(text):
    out = []
    for line in text.splitlines():
        m = SAMPLE_RE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
            try:
                out.append((m.group(1), labels, float(m.group(4))))
            except ValueError:
                pass
    return out


def percentile(values, q):
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def proc_status(pid):
    """(VmRSS KiB, threads, open fds) of `pid`, None for what cannot be read."""
    rss = threads = fds = None
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("Threads:"):
                    threads = int(line.split()[1])
    except OSError:
        pass
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        pass
    return rss, threads, fds


def gpu_used_mib(pid):
    if not pid or not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    used = 0
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            try:
                used += int(parts[1])
            except ValueError:
                pass
    return used


def fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


class Unexpected(Exception):
    """A response that arrived but is wrong (missing summary, wrong counts, bad JSON...)."""


# --- the load ----------------------------------------------------------------------------------

class Soak:
    def __init__(self, args, grpc_addr, http_addr, metrics_addr, pid):
        self.args = args
        self.grpc_addr, self.http_addr, self.metrics_addr, self.pid = grpc_addr, http_addr, metrics_addr, pid
        self.client = VlmGraphClient(grpc_addr, timeout=args.deadline)
        self.pb = self.client.pb
        self.client.wait_ready(timeout=60)
        self.info = self.client.model_info()
        self.has_tokenizer = bool(self.info.tokenizer)
        self.lock = threading.Lock()
        self.records = []          # (t_end, op, kind, code, latency, detail)
        self.unexpected = []
        self.issued = collections.Counter()     # rpc -> calls the server certainly received
        self.uncertain = collections.Counter()  # rpc -> calls it may not have received
        self.busy = {}             # worker -> (op, start)
        self.stuck = []
        self.stop = threading.Event()
        self.seq = 0
        self.t0 = None
        # Prompt material.
        info = self.info
        self.id_pool = [i for i in range(min(info.vocab_size, 1000)) if i != info.image_token_id]
        self.small_png = make_png(96, 24, seed=1)
        self.small_tiles = image_tiles(self.small_png, info)
        self.chelsea = None
        if os.path.isfile(CHELSEA):
            with open(CHELSEA, "rb") as fh:
                self.chelsea = fh.read()
            self.chelsea_tiles = image_tiles(self.chelsea, info)
            if self.chelsea_tiles > info.max_tiles_per_request:
                self.chelsea = None
        self.openai = None
        if self.has_tokenizer and http_addr:
            import openai
            self.openai = openai.OpenAI(base_url=f"http://{http_addr}/v1", api_key="unused",
                                        timeout=args.deadline, max_retries=0)
        self.ops = self._op_table()

    # -- bookkeeping --

    def now(self):
        return time.monotonic() - self.t0

    def record(self, op, kind, code, latency, detail=""):
        rec = (round(self.now(), 3), op, kind, code, round(latency, 4), detail[:500])
        with self.lock:
            self.records.append(rec)
            if kind == "unexpected":
                self.unexpected.append(rec)
        if kind == "unexpected" and self.args.verbose:
            print(f"UNEXPECTED {rec}", file=sys.stderr, flush=True)

    def run_op(self, op, fn, expect, rpc=None, uncertain=False):
        """Runs fn(); `expect` = the set of status names that are expected ("OK" for success)."""
        start = time.monotonic()
        code, detail = "OK", ""
        try:
            result = fn()
            if isinstance(result, str):  # an op may name its own outcome code
                code = result
        except grpc.RpcError as e:
            code = e.code().name if e.code() else "UNKNOWN"
            detail = (e.details() or "")
        except Unexpected as e:
            code, detail = "BAD_RESPONSE", str(e)
        except Exception as e:  # noqa: BLE001 - every exception is an outcome
            status = getattr(e, "status_code", None)
            code = f"HTTP_{status}" if isinstance(status, int) else type(e).__name__
            detail = f"{e}\n{traceback.format_exc(limit=3)}"
        latency = time.monotonic() - start
        if rpc:
            with self.lock:
                (self.uncertain if uncertain else self.issued)[rpc] += 1
        if code in expect:
            kind = "ok" if code in ("OK", "HTTP_200") else "expected_error"
        else:
            kind = "unexpected"
            if code == "DEADLINE_EXCEEDED" or "Timeout" in code:
                detail = "HANG (deadline passed): " + detail
        self.record(op, kind, code, latency, detail)
        return code

    # -- request builders --

    def ids(self, rng, n):
        return [rng.choice(self.id_pool) for _ in range(n)]

    def sampling_kwargs(self, rng, max_new):
        kw = {"max_new_tokens": max_new}
        if rng.random() < 0.5:
            kw.update(sample=True, temperature=rng.choice([0.7, 1.0, 1.3]), top_k=rng.choice([0, 20, 50]),
                      top_p=rng.choice([None, 0.9]), seed=rng.randrange(1 << 30))
        if rng.random() < 0.2:
            kw["stop_token_ids"] = [rng.choice(self.id_pool)]
        return kw

    def stream_all(self, req, max_new, timeout=None):
        """Reads a Generate stream to its end; checks it ends with exactly one summary."""
        tokens, summary = 0, None
        for msg in self.client.generate_stream(req, timeout=timeout or self.args.deadline):
            if summary is not None:
                raise Unexpected("message after the summary")
            if msg.HasField("tokens"):
                tokens += len(msg.tokens.token_ids)
            elif msg.HasField("summary"):
                summary = msg.summary
        if summary is None:
            raise Unexpected("stream ended OK without a summary")
        if summary.generated_tokens != tokens or (max_new is not None and tokens > max_new):
            raise Unexpected(f"summary says {summary.generated_tokens} tokens, stream had {tokens}, max {max_new}")
        return summary

    def generate(self, rng, op, ids, images=None, max_new=None, expect=("OK",), **extra):
        kw = self.sampling_kwargs(rng, max_new) if max_new is not None else {}
        kw.update(extra)
        with self.lock:
            self.seq += 1
            rid = f"soak-{self.seq}"
        req = self.client.generate_request(ids, images, request_id=rid, **kw)
        return self.run_op(op, lambda: self.stream_all(req, kw.get("max_new_tokens")), set(expect), rpc="Generate")

    # -- the operations --

    def op_gen_ids(self, rng):
        n = rng.randint(1, 60)
        self.generate(rng, "generate_ids", self.ids(rng, n), max_new=rng.randint(1, 32))

    def op_gen_long(self, rng):
        # Beyond the largest prefill bucket: eager or refused, as buckets.oversize says.
        n = max(self.info.seq_lens) + rng.randint(1, 40)
        max_new = 8
        if n + max_new > self.info.max_context:
            n = self.info.max_context - max_new
        expect = ("OK",) if self.info.oversize == "eager" else ("INVALID_ARGUMENT",)
        self.generate(rng, "generate_long", self.ids(rng, n), max_new=max_new, expect=expect)

    def op_gen_image_small(self, rng):
        ids = build_prompt(self.info, [self.small_tiles], self.ids(rng, rng.randint(1, 12)))
        self.generate(rng, "generate_image_small", ids, [self.small_png], max_new=rng.randint(1, 16))

    def op_gen_image_chelsea(self, rng):
        if self.chelsea is None:
            return self.op_gen_image_small(rng)
        ids = build_prompt(self.info, [self.chelsea_tiles], self.ids(rng, rng.randint(1, 12)))
        self.generate(rng, "generate_image_chelsea", ids, [self.chelsea], max_new=rng.randint(1, 16))

    def op_forward(self, rng):
        n = rng.randint(2, 100)
        ids = self.ids(rng, n)
        targets = ids[1:] + [-100]
        for i in range(n):
            if rng.random() < 0.1:
                targets[i] = -100
        positions = sorted(rng.sample(range(n), min(n, rng.randint(0, 3))))

        def call():
            r = self.client.forward(ids, target_ids=targets, logits_positions=positions, timeout=self.args.deadline)
            counted = sum(1 for t in targets if t != -100)
            if r.loss_tokens != counted or not math.isfinite(r.loss):
                raise Unexpected(f"loss {r.loss} over {r.loss_tokens} tokens, expected {counted} tokens")
            if [p.position for p in r.logits] != positions or any(
                    len(p.logits) != self.info.vocab_size for p in r.logits):
                raise Unexpected("logits positions or sizes differ from the request")

        self.run_op("forward", call, {"OK"}, rpc="Forward")

    def train_examples(self, rng):
        out = []
        for _ in range(rng.randint(1, 3)):
            n = rng.randint(4, 24)
            ids = self.ids(rng, n)
            ex = {"input_ids": ids, "target_ids": ids[1:] + [-100]}
            out.append(ex)
        return out

    def op_train(self, rng):
        steps = rng.randint(2, 4)
        def call():
            cfg = self.client.train_config(language_learning_rate=1e-5, trainable_parts=["LANGUAGE"])
            reqs = [self.client.train_batch(self.train_examples(rng)) for _ in range(steps)]
            got = []
            for resp in self.client.train(cfg, iter(reqs), timeout=self.args.deadline):
                if resp.HasField("step"):
                    got.append(resp.step)
            if [s.step for s in got] != list(range(1, steps + 1)):
                raise Unexpected(f"steps {[s.step for s in got]}, expected 1..{steps}")
            if any(not math.isfinite(s.loss) for s in got):
                raise Unexpected("a non-finite training loss")

        self.run_op("train", call, {"OK", "RESOURCE_EXHAUSTED"}, rpc="Train")

    def op_train_bad(self, rng):
        def call():
            cfg = self.client.train_config(language_learning_rate=1e-5, trainable_parts=["LANGUAGE"])
            bad = self.client.train_batch([{"input_ids": [1, 2, 3], "target_ids": [2, 3]}])
            for _ in self.client.train(cfg, iter([bad]), timeout=self.args.deadline):
                pass

        self.run_op("bad_train_targets", call, {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}, rpc="Train")

    def op_bad(self, rng):
        info = self.info
        which = rng.choice(["empty", "oov", "negative", "bad_image", "truncated_image", "image_count",
                            "zero_max_new", "too_long", "forward_targets", "forward_oov", "forward_positions"])
        inv = ("INVALID_ARGUMENT",)
        if which == "empty":
            self.generate(rng, "bad_empty_prompt", [], expect=inv)
        elif which == "oov":
            self.generate(rng, "bad_oov_id", self.ids(rng, 3) + [info.vocab_size + rng.randrange(1000)], max_new=4,
                          expect=inv)
        elif which == "negative":
            self.generate(rng, "bad_oov_id", [-1 - rng.randrange(5)] + self.ids(rng, 3), max_new=4, expect=inv)
        elif which == "bad_image":
            ids = build_prompt(info, [1], self.ids(rng, 4))
            self.generate(rng, "bad_image_bytes", ids, [os.urandom(rng.randint(1, 200))], max_new=4, expect=inv)
        elif which == "truncated_image":
            data = self.chelsea or self.small_png
            tiles = image_tiles(data, info)
            ids = build_prompt(info, [tiles], self.ids(rng, 4))
            self.generate(rng, "bad_image_truncated", ids, [data[:rng.randint(40, len(data) // 2)]], max_new=4,
                          expect=inv)
        elif which == "image_count":
            ids = build_prompt(info, [self.small_tiles + 1], self.ids(rng, 4))
            self.generate(rng, "bad_image_token_count", ids, [self.small_png], max_new=4, expect=inv)
        elif which == "zero_max_new":
            self.generate(rng, "bad_max_new_tokens", self.ids(rng, 4), max_new=0, expect=inv)
        elif which == "too_long":
            n = rng.randint(8, 32)
            self.generate(rng, "bad_too_long", self.ids(rng, n), max_new=info.max_context - n + 1, expect=inv)
        elif which == "forward_targets":
            ids = self.ids(rng, 8)
            self.run_op("bad_forward_targets", lambda: self.client.forward(ids, target_ids=ids[:5]),
                        set(inv), rpc="Forward")
        elif which == "forward_oov":
            ids = self.ids(rng, 4) + [info.vocab_size]
            self.run_op("bad_forward_oov", lambda: self.client.forward(ids, target_ids=[-100] * 5),
                        set(inv), rpc="Forward")
        else:
            ids = self.ids(rng, 4)
            self.run_op("bad_forward_positions", lambda: self.client.forward(ids, logits_positions=[4]),
                        set(inv), rpc="Forward")

    def op_cancel(self, rng):
        req = self.client.generate_request(self.ids(rng, rng.randint(1, 30)), max_new_tokens=200)

        def call():
            stream = self.client.generate_stream(req, timeout=self.args.deadline)
            next(stream)
            stream.cancel()
            for _ in stream:  # finished before the cancel: then it ends OK
                pass

        self.run_op("cancel_after_first", call, {"CANCELLED", "OK"}, rpc="Generate")

    def op_vanish(self, rng):
        after_first = rng.random() < 0.7
        req = self.client.generate_request(self.ids(rng, rng.randint(1, 30)), max_new_tokens=200)

        def call():
            channel = grpc.insecure_channel(self.grpc_addr)
            try:
                stub = self.pb.service_pb2_grpc.VlmGraphStub(channel)
                stream = stub.Generate(req, timeout=self.args.deadline)
                if after_first:
                    next(stream)
                else:
                    time.sleep(rng.random() * 0.05)
            finally:
                channel.close()
            return "VANISHED"

        self.run_op("vanish_after_first" if after_first else "vanish_at_once", call, {"VANISHED"},
                    rpc="Generate", uncertain=not after_first)

    # HTTP

    def http(self, method, path, body=None, expect_status=200):
        host, port = self.http_addr.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=self.args.deadline)
        try:
            headers = {"Content-Type": "application/json"} if body is not None else {}
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        if resp.status != expect_status:
            raise Unexpected(f"{method} {path}: HTTP {resp.status} {data[:300]!r}")
        if resp.status >= 400:
            err = json.loads(data)
            if "error" not in err or "message" not in err["error"]:
                raise Unexpected(f"error body without error.message: {data[:300]!r}")
        return data

    def op_http_misc(self, rng):
        which = rng.choice(["models", "models", "health", "bad_json", "unknown_path", "cut_off"])
        if which == "models":
            def call():
                data = json.loads(self.http("GET", "/v1/models"))
                if data["data"][0]["id"] != self.info.served_model_name:
                    raise Unexpected(f"/v1/models lists {data}")
                return "HTTP_200"
            self.run_op("http_models", call, {"HTTP_200"})
        elif which == "health":
            self.run_op("http_health", lambda: (self.http("GET", "/health"), "HTTP_200")[1], {"HTTP_200"})
        elif which == "bad_json":
            self.run_op("http_bad_json", lambda: (self.http("POST", "/v1/chat/completions", b"{not json",
                                                            expect_status=400), "HTTP_400")[1], {"HTTP_400"})
        elif which == "unknown_path":
            self.run_op("http_unknown_path", lambda: (self.http("GET", "/v1/nothing-here", expect_status=404),
                                                      "HTTP_404")[1], {"HTTP_404"})
        else:
            def call():
                host, port = self.http_addr.rsplit(":", 1)
                with socket.create_connection((host, int(port)), timeout=10) as s:
                    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json"
                              b"\r\nContent-Length: 500\r\n\r\n{\"messages\": [")
                return "VANISHED"
            self.run_op("http_cut_off_body", call, {"VANISHED"})

    def op_http_text(self, rng):
        """OpenAI text endpoints: 200 with a tokenizer, 400 without."""
        import openai
        which = rng.choice(["chat", "chat", "chat_stream", "completion", "chat_image"])
        content = rng.choice(["What is the capital of France?", "Say hello.", "Count to five.", "Name a colour."])
        messages = [{"role": "user", "content": content}]
        if which == "chat_image":
            url = "data:image/png;base64," + base64.b64encode(self.small_png).decode()
            messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "What is in this picture?"}]}]
        max_tokens = rng.randint(1, 24)
        expect = {"HTTP_200"} if self.has_tokenizer else {"HTTP_400"}

        def call():
            if self.openai is None:
                # No tokenizer: the SDK is not needed to see the 400; plain HTTP keeps it light.
                path = "/v1/completions" if which == "completion" else "/v1/chat/completions"
                body = {"model": self.info.served_model_name, "max_tokens": max_tokens}
                body.update({"prompt": content} if which == "completion" else {"messages": messages})
                self.http("POST", path, json.dumps(body).encode(), expect_status=400)
                return "HTTP_400"
            try:
                if which == "completion":
                    r = self.openai.completions.create(model=self.info.served_model_name, prompt=content,
                                                       max_tokens=max_tokens, temperature=0)
                    if r.usage.completion_tokens > max_tokens:
                        raise Unexpected(f"{r.usage.completion_tokens} tokens > max_tokens {max_tokens}")
                elif which == "chat_stream":
                    done = False
                    for chunk in self.openai.chat.completions.create(
                            model=self.info.served_model_name, messages=messages, max_tokens=max_tokens,
                            stream=True, temperature=0):
                        if chunk.choices and chunk.choices[0].finish_reason:
                            done = True
                    if not done:
                        raise Unexpected("stream without a finish_reason")
                else:
                    r = self.openai.chat.completions.create(model=self.info.served_model_name, messages=messages,
                                                            max_tokens=max_tokens, temperature=0)
                    if r.choices[0].finish_reason not in ("stop", "length"):
                        raise Unexpected(f"finish_reason {r.choices[0].finish_reason}")
            except openai.APIStatusError as e:
                return f"HTTP_{e.status_code}"
            return "HTTP_200"

        self.run_op(f"http_{which}", call, expect)

    def op_http_vanish(self, rng):
        """A streamed chat whose socket is closed after the first bytes (server counts 499)."""
        body = json.dumps({"model": self.info.served_model_name, "stream": True, "max_tokens": 200,
                           "messages": [{"role": "user", "content": "Tell me a long story."}]}).encode()

        def call():
            host, port = self.http_addr.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=self.args.deadline) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                          + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                first = s.recv(256)
                if not first.startswith(b"HTTP/1.1 200"):
                    raise Unexpected(f"streamed chat answered {first[:100]!r}")
            return "VANISHED"

        self.run_op("http_vanish_stream", call, {"VANISHED"})

    def _raw_http(self, data, slow_seconds=0.0, timeout=None):
        """Sends raw bytes (over `slow_seconds`, one byte at a time, when set) and returns the
        status of the answer ("HTTP_nnn"), or CLOSED when the server closed without one."""
        host, port = self.http_addr.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=timeout or self.args.deadline) as s:
            if slow_seconds:
                pause = slow_seconds / max(1, len(data))
                for i in range(len(data)):
                    try:
                        s.sendall(data[i:i + 1])
                    except OSError:
                        break
                    time.sleep(pause)
            else:
                s.sendall(data)
            got = b""
            try:
                while b"\r\n" not in got:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    got += chunk
            except (ConnectionResetError, BrokenPipeError):
                pass
        if got.startswith(b"HTTP/1.1 "):
            return "HTTP_" + got.split(b" ")[1].decode()
        return "CLOSED"

    def op_http_attack(self, rng):
        """Hostile HTTP clients (docs/security.md): a head sent one byte at a time past
        http.request_head_timeout_seconds (408 or closed), a 200 MB body announced but never sent
        (413 from its Content-Length), a form body (415), a request line over 64 KiB (414)."""
        which = rng.choice(["slow_head", "huge_body", "form_body", "long_line"])
        if which == "slow_head":
            head = b"GET /health HTTP/1.1\r\nHost: soak\r\nX-Slow: " + b"s" * 200 + b"\r\n\r\n"
            self.run_op("http_slow_head", lambda: self._raw_http(head, slow_seconds=60, timeout=90),
                        {"HTTP_408", "CLOSED"})
        elif which == "huge_body":
            head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 200000000\r\n\r\n")
            self.run_op("http_huge_body", lambda: self._raw_http(head), {"HTTP_413", "HTTP_401"})
        elif which == "form_body":
            body = b"messages=hello"
            req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\n"
                   b"Content-Type: application/x-www-form-urlencoded\r\n"
                   + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            self.run_op("http_form_body", lambda: self._raw_http(req), {"HTTP_415", "HTTP_401"})
        else:
            req = b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: soak\r\n\r\n"
            self.run_op("http_long_line", lambda: self._raw_http(req), {"HTTP_414"})

    # gRPC text prompts

    def op_grpc_text(self, rng):
        which = rng.choice(["text", "chat", "chat_image", "forward_text"])
        prompt = rng.choice(["The capital of France is", "Once upon a time", "1, 2, 3,", "Hello"])
        expect = ("OK",) if self.has_tokenizer else ("FAILED_PRECONDITION",)
        if which == "forward_text":
            self.run_op("forward_text", lambda: self.client.forward(text=prompt, target_next_tokens=True),
                        set(expect), rpc="Forward")
        elif which == "text":
            self.generate(rng, "generate_text", [], max_new=rng.randint(1, 24), expect=expect, text=prompt)
        else:
            content = [self.small_png, prompt] if which == "chat_image" else prompt
            self.generate(rng, f"generate_{which}", [], max_new=rng.randint(1, 24), expect=expect,
                          messages=[{"role": "user", "content": content}])

    def _op_table(self):
        ops = [(self.op_gen_ids, 30), (self.op_gen_long, 2), (self.op_gen_image_small, 6),
               (self.op_gen_image_chelsea, 3), (self.op_forward, 14), (self.op_train, 4), (self.op_train_bad, 1),
               (self.op_bad, 12), (self.op_cancel, 6), (self.op_vanish, 5)]
        if self.http_addr:
            ops += [(self.op_http_misc, 6), (self.op_http_text, 10 if self.has_tokenizer else 3),
                    (self.op_http_attack, 2)]
            if self.has_tokenizer:
                ops.append((self.op_http_vanish, 3))
        ops.append((self.op_grpc_text, 12 if self.has_tokenizer else 2))
        if self.args.ops:
            names = set(self.args.ops.split(","))
            unknown = names - {fn.__name__[3:] for fn, _ in ops}
            if unknown:
                raise SystemExit(f"soak: --ops: unknown or unavailable operations {sorted(unknown)}; "
                                 f"known: {[fn.__name__[3:] for fn, _ in ops]}")
            ops = [(fn, w) for fn, w in ops if fn.__name__[3:] in names]
        return ops

    def worker(self, index):
        rng = random.Random(self.args.seed * 1000 + index)
        fns, weights = zip(*self.ops)
        while not self.stop.is_set():
            fn = rng.choices(fns, weights)[0]
            with self.lock:
                self.busy[index] = (fn.__name__, time.monotonic())
            try:
                fn(rng)
            except Exception as e:  # noqa: BLE001 - a bug in a request builder is still an outcome
                self.record(fn.__name__, "unexpected", type(e).__name__, 0.0, traceback.format_exc(limit=4))
            with self.lock:
                self.busy.pop(index, None)

    # -- sampling --

    def metrics(self):
        host, port = self.metrics_addr.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=20)
        try:
            conn.request("GET", "/metrics")
            return parse_metrics(conn.getresponse().read().decode())
        finally:
            conn.close()

    def sample(self, label, since):
        """One sample of the series; `since` = start of this latency window (seconds)."""
        t = self.now()
        rss, threads, fds = proc_status(self.pid) if self.pid else (None, None, None)
        s = {"t": round(t, 1), "label": label, "rss_kib": rss, "threads": threads, "fds": fds,
             "gpu_mib": gpu_used_mib(self.pid)}
        try:
            with open("/proc/loadavg") as fh:
                s["loadavg_1m"] = float(fh.read().split()[0])
        except OSError:
            pass
        try:
            samples = self.metrics()
            s["metrics_error"] = None
        except (OSError, http.client.HTTPException) as e:
            samples, s["metrics_error"] = [], str(e)

        def total(name):
            return sum(v for n, _, v in samples if n == name)

        # Serving graphs (vision, prefill, decode) are captured once, at start-up; a Train job
        # captures its own graphs (region train) when it starts, as it trains its own copy of the
        # weights: counted apart.
        s["captures"] = sum(v for n, l, v in samples
                            if n == "vlmgraph_graph_captures_total" and l.get("region") != "train")
        s["train_captures"] = sum(v for n, l, v in samples
                                  if n == "vlmgraph_graph_captures_total" and l.get("region") == "train")
        s["heap_in_use_bytes"] = sum(v for n, l, v in samples
                                     if n == "vlmgraph_process_heap_bytes" and l.get("state") == "in_use")
        s["heap_free_bytes"] = sum(v for n, l, v in samples
                                   if n == "vlmgraph_process_heap_bytes" and l.get("state") == "free")
        s["queue_depth"] = total("vlmgraph_queue_depth")
        s["active_sequences"] = total("vlmgraph_active_sequences")
        s["generated_tokens"] = total("vlmgraph_generated_tokens_total")
        s["train_steps"] = total("vlmgraph_train_steps_total")
        s["requests"] = {f"{l.get('rpc')}/{l.get('code')}": v for n, l, v in samples
                         if n == "vlmgraph_requests_total" and v}
        s["http_requests"] = {f"{l.get('endpoint')} {l.get('status')}": v for n, l, v in samples
                              if n == "vlmgraph_http_requests_total" and v}
        with self.lock:
            window = [r for r in self.records if since <= r[0] < t]
        gen = [r[4] for r in window if r[1].startswith("generate") and r[2] == "ok"]
        s["window"] = [round(since, 1), round(t, 1)]
        s["generate_n"] = len(gen)
        s["generate_p50_s"] = percentile(gen, 0.5)
        s["generate_p99_s"] = percentile(gen, 0.99)
        s["outcomes_in_window"] = len(window)
        s["unexpected_in_window"] = sum(1 for r in window if r[2] == "unexpected")
        return s

    def run(self):
        args = self.args
        self.t0 = time.monotonic()
        series = [self.sample("start", 0.0)]
        workers = [threading.Thread(target=self.worker, args=(i,), daemon=True, name=f"soak-{i}")
                   for i in range(args.concurrency)]
        for w in workers:
            w.start()
        end = args.duration
        next_sample = args.sample_seconds
        while True:
            now = self.now()
            if now >= end:
                break
            time.sleep(min(1.0, end - now, max(0.0, next_sample - now)))
            # Watchdog: a call running well past its deadline is a hang.
            with self.lock:
                seen = {(x[0], x[1]) for x in self.stuck}
                for idx, (op, start) in list(self.busy.items()):
                    if time.monotonic() - start > args.deadline + 30 and (idx, start) not in seen:
                        self.stuck.append((idx, start, op, round(self.now(), 1)))
            if self.now() >= next_sample and self.now() < end:
                series.append(self.sample("load", series[-1]["window"][1] if len(series) > 1 else 0.0))
                print(f"[soak] t={series[-1]['t']:.0f}s rss={fmt(series[-1]['rss_kib'], 'd')} KiB "
                      f"outcomes={len(self.records)} unexpected={len(self.unexpected)} "
                      f"gen p50={fmt(series[-1]['generate_p50_s'])} p99={fmt(series[-1]['generate_p99_s'])}",
                      file=sys.stderr, flush=True)
                next_sample += args.sample_seconds
        self.stop.set()
        join_deadline = time.monotonic() + args.deadline + 30
        for w in workers:
            w.join(timeout=max(0.1, join_deadline - time.monotonic()))
        alive = [w.name for w in workers if w.is_alive()]
        with self.lock:
            for idx, (op, start) in self.busy.items():
                self.stuck.append((idx, start, op, round(self.now(), 1)))
        # Gauges back to 0.
        drained, gauge_wait = False, time.monotonic() + 30
        while time.monotonic() < gauge_wait:
            try:
                m = self.metrics()
            except (OSError, http.client.HTTPException):
                m = []
            q = sum(v for n, _, v in m if n == "vlmgraph_queue_depth")
            a = sum(v for n, _, v in m if n == "vlmgraph_active_sequences")
            if m and q == 0 and a == 0:
                drained = True
                break
            time.sleep(0.5)
        last = series[-1]["window"][1] if len(series) > 1 else 0.0
        series.append(self.sample("end", last))
        self.client.close()
        return series, drained, alive


# --- server process ----------------------------------------------------------------------------

def start_server(args, log_path):
    cmd = [args.server, "--grpc-address", "127.0.0.1:0", "--metrics-address", "127.0.0.1:0",
           "--http-address", "127.0.0.1:0", *args.server_arg]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    deadline = time.time() + args.start_timeout
    line = ""
    while time.time() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            m = READY_RE.match(line)
            if m:
                def drain():  # keep stdout from filling its pipe
                    for rest in proc.stdout:
                        log.write(rest)
                        log.flush()
                threading.Thread(target=drain, daemon=True).start()
                return proc, cmd, m.group(1), m.group(3), m.group(2)
        if proc.poll() is not None:
            break
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
    log.close()
    with open(log_path) as fh:
        sys.exit(f"soak: the server did not start (last stdout {line!r}); log {log_path}:\n{fh.read()[-4000:]}")


def server_log_problems(log_path, limit=40):
    """Warning and error lines of the server log (format: 'TIME L vlmgraph] ...', L = W or E)."""
    if not log_path or not os.path.isfile(log_path):
        return 0, 0, []
    warn = err = 0
    lines = []
    with open(log_path, errors="replace") as fh:
        for line in fh:
            m = re.match(r"^\S+ ([WEF]) ", line)
            if not m:
                continue
            if m.group(1) == "W":
                warn += 1
            else:
                err += 1
            if len(lines) < limit:
                lines.append(line.rstrip("\n"))
    return warn, err, lines


# --- verdict and report ------------------------------------------------------------------------

def evaluate(args, soak, series, drained, alive, exit_info, started):
    warm = args.warmup_seconds if args.warmup_seconds is not None else min(120.0, 0.2 * args.duration)
    post = [s for s in series if s["t"] >= warm and s["label"] != "start"]
    rss_post = [s["rss_kib"] for s in post if s["rss_kib"] is not None]
    checks = collections.OrderedDict()
    mem = {"warmup_seconds": warm, "samples_after_warmup": len(rss_post)}
    if soak.pid is None:
        checks["memory"] = ("SKIP", "no pid: RSS not sampled")
    elif len([s for s in post if s["label"] != "end" and s["rss_kib"] is not None]) < 3:
        checks["memory"] = ("FAIL", f"{len(rss_post)} RSS sample(s) after warm-up; need 3 under load (run longer)")
    else:
        loaded = [s["rss_kib"] for s in post if s["label"] != "end" and s["rss_kib"] is not None]
        third = max(1, len(loaded) // 3)
        first, last_third = statistics.median(loaded[:third]), statistics.median(loaded[-third:])
        drift = (last_third - first) / first
        peak, after = max(loaded), rss_post[-1]
        mem.update(first_third_median_kib=first, last_third_median_kib=last_third, drift=drift,
                   max_kib=peak, max_growth=(peak - first) / first, after_load_kib=after,
                   samples_per_third=third)
        heap = [s.get("heap_in_use_bytes") for s in post if s["label"] != "end" and s.get("heap_in_use_bytes")]
        heap_note = ""
        if len(heap) >= 3:  # glibc heap in use (vlmgraph_process_heap_bytes), same thirds
            h3 = max(1, len(heap) // 3)
            h0, h1 = statistics.median(heap[:h3]), statistics.median(heap[-h3:])
            mem.update(heap_in_use_first_third_median_bytes=h0, heap_in_use_last_third_median_bytes=h1)
            heap_note = f"; heap in use {h0 / 2**20:.1f} -> {h1 / 2**20:.1f} MiB ({100 * (h1 - h0) / h0:+.2f}%)"
        checks["memory"] = ("PASS" if drift <= MEMORY_LIMIT else "FAIL",
                            f"RSS median of the first third {first / 1024:.1f} MiB, of the last third "
                            f"{last_third / 1024:.1f} MiB (drift {100 * drift:+.2f}%, limit +{100 * MEMORY_LIMIT:.0f}%; "
                            f"{third} sample(s) a third); highest sample {peak / 1024:.1f} MiB "
                            f"({100 * (peak - first) / first:+.2f}%), after the load {after / 1024:.1f} MiB{heap_note}")
    if post:
        c0, c1 = post[0]["captures"], series[-1]["captures"]
        mem["captures_at_warmup"], mem["captures_at_end"] = c0, c1
        t0c, t1c = post[0].get("train_captures", 0), series[-1].get("train_captures", 0)
        checks["captures"] = ("PASS" if c1 == c0 else "FAIL",
                              f"{c1 - c0:.0f} serving graph captures after warm-up ({c0:.0f} at warm-up, "
                              f"{c1:.0f} at the end); Train jobs captured {t1c - t0c:.0f} graphs of their own")
    else:
        checks["captures"] = ("FAIL", "no sample after warm-up")
    n_unexp = len(soak.unexpected)
    checks["outcomes"] = ("PASS" if n_unexp == 0 else "FAIL", f"{n_unexp} UNEXPECTED of {len(soak.records)} outcomes")
    hangs = [r for r in soak.unexpected if r[5].startswith("HANG")]
    problems = []
    if hangs:
        problems.append(f"{len(hangs)} request(s) passed their deadline")
    if soak.stuck or alive:
        problems.append(f"stuck workers: {soak.stuck or alive}")
    if not drained:
        problems.append("queue depth / active sequences not back to 0 within 30 s")
    counts = {}
    if started:
        final = series[-1]["requests"]
        for rpc in ("Generate", "Forward", "Train"):
            server = sum(v for k, v in final.items() if k.startswith(rpc + "/"))
            lo, hi = soak.issued[rpc], soak.issued[rpc] + soak.uncertain[rpc]
            counts[rpc] = {"server": server, "client_certain": lo, "client_uncertain": soak.uncertain[rpc]}
            if not lo <= server <= hi:
                problems.append(f"{rpc}: server counted {server:.0f} finished RPCs, client sent {lo} (+{hi - lo} maybe)")
    checks["answered"] = ("FAIL" if problems else "PASS",
                          "; ".join(problems) or "no hang, gauges back to 0"
                          + (", server counts match the client's" if started else ""))
    if started:
        rc, secs = exit_info
        checks["exit"] = ("PASS" if rc == 0 else "FAIL",
                          f"exit status {rc} {secs:.1f} s after SIGTERM (limit {args.shutdown_timeout:.0f} s)")
    else:
        checks["exit"] = ("SKIP", "attached to a running server: not stopped")
    verdict = "PASS" if all(v[0] != "FAIL" for v in checks.values()) else "FAIL"
    return verdict, checks, mem, counts


def markdown(args, soak, series, verdict, checks, mem, counts, log_info, meta):
    out = []
    w = out.append
    w(f"# vlmgraph soak: {verdict}\n")
    w(f"- command: `{meta['command']}`")
    w(f"- started: {meta['date']}; host: {meta['host']}; model: {soak.info.model} ({soak.info.dtype} on "
      f"{soak.info.device}), tokenizer: {'yes' if soak.has_tokenizer else 'no'}")
    if args.ops:
        w(f"- operations: {args.ops}")
    w(f"- duration {args.duration:.0f} s, concurrency {args.concurrency}, deadline {args.deadline:.0f} s, "
      f"sample every {args.sample_seconds:.0f} s, warm-up {mem['warmup_seconds']:.0f} s")
    w(f"- outcomes: {len(soak.records)} ({sum(1 for r in soak.records if r[2] == 'ok')} OK, "
      f"{sum(1 for r in soak.records if r[2] == 'expected_error')} expected errors, {len(soak.unexpected)} UNEXPECTED)\n")
    w("| check | result | detail |\n|---|---|---|")
    for name, (res, detail) in checks.items():
        w(f"| {name} | {res} | {detail} |")
    w("\n## Series\n")
    w("| t (s) | RSS (MiB) | vs first-third median | heap in use (MiB) | threads | fds | GPU (MiB) | captures | "
      "queue | active | requests | load 1m | Generate n | p50 (s) | p99 (s) |")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    base = mem.get("first_third_median_kib")
    for s in series:
        rss = s["rss_kib"]
        rel = f"{100 * (rss - base) / base:+.2f}%" if rss is not None and base and s["t"] >= mem["warmup_seconds"] \
            and s["label"] != "start" else ""
        heap = s.get("heap_in_use_bytes")
        w(f"| {s['t']:.0f}{' (end)' if s['label'] == 'end' else ''} | {fmt(rss / 1024 if rss else None, '.1f')} | "
          f"{rel} | {fmt(heap / 2**20 if heap else None, '.1f')} | {fmt(s['threads'], 'd')} | {fmt(s['fds'], 'd')} | {fmt(s['gpu_mib'], 'd')} | "
          f"{s['captures']:.0f} | {s['queue_depth']:.0f} | {s['active_sequences']:.0f} | "
          f"{sum(s['requests'].values()):.0f} | {fmt(s.get('loadavg_1m'), '.2f')} | {s['generate_n']} | "
          f"{fmt(s['generate_p50_s'])} | {fmt(s['generate_p99_s'])} |")
    w("\n## Outcomes (client side)\n")
    w("| operation | outcome | code | count | p50 (s) | p99 (s) |\n|---|---|---|---|---|---|")
    groups = collections.defaultdict(list)
    for r in soak.records:
        groups[(r[1], r[2], r[3])].append(r[4])
    for (op, kind, code), lat in sorted(groups.items()):
        w(f"| {op} | {kind} | {code} | {len(lat)} | {fmt(percentile(lat, 0.5))} | {fmt(percentile(lat, 0.99))} |")
    by_code = collections.Counter((r[2], r[3]) for r in soak.records)
    w("\nBy code: " + ", ".join(f"{code} {n} ({kind})" for (kind, code), n in sorted(by_code.items())))
    final = series[-1]
    w("\n## Server counters at the end\n")
    w("| rpc / code | vlmgraph_requests_total |\n|---|---|")
    for k, v in sorted(final["requests"].items()):
        w(f"| {k} | {v:.0f} |")
    if counts:
        w("\nServer vs client RPC counts: " + ", ".join(
            f"{rpc} {c['server']:.0f} (client {c['client_certain']} + {c['client_uncertain']} maybe)"
            for rpc, c in counts.items()))
    w("\n| endpoint status | vlmgraph_http_requests_total |\n|---|---|")
    for k, v in sorted(final["http_requests"].items()):
        w(f"| {k} | {v:.0f} |")
    w(f"\nServing graph captures: {final['captures']:.0f} in all; {mem.get('captures_at_end', 0) - mem.get('captures_at_warmup', 0):.0f} "
      f"after warm-up. Train jobs' own graph captures: {final.get('train_captures', 0):.0f}. Generated tokens {final['generated_tokens']:.0f}, train steps {final['train_steps']:.0f}.")
    if soak.unexpected:
        w("\n## UNEXPECTED outcomes (first 30)\n")
        for r in soak.unexpected[:30]:
            w(f"- t={r[0]:.1f}s {r[1]} -> {r[3]} after {r[4]:.3f} s: {r[5].splitlines()[0] if r[5] else ''}")
    warn, err, lines = log_info
    w(f"\n## Server log\n\n{meta.get('server_log') or '(attached: not read)'}: {warn} warning(s), {err} error(s)")
    if lines:
        w("\n```\n" + "\n".join(lines[:20]) + "\n```")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", default=os.path.join(ROOT, "build", "server", "vlmgraph-server"))
    ap.add_argument("--server-arg", action="append", default=[], help="extra server flag (repeat)")
    ap.add_argument("--server-log", help="server stderr goes here (default: a file in /tmp)")
    ap.add_argument("--grpc", help="attach: gRPC host:port of a running server")
    ap.add_argument("--http", help="attach: OpenAI HTTP host:port ('' or unset: no HTTP load)")
    ap.add_argument("--metrics", help="attach: metrics host:port")
    ap.add_argument("--pid", type=int, help="attach: server pid (for RSS)")
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of load (default 1800)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sample-seconds", type=float, default=30.0)
    ap.add_argument("--warmup-seconds", type=float, help="default: min(120, 20%% of --duration)")
    ap.add_argument("--deadline", type=float, default=60.0, help="per-request deadline, seconds")
    ap.add_argument("--shutdown-timeout", type=float, default=45.0, help="seconds from SIGTERM to exit")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ops", help="only these operations, comma-separated (default: the whole mix): gen_ids, "
                    "gen_long, gen_image_small, gen_image_chelsea, forward, train, train_bad, bad, cancel, vanish, "
                    "http_misc, http_text, http_attack, http_vanish (tokenizer), grpc_text")
    ap.add_argument("--json", help="write the report as JSON here")
    ap.add_argument("--verbose", action="store_true", help="print each UNEXPECTED outcome as it happens")
    args = ap.parse_args()

    started = args.grpc is None
    proc = None
    log_path = None
    command = " ".join([os.path.basename(sys.executable), *sys.argv])
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if started:
        if not os.path.isfile(args.server):
            sys.exit(f"soak: {args.server} not found (build it: scripts/test.sh)")
        log_path = args.server_log or tempfile.mktemp(prefix="soak-server-", suffix=".log")
        proc, server_cmd, grpc_addr, http_addr, metrics_addr = start_server(args, log_path)
        pid = proc.pid
        print(f"[soak] started {' '.join(server_cmd)} (pid {pid}); log {log_path}", file=sys.stderr, flush=True)
    else:
        if not args.metrics:
            sys.exit("soak: --metrics is needed with --grpc")
        grpc_addr, http_addr, metrics_addr, pid = args.grpc, args.http or None, args.metrics, args.pid
    try:
        soak = Soak(args, grpc_addr, http_addr, metrics_addr, pid)
    except Exception:
        if proc:
            proc.kill()
        raise
    print(f"[soak] model {soak.info.model}, tokenizer {'yes' if soak.has_tokenizer else 'no'}, "
          f"{args.duration:.0f} s x {args.concurrency} workers", file=sys.stderr, flush=True)
    series, drained, alive = soak.run()
    exit_info = None
    if started:
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=args.shutdown_timeout)
        except subprocess.TimeoutExpired:
            rc = "none (killed)"
            proc.kill()
            proc.wait(timeout=30)
        exit_info = (rc, time.monotonic() - t)
    verdict, checks, mem, counts = evaluate(args, soak, series, drained, alive, exit_info, started)
    log_info = server_log_problems(log_path)
    meta = {"command": command, "date": started_at,
            "host": f"{socket.gethostname()}, {os.cpu_count()} CPUs", "server_log": log_path}
    print(markdown(args, soak, series, verdict, checks, mem, counts, log_info, meta))
    if args.json:
        ops = collections.defaultdict(lambda: collections.Counter())
        for r in soak.records:
            ops[r[1]][f"{r[2]}:{r[3]}"] += 1
        report = {"verdict": verdict, "checks": {k: {"result": v[0], "detail": v[1]} for k, v in checks.items()},
                  "meta": meta, "args": vars(args), "memory": mem, "rpc_counts": counts,
                  "model_info": {"model": soak.info.model, "device": soak.info.device, "dtype": soak.info.dtype,
                                 "tokenizer": soak.info.tokenizer, "vocab_size": soak.info.vocab_size},
                  "series": series, "outcomes_by_operation": {k: dict(v) for k, v in sorted(ops.items())},
                  "outcomes_by_code": {f"{k}:{c}": n for (k, c), n in
                                       collections.Counter((r[2], r[3]) for r in soak.records).items()},
                  "outcomes_total": len(soak.records),
                  "unexpected": [dict(zip(("t", "op", "kind", "code", "latency_s", "detail"), r))
                                 for r in soak.unexpected[:500]],
                  "stuck_workers": soak.stuck, "exit": exit_info,
                  "server_log_warnings": log_info[0], "server_log_errors": log_info[1],
                  "server_log_lines": log_info[2]}
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    sys.exit(0 if verdict == "PASS" else 1)


if __name__ == "__main__":
    main()
