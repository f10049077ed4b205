"""Training: the DeepSpeed config (deepspeed_config.py), the client optimizer and schedule, checkpoints
through the engine (checkpoint.py), the numerical guard, stop signals, metrics and the loop (trainer.py)."""
