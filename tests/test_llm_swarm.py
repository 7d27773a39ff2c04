"""llm-tiny through a real local swarm on 127.0.0.1: two stages train it below its starting bits per byte, and
what the swarm holds is exported as a folder transformers loads, and as a
file `volunteer eval` measures in bits per byte and perplexity."""

from __future__ import annotations

import json

import pytest

from procs import wait_until
from volunteer.config import resolve_run_path

TRAIN_TIMEOUT_S = 240.0
START_BITS_PER_BYTE = 3.0  # llm-tiny's initial test loss: ln(2048) nats per token over 3.6 bytes, 3.06
EVAL_EVERY_S = 6


def _tiny_run(tmp_path):
    """The shipped llm-tiny with test-sized timeouts and evaluations (its model, data and tokenizer unchanged)."""
    text = resolve_run_path("llm-tiny").read_text()
    text = text.replace("  eval_every_s: 20.0", f"  eval_every_s: {EVAL_EVERY_S}")
    text = text[: text.index("timeouts:")] + "timeouts: {heartbeat_s: 1.0, rpc_s: 10, record_ttl_heartbeats: 10}\n"
    path = tmp_path / "llm-tiny.yaml"
    path.write_text(text)
    return path


def test_llm_tiny_trains_through_a_swarm_and_exports_for_transformers(swarm, tmp_path):
    transformers = pytest.importorskip("transformers")
    run = _tiny_run(tmp_path)
    _, maddr = swarm.bootstrap()
    reader = swarm.reader(run, maddr)
    swarm.join(run, "layer0", maddr, name="layer0")
    swarm.join(run, "layer1", maddr, name="layer1")

    def evaluated() -> dict | None:
        ev = reader.report().get("evaluation")
        return ev if ev and ev["test_bits_per_byte"] is not None and ev["samples"] >= 400 else None

    wait_until(evaluated, TRAIN_TIMEOUT_S, interval_s=1.0, what="a published evaluation after 400 samples")
    ev = evaluated()
    assert ev["test_bits_per_byte"] < START_BITS_PER_BYTE - 0.3, ev
    print(f"llm-tiny through the swarm: {ev['test_bits_per_byte']:.3f} bits/byte after {ev['samples']} samples")

    folder = tmp_path / "hf"
    export = swarm.start("export", "--run", str(run), "--initial-peers", maddr, "--format", "hf", "--out",
                         str(folder), "--json", name="export-hf")
    assert export.wait(120) == 0, export.stderr()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("import os\n", return_tensors="pt")["input_ids"]
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], 2048)
    # `volunteer generate` on such a folder: tests/test_lm_cli.py (a process less here)

    file = tmp_path / "model.pt"
    export = swarm.start("export", "--run", str(run), "--initial-peers", maddr, "--out", str(file), name="export")
    assert export.wait(120) == 0, export.stderr()
    evaluation = swarm.start("eval", "--model", str(file), "--json", name="eval")
    assert evaluation.wait(120) == 0, evaluation.stderr()
    result = json.loads(evaluation.stdout().strip().splitlines()[-1])
    assert result["bits_per_byte"] < START_BITS_PER_BYTE and 1.0 < result["perplexity"] < 2048
    assert 3.0 < result["bytes_per_token"] < 4.5
