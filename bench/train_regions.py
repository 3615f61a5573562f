#!/usr/bin/env python3
"""Device time of an eager training step by region, from a Chrome trace written by
`vlmgraph-train-bench --mode eager --profile-trace PATH` (PATH.eager.json; graph replays carry no
host op per kernel, so the split needs the eager step: its kernels are the graph's, only the
launch gaps differ).

Regions are the profiler ranges the model and the trainer open (model/vision_language_model.h):
vlmgraph::vision_encoder, ::projector, ::embed, ::decoder (the blocks and the final norm),
::lm_head_loss and ::optimizer. A forward kernel belongs to the innermost range around the host op
that launched it; a backward kernel to the region of its autograd node, found by the node's
sequence number: the region of the forward op with the largest sequence number not above it
(forward ops number up as they run, region after region, so a custom function's node, whose own
forward op records no number, still lands in its region). Kernels of neither kind (the gradient
all-reduce's hooks, the step's report) are "other". Usage:

    train_regions.py trace.eager.json [--steps 3] [--json]

Per step: milliseconds of kernel time per region, forward and backward apart, their share of the
device-busy time, and the busy time and span."""
import argparse
import bisect
import collections
import json

import chrome_trace  # bench/chrome_trace.py, beside this script


PREFIX = "vlmgraph::"


def launches_of(events):
    """Correlation id -> (thread, time) of the runtime or driver call that launched the kernel
    (cuBLASLt's kernels go through the driver's cuLaunchKernelEx)."""
    out = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            c = e.get("args", {}).get("correlation")
            if c is not None:
                out[c] = (e["tid"], e["ts"])
    return out


def ranges_of(events):
    """Thread -> the vlmgraph:: profiler ranges opened on it, (start, end, region), by start."""
    ranges = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e["name"].startswith(PREFIX):
            ranges[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"][len(PREFIX):]))
    for lst in ranges.values():
        lst.sort()
    return ranges


def regions_of(events, ranges):
    """The forward ops' sequence numbers, sorted, and the region of each."""
    seqs = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "cpu_op":
            continue
        seq = e.get("args", {}).get("Sequence number")
        if seq is None or e["name"].startswith("autograd::engine::evaluate_function"):
            continue
        region = innermost(ranges.get(e["tid"], []), e["ts"], e["ts"] + e["dur"])
        if region is not None:
            seqs.append((seq, region))
    seqs.sort()
    return [s for s, _ in seqs], [r for _, r in seqs]


def innermost(ranges, start, end):
    """The shortest range containing [start, end], or None."""
    best = None
    for s, e, name in ranges:
        if s > start:
            break
        if e >= end and (best is None or e - s < best[1] - best[0]):
            best = (s, e, name)
    return best[2] if best else None


def split(events, steps):
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        raise SystemExit("no device kernels in the trace")
    ranges = ranges_of(events)
    seq_keys, seq_regions = regions_of(events, ranges)
    if not seq_keys:
        raise SystemExit("no vlmgraph:: profiler ranges in the trace: an eager step's trace is needed "
                         "(vlmgraph-train-bench --mode eager --profile-trace PATH)")
    launches = launches_of(events)
    backward = backward_sequences(events, launches)
    by_region = collections.defaultdict(float)
    for k in kernels:
        launch = launches.get(k.get("args", {}).get("correlation"))
        region = innermost(ranges.get(launch[0], []), launch[1], launch[1]) if launch else None
        if region is not None:
            by_region[region + " forward" if region != "optimizer" else region] += k["dur"]
            continue
        seq = backward.get(k.get("args", {}).get("correlation"))
        if seq is not None:
            i = bisect.bisect_right(seq_keys, seq) - 1
            if i >= 0:
                by_region[seq_regions[i] + " backward"] += k["dur"]
                continue
        by_region["other"] += k["dur"]
    busy = sum(by_region.values())
    span = max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)
    return {
        "steps": steps,
        "device_busy_ms": busy / 1e3 / steps,
        "span_ms": span / 1e3 / steps,
        "regions_ms": {r: t / 1e3 / steps for r, t in sorted(by_region.items(), key=lambda kv: -kv[1])},
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    events = chrome_trace.load_events(a.trace)
    out = split(events, a.steps)
    if a.json:
        print(json.dumps(out))
        return
    print(f"device busy {out['device_busy_ms']:.2f} ms/step, span {out['span_ms']:.2f} ms/step")
    for r, ms in out["regions_ms"].items():
        print(f"{ms:9.2f} ms  {100 * ms / out['device_busy_ms']:5.1f}%  {r}")


def backward_sequences(events, launches):
    """Correlation id -> the sequence number of the autograd node (evaluate_function) inside which
    the host launched that kernel."""
    nodes = collections.defaultdict(list)  # tid -> [(start, end, seq)]
    for e in events:
        if (e.get("ph") == "X" and e.get("cat") == "cpu_op"
                and e["name"].startswith("autograd::engine::evaluate_function")
                and e.get("args", {}).get("Sequence number") is not None):
            nodes[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["args"]["Sequence number"]))
    starts = {}
    for tid, lst in nodes.items():
        lst.sort()
        starts[tid] = [s for s, _, _ in lst]
    out = {}
    for c, (tid, ts) in launches.items():
        if tid not in nodes:
            continue
        lst = nodes[tid]
        i = bisect.bisect_right(starts[tid], ts) - 1  # the last node begun before the launch
        if i >= 0 and ts <= lst[i][1]:
            out[c] = lst[i][2]
    return out


if __name__ == "__main__":
    main()
