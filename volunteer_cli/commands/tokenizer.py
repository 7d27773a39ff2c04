"""`volunteer tokenizer train`: learn the byte-level BPE a llama run names in ``data.tokenizer``.

Prints the file's sha256 (what ``data.tokenizer_sha256`` pins) and its vocabulary size (what
``model.vocab_size`` must reach). Progress: the bytes read so far on stderr, and the library's own bars on a
terminal.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from volunteer_cli.main import UserError

PROGRESS_EVERY_S = 2.0


def run_tokenizer(args: argparse.Namespace) -> int:
    from swarm.run.tokenizer import file_sha256, train_tokenizer

    paths = [Path(p).expanduser() for p in args.corpus]
    out = Path(args.out).expanduser()
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: the folder {out.parent} does not exist")
    total = sum(p.stat().st_size for p in paths if p.is_file())
    started = time.monotonic()
    progress = _Progress(total, quiet=args.json)
    try:
        tokenizer = train_tokenizer(paths, args.vocab_size, show_progress=sys.stderr.isatty() and not args.json,
                                    on_read=progress)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    tokenizer.save(str(out))
    digest = file_sha256(out)
    result = {"out": str(out), "vocab_size": tokenizer.get_vocab_size(), "sha256": digest,
              "corpus_bytes": total, "seconds": round(time.monotonic() - started, 2)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"saved {out}: {result['vocab_size']} tokens from {total / 1e6:.1f} MB (on disk) in {result['seconds']:.1f} s\n"
              f"in the run config:\n  data:\n    tokenizer: {out}\n    tokenizer_sha256: {digest}\n"
              f"  model:\n    vocab_size: {result['vocab_size']}")
    return 0


class _Progress:
    """Called with the bytes (on disk) read so far; prints at most every PROGRESS_EVERY_S seconds."""

    def __init__(self, total: int, quiet: bool):
        self.total, self.quiet = max(total, 1), quiet
        self.last = float("-inf")
        self.shown = -1

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if self.quiet or done == self.shown or (now - self.last < PROGRESS_EVERY_S and done < self.total):
            return
        self.last, self.shown = now, done
        print(f"tokenizer: read {done / 1e6:.1f} of {self.total / 1e6:.1f} MB ({done / self.total:.0%})",
              file=sys.stderr, flush=True)
