"""Peer addresses (multiaddrs) checked by hand, before anything loads.

p2pd refuses a bad bootstrap address only after hivemind and torch have loaded and the DHT process
has started (9-20 s on a busy machine), with a raw ``P2PDaemonError``. A pure parser over the
standard library says what is wrong at once, with the shape a peer address must have.
"""

from __future__ import annotations

import ipaddress

PEER_MADDR_SHAPE = "/ip4/HOST/tcp/PORT/p2p/PEER_ID"
_BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_HOST_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6")
_SHA256_MULTIHASH = (0x12, 32)  # "Qm..." peer ids
_IDENTITY_MULTIHASH = 0x00  # "12D3KooW..." (an inlined public key)
_MAX_IDENTITY_BYTES = 42


def base58_decode(text: str) -> bytes | None:
    """Bitcoin-alphabet base58; None if a character is outside the alphabet."""
    number = 0
    for char in text:
        digit = _BASE58.find(char)
        if digit < 0:
            return None
        number = number * 58 + digit
    body = number.to_bytes((number.bit_length() + 7) // 8, "big") if number else b""
    return b"\0" * (len(text) - len(text.lstrip("1"))) + body


def peer_id_problem(text: str) -> str | None:
    """None for a libp2p peer id in base58 (Qm... or 12D3KooW...), else what is wrong with it."""
    raw = base58_decode(text) if text else None
    if raw is None:
        bad = sorted({c for c in text if c not in _BASE58})
        return f"the peer id {text!r} has characters a peer id never has ({''.join(bad)!r})" if bad else "the peer id is empty"
    if len(raw) == 2 + _SHA256_MULTIHASH[1] and (raw[0], raw[1]) == _SHA256_MULTIHASH:
        return None
    if len(raw) >= 2 and raw[0] == _IDENTITY_MULTIHASH and raw[1] == len(raw) - 2 <= _MAX_IDENTITY_BYTES:
        return None
    return f"{text!r} is not a peer id (copy the whole id, e.g. Qm... of 46 characters or 12D3KooW... of 52)"


def _host_problem(protocol: str, value: str) -> str | None:
    if protocol in ("ip4", "ip6"):
        try:
            (ipaddress.IPv4Address if protocol == "ip4" else ipaddress.IPv6Address)(value)
        except ValueError:
            return f"{value!r} is not an {protocol} address"
        return None
    return None if value and all(part for part in value.split(".")) else f"{value!r} is not a host name"


def _port_problem(value: str) -> str | None:
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        return f"{value!r} is not a port (1-65535)"
    return None


def _transport_problems(parts: list[str], index: int, any_port: bool = False) -> tuple[int, str | None]:
    """Parse /tcp/PORT or /udp/PORT/quic-v1 at ``index`` (``any_port``: 0 too, a listen address's "a free one");
    returns the next index and any problem."""
    if index >= len(parts) or parts[index] not in ("tcp", "udp"):
        found = f"/{parts[index]}" if index < len(parts) else "nothing"
        return index, f"expected /tcp/PORT after the host, found {found}"
    if index + 1 >= len(parts):
        return index + 1, f"/{parts[index]} has no port"
    problem = None if any_port and parts[index + 1] == "0" else _port_problem(parts[index + 1])
    if problem or parts[index] == "tcp":
        return index + 2, problem
    if index + 2 < len(parts) and parts[index + 2] == "quic-v1":
        return index + 3, None
    return index + 2, "a /udp address needs /quic-v1 after its port (the old /quic form is not supported)"


def _host_and_transport(text: str, what: str, any_port: bool = False) -> tuple[list[str], int, str | None]:
    """The parts of ``text``, the index after /HOST/tcp/PORT (or /udp/PORT/quic-v1), and what is wrong there."""
    if not text.startswith("/"):
        return [], 0, f"{what} starts with /"
    parts = text.strip("/").split("/")
    if parts[0] not in _HOST_PROTOCOLS:
        return parts, 0, f"it starts with /{parts[0]}, not /ip4, /ip6 or /dns4"
    if len(parts) < 2:
        return parts, 0, f"/{parts[0]} has no host"
    problem = _host_problem(parts[0], parts[1])
    if problem:
        return parts, 0, problem
    index, problem = _transport_problems(parts, 2, any_port)
    return parts, index, problem


def peer_maddr_problem(text: str) -> str | None:
    """None for a dialable peer address, else what is wrong with it (in words, without the shape)."""
    parts, index, problem = _host_and_transport(text, "a peer address")
    if problem:
        return problem
    if parts[index:index + 1] == ["p2p"] and parts[index + 2:index + 3] == ["p2p-circuit"]:  # through a relay
        problem = peer_id_problem(parts[index + 1])
        if problem:
            return f"relay: {problem}"
        index += 3
    if index >= len(parts):
        return "it has no /p2p/PEER_ID at the end"
    if parts[index] != "p2p" or index + 2 != len(parts):
        return f"expected /p2p/PEER_ID at the end, found /{'/'.join(parts[index:])}"
    return peer_id_problem(parts[index + 1])


def check_peer_maddrs(maddrs: list[str], source: str) -> None:
    """Raise ValueError naming ``source`` (e.g. "--initial-peers") for the first bad address."""
    for maddr in maddrs:
        problem = peer_maddr_problem(maddr)
        if problem:
            raise ValueError(
                f"{source}: {maddr!r} is not a peer address: {problem}. A peer address has the shape "
                f"{PEER_MADDR_SHAPE}; `volunteer bootstrap` prints the one to pass"
            )


LISTEN_MADDR_SHAPE = "/ip4/HOST/tcp/PORT (or /ip4/HOST/udp/PORT/quic-v1)"


def listen_maddr_problem(text: str, any_port: bool = True) -> str | None:
    """None for an address this machine can listen on (``any_port``: port 0 = a free one) or announce, else what is
    wrong with it: p2pd says so only after hivemind and torch have loaded, in its own words."""
    parts, index, problem = _host_and_transport(text, "an address", any_port)
    if problem:
        return problem
    if index != len(parts):
        return f"unexpected /{'/'.join(parts[index:])} after the port (no /p2p/PEER_ID here: that is this peer's own)"
    return None


def check_listen_maddrs(maddrs: list[str], source: str, any_port: bool = True) -> None:
    """Raise ValueError naming ``source`` (e.g. "--listen") for the first address this peer cannot listen on."""
    for maddr in maddrs:
        problem = listen_maddr_problem(maddr, any_port)
        if problem:
            example = "/ip4/127.0.0.1/tcp/0" if any_port else "/ip4/203.0.113.7/tcp/31337"
            raise ValueError(f"{source}: {maddr!r} is not an address to {'listen on' if any_port else 'announce'}: "
                             f"{problem}. Write {LISTEN_MADDR_SHAPE}, e.g. {example}"
                             + (" (port 0: a free one)" if any_port else ""))
