"""``python -m launcher [overrides]``: see launcher/cli.py."""

from launcher.cli import main

main()
