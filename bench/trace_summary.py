#!/usr/bin/env python3
"""Summarises a Chrome trace written by a benchmark's --profile-trace: device kernels grouped by
name, total and mean microseconds, share of the device-busy time; then the device-busy time and the
wall span of the kernels. Usage: trace_summary.py trace.json [--top 40] [--steps N] [--by-op]
(--steps divides the totals, so the figures are per step). --by-op (eager traces: graph replays
have no host op per kernel) groups the kernels by the host ops that launched them instead: the
autograd node (forward op or `XBackward0`) and the innermost ATen op around the launch."""
import argparse
import bisect
import collections

import chrome_trace  # bench/chrome_trace.py, beside this script


def host_op_chains(events):
    """Maps a kernel's correlation id to the names of the host ops around its launch, outermost
    first."""
    ops = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            ops[e["tid"]].append(e)
    parents, starts = {}, {}
    for tid, lst in ops.items():
        lst.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack, par = [], []
        for i, e in enumerate(lst):
            while stack and lst[stack[-1]]["ts"] + lst[stack[-1]]["dur"] < e["ts"]:
                stack.pop()
            par.append(stack[-1] if stack else -1)
            stack.append(i)
        parents[tid] = par
        starts[tid] = [e["ts"] for e in lst]
    chains = {}
    for e in events:
        if e.get("cat") != "cuda_runtime" or "correlation" not in e.get("args", {}):
            continue
        tid, t = e["tid"], e["ts"]
        if tid not in ops:
            continue
        i = bisect.bisect_right(starts[tid], t) - 1
        chain = []
        while i >= 0:
            o = ops[tid][i]
            if o["ts"] <= t <= o["ts"] + o["dur"]:
                chain.append(o["name"])
            i = parents[tid][i]
        chains[e["args"]["correlation"]] = chain[::-1]
    return chains


def op_label(chain):
    if not chain:
        return "(no host op)"
    node = next((n for n in chain if n.startswith("autograd::engine::evaluate_function")), None)
    node = node.split(": ", 1)[-1] if node else chain[0]
    return f"{node} > {chain[-1]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--by-op", action="store_true")
    a = ap.parse_args()
    events = chrome_trace.load_events(a.trace)
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        print("no device kernels in the trace")
        return
    chains = host_op_chains(events) if a.by_op else {}
    total = collections.defaultdict(float)
    count = collections.Counter()
    for e in kernels:
        key = e["name"]
        if a.by_op:
            key = f"{op_label(chains.get(e.get('args', {}).get('correlation'), []))} :: {e['name'][:90]}"
        total[key] += e["dur"]
        count[key] += 1
    busy = sum(total.values())
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    print(f"kernels {len(kernels) / a.steps:.0f}/step, device busy {busy / a.steps / 1e3:.3f} ms/step, "
          f"span {span / a.steps / 1e3:.3f} ms/step")
    print(f"{'us/step':>10} {'share':>6} {'n/step':>7} {'mean us':>8}  {'host op :: ' if a.by_op else ''}kernel")
    for name, t in sorted(total.items(), key=lambda kv: -kv[1])[: a.top]:
        print(f"{t / a.steps:10.1f} {100 * t / busy:5.1f}% {count[name] / a.steps:7.1f} "
              f"{t / count[name]:8.2f}  {name[:220]}")


if __name__ == "__main__":
    main()
