"""Training: the DeepSpeed config (deepspeed_config.py), optimizer and schedule, checkpoints, metrics and the loop (trainer.py)."""
