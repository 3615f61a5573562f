#!/usr/bin/env python3
"""CI check of vlmgraph-diagnose: runs it (built-in tiny model on CPU, --quick) and checks that the
JSON report has every section with sane values, and that --skip-* flags drop their section.

    check_diagnose.py PATH/TO/vlmgraph-diagnose WORK_DIR
"""
import json
import os
import subprocess
import sys


def run(binary, work, name, *flags):
    path = os.path.join(work, name + ".json")
    proc = subprocess.run([binary, "--quick", "--json", path, *flags], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        sys.exit(f"vlmgraph-diagnose {' '.join(flags)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    with open(path) as fh:
        return json.load(fh), proc.stdout


def check(cond, what):
    if not cond:
        sys.exit(f"FAILED: {what}")
    print(f"ok   {what}")


def main():
    binary, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    r, table = run(binary, work, "full")
    for section in ("environment", "baseline", "sweeps", "capture", "dispatch", "bucket_advice"):
        check(section in r, f"section {section} present")
        check(f"== {section.replace('bucket_advice', 'bucket advice')}" in table or section == "environment",
              f"section {section} printed as a table")
    env = r["environment"]
    check(env["device"] == "cpu" and env["graphs_available"] is False, "CPU run marks graphs unavailable")
    rows = r["baseline"]["rows"]
    regions = {row["region"] for row in rows}
    check({"vision", "prefill", "decode", "train"} <= regions, f"baseline covers every region ({sorted(regions)})")
    check(all(row["eager_ms"] > 0 for row in rows), "every eager median is positive")
    check(all(row["graph_ms"] is None and row["speedup"] is None for row in rows), "graph columns are null on CPU")
    s = r["sweeps"]
    check(len(s["vary_batch"]) >= 2 and len(s["vary_sequence"]) >= 2, "sweeps ran several shapes")
    check(s["captures_after_warmup"] == 0, "zero captures after warm-up")
    check(s["unexpected_eager_fallbacks"] == 0, "no eager fallback for a shape that has a bucket")
    check(all(row["padding_waste"] >= 1.0 for row in s["vary_batch"] + s["vary_sequence"]), "padding waste >= 1")
    check(any(row["between_buckets"] for row in s["vary_sequence"]), "the sequence sweep visits lengths between buckets")
    a = r["bucket_advice"]
    check(a["suggested"]["padding_waste"] <= a["current"]["padding_waste"] + 1e-9, "suggested buckets waste no more")
    check(len(a["suggested"]["seq_lens"]) >= 1 and a["requests"] > 0, "advice computed from a shape sample")
    check(r["capture"]["available"] is False and r["dispatch"]["available"] is False, "capture and dispatch are n/a on CPU")

    lengths = os.path.join(work, "shapes.txt")
    with open(lengths, "w") as fh:
        fh.write("\n".join(str(n) for n in [5, 7, 9, 30, 31, 60, 61, 62]) + "\n")
    r2, _ = run(binary, work, "skipped", "--skip-baseline", "--skip-sweeps", "--shape-log", lengths)
    check("baseline" not in r2 and "sweeps" not in r2, "--skip-baseline and --skip-sweeps drop their sections")
    check(r2["bucket_advice"]["requests"] == 8 and "shape log" in r2["bucket_advice"]["source"], "--shape-log is used")
    print("check_diagnose: passed")


if __name__ == "__main__":
    main()
