"""volunteer/preflight.py as plain functions: what a node checks before it joins (no processes, no network)."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from swarm.run.runconfig import RunConfig
from volunteer.preflight import (PreflightError, check_listen_free, check_run, check_writable_parent, listen_endpoints,
                                 needs_data, private_dir)


def run_of(**sections) -> RunConfig:
    return RunConfig.model_validate({"name": "t", **sections})


@pytest.mark.parametrize("sections, says", [
    ({"model": {"input_dim": 32}}, "has 64 features; set model.input_dim to 64"),
    ({"model": {"num_classes": 5}}, "model.num_classes (5) must exceed the largest label"),
    ({"data": {"source": "npz", "path": "/nonexistent/x.npz"}}, "data.path '/nonexistent/x.npz' does not exist"),
    ({"data": {"shards": 4096}}, "data.shards (4096) exceeds"),
    ({"model": {"kind": "transformer"}}, "needs model.kind 'mlp'"),
])
def test_a_run_whose_model_does_not_fit_its_data_is_refused_with_the_field(sections, says):
    with pytest.raises(PreflightError) as caught:
        check_run(run_of(**sections), "auto")
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_an_npz_of_other_width_names_the_input_dim_to_set(tmp_path):
    path = tmp_path / "mine.npz"
    np.savez(path, X=np.zeros((40, 20), dtype=np.float32), y=np.arange(40) % 4)
    with pytest.raises(PreflightError, match="has 20 features; set model.input_dim to 20"):
        check_run(run_of(data={"source": "npz", "path": str(path)}), "layer0")
    check_run(run_of(data={"source": "npz", "path": str(path)}, model={"input_dim": 20, "num_classes": 4}), "layer0")


def test_the_shipped_kinds_chain_and_fit_their_data():
    check_run(run_of(), "auto")
    check_run(run_of(model={"kind": "transformer", "stages": 3, "activation": "gelu", "d_model": 32, "d_ff": 64,
                            "seq_len": 16}, data={"source": "text"}), "auto")


def test_only_nodes_that_read_the_data_need_it():
    run = run_of(model={"stages": 4})
    assert [needs_data(run, s) for s in ("auto", "layer0", "layer1", "layer2", "layer3")] == [
        True, True, False, False, True]
    assert needs_data(run_of(averaging={"exchange": {"every_samples": 100}}), "layer1")
    # a middle stage of a run whose data file it does not hold still serves
    check_run(run_of(data={"source": "npz", "path": "/nonexistent/x.npz"}), "layer1")


def test_listen_endpoints_are_the_explicit_ports():
    found = listen_endpoints(["/ip4/0.0.0.0/tcp/0", "/ip4/127.0.0.1/tcp/31337", "/ip4/0.0.0.0/udp/31337/quic-v1",
                              "/ip6/::1/tcp/4001", "/dns4/example.org/tcp/1"])
    assert [(e.host, e.transport, e.port) for e in found] == [
        ("127.0.0.1", "tcp", 31337), ("0.0.0.0", "udp", 31337), ("::1", "tcp", 4001)]


def test_a_port_another_process_shares_with_reuseport_counts_as_taken():
    with socket.socket() as held:  # what p2pd does: SO_REUSEPORT lets a second p2pd start on it silently
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(PreflightError, match=f"--listen /ip4/127.0.0.1/tcp/{port}: TCP port {port} is already "
                                                 "in use on this machine"):
            check_listen_free([f"/ip4/127.0.0.1/tcp/{port}"], "--listen")
    check_listen_free([f"/ip4/127.0.0.1/tcp/{port}", "/ip4/0.0.0.0/tcp/0"], "--listen")


def test_a_folder_that_takes_no_files_is_named_with_the_fix(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(PreflightError, match=f"data dir {blocker / 'data'}: cannot write there .*; pass --data-dir"):
        private_dir(blocker / "data", "data dir", "pass --data-dir with a folder you can write to")
    with pytest.raises(PreflightError, match=f"identity {blocker / 'id.key'}: cannot write in {blocker}"):
        check_writable_parent(blocker / "id.key", "identity", "pass --identity ...")
    assert private_dir(tmp_path / "ok", "data dir", "") == tmp_path / "ok"
    assert not list((tmp_path / "ok").iterdir())  # the write check leaves nothing behind
