"""`volunteer ...`: the command line. Heavy imports (torch, hivemind) happen inside commands only."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from volunteer import __version__

EXIT_USAGE = 2
# command -> (module, function): each command's heavy imports happen only when it runs
COMMANDS = {
    "join": ("volunteer_cli.commands.join", "run_join"),
    "bootstrap": ("volunteer_cli.commands.bootstrap", "run_bootstrap"),
    "status": ("volunteer_cli.commands.status", "run_status"),
    "ctl": ("volunteer_cli.commands.ctl", "run_ctl"),
    "doctor": ("volunteer_cli.commands.doctor", "run_doctor"),
    "service": ("volunteer_cli.commands.service", "run_service"),
    "export": ("volunteer_cli.commands.export", "run_export"),
    "eval": ("volunteer_cli.commands.export", "run_eval"),
    "demo": ("volunteer_cli.commands.demo", "run_demo"),
    "tokenizer": ("volunteer_cli.commands.tokenizer", "run_tokenizer"),
    "generate": ("volunteer_cli.commands.generate", "run_generate"),
}
EXIT_FAILURE = 1


class UserError(Exception):
    """A mistake the user can fix; printed without a traceback, exit status 2."""


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535; 0 picks a free one)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is outside 0-65535 (0 picks a free one)")
    return port


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive number of seconds")
    return value


def _seconds_or_zero(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 turns it off)") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be 0 (off) or a positive number of seconds")
    return value


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logs (-vv: debug)")


def _add_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", default=None, help="run config: a YAML path or a built-in run name (default: digits-mlp)")
    parser.add_argument("--initial-peers", nargs="+", default=None, metavar="MADDR",
                        help="bootstrap peers (default: bootstrap_peers of the run config)")


def add_join_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `volunteer join` (also checked by `volunteer service install`)."""
    parser.add_argument("--swarm", default="auto", help="layerK, or auto: the swarm that most needs capacity, "
                        "and later the one that becomes the bottleneck (see --rebalance-s)")
    parser.add_argument("--rebalance-s", type=_seconds_or_zero, default=60.0, metavar="S",
                        help="with --swarm auto: reconsider the swarm every S seconds and move to the bottleneck "
                        "swarm when it is short (0: stay where joined; default 60)")
    _add_run(parser)
    parser.add_argument("--headless", action="store_true", help="log lines instead of the terminal dashboard")
    parser.add_argument("--log-format", choices=("human", "json"), default="human")
    parser.add_argument("--prefs", default=None, help="volunteer.yaml with local preferences")
    parser.add_argument("--identity", default=None, help="identity key file (keeps the peer id across restarts)")
    parser.add_argument("--data-dir", default=None, help="checkpoints, identities, sockets")
    parser.add_argument("--listen", nargs="+", default=None, metavar="MADDR",
                        help="listen multiaddrs (default from preferences: all interfaces, random port)")
    parser.add_argument("--announce", nargs="+", default=None, metavar="MADDR")
    parser.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--new-run", action="store_true",
                        help="train this config's own run even when another run of the same name is active "
                             "with a different config (you may train alone)")
    _add_common(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="volunteer",
        description="Lend your GPU or CPU to train a neural network with other volunteers, one layer swarm at a time.",
    )
    parser.add_argument("--version", action="version", version=f"volunteer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    add_join_arguments(sub.add_parser("join", help="join a layer swarm and train it"))

    boot = sub.add_parser("bootstrap", help="host a long-lived bootstrap peer")
    boot.add_argument("--identity", default=None, help="identity key file (default: in the user data dir)")
    boot.add_argument("--listen", nargs="+", default=None, metavar="MADDR",
                      help="listen multiaddrs (default: all interfaces, TCP and QUIC port 31337)")
    boot.add_argument("--announce", nargs="+", default=None, metavar="MADDR")
    boot.add_argument("--initial-peers", nargs="+", default=None, metavar="MADDR", help="other bootstrap peers")
    boot.add_argument("--json", action="store_true", help='first stdout line: {"peer_id": ..., "maddrs": [...]}')
    boot.add_argument("--log-every-s", type=float, default=60.0, help="how often to log the number of known peers")
    _add_common(boot)

    status = sub.add_parser("status", help="show every swarm of a run")
    _add_run(status)
    status.add_argument("--json", action="store_true")
    status.add_argument("--timeout-s", type=float, default=30.0)
    status.add_argument("--serve", type=_port, default=None, metavar="PORT",
                        help="keep reading and serve the run health page on this port (0: a free one) until Ctrl+C")
    status.add_argument("--serve-host", default="127.0.0.1",
                        help="address the page listens on (default 127.0.0.1; 0.0.0.0 shows it to others)")
    status.add_argument("--every-s", type=_positive, default=5.0, help="--serve: seconds between reads of the DHT")
    status.add_argument("--data-dir", default=None,
                        help="where this machine's contribution is kept (default: preferences, then the user data dir)")
    status.add_argument("--prefs", default=None, help="volunteer.yaml with local preferences")
    _add_common(status)

    ctl = sub.add_parser("ctl", help="status, pause, finish, resume or quit the node running on this machine")
    ctl.add_argument("action", choices=("status", "pause", "finish", "resume", "quit"),
                     help="finish: complete in-flight work, then pause; quit: leave the swarm and stop")
    ctl.add_argument("--json", action="store_true", help="print the node's status snapshot as JSON")
    ctl.add_argument("--data-dir", default=None, help="the node's data dir (default: preferences, then the user data dir)")
    ctl.add_argument("--prefs", default=None, help="volunteer.yaml with local preferences")
    ctl.add_argument("--swarm", default=None, help="when several nodes run here: the one serving this swarm")
    ctl.add_argument("--run", default=None, help="when several nodes run here: the one of this run (name or id)")
    ctl.add_argument("--socket", default=None, help="the node's control socket (skips the search)")
    ctl.add_argument("--timeout-s", type=float, default=5.0, help="how long to wait for the node's answer")
    ctl.add_argument("--wait-s", type=float, default=30.0, help="quit: how long to wait for the node to stop")
    _add_common(ctl)

    doctor = sub.add_parser("doctor", help="check this machine: data dir, idle detection, bootstrap peers, GPU")
    _add_run(doctor)
    doctor.add_argument("--prefs", default=None, help="volunteer.yaml with local preferences")
    doctor.add_argument("--data-dir", default=None)
    doctor.add_argument("--json", action="store_true")
    doctor.add_argument("--timeout-s", type=float, default=20.0, help="how long to try the bootstrap peers")
    doctor.add_argument("--listen", nargs="+", default=None, metavar="MADDR",
                        help="where to listen for the reachability check (default: network.listen of --prefs, "
                             "else all interfaces as `volunteer join` does)")
    _add_common(doctor)

    service = sub.add_parser("service", help="run a headless node as a systemd user service (Linux)")
    service.add_argument("action", choices=("install", "uninstall"))
    service.add_argument("join_args", nargs=argparse.REMAINDER, metavar="JOIN ARGS",
                         help="arguments for `volunteer join` (--run, --initial-peers, --prefs, ...)")

    export = sub.add_parser("export", help="save one model assembled from the best peer of each swarm")
    _add_run(export)
    export.add_argument("--out", required=True, help="file to write (a torch state file), or with --format hf "
                        "a folder")
    export.add_argument("--format", choices=("pt", "hf"), default="pt", help="pt: one torch file for `volunteer "
                        "eval`; hf: a folder transformers loads (llama runs: config.json, model.safetensors, "
                        "tokenizer.json)")
    export.add_argument("--timeout-s", type=float, default=60.0, help="per-layer download timeout")
    export.add_argument("--json", action="store_true")
    _add_common(export)

    evaluate = sub.add_parser("eval", help="evaluate an exported model on the run's test split")
    evaluate.add_argument("--model", required=True, help="a file written by `volunteer export`")
    evaluate.add_argument("--run", default=None, help="override the run config stored in the file")
    evaluate.add_argument("--json", action="store_true")
    _add_common(evaluate)

    demo = sub.add_parser("demo", help="train a whole local swarm on this machine (real processes on loopback)")
    demo.add_argument("--run", default=None, help="run config: a YAML path or a built-in run name (default: digits-mlp)")
    demo.add_argument("--per-swarm", type=int, default=1, help="volunteers per layer swarm")
    demo.add_argument("--time-limit-s", type=_positive, default=180.0,
                      help="give up after this many seconds (default 180)")
    demo.add_argument("--target-accuracy", type=float, default=None,
                      help="classifiers: stop at this test accuracy (default: the run's training.target_accuracy)")
    demo.add_argument("--target-bits-per-byte", type=float, default=None,
                      help="language models: stop at this test loss in bits per byte or below "
                           "(default: the run's training.target_bits_per_byte)")
    demo.add_argument("--device", default="cpu", help="device of every volunteer: cpu, auto, cuda or cuda:N")
    demo.add_argument("--json", action="store_true", help="last stdout line: a JSON summary")
    _add_common(demo)
    _add_language_model_commands(sub)
    return parser


def _add_language_model_commands(sub: argparse._SubParsersAction) -> None:
    tokenizer = sub.add_parser("tokenizer", help="train the byte-level BPE tokenizer a llama run names")
    tokenizer.add_argument("action", choices=("train",))
    tokenizer.add_argument("--corpus", nargs="+", required=True, metavar="PATH",
                           help="text files (.txt, .jsonl with a text field, or either gzipped)")
    tokenizer.add_argument("--vocab-size", type=int, default=2048, help="tokens in the vocabulary (default 2048)")
    tokenizer.add_argument("--out", required=True, help="the tokenizer.json to write")
    tokenizer.add_argument("--json", action="store_true")
    _add_common(tokenizer)

    generate = sub.add_parser("generate", help="sample text from a model exported with `export --format hf`")
    generate.add_argument("--model", required=True, help="the folder `volunteer export --format hf` wrote")
    generate.add_argument("--prompt", default="", help="the text to continue")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.8, help="0: always the likeliest token")
    generate.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    generate.add_argument("--seed", type=int, default=None, help="seed the sampling, for a repeatable text")
    generate.add_argument("--backend", choices=("auto", "own", "transformers"), default="auto",
                          help="own: this client's modules; transformers: its LlamaForCausalLM; auto: transformers "
                               "when installed")
    _add_common(generate)



def entry() -> None:
    """The `volunteer` command and `python -m volunteer_cli`: ``main``, then the process ends without finalizing its
    interpreter (``end_process``: ~1 s after the work is done, gone). ``main`` itself returns its code."""
    from volunteer.hygiene import end_process

    end_process(main())


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit: a reader that left (`| head -1`) is caught below
        return code
    except KeyboardInterrupt:  # before a command installs its own handler (join: volunteer/hygiene.py)
        print("stopping… interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _reader_left()


def _reader_left() -> int:
    """stdout's reader closed the pipe (`volunteer ctl resume | head -1`): the command did its work, and
    what it had left to print has nobody to read it. Exit as a program killed by SIGPIPE does, quietly."""
    import os
    import signal

    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush must not fail again
    return 128 + signal.SIGPIPE


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    from volunteer.config import ConfigError
    from volunteer.preflight import PreflightError

    from swarm.dht.lightdht import light_hivemind

    # hivemind shares its futures' buffers by file name, through a torch_shm_manager it starts at the DHT's first
    # start: a SIGTERM or Ctrl+C that lands while that manager comes up left torch's client spinning at 100 % CPU for
    # good, in C, where no Python handler runs (a bootstrap stopped 1.5 s after launch: only SIGKILL ended it; the
    # demo waited 20 s for it). File descriptors need no manager. A user's own setting wins.
    os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")
    light_hivemind()  # every command: hivemind's parts without the averager's scipy, the MoE server, the optimizer
    try:
        module_name, function_name = COMMANDS[args.command]
        return getattr(importlib.import_module(module_name), function_name)(args)
    except (ConfigError, UserError, PreflightError) as exc:
        print(f"volunteer {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
