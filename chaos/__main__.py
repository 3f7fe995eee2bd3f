"""``python -m chaos [overrides]``: see chaos/cli.py."""

import sys

from chaos.cli import main

sys.exit(main(sys.argv[1:]))
