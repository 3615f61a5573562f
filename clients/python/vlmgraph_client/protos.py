"""Python stubs for the vlmgraph gRPC API, generated from proto/ on first use.

The stubs are not committed: `load()` runs grpcio-tools' protoc on proto/vlmgraph/v1/*.proto into
vlmgraph_client/_gen (or $VLMGRAPH_CLIENT_GEN_DIR) whenever the .proto files changed, then imports
them. The proto directory is the repository's proto/ (found relative to this package) or
$VLMGRAPH_PROTO_DIR.

    from vlmgraph_client import protos
    pb = protos.load()
    pb.generate_pb2.GenerateRequest(input_ids=[1, 2, 3])
"""
import hashlib
import importlib
import os
import shutil
import sys
import tempfile
import types

_PROTO_NAMES = ("image", "chat", "generate", "forward", "train", "model_info", "service")
_loaded = None


def proto_dir():
    """The directory holding vlmgraph/v1/*.proto."""
    env = os.environ.get("VLMGRAPH_PROTO_DIR")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", "..", "proto"))


def _gen_dir():
    env = os.environ.get("VLMGRAPH_CLIENT_GEN_DIR")
    if env:
        return env
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_gen")


def _proto_files(root):
    files = [os.path.join(root, "vlmgraph", "v1", f"{n}.proto") for n in _PROTO_NAMES]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"vlmgraph .proto files not found: {missing}; set VLMGRAPH_PROTO_DIR")
    return files


def _digest(files):
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()


def _stamp(out):
    try:
        with open(os.path.join(out, "STAMP")) as fh:
            return fh.read().strip()
    except OSError:
        return None


def build_protos(force=False):
    """Generates the Python stubs if the .proto files changed; returns the output directory."""
    from grpc_tools import protoc  # grpcio-tools
    import grpc_tools

    root = proto_dir()
    files = _proto_files(root)
    out = _gen_dir()
    digest = _digest(files)
    if not force and _stamp(out) == digest:
        return out
    parent = os.path.dirname(out) or "."
    os.makedirs(parent, exist_ok=True)
    # Generate into a fresh directory, then swap it in: concurrent processes never see half a tree.
    tmp = tempfile.mkdtemp(prefix=".gen-", dir=parent)
    try:
        well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
        args = ["protoc", f"-I{root}", f"-I{well_known}", f"--python_out={tmp}", f"--grpc_python_out={tmp}"] + files
        if protoc.main(args) != 0:
            raise RuntimeError("grpc_tools.protoc failed on " + " ".join(files))
        with open(os.path.join(tmp, "STAMP"), "w") as fh:
            fh.write(digest)
        try:
            os.rename(tmp, out)  # atomic when `out` does not exist yet
        except OSError:
            if _stamp(out) != digest:
                # Stale stubs from older .proto files: move them aside, then swap in the new ones.
                old = out + f".old-{os.getpid()}"
                os.rename(out, old)
                os.rename(tmp, out)
                shutil.rmtree(old, ignore_errors=True)
            # else another process just generated the same stubs: keep theirs.
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def load():
    """Builds (if needed) and imports the stubs; returns a namespace of the *_pb2 modules."""
    global _loaded
    if _loaded is not None:
        return _loaded
    out = build_protos()
    if out not in sys.path:
        sys.path.insert(0, out)
    ns = types.SimpleNamespace()
    for name in _PROTO_NAMES:
        setattr(ns, f"{name}_pb2", importlib.import_module(f"vlmgraph.v1.{name}_pb2"))
    ns.service_pb2_grpc = importlib.import_module("vlmgraph.v1.service_pb2_grpc")
    _loaded = ns
    return ns
