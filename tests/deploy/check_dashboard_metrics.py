#!/usr/bin/env python3
"""Checks the Grafana dashboard against the metrics the server exports.

Every `vlmgraph_*` name that a panel or template variable queries must exist, either in a scrape of
a running server (Prometheus text format, from a file, `-` for stdin, or an http:// URL) or in the
fixed list of docs/metrics.md. Also checked: the JSON parses; panel ids are unique and panels fit the
24-column grid; every target has a PromQL expression; every `$variable` is defined; panels use the
provisioned Prometheus data source; rate()/increase() are applied to counters (or histogram series)
only; histogram_quantile() is given `_bucket` series. With --promtool, every expression is parsed by
`promtool check rules` (Grafana's $variables replaced by sample values).

  check_dashboard_metrics.py DASHBOARD.json http://127.0.0.1:9464/metrics   # live scrape
  check_dashboard_metrics.py DASHBOARD.json scrape.txt
  check_dashboard_metrics.py DASHBOARD.json --metrics-doc docs/metrics.md \\
      --datasources deploy/grafana/provisioning/datasources/prometheus.yml --promtool promtool

A histogram `F` is exported as `F_bucket`, `F_sum` and `F_count`; a dashboard may query any of them.
prometheus-cpp leaves out a labelled family until its first observation, so scrape a server that has
served at least one request of each kind the dashboard shows. A family that cannot appear on the
server scraped (graph captures and replays on a CPU server) may be named with --allow-missing; it
is then reported but not counted as a problem. Exit status 0 when every check passes.

  check_dashboard_metrics.py DASHBOARD.json scrape.txt \
      --allow-missing vlmgraph_graph_captures_total,vlmgraph_graph_replays_total
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request

METRIC_RE = re.compile(r"\b(vlmgraph_[A-Za-z0-9_:]+)")
VAR_RE = re.compile(r"\$(?:\{([A-Za-z0-9_]+)(?::[a-z]+)?\}|([A-Za-z0-9_]+))")
RATE_RE = re.compile(r"\b(rate|irate|increase)\s*\(\s*(vlmgraph_[A-Za-z0-9_:]+)")
QUANTILE_RE = re.compile(r"histogram_quantile\s*\(\s*[0-9.]+\s*,\s*(?:sum|max|min)?\s*"
                         r"(?:by\s*\([^)]*\)\s*)?\(\s*(?:rate|irate|increase)\s*\(\s*"
                         r"(vlmgraph_[A-Za-z0-9_:]+)")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Grafana's built-in variables, with a value that makes the expression valid PromQL.
BUILTIN_VARS = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h", "__range_s": "3600",
                "__interval_ms": "15000", "__range_ms": "3600000"}


class Exported:
    """Metric families and sample names of one source: {family: type} plus concrete series names."""

    def __init__(self, types, samples, source):
        self.types = types      # family name -> counter | gauge | histogram | summary | untyped
        self.samples = samples  # names seen on sample lines (F_bucket, F_sum, ... for histograms)
        self.source = source

    def family_of(self, name):
        if name in self.types:
            return name
        for suffix in HISTOGRAM_SUFFIXES:
            base = name[: -len(suffix)]
            if name.endswith(suffix) and self.types.get(base) in ("histogram", "summary"):
                return base
        return None

    def has(self, name):
        return name in self.samples or self.family_of(name) is not None

    def series_type(self, name):
        """counter, gauge, histogram-series (F_bucket/_sum/_count) or None when unknown."""
        fam = self.family_of(name)
        if fam is None:
            return None
        if fam != name:
            return "histogram-series"
        return self.types[fam]


def parse_scrape(text, source):
    types, samples = {}, set()
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 4 and parts[1] == "TYPE":
                types[parts[2]] = parts[3].strip()
            elif len(parts) >= 3 and parts[1] == "HELP":
                types.setdefault(parts[2], "untyped")
            continue
        m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)", line)
        if m:
            samples.add(m.group(1))
    # A family with only HELP but samples under suffixes is a histogram or summary in practice.
    return Exported(types, samples, source)


def read_scrape(where):
    if where == "-":
        return sys.stdin.read()
    if where.startswith(("http://", "https://")):
        with urllib.request.urlopen(where, timeout=10) as r:
            return r.read().decode("utf-8")
    with open(where, encoding="utf-8") as f:
        return f.read()


def parse_metrics_doc(path):
    """Rows of the docs/metrics.md table: | `name` | type | labels | meaning |."""
    types = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            m = re.match(r"\|\s*`(vlmgraph_[A-Za-z0-9_:]+)`\s*\|\s*([a-z]+)\s*\|", line)
            if m:
                types[m.group(1)] = m.group(2)
    if not types:
        raise SystemExit(f"{path}: no metric table rows found")
    samples = set()
    for name, kind in types.items():
        samples.update([name + s for s in HISTOGRAM_SUFFIXES] if kind == "histogram" else [name])
    return Exported(types, samples, path)


def provisioned_uids(path):
    import yaml  # PyYAML, installed by scripts/install-deps.sh
    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    return {d["uid"]: d.get("type") for d in doc.get("datasources", []) if "uid" in d}


def walk_panels(panels):
    for p in panels:
        yield p
        yield from walk_panels(p.get("panels", []))


class Checker:
    def __init__(self):
        self.errors = []
        self.allowed = []   # queried names absent from the scrape but named in --allow-missing
        self.bad_uids = {}  # data source uid -> queries using it, when it is not provisioned

    def error(self, msg):
        self.errors.append(msg)

    def run(self, dash, exported, uids, promtool, allow_missing=()):
        variables = {v.get("name"): v for v in dash.get("templating", {}).get("list", [])}
        panels = list(walk_panels(dash.get("panels", [])))
        if not dash.get("uid") or not dash.get("title"):
            self.error("dashboard has no uid or title")
        if not [p for p in panels if p.get("type") != "row"]:
            self.error("dashboard has no panels")

        exprs = []  # (where, expr)
        seen_ids = {}
        for p in panels:
            where = f"panel {p.get('id')} '{p.get('title', '')}'"
            if p.get("id") in seen_ids:
                self.error(f"{where}: id also used by '{seen_ids[p['id']]}'")
            seen_ids[p.get("id")] = p.get("title", "")
            g = p.get("gridPos", {})
            if not all(k in g for k in ("x", "y", "w", "h")) or g["x"] + g["w"] > 24:
                self.error(f"{where}: gridPos missing or wider than 24 columns: {g}")
            if p.get("type") == "row":
                continue
            targets = p.get("targets", [])
            if not targets:
                self.error(f"{where}: no query targets")
            refs = [t.get("refId") for t in targets]
            if len(set(refs)) != len(refs):
                self.error(f"{where}: duplicate refId in {refs}")
            for t in targets:
                if not t.get("expr", "").strip():
                    self.error(f"{where} target {t.get('refId')}: empty expr")
                    continue
                exprs.append((f"{where} target {t.get('refId')}", t["expr"]))
                self.check_datasource(where, t.get("datasource") or p.get("datasource"), variables,
                                      uids)
        for name, v in variables.items():
            if v.get("type") == "query":
                q = v.get("query")
                q = q.get("query", "") if isinstance(q, dict) else (q or "")
                exprs.append((f"variable ${name}", q))
                self.check_datasource(f"variable ${name}", v.get("datasource"), variables, uids)

        self.report_datasources(uids)
        used = {}
        for where, expr in exprs:
            for m in VAR_RE.finditer(expr):
                var = m.group(1) or m.group(2)
                if var not in variables and var not in BUILTIN_VARS:
                    self.error(f"{where}: ${var} is not a dashboard variable: {expr}")
            for name in METRIC_RE.findall(expr):
                used.setdefault(name, where)
            for fn, name in RATE_RE.findall(expr):
                kind = exported.series_type(name)
                if kind not in (None, "counter", "histogram-series"):
                    self.error(f"{where}: {fn}() over {name}, which is a {kind}, not a counter")
            for name in QUANTILE_RE.findall(expr):
                if not name.endswith("_bucket"):
                    self.error(f"{where}: histogram_quantile() over {name}; use {name}_bucket")

        missing = sorted(n for n in used if not exported.has(n))
        self.allowed = []
        for n in missing:
            if any(n == a or n in (a + s for s in HISTOGRAM_SUFFIXES) for a in allow_missing):
                self.allowed.append(n)
            else:
                self.error(f"{used[n]}: {n} is not exported ({exported.source}); a labelled family "
                           "appears after its first observation")
        if promtool:
            self.check_promql(exprs, promtool)
        return used

    def check_datasource(self, where, ds, variables, uids):
        uid = (ds or {}).get("uid", "") if isinstance(ds, dict) else (ds or "")
        m = VAR_RE.fullmatch(uid or "")
        if m:
            var = variables.get(m.group(1) or m.group(2))
            if not var or var.get("type") != "datasource" or var.get("query") != "prometheus":
                self.error(f"{where}: data source {uid} is not a Prometheus data source variable")
                return
            uid = var.get("current", {}).get("value", "")
        if uids is not None and uids.get(uid) != "prometheus":
            self.bad_uids.setdefault(uid, []).append(where)

    def report_datasources(self, uids):
        for uid, wheres in self.bad_uids.items():
            self.error(f"{len(wheres)} queries (first: {wheres[0]}) use data source uid '{uid}', which "
                       f"is not a provisioned Prometheus data source ({sorted(uids)})")

    def check_promql(self, exprs, promtool):
        def fill(expr):
            return VAR_RE.sub(lambda m: BUILTIN_VARS.get(m.group(1) or m.group(2), ".*"), expr)

        rules = {"groups": [{"name": "dashboard", "rules": [
            {"record": f"dashboard:expr_{i}", "expr": fill(e)} for i, (_, e) in enumerate(exprs)
            if not e.startswith("label_values(")]}]}
        with tempfile.NamedTemporaryFile("w", suffix=".rules.json", delete=False) as f:
            json.dump(rules, f)  # JSON is YAML
        try:
            r = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True)
        finally:
            os.unlink(f.name)
        if r.returncode != 0:
            self.error("promtool check rules rejected a dashboard expression:\n"
                       + (r.stdout + r.stderr).strip())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dashboard", help="Grafana dashboard JSON")
    ap.add_argument("scrape", nargs="?", help="Prometheus text: file, '-' or http:// URL")
    ap.add_argument("--metrics-doc", help="check against docs/metrics.md instead of a scrape")
    ap.add_argument("--datasources", help="Grafana data source provisioning YAML")
    ap.add_argument("--promtool", help="promtool binary: parse every expression")
    ap.add_argument("--allow-missing", default="",
                    help="comma-separated families that may be absent from the scrape")
    args = ap.parse_intermixed_args()
    if bool(args.scrape) == bool(args.metrics_doc):
        ap.error("give exactly one of SCRAPE or --metrics-doc")

    with open(args.dashboard, encoding="utf-8") as f:
        try:
            dash = json.load(f)
        except json.JSONDecodeError as e:
            print(f"{args.dashboard}: not valid JSON: {e}")
            return 1
    exported = (parse_metrics_doc(args.metrics_doc) if args.metrics_doc
                else parse_scrape(read_scrape(args.scrape), args.scrape))
    uids = provisioned_uids(args.datasources) if args.datasources else None
    checker = Checker()
    allow = [a.strip() for a in args.allow_missing.split(",") if a.strip()]
    used = checker.run(dash, exported, uids, args.promtool, allow)
    for e in checker.errors:
        print(f"FAIL {args.dashboard}: {e}")
    families = sorted({exported.family_of(n) or n for n in used})
    unused = sorted(set(exported.types) - set(families))
    print(f"check_dashboard_metrics: {len(used)} metric names ({len(families)} families) queried; "
          f"{len(checker.errors)} problems; checked against {exported.source}")
    if checker.allowed:
        print(f"  absent but allowed (--allow-missing): {', '.join(checker.allowed)}")
    if unused:
        print(f"  exported but not on the dashboard: {', '.join(unused)}")
    return 1 if checker.errors else 0


if __name__ == "__main__":
    sys.exit(main())
