#!/usr/bin/env python3
"""Device time of a decode step by region, from a Chrome trace of replayed decode graphs written by
`vlmgraph-bench --profile-trace PATH` (PATH.graph.b<N>.json: 10 decode steps at batch N).

A replayed graph carries no host op per kernel, so regions come from kernel names (this build's
kernels and the libraries' families), in this order:
  attention          the decode attention kernel (model/cuda/decode_attention.cu: RoPE, the KV
                     write and attention over each row's real length), or any kernel named
                     *attention* / flash / fmha / sdpa
  lm_head            a GEMM launched at most `--lm-head-max` times per step (the head's projection
                     onto the vocabulary runs once per step; the blocks' GEMMs once per layer)
  gemm               the other GEMMs (cuBLAS nvjet / sm90 / CUTLASS / gemm kernels; at small
                     batch the model's GemvKernel, which fuses the RMSNorm before and the SiLU x
                     up after its product, model/cuda/)
  norms_activations  RMSNorm, SiLU x up, rotary, layer norms, element-wise kernels
  sampling           argmax, the Gumbel-max draw, nucleus prefixes, sorts and top-k
  copies             memcpy kernels (cuBLAS's memcpy32_post for a GEMM whose C is not its D),
                     gathers, the embedding's index_select and host<->device copies
  other              anything else
Per step: microseconds of kernel time per region and its share of the device-busy time, the
busy time and the span (first kernel start to last kernel end, over --steps). Usage:

    decode_regions.py trace.graph.b256.json [--steps 10] [--json]"""
import argparse
import collections
import json

import chrome_trace  # bench/chrome_trace.py, beside this script

REGIONS = ["attention", "gemm", "lm_head", "norms_activations", "sampling", "copies", "other"]


def is_gemm(name):
    n = name.lower()
    return any(k in n for k in ("nvjet", "gemm", "gemv", "sm90_xmma", "cutlass", "cublas"))


def region_of(name, launches_per_step, lm_head_max):
    n = name.lower()
    if "attention" in n or "flash" in n or "fmha" in n or "sdpa" in n:
        return "attention"
    if any(k in n for k in ("memcpy", "gather", "copy", "indexselect")):
        return "copies"
    if is_gemm(name):
        return "lm_head" if launches_per_step <= lm_head_max else "gemm"
    if any(k in n for k in ("argmax", "gumbel", "nucleus", "radix", "sort", "topk")):
        return "sampling"
    if any(k in n for k in ("norm", "silu", "rotary", "rope", "elementwise", "where", "gelu",
                            "softmax", "add", "mul")):
        return "norms_activations"
    return "other"


def regions(events, steps, lm_head_max=1.5):
    """{region: us per step}, busy us per step, span us per step, kernels per step."""
    work = [e for e in events if e.get("ph") == "X" and e.get("cat") in (
        "kernel", "gpu_memcpy", "gpu_memset")]
    if not work:
        raise SystemExit("no kernels in the trace")
    count = collections.Counter(e["name"] for e in work)
    out = collections.OrderedDict((r, 0.0) for r in REGIONS)
    for e in work:
        out[region_of(e["name"], count[e["name"]] / steps, lm_head_max)] += e["dur"] / steps
    busy = sum(out.values())
    span = (max(e["ts"] + e["dur"] for e in work) - min(e["ts"] for e in work)) / steps
    return out, busy, span, len(work) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lm-head-max", type=float, default=1.5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    events = chrome_trace.load_events(a.trace)
    per, busy, span, kernels = regions(events, a.steps, a.lm_head_max)
    if a.json:
        print(json.dumps({"regions_us": per, "busy_us": busy, "span_us": span,
                          "kernels_per_step": kernels}))
        return
    print(f"{'region':18s} {'us/step':>9s} {'share':>6s}")
    for r, us in per.items():
        print(f"{r:18s} {us:9.1f} {100 * us / busy if busy else 0:5.1f}%")
    print(f"{'busy':18s} {busy:9.1f}   span {span:.1f} us/step, {kernels:.0f} kernels/step")


if __name__ == "__main__":
    main()
