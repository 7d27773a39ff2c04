"""Loading run configs and preferences from YAML, with errors a person can act on.

A user mistake never shows a traceback: it raises ``ConfigError`` whose message names the
file, the field and the fix, and the CLI prints it and exits with status 2.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from swarm.run.runconfig import CrossFieldError, RunConfig
from volunteer.prefs import Preferences

DEFAULT_RUN = "digits-mlp"
_ModelT = TypeVar("_ModelT", bound=BaseModel)

_FIXES = {
    "missing": "add it",
    "extra_forbidden": "remove it or check its spelling",
    "int_type": "write a whole number",
    "int_parsing": "write a whole number",
    "float_type": "write a number",
    "float_parsing": "write a number",
    "bool_type": "write true or false",
    "bool_parsing": "write true or false",
    "string_type": "write a text value",
    "list_type": "write a list (- item per line, or [a, b])",
    "literal_error": "use one of the allowed values",
    "string_pattern_mismatch": "use lowercase letters, digits, '-' or '_' (at most 48 characters)",
    "model_type": "write a mapping (key: value lines)",
    "dict_type": "write a mapping (key: value lines)",
}


class ConfigError(ValueError):
    """A config file the user must fix; the message says where and how."""


def builtin_runs_dir() -> Path:
    return Path(str(resources.files("volunteer.configs") / "runs"))


def builtin_run_names() -> list[str]:
    return sorted(p.stem for p in builtin_runs_dir().glob("*.yaml"))


def resolve_run_path(run: str | None) -> Path:
    """``run`` is a path to a YAML file or the name of a built-in run (``digits-mlp``)."""
    run = run or DEFAULT_RUN
    path = Path(run).expanduser()
    if path.suffix in (".yaml", ".yml") or os.sep in run:
        return path
    builtin = builtin_runs_dir() / f"{run}.yaml"
    if builtin.is_file():
        return builtin
    raise ConfigError(
        f"no run named {run!r}: pass a path to a run YAML file, or one of the built-in runs: "
        f"{', '.join(builtin_run_names())}"
    )


def load_run(run: str | None) -> tuple[RunConfig, Path]:
    path = resolve_run_path(run)
    return _load(path, RunConfig, what="run config"), path


def load_preferences(path: str | Path | None) -> Preferences:
    """Preferences from ``path``; with no path, the user's config dir file if present, else defaults."""
    if path is None:
        from volunteer.paths import default_preferences_path

        candidate = default_preferences_path()
        if not candidate.is_file():
            return Preferences()
        path = candidate
    return _load(Path(path).expanduser(), Preferences, what="preferences")


def _load(path: Path, model: type[_ModelT], what: str) -> _ModelT:
    data = _read_yaml(path, what)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(path, exc, model)) from None


def _read_yaml(path: Path, what: str) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such {what} file; check the path") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder, not a {what} file") from None
    except (PermissionError, UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"{path}: cannot read this {what} file ({exc.__class__.__name__}: {exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the file must hold a mapping of fields (key: value lines), "
                          f"not a {type(data).__name__}")
    return data


def format_validation_error(path: Path, exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    lines = [f"{path}: {exc.error_count()} problem(s):"]
    for error in exc.errors(include_url=False):
        loc = _location(error)
        message = error["msg"].removeprefix("Value error, ")
        fix = _FIXES.get(error["type"])
        home = _home_of(model, error["loc"]) if error["type"] == "extra_forbidden" and model else None
        if home:  # a real field in the wrong section (`wire_codec:` at the top of a run file)
            fix = f"it belongs under {home.rsplit('.', 1)[0]}: write it as {home}"
        got = ""
        if error["type"] not in ("missing",) and "input" in error and not isinstance(error["input"], dict):
            got = f" (got {error['input']!r})"
        lines.append(f"  {loc}: {message}{got}" + (f"; {fix}" if fix else ""))
    return "\n".join(lines)


def _location(error: dict[str, Any]) -> str:
    """Where the error is: ``model.stages``; for a rule between fields, every field it involves."""
    prefix = ".".join(str(part) for part in error["loc"])
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, CrossFieldError):
        return ", ".join(f"{prefix}.{field}" if prefix else field for field in cause.fields)
    return prefix or "(top level)"


def _home_of(model: type[BaseModel], loc: tuple) -> str | None:
    """Where a field that is not allowed at ``loc`` is one: the dotted path of the one section of ``model`` (a nested
    model, at most two levels down) that has a field of that name, or None (a misspelling, or several homes)."""
    name = str(loc[-1])
    homes = []

    def walk(section: type[BaseModel], prefix: str, depth: int) -> None:
        for field_name, field in section.model_fields.items():
            kind = field.annotation
            if isinstance(kind, type) and issubclass(kind, BaseModel) and depth < 2:
                path = f"{prefix}{field_name}"
                if name in kind.model_fields:  # (never the section it was refused in: there it would be allowed)
                    homes.append(f"{path}.{name}")
                walk(kind, f"{path}.", depth + 1)

    walk(model, "", 0)
    return homes[0] if len(homes) == 1 else None
