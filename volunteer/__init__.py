"""The desktop client: CLI, configuration, node lifecycle, process hygiene, bootstrap hosting.

Map:
- cli.py        `volunteer ...` (argparse; imports torch/hivemind only inside commands)
- config.py     loading YAML run configs and preferences with errors that name file, field and fix
- prefs.py      the local preferences schema (volunteer.yaml)
- paths.py      per-user data and config dirs
- snapshot.py   the status snapshot, events and commands shared by the engine, TUI and control socket
- hygiene.py    signal handling and the watchdog that reaps the DHT and p2pd if we crash
- node/         the node engine: a lifecycle (join, serve, leave) over named parts (commands,
                governors, checkpoints, announcer); see its map
- bootstrap.py  `volunteer bootstrap`
- status.py     `volunteer status`
"""

__version__ = "0.1.0"
