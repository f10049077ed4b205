"""Model FLOPs per token (megasparse.model.flops) against torch's FLOP counter on the model itself, and the
throughput metrics built on them."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megasparse.config import config_from_dict
from megasparse.model.factory import layer_factory
from megasparse.model.flops import flops_per_token
from megasparse.model.llama import Llama
from megasparse.train.throughput import known_peak_tflops, throughput

VOCAB, SEQ = 320, 24
METHODS = {"dense": {}, "sparse": {"optimizer": {"name": "smet"}},
           "lowrank": {"optimizer": {"name": "spectron"}, "lowrank": {"rank_ratio": 0.3, "targets": ["q_proj", "up_proj"]}}}


def counted(cfg, backward: bool) -> int:
    """FLOPs torch counts for one sequence of ``SEQ`` tokens, through the math attention (whose products it
    counts; it has no formula for the fused CPU kernels) and, with ``backward``, the backward pass."""
    torch.manual_seed(0)
    model = Llama(cfg.model, VOCAB, layer_factory(cfg))
    tokens = torch.randint(0, VOCAB, (1, SEQ))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss = model(tokens, tokens)
        if backward:
            loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("layer", list(METHODS))
@pytest.mark.parametrize("kv_heads", [0, 2])  # multi-head and grouped-query attention
def test_flops_per_token_are_what_torch_counts(layer, kv_heads):
    cfg = config_from_dict({"model": {"preset": "llama-tiny", "layer": layer, "n_kv_heads": kv_heads},
                            "data": {"seq_len": SEQ}, **METHODS[layer]})
    flops = flops_per_token(cfg, VOCAB)
    assert counted(cfg, backward=False) == flops.forward * SEQ
    assert counted(cfg, backward=True) == flops.training * SEQ


def test_the_kinds_of_work():
    cfg = config_from_dict({"model": {"preset": "llama-9m", "layer": "lowrank"}, "optimizer": {"name": "spectron"},
                            "data": {"seq_len": 512}, "lowrank": {"rank": 32, "targets": ["down_proj"]}})
    flops = flops_per_token(cfg, 1000)
    dim, ffn, layers = 128, 352, 4
    dense = 4 * dim * dim + 2 * dim * ffn  # q k v o, gate up
    assert flops.projections == layers * 2 * (dense + 32 * (ffn + dim))
    assert flops.attention == layers * 4 * 512 * dim and flops.head == 2 * dim * 1000


def test_throughput_and_mfu():
    values = throughput(tokens_per_s=8000.0, devices=4, training_flops_per_token=10**9, peak_tflops=4.0)
    assert values == pytest.approx({"tokens_per_s_per_device": 2000.0, "tflops_per_device": 2.0, "mfu": 0.5})
    assert "mfu" not in throughput(8000.0, 4, 10**9, None)
    assert known_peak_tflops("NVIDIA H100 80GB HBM3") == known_peak_tflops("NVIDIA H200") == 989.0
    assert known_peak_tflops("NVIDIA H100 PCIe") == 756.0 and known_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert known_peak_tflops("NVIDIA L40S") == 362.0 and known_peak_tflops("NVIDIA L4") == 121.0
    assert known_peak_tflops("NVIDIA H200 NVL") == 835.0 and known_peak_tflops("NVIDIA GB200") == 2500.0
    assert known_peak_tflops("Intel Xeon") is None
