"""Importance criteria beyond the baselines; importing this package registers their methods."""
