"""The checkpoint format, which the trainer and the tools both stand on: a checkpoint's files, its
completion file and model (files.py), crash-safe publication and manifests (durable.py), the whole
training state read from or written into any layout (state.py), whether a checkpoint can continue a
run (compat.py), and model directories with the sparse and low-rank forms (weights.py)."""
