#!/usr/bin/env python3
"""Turn stepfuse-bench (and bench/peers) JSON output into a throughput chart (PNG).

    python3 scripts/plot_bench.py --out bench.png gpt2.json resnet50.json peers-gpt2.json ...

Each input file is either a `stepfuse-bench --json FILE` report (one preset: fused,
unfused, optionally interpreted, and the bandwidth measured in the same run) or a
`bench/peers/run.sh --json FILE` report (not --overhead) (one preset: stepfuse and each peer, timed
interleaved in one process). Files for the same preset are drawn as one group of bars.

Every bar is effective throughput: the bytes an optimizer step must move (stepfuse's
byte model, e.g. 32 B/param for fp32 AdamW with clipping: one read of the gradients for
the reduce pass, then 4 reads and 3 writes per parameter) divided by the median step
time. The black tick over each group is the Adam-like bandwidth (4 reads, 3 writes)
measured by stepfuse-bench in the same run: the roofline a step cannot beat.

Needs matplotlib (pip install matplotlib).
"""

import argparse
import json
import sys


def load(path):
    with open(path) as f:
        report = json.load(f)
    tool = report.get("tool", "")
    if tool == "stepfuse-bench":
        cfg = report["config"]
        preset = cfg.get("preset") or cfg.get("shapes") or "custom"
        bars = {}
        for mode, label in (("fused", "stepfuse fused"), ("unfused", "stepfuse unfused"),
                            ("interpreted", "stepfuse interpreted")):
            if isinstance(report.get(mode), dict) and "gbs" in report[mode]:
                bars[label] = report[mode]["gbs"]
        roof = report.get("bandwidth", {}).get("adam_like", {}).get("gbs_median")
        return preset, bars, roof, report
    if tool == "bench/peers/peers.py" and report.get("mode") == "peers":
        bars = {}
        for name, peer in report["peers"].items():
            if peer.get("status") == "ok" and peer.get("gbs") is not None:
                bars["stepfuse (peers run)" if name == "stepfuse" else name] = peer["gbs"]
        return report.get("preset") or "custom", bars, None, report
    sys.exit(f"plot_bench.py: {path}: not a stepfuse-bench or bench/peers JSON report (tool = {tool!r})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="JSON files from stepfuse-bench --json or bench/peers --json")
    ap.add_argument("--out", default="bench.png", help="PNG to write (default: bench.png)")
    ap.add_argument("--title", default=None, help="chart title (default: machine and thread count from the reports)")
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_bench.py: matplotlib is missing: pip install matplotlib")

    groups = {}  # preset -> {label: GB/s}, roofline
    order = []
    meta = []
    for path in args.reports:
        preset, bars, roof, report = load(path)
        if preset not in groups:
            groups[preset] = {"bars": {}, "roof": None}
            order.append(preset)
        groups[preset]["bars"].update(bars)
        if roof is not None:
            groups[preset]["roof"] = roof
        meta.append(report)

    labels = []
    for p in order:
        for label in groups[p]["bars"]:
            if label not in labels:
                labels.append(label)
    # stepfuse first, then the peers in the order they appear.
    labels.sort(key=lambda l: (0 if l.startswith("stepfuse fused") else 1 if l.startswith("stepfuse") else 2))

    width = 0.8 / max(1, len(labels))
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(order) + 2), 4.5))
    for i, label in enumerate(labels):
        xs, ys = [], []
        for g, p in enumerate(order):
            if label in groups[p]["bars"]:
                xs.append(g - 0.4 + width * (i + 0.5))
                ys.append(groups[p]["bars"][label])
        bars = ax.bar(xs, ys, width, label=label)
        for x, y in zip(xs, ys):
            ax.text(x, y, f"{y:.1f}", ha="center", va="bottom", fontsize=7)
    roof_drawn = False
    for g, p in enumerate(order):
        roof = groups[p]["roof"]
        if roof is not None:
            ax.hlines(roof, g - 0.45, g + 0.45, colors="black", linewidth=2,
                      label=None if roof_drawn else "measured Adam-like bandwidth (roofline)")
            roof_drawn = True
    ax.set_xticks(range(len(order)))
    ax.set_xticklabels(order)
    ax.set_ylabel("effective GB/s (bytes the step must move / time)")
    threads = sorted({str(r.get("threads")) for r in meta if r.get("threads") is not None})
    target = sorted({r.get("cpu_target") for r in meta if r.get("cpu_target")})
    ax.set_title(args.title or f"AdamW + clip + loss scale, fp32 · CPU {', '.join(target)} · "
                               f"{'/'.join(threads)} thread(s)", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4, frameon=False)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.1)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
