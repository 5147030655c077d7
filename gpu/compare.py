#!/usr/bin/env python3
"""Compare the A/B runs of gpu/ab.sh: for every figure (baselines included), each build's median
per round, and new/base as the ratio of the two builds' medians over rounds. A figure is flagged
"slower" only when every round of the new build is slower than every round of the base build
and the ratio is over 1.10 (drift between rounds is shown by the per-round columns).
Usage: python3 compare.py AB_DIR"""
import json, pathlib, statistics, sys

root = pathlib.Path(sys.argv[1])
runs = {}  # build -> round -> figure -> median_ns
for report in sorted(root.glob("*-*/vmm-bench-report.json")):
    build, rnd = report.parent.name.rsplit("-", 1)
    figures = {}
    for row in json.loads(report.read_text())["rows"]:
        figures[row["figure"]] = row["median_ns"]
        if row.get("baseline") and row.get("baseline_median_ns") is not None:
            figures.setdefault(row["baseline"], row["baseline_median_ns"])
    runs.setdefault(build, {})[int(rnd)] = figures

def fmt(ns):
    return f"{ns / 1e6:.3f} ms" if ns >= 1e6 else f"{ns / 1e3:.2f} us"

new, base = runs.get("new", {}), runs.get("base", {})
names = sorted(set().union(*[f.keys() for f in new.values()], *[f.keys() for f in base.values()]))
print("| figure | new (per round) | base (per round) | new/base | verdict |")
print("|---|---|---|---:|---|")
for name in names:
    a = [new[r][name] for r in sorted(new) if name in new[r]]
    b = [base[r][name] for r in sorted(base) if name in base[r]]
    if not a or not b:
        print(f"| {name} | {', '.join(map(fmt, a)) or '-'} | {', '.join(map(fmt, b)) or '-'} | - | only one build has it |")
        continue
    ratio = statistics.median(a) / statistics.median(b)
    slower = min(a) > max(b) and ratio > 1.10
    faster = max(a) < min(b) and ratio < 0.91
    verdict = "slower" if slower else "faster" if faster else "same within spread"
    print(f"| {name} | {', '.join(map(fmt, a))} | {', '.join(map(fmt, b))} | {ratio:.3f}x | {verdict} |")
