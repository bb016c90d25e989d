"""Replica side: the local Fairway queue, the admission gate and the engines behind it."""
