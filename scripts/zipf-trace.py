#!/usr/bin/env python3
"""A synthetic request trace for `model-residency simulate --trace`:
Poisson arrivals at RATE requests/s, MODELS models of 1-4 GiB with Zipf(1.1)
popularity, fixed seed. Usage: zipf-trace.py [REQUESTS] [RATE] > trace.csv"""
import random
import sys

requests = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
rate = float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
MODELS = 50
random.seed(7)
sizes = [random.choice([1, 2, 3, 4]) for _ in range(MODELS)]
weights = [1 / (i + 1) ** 1.1 for i in range(MODELS)]
t = 0.0
print("time,model,size")
for _ in range(requests):
    t += random.expovariate(rate)
    m = random.choices(range(MODELS), weights=weights)[0]
    print(f"{t:.4f},m{m},{sizes[m]}Gi")
