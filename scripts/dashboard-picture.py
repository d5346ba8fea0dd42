#!/usr/bin/env python3
"""The dashboard's main panel as an SVG (stdlib only), from the Prometheus
answers `model-residency demo --dashboard-data DIR` saves: the VRAM each
model held on one GPU over the run, stacked, against the GPU's budget (the
GPU with the most samples, or RESIDENCY).

usage: dashboard-picture.py DIR OUT.svg [RESIDENCY]
"""
import json
import sys

COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948",
          "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"]


def series(path):
    with open(path) as f:
        answer = json.load(f)
    if answer.get("status") != "success":
        sys.exit(f"{path}: Prometheus said {answer.get('error')}")
    for s in answer["data"]["result"]:
        yield s["metric"], {int(float(t)): float(v) for t, v in s["values"]}


def main(folder, out, residency=None):
    vram = list(series(f"{folder}/vram.json"))
    budgets = list(series(f"{folder}/budget.json"))
    if not vram:
        sys.exit("no VRAM series in the saved data")
    if residency is None:
        samples = {}
        for labels, points in vram:
            r = labels.get("residency")
            samples[r] = samples.get(r, 0) + len(points)
        residency = max(samples, key=samples.get)
    vram = [s for s in vram if s[0].get("residency") == residency]
    budgets = [s for s in budgets if s[0].get("residency") == residency]
    times = sorted({t for _, points in vram + budgets for t in points})
    t0, t1 = times[0], times[-1]
    top = max([max(p.values()) for _, p in budgets] +
              [sum(p.get(t, 0) for _, p in vram) for t in times])
    top *= 1.1
    w, h, left, right, up, bottom = 760, 380, 80, 230, 40, 50
    px = lambda t: left + (t - t0) / max(t1 - t0, 1) * (w - left - right)
    py = lambda v: h - bottom - v / top * (h - up - bottom)
    gib = 1 << 30
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{(w - right) / 2 + left / 2}" y="22" text-anchor="middle" font-size="14">'
           f'VRAM of GPU {residency}: what each model holds against its budget (a demo run)</text>',
           f'<line x1="{left}" y1="{h-bottom}" x2="{w-right}" y2="{h-bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="{up}" x2="{left}" y2="{h-bottom}" stroke="black"/>',
           f'<text x="{(w - right + left) / 2}" y="{h-12}" text-anchor="middle">seconds into the run</text>']
    step = max(1, round(top / gib / 5))
    for g in range(0, int(top / gib) + 1, step):
        svg.append(f'<text x="{left-6}" y="{py(g * gib) + 4}" text-anchor="end">{g} GiB</text>')
        svg.append(f'<line x1="{left}" y1="{py(g * gib)}" x2="{w-right}" y2="{py(g * gib)}" stroke="#eee"/>')
    for s in range(0, t1 - t0 + 1, max(1, (t1 - t0) // 6)):
        svg.append(f'<text x="{px(t0 + s)}" y="{h-bottom+16}" text-anchor="middle">{s}</text>')
    base = {t: 0.0 for t in times}
    vram.sort(key=lambda s: (s[0].get("residency", ""), s[0].get("model", ""), s[0].get("state", "")))
    for i, (labels, points) in enumerate(vram):
        lower = [(t, base[t]) for t in times]
        upper = [(t, base[t] + points.get(t, 0.0)) for t in times]
        for t in times:
            base[t] += points.get(t, 0.0)
        outline = upper + list(reversed(lower))
        d = " ".join(f"{'M' if k == 0 else 'L'}{px(t):.1f},{py(v):.1f}" for k, (t, v) in enumerate(outline)) + " Z"
        color = COLORS[i % len(COLORS)]
        svg.append(f'<path d="{d}" fill="{color}" fill-opacity="0.8" stroke="none"/>')
        name = f'{labels.get("model", "?")} ({labels.get("state", "?")})'
        y = up + 16 * i
        svg.append(f'<rect x="{w-right+10}" y="{y}" width="10" height="10" fill="{color}"/>')
        svg.append(f'<text x="{w-right+26}" y="{y+9}">{name}</text>')
    for labels, points in budgets:
        ts = sorted(points)
        d = " ".join(f"{'M' if k == 0 else 'L'}{px(t):.1f},{py(points[t]):.1f}" for k, t in enumerate(ts))
        svg.append(f'<path d="{d}" fill="none" stroke="black" stroke-width="2" stroke-dasharray="6 3"/>')
        y = up + 16 * len(vram)
        svg.append(f'<line x1="{w-right+10}" y1="{y+5}" x2="{w-right+20}" y2="{y+5}" stroke="black" stroke-width="2" stroke-dasharray="3 2"/>')
        svg.append(f'<text x="{w-right+26}" y="{y+9}">budget</text>')
        break
    svg.append("</svg>")
    with open(out, "w") as f:
        f.write("\n".join(svg) + "\n")


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    main(*sys.argv[1:])
