"""Training: the loop (trainer.py), checkpoints, metrics, FLOPs, and the entry points (run.py)."""
