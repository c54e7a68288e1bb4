#!/usr/bin/env python3
"""Issue 43's ResNet convergence comparison, from gpu_convergence.sh's log.

Each run is a section `## resnet50 seed S MODE` (MODE `amp`, `fp32`, or `fp32-again`
for a second f32 run of the seed; `--fp32` in older logs) followed by the
image-folder example's epoch lines (`epoch N: loss L, ..., eval loss E, eval accuracy
A%`). AMP and f32 runs of one seed start from the same weights and see the same batches,
so the comparison is paired: per epoch, the mean over the seeds of each precision's
training loss, and the mean of the per-seed differences AMP - f32 with its standard
error, also as a share of f32's mean; then the same for the last epoch's held-out loss
and accuracy. (Ratios per seed would be dominated by the seeds whose loss is nearest 0.)
Where the log has `fp32-again` runs, the same table compares them with the first f32
runs: how far f32 lands from itself.

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


def table(runs, seeds, arm, base):
    """The paired comparison of the runs `arm` against `base` of every seed."""
    print(f"resnet50, {len(seeds)} seeds, {arm} against {base} from the same start\n")
    print(f"| measure | {arm} mean | {base} mean | {arm} - {base} (paired, standard error) "
          f"| of {base}'s mean |")
    print("|---|---|---|---|---|")
    epochs = len(runs[seeds[0]][arm])
    for e in range(epochs):
        compare(f"training loss, epoch {e + 1}",
                [runs[s][arm][e][0] for s in seeds], [runs[s][base][e][0] for s in seeds])
    compare("held-out loss after the last epoch",
            [runs[s][arm][-1][1] for s in seeds], [runs[s][base][-1][1] for s in seeds])
    compare("held-out accuracy (%) after the last epoch",
            [runs[s][arm][-1][2] for s in seeds], [runs[s][base][-1][2] for s in seeds])
    print()


def main():
    runs = parse(sys.argv[1])
    for modes in runs.values():
        if "--fp32" in modes:
            modes["fp32"] = modes.pop("--fp32")
    for arm in ["amp", "fp32-again"]:
        seeds = [s for s in sorted(runs, key=lambda s: (len(s), s))
                 if len(runs[s].get(arm, [])) == len(runs[s].get("fp32", [])) > 0]
        left = sorted(s for s in runs if arm in runs[s] and s not in seeds)
        if left:
            print(f"left out of {arm} (a run missing or cut short): seeds {', '.join(left)}")
        if seeds:
            table(runs, seeds, arm, "fp32")


if __name__ == "__main__":
    main()
