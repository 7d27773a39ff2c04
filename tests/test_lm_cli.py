"""The language-model commands through the installed entry point: `tokenizer train`, `generate`; and the light
commands (`--help`, `status`, `ctl`) never import transformers (nor torch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from procs import volunteer_exe  # noqa: E402

from swarm.run.data import BUNDLED_CORPUS  # noqa: E402
from swarm.run.generation import generate_ids, next_token  # noqa: E402
from swarm.run.hf_export import write_hf_dir  # noqa: E402
from swarm.run.models import build_stages  # noqa: E402
from swarm.run.runconfig import ModelConfig  # noqa: E402
from swarm.run.tokenizer import BUNDLED_TOKENIZER, file_sha256  # noqa: E402
from volunteer.config import load_run  # noqa: E402

TINY = ModelConfig(kind="llama", stages=2, blocks_per_stage=1, d_model=32, n_heads=4, n_kv_heads=2,
                   vocab_size=2048, seq_len=16, seed=1)


def volunteer(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([volunteer_exe(), *args], capture_output=True, text=True, timeout=timeout_s)


def test_tokenizer_train_reproduces_the_shipped_tokenizer_and_prints_its_pin(tmp_path):
    out = tmp_path / "tok.json"
    done = volunteer("tokenizer", "train", "--corpus", str(BUNDLED_CORPUS), "--vocab-size", "2048", "--out", str(out),
                     "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["vocab_size"] == 2048 and result["sha256"] == file_sha256(out)
    assert "tokenizer: read" in done.stderr or result["corpus_bytes"] > 0
    assert result["sha256"] == file_sha256(BUNDLED_TOKENIZER), "the shipped file is what the command makes"
    run, _ = load_run("llm-tiny")
    assert run.data.tokenizer_sha256 == result["sha256"] and run.model.vocab_size == result["vocab_size"]
    bad = volunteer("tokenizer", "train", "--corpus", str(tmp_path / "missing.txt"), "--out", str(out))
    assert bad.returncode == 2 and "no such file" in bad.stderr and "Traceback" not in bad.stderr


def test_sampling_is_greedy_at_temperature_zero_and_keeps_to_the_top_k():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.5])
    assert next_token(logits, 0.0, 0, None) == 1
    generator = torch.Generator().manual_seed(0)
    assert {next_token(logits, 5.0, 2, generator) for _ in range(50)} == {1, 3}


def test_generate_continues_a_prompt_with_our_modules_and_with_transformers_alike(tmp_path):
    stages = build_stages(TINY)
    write_hf_dir(tmp_path, TINY, [s.state_dict() for s in stages], BUNDLED_TOKENIZER)
    greedy = {}
    for backend in ("own", "transformers"):
        done = volunteer("generate", "--model", str(tmp_path), "--prompt", "def main(", "--max-new-tokens", "8",
                         "--temperature", "0", "--backend", backend)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("def main(") and len(done.stdout) > len("def main(\n")
        greedy[backend] = done.stdout
    assert greedy["own"] == greedy["transformers"], "the same weights pick the same tokens"
    sampled = volunteer("generate", "--model", str(tmp_path), "--prompt", "x", "--seed", "3", "--backend", "own")
    assert sampled.returncode == 0 and sampled.stdout.startswith("x")
    missing = volunteer("generate", "--model", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "export --format hf" in missing.stderr


def test_generate_ids_never_passes_the_trained_context():
    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.lengths = []

        def forward(self, ids):
            self.lengths.append(ids.shape[1])
            return torch.zeros(1, ids.shape[1], 5)

    model = Recorder()
    assert generate_ids(model, [1, 2, 3], max_new_tokens=6, context=4, temperature=0) == [0] * 6
    assert max(model.lengths) == 4
    assert generate_ids(Recorder(), [1], 6, 4, temperature=0, stop=0) == []


LIGHT_COMMANDS = """
import sys
from volunteer_cli.main import build_parser
build_parser().format_help()
import volunteer_cli.commands.status, volunteer_cli.commands.ctl
from volunteer.config import load_run
run, _ = load_run("llm-tiny")  # a llama run config validates without torch or transformers
heavy = [m for m in ("torch", "transformers", "tokenizers", "safetensors") if m in sys.modules]
print(heavy)
sys.exit(bool(heavy))
"""


def test_help_status_and_ctl_import_neither_transformers_nor_torch(tmp_path):
    done = subprocess.run([sys.executable, "-c", LIGHT_COMMANDS], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    for args in (["--help"], ["ctl", "status", "--data-dir", str(tmp_path), "--timeout-s", "1"],
                 ["status", "--run", "llm-tiny", "--timeout-s", "1"]):
        ran = subprocess.run([sys.executable, "-X", "importtime", "-m", "volunteer_cli", *args], capture_output=True,
                             text=True, timeout=60)
        imported = {line.rsplit("|", 1)[-1].strip() for line in ran.stderr.splitlines()
                    if line.startswith("import time:")}
        assert "volunteer_cli.main" in imported, ran.stderr[-2000:]
        assert not {"torch", "transformers"} & imported, f"volunteer {' '.join(args)} imported torch or transformers"
