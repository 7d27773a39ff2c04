"""The driver's bytes per micro-batch with stages pushing to each other, against the relay, in one run (the
``data-plane`` part of benchmarks.pipeline; issue 41's ``driver_bytes_vs_relay``).

A shipped run (charlm: 4 stages, float32 activations) trains on loopback with ``per_swarm`` ``volunteer join`` per
stage: stages pushing (the default), with ``VOLUNTEER_DATA_PLANE=relay`` (the driver carries every tensor of every
hop), and pushing with the run's checks off (``integrity.spot_share`` 0: no spot checks, referee, audits or stage-0
replicas), to tell the data plane's bytes from the checks'. Each volunteer's record says the Mb/s of tensor payload
it sent and received over its last heartbeat (swarm/pipeline/transport/traffic.py: every RPC's tensors, per link);
summed over the window's heartbeats and divided by the micro-batches the drivers completed in that window, that is
the bytes per micro-batch of the drivers, and of every peer together. The drivers' share of the relay's is what
stage-to-stage transfer saves on a volunteer's uplink, where a home link is slowest (benchmarks.wan measures the
time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.common import load_run_config, ratio, say, write_run
from benchmarks.fleet import Fleet
from benchmarks.pipeline_configs import training_only
from benchmarks.pipeline_swarm import START_TIMEOUT_S, join_all, sleep_checking, stop_in_order, wait_training

MODES = ("push", "relay", "push_unchecked")  # the last: spot checks, referee and stage-0 replicas off (what is checks)


@dataclass(slots=True, kw_only=True)
class DataPlaneSettings:
    run: str = "charlm"
    warmup_s: float = 10.0
    window_s: float = 30.0
    heartbeat_s: float = 2.0
    per_swarm: int = 1  # volunteers per stage (2: every swarm has a second copy, the drivers check each other's)
    modes: tuple[str, ...] = MODES


QUICK = DataPlaneSettings(run="digits-mlp", warmup_s=1.0, window_s=4.0, heartbeat_s=0.5)


class _Bytes:
    """Tensor bytes a peer moved over successive records (its Mb/s times each heartbeat's span), and its clock."""

    def __init__(self) -> None:
        self.last: dict[str, Any] = {}  # peer id -> its last record read
        self.first: dict[str, Any] = {}
        self.moved: dict[str, float] = {}

    def add(self, records: list[Any]) -> None:
        for r in records:
            if r.state != "online":
                continue
            before = self.last.get(r.peer_id)
            self.last[r.peer_id] = r
            self.first.setdefault(r.peer_id, r)
            if before is None or r.updated_at <= before.updated_at or r.mbps_in < 0 or r.mbps_out < 0:
                continue
            span = r.updated_at - before.updated_at
            self.moved[r.peer_id] = self.moved.get(r.peer_id, 0.0) + (r.mbps_in + r.mbps_out) * 1e6 / 8 * span


def _one(fleet: Fleet, maddr: str, reader: Any, s: DataPlaneSettings, mode: str) -> dict[str, Any]:
    from swarm.dht.membership import Membership

    config = training_only(s.run, s.heartbeat_s)
    config["name"] = f"bench-{s.run}-{mode}"  # a run id of its own: the second run never meets the first's records
    if mode == "push_unchecked":
        config.setdefault("integrity", {})["spot_share"] = 0.0
    run_path = write_run(fleet.workdir / f"dataplane-{mode}.yaml", config)
    run = load_run_config(run_path)
    stages, batch = run.model.stages, run.training.batch_size
    how = {"push": "pushing", "relay": "relayed by the driver", "push_unchecked": "pushing, checks off"}[mode]
    say(f"data-plane: {s.run}, {stages} stages x {s.per_swarm}, stages {how}")
    procs = join_all(fleet, run_path, maddr, stages, s.per_swarm, f"dataplane-{mode}",
                     env={"VOLUNTEER_DATA_PLANE": "relay" if mode == "relay" else "push"})
    flat = [p for group in procs.values() for p in group]
    membership = Membership(reader, run, b"")
    try:
        wait_training(membership, stages, s.per_swarm, flat, START_TIMEOUT_S)
        sleep_checking(s.warmup_s, flat)
        driver, everyone = _Bytes(), _Bytes()
        views = membership.read_all()
        driver.add(views.get("layer0", []))
        everyone.add([r for records in views.values() for r in records])
        for _ in range(max(1, round(s.window_s / s.heartbeat_s))):
            sleep_checking(s.heartbeat_s, flat)
            views = membership.read_all()
            driver.add(views.get("layer0", []))
            everyone.add([r for records in views.values() for r in records])
    finally:
        stop_in_order(fleet, procs)
    trained = sum(driver.last[p].trained - driver.first[p].trained for p in driver.last)
    microbatches = trained / batch
    if microbatches <= 0:
        return {"mode": mode, "microbatches": 0, "driver_bytes_per_microbatch": None}
    return {
        "mode": mode, "microbatches": round(microbatches, 1), "batch": batch, "stages": stages,
        "per_swarm": s.per_swarm,
        "driver_bytes_per_microbatch": round(sum(driver.moved.values()) / microbatches),
        "all_peers_bytes_per_microbatch": round(sum(everyone.moved.values()) / microbatches),
        "bytes_per_microbatch_by_swarm": {
            name: round(sum(everyone.moved.get(r.peer_id, 0.0) for r in views.get(name, [])) / microbatches)
            for name in run.swarm_names},
    }


def data_plane(fleet: Fleet, maddr: str, reader: Any, s: DataPlaneSettings) -> dict[str, Any]:
    unknown = set(s.modes) - set(MODES)
    if unknown:
        raise SystemExit(f"--data-plane-modes: {sorted(unknown)} are not among {list(MODES)}")
    results = {mode: _one(fleet, maddr, reader, s, mode) for mode in MODES if mode in s.modes}
    push, relay, unchecked = (results.get(m, {}).get("driver_bytes_per_microbatch") for m in MODES)
    vs = ratio(push, relay) if push is not None and relay else None
    vs_unchecked = ratio(unchecked, relay) if unchecked is not None and relay else None
    say(f"data-plane: the driver moves {push} bytes per micro-batch with stages pushing, {relay} relaying "
        f"({vs if vs is None else round(vs, 3)} of the relay's), {unchecked} pushing without checks")
    return {"driver_bytes_vs_relay": vs, "driver_bytes_vs_relay_unchecked": vs_unchecked,
            "data_plane": {"run": s.run, **results}}
