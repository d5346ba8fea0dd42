#!/usr/bin/env python3
"""Waiting on the traces of traces.py, per policy (lru, cost, rate): the table in
docs/performance.md ("Waiting on four traces"). Makes each trace under DIR
(kept when there), replays it with `model-residency simulate` on a 64Gi GPU
under each policy, and prints one markdown table per trace, with each
policy's waiting as a ratio to the seed's LRU and to `cost` + the warm tier.

With --disk Q every policy runs with that disk tier for artifacts (a load
whose artifact is not on disk waits for its fetch: --fetch S seconds per
GiB, default 1.5, the node agent's own figure), and the tables gain the
fetches.

With --ceilings two more rows: `rate` + warm with each model's share known
(the rates the trace was drawn with, traces.py's rates.csv) and clairvoyant
(each model's next request known): how much of the waiting left is the rate
estimate's and how much its keys'. Measurements, not policies.

--kinds K,K,... replays only those kinds (default: all of traces.py's, the
four and the three held out: mixed, flat, steep).

Usage: trace-table.py BINARY DIR [REQUESTS] [--host 256Gi] [--disk Q [--fetch S]] [--ceilings] [--kinds K,...]"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = ["zipf", "shifting", "scan", "bursts", "mixed", "flat", "steep"]


def main():
    argv = sys.argv[1:]
    def option(name, default):
        if name not in argv:
            return default
        i = argv.index(name)
        value = argv[i + 1]
        del argv[i : i + 2]
        return value

    kinds = option("--kinds", ",".join(KINDS)).split(",")
    ceilings = "--ceilings" in argv
    if ceilings:
        argv.remove("--ceilings")
    host = option("--host", "256Gi")
    disk = option("--disk", None)
    fetch = option("--fetch", None)
    extra = []
    if disk:
        extra = ["--disk-budget", disk] + (["--fetch-seconds-per-gib", fetch] if fetch else [])
    if len(argv) < 2:
        sys.exit(__doc__)
    binary, root = argv[0], argv[1]
    requests = argv[2] if len(argv) > 2 else "100000"
    policies = [
        ("seed LRU", []),
        ("`cost`", ["--eviction", "cost"]),
        ("`rate`", ["--eviction", "rate"]),
        (f"LRU + warm ({host})", ["--warm-budget", host]),
        (f"`cost` + warm ({host})", ["--eviction", "cost", "--warm-budget", host]),
        (f"`rate` + warm ({host})", ["--eviction", "rate", "--warm-budget", host]),
    ]
    for kind in kinds:
        out = os.path.join(root, f"{kind}-{requests}")
        if not os.path.exists(os.path.join(out, "rates.csv")):
            subprocess.run([sys.executable, os.path.join(HERE, "traces.py"), kind, out, requests], check=True)
        rate_warm = ["--eviction", "rate", "--warm-budget", host]
        known = [
            (f"`rate` + warm, rates known (ceiling)", rate_warm + ["--known-rates", os.path.join(out, "rates.csv")]),
            (f"`rate` + warm, clairvoyant (ceiling)", rate_warm + ["--clairvoyant"]),
        ] if ceilings else []
        rows = []
        for name, flags in policies + known:
            cmd = [binary, "simulate", "--budget", "64Gi", "--registry", os.path.join(out, "registry.yaml"),
                   "--trace", os.path.join(out, "trace.csv"), "--output", "json", *flags, *extra]
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            rows.append((name, r))
        lru = rows[0][1]["wait_seconds"]
        cost_warm = next(r for name, r in rows if name.startswith("`cost` + warm"))["wait_seconds"]
        disk_note = f", disk {disk}" if disk else ""
        print(f"\n{kind} ({requests} requests{disk_note})\n")
        fetch_head = " fetches | fetching (s) |" if disk else ""
        print(f"| policy | loads | wakes | sleeps | hits |{fetch_head} waiting (s) | vs seed LRU | vs `cost` + warm | over budget |")
        print("|---|---|---|---|---|" + ("---|---|" if disk else "") + "---|---|---|---|")
        for name, r in rows:
            w = r["wait_seconds"]
            fetched = f" {r['fetches']:,} | {r['fetch_seconds']:,.0f} |" if disk else ""
            print(f"| {name} | {r['loads']:,} | {r['wakes']:,} | {r['sleeps']:,} | {r['hits']:,} |{fetched} {w:,.0f} | "
                  f"{lru / w:.2f}x | {cost_warm / w:.2f}x | {r['over_budget_steps']} |")


if __name__ == "__main__":
    main()
