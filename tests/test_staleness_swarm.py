"""A real swarm reports how stale its updates are: `volunteer status` shows layer0's staleness (its lanes'
backward passes come back after other lanes' updates) and 0 at the last stage (forward and backward in one call)."""

from __future__ import annotations

from procs import wait_until, write_run

STATUS_TIMEOUT_S = 60.0


def test_status_shows_each_copys_staleness(swarm, tmp_path):
    run = write_run(tmp_path / "run.yaml", name="stale", stages=2, training="{in_flight: 4, eval_every_s: 60}")
    _, maddr = swarm.bootstrap()
    swarm.join(run, "layer0", maddr)
    swarm.join(run, "layer1", maddr)

    def measured() -> dict | None:
        report = swarm.status(run, maddr)
        rows = {name: report["swarms"][name] for name in ("layer0", "layer1")}
        if all(rows.values()) and all(r[0]["staleness"] for r in rows.values()):
            return report
        return None

    report = wait_until(measured, STATUS_TIMEOUT_S, interval_s=1.0, what="both copies to report their staleness")
    first, last = report["swarms"]["layer0"][0]["staleness"], report["swarms"]["layer1"][0]["staleness"]
    assert 1 <= first["max"] <= 3 * 4  # other lanes' updates land between a forward and its backward
    assert 0 < first["mean"] <= first["p95"] <= first["max"]
    assert last == {"mean": 0.0, "p95": 0.0, "max": 0}
    assert report["summary"]["layer0"]["staleness_max"] == first["max"]
