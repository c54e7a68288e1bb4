#!/usr/bin/env python3
"""Reads a timeline written by cupti_trace.c (gzip or plain CSV): splits it into steps
at idle gaps, prints the median span of the steps with the most common op count, and
one step's ops (start, duration, kind, grid, block, name) with its busy time and gaps,
then the step's time per kernel name.

    python3 timeline.py ours.csv.gz [--gap-us 60] [--step -3]
"""
import argparse, collections, gzip, re, statistics


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    rows = []
    for line in opener(path, "rt"):
        t = line.rstrip("\n").split(",", 6)
        rows.append((t[0], int(t[1]), int(t[2]), int(t[3]), int(t[4]), int(t[5]), t[6]))
    rows.sort(key=lambda r: r[1])
    return [r for r in rows if r[0] != "D"]


def steps(rows, gap_ns):
    """Runs of GPU work separated by more than gap_ns of idle time."""
    out, cur, end = [], [rows[0]], rows[0][2]
    for r in rows[1:]:
        if r[1] - end > gap_ns:
            out.append(cur)
            cur = []
        cur.append(r)
        end = max(end, r[2])
    out.append(cur)
    return out


def show(step):
    t0, end, busy, gaps = step[0][1], step[0][1], 0, 0
    for r in step:
        gaps += max(0, r[1] - end)
        busy += r[2] - r[1]
        end = max(end, r[2])
        name = re.sub(r"void |<.*", "", r[6])[:70]
        print(f"{(r[1] - t0) / 1e3:9.1f} {(r[2] - r[1]) / 1e3:8.1f} {r[0]} g{r[4]:>6} b{r[5]:>4} {name}")
    print(f"span {(step[-1][2] - t0) / 1e3:.1f} us  busy {busy / 1e3:.1f}  gaps {gaps / 1e3:.1f}  ops {len(step)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--gap-us", type=float, default=60)
    ap.add_argument("--step", type=int, default=-3)
    a = ap.parse_args()
    ss = steps(load(a.path), a.gap_us * 1e3)
    # The op count that covers the most ops: the training loop's steps, not the
    # many short runs of autotuning or warm-up.
    counts = collections.Counter(len(s) for s in ss if len(s) > 3)
    n = max(counts, key=lambda k: k * counts[k])
    same = [s for s in ss if len(s) == n]
    spans = [(s[-1][2] - s[0][1]) / 1e3 for s in same]
    print(f"{len(same)} steps of {n} ops: median span {statistics.median(spans):.1f} us")
    show(same[a.step])
    per = collections.defaultdict(lambda: [0, 0.0])
    for r in same[a.step]:
        name = re.sub(r"void |<.*", "", r[6])[:70]
        per[name][0] += 1
        per[name][1] += (r[2] - r[1]) / 1e3
    print("us total, calls, kernel:")
    for name, (calls, us) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"{us:9.1f} {calls:4d} {name}")


if __name__ == "__main__":
    main()
