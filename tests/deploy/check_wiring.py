#!/usr/bin/env python3
"""Checks that the deployment files agree with each other, so `docker compose up` works first time.

No Docker engine is needed; each check reads the files as Docker, Prometheus and Grafana would:
  - compose.yaml: services vlmgraph, prometheus, grafana; the server reserves an NVIDIA GPU; its
    --config path lies in the mounted deploy/ folder and the file exists;
  - every deploy/config*.yaml: server.grpc_address and server.metrics_address listen on all
    interfaces (a container's 127.0.0.1 is unreachable from the host and from Prometheus) at ports
    that compose publishes; the device is a GPU (compose reserves one; every GPU, count: all, when
    a config serves on every GPU with data_parallel_size 0); a model directory under
    /opt/vlmgraph/models/ is one the Dockerfile converts at build time (tools/convert_gguf.py);
    config-throughput.yaml uses only keys that config.yaml has;
  - deploy/prometheus.yml scrapes a compose service at the configs' metrics port;
  - Grafana's data source points at the prometheus service; the dashboard provider path, the home
    dashboard and the provisioning folder match compose's mounts;
  - Dockerfile: the build stage is CUDA 13.0 devel on Ubuntu 24.04 and runs scripts/install-deps.sh,
    the script .ci/run runs; the runtime stage runs as a non-root user with a HEALTHCHECK through
    the gRPC health probe at the configs' gRPC port; every repository path it names exists and is
    not excluded by .dockerignore.

  check_wiring.py [--root REPO]
"""
import argparse
import fnmatch
import os
import re
import sys

import yaml  # PyYAML, installed by scripts/install-deps.sh

INTERP_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def interpolate(value, env):
    """Compose's ${VAR:-default} with `env` (dict) over the defaults; other values unchanged."""
    if isinstance(value, str):
        return INTERP_RE.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def split_address(addr):
    """'0.0.0.0:50051' -> ('0.0.0.0', 50051); '[::]:50051' -> ('::', 50051)."""
    m = re.fullmatch(r"\[?([^\]]*)\]?:(\d+)", str(addr))
    return (m.group(1), int(m.group(2))) if m else (None, None)


class Wiring:
    def __init__(self, root):
        self.root = root
        self.errors = []

    def error(self, msg):
        self.errors.append(msg)

    def path(self, rel):
        return os.path.join(self.root, rel)

    def load_yaml(self, rel):
        try:
            with open(self.path(rel), encoding="utf-8") as f:
                return yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            self.error(f"{rel}: {e}")
            return {}

    # --- compose ------------------------------------------------------------------------------------
    def mounts(self, service):
        """[(host path relative to the root, container path)] of a service's bind mounts."""
        out = []
        for v in service.get("volumes", []):
            if isinstance(v, dict):
                src, dst = v.get("source", ""), v.get("target", "")
            else:
                parts = str(v).split(":")
                if len(parts) < 2:
                    continue
                src, dst = parts[0], parts[1]
            if src.startswith(("./", "../", "/")):
                out.append((os.path.normpath(src), dst.rstrip("/")))
        return out

    def host_path(self, service, container_path):
        """The repository path that a container path of `service` shows, or None."""
        best = None
        for src, dst in self.mounts(service):
            if container_path == dst or container_path.startswith(dst + "/"):
                if best is None or len(dst) > len(best[1]):
                    best = (src, dst)
        if best is None:
            return None
        return os.path.normpath(os.path.join(best[0], os.path.relpath(container_path, best[1])))

    @staticmethod
    def published(service):
        """{container port: host address} of a service's `ports`."""
        out = {}
        for p in service.get("ports", []):
            if isinstance(p, dict):
                out[int(p["target"])] = p.get("host_ip", "0.0.0.0")
                continue
            parts = str(p).split("/")[0].split(":")
            host_ip = parts[0] if len(parts) == 3 else "0.0.0.0"
            out[int(parts[-1])] = host_ip
        return out

    def check(self):
        compose = self.compose = self.load_yaml("compose.yaml")
        services = compose.get("services", {})
        for name in ("vlmgraph", "prometheus", "grafana"):
            if name not in services:
                self.error(f"compose.yaml: no service '{name}'")
        if self.errors:
            return
        server = services["vlmgraph"]
        devices = (server.get("deploy", {}).get("resources", {}).get("reservations", {})
                   .get("devices", []))
        if not any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])
                   for d in devices):
            self.error("compose.yaml: vlmgraph reserves no NVIDIA GPU "
                       "(deploy.resources.reservations.devices)")

        configs = sorted(f for f in os.listdir(self.path("deploy"))
                         if re.fullmatch(r"config[\w-]*\.yaml", f))
        if "config.yaml" not in configs:
            self.error("deploy/config.yaml does not exist")
        # The --config argument, for the default and for each config of deploy/.
        for env in [{}] + [{"VLMGRAPH_CONFIG": c} for c in configs]:
            cmd = interpolate(server.get("command", []), env)
            cmd = cmd.split() if isinstance(cmd, str) else cmd
            if "--config" not in cmd or cmd.index("--config") + 1 >= len(cmd):
                self.error("compose.yaml: vlmgraph's command has no --config PATH")
                break
            cpath = cmd[cmd.index("--config") + 1]
            host = self.host_path(server, cpath)
            if host is None or not os.path.isfile(self.path(host)):
                self.error(f"compose.yaml (env {env or 'default'}): --config {cpath} is not a file "
                           f"of a mounted repository folder (got {host})")

        grpc_ports, metrics_ports, http_ports = set(), set(), set()
        server_ports = self.published(server)
        for c in configs:
            cfg = self.load_yaml(f"deploy/{c}")
            srv = cfg.get("server", {}) or {}
            self.check_auth(c, cfg, server, services)
            addresses = [("grpc_address", grpc_ports), ("metrics_address", metrics_ports)]
            if srv.get("http_address"):
                addresses.append(("http_address", http_ports))
            for key, ports in addresses:
                host, port = split_address(srv.get(key, ""))
                if port is None:
                    self.error(f"deploy/{c}: server.{key} missing or not HOST:PORT")
                    continue
                ports.add(port)
                if host not in ("0.0.0.0", "::", "*"):
                    self.error(f"deploy/{c}: server.{key} = {srv.get(key)} listens on {host} only; "
                               f"inside a container use 0.0.0.0:{port}")
                if port not in server_ports:
                    self.error(f"deploy/{c}: server.{key} port {port} is not published by "
                               f"compose.yaml (vlmgraph ports: {sorted(server_ports)})")
            device = str(cfg.get("device", ""))
            if not device.startswith("cuda"):
                self.error(f"deploy/{c}: device is '{device}'; compose reserves a GPU, use cuda")
            if cfg.get("data_parallel_size") == 0 and not any(
                    str(d.get("count")) == "all" for d in devices if d.get("driver") == "nvidia"):
                self.error(f"deploy/{c}: data_parallel_size 0 serves on every GPU, but compose.yaml "
                           "reserves fewer (deploy.resources.reservations.devices count: all)")
            model = str(cfg.get("model", ""))
            if model.startswith("/opt/vlmgraph/models/"):
                dockerfile = open(self.path("Dockerfile")).read()
                if "tools/convert_gguf.py" not in dockerfile or not re.search(
                        re.escape("/stage" + model) + r"(?![\w/.-])", dockerfile):
                    self.error(f"deploy/{c}: model {model} is not converted into the image by the "
                               "Dockerfile (tools/convert_gguf.py ... /stage" + model + ")")
        if len(grpc_ports) > 1 or len(metrics_ports) > 1 or len(http_ports) > 1:
            self.error(f"deploy/config*.yaml disagree on ports: gRPC {sorted(grpc_ports)}, "
                       f"metrics {sorted(metrics_ports)}")
        self.check_same_keys(configs)
        self.check_prometheus(services, metrics_ports)
        self.check_grafana(services)
        self.check_dockerfile(grpc_ports, metrics_ports)

    def check_auth(self, c, cfg, server, services):
        """A config that listens on all interfaces names API keys (the server refuses to start
        otherwise), and a keys file under /run/secrets/ is a secret compose gives the server."""
        auth = cfg.get("auth", {}) or {}
        keys_file = auth.get("api_keys_file") or ""
        if not keys_file and not (cfg.get("server", {}) or {}).get("api_key") \
                and not auth.get("allow_unauthenticated"):
            self.error(f"deploy/{c}: listens on all interfaces without auth.api_keys_file; the "
                       f"server would refuse to start")
        if keys_file.startswith("/run/secrets/"):
            name = keys_file[len("/run/secrets/"):]
            given = [s if isinstance(s, str) else s.get("source") for s in server.get("secrets", [])]
            if name not in given:
                self.error(f"deploy/{c}: auth.api_keys_file {keys_file} but compose.yaml gives the "
                           f"vlmgraph service no secret '{name}'")
            if name not in (self.compose.get("secrets") or {}):
                self.error(f"compose.yaml: secret '{name}' is not declared under top-level secrets")

    def check_same_keys(self, configs):
        def keys(d, prefix=""):
            out = set()
            for k, v in (d or {}).items():
                out.add(prefix + str(k))
                if isinstance(v, dict):
                    out |= keys(v, f"{prefix}{k}.")
            return out

        if "config.yaml" not in configs:
            return
        base = keys(self.load_yaml("deploy/config.yaml"))
        for c in configs:
            extra = keys(self.load_yaml(f"deploy/{c}")) - base
            if extra:
                self.error(f"deploy/{c}: keys not in deploy/config.yaml (typo?): {sorted(extra)}")

    def check_prometheus(self, services, metrics_ports):
        prom = self.load_yaml("deploy/prometheus.yml")
        targets = [t for job in prom.get("scrape_configs", []) or []
                   for sc in job.get("static_configs", []) or [] for t in sc.get("targets", [])]
        if not targets:
            self.error("deploy/prometheus.yml: no static scrape targets")
        for t in targets:
            host, port = split_address(t)
            if host not in services:
                self.error(f"deploy/prometheus.yml: target {t}: '{host}' is not a compose service")
            elif metrics_ports and port not in metrics_ports:
                self.error(f"deploy/prometheus.yml: target {t}: the server's metrics port is "
                           f"{sorted(metrics_ports)}")
        mounted = self.host_path(services["prometheus"], "/etc/prometheus/prometheus.yml")
        if mounted != "deploy/prometheus.yml":
            self.error("compose.yaml: prometheus does not mount deploy/prometheus.yml at "
                       "/etc/prometheus/prometheus.yml")

    def check_grafana(self, services):
        grafana = services["grafana"]
        env = grafana.get("environment", {}) or {}
        if isinstance(env, list):
            env = dict(e.split("=", 1) for e in env)
        env = interpolate(env, {})
        prov = self.host_path(grafana, "/etc/grafana/provisioning")
        if prov != "deploy/grafana/provisioning":
            self.error(f"compose.yaml: grafana's /etc/grafana/provisioning is {prov}, not "
                       "deploy/grafana/provisioning")
            return
        ds = self.load_yaml("deploy/grafana/provisioning/datasources/prometheus.yml")
        for d in ds.get("datasources", []):
            m = re.fullmatch(r"https?://([^:/]+):(\d+)/?", d.get("url", ""))
            if not m or m.group(1) not in services or m.group(1) == "grafana":
                self.error(f"grafana data source {d.get('name')}: url {d.get('url')} is not a "
                           "compose service")
            elif int(m.group(2)) != 9090:
                self.error(f"grafana data source url {d.get('url')}: Prometheus listens on 9090")
        dp = self.load_yaml("deploy/grafana/provisioning/dashboards/dashboards.yml")
        for p in dp.get("providers", []):
            cpath = (p.get("options") or {}).get("path", "")
            host = self.host_path(grafana, cpath)
            if host is None or not os.path.isdir(self.path(host)):
                self.error(f"grafana dashboard provider path {cpath} is not a mounted folder")
            elif not [f for f in os.listdir(self.path(host)) if f.endswith(".json")]:
                self.error(f"grafana dashboard provider path {cpath} ({host}) has no .json")
        home = env.get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
        if home:
            host = self.host_path(grafana, home)
            if host is None or not os.path.isfile(self.path(host)):
                self.error(f"compose.yaml: GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH {home} is not "
                           "a mounted file")

    def check_dockerfile(self, grpc_ports, metrics_ports):
        try:
            with open(self.path("Dockerfile"), encoding="utf-8") as f:
                text = f.read()
            with open(self.path(".ci/run"), encoding="utf-8") as f:
                ci = f.read()
        except OSError as e:
            self.error(str(e))
            return
        logical = re.sub(r"\\\n", " ", text)  # join continuation lines
        lines = [ln.strip() for ln in logical.splitlines()
                 if ln.strip() and not ln.strip().startswith("#")]
        code = "\n".join(lines)  # without comments
        froms = [ln for ln in lines if ln.upper().startswith("FROM ")]
        args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", logical, re.M))
        froms = [interpolate(f, args) for f in froms]
        if len(froms) < 2:
            self.error("Dockerfile: not multi-stage")
            return
        if not re.match(r"FROM nvidia/cuda:13\.0(\.\d+)?-(cudnn-)?devel-ubuntu24\.04\b", froms[0]):
            self.error(f"Dockerfile: build stage is '{froms[0]}', not NVIDIA CUDA 13.0 devel on "
                       "Ubuntu 24.04")
        if "devel" in froms[-1]:
            self.error(f"Dockerfile: runtime stage '{froms[-1]}' is a devel image")
        runtime_start = max(i for i, ln in enumerate(lines) if ln.upper().startswith("FROM "))
        build_lines, runtime_lines = lines[:runtime_start], lines[runtime_start:]

        dep_script = "scripts/install-deps.sh"
        if not any(ln.startswith("RUN") and re.search(r"(^|[\s;&|])(\./)?" + re.escape(dep_script), ln)
                   for ln in build_lines):
            self.error(f"Dockerfile: the build stage does not RUN {dep_script}")
        if not re.search(r"^\s*(bash\s+)?(\./)?" + re.escape(dep_script), ci, re.M):
            self.error(f".ci/run does not run {dep_script}: CI and the image would build against "
                       "different dependency sets")
        users = [ln.split()[1] for ln in runtime_lines if ln.upper().startswith("USER ")]
        if not users or users[-1].split(":")[0] in ("root", "0"):
            self.error("Dockerfile: the runtime stage does not switch to a non-root USER")
        hc = [ln for ln in runtime_lines if ln.upper().startswith("HEALTHCHECK ")]
        if not hc or "grpc_health_probe" not in hc[-1]:
            self.error("Dockerfile: no HEALTHCHECK through grpc_health_probe in the runtime stage")
        m = re.search(r"VLMGRAPH_HEALTH_ADDRESS=\S*:(\d+)", code)
        if not m or (grpc_ports and int(m.group(1)) not in grpc_ports):
            self.error(f"Dockerfile: VLMGRAPH_HEALTH_ADDRESS does not name the gRPC port "
                       f"{sorted(grpc_ports)}")
        exposed = {int(p.split("/")[0]) for ln in runtime_lines if ln.upper().startswith("EXPOSE ")
                   for p in ln.split()[1:]}
        for port in grpc_ports | metrics_ports:
            if port not in exposed:
                self.error(f"Dockerfile: port {port} is not EXPOSEd")
        # Repository paths the build uses must exist and reach the build context.
        ignore = []
        if os.path.isfile(self.path(".dockerignore")):
            with open(self.path(".dockerignore"), encoding="utf-8") as f:
                ignore = [ln.strip().lstrip("/") for ln in f
                          if ln.strip() and not ln.startswith("#")]
        for rel in sorted(set(re.findall(r"(?<![\w/.])((?:scripts|tests|deploy|docs)/[\w./-]+\w)",
                                         code))):
            if not os.path.exists(self.path(rel)):
                self.error(f"Dockerfile: {rel} does not exist")
            parts = rel.split("/")
            prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
            for pat in ignore:
                if any(fnmatch.fnmatch(p, pat) for p in prefixes):
                    self.error(f".dockerignore: '{pat}' keeps {rel}, which the Dockerfile uses, out "
                               "of the build context")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    args = ap.parse_args()
    w = Wiring(args.root)
    w.check()
    for e in w.errors:
        print(f"FAIL {e}")
    print(f"check_wiring: {len(w.errors)} problems")
    return 1 if w.errors else 0


if __name__ == "__main__":
    sys.exit(main())
