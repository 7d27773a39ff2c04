"""A log file per `volunteer join` session, so that what the node said does not vanish with the terminal.

``<data_dir>/logs/join-YYYYmmdd-HHMMSS-<pid>.log`` gets the node's events and a summary line every
``SUMMARY_EVERY_S`` (the headless log's format) and the Python log records from ``INFO`` up (our own
modules; hivemind stays at its own level), whatever the terminal shows. The newest ``KEEP_LOGS`` files
are kept. The path is shown at startup, in the dashboard and in the farewell line.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TextIO

LOG_DIR = "logs"
KEEP_LOGS = 20
SUMMARY_EVERY_S = 60.0
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FILE_LEVEL = logging.INFO


def new_log_path(data_dir: Path, now: float | None = None, pid: int | None = None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    return Path(data_dir) / LOG_DIR / f"join-{stamp}-{os.getpid() if pid is None else pid}.log"


def logs_to_remove(names: list[str], keep: int = KEEP_LOGS) -> list[str]:
    """The oldest session logs beyond the newest ``keep`` (their names sort by time)."""
    logs = sorted(n for n in names if n.startswith("join-") and n.endswith(".log"))
    return logs[:-keep] if keep > 0 else logs


def _prune(directory: Path, keep: int) -> None:
    for name in logs_to_remove([p.name for p in directory.iterdir()], keep):
        try:
            (directory / name).unlink()
        except OSError as exc:
            logging.getLogger(__name__).debug("could not remove the old log %s: %s", name, exc)


class SessionLog:
    """Opens the session's log file and routes the Python log records into it; ``close()`` at exit."""

    def __init__(self, path: Path, keep: int = KEEP_LOGS):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        _prune(path.parent, keep - 1)  # room for this one
        self.stream: TextIO = open(path, "a", buffering=1, encoding="utf-8")  # line-buffered: readable while we run
        self._handler = logging.StreamHandler(self.stream)
        self._handler.setFormatter(logging.Formatter(FILE_FORMAT))
        self._handler.setLevel(FILE_LEVEL)
        root = logging.getLogger()
        for handler in root.handlers:  # the terminal keeps the verbosity it was given
            if handler.level == logging.NOTSET:
                handler.setLevel(root.level)
        if root.level > FILE_LEVEL or root.level == logging.NOTSET:
            root.setLevel(FILE_LEVEL)
        root.addHandler(self._handler)

    def event_log(self):
        """A listener pair (volunteer/eventlog.py) that writes the node's events and summaries here."""
        from volunteer.eventlog import EventLog

        return EventLog(stream=self.stream, fmt="human", summary_every_s=SUMMARY_EVERY_S)

    def close(self) -> None:
        logging.getLogger().removeHandler(self._handler)
        self.stream.close()


def open_session_log(data_dir: Path) -> SessionLog | None:
    """The session's log, or None (with a warning on stderr) when the data dir is not writable."""
    path = new_log_path(data_dir)
    try:
        return SessionLog(path)
    except OSError as exc:
        logging.getLogger(__name__).warning("no log file for this session (%s): %s", path, exc)
        return None
