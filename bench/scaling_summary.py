#!/usr/bin/env python3
"""The scaling table of `scripts/gpu-check.sh BUILD OUT dpscale` (scripts/gpu/multi_gpu.sh): data-
parallel training and serving from 1 to N GPUs of one host, each figure against the 1-GPU figure
of the same machine start.

    python3 bench/scaling_summary.py OUT_DIR

Reads from OUT_DIR:
  scale_train_w1a.json, scale_train_w1b.json  vlmgraph-train-bench --json, 1 GPU before and after
                                              the other worlds (their mean is the baseline)
  scale_train_wW.json                         the same bench under torchrun at W GPUs
  scale_overlap_wN.json                       bench/allreduce_overlap.py --steady --json (last line)
  scale_upstream.log                          ../shared/peers/upstream_ddp_scaling.py's last RESULT
  scale_wW_http.json                          ../shared/tools/http_load.py's last line
  scale_wW_grpc_I.json                        vlmgraph-grpc-load's JSON line, one file per loader
  scale_wW_threads.json                       bench/thread_cpu.py --json during the gRPC load
  scale_wN_fixed_*                            the same loads with the fronts' threads fixed at 2
Training scaling = tokens/s per GPU at W over the 1-GPU baseline; serving scaling = output
tokens/s at W over 1 GPU's. Prints one table and writes OUT_DIR/scale_summary.json. Exit status:
1 when a serving load had errors, 2 when no 1-GPU figure exists; the targets (issue: >= 94% / 92%
training at 4 / 8 GPUs, >= 2x upstream per GPU, gRPC >= 3.8x / 7.5x, TTFT p99 <= 1.5x one GPU's)
are printed beside the figures, not enforced.
"""
import glob
import json
import os
import re
import sys

TRAIN_TARGET = {4: 0.94, 8: 0.92}
SERVE_TARGET = {4: 3.8, 8: 7.5}


def last_json_line(path):
    """The last line of `path` that parses as a JSON object, or None."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("RESULT "):
            line = line[len("RESULT "):]
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def train_row(out, name):
    try:
        with open(os.path.join(out, name + ".json")) as f:
            return json.load(f)["graph"]
    except (OSError, ValueError, KeyError):
        return None


def grpc_rows(out, name):
    rows = []
    for f in sorted(glob.glob(os.path.join(out, name + "_grpc_*.json"))):
        r = last_json_line(f)
        if r is not None:
            rows.append(r)
    if not rows:
        return None
    return {"tok_per_s": sum(r["tok_per_s"] for r in rows), "errors": sum(r["errors"] for r in rows),
            "requests": sum(r["requests"] for r in rows),
            "ttft_p99_ms": max(r["ttft_p99_ms"] for r in rows), "loaders": len(rows)}


def worlds(out):
    ws = set()
    for f in os.listdir(out):
        m = re.match(r"scale_(?:train_)?w(\d+)[ab]?[_.]", f)
        if m:
            ws.add(int(m.group(1)))
    return sorted(ws)


def summarize(out):
    """The summary dict of OUT_DIR's files (see the module's docstring)."""
    s = {"training": [], "serving": [], "fixed_threads": None, "overlap": None, "upstream": None}
    base = [r for r in (train_row(out, "scale_train_w1a"), train_row(out, "scale_train_w1b")) if r]
    up = last_json_line(os.path.join(out, "scale_upstream.log"))
    s["upstream"] = up
    if base:
        base_tps = sum(r["tokens_per_second_per_gpu"] for r in base) / len(base)
        s["training_baseline"] = {"step_ms": [r["median_step_ms"] for r in base],
                                  "tokens_per_second_per_gpu": base_tps}
        for w in worlds(out):
            r = base[0] if w == 1 else train_row(out, f"scale_train_w{w}")
            if r is None:
                continue
            tps = base_tps if w == 1 else r["tokens_per_second_per_gpu"]
            row = {"gpus": w, "step_ms": r["median_step_ms"] if w > 1 else [b["median_step_ms"] for b in base],
                   "spread": r["step_ms_spread"], "tokens_per_second_per_gpu": tps,
                   "scaling": tps / base_tps}
            if up and f"tok_per_s_per_gpu_w{w}" in up:
                row["upstream_tokens_per_second_per_gpu"] = up[f"tok_per_s_per_gpu_w{w}"]
                row["upstream_step_ms"] = up.get(f"step_ms_w{w}")
                row["vs_upstream"] = tps / up[f"tok_per_s_per_gpu_w{w}"]
            s["training"].append(row)
    for f in glob.glob(os.path.join(out, "scale_overlap_w*.json")):
        s["overlap"] = last_json_line(f)
    one = None
    for w in worlds(out):
        g = grpc_rows(out, f"scale_w{w}")
        h = last_json_line(os.path.join(out, f"scale_w{w}_http.json"))
        t = last_json_line(os.path.join(out, f"scale_w{w}_threads.json"))
        if g is None and h is None:
            continue
        row = {"gpus": w, "grpc": g, "http": h, "threads": t}
        if w == 1:
            one = row
        s["serving"].append(row)
    for row in s["serving"]:
        for api in ("grpc", "http"):
            if one and row[api] and one[api]:
                row[api]["scaling"] = row[api]["tok_per_s"] / one[api]["tok_per_s"]
                row[api]["ttft_p99_vs_1gpu"] = row[api]["ttft_p99_ms"] / one[api]["ttft_p99_ms"]
    fixed = glob.glob(os.path.join(out, "scale_w*_fixed_http.json")) + \
        glob.glob(os.path.join(out, "scale_w*_fixed_grpc_*.json"))
    if fixed:
        w = int(re.search(r"scale_w(\d+)_fixed", fixed[0]).group(1))
        g = grpc_rows(out, f"scale_w{w}_fixed")
        h = last_json_line(os.path.join(out, f"scale_w{w}_fixed_http.json"))
        for api, r in (("grpc", g), ("http", h)):
            if r and one and one[api]:
                r["scaling"] = r["tok_per_s"] / one[api]["tok_per_s"]
        s["fixed_threads"] = {"gpus": w, "grpc": g, "http": h,
                              "threads": last_json_line(os.path.join(out, f"scale_w{w}_fixed_threads.json"))}
    return s


def fmt_threads(t):
    if not t:
        return ""
    return "%.1f cores, %d threads > 90%%" % (t["total_cores"], t["threads_above_90_percent"])


def render(s):
    lines = []
    if s["training"]:
        lines.append("Training, nanovlm-460m bf16 graphed, 8 x 1024 per GPU (1-GPU step %s ms, first and last):"
                     % " / ".join("%.2f" % x for x in s["training_baseline"]["step_ms"]))
        lines.append("| GPUs | step | spread | tokens/s per GPU | against 1 GPU | upstream DDP eager, per GPU | vlmgraph / upstream |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in s["training"]:
            step = r["step_ms"] if r["gpus"] > 1 else r["step_ms"][0]
            target = TRAIN_TARGET.get(r["gpus"])
            lines.append("| %d | %.2f ms | %.1f%% | %.0f | %s | %s | %s |" % (
                r["gpus"], step, 100 * r["spread"], r["tokens_per_second_per_gpu"],
                "" if r["gpus"] == 1 else "%.1f%%%s" % (100 * r["scaling"], " (target %.0f%%)" % (100 * target) if target else ""),
                "%.0f (%.2f ms)" % (r["upstream_tokens_per_second_per_gpu"], r["upstream_step_ms"]) if "vs_upstream" in r else "",
                "%.2fx" % r["vs_upstream"] if "vs_upstream" in r else ""))
    if s["overlap"]:
        o = s["overlap"]
        lines.append("Trace of the largest world (steady state): span %.2f ms, compute busy %.1f%%, all-reduce "
                     "busy %.2f ms of which %.2f ms exposed" % (o["step_span_ms"], 100 * o["compute_busy_fraction"],
                                                               o["all_reduce_busy_ms"], o["all_reduce_exposed_ms"]))
    if s["serving"]:
        lines.append("Serving, SmolLM2-135M shape bf16, 256 streams per GPU, 128 output tokens:")
        lines.append("| GPUs | gRPC tokens/s | against 1 GPU | gRPC TTFT p99 | HTTP tokens/s | against 1 GPU | HTTP TTFT p99 | errors | server CPU during gRPC |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        rows = list(s["serving"])
        if s["fixed_threads"]:
            rows.append(dict(s["fixed_threads"], label="%d, fronts' threads fixed at 2" % s["fixed_threads"]["gpus"]))
        for r in rows:
            g, h = r["grpc"] or {}, r["http"] or {}
            target = SERVE_TARGET.get(r["gpus"])
            lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                r.get("label", r["gpus"]),
                "%.0f" % g["tok_per_s"] if g else "",
                "%.2fx%s" % (g["scaling"], " (target %.1fx)" % target if target and "label" not in r else "") if "scaling" in g and r["gpus"] > 1 else "",
                "%.1f ms" % g["ttft_p99_ms"] if g else "",
                "%.0f" % h["tok_per_s"] if h else "",
                "%.2fx" % h["scaling"] if "scaling" in h and r["gpus"] > 1 else "",
                "%.1f ms" % h["ttft_p99_ms"] if h else "",
                "%d / %d" % (g.get("errors", 0), h.get("errors", 0)),
                fmt_threads(r.get("threads"))))
    return "\n".join(lines)


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__.split("\n\n")[1])
    out = sys.argv[1]
    s = summarize(out)
    with open(os.path.join(out, "scale_summary.json"), "w") as f:
        json.dump(s, f, indent=1)
    print(render(s))
    if not s["training"] and not s["serving"]:
        return 2
    errors = [r for r in s["serving"] + ([s["fixed_threads"]] if s["fixed_threads"] else [])
              for api in ("grpc", "http") if r[api] and r[api].get("errors")]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
