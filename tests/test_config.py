"""Bad configs give messages that name the file, the field and the fix (through the installed CLI)."""

from __future__ import annotations

import subprocess

import pytest

from procs import volunteer_exe
from swarm.run.runconfig import RunConfig
from volunteer.config import ConfigError, load_run

MADDR = "/ip4/127.0.0.1/tcp/9/p2p/QmaypY6rCvw4CcrNw87NrKEqJ2gh92sJjKAYFB85EL7cbK"


def _join(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([volunteer_exe(), "join", "--headless", "--initial-peers", MADDR, *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("model:\n  stages: 2\n", ["name: Field required; add it"]),
        ("name: r\nmodel:\n  stages: four\n", ["model.stages", "whole number", "'four'"]),
        ("name: r\nmodle:\n  stages: 2\n", ["modle", "remove it or check its spelling"]),
        ("name: r\noptimizer:\n  name: lion\n", ["optimizer.name", "'sgd', 'adam' or 'adamw'"]),
        ("name: r\nmodel: [1, 2\n", ["not valid YAML at line"]),
        ("- just\n- a list\n", ["must hold a mapping"]),
        ("name: Bad Name\n", ["name:", "lowercase letters"]),
    ],
)
def test_bad_run_config_names_file_field_and_fix(tmp_path, content, expected):
    path = tmp_path / "run.yaml"
    path.write_text(content)
    result = _join("--run", str(path), "--swarm", "layer0")
    assert result.returncode == 2
    assert str(path) in result.stderr
    for text in expected:
        assert text in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("content", "fix"),
    [
        ("name: r\nwire_codec: float16\n",
         "wire_codec: Extra inputs are not permitted (got 'float16'); it belongs under training: write it as "
         "training.wire_codec"),
        ("name: r\ntraining: {lr: 0.1}\n", "training.lr: Extra inputs are not permitted (got 0.1); it belongs under "
                                            "optimizer: write it as optimizer.lr"),
        ("name: r\nmodle: {stages: 2}\n", "modle: Extra inputs are not permitted; remove it or check its spelling"),
    ],
)
def test_a_field_in_the_wrong_section_is_named_with_its_section(tmp_path, content, fix):
    from volunteer.config import ConfigError, load_run

    path = tmp_path / "run.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError) as caught:
        load_run(str(path))
    assert fix in str(caught.value)


@pytest.mark.parametrize(
    ("content", "fields", "fix"),
    [
        ("name: r\noptimizer: {name: adam}\naveraging: {mode: pdmm_isvr}\n",
         "averaging.mode, optimizer.name, optimizer.momentum", "set optimizer.name: sgd and optimizer.momentum: 0"),
        ("name: r\noptimizer: {name: sgd, momentum: 0.5}\naveraging: {mode: dsgd}\n",
         "averaging.mode, optimizer.name, optimizer.momentum", "(now sgd, momentum 0.5)"),
        ("name: r\nmodel: {kind: transformer, d_model: 130, n_heads: 4}\n",
         "model.d_model, model.n_heads", "must be a multiple of n_heads (4)"),
        ("name: r\ndata: {partition: label_skewed, classes_per_shard: 12}\n",
         "data.classes_per_shard, data.partition, model.num_classes", "exceeds model.num_classes (10)"),
    ],
)
def test_a_rule_between_fields_names_every_field_it_involves(tmp_path, content, fields, fix):
    path = tmp_path / "run.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError) as error:
        load_run(str(path))
    message = str(error.value)
    assert f"  {fields}: " in message and fix in message and str(path) in message
    assert "(top level)" not in message


def test_unreadable_and_missing_files(tmp_path):
    missing = _join("--run", str(tmp_path / "nope.yaml"), "--swarm", "layer0")
    assert missing.returncode == 2 and "no such run config file" in missing.stderr
    folder = tmp_path / "dir.yaml"
    folder.mkdir()
    assert "is a folder" in _join("--run", str(folder), "--swarm", "layer0").stderr
    unknown = _join("--run", "no-such-run", "--swarm", "layer0")
    assert unknown.returncode == 2 and "built-in runs" in unknown.stderr and "digits-mlp" in unknown.stderr


def test_unknown_layer_lists_the_valid_ones(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: r\nmodel:\n  stages: 3\n")
    result = _join("--run", str(path), "--swarm", "layer7")
    assert result.returncode == 2
    assert "layer0, layer1, layer2, or auto" in result.stderr


def test_no_bootstrap_peers_says_how_to_start_one(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: r\n")
    result = subprocess.run([volunteer_exe(), "join", "--headless", "--run", str(path), "--swarm", "layer0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "volunteer bootstrap" in result.stderr


def test_bad_preferences_name_the_field(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("name: r\n")
    prefs = tmp_path / "volunteer.yaml"
    prefs.write_text("device: gpu\nnetwork:\n  listen: [/ip4/0.0.0.0/udp/1/quic]\n")
    result = _join("--run", str(run), "--swarm", "layer0", "--prefs", str(prefs))
    assert result.returncode == 2
    assert "device" in result.stderr and "auto, cpu, cuda or cuda:N" in result.stderr
    assert "network.listen" in result.stderr and "quic-v1" in result.stderr


def test_run_id_is_name_plus_canonical_hash():
    a = RunConfig(name="x")
    b = RunConfig.model_validate({"name": "x", "bootstrap_peers": [MADDR], "timeouts": {"heartbeat_s": 2}})
    c = RunConfig.model_validate({"name": "x", "model": {"hidden_dim": 7}})
    assert a.run_id == b.run_id, "bootstrap peers and timeouts are local choices"
    assert a.run_id != c.run_id
    assert a.run_id.startswith("x-") and len(a.run_id) == len("x-") + 8


def test_the_run_id_is_computed_once_per_object_and_a_changed_copy_computes_its_own():
    """``config_hash`` is kept on the (frozen) object after the first read; ``model_copy(update=...)`` copies the
    object's ``__dict__``, the kept hash with it, and must not answer with the original's."""
    run = RunConfig(name="x")
    first = run.run_id
    assert run.run_id == first and run == RunConfig(name="x"), "the kept hash is no field: equality is unchanged"
    bigger = run.model_copy(update={"training": run.training.model_copy(update={"batch_size": 64})})
    assert bigger.run_id == RunConfig(name="x", training={"batch_size": 64}).run_id != first
    assert "_config_hash_memo" not in run.model_dump() and run.run_id == first


def test_a_removed_field_keeps_the_run_id_earlier_clients_compute():
    """The direction check's fields (integrity.ascent_*) left with it; a run keeps the id it had, and a config
    that still sets one is refused instead of silently ignored."""
    # the id predates identity work and weight stashing, too
    before_work = RunConfig(name="x", integrity={"identity_bits": 0}, training={"weight_stashing": False})
    assert before_work.run_id == "x-a3bb3a9e", "the id clients before the removal computed"
    assert RunConfig(name="x", training={"weight_stashing": False}).run_id != before_work.run_id, \
        "asking for identity work is a new run id"
    assert RunConfig(name="x").run_id not in (before_work.run_id, RunConfig(name="x", training={
        "weight_stashing": False}).run_id), "weight stashing (a backward's computation) is a new run id"
    with pytest.raises(ValueError, match="ascent_cosine"):
        RunConfig.model_validate({"name": "x", "integrity": {"ascent_cosine": -1.0}})


def test_builtin_runs_load():
    for name in ("digits-mlp", "charlm"):
        run, path = load_run(name)
        assert run.name == name and path.is_file()
    with pytest.raises(ConfigError):
        load_run("does-not-exist")


def test_example_preferences_document_the_defaults():
    from volunteer.config import builtin_runs_dir, load_preferences
    from volunteer.prefs import Preferences

    example = builtin_runs_dir().parent / "volunteer.example.yaml"
    assert load_preferences(example) == Preferences()
    assert Preferences().network.listen is None, "volunteers must not all take the bootstrap port"


def test_help_imports_neither_torch_nor_hivemind():
    code = ("import sys; from volunteer_cli.main import build_parser; build_parser().format_help(); "
            "heavy = [m for m in ('torch', 'hivemind') if m in sys.modules]; print(heavy); sys.exit(bool(heavy))")
    import sys as _sys

    result = subprocess.run([_sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    help_text = subprocess.run([volunteer_exe(), "--help"], capture_output=True, text=True, timeout=60).stdout
    for command in ("join", "bootstrap", "status", "ctl", "doctor", "service", "export", "eval", "demo"):
        assert command in help_text


@pytest.mark.parametrize("value", ["-3", "0", "nan", "inf", "soon"])
def test_a_demo_time_limit_that_is_not_a_positive_number_is_refused_before_anything_starts(value, capsys):
    from volunteer_cli.main import EXIT_USAGE, build_parser

    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["demo", "--time-limit-s", value])
    assert stopped.value.code == EXIT_USAGE
    assert "--time-limit-s" in capsys.readouterr().err
    assert build_parser().parse_args(["demo", "--time-limit-s", "30"]).time_limit_s == 30.0
