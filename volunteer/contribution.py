"""What this machine has given a run, kept across restarts: micro-batches and samples computed, time online.

Volunteers expect to see their own contribution (BOINC's "work done", Folding@home's work units), and
to see it grow across restarts, not start at 0 each time. One file per identity:
``<data_dir>/contribution/<peer id>.json``, ``{"peer_id", "runs": {run_id: Tally}}``. Only the process that
holds the identity writes it (identities are locked, swarm/dht/dht.py ``claim_identity``), so writers never
race; readers (`volunteer status`) sum every file of the data dir. Writes are atomic (a temporary file,
then a rename), so a crash leaves the previous file.

``Session`` turns the stage's cumulative counters into deltas (a pure fold, tested without a node);
the node part that feeds it lives in volunteer/node/contribution.py.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

logger = logging.getLogger(__name__)

CONTRIBUTION_DIR = "contribution"
FILE_SUFFIX = ".json"
MAX_TICK_GAP_S = 10.0  # a longer gap between two ticks (a suspended laptop) counts as this much online time


@dataclass(slots=True, frozen=True)
class Tally:
    """One run's figures for this machine (or for one session)."""

    microbatches: int = 0  # micro-batches whose update this copy applied (forward and backward here)
    samples: int = 0  # the samples in them
    online_s: float = 0.0  # seconds spent online (taking work), not paused or syncing
    sessions: int = 0  # joins that served
    first_at: float | None = None  # wall time of the first session
    last_at: float | None = None  # wall time of the last update
    swarms: tuple[str, ...] = ()  # the layer swarms served

    def plus(self, other: Tally) -> Tally:
        firsts = [t for t in (self.first_at, other.first_at) if t is not None]
        lasts = [t for t in (self.last_at, other.last_at) if t is not None]
        return Tally(microbatches=self.microbatches + other.microbatches, samples=self.samples + other.samples,
                     online_s=self.online_s + other.online_s, sessions=self.sessions + other.sessions,
                     first_at=min(firsts) if firsts else None, last_at=max(lasts) if lasts else None,
                     swarms=tuple(sorted(set(self.swarms) | set(other.swarms))))

    def to_json(self) -> dict:
        data = asdict(self)
        data["swarms"] = list(self.swarms)
        data["online_s"] = round(self.online_s, 1)
        return data

    @staticmethod
    def from_json(data: dict) -> Tally:
        """Parse one entry; ValueError for a malformed one (the caller skips it)."""
        try:
            return Tally(microbatches=int(data.get("microbatches", 0)), samples=int(data.get("samples", 0)),
                         online_s=float(data.get("online_s", 0.0)), sessions=int(data.get("sessions", 0)),
                         first_at=_optional_float(data.get("first_at")), last_at=_optional_float(data.get("last_at")),
                         swarms=tuple(str(s) for s in data.get("swarms", ())))
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed contribution entry: {exc}") from None


def _optional_float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


@dataclass(slots=True)
class Session:
    """This process's contribution, folded from the stage's cumulative counters at each tick."""

    swarm: str
    started_at: float = field(default_factory=time.time)
    tally: Tally = field(default_factory=Tally)
    _last_counters: tuple[int, int] | None = None  # (micro-batches, samples) at the last observation
    _last_tick_s: float | None = None  # monotonic

    def observe(self, microbatches: int, samples: int, online: bool, now_s: float, wall_s: float) -> None:
        """Fold in the counters as they are now (they only grow within one stage; a smaller value means a
        new stage, counted from 0) and the time since the last call if the node was online meanwhile."""
        last = self._last_counters or (0, 0)
        d_batches = microbatches - last[0] if microbatches >= last[0] else microbatches
        d_samples = samples - last[1] if samples >= last[1] else samples
        self._last_counters = (microbatches, samples)
        d_online = 0.0
        if online and self._last_tick_s is not None:
            d_online = min(max(0.0, now_s - self._last_tick_s), MAX_TICK_GAP_S)
        self._last_tick_s = now_s
        t = self.tally
        self.tally = replace(t, microbatches=t.microbatches + d_batches, samples=t.samples + d_samples,
                             online_s=t.online_s + d_online, sessions=1,
                             first_at=t.first_at if t.first_at is not None else self.started_at, last_at=wall_s,
                             swarms=(self.swarm,))


def contribution_path(data_dir: Path, peer_id: str) -> Path:
    return Path(data_dir) / CONTRIBUTION_DIR / f"{peer_id}{FILE_SUFFIX}"


def load_runs(path: Path) -> dict[str, Tally]:
    """The runs in one file; an unreadable file or entry is skipped with a warning (never fatal)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("ignoring the contribution file %s: %s", path, exc)
        return {}
    runs: dict[str, Tally] = {}
    for run_id, entry in (data.get("runs") or {}).items() if isinstance(data, dict) else ():
        try:
            runs[str(run_id)] = Tally.from_json(entry)
        except ValueError as exc:
            logger.warning("%s, run %s: %s", path, run_id, exc)
    return runs


def save_runs(path: Path, peer_id: str, runs: dict[str, Tally]) -> None:
    """Write atomically: a reader or a crash never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    payload = {"peer_id": peer_id, "runs": {run_id: tally.to_json() for run_id, tally in sorted(runs.items())}}
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=True))
    os.replace(tmp, path)


def machine_total(data_dir: Path, run_id: str) -> Tally:
    """This run's figures summed over every identity in the data dir (several volunteers on one machine)."""
    return machine_tallies(data_dir, run_id)[0]


def machine_tallies(data_dir: Path, run_id: str) -> tuple[Tally, int]:
    """This run's figures summed over every identity in the data dir, and how many identities gave any: a
    volunteer's farewell counts its own identity's sessions only, `volunteer status` all of them."""
    total, identities = Tally(), 0
    directory = Path(data_dir) / CONTRIBUTION_DIR
    try:
        files = sorted(directory.glob(f"*{FILE_SUFFIX}"))
    except OSError:
        return total, 0
    for path in files:
        tally = load_runs(path).get(run_id)
        if tally is not None:
            total, identities = total.plus(tally), identities + 1
    return total, identities


def format_hours(seconds: float) -> str:
    """'40 s', '45 min', '3.2 h': the unit volunteers count their time in."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def describe_tally(tally: Tally) -> str:
    """'1,234 micro-batches (39,488 samples), 3.2 h online'."""
    return (f"{tally.microbatches:,} micro-batches ({tally.samples:,} samples), "
            f"{format_hours(tally.online_s)} online")


def farewell(run_id: str, session: Tally, total: Tally, log_path: str = "") -> str:
    """The lines printed when a volunteer quits: this session, then everything this identity gave the run."""
    lines = [f"Thank you. This session you computed {describe_tally(session)} for run {run_id}."]
    if total.sessions > 1:
        since = time.strftime("%Y-%m-%d", time.localtime(total.first_at)) if total.first_at else "the start"
        lines.append(f"In total since {since}: {describe_tally(total)} over {total.sessions} sessions of this "
                     "identity (`volunteer status` sums every identity on this machine).")
    if log_path:
        lines.append(f"Log of this session: {log_path}")
    return "\n".join(lines)
