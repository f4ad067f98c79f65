#!/usr/bin/env python3
"""Summarise an Nsight Compute --csv log: per kernel name, launches, total and mean time,
and the mean of the other metrics. Usage: ncu_summary.py TITLE FILE.csv"""
import csv, sys
from collections import defaultdict

title, path = sys.argv[1], sys.argv[2]
try:
    lines = [l for l in open(path, errors="replace") if l.startswith('"')]
except OSError as e:
    print(f"{title}: no ncu output ({e})")
    sys.exit(0)
rows = list(csv.DictReader(lines))
by = defaultdict(lambda: defaultdict(list))
order = []
for r in rows:
    name = r.get("Kernel Name", "?")
    short = name.split("(")[0][:60]
    if short not in by:
        order.append(short)
    try:
        v = float(r["Metric Value"].replace(",", ""))
    except (KeyError, ValueError):
        continue
    by[short][r["Metric Name"]].append(v)
total = sum(sum(m.get("gpu__time_duration.sum", [])) for m in by.values())
print(f"== ncu {title}: {total/1e3:.1f} us in {len(by)} kernels")
for k in sorted(order, key=lambda k: -sum(by[k].get("gpu__time_duration.sum", [0]))):
    m = by[k]
    t = m.get("gpu__time_duration.sum", [0])
    mean = lambda n: sum(m[n]) / len(m[n]) if m.get(n) else float("nan")
    print(f"  {k:60} n={len(t):3} total {sum(t)/1e3:8.1f} us mean {sum(t)/len(t)/1e3:7.2f} us"
          f" sm {mean('sm__throughput.avg.pct_of_peak_sustained_elapsed'):5.1f}%"
          f" dram {mean('dram__throughput.avg.pct_of_peak_sustained_elapsed'):5.1f}%"
          f" warps {mean('sm__warps_active.avg.pct_of_peak_sustained_active'):5.1f}%"
          f" regs {mean('launch__registers_per_thread'):4.0f} grid {mean('launch__grid_size'):7.0f}")
