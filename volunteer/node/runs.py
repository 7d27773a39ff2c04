"""Another run of the same name, with another config: stop and say how to join it, unless asked not to.

A changed config (a different ``optimizer.lr``, say) is a different run id, so such a volunteer
never trains with the others. It used to log the differences and then serve its own empty run
forever. Now, when the other run has peers online and ours has none, the node stops with the
differences and a copy of the active run's config to join with; ``--new-run`` makes training
alone an explicit choice.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

NEW_RUN_FLAG = "--new-run"


def active_conflict(ours_online: int, others: list[Any], new_run: bool) -> Any | None:
    """The other run to stop for (the one with the most online peers), or None.

    Only when ours has nobody else online: if our run is live too, we join it as configured."""
    if new_run or ours_online > 0:
        return None
    live = [other for other in others if other.online > 0]
    return max(live, key=lambda other: (other.online, other.run_id)) if live else None


def save_run_config(other: Any, run: Any, folder: Path) -> Path | None:
    """Write the active run's config (its canonical fields, our bootstrap peers and timeouts) to
    ``folder/<run id>.yaml``; None if it cannot be written or would not load as that same run id
    (a config from another client version)."""
    import yaml

    from swarm.run.runconfig import RunConfig

    data = {**other.config, "timeouts": run.timeouts.model_dump(mode="json"),
            "bootstrap_peers": list(run.bootstrap_peers)}
    try:
        if RunConfig.model_validate(data).run_id != other.run_id:
            return None
    except ValueError as exc:
        logger.info("the active run's config does not load here: %s", exc)
        return None
    path = folder / f"{other.run_id}.yaml"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        header = f"# The config of the active run {other.run_id}, saved by `volunteer join`.\n"
        path.write_text(header + yaml.safe_dump(data, sort_keys=False))
    except OSError as exc:
        logger.warning("could not save the active run's config to %s: %s", path, exc)
        return None
    return path


def conflict_message(run: Any, other: Any, saved: Path | None, initial_peers: list[str]) -> str:
    detail = "; ".join(other.differences) if other.differences else "unknown fields"
    peers = " ".join(initial_peers)
    plural = "s" if other.online != 1 else ""
    use = (f"To join it, use its config: volunteer join --run {saved} --initial-peers {peers}"
           if saved is not None else
           f"To join it, change your run config to match (--run), or ask its organisers for their config")
    return (f"another run named {run.name!r} is active with a different config ({other.run_id}, "
            f"{other.online} peer{plural} online); yours ({run.run_id}) has nobody else, so you would train alone. "
            f"Differences: {detail}. {use}. To start your own run anyway, add {NEW_RUN_FLAG}")
