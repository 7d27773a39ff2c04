"""What an identity costs (swarm/integrity/identity_work.py), against what it cost before: one RSA-2048 key.

For ``--ids`` fresh peer ids (real libp2p identities, as `volunteer join` makes them) the same process measures:

- ``keygen_s``: CPU seconds to make the identity (hivemind's RSA-2048 key pair): the whole price of an identity
  before identity work;
- ``work_s``: CPU seconds to find its proof at the run's default ``integrity.identity_bits`` (the luck of the draw
  spreads it: the mean is the price, the p95 what an unlucky volunteer waits);
- ``verify_ms``: what a reader pays to check one record's proof (once per peer and nonce);
- ``python_sha256_per_s`` and ``scrypt_per_s``: the rates of the two puzzles a volunteer could run in Python, to
  show why a plain-hash puzzle would tax volunteers (a Python loop) more than attackers (native code).

Prints one JSON object with ``identity_cost_vs_keygen`` = (keygen_s + work_s) / keygen_s (means: what an identity
costs now against before) and ``python_sha256_vs_scrypt_evaluations_per_s``.

    python -m benchmarks.identity_work --json [--ids 24] [--bits B]
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import finish, machine_notes, median, parser, percentile, rounded, say


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = _parser().parse_args(argv)
    from swarm.dht.dht import identity_peer_id
    from swarm.integrity import identity_work as iw
    from swarm.run.runconfig import DEFAULT_IDENTITY_BITS

    bits = DEFAULT_IDENTITY_BITS if args.bits is None else args.bits
    keygen, work, verify, evaluations = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="volunteer-idwork-") as tmp:
        from hivemind.p2p import P2P

        for k in range(args.ids):
            path = Path(tmp) / f"identity-{k}.key"
            t = time.process_time()
            P2P.generate_identity(str(path))
            keygen.append(time.process_time() - t)
            peer = identity_peer_id(path)
            t = time.process_time()
            nonce = iw.find_work(peer, bits)
            work.append(time.process_time() - t)
            evaluations.append(nonce + 1)
            iw._verified.clear()
            t = time.perf_counter()
            assert iw.has_work(peer, nonce, bits)
            verify.append(time.perf_counter() - t)
            say(f"identity {k + 1}/{args.ids}: key {keygen[-1]:.3f} s, work {work[-1]:.2f} s ({nonce + 1} evaluations)")
    rates = _rates()
    mean_keygen, mean_work = sum(keygen) / len(keygen), sum(work) / len(work)
    report: dict[str, Any] = {
        "machine": machine_notes(), "bits": bits, "ids": args.ids,
        "keygen_s": {"mean": mean_keygen, "median": median(keygen)},
        "work_s": {"mean": mean_work, "median": median(work), "p95": percentile(work, 95), "max": max(work)},
        "evaluations": {"mean": sum(evaluations) / len(evaluations), "expected": 2**bits},
        "verify_ms": {"median": 1000 * median(verify), "p95": 1000 * percentile(verify, 95)},
        **rates,
        "identity_cost_vs_keygen": (mean_keygen + mean_work) / mean_keygen,
        "python_sha256_vs_scrypt_evaluations_per_s": rates["python_sha256_per_s"] / rates["scrypt_per_s"],
    }
    return finish(rounded(report), "identity_work", started, args)


def _rates(seconds: float = 1.0) -> dict[str, float]:
    """Evaluations a second of the scrypt puzzle and of a SHA-256 puzzle's loop in Python, on this core."""
    from swarm.integrity.identity_work import work_digest

    def rate(step) -> float:
        n, t = 0, time.process_time()
        while time.process_time() - t < seconds:
            for _ in range(64):
                step(n)
                n += 1
        return n / (time.process_time() - t)

    prefix = hashlib.sha256(b"volunteer identity work v1/QmPeer")

    def sha_step(n: int) -> None:
        h = prefix.copy()
        h.update(n.to_bytes(8, "little"))
        h.digest()

    return {"scrypt_per_s": rate(lambda n: work_digest("QmPeer", n)), "python_sha256_per_s": rate(sha_step)}


def _parser() -> argparse.ArgumentParser:
    p = parser("identity_work", __doc__)
    p.add_argument("--ids", type=int, default=24, help="fresh identities to make and prove")
    p.add_argument("--bits", type=int, default=None, help="the work's bits (default: the run config's default)")
    return p


if __name__ == "__main__":
    raise SystemExit(main())
