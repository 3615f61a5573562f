#!/usr/bin/env python3
"""Tests for check_dashboard_metrics.py: it passes the real dashboard and catches broken ones.

Each case writes a changed copy of deploy/grafana/dashboards/vlmgraph.json (or a scrape) to a
temporary folder and expects the checker's exit status. Needs promtool for the PromQL cases (given
as the first argument, or found on PATH; those cases are skipped without it).

  tests/deploy/test_check_dashboard_metrics.py [PROMTOOL]
"""
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CHECKER = os.path.join(HERE, "check_dashboard_metrics.py")
DASHBOARD = os.path.join(ROOT, "deploy/grafana/dashboards/vlmgraph.json")
DOC = os.path.join(ROOT, "docs/metrics.md")
DATASOURCES = os.path.join(ROOT, "deploy/grafana/provisioning/datasources/prometheus.yml")

# A scrape in prometheus-cpp's format with every family of docs/metrics.md, one series each.
SCRAPE_HEAD = """# HELP vlmgraph_step_latency_seconds Wall time of one region run
# TYPE vlmgraph_step_latency_seconds histogram
vlmgraph_step_latency_seconds_count{region="decode",bucket="b1xc512",mode="graph"} 3
vlmgraph_step_latency_seconds_sum{region="decode",bucket="b1xc512",mode="graph"} 0.01
vlmgraph_step_latency_seconds_bucket{region="decode",bucket="b1xc512",mode="graph",le="0.001"} 1
vlmgraph_step_latency_seconds_bucket{region="decode",bucket="b1xc512",mode="graph",le="+Inf"} 3
"""


def full_scrape():
    lines = [SCRAPE_HEAD]
    with open(DOC, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("| `vlmgraph_") or "step_latency" in line:
                continue
            name, kind = [c.strip().strip("`") for c in line.split("|")[1:3]]
            lines.append(f"# HELP {name} x\n# TYPE {name} {kind}\n")
            if kind == "histogram":
                lines.append(f'{name}_count 1\n{name}_sum 1\n{name}_bucket{{le="+Inf"}} 1\n')
            else:
                lines.append(f"{name} 1\n")
    return "".join(lines)


def targets(dash):
    for p in dash["panels"]:
        for t in p.get("targets", []):
            yield p, t


def first_target_with(dash, text):
    return next(t for _, t in targets(dash) if text in t["expr"])


def main():
    promtool = sys.argv[1] if len(sys.argv) > 1 else shutil.which("promtool")
    with open(DASHBOARD, encoding="utf-8") as f:
        base = json.load(f)
    tmp = tempfile.mkdtemp(prefix="dashcheck-")
    failures, ran = [], 0

    def case(name, want_rc, mutate=None, scrape=None, use_promtool=False, raw=None, extra=()):
        nonlocal ran
        if use_promtool and not promtool:
            print(f"skip {name}: no promtool")
            return
        dash = copy.deepcopy(base)
        if mutate:
            mutate(dash)
        path = os.path.join(tmp, "dash.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(raw if raw is not None else json.dumps(dash))
        cmd = [sys.executable, CHECKER, path, "--datasources", DATASOURCES]
        if scrape is None:
            cmd += ["--metrics-doc", DOC]
        else:
            spath = os.path.join(tmp, "scrape.txt")
            with open(spath, "w", encoding="utf-8") as f:
                f.write(scrape)
            cmd.append(spath)
        if use_promtool:
            cmd += ["--promtool", promtool]
        cmd += list(extra)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        ran += 1
        ok = r.returncode == want_rc
        print(f"{'ok  ' if ok else 'FAIL'} {name}: rc {r.returncode} (want {want_rc})")
        if not ok:
            failures.append(name)
        if not ok or os.environ.get("VERBOSE"):
            print("    " + (r.stdout + r.stderr).strip().replace("\n", "\n    "))

    def set_expr(text, new):
        def f(dash):
            first_target_with(dash, text)["expr"] = new
        return f

    def rename(old, new):
        def f(dash):
            t = first_target_with(dash, old)
            t["expr"] = t["expr"].replace(old, new)
        return f

    case("real dashboard vs docs/metrics.md", 0, use_promtool=bool(promtool))
    case("real dashboard vs a full scrape", 0, scrape=full_scrape())
    case("unknown metric name", 1, rename("vlmgraph_queue_time_seconds", "vlmgraph_queue_seconds"))
    case("metric missing from the scrape", 1,
         scrape=full_scrape().replace("vlmgraph_kv_cache_bytes", "vlmgraph_other_bytes"))
    case("histogram family absent from the scrape", 1,
         scrape=full_scrape().replace("step_latency", "other_latency"))
    no_graphs = "".join(ln + "\n" for ln in full_scrape().splitlines()
                        if "graph_captures" not in ln and "graph_replays" not in ln)
    case("CPU scrape without graph series", 1, scrape=no_graphs)
    case("CPU scrape, graph series allowed missing", 0, scrape=no_graphs,
         extra=["--allow-missing", "vlmgraph_graph_captures_total,vlmgraph_graph_replays_total"])
    case("rate() over a gauge", 1, set_expr("vlmgraph_queue_depth",
                                            "sum(rate(vlmgraph_queue_depth[$__rate_interval]))"))
    case("histogram_quantile() without _bucket", 1,
         set_expr("vlmgraph_inter_token_latency_seconds_bucket",
                  "histogram_quantile(0.5, sum by (le) (rate(vlmgraph_inter_token_latency_seconds"
                  "[$__rate_interval])))"))
    case("undefined dashboard variable", 1,
         set_expr("vlmgraph_queue_depth", 'sum(vlmgraph_queue_depth{instance=~"$instance"})'))
    case("PromQL syntax error", 1, set_expr("vlmgraph_queue_depth", "sum(vlmgraph_queue_depth"),
         use_promtool=True)
    case("duplicate panel id", 1, lambda d: d["panels"][2].update(id=d["panels"][1]["id"]))
    case("unprovisioned data source", 1,
         lambda d: d["templating"]["list"][0]["current"].update(value="some-other-uid"))
    case("not JSON", 1, raw="{ not json")
    shutil.rmtree(tmp)
    print(f"test_check_dashboard_metrics: {ran - len(failures)} of {ran} cases as expected")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
