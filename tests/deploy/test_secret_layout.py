#!/usr/bin/env python3
"""The API-keys secret as compose.yaml and deploy/k8s/vlmgraph.yaml hand it to the container, read
by the container's user (uid and gid 10001, the Dockerfile's `vlmgraph`), without Docker.

Compose bind-mounts a file secret with the host file's owner and mode; the documented layout
(docs/deployment.md) is the operator's own file with group 10001 and mode 0440. Kubernetes writes a
secret's files as root with the volume's defaultMode and, with the pod's fsGroup, that group: the
manifest's fsGroup 10001 and defaultMode 0440 give the same. Each layout is read by a process of
uid/gid 10001 with no other group (setpriv, as the container runs); a file only the operator can
read (chmod 600) is refused, as it is in the container. Then the server takes the keys
file of that layout (`auth.api_keys_file`, deploy/config.yaml's other settings on the CPU) and
answers only calls with the key.

  test_secret_layout.py SERVER   (root needed to change owners and uids; exits 77 = skipped without)
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UID = GID = 10001


def readable_by_container_user(path):
    r = subprocess.run(["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups", "head", "-c", "1",
                        path], capture_output=True)
    return r.returncode == 0


def k8s_secret_mode_and_group():
    docs = list(yaml.safe_load_all(open(os.path.join(ROOT, "deploy/k8s/vlmgraph.yaml"))))
    pod = next(d for d in docs if d and d.get("kind") == "Deployment")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if "secret" in v)
    return volume["secret"]["defaultMode"], pod.get("securityContext", {}).get("fsGroup")


def main():
    server = os.path.abspath(sys.argv[1])
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        print("skip: needs root and setpriv (util-linux)")
        return 77
    failures = []
    tmp = tempfile.mkdtemp()
    os.chmod(tmp, 0o755)
    try:
        keys = os.path.join(tmp, "vlmgraph_api_keys")
        key = "layout-test-key-0123456789abcdef"
        with open(keys, "w") as f:
            f.write(f"inference,train,publish {key}\n")

        # The docs' compose layout: the operator's file, group 10001, 0440.
        doc = open(os.path.join(ROOT, "docs/deployment.md")).read()
        if not re.search(r"chmod 0?440 deploy/api-keys", doc) or "chgrp 10001 deploy/api-keys" not in doc:
            failures.append("docs/deployment.md does not give the 0440 / group 10001 layout")
        os.chown(keys, 0, GID)
        os.chmod(keys, 0o440)
        if not readable_by_container_user(keys):
            failures.append("compose layout (group 10001, 0440) is not readable by uid 10001")
        # A file only the operator can read: 0600.
        os.chown(keys, 0, 0)
        os.chmod(keys, 0o600)
        if readable_by_container_user(keys):
            failures.append("a 0600 file of another user is readable by uid 10001: the check proves nothing")

        # Kubernetes: root-owned files, defaultMode, group fsGroup.
        mode, fs_group = k8s_secret_mode_and_group()
        if fs_group != GID:
            failures.append(f"deploy/k8s/vlmgraph.yaml: pod fsGroup is {fs_group}, not {GID}")
        os.chown(keys, 0, fs_group if isinstance(fs_group, int) else 0)
        os.chmod(keys, mode)
        if not readable_by_container_user(keys):
            failures.append(f"k8s layout (root:{fs_group}, {oct(mode)}) is not readable by uid 10001")

        # The server with that keys file and deploy/config.yaml's other settings (CPU, a preset).
        proc = subprocess.Popen(
            [server, "--config", os.path.join(ROOT, "deploy/config.yaml"), "--set", "model=nanovlm-tiny",
             "--set", "device=cpu", "--set", "data_parallel_size=1", "--set", f"auth.api_keys_file={keys}",
             # nanovlm-tiny's 512 positions and a CPU: shapes that fit it
             "--set", "buckets.seq_lens=[128, 256]", "--set", "buckets.context_lens=[512]",
             "--set", "buckets.batch_sizes=[1, 2]", "--set", "buckets.tile_counts=[1]",
             "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0",
             "--metrics-address", "127.0.0.1:0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp)
        http = None
        deadline = time.time() + 120
        while time.time() < deadline and http is None:
            line = proc.stdout.readline()
            if not line:
                break
            m = re.search(r" http (\S+)", line)
            if "ready" in line and m:
                http = m.group(1)
        if http is None:
            proc.kill()
            failures.append("the server did not start: " + proc.stderr.read()[-2000:])
        else:
            import urllib.error
            import urllib.request

            def status(auth):
                req = urllib.request.Request(f"http://{http}/v1/models",
                                             headers={"Authorization": f"Bearer {auth}"} if auth else {})
                try:
                    return urllib.request.urlopen(req, timeout=10).status
                except urllib.error.HTTPError as e:
                    return e.code

            if status(key) != 200 or status(None) != 401 or status("wrong") != 401:
                failures.append(f"keys not applied: with key {status(key)}, without {status(None)}")
            proc.terminate()
            proc.wait(timeout=60)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for f in failures:
        print("FAIL", f)
    print("ok" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
