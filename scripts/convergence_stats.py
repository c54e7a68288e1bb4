#!/usr/bin/env python3
"""Issue 43's ResNet convergence comparison, from gpu_convergence.sh's log.

Each run is a section `## resnet50 seed S MODE` (MODE `amp` or `--fp32`) followed by the
image-folder example's epoch lines (`epoch N: loss L, ..., eval loss E, eval accuracy
A%`). Per run: the last epoch's held-out loss and accuracy, and the mean training loss
of the last three epochs. Per precision: their means over the seeds with standard
errors; and, the comparison the 1% bar asks, AMP's held-out loss relative to f32's of
the same seed (same start, same batches): the mean of those ratios minus one, with its
standard error.

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


def main():
    runs = parse(sys.argv[1])
    per_mode = defaultdict(lambda: defaultdict(list))
    ratios = []
    print("| seed | mode | train loss (last 3 epochs) | eval loss | eval accuracy |")
    print("|---|---|---|---|---|")
    for seed in sorted(runs, key=lambda s: (len(s), s)):
        finals = {}
        for mode, epochs in sorted(runs[seed].items()):
            if len(epochs) < 3:
                print(f"| {seed} | {mode} | (ran {len(epochs)} epochs: left out) | | |")
                continue
            train = sum(e[0] for e in epochs[-3:]) / 3
            _, eval_loss, accuracy = epochs[-1]
            finals[mode] = eval_loss
            per_mode[mode]["train"].append(train)
            per_mode[mode]["eval"].append(eval_loss)
            per_mode[mode]["accuracy"].append(accuracy)
            print(f"| {seed} | {mode} | {train:.4f} | {eval_loss:.4f} | {accuracy:.2f}% |")
        if "amp" in finals and "--fp32" in finals and finals["--fp32"] > 0:
            ratios.append(finals["amp"] / finals["--fp32"] - 1)
    print()
    for mode, stats in sorted(per_mode.items()):
        parts = [f"{name} {m:.4f} +- {se:.4f}" for name, (m, se) in
                 ((k, mean_se(v)) for k, v in stats.items())]
        print(f"resnet50 {mode}: {len(stats['eval'])} runs; means over the seeds "
              f"(standard errors): " + ", ".join(parts))
    if ratios:
        m, se = mean_se(ratios)
        print(f"resnet50 AMP eval loss against f32's of the same seed: {100 * m:+.2f}% "
              f"+- {100 * se:.2f}% (standard error, {len(ratios)} seeds)")


if __name__ == "__main__":
    main()
