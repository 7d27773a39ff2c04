"""`volunteer generate`: continue a prompt with a model written by `volunteer export --format hf`.

Backends: ``own`` (this client's modules, swarm/run/generation.py: no transformers needed) or ``transformers``
(its LlamaForCausalLM and ``generate``); ``auto`` takes transformers when it is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from volunteer_cli.main import UserError


def run_generate(args: argparse.Namespace) -> int:
    folder = Path(args.model).expanduser()
    if not (folder / "config.json").is_file() or not (folder / "tokenizer.json").is_file():
        raise UserError(f"--model {folder}: not a folder written by `volunteer export --format hf` (it needs "
                        "config.json, model.safetensors and tokenizer.json)")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens}: give at least 1")
    if args.temperature < 0:
        raise UserError(f"--temperature {args.temperature}: give 0 (the likeliest token) or more")
    backend = args.backend
    has_transformers = importlib.util.find_spec("transformers") is not None
    if backend == "auto":
        backend = "transformers" if has_transformers else "own"
    elif backend == "transformers" and not has_transformers:
        raise UserError("--backend transformers: transformers is not installed (pip install 'volunteer[hf]'), "
                        "or use --backend own")
    from tokenizers import Tokenizer

    from swarm.run.tokenizer import END_OF_TEXT

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    stop = tokenizer.token_to_id(END_OF_TEXT)
    prompt = tokenizer.encode(args.prompt).ids if args.prompt else [stop if stop is not None else 0]
    generate = _with_transformers if backend == "transformers" else _with_own_modules
    new_ids = generate(folder, prompt, stop, args)
    text = tokenizer.decode(new_ids)
    sys.stdout.write(args.prompt + text + ("\n" if not text.endswith("\n") else ""))
    if args.verbose:
        print(json.dumps({"backend": backend, "prompt_tokens": len(prompt), "new_tokens": len(new_ids)}),
              file=sys.stderr)
    return 0


def _with_own_modules(folder: Path, prompt: list[int], stop: int | None, args: argparse.Namespace) -> list[int]:
    from swarm.run.generation import generate_ids, load_own_model
    from swarm.run.hf_export import HFExportError

    try:
        model, context = load_own_model(folder)
    except HFExportError as exc:
        raise UserError(str(exc)) from None
    return generate_ids(model, prompt, args.max_new_tokens, context, args.temperature, args.top_k, stop, args.seed)


def _with_transformers(folder: Path, prompt: list[int], stop: int | None, args: argparse.Namespace) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if args.seed is not None:
        torch.manual_seed(args.seed)
    context = model.config.max_position_embeddings
    ids = torch.tensor([prompt[-(context - 1):]], dtype=torch.int64)
    room = max(1, min(args.max_new_tokens, context - ids.shape[1]))  # positions past training are not known
    sampling = {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k or None} \
        if args.temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=room, eos_token_id=stop,
                             pad_token_id=stop, **sampling)
    new = out[0, ids.shape[1]:].tolist()
    return new[: new.index(stop)] if stop in new else new
