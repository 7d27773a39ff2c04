"""Figures of benchmarks/adversary.py from sampled series: pure functions, no processes.

A run is a list of ``Sample``s taken every few seconds from t = 0 (training started). The attack
window is [attack_at, attack_at + attack_s), the after window the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STALE_GAP = 0.15  # published accuracy this far from the true one is a stale evaluation
EVAL_EVERY_S = 5.0  # the benchmark's run config: training.eval_every_s
KILLED_ACCURACY = 0.2  # at or below this at the end (chance is 0.1), the run is dead
KILLED_WINDOW_S = 10.0  # or no sample trained in the last this many seconds


@dataclass(slots=True, frozen=True)
class Sample:
    t: float
    trained: int  # samples completed by every layer0 driver (their records)
    lost: int  # micro-batches the drivers gave up
    drivers: int
    true_accuracy: float | None  # the copies pulled and evaluated by the benchmark
    published_accuracy: float | None  # what the newest layer0 record says
    published_labelled: bool  # the record says when / on which copy it evaluated


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _window(samples: list[Sample], start: float, end: float) -> list[Sample]:
    return [s for s in samples if start <= s.t < end]


def rate(samples: list[Sample]) -> float | None:
    """Samples/s trained across the window (first to last sample)."""
    if len(samples) < 2 or samples[-1].t <= samples[0].t:
        return None
    return (samples[-1].trained - samples[0].trained) / (samples[-1].t - samples[0].t)


def longest_stall_s(samples: list[Sample]) -> float:
    """The longest span over which ``trained`` did not grow."""
    longest, since = 0.0, None
    for prev, cur in zip(samples, samples[1:]):
        if cur.trained <= prev.trained:
            since = prev.t if since is None else since
            longest = max(longest, cur.t - since)
        else:
            since = None
    return longest


def longest_unlabelled_stale_s(samples: list[Sample], gap: float = STALE_GAP) -> float:
    """The longest span over which status published an accuracy ``gap`` away from the truth without a date."""
    longest, since = 0.0, None
    for s in samples:
        stale = (s.true_accuracy is not None and s.published_accuracy is not None and not s.published_labelled
                 and abs(s.published_accuracy - s.true_accuracy) > gap)
        if stale:
            since = s.t if since is None else since
            longest = max(longest, s.t - since)
        else:
            since = None
    return longest


def summarize_run(samples: list[Sample], attack_at: float, attack_s: float, after_s: float) -> dict[str, Any]:
    end = attack_at + attack_s + after_s
    before = _window(samples, attack_at / 3, attack_at)
    during = _window(samples, attack_at, attack_at + attack_s)
    after = _window(samples, attack_at + attack_s, end + 1)
    acc = lambda part: _mean([s.true_accuracy for s in part if s.true_accuracy is not None])  # noqa: E731
    last = samples[-1] if samples else None
    tail = _window(samples, (last.t if last else 0) - KILLED_WINDOW_S, float("inf"))
    measured = [s.true_accuracy for s in samples if s.true_accuracy is not None]
    final_accuracy = measured[-1] if measured else None
    stalled = len(tail) >= 2 and tail[-1].trained <= tail[0].trained
    start_lost = during[0].lost if during else (last.lost if last else 0)
    return {
        "accuracy_before": acc(before), "accuracy_during": acc(during), "accuracy_after": acc(after),
        "final_accuracy": final_accuracy,
        "published_final_accuracy": last.published_accuracy if last else None,
        "rate_before": rate(before), "rate_during": rate(during), "rate_after": rate(after),
        "lost_microbatches": (last.lost - start_lost) if last else 0,
        "stall_s": longest_stall_s(_window(samples, attack_at, end + 1)),
        "stale_eval_unlabelled_s": longest_unlabelled_stale_s(samples),
        "killed": bool(stalled or (final_accuracy is not None and final_accuracy <= KILLED_ACCURACY)),
        "samples": len(samples),
        "curve": [(s.trained, s.true_accuracy) for s in samples if s.true_accuracy is not None],
        "time_curve": [(s.t, s.true_accuracy) for s in samples if s.true_accuracy is not None],
        "attack_at": attack_at,
    }


RECOVERY_MARGIN = 0.02


def recovery_s(run: dict[str, Any], base: dict[str, Any], margin: float = RECOVERY_MARGIN) -> float | None:
    """Seconds from the attack's start until the attacked run's true accuracy is back within ``margin`` of the clean
    run's at the same time and stays there (issue 40 item 6); 0 when it never fell that far, None when it never came
    back. The clean run's accuracy at time t is its newest sample at or before t."""
    curve, clean = run.get("time_curve") or [], base.get("time_curve") or []
    attack_at = run.get("attack_at", 0.0)
    if not curve or not clean:
        return None

    def clean_at(t: float) -> float | None:
        earlier = [acc for at, acc in clean if at <= t]
        return earlier[-1] if earlier else None

    behind = [t for t, acc in curve if t >= attack_at and clean_at(t) is not None and acc < clean_at(t) - margin]
    if not behind:
        return 0.0
    after = [t for t, _ in curve if t > behind[-1]]
    return round(after[0] - attack_at, 1) if after else None


def equal_samples_ratio(run: dict[str, Any], base: dict[str, Any]) -> float | None:
    """The run's final true accuracy over the clean run's at the first sample that had trained as many
    samples (None if the clean run never got there). A run the machine slowed down (busy loops, an attacker's
    CPU) trains fewer samples in the same time; this says whether it learned as much from each one."""
    if not run.get("curve") or not base.get("curve"):
        return None
    trained, accuracy = run["curve"][-1]
    later = [acc for done, acc in base["curve"] if done >= trained]
    return _ratio(accuracy, later[0]) if later else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def summary(results: dict[str, dict[str, Any]], clean: dict[tuple, dict[str, Any]],
            baselines: dict[str, tuple]) -> dict[str, Any]:
    """The headline figures: one ``<attack>_accuracy_ratio`` per attack, ``runs_killed`` and the rest."""
    report: dict[str, Any] = {}
    for name, run in results.items():
        base = clean[baselines[name]]
        during = _ratio(run["accuracy_during"], base["accuracy_during"])
        after = _ratio(run["accuracy_after"], base["accuracy_after"])
        run["accuracy_ratio_during"], run["accuracy_ratio_after"] = during, after
        run["throughput_ratio_during"] = _ratio(run["rate_during"], base["rate_during"])
        run["accuracy_ratio_equal_samples"] = equal_samples_ratio(run, base)
        run["recovery_s"] = recovery_s(run, base)
        ratios = [r for r in (during, after) if r is not None]
        report[f"{name}_accuracy_ratio"] = min(ratios) if ratios else None
    refusals = {n: r.get("refused_after_s") for n, r in results.items() if "refused_after_s" in r}
    report["runs_killed"] = sum(1 for r in results.values() if r["killed"] or not r["all_alive"])
    report["killed"] = sorted(n for n, r in results.items() if r["killed"] or not r["all_alive"])
    report["refused_after_s"] = refusals
    report["never_refused"] = sorted(n for n, seconds in refusals.items() if seconds is None)
    report["lost_microbatches"] = sum(r["lost_microbatches"] for r in results.values())
    report["honest_bans"] = {n: r.get("honest_bans", 0) for n, r in results.items()}
    report["attacker_banned"] = {n: r.get("attacker_banned", False) for n, r in results.items()}
    report["honest_convicted"] = {n: r.get("honest_convicted", 0) for n, r in results.items()}
    report["attackers_convicted"] = {n: r.get("attackers_convicted", 0) for n, r in results.items()}
    stale = {n: r["stale_eval_unlabelled_s"] for n, r in results.items()}
    report["stale_eval_unlabelled"] = any(v > 2 * EVAL_EVERY_S for v in stale.values())
    report["stale_eval_unlabelled_s"] = stale
    report["equal_samples_ratio"] = {n: r["accuracy_ratio_equal_samples"] for n, r in results.items()}
    report["recovery_s"] = {n: r["recovery_s"] for n, r in results.items()}
    report["attacks"] = results
    report["clean"] = {"-".join(map(str, k)): v for k, v in clean.items()}
    return report
