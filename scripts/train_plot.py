#!/usr/bin/env python3
"""Plots vlmgraph-train's metrics file (JSON lines, docs/training.md "Metrics file") and converts it
to TensorBoard event files.

  scripts/train_plot.py runs/run1/metrics.jsonl -o loss.png            # train + eval loss, lr
  scripts/train_plot.py runs/a/metrics.jsonl runs/b/metrics.jsonl -o compare.png
  scripts/train_plot.py runs/run1/metrics.jsonl --tensorboard tb/run1  # then: tensorboard --logdir tb
  scripts/train_plot.py runs/run1/metrics.jsonl --tensorboard tb/run1 --follow   # while it trains

The PNG (matplotlib) has the training loss per step (faint) with its moving average, the
validation loss at each evaluation (markers), and below it each trained part's learning rate;
several files are drawn as several runs. --tensorboard writes the scalars train/loss, eval/loss,
train/learning_rate/<part>, train/grad_norm, train/tokens_per_second and train/mfu with each
step's wall time, through torch.utils.tensorboard's SummaryWriter (the tensorboard package; or
tensorboardX's when torch is missing). --follow keeps reading the file as the job appends to it
(every --interval seconds, until interrupted), redrawing the PNG and adding the new events; a
file that a resumed job rewrote shorter (vlmgraph-train drops the steps after the checkpoint it
resumes) is followed from there, with TensorBoard's purge_step so that no step shows twice.

Exit status: 0 done, 2 bad arguments or an unreadable file. Python and these packages are tools
only: nothing on the server's or the trainer's path uses them.
"""
import argparse
import json
import math
import os
import sys
import time


def read_records(path, offset=0):
    """(records, new offset) of the complete lines of `path` from byte `offset`: a last line
    without its newline (being written) is left for the next read. Lines that are not JSON
    objects with a "step" are skipped."""
    records = []
    with open(path, "rb") as fh:
        fh.seek(offset)
        data = fh.read()
    end = data.rfind(b"\n") + 1
    for line in data[:end].splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and isinstance(r.get("step"), int):
            records.append(r)
    return records, offset + end


def finite(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def series(records, key):
    """(steps, values) of the records whose `key` is a finite number."""
    pts = [(r["step"], r[key]) for r in records if finite(r.get(key))]
    return [p[0] for p in pts], [p[1] for p in pts]


def moving_average(values, window):
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def run_label(path, paths):
    """The run's name: its file's directory name, when several runs are drawn."""
    if len(paths) == 1:
        return ""
    return os.path.basename(os.path.dirname(os.path.abspath(path))) or path


def draw_png(runs, out_path, title=None):
    """runs: [(label, records)]. Writes the PNG; returns what it drew, for the summary line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True,
                                         gridspec_kw={"height_ratios": [3, 1.3]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    rates_seen = []
    for k, (label, records) in enumerate(runs):
        color = colors[k % len(colors)]
        prefix = f"{label}: " if label else ""
        steps, loss = series(records, "loss")
        if steps:
            window = max(1, len(steps) // 20)
            ax_loss.plot(steps, loss, color=color, alpha=0.25, linewidth=0.8)
            ax_loss.plot(steps, moving_average(loss, window), color=color, linewidth=1.6,
                         label=f"{prefix}train loss" + (f" (mean of {window})" if window > 1 else ""))
        steps, eval_loss = series(records, "eval_loss")
        if steps:
            ax_loss.plot(steps, eval_loss, color=color, linestyle="--", marker="o", markersize=4,
                         label=f"{prefix}eval loss")
        parts = []
        for r in records:
            for part in (r.get("learning_rate") or {}):
                if part not in parts:
                    parts.append(part)
        for j, part in enumerate(parts):
            pts = [(r["step"], r["learning_rate"][part]) for r in records
                   if finite((r.get("learning_rate") or {}).get(part))]
            if pts:
                ax_lr.plot([p[0] for p in pts], [p[1] for p in pts], color=color,
                           linestyle=["-", "--", ":"][j % 3], label=f"{prefix}{part}")
                rates_seen.extend(p[1] for p in pts)
    ax_loss.set_ylabel("loss (cross entropy per token)")
    ax_loss.grid(True, alpha=0.3)
    ax_loss.legend(loc="upper right", fontsize=8)
    ax_loss.set_title(title or "vlmgraph-train")
    positive = [v for v in rates_seen if v > 0]
    if positive and max(positive) / min(positive) > 20:
        ax_lr.set_yscale("log")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    ax_lr.grid(True, alpha=0.3)
    if rates_seen:
        ax_lr.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)


def summary_writer(log_dir, purge_step=None):
    """torch.utils.tensorboard's SummaryWriter, else tensorboardX's (both write TensorBoard's
    event format with the tensorboard / tensorboardX packages' own writers)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            sys.exit("train_plot.py: --tensorboard needs the tensorboard package (pip install "
                     "tensorboard; scripts/install-deps.sh installs it) or tensorboardX")
    return SummaryWriter(log_dir=log_dir, purge_step=purge_step)


# The scalars written per record: (tag, key in the record).
SCALARS = [("train/loss", "loss"), ("eval/loss", "eval_loss"), ("train/grad_norm", "grad_norm"),
           ("train/tokens_per_second", "tokens_per_second"), ("train/mfu", "mfu")]


def write_events(writer, records):
    for r in records:
        step, walltime = r["step"], r.get("time")
        walltime = walltime if finite(walltime) else None
        for tag, key in SCALARS:
            if finite(r.get(key)):
                writer.add_scalar(tag, r[key], step, walltime=walltime)
        for part, rate in (r.get("learning_rate") or {}).items():
            if finite(rate):
                writer.add_scalar(f"train/learning_rate/{part}", rate, step, walltime=walltime)
    writer.flush()


class Follower:
    """Reads one metrics file as it grows: poll() returns the complete records added since the
    last call. A file rewritten shorter or replaced (a resumed job) is read again from its start,
    and `restarted` is set until the caller clears it."""

    def __init__(self, path):
        self.path = path
        self.offset = 0
        self.inode = None
        self.records = []
        self.restarted = False

    def poll(self):
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        if self.inode is not None and (st.st_ino != self.inode or st.st_size < self.offset):
            self.offset, self.records, self.restarted = 0, [], True
        self.inode = st.st_ino
        new, self.offset = read_records(self.path, self.offset)
        self.records.extend(new)
        return new


def follow_once(follower, writer, tensorboard_dir, png_path, title=None):
    """One read of --follow: the new records go to TensorBoard (a writer made on first use; after
    a restart a new one whose purge_step drops what the old one wrote from there on) and the PNG
    is redrawn. Returns the writer to pass next time."""
    new = follower.poll()
    if follower.restarted and writer is not None:
        writer.close()
        writer = None
    batch = follower.records if follower.restarted else new
    if tensorboard_dir and batch:
        if writer is None:
            writer = summary_writer(tensorboard_dir, batch[0]["step"])
        write_events(writer, batch)
    if png_path and batch:
        draw_png([("", follower.records)], png_path, title)
    if new:
        print(f"{follower.path}: step {follower.records[-1]['step']}", flush=True)
    follower.restarted = False
    return writer


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", nargs="+", help="metrics.jsonl files of vlmgraph-train (one per run)")
    p.add_argument("-o", "--output", help="PNG to write: train and eval loss, learning rates")
    p.add_argument("--title", help="the plot's title (default: vlmgraph-train)")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="write TensorBoard event files here (one metrics file only)")
    p.add_argument("--follow", action="store_true",
                   help="keep converting while the run writes the file (until interrupted)")
    p.add_argument("--interval", type=float, default=5.0, help="--follow: seconds between reads")
    args = p.parse_args(argv)
    if not args.output and not args.tensorboard:
        p.error("give -o PNG and/or --tensorboard DIR")
    if args.tensorboard and len(args.metrics) != 1:
        p.error("--tensorboard converts one metrics file; run it once per run directory")
    if args.follow and len(args.metrics) != 1:
        p.error("--follow reads one metrics file")
    for path in args.metrics:
        if not os.path.isfile(path) and not args.follow:
            print(f"train_plot.py: {path}: no such file", file=sys.stderr)
            return 2

    if not args.follow:
        runs = []
        for path in args.metrics:
            records, _ = read_records(path)
            runs.append((run_label(path, args.metrics), records))
        if args.output:
            draw_png(runs, args.output, args.title)
        if args.tensorboard:
            records = runs[0][1]
            # purge_step: a conversion run again replaces the steps it writes.
            writer = summary_writer(args.tensorboard, records[0]["step"] if records else None)
            write_events(writer, records)
            writer.close()
        for path, (_, records) in zip(args.metrics, runs):
            steps, loss = series(records, "loss")
            _, evals = series(records, "eval_loss")
            print(f"{path}: {len(steps)} steps" +
                  (f", last loss {loss[-1]:.4f}" if loss else "") +
                  (f", last eval_loss {evals[-1]:.4f}" if evals else ""))
        if args.output:
            print(f"wrote {args.output}")
        if args.tensorboard:
            print(f"wrote TensorBoard events to {args.tensorboard} (tensorboard --logdir "
                  f"{os.path.dirname(os.path.abspath(args.tensorboard))})")
        return 0

    follower = Follower(args.metrics[0])
    writer = None
    try:
        while True:
            writer = follow_once(follower, writer, args.tensorboard, args.output, args.title)
            time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    finally:
        if writer is not None:
            writer.close()
    return 0

if __name__ == "__main__":
    sys.exit(main())
