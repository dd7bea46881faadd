"""Plot accumulated weighted work over time per policy (matplotlib, optional dependency)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from unicron.errors import UsageError
from unicron.plan.simulate import SimResult


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise UsageError("--plot needs matplotlib (pip install 'unicron[plot]')") from exc
    return plt


def check_plot_path(path: Path) -> None:
    """Before a simulation runs: ``path`` is a file to be, with a suffix naming a format
    matplotlib writes (27C F8: "x.txt" was an internal error after the whole simulation, and
    "/tmp" or "pd" silently became "/tmp.png", "pd.png")."""
    plt = _pyplot()
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    if path.is_dir():
        raise UsageError(f"--plot: {path} is a directory")
    if path.suffix.lower().lstrip(".") not in formats:
        raise UsageError(f"--plot: {path} does not end in a suffix of an image format "
                         f"({', '.join('.' + f for f in sorted(formats))})")


def plot_simulation(result: SimResult, path: Path, title: str = "") -> None:
    check_plot_path(path)
    plt = _pyplot()
    hours = 3600.0
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([0, result.duration_s / hours], [0, result.bound], color="grey", linestyle=":", label="upper bound")
    ax.plot([0, result.duration_s / hours], [0, result.no_failure], color="black", linestyle="--",
            label="as placed, no failure")
    for policy in result.policies:
        ax.plot([t / hours for t, _ in policy.timeline], [w for _, w in policy.timeline],
                drawstyle="default", label=policy.name)
    ax.set_xlabel("hours")
    ax.set_ylabel("accumulated weighted work")
    # Wrapped, never cut: a trace's source line can be long.
    ax.set_title(textwrap.fill(title or f"{result.events} failure/recovery events", 100), fontsize=9)
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as exc:
        raise UsageError(f"--plot: cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)
