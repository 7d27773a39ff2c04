"""Where a volunteer keeps its files: the platform's per-user data and config dirs."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "volunteer"


def user_data_dir() -> Path:
    override = os.environ.get("VOLUNTEER_DATA_DIR")
    return Path(override).expanduser() if override else Path(platformdirs.user_data_dir(APP_NAME))


def user_config_dir() -> Path:
    override = os.environ.get("VOLUNTEER_CONFIG_DIR")
    return Path(override).expanduser() if override else Path(platformdirs.user_config_dir(APP_NAME))


def default_preferences_path() -> Path:
    return user_config_dir() / "volunteer.yaml"


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700): it holds identity keys and the control socket."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def node_dir(data_dir: Path, run_id: str, swarm: str, create: bool = True) -> Path:
    """One folder per (run, swarm) this machine serves: checkpoint, control socket, healing's snapshots."""
    path = Path(data_dir) / "runs" / run_id / swarm
    return ensure_private_dir(path) if create else path
