#!/usr/bin/env python3
"""Issue 43's ResNet convergence comparison, from gpu_convergence.sh's log.

Each run is a section `## resnet50 seed S MODE` (MODE `amp` or `--fp32`) followed by the
image-folder example's epoch lines (`epoch N: loss L, ..., eval loss E, eval accuracy
A%`). AMP and f32 runs of one seed start from the same weights and see the same batches,
so the comparison is paired: per epoch, the mean over the seeds of each precision's
training loss, and the mean of the per-seed differences AMP - f32 with its standard
error, also as a share of f32's mean; then the same for the last epoch's held-out loss
and accuracy. (Ratios per seed would be dominated by the seeds whose loss is nearest 0.)

    python3 convergence_stats.py convergence.txt
"""
import math
import re
import sys
from collections import defaultdict


def mean_se(values):
    n = len(values)
    m = sum(values) / n
    if n < 2:
        return m, float("nan")
    var = sum((v - m) ** 2 for v in values) / (n - 1)
    return m, math.sqrt(var / n)


def parse(path):
    runs = defaultdict(dict)  # seed -> mode -> [(train loss, eval loss, eval accuracy)]
    current = None
    for line in open(path):
        head = re.match(r"## resnet50 seed (\S+) (\S+)", line)
        if head:
            current = runs[head.group(1)].setdefault(head.group(2), [])
            continue
        epoch = re.match(r"epoch \d+: loss ([0-9.eE+-]+|nan|inf).*eval loss ([0-9.eE+-]+|nan|inf), "
                         r"eval accuracy ([0-9.]+)%", line)
        if epoch and current is not None:
            current.append(tuple(float(g) for g in epoch.groups()))
    return runs


def compare(label, amp, f32):
    """One row: both means and the paired difference with its standard error."""
    diff, se = mean_se([a - f for a, f in zip(amp, f32)])
    base = sum(f32) / len(f32)
    print(f"| {label} | {sum(amp) / len(amp):.4f} | {base:.4f} | {diff:+.4f} +- {se:.4f} | "
          f"{100 * diff / base:+.1f}% +- {100 * se / base:.1f}% |")


def main():
    runs = parse(sys.argv[1])
    seeds = [s for s in sorted(runs, key=lambda s: (len(s), s))
             if len(runs[s].get("amp", [])) == len(runs[s].get("--fp32", [])) > 0]
    left = sorted(set(runs) - set(seeds))
    if left:
        print(f"left out (a run missing or cut short): seeds {', '.join(left)}")
    if not seeds:
        return
    print(f"resnet50, {len(seeds)} seeds, AMP f16 against f32 from the same start\n")
    print("| measure | AMP mean | f32 mean | AMP - f32 (paired, standard error) | of f32's mean |")
    print("|---|---|---|---|---|")
    epochs = len(runs[seeds[0]]["amp"])
    for e in range(epochs):
        compare(f"training loss, epoch {e + 1}",
                [runs[s]["amp"][e][0] for s in seeds], [runs[s]["--fp32"][e][0] for s in seeds])
    compare("held-out loss after the last epoch",
            [runs[s]["amp"][-1][1] for s in seeds], [runs[s]["--fp32"][-1][1] for s in seeds])
    compare("held-out accuracy (%) after the last epoch",
            [runs[s]["amp"][-1][2] for s in seeds], [runs[s]["--fp32"][-1][2] for s in seeds])


if __name__ == "__main__":
    main()
