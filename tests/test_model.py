"""The LLaMA model: shapes, causality, RoPE, RMSNorm, attention variants, presets."""
import math

import pytest
import torch
import torch.nn.functional as F

from megasparse.config import config_from_dict
from megasparse.model.llama import Llama, RMSNorm, apply_rope, num_parameters, rope_tables

VOCAB = 97


def tiny(**model) -> Llama:
    torch.manual_seed(0)
    return Llama(config_from_dict({"model": {"preset": "llama-tiny", **model}}).validate().model, VOCAB)


def test_logits_shape_and_loss():
    model = tiny()
    tokens = torch.randint(0, VOCAB, (3, 11))
    assert model(tokens).shape == (3, 11, VOCAB)
    loss = model(tokens, tokens)
    assert loss.ndim == 0 and loss.dtype == torch.float32
    assert loss.item() == pytest.approx(math.log(VOCAB), rel=0.05)  # small init: near-uniform prediction


@pytest.mark.parametrize("model", [{}, {"n_kv_heads": 2}, {"n_kv_heads": 1}, {"tie_embeddings": True}])
def test_causal_prefix_outputs_ignore_the_future(model):
    net = tiny(**model)
    tokens = torch.randint(0, VOCAB, (2, 16))
    changed = tokens.clone()
    changed[:, 9:] = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        a, b = net(tokens), net(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_rope_rotates_pairs_and_keeps_norms():
    cos, sin = rope_tables(seq_len=8, head_dim=6, theta=10000.0, device=torch.device("cpu"))
    x = torch.randn(2, 8, 3, 6)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, 0], x[:, 0])  # position 0: angle 0
    # feature i pairs with i + D/2 and turns by t * theta^(-2i/D)
    angle = 5 * 10000.0 ** (-2 * 1 / 6)
    x1, x2 = x[:, 5, :, 1], x[:, 5, :, 4]
    torch.testing.assert_close(y[:, 5, :, 1], x1 * math.cos(angle) - x2 * math.sin(angle))
    torch.testing.assert_close(y[:, 5, :, 4], x2 * math.cos(angle) + x1 * math.sin(angle))


def test_rope_scores_depend_on_relative_position_only():
    cos, sin = rope_tables(seq_len=12, head_dim=8, theta=10000.0, device=torch.device("cpu"))
    q, k = torch.randn(8), torch.randn(8)
    at = lambda v, t: apply_rope(v.expand(1, 12, 1, 8), cos, sin)[0, t, 0]  # noqa: E731
    assert torch.dot(at(q, 7), at(k, 4)).item() == pytest.approx(torch.dot(at(q, 5), at(k, 2)).item(), rel=1e-5)


def test_rmsnorm_matches_its_formula():
    norm = RMSNorm(5, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 6.0))
    x = torch.randn(4, 5)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected)
    assert norm.bfloat16()(x.bfloat16()).dtype == torch.bfloat16


def test_attention_equals_explicit_masked_softmax():
    net = tiny()
    attn, x = net.layers[0].self_attn, torch.randn(2, 6, 64)
    cos, sin = rope_tables(6, 16, 10000.0, torch.device("cpu"))
    q = apply_rope(attn.q_proj(x).view(2, 6, 4, 16), cos, sin).transpose(1, 2)
    k = apply_rope(attn.k_proj(x).view(2, 6, 4, 16), cos, sin).transpose(1, 2)
    v = attn.v_proj(x).view(2, 6, 4, 16).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / 4.0
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    expected = attn.o_proj((F.softmax(scores, -1) @ v).transpose(1, 2).reshape(2, 6, 64))
    torch.testing.assert_close(attn(x, cos, sin), expected, rtol=1e-5, atol=1e-6)


def test_tied_embeddings_share_one_tensor():
    net = tiny(tie_embeddings=True)
    assert net.lm_head.weight is net.embed_tokens.weight
    assert num_parameters(net) == num_parameters(tiny()) - VOCAB * 64


@pytest.mark.parametrize("preset,millions", [("llama-9m", 9.0), ("llama-60m", 58.1), ("llama-130m", 134.1),
                                             ("llama-240m", 239.4), ("llama-350m", 368.0),
                                             ("llama-1b", 1339.1)])
def test_preset_sizes_with_a_32k_vocabulary(preset, millions):
    cfg = config_from_dict({"model": {"preset": preset}}).validate().model
    with torch.device("meta"):
        net = Llama(cfg, 32000)
    d, f, layers = cfg.dim, cfg.ffn_dim, cfg.n_layers
    assert num_parameters(net) == 2 * 32000 * d + layers * (4 * d * d + 3 * d * f + 2 * d) + d
    assert num_parameters(net) / 1e6 == pytest.approx(millions, rel=1e-3)


def test_tiny_preset_is_under_two_million_parameters_with_an_8k_vocabulary():
    cfg = config_from_dict({"model": {"preset": "llama-tiny"}}).model
    with torch.device("meta"):
        assert num_parameters(Llama(cfg, 8000)) < 2_000_000


def test_output_projections_start_smaller():
    net = tiny()
    block = net.layers[0]
    assert block.mlp.down_proj.weight.std() < 0.6 * block.mlp.up_proj.weight.std()


@pytest.mark.parametrize("layer", ["dense", "sparse", "lowrank"])
def test_weight_init_schemes(layer):
    """scaled_normal: N(0, s^2), residual outputs N(0, s^2 / 2L); normal: N(0, s^2) everywhere (SMET's code);
    torch: linear U(+-1/sqrt(in)) (variance 1 / (3 in)) and embedding N(0, 1) (Spectron's code). The
    low-rank projections start as the best rank-r approximation of such a draw, so for them only the
    depth scaling is checked."""
    from megasparse.model.factory import layer_factory

    def model(init: str) -> Llama:
        cfg = config_from_dict({"model": {"preset": "llama-9m", "init": init, "init_std": 0.05, "layer": layer},
                                "optimizer": {"name": {"sparse": "smet", "lowrank": "spectron"}.get(layer, "adamw")}})
        torch.manual_seed(0)
        return Llama(cfg.validate().model, 512, layer_factory(cfg))

    def std(module) -> float:
        weight = module.values if layer == "sparse" else module.weight if layer == "dense" else module.A @ module.B
        return weight.detach().std().item()

    depth = math.sqrt(2 * 4)  # llama-9m: 4 layers
    scaled, plain, default = model("scaled_normal"), model("normal"), model("torch")
    for net in (scaled, plain):
        assert net.embed_tokens.weight.std().item() == pytest.approx(0.05, rel=0.02)
        assert net.lm_head.weight.std().item() == pytest.approx(0.05, rel=0.02)
    assert default.embed_tokens.weight.std().item() == pytest.approx(1.0, rel=0.02)
    head = default.lm_head.weight
    assert head.abs().max() <= 1 / math.sqrt(128) and head.std().item() == pytest.approx((3 * 128) ** -0.5, rel=0.02)
    if layer == "lowrank":  # the same draws, scaled: A B scales with them
        for proj, ratio in (("up_proj", 1.0), ("down_proj", 1 / depth)):
            scaled_proj, plain_proj = getattr(scaled.layers[0].mlp, proj), getattr(plain.layers[0].mlp, proj)
            assert std(scaled_proj) / std(plain_proj) == pytest.approx(ratio, rel=1e-4)
        return
    for net, down_std in ((scaled, 0.05 / depth), (plain, 0.05)):
        assert std(net.layers[0].mlp.up_proj) == pytest.approx(0.05, rel=0.02)
        assert std(net.layers[0].mlp.down_proj) == pytest.approx(down_std, rel=0.02)
        assert std(net.layers[0].self_attn.o_proj) == pytest.approx(down_std, rel=0.05)
    for proj, fan_in in ((default.layers[0].mlp.up_proj, 128), (default.layers[0].mlp.down_proj, 352)):
        weight = proj.values if layer == "sparse" else proj.weight
        assert weight.abs().max().item() <= 1 / math.sqrt(fan_in)
        assert weight.std().item() == pytest.approx((3 * fan_in) ** -0.5, rel=0.02)


def _build(layer: str, preset: str = "llama-tiny") -> Llama:
    from megasparse.model.factory import layer_factory

    optimizer = {"dense": "adamw", "sparse": "smet", "lowrank": "spectron"}[layer]
    cfg = config_from_dict({"model": {"preset": preset, "layer": layer}, "optimizer": {"name": optimizer}}).validate()
    torch.manual_seed(3)
    return Llama(cfg.model, VOCAB, layer_factory(cfg))


@pytest.mark.parametrize("layer", ["dense", "sparse", "lowrank"])
def test_a_model_built_on_the_device_holds_the_host_builds_weights_cast(layer):
    """built_on moves each parameter as it is registered; the draws stay on the host, so the weights (sparse masks,
    low-rank SVD factors) are those of a build on the host in fp32, cast; buffers keep their precision."""
    from megasparse.model.placement import built_on

    host = _build(layer)
    with built_on("cpu", torch.bfloat16):
        placed = _build(layer)
    expected, actual = host.state_dict(), placed.state_dict()
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        want = tensor.bfloat16() if tensor.is_floating_point() and name in dict(host.named_parameters()) else tensor
        assert actual[name].dtype == want.dtype and torch.equal(actual[name], want), name
    if layer == "sparse":
        density = host.layers[0].self_attn.q_proj.values.sparse_density
        assert placed.layers[0].self_attn.q_proj.values.sparse_density == density  # what the layers set on it stays
    assert placed.lm_head.weight is placed.embed_tokens.weight or not host.lm_head.weight is host.embed_tokens.weight


def test_building_on_the_device_holds_one_layer_on_the_host_not_the_model():
    """The device faked by the meta device: the most the host holds while llama-20m is built is a few of its
    tensors (counted with torch's profiler), against the whole fp32 model when it is built on the host."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    from megasparse.model.placement import built_on

    def host_peak(place: bool) -> int:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as p:
            if place:
                with built_on("meta", torch.bfloat16):
                    model = _build("dense", "llama-20m")
            else:
                model = _build("dense", "llama-20m")
        _, sizes = MemoryProfileTimeline(p._memory_profile())._coalesce_timeline(torch.device("cpu"))
        return max(sum(categories) for categories in sizes), num_parameters(model)

    placed, parameters = host_peak(True)
    whole, _ = host_peak(False)
    assert whole >= 4 * parameters and placed < 4 * parameters / 8, (placed, whole, parameters)
