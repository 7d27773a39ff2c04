"""The tests' own DHT peer: reads a run's records and pulls copies from outside, as `volunteer export` does."""

from __future__ import annotations

import asyncio
import json
import time

import torch

from swarm.averaging.params_rpc import fetch_params
from swarm.dht.dht import DHTSettings, fresh_p2p, make_validators, shutdown_dht, start_dht
from swarm.dht.membership import Membership
from swarm.dht.records import MemberRecord
from volunteer.config import load_run


def events(proc) -> list[dict]:
    """The event lines of a `--log-format json` volunteer."""
    out = []
    for line in proc.stdout().splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict) and item.get("type") == "event":
            out.append(item)
    return out


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(float((a[k] - b[k]).pow(2).sum()) for k in a) ** 0.5


def norm(a: dict[str, torch.Tensor]) -> float:
    return sum(float(a[k].pow(2).sum()) for k in a) ** 0.5


class Client:
    def __init__(self, run_path, maddr: str):
        self.run, _ = load_run(str(run_path))
        self.dht = start_dht(DHTSettings(initial_peers=[maddr], client_mode=True),
                             make_validators(self.run.run_id, self.run.swarm_names, None))
        self.membership = Membership(self.dht, self.run, b"")

    def report(self) -> dict:
        """What `volunteer status --json` prints, read by this long-lived DHT peer: poll with this, not with the
        CLI, which starts a process and a DHT of its own on every call."""
        from volunteer_cli.commands.status import build_report

        return build_report(self.run, self.membership.read_all(), now=time.time())

    def online(self, swarm: str) -> dict[str, MemberRecord]:
        return {r.peer_id: r for r in self.membership.read(swarm) if r.state == "online"}

    def copies(self, swarm: str, peer_ids: list[str]) -> list[dict[str, torch.Tensor]]:
        async def pull():
            p2p = await fresh_p2p(self.dht)
            try:
                return [(await fetch_params(p2p, pid, self.run, swarm, timeout_s=20))[0] for pid in peer_ids]
            finally:
                await p2p.shutdown()

        return asyncio.run(pull())

    def close(self) -> None:
        shutdown_dht(self.dht)
