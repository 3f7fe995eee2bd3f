"""Hydra configuration tree; a package so that ``pkg://conf`` finds it once installed."""
