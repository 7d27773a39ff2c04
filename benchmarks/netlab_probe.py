"""Probes the network lab runs inside its hosts (plain sockets, standard library only, starts in ~50 ms).

    python benchmarks/netlab_probe.py sink ADDRESS PORT         accept one connection, read to EOF, print
                                                               {"bytes", "seconds" (first to last byte), "peer"}
    python benchmarks/netlab_probe.py send ADDRESS PORT BYTES   connect and send BYTES
    python benchmarks/netlab_probe.py echo ADDRESS PORT         accept one connection, echo until EOF
    python benchmarks/netlab_probe.py ping ADDRESS PORT COUNT   COUNT round trips of 64 bytes; print
                                                               {"rtt_ms": [...]}

A server prints "ready" on its first line once it listens. Every socket has a timeout (TIMEOUT_S).
"""

from __future__ import annotations

import json
import socket
import sys
import time

TIMEOUT_S = 30.0
CHUNK_BYTES = 64 * 1024
PING_BYTES = 64


def _listen(address: str, port: int) -> socket.socket:
    server = socket.create_server((address, port))
    server.settimeout(TIMEOUT_S)
    print("ready", flush=True)
    conn, _ = server.accept()
    conn.settimeout(TIMEOUT_S)
    server.close()
    return conn


def sink(address: str, port: int) -> dict:
    conn = _listen(address, port)
    total, first_s, last_s = 0, None, None
    peer = conn.getpeername()[0]
    while chunk := conn.recv(CHUNK_BYTES):
        last_s = time.monotonic()
        first_s = first_s or last_s
        total += len(chunk)
    conn.close()
    return {"bytes": total, "seconds": (last_s - first_s) if first_s else 0.0, "peer": peer}


def send(address: str, port: int, count: int) -> dict:
    conn = socket.create_connection((address, port), timeout=TIMEOUT_S)
    block = b"x" * CHUNK_BYTES
    left = count
    while left > 0:
        left -= conn.send(block[: min(left, CHUNK_BYTES)])
    conn.close()
    return {"sent": count}


def echo(address: str, port: int) -> dict:
    conn = _listen(address, port)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while chunk := conn.recv(CHUNK_BYTES):
        conn.sendall(chunk)
    conn.close()
    return {}


def ping(address: str, port: int, count: int) -> dict:
    conn = socket.create_connection((address, port), timeout=TIMEOUT_S)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(count):
        started = time.monotonic()
        conn.sendall(b"p" * PING_BYTES)
        got = 0
        while got < PING_BYTES:
            reply = conn.recv(PING_BYTES - got)
            if not reply:
                raise ConnectionError("the echo server closed the connection mid-ping")
            got += len(reply)
        rtts.append((time.monotonic() - started) * 1000.0)
    conn.close()
    return {"rtt_ms": rtts}


def main(argv: list[str]) -> int:
    mode, address, port, *rest = argv
    actions = {"sink": sink, "send": send, "echo": echo, "ping": ping}
    print(json.dumps(actions[mode](address, int(port), *map(int, rest))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
