#!/usr/bin/env python3
"""CPU time of a process's threads over a window: which threads of a server run at 100%.

    python3 bench/thread_cpu.py PID [--seconds 5] [--top 12] [--json]

Reads utime + stime of every /proc/PID/task/TID/stat (proc(5): fields 14 and 15, in clock ticks)
at the start and the end of the window; a thread's share is its CPU seconds over the window's
seconds (1.0 = one core all the time). Prints the process total, the number of threads above 90%,
and the busiest threads with their names (comm). Threads that started or ended inside the window
count from their first or until their last sample. Linux only.
"""
import argparse
import json
import os
import sys
import time

TICKS = os.sysconf("SC_CLK_TCK")


def sample(pid):
    """{tid: (comm, cpu seconds)} of the process's threads now."""
    out = {}
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/stat") as f:
                text = f.read()
        except OSError:
            continue  # the thread ended
        # comm is in parentheses and may hold spaces or parentheses: split at the last ')'.
        comm = text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        # fields[0] is field 3 (state): utime and stime are fields 14 and 15.
        out[int(tid)] = (comm, (int(fields[11]) + int(fields[12])) / TICKS)
    return out


def measure(pid, seconds):
    """[(tid, comm, share)] busiest first, and the window's length in seconds."""
    t0, a = time.monotonic(), sample(pid)
    time.sleep(seconds)
    t1, b = time.monotonic(), sample(pid)
    window = t1 - t0
    rows = [(tid, comm, (cpu - a.get(tid, (comm, 0.0))[1]) / window) for tid, (comm, cpu) in b.items()]
    rows.sort(key=lambda r: -r[2])
    return rows, window


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pid", type=int)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--json", action="store_true", help="one JSON line instead of text")
    a = p.parse_args()
    rows, window = measure(a.pid, a.seconds)
    total = sum(r[2] for r in rows)
    saturated = sum(1 for r in rows if r[2] > 0.9)
    if a.json:
        print(json.dumps({"pid": a.pid, "window_seconds": round(window, 3), "threads": len(rows),
                          "total_cores": round(total, 3), "threads_above_90_percent": saturated,
                          "top": [{"tid": t, "comm": c, "cores": round(s, 3)} for t, c, s in rows[:a.top]]}))
    else:
        print(f"pid {a.pid}: {len(rows)} threads, {total:.2f} cores over {window:.1f} s, "
              f"{saturated} threads above 90%")
        for tid, comm, share in rows[:a.top]:
            print(f"  {tid:>8} {comm:<16} {100 * share:6.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
