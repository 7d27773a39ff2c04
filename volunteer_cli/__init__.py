"""The top floor: the `volunteer` command line, above both the engine (``volunteer``) and the dashboard (``tui``).

Dependency direction: ``volunteer_cli -> tui -> volunteer -> swarm``; nothing below imports this
package, so the engine never depends on its front ends.

Map:
- main.py        `volunteer ...`: argparse, dispatch to a command (imports torch/hivemind only inside commands)
- __main__.py    ``python -m volunteer_cli`` (what the systemd unit and the demo run)
- forkserver.py  `volunteer` processes forked from one that imported torch and hivemind once (the demo, tests):
                 the client's side; forkserver_process.py is the server process it starts
- commands/      one module per command (join, bootstrap, status, ctl, doctor, service, export/eval, demo)
"""
