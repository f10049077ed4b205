"""Optimizer pieces shared by the methods and the trainer: the AdamW update (adamw.py), where a
parameter lives in the client optimizer's partitions (partitions.py) and the parameter groups
(groups.py)."""
