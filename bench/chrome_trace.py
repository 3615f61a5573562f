"""Chrome trace files as the bench scripts read them (allreduce_overlap.py, decode_regions.py,
trace_summary.py, train_regions.py): what `vlmgraph-bench` and `vlmgraph-train-bench` write with
`--profile-trace` (torch.profiler's export_chrome_trace: {"traceEvents": [...]}), a bare event list,
or either gzipped (`.gz`, as scripts/gpu/multi_gpu.sh keeps them)."""
import gzip
import json


def load_events(path):
    """The trace's event list (dicts with ph, cat, name, ts, dur, ...)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data.get("traceEvents", []) if isinstance(data, dict) else data
