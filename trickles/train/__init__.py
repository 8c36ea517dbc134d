"""Training: the loop (trainer.py), checkpoints, metrics, FLOPs, the entry points (run.py) and the scaling report
(scaling.py)."""
