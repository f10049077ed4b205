"""Training: the DeepSpeed config (deepspeed_config.py), the client optimizer and schedule, checkpoints
through the engine (checkpoint.py), the step decision (numerical guard and stop agreement, guard.py), stop signals, metrics and the loop (trainer.py)."""
