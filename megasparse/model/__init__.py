"""The LLaMA model (llama.py), its named shapes (presets.py) and the projection-layer factory (layers.py)."""
