"""`volunteer bootstrap`: a long-lived DHT peer that others join through."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from volunteer_cli.main import UserError
from volunteer.prefs import DEFAULT_PORT

logger = logging.getLogger("volunteer.bootstrap")
DEFAULT_BOOTSTRAP_LISTEN = [f"/ip4/0.0.0.0/tcp/{DEFAULT_PORT}", f"/ip4/0.0.0.0/udp/{DEFAULT_PORT}/quic-v1"]


async def _count_peers(dht, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


def _check_local(identity: Path, listen: list[str] | None) -> None:
    """The identity's folder takes files and no other process listens on our ports, before anything loads: a
    second bootstrap peer on a taken port would otherwise start, share it (SO_REUSEPORT), and print addresses
    that reach the first one."""
    from volunteer.preflight import check_listen_free, check_writable_parent

    check_writable_parent(identity, "identity", "pass --identity with a path in a folder you can write to "
                          "(or set VOLUNTEER_DATA_DIR)")
    if listen:
        check_listen_free(listen, "--listen")
    else:
        check_listen_free(DEFAULT_BOOTSTRAP_LISTEN, "listen address", f"pass --listen with another port, e.g. "
                          f"/ip4/0.0.0.0/tcp/{DEFAULT_PORT + 1} /ip4/0.0.0.0/udp/{DEFAULT_PORT + 1}/quic-v1")


def run_bootstrap(args: argparse.Namespace) -> int:
    from swarm.dht.lightdht import light_hivemind
    from volunteer_cli.commands.common import check_initial_peers, check_own_maddrs, setup_process

    light_hivemind()  # a bootstrap peer needs hivemind's DHT and P2P, not its averaging (scipy) or MoE packages
    from volunteer.paths import user_data_dir

    check_initial_peers(args.initial_peers)
    check_own_maddrs(args.listen, args.announce)
    identity = Path(args.identity).expanduser() if args.identity else user_data_dir() / "bootstrap" / "identity.key"
    _check_local(identity, args.listen)

    watchdog, shutdown = setup_process(args.verbose)
    from swarm.dht.dht import (DHTSettings, DHTStartError, IdentityInUse, claim_identity, make_validators, shutdown_dht,
                           start_dht, visible_maddrs)

    dht = lock = None
    try:
        try:
            identity, lock = claim_identity(identity, identity.parent)
        except IdentityInUse as exc:
            raise UserError(str(exc)) from None
        settings = DHTSettings(
            initial_peers=args.initial_peers or [],
            host_maddrs=args.listen or DEFAULT_BOOTSTRAP_LISTEN,
            announce_maddrs=args.announce or [],
            identity_path=identity,
            process_group=watchdog.pgid,
        )
        try:
            # Signatures are checked for every run; schemas are per run and live on the volunteers.
            dht = start_dht(settings, make_validators(None, [], identity))
        except DHTStartError as exc:
            raise UserError(str(exc)) from None
        maddrs = visible_maddrs(dht)
        if args.json:
            print(json.dumps({"peer_id": str(dht.peer_id), "maddrs": maddrs}), flush=True)
        else:
            print(f"bootstrap peer {dht.peer_id} is up (identity {identity}).", flush=True)
            print("Volunteers join with one of:", flush=True)
            for maddr in maddrs:
                print(f"  volunteer join --initial-peers {maddr}", flush=True)
        started = time.monotonic()
        while not shutdown.event.wait(args.log_every_s):
            try:
                known = dht.run_coroutine(_count_peers)
            except Exception as exc:
                logger.warning("could not count peers: %s", exc)
                continue
            print(f"{time.strftime('%H:%M:%S')} {known} peers known, up {time.monotonic() - started:.0f} s",
                  file=sys.stderr, flush=True)
        print("shutting down", file=sys.stderr, flush=True)
        return 0
    finally:
        if dht is not None:
            shutdown_dht(dht)
        if lock is not None:
            lock.release()
        watchdog.stop()
