"""Native low-rank training: factorised layers W = A B (layers.py), the distributed whole-matrix
steps (linalg.py) and the Spectron optimizer (spectron.py)."""
