"""End to end: a real Prometheus server (Debian's `prometheus` package) scrapes the server's
/metrics endpoint, and its query API returns the vlmgraph metrics; the Grafana dashboard's
metrics are all present in a live scrape."""
import json
import os
import shutil
import subprocess
import sys
import time
import unittest
import urllib.parse
import urllib.request

from e2e_util import ROOT, Server, chelsea, free_port, require, scratch_dir
from vlmgraph_client import build_prompt, image_tiles


def query(base, expr):
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read().decode())
    assert body["status"] == "success", body
    return body["data"]["result"]


class PrometheusTest(unittest.TestCase):
    def setUp(self):
        self.prometheus = shutil.which("prometheus")
        require(self.prometheus, "the prometheus binary (Debian package prometheus)")
        self.image = chelsea()
        self.server = Server({}, name="prom").start()
        self.addCleanup(self.server.cleanup)
        self.dir = scratch_dir("prometheus")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def traffic(self):
        """One request of every kind, so every labelled family has a series."""
        with self.server.client() as c:
            info = c.model_info()
            ids = build_prompt(info, [image_tiles(self.image, info)], [1, 2, 3])
            c.generate_all(ids, [self.image], max_new_tokens=4)
            c.forward([1, 2, 3], target_ids=[2, 3, -100])
            cfg = c.train_config(language_learning_rate=1e-3)
            list(c.train(cfg, iter([c.train_batch([{"input_ids": [1, 2, 3], "target_ids": [2, 3, -100]}])])))
            try:
                c.generate_all([5000])
            except Exception:
                pass  # INVALID_ARGUMENT, counted by code

    def test_prometheus_scrapes_vlmgraph_metrics(self):
        self.traffic()
        config = os.path.join(self.dir, "prometheus.yml")
        with open(config, "w") as fh:
            fh.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                     "scrape_configs:\n  - job_name: vlmgraph\n    static_configs:\n"
                     f"      - targets: ['{self.server.metrics_address}']\n")
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log = open(os.path.join(self.dir, "prometheus.log"), "w")
        self.addCleanup(log.close)
        proc = subprocess.Popen([self.prometheus, f"--config.file={config}",
                                 f"--storage.tsdb.path={os.path.join(self.dir, 'data')}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=log)

        def stop():
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.addCleanup(stop)

        requests, deadline = [], time.time() + 90
        while time.time() < deadline and proc.poll() is None:
            try:
                requests = query(base, "vlmgraph_requests_total")
                if any(r["metric"].get("rpc") == "Train" and float(r["value"][1]) >= 1 for r in requests):
                    break
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        self.assertIsNone(proc.poll(), "prometheus exited; see its log")
        by_label = {(r["metric"]["rpc"], r["metric"]["code"]): float(r["value"][1]) for r in requests}
        self.assertGreaterEqual(by_label.get(("Generate", "OK"), 0), 1, requests)
        self.assertGreaterEqual(by_label.get(("Generate", "INVALID_ARGUMENT"), 0), 1, requests)
        self.assertGreaterEqual(by_label.get(("Forward", "OK"), 0), 1, requests)
        self.assertGreaterEqual(by_label.get(("Train", "OK"), 0), 1, requests)
        for r in requests:
            self.assertEqual(r["metric"]["job"], "vlmgraph")
        up = query(base, 'up{job="vlmgraph"}')
        self.assertEqual(float(up[0]["value"][1]), 1.0)
        latency = query(base, 'sum by (region) (vlmgraph_step_latency_seconds_count)')
        self.assertEqual({r["metric"]["region"] for r in latency}, {"vision", "prefill", "decode", "train"})
        tokens = query(base, 'vlmgraph_tokens_total{kind="padded"} >= on(region) vlmgraph_tokens_total{kind="real"}')
        self.assertGreaterEqual(len(tokens), 3)

    def test_dashboard_metrics_exist_in_a_live_scrape(self):
        checker = os.path.join(ROOT, "tests", "deploy", "check_dashboard_metrics.py")
        dashboard = os.path.join(ROOT, "deploy", "grafana", "dashboards", "vlmgraph.json")
        if not (os.path.isfile(checker) and os.path.isfile(dashboard)):
            self.skipTest("no dashboard checker in this checkout")
        self.traffic()
        out = subprocess.run([sys.executable, checker, dashboard, f"http://{self.server.metrics_address}/metrics"],
                             capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)


if __name__ == "__main__":
    unittest.main()
