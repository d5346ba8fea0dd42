#!/usr/bin/env python3
"""Traces for `model-residency simulate` beyond one Zipf (docs/performance.md,
"Waiting on four traces"). Each writes DIR/registry.yaml and DIR/trace.csv.

Every trace's models are 14-18 GiB (a 64Gi budget holds 4 awake), load in
30-90 s and wake in 0.5-6 s (drawn uniformly per model), and sleep at 1-2 GiB
of VRAM with their size in host memory (vLLM level 1); arrivals are Poisson,
one a second on average, and popularity is shuffled against registry order.

  zipf      #28's trace: 20 models, Zipf(1.0) popularity (what
            scripts/warm-trace.py writes, request for request)
  shifting  40 models; the Zipf(1.0) ranking is drawn anew every hour (the
            hot set rotates) and the arrival rate follows the day (a sine,
            0.2x at night to 1.8x at its peak)
  scan      the zipf trace's 20 hot models, and one request in ten goes to a
            model asked for once and never again (a scan through a long
            tail: REQUESTS/10 models of their own)
  bursts    the zipf trace's 20 models, and every 10 minutes on average one of
            40 cold models gets a burst: 20-60 requests within 5 seconds

Usage: traces.py KIND DIR [REQUESTS] [--same-costs] [--seed N]
(--same-costs: every load 60 s, every wake 3 s; default seed 11)."""
import math
import os
import random
import sys


def model_line(name, same):
    size = random.randint(14, 18)
    load = 60.0 if same else random.uniform(30, 90)
    wake = 3.0 if same else random.uniform(0.5, 6)
    sleeping = random.choice([1, 2])
    return (
        f"- {{name: {name}, size: {size}Gi, loadTime: {load:.1f}s, "
        f"sleep: {{preset: vllm, sleepingSize: {sleeping}Gi, hostMemory: {size}Gi, wakeTime: {int(wake * 1000)}ms}}}}\n"
    )


def zipf_weights(n):
    """Zipf(1.0) weights over n models, the ranking shuffled."""
    order = list(range(n))
    random.shuffle(order)
    weights = [0.0] * n
    for rank, m in enumerate(order):
        weights[m] = 1 / (rank + 1)
    return weights


def registry(out, names, same):
    with open(os.path.join(out, "registry.yaml"), "w") as f:
        for name in names:
            f.write(model_line(name, same))


def zipf(out, requests, same):
    # The draws in the order warm-trace.py made them: its trace, exactly.
    names = [f"m{i}" for i in range(20)]
    registry(out, names, same)
    weights = zipf_weights(20)
    t = 0.0
    for _ in range(requests):
        t += random.expovariate(1.0)
        yield t, names[random.choices(range(20), weights=weights)[0]]


def shifting(out, requests, same):
    names = [f"m{i}" for i in range(40)]
    registry(out, names, same)
    weights, hour, t = zipf_weights(40), 0, 0.0
    for _ in range(requests):
        # Thinning: a Poisson process of rate 1.8/s, each arrival kept with
        # the day's rate over that (0.2-1.8 a second, 1 on average).
        while True:
            t += random.expovariate(1.8)
            rate = 1.0 + 0.8 * math.sin(2 * math.pi * t / 86400)
            if random.random() < rate / 1.8:
                break
        if int(t // 3600) != hour:
            hour = int(t // 3600)
            weights = zipf_weights(40)
        yield t, names[random.choices(range(40), weights=weights)[0]]


def scan(out, requests, same):
    hot = [f"m{i}" for i in range(20)]
    tail = [f"once{i}" for i in range(requests // 10)]
    registry(out, hot + tail, same)
    weights = zipf_weights(20)
    t, next_tail = 0.0, 0
    for _ in range(requests):
        t += random.expovariate(1.0)
        if random.random() < 0.1 and next_tail < len(tail):
            yield t, tail[next_tail]
            next_tail += 1
        else:
            yield t, hot[random.choices(range(20), weights=weights)[0]]


def bursts(out, requests, same):
    hot = [f"m{i}" for i in range(20)]
    cold = [f"cold{i}" for i in range(40)]
    registry(out, hot + cold, same)
    weights = zipf_weights(20)
    t, events, next_burst = 0.0, [], random.expovariate(1 / 600)
    while len(events) < requests:
        t += random.expovariate(1.0)
        while next_burst < t:
            model = random.choice(cold)
            for _ in range(random.randint(20, 60)):
                events.append((next_burst + random.uniform(0, 5), model))
            next_burst += random.expovariate(1 / 600)
        events.append((t, hot[random.choices(range(20), weights=weights)[0]]))
    events.sort()
    yield from events[:requests]


KINDS = {"zipf": zipf, "shifting": shifting, "scan": scan, "bursts": bursts}


def main():
    argv = sys.argv[1:]
    same = "--same-costs" in argv
    seed = 11
    if "--seed" in argv:
        seed = int(argv[argv.index("--seed") + 1])
        del argv[argv.index("--seed") : argv.index("--seed") + 2]
    args = [a for a in argv if not a.startswith("--")]
    if len(args) < 2 or args[0] not in KINDS:
        sys.exit(f"usage: traces.py {{{'|'.join(KINDS)}}} DIR [REQUESTS] [--same-costs] [--seed N]")
    kind, out = args[0], args[1]
    requests = int(args[2]) if len(args) > 2 else 100_000
    random.seed(seed)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "trace.csv"), "w") as f:
        f.write("time,model\n")
        for t, model in KINDS[kind](out, requests, same):
            f.write(f"{t:.3f},{model}\n")


if __name__ == "__main__":
    main()
