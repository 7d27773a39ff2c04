"""`volunteer status --serve PORT`: the run health page, served for as long as it runs.

A long-lived reader of the DHT (no torch, like `volunteer status`) reads every swarm every
``--every-s`` seconds and serves, on ``--serve-host`` (default 127.0.0.1: say 0.0.0.0 to show it to
others):

    /             the page (volunteer/healthpage.py): swarms, peers, the evaluation curve; it reloads itself
    /api/status   the same as JSON: {"report", "history", "bottleneck", "read_at", "age_s", "error"}

A failed read keeps the last report on the page with its age and the error. Ctrl+C stops it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger("volunteer.status")


class HealthState:
    """What the page shows; written by the reader loop, read by the HTTP threads."""

    def __init__(self, history_path: Path | None = None) -> None:
        from volunteer.healthpage import History

        self.lock = threading.Lock()
        self.report: dict[str, Any] = {}
        self.history = History(path=history_path)
        self.read_at: float | None = None
        self.error = ""

    def update(self, report: dict[str, Any], now: float) -> None:
        with self.lock:
            self.report, self.read_at, self.error = report, now, ""
            self.history.add(report, now)

    def failed(self, error: str) -> None:
        with self.lock:
            self.error = error

    def data(self, now: float) -> dict[str, Any]:
        from volunteer.healthpage import page_data

        with self.lock:
            return page_data(self.report, self.history, self.read_at, now, self.error)


def make_handler(state: HealthState, refresh_s: int) -> type[BaseHTTPRequestHandler]:
    from volunteer.healthpage import render_page

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            path = self.path.split("?", 1)[0]
            if path == "/api/status":
                self._send(200, "application/json", json.dumps(state.data(time.time())).encode())
            elif path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", render_page(state.data(time.time()), refresh_s).encode())
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found: the page is / and the JSON /api/status\n")

        def _send(self, code: int, kind: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's signature)
            logger.debug("http: " + format, *args)

    return Handler


def serve(read: Callable[[], dict[str, Any]], host: str, port: int, every_s: float, stop: threading.Event,
          announce: Callable[[str], None] = print, history_path: Path | None = None) -> None:
    """Serve the page until ``stop`` is set; ``read`` returns a fresh report (it may raise). ``history_path``:
    where the run's curve is kept across restarts of the page (volunteer/healthpage.py History)."""
    from volunteer_cli.main import UserError

    state = HealthState(history_path)
    try:
        server = ThreadingHTTPServer((host, port), make_handler(state, refresh_s=max(1, round(every_s))))
    except OSError as exc:
        raise UserError(f"cannot serve the health page on {host}:{port}: {exc.strerror or exc}. "
                        "Pick another port with --serve PORT (0 picks a free one)") from None
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5}, daemon=True)
    thread.start()
    bound_host, bound_port = server.server_address[:2]
    announce(f"serving the run health page at http://{bound_host}:{bound_port}/ (JSON: /api/status); "
             "Ctrl+C stops it")
    try:
        while not stop.is_set():
            try:
                state.update(read(), time.time())
            except Exception as exc:  # a slow DHT or a lost bootstrap: say it on the page, keep the last figures
                logger.warning("reading the swarms failed: %s", exc)
                state.failed(f"{exc.__class__.__name__}: {exc}")
            stop.wait(every_s)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5.0)
