"""Each agent's Prometheus endpoint: the figures (:mod:`.node_metrics`) and their server."""
