#!/usr/bin/env python3
"""Plots of a `microspec bench` run, written next to its summary.json.

    benchmarks/plot_report.py results/gemma/summary.json

- speedup_by_category.png: speedup over ar per category and overall, one bar per method (the
  paper's Figure 3); the mean acceptance length is written above each bar.
- time_breakdown.png: where a generated token's time goes per method, in ms per token: prefill,
  draft backbone, draft LM head, target forward (its LM head separately), bookkeeping (Figure 4).
- study.png, for --sweep: acceptance length and tok/s against the swept setting (Figure 6); for
  --ablation: tok/s and acceptance length per ablation row (Table 2).
- coverage.png, when the summary names a coverage CSV (Figure 1b): coverage against vocabulary size.
  `microspec coverage`'s CSV (kind, param, category, steps, covered, coverage, mean_active): the
  rows of category "all", static top-K sets as a line and dynamic windows as points labelled
  W_max, at their mean active size. Other CSVs with a header row: long form, a size column
  (vocab_size, size, k, tokens, window or w_max), a `coverage` column and optionally a series
  column (series, method, vocabulary, source, category, dataset or model); or wide form, the size
  column then one numeric column per series. Coverage may be a fraction (0..1) or a percentage.

Exit status 0 on success, 2 for a bad summary or CSV, 3 when matplotlib is missing.
"""
import argparse
import csv
import json
import pathlib
import sys

SIZE_COLUMNS = ("vocab_size", "size", "k", "tokens", "window", "w_max", "vocabulary_size")
SERIES_COLUMNS = ("series", "method", "vocabulary", "source", "category", "dataset", "model")


def fail(message, status=2):
    print(f"plot_report.py: {message}", file=sys.stderr)
    sys.exit(status)


def load_matplotlib():
    try:
        import matplotlib
    except ImportError:
        fail("matplotlib is not installed (python3 -m pip install matplotlib, or run the bench with --no-plots)", 3)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def title_of(summary):
    run = summary.get("run", {})
    model = pathlib.Path(run.get("model", "")).name
    mode = "greedy" if run.get("greedy", True) else f"temperature {run.get('temperature')}"
    return f"{model}: {run.get('questions', '?')} prompts, up to {run.get('max_new_tokens', '?')} tokens, {mode}"


def plot_speedup(plt, summary, out):
    ref = summary["reference"]
    methods = [m for m in summary["methods"] if m["info"]["label"] != ref]
    if not methods:
        return None
    groups = list(summary["categories"]) + ["overall"]
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(groups) * max(1, len(methods)) ** 0.5 + 3), 5))
    width = 0.8 / len(methods)
    for k, m in enumerate(methods):
        xs, ys, labels = [], [], []
        for i, g in enumerate(groups):
            stats = m["overall"] if g == "overall" else m["by_category"].get(g)
            if not stats or stats["speedup"] <= 0:
                continue
            xs.append(i - 0.4 + width * (k + 0.5))
            ys.append(stats["speedup"])
            labels.append(f"{stats['mean_acceptance_length']:.2f}" if stats["steps"] else "")
        bars = ax.bar(xs, ys, width, label=m["info"]["label"])
        if len(methods) <= 6:
            for b, text in zip(bars, labels):
                if text:
                    ax.annotate(text, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                                fontsize=6, rotation=90)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=30, ha="right")
    ax.set_ylabel(f"speedup over {ref} (x, tok/s incl. prefill)")
    ax.set_title("Speedup per category (numbers: mean acceptance length)\n" + title_of(summary), fontsize=10)
    ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    fig.tight_layout()
    path = out / "speedup_by_category.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_breakdown(plt, summary, out):
    parts = [("prefill", "prefill", None), ("draft backbone", "draft_backbone_seconds", None),
             ("draft LM head", "draft_lm_head_seconds", None), ("target forward (excl. LM head)", None, "target_body"),
             ("target LM head", "target_lm_head_seconds", None), ("bookkeeping", "bookkeeping_seconds", None),
             ("other", None, "other")]
    methods = summary["methods"]
    if not methods:
        return None
    fig, ax = plt.subplots(figsize=(11, max(3.0, 1.2 + 0.5 * len(methods))))
    names = [m["info"]["label"] for m in methods]
    left = [0.0] * len(methods)
    for name, key, derived in parts + [("total (not split)", None, "total")]:
        widths = []
        for m in methods:
            g = m["overall"]
            tokens = max(1, g["new_tokens"])
            peer = m["info"]["peer"]
            if derived == "total":
                sec = g["wall_seconds"] if peer else 0.0
            elif peer:
                sec = 0.0
            elif key == "prefill":
                sec = g["prefill_seconds"]
            elif derived == "target_body":
                sec = g["target_seconds"] - g["target_lm_head_seconds"]
            elif derived == "other":
                sec = max(0.0, g["wall_seconds"] - g["prefill_seconds"] - g["draft_backbone_seconds"] -
                          g["draft_lm_head_seconds"] - g["target_seconds"] - g["bookkeeping_seconds"])
            else:
                sec = g[key]
            widths.append(1000.0 * sec / tokens)
        if any(w > 0 for w in widths):
            ax.barh(names, widths, left=left, label=name)
            left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("time per generated token (ms)")
    ax.set_title("Where the time goes\n" + title_of(summary), fontsize=10)
    ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
    fig.tight_layout()
    path = out / "time_breakdown.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def as_number(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def plot_study(plt, summary, out):
    studied = [m for m in summary["methods"] if m["info"]["study_key"]]
    if not studied:
        return None
    ref = next((m for m in summary["methods"] if m["info"]["label"] == summary["reference"]), None)
    key = studied[0]["info"]["study_key"]
    bases, values = [], []
    for m in studied:
        if m["info"]["base"] not in bases:
            bases.append(m["info"]["base"])
        if m["info"]["study_value"] not in values:
            values.append(m["info"]["study_value"])
    numeric = key != "ablation" and all(as_number(v) is not None for v in values)
    position = {v: (as_number(v) if numeric else i) for i, v in enumerate(values)}
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for b in bases:
        rows = sorted((m for m in studied if m["info"]["base"] == b), key=lambda m: position[m["info"]["study_value"]])
        xs = [position[m["info"]["study_value"]] for m in rows]
        ax1.plot(xs, [m["overall"]["mean_acceptance_length"] for m in rows], marker="o", label=b)
        ax2.plot(xs, [m["overall"]["tokens_per_second"] for m in rows], marker="s", label=b)
    if ref:
        ax2.axhline(ref["overall"]["tokens_per_second"], color="gray", linestyle=":", label=ref["info"]["label"])
    if not numeric:
        ax2.set_xticks(range(len(values)))
        ax2.set_xticklabels(values, rotation=15)
    ax2.set_xlabel(key if key != "ablation" else "ablation (draft-vocabulary candidate source, gather)")
    ax1.set_ylabel("mean acceptance length\n(tokens per step)")
    ax2.set_ylabel("tok/s (incl. prefill)")
    ax1.grid(True, alpha=0.3)
    ax2.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    ax1.set_title(f"Acceptance length and speed against {key}\n" + title_of(summary), fontsize=10)
    fig.tight_layout()
    path = out / "study.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def read_coverage(path):
    """Returns ({series: [(size, coverage fraction, point label)]}, x-axis name, series drawn as points)."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        fail(f"{path}: no rows")
    columns = list(rows[0].keys())
    if {"kind", "param", "category", "coverage", "mean_active"} <= set(columns):  # microspec coverage
        chosen = [r for r in rows if r["category"] == "all"] or rows
        series = {}
        for r in chosen:
            x, y = as_number(r["mean_active"]), as_number(r["coverage"])
            if x is None or y is None:
                fail(f"{path}: non-numeric mean_active/coverage in row {r}")
            name = {"static": "static top-K (frequency file)", "dynamic": "dynamic window (MicroSpec)"}.get(
                r["kind"], r["kind"])
            series.setdefault(name, []).append((x, y, f"W={r['param']}" if r["kind"] == "dynamic" else ""))
        return ({k: sorted(v) for k, v in series.items()}, "mean active rows",
                {"dynamic window (MicroSpec)"})
    lower = {c.lower().strip(): c for c in columns}
    size_col = next((lower[c] for c in SIZE_COLUMNS if c in lower), columns[0])
    series = {}
    if "coverage" in lower:
        cov_col = lower["coverage"]
        series_col = next((lower[c] for c in SERIES_COLUMNS if c in lower), None)
        for r in rows:
            x, y = as_number(r[size_col]), as_number(r[cov_col])
            if x is None or y is None:
                fail(f"{path}: non-numeric {size_col}/{cov_col} in row {r}")
            series.setdefault(r[series_col] if series_col else "coverage", []).append((x, y))
    else:
        for c in columns:
            if c == size_col:
                continue
            points = [(as_number(r[size_col]), as_number(r[c])) for r in rows]
            if all(x is not None and y is not None for x, y in points):
                series[c] = points
        if not series:
            fail(f"{path}: no numeric coverage columns next to {size_col}")
    top = max(y for pts in series.values() for _, y in pts)
    scale = 0.01 if top > 1.0 else 1.0
    return {k: sorted((x, y * scale, "") for x, y in v) for k, v in series.items()}, size_col, set()


def plot_coverage(plt, summary, summary_path, out):
    name = summary.get("coverage_csv")
    if not name:
        return None
    path = summary_path.parent / name
    if not path.exists():
        fail(f"{path}: coverage CSV named in the summary is missing")
    series, size_col, as_points = read_coverage(path)
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, pts in series.items():
        xs, ys = [x for x, _, _ in pts], [100 * y for _, y, _ in pts]
        if label in as_points:
            ax.scatter(xs, ys, marker="*", s=120, color="C3", label=label, zorder=3)
            for x, y, text in pts:
                ax.annotate(text, (x, 100 * y), textcoords="offset points", xytext=(5, -10), fontsize=8)
        else:
            ax.plot(xs, ys, marker=".", label=label)
    ax.set_xscale("log")
    ax.set_xlabel(f"draft vocabulary size ({size_col}, tokens, log scale)")
    ax.set_ylabel("coverage of the target's next tokens (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, which="both", alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    ax.set_title("Coverage against vocabulary size\n" + pathlib.Path(summary.get("run", {}).get("model", "")).name,
                 fontsize=10)
    fig.tight_layout()
    out_path = out / "coverage.png"
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("summary", help="summary.json written by `microspec bench`")
    ap.add_argument("-o", "--out", help="folder for the PNGs (default: the summary's folder)")
    args = ap.parse_args()
    summary_path = pathlib.Path(args.summary)
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
        summary["methods"], summary["reference"], summary["categories"]  # noqa: B018 (shape check)
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(f"{summary_path}: not a bench summary ({e})")
    out = pathlib.Path(args.out) if args.out else summary_path.parent
    out.mkdir(parents=True, exist_ok=True)
    plt = load_matplotlib()
    written = [plot_speedup(plt, summary, out), plot_breakdown(plt, summary, out), plot_study(plt, summary, out),
               plot_coverage(plt, summary, summary_path, out)]
    for p in written:
        if p:
            print(f"plot_report.py: wrote {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
