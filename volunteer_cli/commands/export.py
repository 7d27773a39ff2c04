"""`volunteer export` (one model from the best peer of each swarm) and `volunteer eval` (test it)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from volunteer_cli.main import UserError
from volunteer.config import load_run

EXPORT_FORMAT = "volunteer-model-v1"
EXPORT_LISTEN = ["/ip4/127.0.0.1/tcp/0"]


EXPORT_TRIES_PER_DONOR = 2  # a cut stream is retried once before the next donor is asked


def export_order(records: list) -> list:
    """The copies to export from, best first: lowest loss EMA among live peers that can be dialled (not behind
    NAT), then those without a loss, most trained first. The next is asked when one fails."""
    from swarm.dht.records import dialable

    live = [r for r in dialable(records) if r.state in ("online", "paused", "finishing")]
    with_loss = sorted((r for r in live if r.loss >= 0), key=lambda r: (r.loss, -r.clock))
    return with_loss + sorted((r for r in live if r.loss < 0), key=lambda r: -r.clock)


def run_export(args: argparse.Namespace) -> int:
    run, _ = load_run(args.run)
    from volunteer_cli.commands.common import check_initial_peers

    check_initial_peers(args.initial_peers)
    initial_peers = args.initial_peers or run.bootstrap_peers
    if not initial_peers:
        raise UserError("no bootstrap peers: pass --initial-peers MADDR or list bootstrap_peers in the run config")
    out = Path(args.out).expanduser()
    if out.parent and not out.parent.exists():
        raise UserError(f"--out {out}: the folder {out.parent} does not exist")
    tokenizer_file = _hf_export_checks(run, out) if args.format == "hf" else None
    from volunteer_cli.commands.common import setup_process

    watchdog, _ = setup_process(args.verbose)
    from swarm.dht.dht import DHTSettings, DHTStartError, make_validators, shutdown_dht, start_dht
    from swarm.dht.membership import Membership

    dht = None
    try:
        settings = DHTSettings(initial_peers=list(initial_peers), host_maddrs=EXPORT_LISTEN, client_mode=True,
                               process_group=watchdog.pgid)
        try:
            dht = start_dht(settings, make_validators(run.run_id, run.swarm_names, None))
        except DHTStartError as exc:
            raise UserError(str(exc)) from None
        views = Membership(dht, run, b"").read_all()
        candidates = {}
        for name in run.swarm_names:
            candidates[name] = export_order(views.get(name, []))
            if not candidates[name]:
                raise UserError(f"swarm {name} has no live peer to export from; try again when it has one")
        delivered = asyncio.run(_download(dht, run, candidates, args.timeout_s))
        from volunteer_cli.commands.export_choice import choose_copies, measure

        states, donors, notes = _choose(run, delivered, choose_copies)
        for note in notes:
            print(f"scored here on the validation split: {note}", file=sys.stderr)
        print(f"exported run {run.run_id} from: " +
              ", ".join(f"{n} <- {d.peer_id[-8:]} (loss {d.loss:.3f}, clock {d.clock})" for n, d in donors.items()),
              file=sys.stderr)
    finally:
        if dht is not None:
            shutdown_dht(dht)
        watchdog.stop()
    payload = _assemble(run, states, donors, views)
    payload["measured"] = measure(run, states)  # the model's own test figures, recomputed here
    if tokenizer_file is not None:
        from swarm.run.hf_export import write_hf_dir

        write_hf_dir(out, run.model, payload["stages"], tokenizer_file)
    else:
        import torch

        torch.save(payload, out)
    measured = payload["measured"]
    figure = (f"test accuracy {measured['test_accuracy']:.2%}" if measured["test_accuracy"] is not None
              else f"test loss {measured['test_loss']:.4f}")
    print(json.dumps({"out": str(out), "format": args.format, "run_id": run.run_id, "reported": payload["reported"],
                      "measured": measured})
          if args.json else f"saved {out} ({figure}, measured here on {measured['test_samples']} test samples)")
    return 0


def _hf_export_checks(run, out: Path) -> Path:
    """Before any download: the run is a llama run, --out is a folder, and the run's tokenizer file is here."""
    from swarm.run.tokenizer import TokenizerError, load_tokenizer, tokenizer_path

    if run.model.kind != "llama":
        raise UserError(f"--format hf exports model.kind llama; run {run.run_id} is a {run.model.kind}: "
                        "use --format pt")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: --format hf writes a folder, and this is a file")
    try:
        load_tokenizer(run.data)
    except TokenizerError as exc:
        raise UserError(str(exc)) from None
    return tokenizer_path(run.data)


def _choose(run, delivered: dict, choose_copies) -> tuple[dict, dict, list[str]]:
    try:
        return choose_copies(run, delivered)
    except RuntimeError as exc:  # a copy whose names or shapes are not the run's stage
        raise UserError(f"a downloaded layer does not fit the run's model: {exc}") from None


async def _download(dht, run, candidates: dict, timeout_s: float) -> dict:
    """Each swarm's layer from its first ``EXPORT_CANDIDATES`` donors that deliver it: {swarm: [(record, state)]},
    scored afterwards (export_choice.py). A cut stream is retried, then the next donor is asked; only when every
    one failed is it an error, naming each failure."""
    from volunteer_cli.commands.export_choice import EXPORT_CANDIDATES

    from swarm.averaging.params_rpc import ParamsRefused, fetch_params
    from swarm.dht.dht import fresh_p2p

    p2p = await fresh_p2p(dht)
    try:
        delivered: dict[str, list] = {}
        for name, order in candidates.items():
            failures, got = [], delivered.setdefault(name, [])
            for donor in order:
                for _ in range(EXPORT_TRIES_PER_DONOR):
                    try:
                        state, _ = await fetch_params(p2p, donor.peer_id, run, name, timeout_s=timeout_s)
                        got.append((donor, state))
                        break
                    except (ConnectionError, asyncio.TimeoutError) as exc:  # a cut stream, a slow peer: again
                        failures.append(f"{donor.peer_id[-8:]}: {exc.__class__.__name__}: {exc}")
                    except (ParamsRefused, OSError, ValueError) as exc:
                        failures.append(f"{donor.peer_id[-8:]}: {exc}")
                        break
                if len(got) >= EXPORT_CANDIDATES:
                    break
                if not got or got[-1][0] is not donor:
                    print(f"could not download {name} from {donor.peer_id[-8:]}; trying the next peer",
                          file=sys.stderr)
            if not got:
                raise UserError(f"could not download {name} from any of its {len(order)} peer(s): "
                                + "; ".join(failures[-4:]))
        return delivered
    finally:
        await p2p.shutdown()


def _assemble(run, states: dict, donors: dict, views: dict) -> dict:
    from swarm.run.models import build_stage

    stages = []
    for k, name in enumerate(run.swarm_names):
        module = build_stage(run.model, k)
        try:
            module.load_state_dict(states[name], strict=True)  # names and shapes must match the run's stage
        except RuntimeError as exc:
            raise UserError(f"{name} from {donors[name].peer_id[-8:]} does not fit the run's model: {exc}") from None
        stages.append(module.state_dict())
    from swarm.dht.published import representative_evaluation

    latest, _ = representative_evaluation(views.get("layer0", []), run.training.eval_every_s)  # a claim: the median
    return {
        "format": EXPORT_FORMAT,
        "run": run.model_dump(mode="json"),
        "run_id": run.run_id,
        "stages": stages,
        "sources": {n: {"peer_id": d.peer_id, "loss": d.loss_or_none, "clock": d.clock} for n, d in donors.items()},
        "reported": None if latest is None else {
            "test_accuracy": latest.test_accuracy if latest.test_accuracy >= 0 else None,
            "test_loss": latest.test_loss if latest.test_loss >= 0 else None,
            "by": latest.peer_id, "state": latest.state,
        },
    }


def run_eval(args: argparse.Namespace) -> int:
    path = Path(args.model).expanduser()
    if not path.is_file():
        raise UserError(f"--model {path}: no such file (make one with `volunteer export --out {path}`)")
    import torch

    from swarm.run.data import load_dataset
    from swarm.run.local import evaluate
    from swarm.run.models import bits_per_char, perplexity

    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise UserError(f"--model {path}: not a model file written by `volunteer export` ({exc.__class__.__name__})") from None
    if not isinstance(payload, dict) or payload.get("format") != EXPORT_FORMAT:
        raise UserError(f"--model {path}: not a model file written by `volunteer export`")
    stored = _stored_run(path, payload)
    run = stored if args.run is None else load_run(args.run)[0]
    stages = _load_stages(path, payload, stored, run, args.run)
    from volunteer.preflight import PreflightError, check_run

    try:
        check_run(run, "auto")  # the test split loads and fits the model (eval reads the data as layer0 does)
    except PreflightError as exc:
        raise UserError(f"{args.run or f'the run config stored in {path}'}: {exc}") from None
    dataset = load_dataset(run.data, run.model)
    accuracy, loss = evaluate(stages, dataset, run.model)
    result = {"run_id": run.run_id, "test_accuracy": accuracy, "test_loss": loss, "test_samples": len(dataset.x_test)}
    lm = ""
    if dataset.kind == "language_model":  # loss: nats per token; a byte-level model's token is one byte
        result["bits_per_byte"] = result["bits_per_char"] = bits_per_char(loss, dataset.bytes_per_token)
        result["perplexity"], result["bytes_per_token"] = perplexity(loss), dataset.bytes_per_token
        lm = f", {result['bits_per_byte']:.3f} bits/byte, perplexity {result['perplexity']:.2f} per token"
    if args.json:
        print(json.dumps(result))
    else:
        acc = f"test accuracy {accuracy:.2%}, " if accuracy is not None else ""
        print(f"{run.run_id}: {acc}test loss {loss:.4f}{lm} on {result['test_samples']} test samples")
    return 0


def _stored_run(path: Path, payload: dict):
    """The run config the model was exported with."""
    from swarm.run.runconfig import RunConfig

    try:
        return RunConfig.model_validate(payload.get("run"))
    except ValueError:
        raise UserError(f"--model {path}: its run config does not load in this client version; pass the run "
                        "it was exported from with --run") from None


def _load_stages(path: Path, payload: dict, stored, run, run_arg: str | None) -> list:
    """The file's stages in ``run``'s model; a file from another model is a UserError naming the fields."""
    from swarm.run.models import build_stage

    states = payload.get("stages")
    fits = isinstance(states, list) and len(states) == run.model.stages
    stages = []
    for k, state in enumerate(states if fits else []):
        module = build_stage(run.model, k)
        try:
            module.load_state_dict(state, strict=True)
        except (RuntimeError, TypeError, AttributeError):
            fits = False
            break
        stages.append(module)
    if fits:
        return stages
    mine, theirs = run.model.model_dump(), stored.model.model_dump()
    differ = [f"model.{key}: {theirs[key]!r} in the file, {mine[key]!r} in --run" for key in mine
              if mine[key] != theirs[key]]
    detail = "; ".join(differ) if differ else "its stages do not fit its own run config"
    if run_arg is None:
        raise UserError(f"--model {path}: {detail}; export it again with `volunteer export`")
    raise UserError(f"--model {path} was exported from run {payload.get('run_id')}, whose model differs from "
                    f"--run {run_arg} ({run.run_id}): {detail}. Drop --run to evaluate it with the run config "
                    "stored in the file")
