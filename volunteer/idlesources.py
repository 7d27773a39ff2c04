"""Is the user at this machine? The idle sources, each a function of the wall clock.

Everything works without root, every source is optional and fails soft: it returns ``idle_s=None``
and a reason instead of raising. ``combine_readings`` takes the most recent activity seen by any
working source. idle.py polls them (``IdleObserver``); busy.py measures the other programs.

Idle sources (Linux):
- ``logind``: every session's ``IdleHint``/``IdleSinceHint`` from ``loginctl`` (all sessions, not
  just ``$XDG_SESSION_ID``: a systemd user service runs outside any session, and the owner of a lab
  machine may be another account). A tty session's ``IdleSinceHint`` is its terminal's last input;
  a desktop session reports idle only if its desktop sets the hint (GNOME does, after its own idle
  delay, so this source starts counting late: the safe side). Nobody logged in = idle forever.
- ``x11``: the X screensaver idle time of the local display (``xprintidle`` if installed, else
  libXss through ctypes in a child process, so a hung or dying X server cannot hang or kill the
  node). Remote displays (ssh -X) are skipped: they measure another machine. In a Wayland session
  X sees only X clients' input, so this source stands aside there.
- ``tty``: the access time of /dev/pts/* and /dev/tty[0-9]* (the kernel updates it on input, at
  8 s granularity). Modify times are not used: they change on output, and a terminal printing a
  log is not a user at the keyboard.
A desktop nobody can measure (no idle hint and no reachable X, e.g. KDE on Wayland) makes the idle
time unknown rather than "idle", so we never train under a working user's hands.

Other platforms (macOS, Windows) have no idle source yet: ``default_sources`` is empty there, the idle
time is unknown and the policy follows ``idle.run_when_idle_unknown`` (idle.py).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

from volunteer.policy import format_duration

LOGIND, X11, TTY = "logind", "x11", "tty"
COMMAND_TIMEOUT_S = 1.5  # a stuck D-Bus or X server must not stall the node's poll
MICROSECONDS_PER_S = 1_000_000
MILLISECONDS_PER_S = 1000
DESKTOP_SESSION_TYPES = ("x11", "wayland", "mir")
DEV_DIR = Path("/dev")
X11_SOCKET_DIR = Path("/tmp/.X11-unix")
NO_SOURCE_DETAIL = "no idle source works here; see `volunteer doctor`"
BLIND_DESKTOP_DETAIL = "a desktop session is running but neither logind nor X can tell its idle time"

# libXss through ctypes, run in a child process: Xlib's default I/O error handler calls exit().
_XSS_SCRIPT = """
import ctypes, sys
class Info(ctypes.Structure):
    _fields_ = [("window", ctypes.c_ulong), ("state", ctypes.c_int), ("kind", ctypes.c_int),
                ("til_or_since", ctypes.c_ulong), ("idle", ctypes.c_ulong), ("event_mask", ctypes.c_ulong)]
try:
    x11, xss = ctypes.CDLL("libX11.so.6"), ctypes.CDLL("libXss.so.1")
except OSError as exc:
    sys.exit(f"libXss is not installed ({exc})")
x11.XOpenDisplay.restype, x11.XOpenDisplay.argtypes = ctypes.c_void_p, [ctypes.c_char_p]
x11.XDefaultRootWindow.restype, x11.XDefaultRootWindow.argtypes = ctypes.c_ulong, [ctypes.c_void_p]
x11.XCloseDisplay.argtypes = [ctypes.c_void_p]
xss.XScreenSaverQueryExtension.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
xss.XScreenSaverAllocInfo.restype = ctypes.POINTER(Info)
xss.XScreenSaverQueryInfo.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.POINTER(Info)]
display = x11.XOpenDisplay(None)
if not display:
    sys.exit("cannot open the X display")
event_base, error_base = ctypes.c_int(), ctypes.c_int()
if not xss.XScreenSaverQueryExtension(display, ctypes.byref(event_base), ctypes.byref(error_base)):
    sys.exit("the X server has no MIT-SCREEN-SAVER extension")
info = xss.XScreenSaverAllocInfo()
xss.XScreenSaverQueryInfo(display, x11.XDefaultRootWindow(display), info)
print(info.contents.idle)
x11.XCloseDisplay(display)
"""


@dataclass(frozen=True, slots=True)
class IdleReading:
    """What one source saw: seconds since the last input (inf: nobody there; None: cannot tell)."""

    source: str
    idle_s: float | None
    detail: str  # what it saw, or why it does not work here
    desktop_seen: bool = False  # it knows a desktop session is running...
    desktop_measured: bool = False  # ...and it measured that desktop's idle time



class CommandFailed(Exception):
    def __init__(self, message: str, not_installed: bool = False):
        super().__init__(message)
        self.not_installed = not_installed


class Runner(Protocol):
    def __call__(self, argv: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None) -> str: ...


def run_command(argv: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None) -> str:
    """stdout of a short helper command; CommandFailed with a plain reason otherwise."""
    name = Path(argv[0]).name
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, env=env, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError:
        raise CommandFailed(f"{name} is not installed", not_installed=True) from None
    except subprocess.TimeoutExpired:
        raise CommandFailed(f"{name} did not answer within {timeout_s:g} s") from None
    except OSError as exc:
        raise CommandFailed(f"{name} cannot run: {exc}") from None
    if done.returncode != 0:
        message = (done.stderr or done.stdout).strip().splitlines()
        raise CommandFailed(f"{name} failed: {message[-1] if message else f'exit status {done.returncode}'}")
    return done.stdout


# --- logind -----------------------------------------------------------------------------------


def logind_reading(now_s: float, runner: Runner = run_command) -> IdleReading:
    try:
        listing = runner(["loginctl", "list-sessions", "--no-legend"], COMMAND_TIMEOUT_S)
        session_ids = [line.split()[0] for line in listing.splitlines() if line.strip()]
        if not session_ids:
            return IdleReading(LOGIND, math.inf, "nobody is logged in")
        properties = ["Id", "Type", "Class", "Active", "IdleHint", "IdleSinceHint"]
        shown = runner(
            ["loginctl", "show-session", *session_ids, *(f"--property={name}" for name in properties)],
            COMMAND_TIMEOUT_S,
        )
    except CommandFailed as exc:
        return IdleReading(LOGIND, None, str(exc))
    return logind_from_sessions(parse_property_blocks(shown), now_s)


def parse_property_blocks(text: str) -> list[dict[str, str]]:
    """`loginctl show-session A B -p ...` prints one Key=value block per session, blank-line separated."""
    blocks: list[dict[str, str]] = [{}]
    for line in text.splitlines():
        if not line.strip():
            blocks.append({})
        elif "=" in line:
            key, _, value = line.partition("=")
            blocks[-1][key.strip()] = value.strip()
    return [block for block in blocks if block]


def logind_from_sessions(sessions: list[dict[str, str]], now_s: float) -> IdleReading:
    idle_times_s: list[float] = []
    blind: list[str] = []
    desktops = 0
    for session in sessions:
        if not session.get("Class", "user").startswith("user"):
            continue  # greeter, lock screen, background and manager sessions have nobody at them
        desktop = session.get("Type") in DESKTOP_SESSION_TYPES
        if desktop and session.get("Active", "yes") != "yes":
            continue  # a switched-away desktop: its user is not at this seat
        desktops += desktop
        try:
            since_s = int(session.get("IdleSinceHint", "0")) / MICROSECONDS_PER_S
        except ValueError:
            since_s = 0.0
        if since_s <= 0:  # never reported: a desktop that does not set the hint, or no terminal at all
            if desktop:
                blind.append(f"session {session.get('Id', '?')} ({session.get('Type')})")
            continue
        if desktop and session.get("IdleHint") != "yes":
            idle_times_s.append(0.0)  # a desktop that sets the hint says its user is active
        else:
            idle_times_s.append(max(0.0, now_s - since_s))  # tty sessions: since = the terminal's last input
    measured = desktops > 0 and not blind
    blind_detail = f"{', '.join(blind)} does not report idle time" if blind else ""
    if idle_times_s:
        detail = f"last input {format_duration(min(idle_times_s))} ago"
        idle_s: float | None = min(idle_times_s)
    elif blind:
        idle_s, detail = None, ""
    else:
        idle_s, detail = math.inf, "nobody at a terminal or desktop"
    detail = "; ".join(part for part in (detail, blind_detail) if part)
    return IdleReading(LOGIND, idle_s, detail, desktop_seen=desktops > 0, desktop_measured=measured)


# --- X screensaver ------------------------------------------------------------------------------


def x11_reading(
    now_s: float,
    runner: Runner = run_command,
    env: Mapping[str, str] | None = None,
    socket_dir: Path = X11_SOCKET_DIR,
) -> IdleReading:
    del now_s  # X reports the idle time itself
    env = dict(os.environ if env is None else env)
    if env.get("WAYLAND_DISPLAY") or env.get("XDG_SESSION_TYPE") == "wayland":
        return IdleReading(X11, None, "Wayland session: X does not see Wayland input", desktop_seen=True)
    displays = local_displays(env, socket_dir)
    if not displays:
        return IdleReading(X11, None, "no local X display")
    idle_times_s, errors = [], []
    for display in displays:
        try:
            idle_times_s.append(query_x_idle_ms(display, runner, env) / MILLISECONDS_PER_S)
        except CommandFailed as exc:
            errors.append(f"{display}: {exc}")
    if not idle_times_s:
        return IdleReading(X11, None, "; ".join(errors), desktop_seen=True)
    detail = f"display {', '.join(displays)}: last input {format_duration(min(idle_times_s))} ago"
    return IdleReading(X11, min(idle_times_s), detail, desktop_seen=True, desktop_measured=True)


def local_displays(env: Mapping[str, str], socket_dir: Path = X11_SOCKET_DIR) -> list[str]:
    """$DISPLAY if it is on this machine, else every local X server's socket (a service has no $DISPLAY)."""
    display = env.get("DISPLAY", "")
    host = display.rpartition(":")[0]
    if display and (host in ("", "unix") or host.startswith("/")):
        return [display]
    try:
        names = sorted(path.name for path in socket_dir.iterdir() if path.name[1:].isdigit())
    except OSError:
        return []
    return [f":{name[1:]}" for name in names if name.startswith("X")]


def query_x_idle_ms(display: str, runner: Runner, env: Mapping[str, str]) -> float:
    env = {**env, "DISPLAY": display}
    gdm_cookie = Path(f"/run/user/{os.getuid()}/gdm/Xauthority")
    if "XAUTHORITY" not in env and gdm_cookie.exists():
        env["XAUTHORITY"] = str(gdm_cookie)
    try:
        output = runner(["xprintidle"], COMMAND_TIMEOUT_S, env)
    except CommandFailed as exc:
        if not exc.not_installed:
            raise
        try:
            output = runner([sys.executable, "-c", _XSS_SCRIPT], COMMAND_TIMEOUT_S, env)
        except CommandFailed as helper_exc:
            reason = str(helper_exc).rpartition(" failed: ")[2]
            raise CommandFailed(f"xprintidle is not installed and libXss says: {reason}") from None
    try:
        return float(output.strip())
    except ValueError:
        raise CommandFailed(f"unexpected idle time {output.strip()[:40]!r}") from None


# --- terminals ----------------------------------------------------------------------------------


def tty_reading(now_s: float, dev_dir: Path = DEV_DIR) -> IdleReading:
    atimes_s = []
    for path in [*dev_dir.glob("pts/[0-9]*"), *dev_dir.glob("tty[0-9]*")]:
        try:
            atimes_s.append(path.stat().st_atime)
        except OSError:
            continue  # closed meanwhile
    if not atimes_s:
        return IdleReading(TTY, None, f"no terminals under {dev_dir}")
    idle_s = max(0.0, now_s - max(atimes_s))
    return IdleReading(TTY, idle_s, f"{len(atimes_s)} terminals; last input {format_duration(idle_s)} ago")


def combine_readings(readings: Iterable[IdleReading]) -> tuple[float | None, str]:
    """The most recent activity any source saw; None (and why) when nobody can tell."""
    readings = list(readings)
    if any(r.desktop_seen for r in readings) and not any(r.desktop_measured for r in readings):
        return None, BLIND_DESKTOP_DETAIL
    known = [r.idle_s for r in readings if r.idle_s is not None]
    if not known:
        return None, NO_SOURCE_DETAIL
    return min(known), ""


IdleSource = Callable[[float], IdleReading]


def default_sources(runner: Runner = run_command) -> list[IdleSource]:
    if not sys.platform.startswith("linux"):
        return []
    return [partial(logind_reading, runner=runner), partial(x11_reading, runner=runner), tty_reading]
