#!/usr/bin/env python3
"""The warm tier's trace for `model-residency simulate` (docs/performance.md):
20 models of 14-18 GiB (a 64Gi budget holds 4), Zipf(1.0) popularity, cold
loads of 30-90 s and wakes of 0.5-6 s drawn uniformly per model, each model
sleeping at 1-2 GiB of VRAM with its size in host memory (vLLM level 1).
Writes DIR/registry.yaml and DIR/trace.csv; with --same-costs every model
loads in 60 s and wakes in 3 s. Usage: warm-trace.py DIR [REQUESTS] [--same-costs]

Kept for the commands in the docs: it is `traces.py zipf`, which also makes
the other traces."""
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
os.execv(sys.executable, [sys.executable, os.path.join(here, "traces.py"), "zipf", *sys.argv[1:]])
