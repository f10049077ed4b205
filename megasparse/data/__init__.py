"""Data pipeline: raw documents (corpus.py), tokenizer (tokenizer.py), packed shards (shards.py, prepare.py) and the resumable batch stream (loader.py)."""
