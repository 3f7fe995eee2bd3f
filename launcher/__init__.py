"""The per-node agent and the Hydra CLI (``python -m launcher``)."""
