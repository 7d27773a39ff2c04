"""Peer addresses are checked before anything loads: what is wrong, the shape to use, exit 2 (issue 16)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from swarm.dht.maddrs import PEER_MADDR_SHAPE, check_peer_maddrs, peer_id_problem, peer_maddr_problem  # noqa: E402

QM = "QmaypY6rCvw4CcrNw87NrKEqJ2gh92sJjKAYFB85EL7cbK"  # sha256 multihash (RSA keys, what hivemind makes)
KOO = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"  # identity multihash (ed25519)
SHAPE = "/ip4/HOST/tcp/PORT/p2p/PEER_ID"


@pytest.mark.parametrize("maddr", [
    f"/ip4/127.0.0.1/tcp/31337/p2p/{QM}",
    f"/ip4/10.0.0.1/udp/31337/quic-v1/p2p/{KOO}",
    f"/ip6/::1/tcp/9/p2p/{QM}",
    f"/dns4/boot.example.org/tcp/31337/p2p/{QM}",
    f"/ip4/1.2.3.4/tcp/1/p2p/{QM}/p2p-circuit/p2p/{KOO}",  # through a relay
])
def test_whole_peer_addresses_pass(maddr):
    assert peer_maddr_problem(maddr) is None


@pytest.mark.parametrize(("maddr", "problem"), [
    ("/ip4/127.0.0.1/tcp/31337", "no /p2p/PEER_ID at the end"),
    ("/ip4/203.0.113.5/tcp/31337/p2p/Qm...", "characters a peer id never has ('.')"),
    (f"/ip4/1.2.3.4/tcp/1/p2p/{QM[:-1]}", "is not a peer id"),
    (f"/ip4/1.2.3.4/udp/1/quic/p2p/{QM}", "needs /quic-v1"),
    (f"/ip4/300.1.1.1/tcp/1/p2p/{QM}", "not an ip4 address"),
    (f"/ip4/1.1.1.1/tcp/0/p2p/{QM}", "not a port"),
    (f"ip4/1.1.1.1/tcp/1/p2p/{QM}", "starts with /"),
    (f"/tcp/1/p2p/{QM}", "not /ip4"),
    (f"/ip4/1.1.1.1/p2p/{QM}", "expected /tcp/PORT"),
])
def test_each_mistake_is_named(maddr, problem):
    assert problem in peer_maddr_problem(maddr)


def test_the_error_shows_the_shape_and_the_source():
    assert PEER_MADDR_SHAPE == SHAPE
    with pytest.raises(ValueError, match=r"--initial-peers: '/ip4/1.2.3.4/tcp/5' is not a peer address.*shape "
                                         r"/ip4/HOST/tcp/PORT/p2p/PEER_ID"):
        check_peer_maddrs([f"/ip4/1.2.3.4/tcp/5/p2p/{QM}", "/ip4/1.2.3.4/tcp/5"], "--initial-peers")
    assert peer_id_problem("") == "the peer id is empty"


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    from procs import volunteer_exe

    env = {**os.environ, "VOLUNTEER_DATA_DIR": str(tmp_path / "data"), "VOLUNTEER_CONFIG_DIR": str(tmp_path / "cfg")}
    return subprocess.run([volunteer_exe(), *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)


def test_join_refuses_a_bad_address_before_loading_anything(tmp_path):
    for maddr in ("/ip4/127.0.0.1/tcp/31337", "/ip4/203.0.113.5/tcp/31337/p2p/Qm..."):
        done = _cli(tmp_path, "join", "--headless", "--initial-peers", maddr)
        assert done.returncode == 2, done.stderr
        assert SHAPE in done.stderr and "loading" not in done.stdout + done.stderr
        assert done.stderr.count("is not a peer address") == 1  # said once, no daemon error
    (tmp_path / "run.yaml").write_text("name: x\nbootstrap_peers: [/ip4/127.0.0.1/tcp/31337]\n")
    done = _cli(tmp_path, "status", "--run", "run.yaml")
    assert done.returncode == 2 and "bootstrap_peers" in done.stderr and SHAPE in done.stderr


@pytest.mark.parametrize(("maddr", "listen", "problem"), [
    ("/ip4/127.0.0.1/tcp/0", True, None),  # port 0: a free one
    ("/ip4/0.0.0.0/udp/31337/quic-v1", True, None),
    ("/ip6/::/tcp/31337", True, None),
    ("/ip4/203.0.113.7/tcp/31337", False, None),
    ("/ip4/203.0.113.7/tcp/0", False, "not a port"),  # announced: others dial it, so a real port
    ("127.0.0.1", True, "starts with /"),  # what a stranger types first
    ("/ip4/127.0.0.1", True, "expected /tcp/PORT"),
    (f"/ip4/127.0.0.1/tcp/31337/p2p/{QM}", True, "no /p2p/PEER_ID here"),
    ("/ip4/0.0.0.0/udp/31337/quic", True, "needs /quic-v1"),
    ("/ip4/127.0.0.1/tcp/99999", True, "not a port"),
])
def test_an_address_to_listen_on_or_announce_is_checked_like_a_peers(maddr, listen, problem):
    from swarm.dht.maddrs import listen_maddr_problem

    found = listen_maddr_problem(maddr, any_port=listen)
    assert found is None if problem is None else problem in found


def test_bootstrap_and_join_refuse_a_bad_listen_address_before_loading_anything(tmp_path):
    """`--listen 127.0.0.1` reached p2pd, which refused it after the libraries loaded, in Go's words."""
    for args in (("bootstrap", "--listen", "127.0.0.1"), ("bootstrap", "--announce", "/ip4/203.0.113.7/tcp/0"),
                 ("join", "--headless", "--listen", "127.0.0.1", "--initial-peers",
                  f"/ip4/127.0.0.1/tcp/31337/p2p/{QM}")):
        done = _cli(tmp_path, *args)
        assert done.returncode == 2, done.stderr
        assert "/ip4/HOST/tcp/PORT" in done.stderr and "loading" not in done.stdout + done.stderr, done.stderr
        assert ("--listen" if "--listen" in args else "--announce") in done.stderr and "Daemon" not in done.stderr
