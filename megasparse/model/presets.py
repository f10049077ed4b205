"""Named LLaMA shapes (hidden size, layers, heads, SwiGLU width; key/value heads and RoPE base where they differ
from multi-head attention and 10,000).

The 9M to 1B shapes follow the LLaMA configs used by the GaLore / ReLoRA / SLTrain line of
memory-efficient pretraining papers, so results are comparable with theirs. ``llama-7b`` is LLaMA 2's 7B
(Touvron et al. 2023: 6.74 B parameters with its 32,000-piece vocabulary), ``llama3-8b`` Llama 3's 8B (Meta
2024: grouped-query attention with 8 key/value heads, RoPE base 500,000; 8.03 B parameters with its 128,256-piece
vocabulary). The vocabulary size is not part of a shape: it always comes from the tokenizer of the data.
"""

MODEL_PRESETS: dict[str, dict[str, int | float]] = {
    "llama-tiny": {"dim": 64, "n_layers": 2, "n_heads": 4, "ffn_dim": 176},
    "llama-9m": {"dim": 128, "n_layers": 4, "n_heads": 4, "ffn_dim": 352},
    "llama-20m": {"dim": 256, "n_layers": 4, "n_heads": 4, "ffn_dim": 688},
    "llama-35m": {"dim": 384, "n_layers": 6, "n_heads": 8, "ffn_dim": 1024},
    "llama-60m": {"dim": 512, "n_layers": 8, "n_heads": 8, "ffn_dim": 1376},
    "llama-130m": {"dim": 768, "n_layers": 12, "n_heads": 12, "ffn_dim": 2048},
    "llama-240m": {"dim": 768, "n_layers": 24, "n_heads": 16, "ffn_dim": 2416},
    "llama-350m": {"dim": 1024, "n_layers": 24, "n_heads": 16, "ffn_dim": 2736},
    "llama-1b": {"dim": 2048, "n_layers": 24, "n_heads": 32, "ffn_dim": 5461},
    "llama-7b": {"dim": 4096, "n_layers": 32, "n_heads": 32, "ffn_dim": 11008},
    "llama3-8b": {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 14336, "rope_theta": 500000.0},
}
