"""What a node is asked to do (``NodeOptions``) and the one error it raises when it cannot join."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from swarm.run.runconfig import RunConfig
from volunteer.prefs import IdlePrefs, ResourcePrefs


class JoinError(RuntimeError):
    """The node could not join; the message says why and what to try."""

    exit_code = 1


class RunConflict(JoinError):
    """Another run of our name is active with another config (volunteer/node/runs.py): a choice the
    user must make, so a service must not restart into it (exit status 2, like a config mistake)."""

    exit_code = 2


class RunDoesNotFit(JoinError):
    """The run's model does not fit its data (volunteer/preflight.py), found before joining: a config to fix,
    so a service must not restart into it (exit status 2)."""

    exit_code = 2


@dataclass(slots=True, kw_only=True)
class NodeOptions:
    run: RunConfig
    run_path: Path | None = None  # the run config's file, named in errors about it
    swarm: str  # "layerK" or "auto"
    initial_peers: list[str]
    data_dir: Path
    identity_path: Path | None = None
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    use_relay: bool = True
    use_auto_relay: bool = False
    client_mode: bool = False
    device: str = "cpu"
    cpu_threads: int = 0
    process_group: int | None = None
    train: bool = True  # False: announce membership only (no stage, no driver)
    idle: IdlePrefs = field(default_factory=IdlePrefs)  # when to train (idle.enabled: only while the user is away)
    resources: ResourcePrefs = field(default_factory=ResourcePrefs)
    new_run: bool = False  # train this config's own run even when another run of its name is active
    log_path: Path | None = None  # this session's log file (volunteer/logfile.py), shown to the user
    rebalance_s: float = 60.0  # --swarm auto: reconsider the swarm this often (swarm/rebalance.py); 0 = never move
    control_socket: bool = True  # serve `volunteer ctl` at <data_dir>/control/<run_id>-<swarm>.sock
