"""The textual app for `volunteer join`: renders NodeSnapshots, sends Commands. Never touches torch or hivemind.

Map:
- app.py       VolunteerApp (layout, keys, the clean-leave flow) and run_dashboard(engine) -> exit code
- bridge.py    EngineBridge: engine listeners -> posted messages; commands -> engine on one ordered thread
- messages.py  SnapshotUpdated, EventRaised, EngineStopped: the only way engine news reaches widgets
- status.py    the top line (run, swarm, peer, state, uptime) and the not-training banner
- work.py      "Your work": samples/s and loss sparklines, samples served (session, total across restarts), device and resources
- run.py       "The run" (every layer swarm, bottleneck marked) and "Peers" (my swarm, my row marked)
- events.py    "Events": the log, each event once, ERROR / WARNING written out
- help.py      the ? screen: keys and a glossary
- format.py    pure formatting: numbers, durations, state labels, the not-training line
"""
