"""The run health page (issue 15, item 7): `volunteer status --serve PORT` serves every swarm's
coverage, throughput and bottleneck, the peers, and the evaluation curve, as a page and as JSON.

The pure parts are tested here without a network; one end-to-end test starts a real bootstrap, a
peer that announces records (one with markup in its version string), the real command, reads both
endpoints, and renders the page in a headless Chromium when the machine has one (.ci/run installs
Debian's; the test skips with the reason where it is missing)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from procs import write_run

from volunteer.healthpage import History, Point, page_data, plot_svg, render_page

REPO = Path(__file__).resolve().parent.parent
HOSTILE_VERSION = '<img src=x onerror="alert(1)">'
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WAIT_S = 90.0


def _report(layer1_online: int = 1, accuracy: float | None = 0.9, samples: int = 1000) -> dict:
    peer = {"peer_id": "12D3KooWpeer0000abcdefgh", "state": "online", "age_s": 1.0, "version": HOSTILE_VERSION,
            "throughput": 50.0, "loss": 0.5, "clock": 3, "shard": 0, "served": 4, "trained": 1234, "lost": 0,
            "staleness": None, "reachable": False}
    report = {"run_id": "run-x", "idle_reason": "", "complete": "", "heals": {"layer0": 0, "layer1": 2},
              "swarms": {"layer0": [peer], "layer1": []},
              "summary": {"layer0": {"online": 1, "total": 1, "throughput": 50.0, "empty": False},
                          "layer1": {"online": layer1_online, "total": 1, "throughput": 20.0 * layer1_online,
                                     "empty": layer1_online == 0}}}
    if accuracy is not None:
        report["evaluation"] = {"test_accuracy": accuracy, "test_loss": 0.3, "samples": samples, "by": "12D3KooWdrv",
                                "age_s": 4.0, "stale": False, "eval_every_s": 5.0}
    return report


def test_the_history_keeps_one_point_per_new_evaluation():
    history = History()
    assert not history.add(_report(accuracy=None), now=1.0)
    assert history.add(_report(samples=1000, accuracy=0.5), now=2.0)
    assert not history.add(_report(samples=1000, accuracy=0.5), now=3.0)  # the same evaluation read again
    assert history.add(_report(samples=3000, accuracy=0.8), now=4.0)
    assert [(p["samples"], p["accuracy"], p["throughput"]) for p in history.to_json()] == [(1000, 0.5, 20.0),
                                                                                            (3000, 0.8, 20.0)]


def test_the_history_is_kept_across_restarts_of_the_page(tmp_path: Path):
    """Issue 30, item 7: the curve started when the page started; an organiser wants the run's history."""
    path = tmp_path / "health" / "run-x.jsonl"
    first = History(path=path)
    assert first.add(_report(samples=1000, accuracy=0.5), now=2.0) and first.add(_report(samples=3000, accuracy=0.8),
                                                                                 now=4.0)
    path.open("a").write("not json\n")  # a torn line from a killed page is skipped
    again = History(path=path)
    assert [p.samples for p in again.points] == [1000, 3000]
    assert not again.add(_report(samples=3000, accuracy=0.8), now=5.0)  # already kept
    assert again.add(_report(samples=5000, accuracy=0.9), now=6.0)
    assert [p.samples for p in History(path=path).points] == [1000, 3000, 5000]


def test_the_peers_table_says_what_each_peer_did_and_one_evaluation_is_a_dot():
    report = _report()
    report["swarms"]["layer1"] = [dict(report["swarms"]["layer0"][0], peer_id="12D3KooWstage1xyz", served=812,
                                       trained=0)]
    page = render_page(page_data(report, History(), read_at=1.0, now=2.0))
    assert "trained 1,234 samples" in page and "served 812 micro-batches" in page  # not "trained 0" for a stage
    svg = plot_svg([Point(at=1.0, samples=330_240, accuracy=0.91, loss=0.3, throughput=10.0)])
    assert "<circle" in svg and "330,241" not in svg and "the only evaluation so far" in svg


def test_the_page_marks_the_bottleneck_and_escapes_what_strangers_wrote():
    history = History()
    history.add(_report(samples=1000, accuracy=0.5), now=1.0)
    history.add(_report(samples=2000, accuracy=0.9), now=2.0)
    data = page_data(_report(layer1_online=0), history, read_at=10.0, now=13.0)
    assert data["bottleneck"] == "layer1" and data["age_s"] == 3.0
    page = render_page(data)
    assert HOSTILE_VERSION not in page and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in page
    assert re.search(r'<tr class="swarm bottleneck"><td>layer1</td><td>0 / 1</td>', page)
    assert "NO ONLINE PEER" in page and "read from the DHT 3 s ago" in page
    assert "test accuracy 90.0 % after 1,000 samples" in page  # the report's own evaluation
    assert page.count("<polyline") == 1
    assert '<td class="reachable">no (behind NAT)</td>' in page


def test_the_plot_scales_accuracy_and_says_when_there_is_nothing_to_plot():
    assert "no evaluation yet" in plot_svg([])
    svg = plot_svg([Point(at=0, samples=0, accuracy=0.0, loss=None, throughput=1.0),
                    Point(at=1, samples=100, accuracy=1.0, loss=None, throughput=1.0)])
    (points,) = re.findall(r'points="([^"]+)"', svg)
    (x0, y0), (x1, y1) = [tuple(map(float, p.split(","))) for p in points.split()]
    assert x0 < x1 and y0 > y1  # accuracy goes up the page
    assert "test loss" in plot_svg([Point(at=0, samples=10, accuracy=None, loss=2.0, throughput=1.0)])


def test_a_failed_read_keeps_the_last_figures_and_says_so():
    data = page_data({}, History(), read_at=None, now=5.0, error="TimeoutError: the DHT did not answer")
    page = render_page(data)
    assert "Waiting for the first read" in page and "last read failed: TimeoutError" in page


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as reply:  # 127.0.0.1 only
        return reply.read()


def _wait_for_records(url: str, peer_id: str) -> dict:
    deadline = time.monotonic() + WAIT_S
    data: dict = {}
    while time.monotonic() < deadline:
        data = json.loads(_get(url + "api/status"))
        rows = (data.get("report") or {}).get("swarms", {}).get("layer0", [])
        if any(r["peer_id"] == peer_id for r in rows) and data["history"]:
            return data
        time.sleep(0.5)
    raise AssertionError(f"the page never showed the peer's record and evaluation: {data}")


def _chromium_dom(url: str) -> str:
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--dump-dom", url],
            capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_status_serve_shows_the_run_in_a_browser(swarm, tmp_path: Path):
    from hostile import HostilePeer

    from volunteer.config import load_run

    run_path = write_run(tmp_path / "run.yaml", name="health-page", stages=2, heartbeat_s=30.0)
    run, _ = load_run(str(run_path))
    _, maddr = swarm.bootstrap()
    with HostilePeer(run, [maddr], tmp_path / "peer.key") as peer:
        assert peer.announce("layer0", shard=0, throughput=7.5, trained=640, test_accuracy=0.75, eval_samples=640,
                             eval_at=time.time() - 1.0, version=HOSTILE_VERSION)
        proc = subprocess.Popen(
            [sys.executable, "-m", "volunteer_cli", "status", "--run", str(run_path), "--initial-peers", maddr,
             "--serve", "0", "--every-s", "1"],
            env=_env(swarm.env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            line = proc.stdout.readline()  # the first line names the address (bounded by the DHT's start timeout)
            urls = re.findall(r"http://127\.0\.0\.1:\d+/", line)
            assert urls, f"no address in the first line: {line!r}"
            url = urls[0]
            data = _wait_for_records(url, peer.peer_id)
            assert data["bottleneck"] == "layer1" and data["report"]["summary"]["layer1"]["empty"]
            assert data["history"][-1]["accuracy"] == 0.75 and data["age_s"] is not None
            page = _get(url).decode()
            assert HOSTILE_VERSION not in page and ("<polyline" in page or "<circle" in page)  # one point: a dot
            if CHROMIUM is None:
                pytest.skip("no headless Chromium on this machine (.ci/run installs Debian's chromium); "
                            "the page and the JSON were checked over HTTP")
            dom = _chromium_dom(url)
            assert "test accuracy 75.0 %" in dom and "NO ONLINE PEER" in dom and peer.peer_id[-8:] in dom
            assert "<img" not in dom  # the version string stayed text
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
                raise AssertionError("status --serve did not stop on Ctrl+C within 30 s") from None
