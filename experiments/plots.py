"""The paper's figures drawn from `config_runner` results (matplotlib, the paper's axes and labels)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server or in CI
    import matplotlib.pyplot as plt

    return plt


def _metric(run: dict[str, Any], metric: str) -> dict[str, float]:
    return {r["title"]: r[metric] for r in run["results"] if r.get(metric) is not None}


def grouped_bars(runs: list[dict[str, Any]], metric: str, ylabel: str, title: str, path: Path,
                 higher_is_better: bool = True) -> Path:
    """One group per workload, one bar per run, each group normalized to its best run (as Figs. 5/6/8c):
    the best run is 1, the others below it (higher is better) or above it (lower is better)."""
    plt = _pyplot()
    workloads = [r["title"] for r in runs[0]["results"]]
    values = np.array([[_metric(run, metric).get(w, np.nan) for w in workloads] for run in runs])
    best = np.nanmax(values, axis=0) if higher_is_better else np.nanmin(values, axis=0)
    normalized = values / best
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(workloads) + 2), 3.6))
    x = np.arange(len(workloads))
    for i, run in enumerate(runs):
        ax.bar(x + (i - (len(runs) - 1) / 2) * width, normalized[i], width, label=run["label"])
    ax.set_xticks(x, workloads, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.05 if higher_is_better else 1.05 * float(np.nanmax(normalized)))
    ax.set_title(title, fontsize=10)
    # Beside the axes, not over them: with 7 runs (Fig. 8c) a legend inside covered the bars.
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def hit_rate_sweep(runs: list[dict[str, Any]], title: str, path: Path) -> Path:
    """Fig. 8(a)(b): throughput, latency and batch size against the achieved cache hit rate."""
    plt = _pyplot()
    workloads = [r["title"] for r in runs[0]["results"]]
    panels = [("throughput", "Throughput (programs/s)"), ("latency_s", "Latency (s)"),
              ("mean_batch_size", "Batch size")]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for ax, (metric, label) in zip(axes, panels):
        for w in workloads:
            points = sorted((100 * _metric(run, "hit_rate")[w], _metric(run, metric).get(w, np.nan)) for run in runs)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=w)
        ax.set_xlabel("Cache hit rate (%)")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def achieved_vs_optimal(run: dict[str, Any], title: str, path: Path) -> Path:
    """Fig. 13: the achieved cache hit rate beside the optimum (Theorem 3.1) per workload."""
    plt = _pyplot()
    workloads = [r["title"] for r in run["results"]]
    achieved = [100 * r["hit_rate"] for r in run["results"]]
    optimal = [100 * r["optimal_hit_rate"] for r in run["results"]]
    x = np.arange(len(workloads))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(workloads) + 2), 3.6))
    ax.bar(x - 0.2, achieved, 0.4, label="Achieved cache hit rate with jsgl", color="tab:orange")
    ax.bar(x + 0.2, optimal, 0.4, label="Optimal cache hit rate", color="tab:blue", alpha=0.6)
    ax.set_xticks(x, workloads, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("Cache hit rate (%)")
    ax.set_ylim(0, 110)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper center", ncols=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
