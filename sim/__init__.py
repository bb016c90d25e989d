"""Discrete-event simulator: the engine model plus the very same policy objects the live hosts run."""
