"""The desktop client's engine: configuration, the node and its lifecycle, headless policy, process hygiene.

The command line sits above this package (volunteer_cli/), and so does the dashboard (tui/); nothing
here imports either.

Map:
- config.py     loading YAML run configs and preferences with errors that name file, field and fix
- preflight.py  what a command checks before it joins: the data dir, the listen ports, the run's data
                against its model (one line with the field and the fix, nothing announced)
- prefs.py      the local preferences schema (volunteer.yaml)
- paths.py      per-user data and config dirs
- snapshot.py   the status snapshot, events and commands shared by the engine, TUI and control socket
- hygiene.py    signal handling and the watchdog that reaps the DHT and p2pd if we crash
- node/         the node engine: a lifecycle (join, serve, leave) over named parts (commands,
                governors, checkpoints, announcer); see its map
- checkpoint.py checkpoints of the node's copy of its layer: saved atomically, restored on restart
- control.py    the control socket `volunteer ctl` talks to: the node's end (server) and the protocol
- controlclient.py `volunteer ctl`'s end: ask one node, or every node of a data dir
- controlwire.py what both ends share: where the sockets live, the errors, one line each way
- headless.py   the idle governor, bandwidth budget and GPU memory cap the node's governors use
- policy.py     when a headless node may train: one pure decision over plain observations
- idle.py       what the node polls: is the user at this machine, is it busy (``IdleObserver``), and
                the doctor's probe of what works here
- idlesources.py the idle sources: logind sessions, the X screensaver, terminals
- busy.py       other programs' CPU and GPU use, and the battery
- eventlog.py   headless output: one line per event and a periodic summary
- device.py     the torch device and thread count, and its name for the volunteer (CPU model, GPU name)
- contribution.py what this machine gave a run, kept across restarts; the farewell line
- logfile.py    the per-session log file of `volunteer join`
- service.py    the systemd user unit that runs a headless node
- priority.py   a foreground join's low CPU and I/O priority (resources.low_priority)
"""

__version__ = "0.1.0"
