"""``python -m chaos [overrides]``: see chaos/cli.py."""

import signal
import sys

from chaos.cli import main


def _stop(signum: int, frame: object) -> None:
    """Exit on SIGTERM as on Ctrl-C, so that the campaign unwinds.

    On its way out the campaign thaws what it froze, heals what it cut and stops the job it
    launched, instead of leaving them so."""
    raise SystemExit(128 + signum)


signal.signal(signal.SIGTERM, _stop)
sys.exit(main(sys.argv[1:]))
