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
