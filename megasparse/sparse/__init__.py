"""SMET dynamic sparse training: sparse layers (layer.py), initial densities (density.py), topology
updates (topology.py) and the optimizer that keeps Adam state for the active weights only (optimizer.py)."""
