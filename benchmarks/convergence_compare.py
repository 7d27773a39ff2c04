"""benchmarks.convergence_swarm's comparisons: its cells' curves against one process's at equal samples, combined
over runs, and when a cell counts as diverged."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from benchmarks.common import ratio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from copies import CopyOracle  # noqa: E402

# a digits cell diverged when its worst chain ends near chance (0.1), or below half its own best: a shard of 5 of
# the 10 classes without averaging tops out near 0.5, which is no divergence
DIVERGED_ACCURACY = 0.2
DIVERGED_BPB = 7.5  # charlm starts at ~8.1 bits per byte (uniform over 256 bytes: 8)
# The language-model runs (configs/runs/*.yaml): their model, data and batch, cut into ``--stages`` stages. Their
# figure is the test loss in bits per byte of text (a token's loss over the bytes it stands for), over one process's
# at equal sequences; diverged at DIVERGED_BPB / 8 of chance (a uniform guess over the vocabulary).
LM_RUNS = ("charlm", "llm-tiny")


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell from its repeated runs: the first run's figures, and with repeats the mean ratio at each point
    every run reached (``ratios``), their range (``ratio_ranges``) and every run (``runs``)."""
    good = [r for r in runs if "error" not in r]
    if len(runs) == 1 or not good:
        return dict(runs[0])
    cell = dict(good[0])
    points = set.intersection(*(set(r.get("ratios", {})) for r in good))
    cell["ratios"] = {p: round(sum(r["ratios"][p] for r in good) / len(good), 4) for p in sorted(points, key=int)}
    cell["ratio_ranges"] = {p: [min(r["ratios"][p] for r in good), max(r["ratios"][p] for r in good)] for p in cell["ratios"]}
    windows = set.intersection(*(set(r.get("window_ratios", {})) for r in good))
    cell["window_ratios"] = {p: round(sum(r["window_ratios"][p] for r in good) / len(good), 4)
                             for p in sorted(windows, key=int)}
    cell["runs"] = runs
    cell["lost"] = sum(r.get("lost", 0) for r in good)
    cell["heals"] = sum(r.get("heals", 0) for r in good)
    cell["penalties"] = {k: sum(r.get("penalties", {}).get(k, 0) for r in good) for k in good[0].get("penalties", {})}
    for key, worst in (("final_accuracy_min", min), ("final_bits_per_byte_max", max)):  # diverged in any run
        finals = [r[key] for r in good if r.get(key) is not None]
        if key in cell:
            cell[key] = worst(finals) if finals else None
    return cell


def bits_per_byte(oracle: CopyOracle) -> float:
    """A language-model chain's test loss in bits per byte (swarm.run.local.evaluate, as one process is measured)."""
    from swarm.run.local import evaluate
    from swarm.run.models import bits_per_char

    return bits_per_char(evaluate(oracle.stages, oracle.dataset, oracle.run.model)[1], oracle.dataset.bytes_per_token)


def _chance_bits(run: str) -> float:
    """Bits per byte of a uniform guess over a language-model run's vocabulary (8 for charlm's bytes; llm-tiny's
    log2(2048) bits per token over the bytes a token stands for)."""
    if run not in LM_RUNS:
        return 8.0
    import math

    from benchmarks.common import load_run_config
    from swarm.run.data import load_dataset

    run_config = load_run_config(Path(__file__).resolve().parents[1] / "configs" / "runs" / f"{run}.yaml")
    data = load_dataset(run_config.data, run_config.model)
    return math.log2(run_config.model.vocab_size) / data.bytes_per_token



def _diverged(cell: dict[str, Any], lm: bool, chance_bits: float = 8.0) -> bool:
    """Digits: the worst chain near chance at the end, or below half the cell's best; a language model: no better
    than DIVERGED_BPB / 8 of chance."""
    if lm:
        final = cell.get("final_bits_per_byte_max")
        return final is None or not final < DIVERGED_BPB / 8.0 * chance_bits
    final = cell.get("final_accuracy_min")
    best = max((row[1] for row in cell.get("curve") or []), default=0.0)
    return final is None or final <= DIVERGED_ACCURACY or final < 0.5 * best


def _rate(curve: list[tuple[int, float, float, int]]) -> float | None:
    """Samples per second between the first and the last sample (training began before the first one)."""
    if len(curve) < 2 or curve[-1][2] <= curve[0][2]:
        return None
    return (curve[-1][0] - curve[0][0]) / (curve[-1][2] - curve[0][2])


class LocalBaseline:
    """One process (swarm.run.local.train_local) at exact sample counts, cached per config (its name aside)."""

    def __init__(self) -> None:
        self.cache: dict[tuple[str, int], float] = {}
        self.curves: dict[str, list[tuple[int, float]]] = {}

    def accuracy(self, config: dict[str, Any], samples: int) -> float:
        import json

        from swarm.run.local import train_local
        from swarm.run.runconfig import RunConfig

        key_config = {k: v for k, v in config.items() if k not in ("name", "averaging", "timeouts")}
        key = (json.dumps(key_config, sort_keys=True), samples)
        if key not in self.cache:
            result = train_local(RunConfig.model_validate(config), samples)
            self.cache[key] = result.accuracy if result.accuracy is not None else result.bits_per_char
            self.curves.setdefault(key[0], []).append((samples, self.cache[key]))
        return self.cache[key]


WINDOW = 0.2  # window_ratios: the samples within 20 % of a point


def _compare(cell: dict[str, Any], config: dict[str, Any], points: tuple[int, ...], baseline: LocalBaseline) -> dict:
    """At each point: the first sample at or after it, against one process trained on exactly as many samples
    (``ratios``); and the mean of every sample within ``WINDOW`` of the point that evaluated all the chains,
    against one process at the point (``window_ratios``: one sample of the worst chain swings by several
    points between two reads a second apart)."""
    out: dict[str, Any] = {"at": {}, "ratios": {}, "window_ratios": {}, "mean_ratios": {}}
    chains_max = max((row[3] for row in cell["curve"]), default=0)
    for point in points:
        later = [row for row in cell["curve"] if row[0] >= point]
        if not later:
            continue
        samples, accuracy, _, chains = later[0][:4]
        local = baseline.accuracy(config, samples)
        out["at"][str(point)] = {"samples": samples, "swarm": accuracy, "local": local, "chains": chains}
        # digits: accuracy over one process's (higher is better); charlm: bits per byte over one process's
        out["ratios"][str(point)] = ratio(accuracy, local)
        if len(later[0]) > 4:  # the chains' mean, as the simulator's node-averaged accuracy (swarm/ecl/study.py)
            out["mean_ratios"][str(point)] = ratio(later[0][4], local)
            out["at"][str(point)]["swarm_mean"] = later[0][4]
        near = [row[1] for row in cell["curve"] if abs(row[0] - point) <= WINDOW * point and row[3] == chains_max]
        if near:
            out["window_ratios"][str(point)] = ratio(sum(near) / len(near), baseline.accuracy(config, point))
            out["at"][str(point)]["window_samples"] = len(near)
    return out


def _last_ratio(cell: dict[str, Any], key: str = "ratios") -> float:
    ratios = cell[key]
    return ratios[max(ratios, key=int)] or 0.0
