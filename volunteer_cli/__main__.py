"""``python -m volunteer_cli ...``: the same as the `volunteer` command."""

import sys

from volunteer_cli.main import main

sys.exit(main())
