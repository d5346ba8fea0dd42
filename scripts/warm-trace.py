#!/usr/bin/env python3
"""The warm tier's trace for `model-residency simulate` (docs/performance.md):
20 models of 14-18 GiB (a 64Gi budget holds 4), Zipf(1.0) popularity, cold
loads of 30-90 s and wakes of 0.5-6 s drawn uniformly per model, each model
sleeping at 1-2 GiB of VRAM with its size in host memory (vLLM level 1).
Writes DIR/registry.yaml and DIR/trace.csv; with --same-costs every model
loads in 60 s and wakes in 3 s. Usage: warm-trace.py DIR [REQUESTS] [--same-costs]"""
import os
import random
import sys

args = [a for a in sys.argv[1:] if not a.startswith("--")]
same = "--same-costs" in sys.argv
out = args[0]
requests = int(args[1]) if len(args) > 1 else 100_000
MODELS = 20
random.seed(11)
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "registry.yaml"), "w") as f:
    for i in range(MODELS):
        size = random.randint(14, 18)
        load = 60.0 if same else random.uniform(30, 90)
        wake = 3.0 if same else random.uniform(0.5, 6)
        sleeping = random.choice([1, 2])
        f.write(
            f"- {{name: m{i}, size: {size}Gi, loadTime: {load:.1f}s, "
            f"sleep: {{preset: vllm, sleepingSize: {sleeping}Gi, hostMemory: {size}Gi, wakeTime: {int(wake * 1000)}ms}}}}\n"
        )
order = list(range(MODELS))
random.shuffle(order)  # popularity is not registry order
weights = [0.0] * MODELS
for rank, m in enumerate(order):
    weights[m] = 1 / (rank + 1)
with open(os.path.join(out, "trace.csv"), "w") as f:
    f.write("time,model\n")
    t = 0.0
    for _ in range(requests):
        t += random.expovariate(1.0)
        m = random.choices(range(MODELS), weights=weights)[0]
        f.write(f"{t:.3f},m{m}\n")
