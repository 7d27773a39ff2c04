"""Local volunteer preferences (``volunteer.yaml``): this machine's choices, never part of the run id."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

DEFAULT_PORT = 31337
_WINDOW_RE = re.compile(r"^([01]\d|2[0-3]):[0-5]\d-([01]\d|2[0-3]):[0-5]\d$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NetworkPrefs(_Strict):
    listen: list[str] | None = Field(
        None,
        description="multiaddrs to listen on (port 0 = a random free port); default: all interfaces, "
        "a random port for a volunteer, TCP and QUIC port 31337 for a bootstrap peer",
    )
    announce: list[str] = Field(default_factory=list, description="public multiaddrs others should dial (explicit port)")
    use_relay: bool = True
    use_auto_relay: bool = False
    client_mode: bool = Field(False, description="for peers behind NAT that nobody can dial")

    @field_validator("listen", "announce")
    @classmethod
    def _are_maddrs(cls, maddrs: list[str] | None, info: ValidationInfo) -> list[str] | None:
        from swarm.dht.maddrs import listen_maddr_problem

        for maddr in maddrs or []:
            problem = listen_maddr_problem(maddr, any_port=info.field_name == "listen")
            if problem:
                raise ValueError(f"{maddr!r} is not a multiaddr like /ip4/0.0.0.0/tcp/{DEFAULT_PORT}: {problem}")
        return maddrs


class IdlePrefs(_Strict):
    """When a headless node may train (BOINC-style computing preferences)."""

    enabled: bool = Field(False, description="headless: train only while the user is away")
    idle_after_s: float = Field(300.0, ge=0.0, description="run only after this long without user activity")
    gpu_only_when_idle: bool = True
    cpu_only_when_idle: bool = True
    max_other_cpu_percent: float = Field(50.0, ge=0.0, le=100.0, description="pause while others use more")
    min_pause_s: float = Field(60.0, ge=0.0, description="stay paused at least this long after a busy CPU")
    pause_on_battery: bool = True
    pause_gpu_when_in_use: bool = Field(True, description="pause GPU work while another program computes on the GPU")
    run_when_idle_unknown: bool = Field(
        False, description="run anyway where no idle source works (see `volunteer doctor`); else stay paused"
    )
    windows: list[str] = Field(
        default_factory=list, description='daily time windows like "22:00-07:30" (may cross midnight); empty = always'
    )

    @field_validator("windows")
    @classmethod
    def _windows_parse(cls, windows: list[str]) -> list[str]:
        for window in windows:
            if not _WINDOW_RE.match(window):
                raise ValueError(f"{window!r} is not a daily window like \"22:00-07:30\"")
        return windows


class ResourcePrefs(_Strict):
    max_cpu_threads: int = Field(0, ge=0, description="0 = one thread per stage process")
    gpu_memory_fraction: float = Field(0.9, gt=0.0, le=1.0)
    bandwidth_mbit_s: float = Field(
        0.0, ge=0.0, description="0 = no cap; averaged over ~10 s of training traffic (see volunteer/headless.py)"
    )
    checkpoint_interval_s: float = Field(300.0, gt=0.0)
    low_priority: bool = Field(
        True, description="join trains at the lowest CPU priority (nice 19) and the idle I/O class, as the "
        "systemd unit does; false: normal priority (see volunteer/priority.py)"
    )


class Preferences(_Strict):
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    identity_path: str | None = Field(None, description="libp2p identity key file; default in the data dir")
    data_dir: str | None = Field(None, description="checkpoints, identity and sockets; default: the user data dir")
    network: NetworkPrefs = NetworkPrefs()
    idle: IdlePrefs = IdlePrefs()
    resources: ResourcePrefs = ResourcePrefs()

    @field_validator("device")
    @classmethod
    def _device_known(cls, device: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
            raise ValueError(f"{device!r} is not a device; use auto, cpu, cuda or cuda:N")
        return device
