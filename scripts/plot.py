#!/usr/bin/env python3
"""Minimal SVG line plot (stdlib only) for docs/performance.md.

usage: plot.py OUT.svg "TITLE" "X LABEL" "Y LABEL" x1,y1 x2,y2 ... [--logx] [--logy]
"""
import math
import sys


def main(argv):
    out, title, xlabel, ylabel, *rest = argv
    logx = "--logx" in rest
    logy = "--logy" in rest
    points = [tuple(map(float, p.split(","))) for p in rest if not p.startswith("--")]
    fx = (lambda v: math.log10(v)) if logx else (lambda v: v)
    fy = (lambda v: math.log10(v)) if logy else (lambda v: v)
    xs = [fx(x) for x, _ in points]
    ys = [fy(y) for _, y in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = (min(ys), max(ys)) if logy else (0.0, max(ys) * 1.15)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y1 = y0 + 1
    w, h, left, right, top, bottom = 560, 340, 70, 20, 40, 50
    px = lambda v: left + (v - x0) / (x1 - x0) * (w - left - right)
    py = lambda v: h - bottom - (v - y0) / (y1 - y0) * (h - top - bottom)
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w/2}" y="22" text-anchor="middle" font-size="14">{title}</text>',
           f'<line x1="{left}" y1="{h-bottom}" x2="{w-right}" y2="{h-bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h-bottom}" stroke="black"/>',
           f'<text x="{w/2}" y="{h-12}" text-anchor="middle">{xlabel}</text>',
           f'<text x="16" y="{h/2}" text-anchor="middle" transform="rotate(-90 16 {h/2})">{ylabel}</text>']
    for (x, y), vx, vy in zip(points, xs, ys):
        svg.append(f'<line x1="{px(vx)}" y1="{h-bottom}" x2="{px(vx)}" y2="{h-bottom+5}" stroke="black"/>')
        svg.append(f'<text x="{px(vx)}" y="{h-bottom+18}" text-anchor="middle">{x:g}</text>')
        svg.append(f'<circle cx="{px(vx)}" cy="{py(vy)}" r="4" fill="#1f77b4"/>')
        svg.append(f'<text x="{px(vx)+6}" y="{py(vy)-8}">{y:g}</text>')
    path = " ".join(f"{'M' if i == 0 else 'L'}{px(vx):.1f},{py(vy):.1f}" for i, (vx, vy) in enumerate(zip(xs, ys)))
    svg.append(f'<path d="{path}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
    svg.append("</svg>")
    with open(out, "w") as f:
        f.write("\n".join(svg) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
