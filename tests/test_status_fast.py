"""`volunteer status` reads the swarms without importing torch (issue 16, item 9: 9.4-9.7 s on a loaded
machine, most of it torch's import), and still sees every record."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from procs import write_run

from swarm.dht.lightdht import _reexports

REPO = Path(__file__).resolve().parent.parent
STATUS_TIMEOUT_S = 120.0


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


def test_reexports_name_the_module_that_defines_each_name(tmp_path: Path):
    init = tmp_path / "__init__.py"
    init.write_text("from pkg.utils.logging import get_logger\nfrom .serializer import MSGPackSerializer as MSG\n"
                    "import os\n")
    assert _reexports(str(init), "pkg.utils") == {"get_logger": "pkg.utils.logging", "MSG": "pkg.utils.serializer"}


def test_the_reader_loads_hivemind_dht_and_the_validators_without_torch():
    code = textwrap.dedent("""
        import sys
        from swarm.dht.lightdht import light_hivemind
        assert light_hivemind()
        from hivemind.dht.node import DHTNode
        from hivemind.utils import get_dht_time
        from swarm.dht.dht import make_validators
        from swarm.dht.membership import Membership
        make_validators("run-1", ["layer0", "layer1"], None)
        get_dht_time()
        assert "torch" not in sys.modules, "torch was imported"
        assert not light_hivemind()  # already in place: a second call changes nothing
    """)
    done = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_status_sees_a_peers_record_and_never_imports_torch(swarm, tmp_path: Path):
    from hostile import HostilePeer

    from volunteer.config import load_run

    run_path = write_run(tmp_path / "run.yaml", name="fast-status", stages=2, heartbeat_s=30.0)
    run, _ = load_run(str(run_path))
    _, maddr = swarm.bootstrap()
    with HostilePeer(run, [maddr], tmp_path / "peer.key") as peer:  # the tests' own record-announcing peer
        assert peer.announce("layer1", throughput=12.5, served=40)
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "volunteer_cli", "status", "--run", str(run_path),
             "--initial-peers", maddr, "--json"],
            env=_env(swarm.env), capture_output=True, text=True, timeout=STATUS_TIMEOUT_S,
        )
    assert done.returncode == 0, done.stderr[-2000:]
    import json

    report = json.loads(done.stdout.strip().splitlines()[-1])
    (row,) = report["swarms"]["layer1"]
    assert row["peer_id"] == peer.peer_id and row["throughput"] == 12.5 and row["served"] == 40
    assert report["summary"]["layer0"]["empty"]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "hivemind.dht.node" in imported and "torch" not in imported


def test_status_shows_the_median_of_the_drivers_evaluations_not_the_boldest_claim():
    """Issue 25: a stranger's record claiming accuracy 1.0 after 2^62 samples, kept fresh, was what `volunteer
    status` showed. Any key can publish a record; the median of the drivers' current evaluations is what one liar
    cannot set."""
    from swarm.dht.records import MemberRecord
    from swarm.run.runconfig import RunConfig
    from volunteer_cli.commands.status import build_report, render_report

    run = RunConfig(name="digits-mlp")
    now = 1000.0

    def driver(peer: str, accuracy: float, samples: int, eval_at: float = now - 2) -> MemberRecord:
        return MemberRecord(peer_id=peer, state="online", version="t", started_at=0.0, updated_at=now - 1,
                            test_accuracy=accuracy, test_loss=0.2, eval_samples=samples, eval_at=eval_at)

    liar = driver("QmLiar0000000000", 1.0, 2**62, eval_at=now)
    honest = [driver("QmHonestA0000000", 0.95, 40_000), driver("QmHonestB0000000", 0.93, 41_000)]
    ev = build_report(run, {"layer0": [liar, *honest]}, now=now)["evaluation"]
    assert ev["test_accuracy"] == 0.95 and ev["samples"] == 40_000 and ev["drivers"] == 3
    assert ev["range"] == [0.93, 1.0]
    assert "the median of 3 drivers', 0.93-1" in render_report(build_report(run, {"layer0": [liar, *honest]}, now=now))
    # two drivers: the worse figure; an evaluation three periods older than the newest is not current
    assert build_report(run, {"layer0": [liar, honest[0]]}, now=now)["evaluation"]["test_accuracy"] == 0.95
    old = driver("QmOld00000000000", 0.10, 100, eval_at=now - 10 * run.training.eval_every_s)
    ev = build_report(run, {"layer0": [old, *honest]}, now=now)["evaluation"]
    assert ev["drivers"] == 2 and ev["test_accuracy"] == 0.93
    # one driver: its own figure, said to be its own
    one = build_report(run, {"layer0": [honest[0]]}, now=now)
    assert one["evaluation"]["drivers"] == 1 and "(by " in render_report(one)
