"""What can be checked before a node joins the DHT, each failure one line with the field and the fix.

A mistake found after the join costs the volunteer 10-60 s, a traceback, and litter: the run is
listed under its name in the DHT, and every later joiner of that name is warned about it. So a
command checks here first, and announces nothing until these pass:

- ``private_dir``, ``check_writable_parent``: the data dir and the identity file's folder can be
  written (a read-only disk, a file where a folder should be);
- ``check_listen_free``: no other process listens on an explicit listen port (libp2p shares ports
  with SO_REUSEPORT, so a second p2pd on a taken port starts without error and answers nothing);
- ``check_run``: the data loads, the model's stages chain, and the head fits the labels.

Everything but ``check_run`` uses the standard library only: the CLI calls those before torch loads.
"""

from __future__ import annotations

import errno
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHAIN_CHECK_BATCH = 2  # samples pushed through the stages to check that they chain
_PORT_ERRNOS = {errno.EADDRINUSE: "is already in use on this machine (another `volunteer bootstrap` or `join`?)",
                errno.EACCES: "needs privileges to listen on (ports below 1024 need root)"}


class PreflightError(ValueError):
    """A check before joining failed; the message names what to change and how."""


# ----- folders
def private_dir(path: Path, what: str, fix: str) -> Path:
    """Create ``path`` (mode 0700, like paths.ensure_private_dir) and check a file can be written in it."""
    from volunteer.paths import ensure_private_dir

    try:
        ensure_private_dir(path)
        _probe_write(path)
    except OSError as exc:
        raise PreflightError(f"{what} {path}: cannot write there ({_reason(exc)}); {fix}") from None
    return path


def check_writable_parent(file: Path, what: str, fix: str) -> None:
    """``file`` (an identity key and its lock) can be created or locked: its folder exists or can be made,
    and takes new files."""
    folder = file.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _probe_write(folder)
    except OSError as exc:
        raise PreflightError(f"{what} {file}: cannot write in {folder} ({_reason(exc)}); {fix}") from None


def _probe_write(folder: Path) -> None:
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
        pass


def _reason(exc: OSError) -> str:
    return exc.strerror or exc.__class__.__name__


# ----- listen ports
@dataclass(frozen=True, slots=True)
class Endpoint:
    """One socket a listen multiaddr asks for."""

    maddr: str
    family: int  # socket.AF_INET or AF_INET6
    host: str
    transport: str  # "tcp" or "udp"
    port: int


def listen_endpoints(maddrs: list[str]) -> list[Endpoint]:
    """The sockets with an explicit port that ``maddrs`` ask for (port 0 picks a free one: nothing to check;
    an address this parser does not know is left to p2pd)."""
    out: list[Endpoint] = []
    for maddr in maddrs:
        parts = maddr.strip("/").split("/")
        if len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] not in ("tcp", "udp"):
            continue
        if not parts[3].isdigit() or int(parts[3]) == 0:
            continue
        family = socket.AF_INET if parts[0] == "ip4" else socket.AF_INET6
        out.append(Endpoint(maddr, family, parts[1], parts[2], int(parts[3])))
    return out


def check_listen_free(maddrs: list[str], source: str, fix: str = "choose another port, or 0 for a free one") -> None:
    """Raise PreflightError naming ``source`` (e.g. "--listen") when a listen port is taken here."""
    for endpoint in listen_endpoints(maddrs):
        code = _bind_errno(endpoint)
        if code in _PORT_ERRNOS:
            raise PreflightError(
                f"{source} {endpoint.maddr}: {endpoint.transport.upper()} port {endpoint.port} "
                f"{_PORT_ERRNOS[code]}: {fix}"
            )


def _bind_errno(endpoint: Endpoint) -> int | None:
    """The errno of binding the endpoint's socket, None when it binds. No SO_REUSEPORT: a p2pd that holds the
    port with it still refuses us. TCP sets SO_REUSEADDR as p2pd does, so a port in TIME_WAIT counts as free."""
    kind = socket.SOCK_STREAM if endpoint.transport == "tcp" else socket.SOCK_DGRAM
    try:
        with socket.socket(endpoint.family, kind) as probe:
            if kind == socket.SOCK_STREAM:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((endpoint.host, endpoint.port))
    except OSError as exc:
        return exc.errno
    return None


# ----- the run's model against its data
def needs_data(run: Any, swarm: str) -> bool:
    """Whether a node of ``swarm`` loads the run's data: layer0 drives with it, the last stage looks its labels
    up, best-model exchange scores copies on it; an auto node may move to any swarm."""
    last = f"layer{run.model.stages - 1}"
    return swarm in ("auto", "layer0", last) or run.averaging.exchange.every_samples > 0


def check_run(run: Any, swarm: str) -> None:
    """The stages chain, and (where this node needs the data) the data loads, cuts into the run's shards, and
    fits the first stage's input and the head. Raises PreflightError with the field and the fix."""
    check_stages_chain(run.model)
    if not needs_data(run, swarm):
        return
    from swarm.run.data import load_dataset, make_shards

    try:
        dataset = load_dataset(run.data, run.model)
        make_shards(dataset.y_train, run.data, dataset.num_classes)
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    except OSError as exc:
        raise PreflightError(f"data.path {run.data.path!r}: cannot read it ({_reason(exc)})") from None
    check_data_fits(run.model, dataset)


def check_stages_chain(model: Any) -> None:
    """Push a small batch through every stage, built one at a time on the CPU: each stage must take the one
    before's output and the last must give the run's logits. (The shipped models take tens of ms; the meta
    device would need no weights, but its first use costs a join 0.5-2 s of imports.)"""
    import torch

    from swarm.run.models import build_stage, stage_input_spec, stage_output_spec

    with torch.no_grad():
        x = stage_input_spec(model, 0).example(CHAIN_CHECK_BATCH)
        for index in range(model.stages):
            problem = stage_input_spec(model, index, CHAIN_CHECK_BATCH).mismatch(x)
            if problem:
                raise PreflightError(f"model: stage {index} cannot take stage {index - 1}'s output ({problem}); "
                                     "check model.kind and its widths")
            try:
                x = build_stage(model, index).eval()(x)
            except RuntimeError as exc:
                raise PreflightError(f"model: stage {index} fails on its own input ({exc}); check model.kind and "
                                     "its widths") from None
        problem = stage_output_spec(model, model.stages - 1, CHAIN_CHECK_BATCH).mismatch(x)
        if problem:
            raise PreflightError(f"model: the last stage returns {problem}; check model.num_classes / vocab_size")


def check_data_fits(model: Any, dataset: Any) -> None:
    """The first stage takes the data's samples, and the head has an output for every label."""
    from swarm.run.models import stage_input_spec, stage_output_spec

    problem = stage_input_spec(model, 0).mismatch(dataset.x_train[:1])
    if problem:
        raise PreflightError(f"the data's samples do not fit the first stage ({problem}); "
                             "set model.input_dim (or model.seq_len) to the data's")
    outputs = stage_output_spec(model, model.stages - 1).shape[-1]
    largest = dataset.largest_label()
    if largest >= outputs:
        field = "model.num_classes" if model.kind == "mlp" else "model.vocab_size"
        raise PreflightError(f"the data has labels up to {largest} but the head has {outputs} outputs; "
                             f"set {field} to at least {largest + 1}")
