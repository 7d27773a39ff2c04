"""The live convergence matrix's curves as a PNG (benchmarks/convergence_swarm.py ``--plot``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(cells: list[dict[str, Any]], out: Path) -> str:
    """The cells' worst-chain curves (and one process's) against samples, one panel per partition."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "not written: matplotlib is missing (pip install -e '.[plots]')"
    partitions = sorted({c["partition"] for c in cells})
    fig, axes = plt.subplots(1, len(partitions), figsize=(7 * len(partitions), 5), squeeze=False)
    for ax, partition in zip(axes[0], partitions):
        for cell in (c for c in cells if c["partition"] == partition and c.get("curve")):
            xs, ys = zip(*[(row[0], row[1]) for row in cell["curve"]])
            ax.plot(xs, ys, label=cell["label"], linewidth=1)
        ax.set(title=f"digits, {partition}: worst chain's true test accuracy", xlabel="run-wide samples",
               ylabel="test accuracy", ylim=(0, 1))
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return str(out)
