#!/usr/bin/env python3
"""Traces for `model-residency simulate` beyond one Zipf (docs/performance.md,
"Waiting on four traces"). Each writes DIR/registry.yaml and DIR/trace.csv.

Every trace's models but mixed's are 14-18 GiB (a 64Gi budget holds 4 awake), load in
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

Held out (added after `--eviction rate`'s constants were fixed, to try it on
traces it was not tuned on; the four above draw exactly as before):

  mixed     30 models of 2-48 GiB (log-uniform), loading in 10 s + 1.5 s a
            GiB and waking in 0.3 s + 0.1 s a GiB; Zipf(1.0)
  flat      40 models, a flatter Zipf(0.7)
  steep     60 models, a steeper Zipf(1.3)

Each also writes DIR/rates.csv, `row,model,share`: from request `row` (from
0) on, the probability that a request is for `model`, as the trace was drawn
(`simulate --known-rates`, a ceiling of `--eviction rate`).

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


def sized_line(name, size):
    """A model whose load and wake grow with its size (a held-out trace's)."""
    load = 10 + 1.5 * size
    wake = 0.3 + 0.1 * size
    sleeping = random.choice([1, 2]) if size > 2 else 1
    return (
        f"- {{name: {name}, size: {size}Gi, loadTime: {load:.1f}s, "
        f"sleep: {{preset: vllm, sleepingSize: {sleeping}Gi, hostMemory: {size}Gi, wakeTime: {int(wake * 1000)}ms}}}}\n"
    )


def zipf_weights(n, skew=1.0):
    """Zipf(skew) weights over n models, the ranking shuffled."""
    order = list(range(n))
    random.shuffle(order)
    weights = [0.0] * n
    for rank, m in enumerate(order):
        weights[m] = 1 / (rank + 1) ** skew
    return weights


def shares(rates, row, names, weights, scale=1.0):
    """From `row` on, each of `names` is its weight's share (times `scale`)."""
    total = sum(weights)
    for name, w in zip(names, weights):
        rates.append((row, name, scale * w / total))


def registry(out, names, same):
    with open(os.path.join(out, "registry.yaml"), "w") as f:
        for name in names:
            f.write(model_line(name, same))


def zipf(out, requests, same, rates):
    # The draws in the order warm-trace.py made them: its trace, exactly.
    names = [f"m{i}" for i in range(20)]
    registry(out, names, same)
    yield from popular(requests, rates, names, zipf_weights(20))


def shifting(out, requests, same, rates):
    names = [f"m{i}" for i in range(40)]
    registry(out, names, same)
    weights, hour, t = zipf_weights(40), 0, 0.0
    shares(rates, 0, names, weights)
    for row in range(requests):
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
            shares(rates, row, names, weights)
        yield t, names[random.choices(range(40), weights=weights)[0]]


def scan(out, requests, same, rates):
    hot = [f"m{i}" for i in range(20)]
    tail = [f"once{i}" for i in range(requests // 10)]
    registry(out, hot + tail, same)
    weights = zipf_weights(20)
    # The tail is a tenth of the requests while it lasts, each model of it
    # asked for once: after its row, never.
    shares(rates, 0, hot, weights, 0.9)
    t, next_tail = 0.0, 0
    for row in range(requests):
        t += random.expovariate(1.0)
        if random.random() < 0.1 and next_tail < len(tail):
            rates.append((row + 1, tail[next_tail], 0.0))
            yield t, tail[next_tail]
            next_tail += 1
        else:
            yield t, hot[random.choices(range(20), weights=weights)[0]]


def bursts(out, requests, same, rates):
    hot = [f"m{i}" for i in range(20)]
    cold = [f"cold{i}" for i in range(40)]
    registry(out, hot + cold, same)
    weights = zipf_weights(20)
    t, events, next_burst, drawn = 0.0, [], random.expovariate(1 / 600), []
    while len(events) < requests:
        t += random.expovariate(1.0)
        while next_burst < t:
            model = random.choice(cold)
            n = random.randint(20, 60)
            drawn.append((next_burst, model, n))
            for _ in range(n):
                events.append((next_burst + random.uniform(0, 5), model))
            next_burst += random.expovariate(1 / 600)
        events.append((t, hot[random.choices(range(20), weights=weights)[0]]))
    events.sort()
    events = events[:requests]
    burst_rates(rates, events, hot, weights, drawn)
    yield from events


def burst_rates(rates, events, hot, weights, drawn):
    """The hot models come at one a second in all; a burst of n adds n/5 a
    second for its 5 s: each model's share is its part of the sum, changing
    at the first row after a burst starts or ends."""
    edges = sorted([(start, +1, model, n) for start, model, n in drawn] +
                   [(start + 5, -1, model, n) for start, model, n in drawn])
    active, e = {}, 0
    shares(rates, 0, hot, weights)
    for row, (t, _) in enumerate(events):
        changed = False
        while e < len(edges) and edges[e][0] <= t:
            _, sign, model, n = edges[e]
            active[model] = active.get(model, 0.0) + sign * n / 5
            if active[model] <= 1e-9:
                del active[model]
                rates.append((row, model, 0.0))
            changed, e = True, e + 1
        if changed:
            total = 1.0 + sum(active.values())
            shares(rates, row, hot, weights, 1.0 / total)
            for model, rate in active.items():
                rates.append((row, model, rate / total))


def popular(requests, rates, names, weights):
    """Poisson arrivals, one a second, each for a model by `weights`."""
    shares(rates, 0, names, weights)
    t = 0.0
    for _ in range(requests):
        t += random.expovariate(1.0)
        yield t, names[random.choices(range(len(names)), weights=weights)[0]]


def mixed(out, requests, same, rates):
    # Held out: 30 models of 2-48 GiB (log-uniform), each loading in
    # 10 s + 1.5 s a GiB and waking in 0.3 s + 0.1 s a GiB; Zipf(1.0).
    names = [f"m{i}" for i in range(30)]
    sizes = [round(2 * 24 ** random.random()) for _ in names]
    with open(os.path.join(out, "registry.yaml"), "w") as f:
        for name, size in zip(names, sizes):
            f.write(model_line(name, True) if same else sized_line(name, size))
    yield from popular(requests, rates, names, zipf_weights(30))


def flat(out, requests, same, rates):
    # Held out: 40 models, a flatter Zipf(0.7) popularity.
    names = [f"m{i}" for i in range(40)]
    registry(out, names, same)
    yield from popular(requests, rates, names, zipf_weights(40, 0.7))


def steep(out, requests, same, rates):
    # Held out: 60 models, a steeper Zipf(1.3) popularity.
    names = [f"m{i}" for i in range(60)]
    registry(out, names, same)
    yield from popular(requests, rates, names, zipf_weights(60, 1.3))


KINDS = {"zipf": zipf, "shifting": shifting, "scan": scan, "bursts": bursts,
         "mixed": mixed, "flat": flat, "steep": steep}


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
    rates = []
    with open(os.path.join(out, "trace.csv"), "w") as f:
        f.write("time,model\n")
        for t, model in KINDS[kind](out, requests, same, rates):
            f.write(f"{t:.3f},{model}\n")
    rates.sort(key=lambda r: r[0])
    with open(os.path.join(out, "rates.csv"), "w") as f:
        f.write("row,model,share\n")
        for row, model, share in rates:
            f.write(f"{row},{model},{share:.6g}\n")


if __name__ == "__main__":
    main()
