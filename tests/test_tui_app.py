"""The dashboard driven by a Pilot over a FakeEngine: what a volunteer sees and what their keys do."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from fake_engine import MY_PEER_ID, NOW, T0, FakeEngine, run_scenario, sample_snapshot, screen_text
from textual.pilot import Pilot
from textual.widgets import DataTable

from tui.app import EXIT_CLEAN, EXIT_NOT_STOPPED, VolunteerApp, run_dashboard
from tui.help import HelpScreen
from volunteer.snapshot import Command, Event, EventLevel, NodeState

EXIT_WAIT_S = 3.0  # how long a test waits for the app to close itself


async def wait_for_exit(app: VolunteerApp, pilot: Pilot) -> None:
    step_s = 0.02
    for _ in range(int(EXIT_WAIT_S / step_s)):
        if app.return_code is not None:
            return
        await pilot.pause(step_s)
    raise AssertionError(f"the app did not exit within {EXIT_WAIT_S}s")


async def settle(pilot: Pilot) -> None:
    """Let messages posted from the engine's thread reach their handlers."""
    await pilot.pause()
    await pilot.pause()


def test_app_module_imports_neither_torch_nor_hivemind() -> None:
    code = "import sys, tui.app; sys.exit(bool({'torch', 'hivemind'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_header_says_who_and_where_i_am() -> None:
    engine = FakeEngine()

    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        header = screen_text(app).splitlines()[0]
        for expected in ("mnist-mlp-3f2a91c0", "swarm layer3", f"peer {MY_PEER_ID[-8:]}", "ONLINE", "up 1h 02m"):
            assert expected in header
        assert engine.listener_count == 1

    run_scenario(engine, scenario)
    assert not engine.started  # run_dashboard's contract: the CLI starts the engine, the app subscribes


def test_p_pauses_and_says_so() -> None:
    engine = FakeEngine()

    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        await pilot.press("p")
        assert engine.wait_for_commands(1) == [Command.PAUSE]
        await settle(pilot)
        assert "you: pause requested" in screen_text(app)

    run_scenario(engine, scenario)


def test_f_asks_to_finish_then_pause() -> None:
    engine = FakeEngine()

    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        await pilot.press("f")
        assert engine.wait_for_commands(1) == [Command.FINISH]

    run_scenario(engine, scenario)


def test_r_resumes_a_paused_node() -> None:
    engine = FakeEngine(sample_snapshot(state=NodeState.PAUSED, reason="you paused it"))

    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        await pilot.press("r")
        assert engine.wait_for_commands(1) == [Command.RESUME]

    run_scenario(engine, scenario)


def test_keys_that_make_no_sense_now_do_nothing() -> None:
    engine = FakeEngine()

    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        await pilot.press("r")  # already training: greyed out
        await pilot.press("p")
        assert engine.wait_for_commands(1) == [Command.PAUSE]  # commands keep their order: r never went
        engine.emit(sample_snapshot(state=NodeState.PAUSED, reason="you paused it"))
        await settle(pilot)
        await pilot.press("p", "f", "r")
        assert engine.wait_for_commands(2) == [Command.PAUSE, Command.RESUME]

    run_scenario(engine, scenario)


def test_state_changes_from_the_engine_show_why_it_is_not_training() -> None:
    engine = FakeEngine()

    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        engine.emit(sample_snapshot(state=NodeState.PAUSED, reason="running on battery"))
        await settle(pilot)
        lines = screen_text(app).splitlines()
        assert "PAUSED" in lines[0]
        assert lines[1].strip() == "PAUSED: running on battery (press r to resume)"
        engine.emit(sample_snapshot())
        await settle(pilot)
        lines = screen_text(app).splitlines()
        assert "ONLINE" in lines[0]
        assert "Your work" in lines[1]  # the banner is gone

    run_scenario(engine, scenario)


def test_a_silent_engine_is_called_out() -> None:
    clock = [NOW]

    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        clock[0] = NOW + 60
        app._refresh_status()  # what the once-a-second timer does
        await settle(pilot)
        assert "NO NEWS from the node for 1m 00s" in screen_text(app)
        assert "up 1h 03m" in screen_text(app).splitlines()[0]

    run_scenario(FakeEngine(), scenario, now=lambda: clock[0])


def test_swarms_table_marks_the_bottleneck_and_my_swarm() -> None:
    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        table = app.dashboard.query_one("#swarms", DataTable)
        assert [key.value for key in table.rows] == ["layer0", "layer1", "layer2", "layer3", "layer4"]
        assert str(table.get_row("layer4")[-1]) == "◀ bottleneck"
        assert str(table.get_row("layer3")[-1]) == "you"
        assert str(table.get_row("layer0")[-1]) == ""
        assert "acc 91.2% · 12s ago" in screen_text(app)

    run_scenario(FakeEngine(), scenario)


def test_peers_table_marks_my_row_and_follows_the_swarm() -> None:
    engine = FakeEngine()

    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        table = app.dashboard.query_one("#peers", DataTable)
        mine = table.get_row(MY_PEER_ID)
        assert [str(cell) for cell in mine] == ["Xk9Q2mZt", "online", "200.5", "0.3201", "1.23M", "now", "◀ you"]
        assert sum("◀ you" in line for line in screen_text(app).splitlines()) == 1

        snapshot = engine.snapshot()
        newcomer = dataclasses.replace(snapshot.peers[0], peer_id="12D3KooWNewcomerNw1", state="joining")
        engine.emit(dataclasses.replace(snapshot, peers=(*snapshot.peers[1:], newcomer)))
        await settle(pilot)
        assert table.row_count == 4
        assert str(table.get_row("12D3KooWNewcomerNw1")[1]) == "joining"
        assert "Peers in layer3: 2 of 4 online" in screen_text(app)

    run_scenario(engine, scenario)


def test_events_appear_once_with_their_level_written_out() -> None:
    engine = FakeEngine(sample_snapshot(events=()))
    warning = Event("banned Zz9yXwVu for 15m: it sent NaN gradients", EventLevel.WARNING, "banned", T0 + 10)
    error = Event("cannot reach the DHT: check your network", EventLevel.ERROR, "error", T0 + 20)

    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        engine.emit(events=(warning, error))
        engine.emit(sample_snapshot(events=(warning, error)))  # the same events again in the snapshot's tail
        await settle(pilot)
        text = screen_text(app)
        assert text.count("banned Zz9yXwVu") == 1
        assert "22:13:30 WARNING banned Zz9yXwVu for 15m" in text
        assert "22:13:40 ERROR cannot reach the DHT: check your network" in text

    run_scenario(engine, scenario)


def test_a_failing_command_is_reported_in_plain_words() -> None:
    engine = FakeEngine(fail_on=Command.PAUSE)

    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        await pilot.press("p")
        engine.wait_for_commands(1)
        for _ in range(50):
            await pilot.pause(0.01)
            if "ERROR could not pause" in screen_text(app):
                return
        raise AssertionError(screen_text(app))

    run_scenario(engine, scenario, size=(120, 40))


def test_help_opens_and_closes() -> None:
    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        assert "finish the work already taken, then pause" in screen_text(app)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("question_mark", "question_mark")
        assert not isinstance(app.screen, HelpScreen)

    run_scenario(FakeEngine(), scenario)


def test_q_leaves_cleanly_then_exits() -> None:
    engine = FakeEngine(stops_on_quit=False)

    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        await pilot.press("q")
        assert engine.wait_for_commands(1) == [Command.QUIT]
        await settle(pilot)
        lines = screen_text(app).splitlines()
        assert "LEAVING" in lines[0]
        assert lines[1].startswith(" LEAVING: telling the swarm we are going offline")
        assert app.return_code is None  # still waiting for the engine
        engine.stop()
        await wait_for_exit(app, pilot)

    app = run_scenario(engine, scenario)
    assert app.return_code == EXIT_CLEAN


@pytest.mark.parametrize("keys", [("ctrl+c",), ("question_mark", "ctrl+c")])
def test_ctrl_c_is_a_clean_quit_from_anywhere(keys: tuple[str, ...]) -> None:
    engine = FakeEngine()

    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        await pilot.press(*keys)
        await wait_for_exit(app, pilot)

    app = run_scenario(engine, scenario)
    assert engine.commands == [Command.QUIT]
    assert app.return_code == EXIT_CLEAN


def test_an_engine_that_will_not_stop_is_given_up_on() -> None:
    engine = FakeEngine(stops_on_quit=False)

    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        await pilot.press("q")
        await wait_for_exit(app, pilot)

    app = run_scenario(engine, scenario, leave_timeout_s=0.1)
    assert app.return_code == EXIT_NOT_STOPPED


def test_the_dashboard_closes_when_the_engine_stops_by_itself() -> None:
    engine = FakeEngine()

    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        engine.stop()  # e.g. the CLI got SIGTERM and stopped the node
        await wait_for_exit(app, pilot)

    app = run_scenario(engine, scenario)
    assert app.return_code == EXIT_CLEAN
    assert engine.commands == []


def test_q_twice_exits_without_waiting() -> None:
    engine = FakeEngine(stops_on_quit=False)

    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        await pilot.press("q", "q")
        await wait_for_exit(app, pilot)

    app = run_scenario(engine, scenario)
    assert engine.commands == [Command.QUIT]
    assert app.return_code == EXIT_NOT_STOPPED


def test_run_dashboard_sends_quit_when_the_app_dies(monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(self: VolunteerApp) -> None:
        raise RuntimeError("terminal went away")

    monkeypatch.setattr(VolunteerApp, "run", crash)
    engine = FakeEngine()
    with pytest.raises(RuntimeError):
        run_dashboard(engine)
    assert engine.commands == [Command.QUIT]


def test_without_colour_problems_stay_prominent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")

    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        assert app.no_color
        note = app.dashboard.query_one("#swarms", DataTable).get_row("layer4")[-1]
        assert "reverse" in str(note.style)  # red would turn into a dim grey

    run_scenario(FakeEngine(), scenario)


def test_events_rewrap_when_the_terminal_grows() -> None:
    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        wrapped = "ERROR could not reach layer4: no peer answered for 60s. Training waits; nothing to do"
        assert wrapped not in screen_text(app)
        await pilot.resize_terminal(120, 40)
        await settle(pilot)
        assert wrapped in screen_text(app)

    run_scenario(FakeEngine(), scenario)


def test_the_dashboard_keeps_updating_behind_the_help_screen() -> None:
    engine = FakeEngine()

    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        await pilot.press("question_mark")
        engine.emit(sample_snapshot(state=NodeState.PAUSED, reason="on battery power"))
        engine.emit(events=(Event("averaged with 7Hk2aBcD (factor 0.25)", time=T0 + 3700),))
        await settle(pilot)
        await pilot.press("escape")
        text = screen_text(app)
        assert "PAUSED: on battery power" in text
        assert "averaged with 7Hk2aBcD (factor 0.25)" in text, text

    run_scenario(engine, scenario)


def test_tables_cope_with_repeated_peers_and_wider_figures() -> None:
    engine = FakeEngine()

    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        snapshot = engine.snapshot()
        quiet = dataclasses.replace(snapshot.peers[0], age_s=750.0, clock=123_456_789_012)
        engine.emit(dataclasses.replace(snapshot, peers=(quiet, *snapshot.peers[1:], snapshot.peers[1])))
        await settle(pilot)
        assert app.dashboard.query_one("#peers", DataTable).row_count == 4
        assert "123B  12m 30s ago" in screen_text(app)

    run_scenario(engine, scenario)
