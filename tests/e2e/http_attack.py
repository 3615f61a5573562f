#!/usr/bin/env python3
"""Attacks on the HTTP front of a running vlmgraph-server, measured from the outside: slowloris
(slow heads and slow bodies), many concurrent SSE streams, huge bodies with and without a key.
Every attack stays on loopback (127.0.0.0/8: the slow clients spread over 127.0.0.2-127.0.0.9 so
the per-client connection limit does not hide the result), is bounded in connections and seconds,
and stops by itself. Figures go to stdout as JSON (docs/security.md quotes them).

    python3 tests/e2e/http_attack.py --url http://127.0.0.1:8000 --key KEY --pid PID \
        --model smollm2-135m-instruct --all

Needs the server's PID (for its RSS and thread count from /proc). tests/e2e/test_attack.py runs
the same functions at CI sizes against a server it starts.
"""
import argparse
import asyncio
import json
import socket
import statistics
import sys
import threading
import time
import urllib.parse

SOURCES = [f"127.0.0.{i}" for i in range(2, 10)]


def proc_status(pid):
    """(RSS in MiB, threads) of a process, from /proc/PID/status."""
    rss, threads = 0.0, 0
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return rss, threads


def host_port(url):
    u = urllib.parse.urlparse(url)
    return u.hostname, u.port or 80


def request_bytes(method, path, body=b"", key=None, content_type="application/json", extra=""):
    head = f"{method} {path} HTTP/1.1\r\nHost: attack\r\n"
    if key:
        head += f"Authorization: Bearer {key}\r\n"
    if body or method == "POST":
        head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
    return (head + extra + "\r\n").encode() + body


def timed_request(url, data, timeout=30):
    """Sends raw bytes, reads the whole response (Connection: close or Content-Length);
    returns (status, seconds, body)."""
    host, port = host_port(url)
    t0 = time.monotonic()
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(data)
        got = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
            head_end = got.find(b"\r\n\r\n")
            if head_end >= 0:
                head = got[:head_end].decode("latin-1").lower()
                for line in head.split("\r\n"):
                    if line.startswith("content-length:"):
                        if len(got) - head_end - 4 >= int(line.split(":")[1]):
                            return int(got.split(b" ")[1]), time.monotonic() - t0, got[head_end + 4:]
    status = int(got.split(b" ")[1]) if got.startswith(b"HTTP/") else 0
    return status, time.monotonic() - t0, got


def health_probe(url, timeout=5):
    """Seconds for GET /health on a new connection (None on failure)."""
    try:
        status, seconds, _ = timed_request(url, request_bytes("GET", "/health"), timeout=timeout)
        return seconds if status == 200 else None
    except OSError:
        return None


def chat_seconds(url, key, model, max_tokens=8):
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    status, seconds, _ = timed_request(url, request_bytes("POST", "/v1/chat/completions", body, key),
                                       timeout=120)
    return seconds if status == 200 else None


def percentile(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))] if values else None


async def _slow_client(host, port, source, head, body_bytes, stop_at, counts):
    """One slow client: sends a request one byte per second, reconnecting whenever the server
    closes it, until stop_at."""
    while time.monotonic() < stop_at:
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        except OSError:
            counts["connect_failed"] += 1
            await asyncio.sleep(0.2)
            continue
        counts["opened"] += 1
        payload = head + b"x" * body_bytes
        try:
            for i in range(len(payload)):
                if time.monotonic() >= stop_at:
                    break
                writer.write(payload[i:i + 1])
                await writer.drain()
                try:
                    got = await asyncio.wait_for(reader.read(4096), timeout=1.0)
                    if not got:
                        counts["closed_by_server"] += 1
                        break
                    if got.startswith(b"HTTP/1.1 408"):
                        counts["got_408"] += 1
                    if got.startswith(b"HTTP/1.1 503"):
                        counts["got_503"] += 1
                except asyncio.TimeoutError:
                    pass
        except (ConnectionError, OSError):
            counts["closed_by_server"] += 1
        finally:
            writer.close()


def slowloris(url, key, model, pid, connections=2000, seconds=30, slow_body=False):
    """`connections` clients that each send one byte a second (of the head, or with slow_body of
    the body after a complete head) for `seconds`, while /health and a chat are timed."""
    host, port = host_port(url)
    if slow_body:
        head = request_bytes("POST", "/v1/chat/completions", key=key, extra="")
        head = head.replace(b"Content-Length: 0", b"Content-Length: 100000")
        body_bytes = 100000
    else:
        head, body_bytes = request_bytes("GET", "/health"), 0
    base_chat = [chat_seconds(url, key, model) for _ in range(3)] if model else []
    counts = {"opened": 0, "connect_failed": 0, "closed_by_server": 0, "got_408": 0, "got_503": 0}
    stop_at = time.monotonic() + seconds

    async def attack():
        tasks = [asyncio.create_task(_slow_client(host, port, SOURCES[i % len(SOURCES)], head,
                                                  body_bytes, stop_at, counts))
                 for i in range(connections)]
        await asyncio.gather(*tasks, return_exceptions=True)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=lambda: loop.run_until_complete(attack()), daemon=True)
    thread.start()
    time.sleep(min(3.0, seconds / 3))  # let the connections open
    probes, chats, peak_threads, peak_rss = [], [], 0, 0.0
    while time.monotonic() < stop_at - 0.5:
        probes.append(health_probe(url))
        if model and len(chats) < 5:
            chats.append(chat_seconds(url, key, model))
        if pid:
            rss, threads = proc_status(pid)
            peak_threads, peak_rss = max(peak_threads, threads), max(peak_rss, rss)
        time.sleep(0.2)
    thread.join(timeout=seconds + 30)
    ok = [p for p in probes if p is not None]
    return {
        "attack": "slow body" if slow_body else "slow head",
        "connections": connections, "seconds": seconds, **counts,
        "health_probes": len(probes), "health_failed": len(probes) - len(ok),
        "health_p50_ms": round(1000 * statistics.median(ok), 2) if ok else None,
        "health_max_ms": round(1000 * max(ok), 2) if ok else None,
        "chat_before_s": [round(c, 3) for c in base_chat if c],
        "chat_during_s": [round(c, 3) if c else None for c in chats],
        "server_threads_peak": peak_threads, "server_rss_peak_mib": round(peak_rss, 1),
    }


def big_body(url, key, pid, megabytes=200, with_key=False, path="/v1/chat/completions"):
    """A body of `megabytes` MB sent at full speed without (or with) a key: seconds to the answer
    and the server's RSS growth."""
    host, port = host_port(url)
    rss0, _ = proc_status(pid) if pid else (0.0, 0)
    size = megabytes * 1000 * 1000
    head = (f"POST {path} HTTP/1.1\r\nHost: attack\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n" + (f"Authorization: Bearer {key}\r\n" if with_key else "")
            + "\r\n").encode()
    peak = rss0
    t0 = time.monotonic()
    status, answer_s = 0, None
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(head)
        s.setblocking(False)
        chunk = b'{"messages": [{"role": "user", "content": "' + b"a" * (1 << 20)
        sent, got = 0, b""
        while sent < size:
            try:
                sent += s.send(chunk[: min(len(chunk), size - sent)])
            except BlockingIOError:
                time.sleep(0.001)
            except OSError:
                break
            try:
                data = s.recv(65536)
                if data:
                    got += data
                    if status == 0 and got.startswith(b"HTTP/1.1 "):
                        status, answer_s = int(got.split(b" ")[1]), time.monotonic() - t0
                        break
            except BlockingIOError:
                pass
            except OSError:
                break
            if pid and sent % (16 << 20) < len(chunk):
                peak = max(peak, proc_status(pid)[0])
        if status == 0:
            s.setblocking(True)
            s.settimeout(30)
            try:
                got += s.recv(65536)
                status, answer_s = int(got.split(b" ")[1]), time.monotonic() - t0
            except (OSError, IndexError, ValueError):
                pass
    time.sleep(0.5)
    rss1 = proc_status(pid)[0] if pid else 0.0
    return {"attack": f"{megabytes} MB body " + ("with" if with_key else "without") + " a key",
            "path": path, "status": status, "answer_seconds": round(answer_s, 3) if answer_s else None,
            "bytes_sent_before_answer": sent, "rss_growth_mib": round(max(peak, rss1) - rss0, 1)}


async def _sse_stream(host, port, source, body, key, hold_until, counts):
    reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
    writer.write(request_bytes("POST", "/v1/chat/completions", body, key))
    await writer.drain()
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=60)
        if not head.startswith(b"HTTP/1.1 200"):
            counts["refused"] += 1
            return
        counts["streaming"] += 1
        while time.monotonic() < hold_until:
            data = await asyncio.wait_for(reader.read(65536), timeout=max(0.1, hold_until - time.monotonic()))
            if not data:
                break
            if b"[DONE]" in data:
                counts["done"] += 1
                break
    except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


def sse_streams(url, key, model, pid, streams=2000, seconds=20, max_tokens=64):
    """`streams` concurrent streaming chats held open for `seconds`: how many got their 200, and
    the server's threads and RSS while they were held."""
    host, port = host_port(url)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Count to fifty."}],
                       "max_tokens": max_tokens, "stream": True, "ignore_eos": True}).encode()
    counts = {"streaming": 0, "refused": 0, "done": 0}
    _, threads0 = proc_status(pid) if pid else (0, 0)
    hold_until = time.monotonic() + seconds

    async def run():
        await asyncio.gather(*[_sse_stream(host, port, SOURCES[i % len(SOURCES)], body, key, hold_until,
                                           counts) for i in range(streams)], return_exceptions=True)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=lambda: loop.run_until_complete(run()), daemon=True)
    thread.start()
    peak_threads, peak_streaming, peak_rss, health = threads0, 0, 0.0, []
    while thread.is_alive() and time.monotonic() < hold_until + 5:
        if pid:
            rss, threads = proc_status(pid)
            peak_threads, peak_rss = max(peak_threads, threads), max(peak_rss, rss)
        peak_streaming = max(peak_streaming, counts["streaming"])
        health.append(health_probe(url))
        time.sleep(0.25)
    thread.join(timeout=seconds + 60)
    ok = [h for h in health if h is not None]
    return {"attack": "concurrent SSE streams", "streams": streams, "seconds": seconds, **counts,
            "server_threads_before": threads0, "server_threads_peak": peak_threads,
            "server_rss_peak_mib": round(peak_rss, 1),
            "health_max_ms": round(1000 * max(ok), 2) if ok else None,
            "health_failed": len(health) - len(ok)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--key", default=None)
    p.add_argument("--model", default=None, help="served model name (chat probes and streams)")
    p.add_argument("--pid", type=int, default=0, help="the server's PID (RSS, threads)")
    p.add_argument("--connections", type=int, default=2000)
    p.add_argument("--seconds", type=int, default=30)
    p.add_argument("--streams", type=int, default=2000)
    p.add_argument("--megabytes", type=int, default=200)
    p.add_argument("--all", action="store_true")
    p.add_argument("--slow-head", action="store_true")
    p.add_argument("--slow-body", action="store_true")
    p.add_argument("--big-body", action="store_true")
    p.add_argument("--sse", action="store_true")
    a = p.parse_args()
    results = []
    if a.all or a.slow_head:
        results.append(slowloris(a.url, a.key, a.model, a.pid, a.connections, a.seconds))
    if a.all or a.slow_body:
        results.append(slowloris(a.url, a.key, a.model, a.pid, a.connections, a.seconds, slow_body=True))
    if a.all or a.big_body:
        results.append(big_body(a.url, a.key, a.pid, a.megabytes, with_key=False))
        results.append(big_body(a.url, a.key, a.pid, a.megabytes, with_key=True))
    if (a.all or a.sse) and a.model:
        results.append(sse_streams(a.url, a.key, a.model, a.pid, a.streams, a.seconds))
    json.dump(results, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
