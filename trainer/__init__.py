"""Training: config system, loop, optimizer, checkpoints, metrics (train.py is the entry point)."""
