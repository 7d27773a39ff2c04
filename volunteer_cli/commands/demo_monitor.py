"""What `volunteer demo` prints while it watches the swarms (pure: views and times in, lines out).

The demo's monitor is the one process the user watches, so every line it prints stands for "now": a figure
that may be old says how old (the test accuracy a driver published 12 s ago, a view the DHT did not refresh
this time), a stall is counted from when training could start (every swarm online), never from before, and
the peers it counts are the ones with a fresh heartbeat (swarm/dht/membership.py ``merge_view``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from volunteer.snapshot import bits_per_byte

STALL_NOTICE_S = 10.0  # every swarm online and no sample trained for this long: say why
STALE_READ_S = 5.0  # a view older than this is printed with its age
WAITING_LINE_S = 2.0  # while swarms come online the demo reads faster (demo.py START_POLL_S), and says so this often


@dataclass(slots=True)
class Figures:
    """The run's figures as the monitor last read them (the demo's JSON result is built from them)."""

    samples: int = 0
    lost: int = 0
    test_accuracy: float | None = None
    test_loss: float | None = None
    eval_at: float | None = None  # wall time of that evaluation (None: not published)
    speed: float = 0.0
    train_loss: float | None = None
    online: dict[str, int] = field(default_factory=dict)
    alarms: list[str] = field(default_factory=list)


def read_figures(views: dict, swarm_names: list[str], eval_every_s: float = 10.0) -> Figures:
    """The figures of one read of every swarm: samples and losses from layer0's online drivers, peers per swarm."""
    from swarm.dht.alarms import run_alarms
    from swarm.dht.published import representative_evaluation

    layer0 = views.get("layer0", [])
    online0 = [r for r in layer0 if r.state == "online"]
    latest, _ = representative_evaluation(layer0, eval_every_s)  # the median of the current ones
    losses = [r.loss for r in online0 if r.loss >= 0]
    return Figures(
        samples=sum(r.trained for r in layer0), lost=sum(r.lost for r in layer0),
        test_accuracy=latest.test_accuracy if latest is not None and latest.test_accuracy >= 0 else None,
        test_loss=latest.test_loss if latest is not None and latest.test_loss >= 0 else None,
        eval_at=latest.eval_at if latest is not None and latest.eval_at >= 0 else None,
        speed=sum(r.throughput for r in online0), train_loss=sum(losses) / len(losses) if losses else None,
        online={name: sum(r.state == "online" for r in views.get(name, [])) for name in swarm_names},
        alarms=run_alarms(views, swarm_names))


def ago(seconds: float) -> str:
    return f"{seconds:.0f} s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago"


class Monitor:
    """The demo's progress lines from successive reads: ``observe`` once per poll (``now``: monotonic, ``wall``:
    time.time() for the evaluations' ages, ``read_age_s``: how old the view is, 0 when just read)."""

    def __init__(self, swarm_names: list[str], started: float):
        self.swarm_names = swarm_names
        self.started = started
        self.all_online_at: float | None = None
        self.progress = (0, 0.0)  # (samples, when they last grew), from when every swarm came online
        self.figures = Figures()
        self._waiting_said_at = -float("inf")

    def observe(self, figures: Figures, now: float, wall: float, read_age_s: float = 0.0) -> list[str]:
        self.figures = figures
        lines = []
        if self.all_online_at is None:
            if figures.online and all(figures.online.values()):
                self.all_online_at = now
                self.progress = (figures.samples, now)  # a stall counts from here, not from the demo's start
                lines.append(f"all swarms online after {now - self.started:.0f} s; training")
            else:
                missing = [name for name, count in figures.online.items() if count == 0]
                if now - self._waiting_said_at >= WAITING_LINE_S:
                    self._waiting_said_at = now
                    lines.append(f"waiting for {', '.join(missing)} to come online{self._read_note(read_age_s)}")
                return lines
        lines.append(self.progress_line(wall, read_age_s))
        lines += [f"RUN ALARM: {alarm}" for alarm in figures.alarms]
        if figures.samples > self.progress[0]:
            self.progress = (figures.samples, now)
        return lines

    def stalled_s(self, now: float) -> float:
        """Seconds since a sample last trained, counted from when every swarm came online (0 before)."""
        return 0.0 if self.all_online_at is None else now - self.progress[1]

    def stall_notice_due(self, now: float) -> bool:
        return self.stalled_s(now) > STALL_NOTICE_S

    def progress_line(self, wall: float, read_age_s: float = 0.0) -> str:
        f = self.figures
        if f.test_accuracy is not None:
            test = f"test acc {f.test_accuracy:.1%}"
        elif f.test_loss is not None:
            test = f"test {bits_per_byte(f.test_loss):.2f} bits/byte"
        else:
            test = "test -"
        if f.eval_at is not None and test != "test -":
            test += f" ({ago(max(0.0, wall - f.eval_at))})"
        loss = f"{f.train_loss:.3f}" if f.train_loss is not None else "-"
        peers = " ".join(f"{name}:{f.online.get(name, 0)}" for name in self.swarm_names)
        return (f"{f.samples:>7} samples  {f.speed:7.0f} samples/s  train loss {loss}  {test}  "
                f"lost {f.lost}  peers {peers}{self._read_note(read_age_s)}")

    @staticmethod
    def _read_note(read_age_s: float) -> str:
        return f"  (the DHT did not answer: figures read {ago(read_age_s)})" if read_age_s > STALE_READ_S else ""
