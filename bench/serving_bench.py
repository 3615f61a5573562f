#!/usr/bin/env python3
"""Serving benchmark: a bounded closed-loop load against a running vlmgraph-server, over the
OpenAI-compatible HTTP API (the official `openai` SDK, streaming) and over gRPC (streaming
Generate with chat messages), at several concurrencies.

    python3 bench/serving_bench.py --http 127.0.0.1:8000 --grpc 127.0.0.1:50051 \\
        --model smollm2-135m-instruct --concurrency 1 8 64 --requests 64 --max-tokens 128 \\
        --json serving.json

Method: for each API and concurrency C, C workers each send chat requests back to back (a fixed
set of questions, greedy, `max_tokens` output tokens with the end-of-turn stop ignored, as vLLM's
`ignore_eos`), until `--requests` requests (at least 2 x C) have finished; the first C requests
of every level are a warm-up and are not counted. Per request: time to first token (request sent
-> first streamed token), inter-token latency (gaps between streamed tokens after the first; a
chunk of k tokens counts as k gaps of its gap / k). Output tokens/s = output tokens of the counted
requests / wall time from the first counted request's start to the last one's end. p50 / p99 are
over all counted requests (TTFT) or all gaps (ITL). Every request and wait is bounded by
`--timeout`.
"""
import argparse
import asyncio
import json
import os
import statistics
import sys
import time

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain what a CUDA graph is to a new engineer.",
    "List three uses of a hash map.",
    "Why is the sky blue?",
    "Summarise the plot of Hamlet in two sentences.",
    "What is the difference between a process and a thread?",
    "Give me a recipe for pancakes.",
]


def percentile(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, int(round(q / 100 * (len(values) - 1)))))
    return values[k]


class Stats:
    def __init__(self):
        self.ttft, self.itl, self.tokens, self.starts, self.ends, self.errors = [], [], 0, [], [], 0

    def add(self, start, stamps):
        """`stamps`: (time, tokens) per streamed chunk."""
        if not stamps:
            self.errors += 1
            return
        self.ttft.append(stamps[0][0] - start)
        for (t0, _), (t1, k) in zip(stamps, stamps[1:]):
            self.itl.extend([(t1 - t0) / k] * k)
        self.tokens += sum(k for _, k in stamps)
        self.starts.append(start)
        self.ends.append(stamps[-1][0])

    def summary(self):
        wall = max(self.ends) - min(self.starts) if self.ends else float("nan")
        ms = lambda v: round(v * 1e3, 3)  # noqa: E731
        return {"requests": len(self.ttft), "errors": self.errors, "output_tokens": self.tokens,
                "output_tokens_per_second": round(self.tokens / wall, 1) if wall else None,
                "ttft_ms_p50": ms(percentile(self.ttft, 50)), "ttft_ms_p99": ms(percentile(self.ttft, 99)),
                "itl_ms_p50": ms(percentile(self.itl, 50)), "itl_ms_p99": ms(percentile(self.itl, 99)),
                "itl_ms_mean": ms(statistics.fmean(self.itl)) if self.itl else None}


async def http_request(client, args, question):
    stamps = []
    start = time.perf_counter()
    stream = await client.chat.completions.create(
        model=args.model, messages=[{"role": "user", "content": question}], max_tokens=args.max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        timeout=args.timeout)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append((time.perf_counter(), 1))
        if chunk.usage is not None and stamps:
            # Chunks can merge tokens; spread the total over the chunks' count.
            extra = chunk.usage.completion_tokens - len(stamps)
            if extra > 0:
                stamps[-1] = (stamps[-1][0], stamps[-1][1] + extra)
    return start, stamps


def grpc_setup(address):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients", "python"))
    import grpc
    from vlmgraph_client import protos
    from vlmgraph_client.client import chat_messages
    pb = protos.load()
    channel = grpc.aio.insecure_channel(address)
    return pb, pb.service_pb2_grpc.VlmGraphStub(channel), chat_messages, channel


async def grpc_request(ctx, args, question):
    pb, stub, chat_messages, _ = ctx
    g = pb.generate_pb2
    req = g.GenerateRequest(messages=chat_messages([{"role": "user", "content": question}]),
                            sampling=g.SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True))
    stamps = []
    start = time.perf_counter()
    async for msg in stub.Generate(req, timeout=args.timeout):
        if msg.HasField("tokens") and msg.tokens.token_ids:
            stamps.append((time.perf_counter(), len(msg.tokens.token_ids)))
    return start, stamps


async def run_level(send, concurrency, total):
    stats, warm, issued = Stats(), concurrency, 0
    lock = asyncio.Lock()

    async def worker(w):
        nonlocal issued
        while True:
            async with lock:
                if issued >= total + warm:
                    return
                n = issued
                issued += 1
            try:
                start, stamps = await send(QUESTIONS[n % len(QUESTIONS)])
            except Exception as e:  # counted, reported; the level goes on
                print(f"request {n} failed: {e!r}", file=sys.stderr)
                stamps, start = [], 0
            if n >= warm:
                stats.add(start, stamps)

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return stats.summary()


async def main_async(args):
    report = {"model": args.model, "max_tokens": args.max_tokens, "levels": {}}
    apis = []
    if args.http:
        from openai import AsyncOpenAI
        client = AsyncOpenAI(base_url=f"http://{args.http}/v1", api_key=args.api_key or "none",
                             max_retries=0, timeout=args.timeout)
        apis.append(("http", lambda q: http_request(client, args, q)))
    if args.grpc:
        ctx = grpc_setup(args.grpc)
        apis.append(("grpc", lambda q: grpc_request(ctx, args, q)))
    for c in args.concurrency:
        for name, send in apis:
            r = await run_level(send, c, max(args.requests, 2 * c))
            report["levels"][f"{name}_c{c}"] = r
            print(f"{name:4s} c={c:3d}: {r['output_tokens_per_second']} tok/s, TTFT p50 {r['ttft_ms_p50']} / "
                  f"p99 {r['ttft_ms_p99']} ms, ITL p50 {r['itl_ms_p50']} / p99 {r['itl_ms_p99']} ms, "
                  f"{r['requests']} requests, {r['errors']} errors", flush=True)
    return report


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--http", default="", help="HOST:PORT of the OpenAI-compatible API ('' = skip)")
    p.add_argument("--grpc", default="", help="HOST:PORT of the gRPC API ('' = skip)")
    p.add_argument("--model", required=True, help="served_model_name")
    p.add_argument("--api-key", default=os.environ.get("VLMGRAPH_API_KEY", ""))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--requests", type=int, default=64, help="counted requests per level (>= 2 x C)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--json", default="")
    args = p.parse_args()
    report = asyncio.run(main_async(args))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    errors = sum(r["errors"] for r in report["levels"].values())
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
