"""``python -m volunteer_cli ...``: the same as the `volunteer` command."""

from volunteer_cli.main import entry

entry()
