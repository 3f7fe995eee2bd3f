"""The commands an operator runs beside a job, each ``python -m launcher.commands.<name>``.

They read a job (and a node) without being part of it, so they live apart from the launch
(:mod:`launcher.cli`) and the roles it runs: :mod:`launcher.commands.status` (one screen on a
running job), :mod:`launcher.commands.doctor` (is this machine fit to join?),
:mod:`launcher.commands.quarantine` (list, clear or add quarantined nodes) and
:mod:`launcher.commands.disk_usage` (where a run directory's disk went).
"""
