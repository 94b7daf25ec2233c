"""Training curves of one or more runs on one figure: a PNG to put in a report or a thesis.

    minitrain plot runs/flan-t5-small runs/flan-t5-base runs/t5-base --metric loss --out curves.png
    minitrain plot runs/a runs/b --metric loss,eval/rougeL --metric lr --smooth 0.9 --out curves.png

Each metric (`--metric`, repeatable or comma-separated; default `loss`) gets its own subplot,
stacked, sharing the x axis: the optimizer step. Any key of the runs' `metrics.jsonl` can be
plotted: `loss`, `lr`, `grad_norm`, `eval/loss`, `eval/rougeL`, ... Each run is named from its
`config.json` (model folder name, lr and LoRA r: `flan-t5-base lr=5e-05 r=16`), or by `--label`
(one per run, in order). `--smooth W` (0 <= W < 1) draws TensorBoard's debiased exponential
moving average with weight W over the faint raw curve (training loss is noisy; eval points are
few, and the lr schedule exact: those are never smoothed).

A run folder without metrics.jsonl, or a metric a run never logged, is one `error:` line (exit 2).
Needs matplotlib (`pip install 'minitrain[plot]'`); it draws with the Agg backend, no display.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Sequence


from minitrain.errors import UserError

DPI = 150
WIDTH_IN, HEIGHT_PER_METRIC_IN = 8.0, 3.0


def read_metrics(run: Path) -> list[dict]:
    """The rows of `run/metrics.jsonl` (one JSON object per logged optimizer step)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        what = "is not a folder" if not run.is_dir() else "holds no metrics.jsonl"
        raise UserError(f"{run}: {what} — pass the out folder of a run (python -m minitrain RECIPE.py out=...)")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise UserError(f"{path}:{n}: not JSON ({e}) — a run writes one JSON object per line; "
                            f"remove the broken line") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise UserError(f"{path}:{n}: no integer \"step\" — not a minitrain metrics line; remove it")
        rows.append(row)
    return rows


def series(rows: Sequence[dict], metric: str, run: Path) -> tuple[list[int], list[float]]:
    """(steps, values) of `metric` over the rows that logged it."""
    points = [(r["step"], float(r[metric])) for r in rows if isinstance(r.get(metric), (int, float))]
    if not points:
        keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and k != "step"})
        raise UserError(f"{run}: metrics.jsonl has no {metric!r} — choose among {', '.join(keys) or 'nothing'}"
                        + (" (eval/* needs eval_data)" if metric.startswith("eval/") else ""))
    steps, values = zip(*sorted(points))
    return list(steps), list(values)


def run_label(run: Path) -> str:
    """`<model folder name> lr=<lr> r=<lora_r>` from config.json; the folder name without one."""
    path = run / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return run.name
    if not isinstance(cfg, dict):
        return run.name
    parts = [Path(str(cfg["model"]).rstrip("/")).name if cfg.get("model") else run.name]
    if isinstance(cfg.get("lr"), (int, float)):
        parts.append(f"lr={cfg['lr']:g}")
    if isinstance(cfg.get("lora_r"), int):
        parts.append(f"r={cfg['lora_r']}")
    return " ".join(parts)


def labels_for(runs: Sequence[Path], given: Sequence[str] | None) -> list[str]:
    """`given` (one per run), else names from config.json, made unique with the folder name."""
    if given:
        if len(given) != len(runs):
            raise UserError(f"--label: {len(given)} labels for {len(runs)} runs — give one --label per run, in order")
        return list(given)
    names = [run_label(r) for r in runs]
    return [f"{n} ({r.name})" if names.count(n) > 1 else n for n, r in zip(names, runs)]


def ema(values: Sequence[float], weight: float) -> list[float]:
    """Debiased exponential moving average (TensorBoard's smoothing): the weighted mean of the
    values so far with weights weight**age, so the first point is not pulled towards 0.
    Non-finite values are skipped (their position repeats the running average)."""
    out, acc, norm = [], 0.0, 0.0
    for v in values:
        if math.isfinite(v):
            acc = weight * acc + (1 - weight) * v
            norm = weight * norm + (1 - weight)
        out.append(acc / norm if norm > 0 else float("nan"))
    return out


def split_metrics(given: Sequence[str] | None) -> list[str]:
    """`--metric a,b --metric c` -> [a, b, c] (default: loss), duplicates dropped."""
    names = [m.strip() for g in (given or ["loss"]) for m in g.split(",") if m.strip()]
    if not names:
        raise UserError("--metric: empty — name a key of metrics.jsonl, e.g. --metric loss,eval/rougeL")
    return list(dict.fromkeys(names))


def plot(runs: Sequence[Path], metrics: Sequence[str], out: Path, *, labels: Sequence[str] | None = None,
         smooth: float = 0.0, title: str | None = None, dpi: int = DPI) -> Path:
    """Draw `metrics` (one subplot each) of every run into `out` (PNG, or PDF / SVG by its suffix)."""
    if not 0.0 <= smooth < 1.0:
        raise UserError(f"--smooth {smooth:g}: must be in [0, 1) — e.g. --smooth 0.9 (0: off)")
    runs = [Path(r) for r in runs]
    names = labels_for(runs, labels)
    data = {r: read_metrics(r) for r in runs}
    curves = {(r, m): series(data[r], m, r) for m in metrics for r in runs}  # every error before drawing
    try:
        from matplotlib.figure import Figure  # the Agg canvas, no pyplot state and no display needed
    except ImportError:
        raise UserError("matplotlib: not installed — pip install 'minitrain[plot]'") from None

    fig = Figure(figsize=(WIDTH_IN, HEIGHT_PER_METRIC_IN * len(metrics)), dpi=dpi, layout="constrained")
    axes = fig.subplots(len(metrics), 1, sharex=True, squeeze=False)[:, 0]
    for ax, metric in zip(axes, metrics):
        for i, (run, name) in enumerate(zip(runs, names)):
            steps, values = curves[run, metric]
            color = f"C{i % 10}"
            sparse = metric.startswith("eval/") or len(steps) <= 20
            if smooth > 0 and not sparse and metric != "lr":  # the schedule is exact: never smoothed
                ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
                ax.plot(steps, ema(values, smooth), color=color, linewidth=1.8, label=name)
            else:
                ax.plot(steps, values, color=color, linewidth=1.8, label=name, marker="o" if sparse else None,
                        markersize=3)
        smoothed = smooth > 0 and metric != "lr" and not metric.startswith("eval/")
        ax.set_ylabel(metric + (f" (EMA {smooth:g})" if smoothed else ""))
        ax.grid(True, alpha=0.3)
        if metric == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    axes[-1].set_xlabel("optimizer step")
    axes[0].legend(loc="best", fontsize="small", frameon=False)
    fig.suptitle(title or f"{', '.join(metrics)} vs optimizer step")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="minitrain plot", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run folders (each with metrics.jsonl, config.json)")
    p.add_argument("--metric", action="append", help="metric(s) to plot, comma-separated or repeated (default: loss)")
    p.add_argument("--out", type=Path, default=Path("curves.png"), help="image file (default: curves.png)")
    p.add_argument("--label", action="append", help="name of a run in the legend, one per run in order")
    p.add_argument("--smooth", type=float, default=0.0, help="EMA weight in [0, 1) for dense curves (default: 0)")
    p.add_argument("--title", help="figure title (default: the metrics)")
    p.add_argument("--dpi", type=int, default=DPI, help=f"resolution (default: {DPI})")
    args = p.parse_args(argv)
    try:
        out = plot(args.runs, split_metrics(args.metric), args.out, labels=args.label, smooth=args.smooth,
                   title=args.title, dpi=args.dpi)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0

