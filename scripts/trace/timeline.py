#!/usr/bin/env python3
"""Reads a timeline written by cupti_trace.c (gzip or plain CSV): splits it into steps
at idle gaps, prints the median span of the steps with the most common op count, and
one step's ops (start, duration, kind, grid, block, name) with its busy time and gaps,
then the step's time per kernel (a generated kernel's name, `k`, with its grid and
block) and per kind: GEMMs (cuBLASLt), attention, other kernels, memsets, gaps.

Where the steps run back to back (a replayed step graph after another: no idle gap
between them), the steps are the repeats of the run's last op: from one of its
occurrences to the next, the most common distance apart.

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


def repeats(rows):
    """The run cut after each occurrence of its last kernel (same grid, block and
    name), keeping the pieces of the most common length: back-to-back steps."""
    key = lambda r: (r[0], r[4], r[5], r[6])
    last = next((r for r in reversed(rows) if r[0] == "K"), rows[-1])
    at = [i for i, r in enumerate(rows) if key(r) == key(last)]
    pieces = [rows[a + 1:b + 1] for a, b in zip(at, at[1:])]
    if not pieces:
        return [rows]
    n = collections.Counter(len(p) for p in pieces).most_common(1)[0][0]
    return [p for p in pieces if len(p) == n]


def name_of(r):
    name = re.sub(r"void |<.*", "", r[6])[:70]
    # Our generated kernels share a few names: their launch shape tells them apart.
    return f"{name} g{r[4]} b{r[5]}" if len(name) <= 12 else name


def kind_of(r):
    name = r[6]
    if r[0] == "S":
        return "memset"
    if "nvjet" in name or "cublas" in name.lower() or "gemm" in name:
        return "gemm"
    if name in ("k_fwd", "k_dq", "k_dkv"):
        return "attention"
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--gap-us", type=float, default=60)
    ap.add_argument("--step", type=int, default=-3)
    a = ap.parse_args()
    rows = load(a.path)
    ss = steps(rows, a.gap_us * 1e3)
    # The op count that covers the most ops: the training loop's steps, not the
    # many short runs of autotuning or warm-up.
    counts = collections.Counter(len(s) for s in ss if len(s) > 3)
    n = max(counts, key=lambda k: k * counts[k])
    same = [s for s in ss if len(s) == n]
    if len(same) < 3:
        same = repeats(rows)
        n = len(same[0])
    spans = [(s[-1][2] - s[0][1]) / 1e3 for s in same]
    print(f"{len(same)} steps of {n} ops: median span {statistics.median(spans):.1f} us")
    show(same[a.step])
    per = collections.defaultdict(lambda: [0, 0.0])
    kinds = collections.defaultdict(float)
    for r in same[a.step]:
        per[name_of(r)][0] += 1
        per[name_of(r)][1] += (r[2] - r[1]) / 1e3
        kinds[kind_of(r)] += (r[2] - r[1]) / 1e3
    print("us total, calls, kernel:")
    for name, (calls, us) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"{us:9.1f} {calls:4d} {name}")
    print("us by kind: " + ", ".join(f"{k} {us:.1f}" for k, us in sorted(kinds.items())))


if __name__ == "__main__":
    main()
