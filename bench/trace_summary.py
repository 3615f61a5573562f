#!/usr/bin/env python3
"""Summarises a Chrome trace written by a benchmark's --profile-trace: device kernels grouped by
name, total and mean microseconds, share of the device-busy time; then the device-busy time and the
wall span of the kernels. Usage: trace_summary.py trace.json [--top 40] [--steps N]
(--steps divides the totals, so the figures are per step)."""
import argparse
import collections
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--steps", type=int, default=1)
    a = ap.parse_args()
    with open(a.trace) as fh:
        events = json.load(fh)["traceEvents"]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    total = collections.defaultdict(float)
    count = collections.Counter()
    for e in kernels:
        total[e["name"]] += e["dur"]
        count[e["name"]] += 1
    busy = sum(total.values())
    if not kernels:
        print("no device kernels in the trace")
        return
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    print(f"kernels {len(kernels) / a.steps:.0f}/step, device busy {busy / a.steps / 1e3:.3f} ms/step, "
          f"span {span / a.steps / 1e3:.3f} ms/step")
    print(f"{'us/step':>10} {'share':>6} {'n/step':>7} {'mean us':>8}  kernel")
    for name, t in sorted(total.items(), key=lambda kv: -kv[1])[: a.top]:
        print(f"{t / a.steps:10.1f} {100 * t / busy:5.1f}% {count[name] / a.steps:7.1f} "
              f"{t / count[name]:8.2f}  {name[:150]}")


if __name__ == "__main__":
    main()
