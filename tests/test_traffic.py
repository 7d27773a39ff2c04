"""Traffic per link (issue 12, item 6): every RPC counts its bytes against the remote peer, and the node
turns two readings into Mb/s in and out, per link and in all, for its record, `status --json`, `ctl
status` and the dashboard."""

from __future__ import annotations

import pytest

from swarm.pipeline.transport.traffic import LinkRates, Traffic, mbps


def test_rates_per_link_and_in_all_between_two_readings():
    traffic, rates = Traffic(), LinkRates()
    traffic.count("peerA", inbound=1000)
    rates.update(10.0, traffic)  # the first reading only sets the start
    assert rates.mbps_in == 0.0 and rates.busiest == ()
    traffic.count("peerA", inbound=250_000, outbound=125_000)
    traffic.count("peerB", outbound=1_250_000)
    rates.update(12.0, traffic)
    assert rates.mbps_in == pytest.approx(1.0) and rates.mbps_out == pytest.approx(5.5)
    assert [(r.peer_id, r.mbps_in, r.mbps_out) for r in rates.busiest] == [("peerB", 0.0, 5.0), ("peerA", 1.0, 0.5)]
    rates.update(13.0, traffic)  # nothing moved: no busy link, zero in all
    assert rates.busiest == () and rates.mbps_in == 0.0


def test_made_up_peer_ids_cannot_grow_the_table():
    traffic = Traffic(max_links=4)
    traffic.count("honest", inbound=10_000_000)
    for i in range(1000):
        traffic.count(f"sybil{i}", inbound=1)
    links = traffic.links()
    assert len(links) == 4 and "honest" in links
    assert traffic.bytes_in == 10_000_000 + 1000  # the totals keep every byte


def test_mbps_is_megabits():
    assert mbps(125_000, 1.0) == pytest.approx(1.0)
    assert mbps(-5, 1.0) == 0.0 and mbps(5, 0.0) == 0.0


def test_records_carry_the_rates_and_status_and_the_dashboard_show_them():
    import time

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from rich.console import Console

    from swarm.dht.records import MemberRecord, _MemberValueSchema, parse_member, peer_id_from_public_key
    from swarm.run.runconfig import RunConfig
    from tui.work import figures_table
    from volunteer.snapshot import LinkRow, NodeSnapshot, NodeState
    from volunteer_cli.commands.status import build_report, render_report

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    subkey, now = b"[owner:" + public + b"]", time.time()
    record = MemberRecord(peer_id=peer_id_from_public_key(public), state="online", version="t", started_at=now,
                          updated_at=now, mbps_in=12.5, mbps_out=3.25)
    assert parse_member(subkey, record.to_wire(), now).mbps_in == 12.5
    old = {k: v for k, v in record.to_wire().items() if not k.startswith("mbps")}  # a client before this
    assert parse_member(subkey, old, now).mbps_in == -1.0
    _MemberValueSchema.parse_obj(old)
    for bad in ({"mbps_in": float("inf")}, {"mbps_out": -3.0}, {"mbps_in": 1e9}):
        assert parse_member(subkey, {**record.to_wire(), **bad}, now) is None, bad

    silent = MemberRecord(peer_id="p2", state="online", version="t", started_at=now, updated_at=now)
    report = build_report(RunConfig(name="s", model={"stages": 2}), {"layer0": [record, silent], "layer1": []}, now)
    assert [(r["mbps_in"], r["mbps_out"]) for r in report["swarms"]["layer0"]] == [(12.5, 3.25), (None, None)]
    assert report["summary"]["layer0"]["mbps_in"] == 12.5
    assert "12.50/3.25 Mb/s in/out" in render_report(report)

    snap = NodeSnapshot(run_name="s", run_id="s-1", swarm="layer0", peer_id="p1", state=NodeState.ONLINE,
                        mbps_in=4.0, mbps_out=1.5, links=(LinkRow("12D3KooWfarpeer1", 3.0, 1.0),))
    console = Console(width=80, record=True)
    console.print(figures_table(snap))
    shown = console.export_text()
    assert "4.00 in, 1.50 out" in shown and "farpeer1" in shown and "3.00 in, 1.00 out" in shown
    assert list(snap.to_json()["links"]) == [{"peer_id": "12D3KooWfarpeer1", "mbps_in": 3.0, "mbps_out": 1.0}]


def test_bytes_are_also_counted_by_op_and_a_strangers_made_up_ops_cannot_grow_the_table():
    from swarm.pipeline.transport.traffic import MAX_OPS

    traffic = Traffic()
    traffic.count("a", inbound=10, outbound=5, op="forward")
    traffic.count("b", inbound=1, op="forward")
    traffic.count("a", outbound=7)  # no op named: in the totals only
    assert traffic.by_op == {"forward": [11, 5]} and (traffic.bytes_in, traffic.bytes_out) == (11, 12)
    for i in range(3 * MAX_OPS):
        traffic.count("evil", inbound=1, op=f"made-up-{i}")
    assert len(traffic.by_op) <= MAX_OPS + 1 and traffic.by_op["other"][0] > 0
    assert sum(b[0] for b in traffic.by_op.values()) == traffic.bytes_in
