"""The agent runtime: what runs beside the workers on each node (``python -m launcher.agent``)."""
