"""Node health: the checks a node passes before it joins, and the quarantine of nodes that fail."""
