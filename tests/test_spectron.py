"""Spectron and the low-rank layer in one process: the step against a plain reference, the
spectral bound on the change of W, orthogonalisation, balanced initialisation, config checks."""
import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megasparse.config import config_from_dict
from megasparse.errors import ConfigError
from megasparse.lowrank.layers import LowRankLinear, balanced_factors
from megasparse.lowrank.linalg import newton_schulz
from megasparse.lowrank.spectron import factor_pairs
from megasparse.model.factory import layer_factory
from megasparse.model.llama import Llama
from megasparse.optim.partitions import Fragment, choose_owners
from megasparse.parallel.layers import WeightInit
from megasparse.parallel.mappings import TensorParallel
from megasparse.train.optim import build_optimizer

WHOLE = TensorParallel()


def spectron_config(**sections):
    raw = {"model": {"preset": "llama-tiny", "layer": "lowrank"}, "optimizer": {"name": "spectron"}}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return config_from_dict(raw).validate()


class Pair(nn.Module):
    def __init__(self, rank: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = LowRankLinear(20, 12, rank, WeightInit(0.3))
        self.gain = nn.Parameter(torch.ones(12))


def attached(model, **sections):
    optimizer = build_optimizer(spectron_config(**sections), model)
    optimizer.attach(factor_pairs(model), fragments=lambda p: [Fragment(p, 0, 0, p.numel())])
    return optimizer


def reference_newton_schulz(m: torch.Tensor) -> torch.Tensor:
    x = m / (m.norm() + 1e-7)
    for _ in range(5):
        gram = x.T @ x
        x = 3.4445 * x + x @ (-4.7750 * gram + 2.0315 * gram @ gram)
    return x


@pytest.mark.parametrize("shape_scale, orthogonalise, renormalise",
                         [(True, True, True), (False, True, True), (True, True, False), (True, False, True),
                          (True, False, False)])
def test_step_equals_the_written_out_algorithm(shape_scale, orthogonalise, renormalise):
    """Spectron and its ablations, written out: A is 12 x 4, so its orthogonalised update is scaled by
    sqrt(12 / 4) (B, 4 x 20: by 1); without orthogonalisation the factors follow AdamW's direction."""
    model = Pair()
    optimizer = attached(model, spectron={"lr": 0.05, "momentum": 0.9, "nesterov": True, "shape_scale": shape_scale,
                                          "orthogonalise": orthogonalise, "renormalise": renormalise},
                         optimizer={"weight_decay": 0.1, "betas": [0.8, 0.9], "eps": 1e-6})
    a, b = model.proj.A.detach().clone(), model.proj.B.detach().clone()
    momentum = {"A": torch.zeros_like(a), "B": torch.zeros_like(b)}
    adam = {key: [torch.zeros_like(x), torch.zeros_like(x)] for key, x in (("A", a), ("B", b))}
    vectors = [v.clone() for v in optimizer._power_vectors()["proj"]]
    generator = torch.Generator().manual_seed(3)
    for t in range(1, 5):
        grads = {"A": torch.randn(a.shape, generator=generator), "B": torch.randn(b.shape, generator=generator)}
        model.proj.A.grad, model.proj.B.grad = grads["A"], grads["B"]
        model.gain.grad = torch.randn(12, generator=generator)
        optimizer.step()
        sigmas = []
        for i, matrix in enumerate((a, b.T)):  # one warm-started power-iteration step each
            u = matrix @ vectors[i]
            u = u / u.norm()
            w = matrix.T @ u
            sigmas.append(w.norm())
            vectors[i] = w / w.norm()
        rho = 0.05 / (sigmas[0] + sigmas[1] + 1) if renormalise else 0.05
        steps = {}
        for key in ("A", "B"):
            momentum[key] = 0.9 * momentum[key] + 0.1 * grads[key]
            direction = 0.1 * grads[key] + 0.9 * momentum[key]  # Nesterov
            m, v = adam[key]
            m.mul_(0.8).add_(0.2 * grads[key])
            v.mul_(0.9).add_(0.1 * grads[key] ** 2)
            if not orthogonalise:
                steps[key] = (m / (1 - 0.8**t)) / ((v / (1 - 0.9**t)).sqrt() + 1e-6)
            elif key == "A":
                steps[key] = reference_newton_schulz(direction) * (math.sqrt(12 / 4) if shape_scale else 1.0)
            else:
                steps[key] = reference_newton_schulz(direction.T).T
        a = a * (1 - 0.05 * 0.1) - rho * steps["A"]
        b = b * (1 - 0.05 * 0.1) - rho * steps["B"]
        torch.testing.assert_close(model.proj.A.detach(), a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model.proj.B.detach(), b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape_scale", [False, True])
def test_a_step_changes_w_by_at_most_eta_in_spectral_norm(shape_scale):
    """||dW||_2 <= rho (s_A ||O_A|| sigma_B + s_B sigma_A ||O_B||) + rho^2 s_A s_B ||O_A|| ||O_B||, and with
    the quintic's ||O||_2 <= 1.25 this stays below max(s) eta (1 + 0.25): the tolerance is the overshoot of
    Newton-Schulz; A is 48 x 12, so s_A = 2 with the shape factor."""
    bound = 0.1 * 1.25 * (2.0 if shape_scale else 1.0)
    for seed in range(5):
        torch.manual_seed(seed)
        layer = LowRankLinear(64, 48, 12, WeightInit(float(torch.rand(()) + 0.1)))
        optimizer = attached(layer, spectron={"lr": 0.1, "shape_scale": shape_scale}, optimizer={"weight_decay": 0.0})
        for _ in range(3):
            before = layer.A.detach() @ layer.B.detach()
            layer.A.grad, layer.B.grad = torch.randn_like(layer.A), torch.randn_like(layer.B)
            optimizer.step()
            change = torch.linalg.matrix_norm(layer.A.detach() @ layer.B.detach() - before, 2).item()
            assert change <= bound, (seed, change)


def kernels_of_a_step(n_layers: int) -> int:
    """ATen operations other than views in Spectron's second step of llama-tiny with ``n_layers`` blocks, counted
    as benchmarks/spectron_step.py counts them."""
    benchmarks = Path(__file__).parents[1] / "benchmarks"
    spec = importlib.util.spec_from_file_location("benchmark_common", benchmarks / "common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    cfg = spectron_config(model={"n_layers": n_layers})
    model = Llama(cfg.model, 256, layer_factory(cfg))
    optimizer = build_optimizer(cfg, model)
    optimizer.attach(factor_pairs(model), fragments=lambda p: [Fragment(p, 0, 0, p.numel())])
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optimizer.step()
    kernels = common.Kernels()
    with kernels.mode:
        optimizer.step()
    return kernels.count


def test_a_layer_adds_no_kernels_to_the_factor_step():
    """The factors of one kind and shape are stepped as one batch, so a block's 7 more factor pairs add kernels
    only for its two norm gains' AdamW (8 each) and nothing for the pairs: the per-pair step took about 80 each."""
    one, two, four = (kernels_of_a_step(n) for n in (1, 2, 4))
    assert two - one == (four - two) / 2 <= 16, (one, two, four)


def test_newton_schulz_orthogonalises():
    m = torch.randn(50, 8, generator=torch.Generator().manual_seed(0)) @ torch.diag(torch.logspace(-1, 0.5, 8))
    singular = torch.linalg.svdvals(newton_schulz(m[None], WHOLE)[0])
    assert singular.min() > 0.6 and singular.max() < 1.25  # the quintic's band around 1
    u, _, vh = torch.linalg.svd(m, full_matrices=False)
    assert torch.nn.functional.cosine_similarity(newton_schulz(m[None], WHOLE).flatten(), (u @ vh).flatten(), dim=0) > 0.95


def test_balanced_factors_are_the_best_rank_r_approximation():
    w = torch.randn(30, 20, generator=torch.Generator().manual_seed(0))
    a, b = balanced_factors(w, 5)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    torch.testing.assert_close(a @ b, u[:, :5] @ torch.diag(s[:5]) @ vh[:5], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.linalg.svdvals(a), s[:5].sqrt(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.linalg.svdvals(b), s[:5].sqrt(), rtol=1e-4, atol=1e-5)


def test_lowrank_forward_never_forms_w():
    layer = LowRankLinear(10, 7, 3, WeightInit(1.0))
    x = torch.randn(4, 10)
    torch.testing.assert_close(layer(x), x @ (layer.A @ layer.B).T)
    assert {n for n, _ in layer.named_parameters()} == {"A", "B"}


def test_other_parameters_get_adamw():
    model = Pair()
    optimizer = attached(model, optimizer={"lr": 0.01, "weight_decay": 0.1})
    reference = nn.Parameter(model.gain.detach().clone())
    adamw = torch.optim.AdamW([reference], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    for _ in range(5):
        grad = torch.randn(12)
        model.gain.grad, reference.grad = grad, grad.clone()
        model.proj.A.grad, model.proj.B.grad = torch.randn_like(model.proj.A), torch.randn_like(model.proj.B)
        optimizer.step()
        adamw.step()
    torch.testing.assert_close(model.gain.detach(), reference.detach())  # norm gains: no weight decay


def test_factory_ranks():
    cfg = spectron_config(lowrank={"rank_ratio": 0.25})
    factory = layer_factory(cfg)
    assert factory.ranks == {"q_proj": 16, "k_proj": 16, "v_proj": 16, "o_proj": 16, "gate_proj": 16,
                             "up_proj": 16, "down_proj": 44}
    aligned = layer_factory(spectron_config(model={"preset": "llama-1b"}, lowrank={"rank_multiple": 8}))
    assert aligned.ranks["down_proj"] == 1368 and layer_factory(spectron_config(model={"preset": "llama-1b"})).ranks[
        "down_proj"] == 1365  # round(0.25 x 5461), as the papers take it


@pytest.mark.parametrize("raw,message", [
    ({"lowrank": {"rank": 64}}, "lowrank.rank: rank 64 for q_proj (64 x 64) must be in (0, 64)"),
    ({"lowrank": {"rank_ratio": 0.001}}, "lowrank.rank_ratio: rank 0 for q_proj (64 x 64) must be in (0, 64)"),
    ({"lowrank": {"rank": -1}}, "lowrank.rank: must be >= 0, got -1"),
    ({"lowrank": {"rank_ratio": 1.0}}, "lowrank.rank_ratio: must be in (0, 1), got 1.0"),
    ({"model": {"layer": "dense"}}, "optimizer.name: spectron steps factorised weights, and this model has none"),
    ({"lowrank": {"targets": []}}, "optimizer.name: spectron steps factorised weights"),
    ({"parallel": {"tensor_parallel": 3}}, "parallel.tensor_parallel: 3 does not divide model.n_heads=4"),
    ({"parallel": {"tensor_parallel": 0}}, "parallel.tensor_parallel: must be >= 1"),
    ({"spectron": {"momentum": 1.0}}, "spectron.momentum: must be in [0, 1), got 1.0"),
])
def test_bad_lowrank_configs(raw, message):
    with pytest.raises(ConfigError) as error:
        layer_factory(spectron_config(**raw))
    assert message in str(error.value)


def test_sparse_slots_must_split_evenly_over_tensor_parallel_ranks():
    cfg = {"model": {"preset": "llama-tiny", "layer": "sparse"}, "optimizer": {"name": "smet"},
           "parallel": {"tensor_parallel": 2}}
    layer_factory(config_from_dict({**cfg, "sparse": {"density": 0.25}}).validate())  # 1024 of 64 x 64: 512 each
    with pytest.raises(ConfigError, match="2 ranks cannot share the 1229 active weights of q_proj"):
        layer_factory(config_from_dict({**cfg, "sparse": {"density": 0.3}}).validate())


def test_newton_schulz_in_bf16_points_where_fp32_does():
    """``spectron.ns_dtype: bf16`` runs the iterations in bf16 (as Muon and the Spectron reference do): the
    direction returned (fp32) is within a cosine of 0.999 of fp32's, tall and wide, and not the same."""
    for shape, wide in (((3, 96, 24), False), ((3, 24, 96), True)):
        m = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        fp32 = newton_schulz(m, TensorParallel(), 5, wide=wide)
        bf16 = newton_schulz(m, TensorParallel(), 5, wide=wide, dtype=torch.bfloat16)
        assert bf16.dtype == torch.float32 and not torch.equal(fp32, bf16)
        assert torch.nn.functional.cosine_similarity(fp32.flatten(1), bf16.flatten(1)).min() > 0.999


def test_each_factor_is_owned_where_most_of_it_lies_and_even_cuts_are_balanced():
    """Spectron's owner ranks (``choose_owners``). ZeRO-1/2-like: consecutive partitions of one buffer of six
    factors of 10 elements over 3 ranks of 20, so factors 0-1, 2-3, 4-5 lie on ranks 0, 1, 2 (factor 2 is
    split 1:9 between ranks 0 and 1): each goes to the rank holding most of it, whatever the costs. ZeRO-3-like:
    every factor cut evenly over the ranks; the owners balance the cost, every rank within the largest cost of
    the mean."""
    held = [[10, 10, 1, 0, 0, 0], [0, 0, 9, 10, 0, 0], [0, 0, 0, 0, 10, 10]]
    assert choose_owners(held, [1, 100, 5, 1, 1, 50]) == [0, 0, 1, 1, 2, 2]
    costs = [9, 7, 7, 5, 3, 3, 2, 1]
    owners = choose_owners([[4] * len(costs)] * 3, costs)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(3)]
    assert sorted(set(owners)) == [0, 1, 2] and max(loads) - sum(costs) / 3 <= max(costs)
    assert loads == [13, 12, 12]  # 9+3+1, 7+5, 7+3+2


@pytest.mark.parametrize("split", ["column", "row"])
def test_a_padded_pair_steps_as_the_unpadded_one(split):
    """A factor pair whose MLP side is stored padded (13 -> 16: A's rows as gate/up, B's columns as down) takes the
    unpadded pair's Spectron steps (power iteration, Newton-Schulz, shape factor from the real shape), and its
    padding stays exactly zero."""
    def model(pad: bool) -> nn.Module:
        torch.manual_seed(0)
        in_features, out_features = (20, 13) if split == "column" else (13, 20)
        return LowRankLinear(in_features, out_features, 4, WeightInit(0.3), WHOLE, split if pad else None, pad=pad)

    padded, plain = model(True), model(False)
    param = padded.A if split == "column" else padded.B
    dim, width = param.padding
    steppers = [attached(m, spectron={"lr": 0.05}, optimizer={"weight_decay": 0.1}) for m in (padded, plain)]
    generator = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = torch.randn(6, padded.in_features, generator=generator)
        for m, optimizer in zip((padded, plain), steppers):
            m.zero_grad()
            m(F.pad(x, (0, 3)) if split == "row" and m is padded else x).square().sum().backward()
            optimizer.step()
        for mine, theirs in ((padded.A, plain.A), (padded.B, plain.B)):
            real = mine.detach().narrow(dim, 0, width) if mine is param else mine.detach()
            torch.testing.assert_close(real, theirs.detach(), rtol=1e-6, atol=1e-7)
        assert not param.detach().narrow(dim, width, param.shape[dim] - width).any()
