"""Starting a hivemind DHT for a run: identity, validators, addresses, and a reapable process group.

The record-signing key *is* the libp2p identity key (loaded from the identity file), so each
peer has its own key, a restarted peer still owns its old subkey, and readers can check that
a record's peer id belongs to the key that signed it (see records.py).
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _apply_hivemind_fixes() -> None:
    """swarm/dht/hivemind_fixes.py, before any P2P client exists (here, not at import: `volunteer status` imports
    this module and must not import hivemind's torch)."""
    from swarm.dht import hivemind_fixes

    hivemind_fixes.apply()

LOOPBACK_MADDRS = ("/ip4/127.0.0.1/tcp/0",)

# hivemind DHTNode settings for a run's nodes (benchmarks/dht_scale.py measured them at 64 peers). A get with
# latest=True crawls the key's neighbourhood with a beam of bucket_size (20) nodes, and every node that holds
# the key returns the whole swarm: a beam of num_replicas (5, the nodes a store writes to) finds the same
# records at about half the CPU. hivemind also re-reads every key a node has read, in the background, before
# its cached copy expires (cache_refresh_before_expiry), and pushes what it found to one more node
# (cache_nearest): our reads always ask for the latest value and never use those copies, so both are off.
NODE_TUNING: dict[str, Any] = {"cache_nearest": 0, "cache_refresh_before_expiry": 0}
GET_BEAM = 5


class DHTStartError(RuntimeError):
    """The DHT could not start or reach its bootstrap peers; the message says what to try."""


class IdentityInUse(RuntimeError):
    pass


@dataclass(slots=True, kw_only=True)
class DHTSettings:
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: list(LOOPBACK_MADDRS))
    announce_maddrs: list[str] = field(default_factory=list)
    identity_path: Path | None = None
    use_relay: bool = True
    use_auto_relay: bool = False
    client_mode: bool = False
    start_timeout_s: float = 60.0
    process_group: int | None = None  # move the DHT process (and its p2pd) into this group
    close_fds_in_child: tuple[int, ...] = ()


# ----- identity


def ensure_identity(path: Path) -> None:
    from hivemind.p2p import P2P

    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))


def load_identity_key(path: Path) -> Any:
    """The hivemind RSAPrivateKey held in a libp2p identity file (protobuf PrivateKey, RSA, DER)."""
    from cryptography.hazmat.primitives import serialization
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    proto = crypto_pb2.PrivateKey.FromString(path.read_bytes())
    if proto.key_type != crypto_pb2.KeyType.RSA:
        raise ValueError(f"{path}: identity is not an RSA key; delete it to generate a new one")
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = serialization.load_der_private_key(proto.data, password=None)
    return key


def identity_peer_id(path: Path) -> str:
    """The libp2p peer id of an identity file, without starting anything (the id its records must carry)."""
    from swarm.dht.records import peer_id_from_public_key, public_key_of_subkey
    from swarm.dht.validators import validator_classes

    signature_class, _ = validator_classes()
    return peer_id_from_public_key(public_key_of_subkey(signature_class(load_identity_key(path)).local_public_key))


def receipt_seed(identity_path: Path, run_id: str) -> bytes:
    """The seed of this peer's per-run receipt key (swarm/integrity/receipts.py): derived from the identity's
    private key and the run id, so a restarted peer signs with the key it signed with before, and a key of one
    run says nothing about another."""
    import hashlib

    return hashlib.blake2b(identity_path.read_bytes(), digest_size=32, person=b"volunteer-rcpt",
                           salt=hashlib.blake2b(run_id.encode(), digest_size=16).digest()).digest()


class IdentityLock:
    """An exclusive lock on an identity file, so two local processes never share one peer id.

    hivemind can check that an identity is free by asking the network (~0.35 s per start); a local
    lock is instant and also covers the common case: several volunteers on one machine.
    """

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(str(self.path) + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def claim_identity(explicit: Path | None, data_dir: Path) -> tuple[Path, IdentityLock]:
    """Lock the identity to use: ``explicit`` if given, else the first free slot in ``data_dir``."""
    if explicit is not None:
        lock = IdentityLock(explicit)
        if not lock.acquire():
            raise IdentityInUse(
                f"the identity {explicit} is in use by another volunteer process on this machine; "
                "stop that process or pass another --identity"
            )
        ensure_identity(explicit)
        return explicit, lock
    for slot in range(256):
        path = data_dir / "identities" / f"identity-{slot}.key"
        lock = IdentityLock(path)
        if lock.acquire():
            ensure_identity(path)
            return path, lock
    raise IdentityInUse(f"all identity slots in {data_dir / 'identities'} are in use")


# ----- the DHT


def make_validators(run_id: str | None, swarm_names: list[str], identity_path: Path | None) -> list[Any]:
    from swarm.dht.records import membership_schema
    from swarm.dht.validators import validator_classes

    signature_class, schema_class = validator_classes()
    key = load_identity_key(identity_path) if identity_path is not None else None
    validators: list[Any] = [signature_class(key)]
    if run_id is not None:
        validators.append(schema_class(membership_schema(swarm_names), allow_extra_keys=True, prefix=run_id))
    return validators


def start_dht(settings: DHTSettings, validators: list[Any]) -> Any:
    """Start a DHT process; raise DHTStartError with advice when it fails."""
    _apply_hivemind_fixes()
    from hivemind import DHT

    class _GroupedDHT(DHT):
        """The DHT process joins a process group that the client's watchdog can reap (with p2pd)."""

        def run(self) -> None:
            # Only our main process decides when the DHT stops (it announces offline first); a stray
            # SIGTERM to the whole group (systemd, pkill) must not kill it mid-leave. The watchdog
            # still SIGKILLs it if the main process dies.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            for fd in settings.close_fds_in_child:
                try:
                    os.close(fd)
                except OSError:
                    pass
            if settings.process_group is not None:
                try:
                    os.setpgid(0, settings.process_group)
                except OSError as exc:  # the watchdog is gone: we still run, just less protected
                    logger.debug("could not join process group %s: %s", settings.process_group, exc)
            super().run()

    dht = _GroupedDHT(start=False, record_validators=validators, **node_kwargs(settings))
    try:
        dht.run_in_background(await_ready=True, timeout=settings.start_timeout_s)
    except Exception as exc:  # hivemind raises plain exceptions for bootstrap failures
        shutdown_dht(dht)
        raise start_error(exc, settings) from None
    return dht


def node_kwargs(settings: DHTSettings) -> dict[str, Any]:
    """hivemind DHTNode.create's arguments for these settings (``hivemind.DHT`` passes them on as they are)."""
    kwargs: dict[str, Any] = dict(
        initial_peers=settings.initial_peers or None,
        host_maddrs=settings.host_maddrs,
        use_relay=settings.use_relay,
        use_auto_relay=settings.use_auto_relay,
        client_mode=settings.client_mode,
        check_if_identity_free=False,  # we hold a local lock on the identity file instead
        **NODE_TUNING,
    )
    if settings.announce_maddrs:
        kwargs["announce_maddrs"] = settings.announce_maddrs
    if settings.identity_path is not None:
        kwargs["identity_path"] = str(settings.identity_path)
    return kwargs


def start_error(exc: BaseException, settings: DHTSettings) -> DHTStartError:
    """Why a DHT node did not start, with what to try."""
    if isinstance(exc, TimeoutError):
        return DHTStartError(f"the DHT did not start within {settings.start_timeout_s:.0f} s; "
                             "check that the listen addresses are free (another process on the same port?)")
    return DHTStartError(explain_start_failure(exc, settings.initial_peers))


def explain_start_failure(exc: BaseException, initial_peers: list[str]) -> str:
    text = f"{exc.__class__.__name__}: {exc}"
    if "bootstrap" in text.lower() or "initial" in text.lower() or "connect" in text.lower():
        peers = ", ".join(initial_peers) or "(none)"
        return (
            f"could not reach any bootstrap peer ({peers}): {text}. Check that a bootstrap peer is running "
            "(`volunteer bootstrap` prints the address to pass), that the address includes /p2p/<peer id>, "
            "and that no firewall blocks the port"
        )
    if "address already in use" in text.lower() or "bind" in text.lower():
        return f"a listen address is taken: {text}. Use another port (port 0 picks a free one)"
    return f"the DHT failed to start: {text}"


def visible_maddrs(dht: Any) -> list[str]:
    return [str(maddr) for maddr in dht.get_visible_maddrs()]


def shutdown_dht(dht: Any, timeout_s: float = 5.0) -> None:
    """Stop the DHT process in order, or kill it (it ignores SIGTERM, so hivemind's fallback would not)."""
    try:
        dht.shutdown()
    except Exception as exc:
        logger.debug("DHT shutdown: %s", exc)
    dht.join(timeout_s)
    if dht.is_alive():
        logger.warning("the DHT process did not stop in %.0f s; killing it", timeout_s)
        dht.kill()
        dht.join(timeout_s)


async def fresh_p2p(dht: Any) -> Any:
    """A new P2P replica of the DHT's daemon for the calling event loop.

    ``DHT.replicate_p2p`` caches one replica per process; once that one is shut down (or its event
    loop closed) every later call gets the dead one back. Each runtime that owns a loop owns its replica.
    """
    _apply_hivemind_fixes()
    from hivemind import DHT
    from hivemind.p2p import P2P

    if hasattr(dht, "daemon_listen_maddr"):  # swarm/dht/nodedht.py: the node runs in this process, on another loop
        maddr = dht.daemon_listen_maddr()
    else:
        maddr = await dht.run_coroutine(DHT._get_p2p_daemon_listen_maddr, return_future=True)
    return await P2P.replicate(maddr)
