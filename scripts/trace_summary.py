#!/usr/bin/env python3
"""Summarise a MAMBA3_GPU_TRACE file of the fused decode (src/engine/cuda/decode.rs writes it):
`trace_summary.py FILE 3|5` (phases per layer). Per kind of phase, averaged over the
layers, how long the phase adds to the step, how long its first and last worker took to see
the previous phase done, and how long the work took."""
import statistics as st
import sys

path, per_layer = sys.argv[1], int(sys.argv[2])  # phases per layer: 3, or 5 with an MLP
names = ["in_proj", "mixer", "out_proj", "fc1", "fc2"][:per_layer]
rows = [tuple(map(int, l.split())) for l in open(path)]
phases = {}
marks = {}
for p, b, t0, t1, t2, t3, t4 in rows:
    phases.setdefault(p, []).append((b, t0, t1, t2))
    if t2:
        t4 = t4 or t2  # a GEMV's tiles end at its arrival
        marks.setdefault(p, []).append((t3 - t1, t4 - t3, t2 - t4))
n = len(phases)
start = min(t0 for r in phases.values() for _, t0, _, _ in r if t0)
ends, acc = [], {k: [] for k in names}
for p in range(n):
    w = [(t1, t2) for _, _, t1, t2 in phases[p] if t2]
    end = max(t2 for _, t2 in w)
    prev = ends[-1] if ends else start
    acc[names[p % per_layer]].append(
        (end - prev, min(t1 for t1, _ in w) - prev, max(t1 for t1, _ in w) - prev,
         st.median(t2 - t1 for t1, t2 in w), max(t2 - t1 for t1, t2 in w), len(w),
         [st.median(m[i] for m in marks[p]) for i in range(3)]))
    ends.append(end)
print(f"fused decode trace: {n} phases, {(ends[-1] - start) / 1e3:.1f} us from the first block's start to the last arrival")
for k in names:
    a = acc[k]
    m = [st.mean(x[i] for x in a) / 1e3 for i in range(5)]
    print(f"  {k:8} workers {a[0][5]:3}: adds {m[0]:5.2f} us; wait seen first {m[1]:5.2f} last {m[2]:5.2f}; "
          f"work median {m[3]:5.2f} max {m[4]:5.2f} us; stages (median) "
          + " ".join(f"{st.mean(x[6][i] for x in a) / 1e3:5.2f}" for i in range(3)))
