#!/usr/bin/env python3
"""How much of the gradient all-reduce a data-parallel training step hides behind computation,
from a Chrome trace written by `vlmgraph-train-bench --profile-trace` on rank 0 (CUPTI reports the
kernels of replayed CUDA graphs one by one).

NCCL kernels (name containing "nccl") are the all-reduce; every other kernel is computation. Per
step it prints the all-reduce's busy time, the part of it during which a computation kernel ran
too (overlapped), the rest (exposed: nothing else ran), and the step's
span. Usage: allreduce_overlap.py trace.json [--steps 3] [--steady] [--json]

--steady: the steady state of submitted steps (`--submit on`, Trainer::Submit): the span runs from
the end of the first step's report copy (its one device-to-host memcpy) to the end of the last
one's, so the steps counted are those whose whole gap to the step before lies in the trace, and
the first step's input upload, which no step before it hides, is left out; --steps is then the
number of report copies less one."""
import argparse
import json

import chrome_trace  # bench/chrome_trace.py, beside this script


def union(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def length(intervals):
    return sum(e - s for s, e in intervals)


def intersect(a, b):
    i = j = 0
    out = []
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append([s, e])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steady", action="store_true")
    a = ap.parse_args()
    events = chrome_trace.load_events(a.trace)
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    if not kernels:
        raise SystemExit("no kernels in the trace")
    begin = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    if a.steady:
        reports = sorted(e["ts"] + e["dur"] for e in events
                         if e.get("ph") == "X" and e.get("cat") == "gpu_memcpy"
                         and "DtoH" in e.get("name", ""))
        if len(reports) < 2:
            raise SystemExit("--steady needs the report copies of 2 steps or more")
        begin, end, a.steps = reports[0], reports[-1], len(reports) - 1

    def clipped(keep):
        return union([[max(e["ts"], begin), min(e["ts"] + e["dur"], end)] for e in kernels
                      if keep(e["name"].lower()) and e["ts"] < end and e["ts"] + e["dur"] > begin])

    nccl = clipped(lambda n: "nccl" in n)
    compute = clipped(lambda n: "nccl" not in n)
    span = end - begin
    allreduce = length(nccl)
    hidden = length(intersect(nccl, compute))
    streams = sorted({(e.get("pid"), e.get("tid")) for e in kernels if "nccl" in e["name"].lower()})
    out = {
        "steps": a.steps,
        "step_span_ms": span / 1e3 / a.steps,
        "compute_busy_ms": length(compute) / 1e3 / a.steps,
        "compute_busy_fraction": length(compute) / span,
        "all_reduce_busy_ms": allreduce / 1e3 / a.steps,
        "all_reduce_overlapped_ms": hidden / 1e3 / a.steps,
        "all_reduce_exposed_ms": (allreduce - hidden) / 1e3 / a.steps,
        "overlapped_fraction": hidden / allreduce if allreduce else 0.0,
        "nccl_kernels": sum(1 for e in kernels if "nccl" in e["name"].lower()
                            and e["ts"] < end and e["ts"] + e["dur"] > begin) // max(a.steps, 1),
        "nccl_streams": len(streams),
    }
    if a.json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        print(f"{k:26s} {v:.3f}" if isinstance(v, float) else f"{k:26s} {v}")


if __name__ == "__main__":
    main()
