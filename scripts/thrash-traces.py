#!/usr/bin/env python3
"""The three shapes on which `--eviction rate` thrashed (#54 S2.7), for
`model-residency simulate`. Each writes DIR/registry.yaml, DIR/trace.csv
and DIR/budget (the GPU's budget). Every model loads in the default load
time (simulate's --load-seconds), one request a second.

  shift      four hot 10Gi models for 5,000 requests, then four others on
             40Gi for 5,000 (a change of working set)
  alternate  the two groups of shift alternating every 1,000 requests
             (10,000 in all)
  big        one 60Gi model every other request among six 10Gi models
             cycling, on 80Gi (6,000 requests)

Usage: thrash-traces.py KIND DIR [--seed N]  (default seed 11)"""
import os
import random
import sys


def write(out, models, budget, requests):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "registry.yaml"), "w") as f:
        for name, size in models:
            f.write(f"- {{name: {name}, size: {size}Gi}}\n")
    with open(os.path.join(out, "budget"), "w") as f:
        f.write(budget + "\n")
    with open(os.path.join(out, "trace.csv"), "w") as f:
        f.write("time,model\n")
        for t, m in enumerate(requests):
            f.write(f"{t}.000,{m}\n")


def main():
    argv = sys.argv[1:]
    seed = 11
    if "--seed" in argv:
        i = argv.index("--seed")
        seed = int(argv[i + 1])
        del argv[i : i + 2]
    if len(argv) != 2:
        sys.exit(__doc__)
    kind, out = argv
    random.seed(seed)
    a = [f"a{i}" for i in range(4)]
    b = [f"b{i}" for i in range(4)]
    if kind == "shift":
        reqs = [random.choice(a) for _ in range(5000)] + [random.choice(b) for _ in range(5000)]
        write(out, [(m, 10) for m in a + b], "40Gi", reqs)
    elif kind == "alternate":
        reqs = [random.choice(a if (r // 1000) % 2 == 0 else b) for r in range(10000)]
        write(out, [(m, 10) for m in a + b], "40Gi", reqs)
    elif kind == "big":
        small = [f"s{i}" for i in range(6)]
        reqs = []
        for r in range(3000):
            reqs += ["big", small[r % 6]]
        write(out, [("big", 60)] + [(m, 10) for m in small], "80Gi", reqs)
    else:
        sys.exit(f"unknown kind {kind!r}: shift, alternate or big")


if __name__ == "__main__":
    main()
