"""SMET in one process: the optimizer against a dense masked reference, slot warm-up, topology
updates, initial densities and config checks."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megasparse.config import config_from_dict
from megasparse.errors import ConfigError
from megasparse.model.factory import projection_shapes
from megasparse.optim.partitions import Fragment
from megasparse.parallel.layers import WeightInit
from megasparse.sparse.density import layer_densities
from megasparse.sparse.layer import SparseLinear
from megasparse.sparse.mask import (active_positions, mask_bytes, mask_checksum, pack, pack_bits, unpack, unpack_bits,
                                    uses_offsets)
from megasparse.sparse.optimizer import MATURE
from megasparse.sparse.topology import (GradientRegrowth, TopologyUpdater, gradient_regrowth, prune_fraction, pruned_slots,
                                        random_regrowth, regrowth_count, slot_sources)
from megasparse.train.optim import build_optimizer


def sparse_config(**sections):
    raw = {"model": {"preset": "llama-tiny", "layer": "sparse"}, "optimizer": {"name": "smet"}}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return config_from_dict(raw).validate()


class TwoLayers(nn.Module):
    def __init__(self, density: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = SparseLinear(12, 10, density, WeightInit(0.5))
        self.b = SparseLinear(10, 8, density, WeightInit(0.5))
        self.gain = nn.Parameter(torch.ones(10))


class MaskedAdamReference:
    """Dense AdamW on the masked matrix with one step count per entry, written out plainly, with SMET's
    warm-up of ``form``: "lr" ramps a regrown entry's rate over its first W steps; "moment" multiplies
    every entry's stored first moment by min(t/W, 1), t its own count, which restarts at 1 on regrowth."""

    def __init__(self, layer: SparseLinear, lr: float, betas, eps, decay, warmup: int, per_entry: bool,
                 form: str) -> None:
        self.w = layer.dense_weight().detach().clone().double()
        self.mask = torch.zeros_like(self.w, dtype=torch.bool)
        self.mask.view(-1)[layer.positions()] = True
        self.m, self.v = torch.zeros_like(self.w), torch.zeros_like(self.w)
        self.t = torch.zeros_like(self.w)
        self.regrown = torch.zeros_like(self.mask)
        self.lr, self.betas, self.eps, self.decay, self.warmup, self.per_entry = lr, betas, eps, decay, warmup, per_entry
        self.form = form
        self.global_t = 0

    def step(self, grad: torch.Tensor) -> None:
        b1, b2 = self.betas
        self.global_t += 1
        self.t[self.mask] += 1
        t = self.t if self.per_entry else torch.full_like(self.t, self.global_t)
        warm = (t / self.warmup).clamp(max=1) if self.warmup and self.per_entry else torch.ones_like(t)
        damp = warm if self.form == "moment" else torch.ones_like(warm)
        self.m = torch.where(self.mask, damp * (b1 * self.m + (1 - b1) * grad), self.m)
        self.v = torch.where(self.mask, b2 * self.v + (1 - b2) * grad**2, self.v)
        ramp = warm if self.form == "lr" else torch.ones_like(warm)
        lr = self.lr * torch.where(self.regrown, ramp, torch.ones_like(ramp))
        update = lr * (self.m / (1 - b1**t)) / ((self.v / (1 - b2**t)).sqrt() + self.eps)
        self.w = torch.where(self.mask, self.w * (1 - lr * self.decay) - update, self.w)

    def move(self, old: set[int], new: set[int]) -> None:
        for pos in old - new:
            self.mask.view(-1)[pos] = False
        for pos in (old - new) | (new - old):
            for tensor in (self.w, self.m, self.v, self.t):
                tensor.view(-1)[pos] = 0
        for pos in new - old:
            self.mask.view(-1)[pos] = True
            self.regrown.view(-1)[pos] = True
            self.t.view(-1)[pos] = 1 if self.form == "moment" else 0


@pytest.mark.parametrize("mode, form", [("smet", "moment"), ("smet", "lr"), ("naive", "moment")])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.5, 0.6)])  # (0.5, 0.6): cohorts mature and ids are reused
def test_smet_step_equals_a_dense_masked_reference(mode, form, betas):
    cfg = sparse_config(optimizer={"lr": 0.01, "betas": list(betas), "weight_decay": 0.1},
                        sparse={"density": 0.3, "update_interval": 4, "prune_fraction": 0.3},
                        smet={"mode": mode, "slot_warmup_steps": 5, "warmup_form": form})
    model = TwoLayers(0.3)
    optimizer = build_optimizer(cfg, model)
    updater = TopologyUpdater(model, cfg.sparse, 60, seed=7, optimizer=optimizer,
                              fragments=lambda p: [Fragment(p, 0, 0, p.numel())])
    group_lr = next(g["lr"] for g in optimizer.param_groups if g.get("sparse"))
    assert group_lr == pytest.approx(0.01 / 0.3 if mode == "smet" else 0.01)  # lr / d in every group by default
    refs = [MaskedAdamReference(layer, group_lr, betas, 1e-8, 0.1, 5, mode == "smet", form)
            for layer in (model.a, model.b)]
    generator = torch.Generator().manual_seed(1)
    for step in range(1, 61):
        for layer, ref in zip((model.a, model.b), refs):
            grad = torch.randn(layer.out_features, layer.in_features, generator=generator, dtype=torch.float64)
            layer.values.grad = grad.reshape(-1)[layer.positions()].float()
            ref.step(grad)
        model.gain.grad = torch.randn(10, generator=generator)
        optimizer.step()
        if updater.due(step):
            before = [set(layer.positions().tolist()) for layer in (model.a, model.b)]
            updater.update(step)
            for layer, ref, old in zip((model.a, model.b), refs, before):
                ref.move(old, set(layer.positions().tolist()))
        for layer, ref in zip((model.a, model.b), refs):
            dense = layer.dense_weight().detach().double()
            torch.testing.assert_close(dense, ref.w, rtol=1e-6, atol=1e-6)
            assert (dense[~ref.mask] == 0).all()
    if betas == (0.5, 0.6) and mode == "smet":
        cohorts = optimizer.state[model.a.values]["cohort"]
        assert (cohorts == MATURE).any()


def step_temporaries(optimizer: torch.optim.Optimizer) -> int:
    """The most bytes an optimizer step holds at once above what was there before it, counted from torch's
    profiler (its memory timeline: the tensors the step touches, and every allocation and free, in order)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        optimizer.step()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    return max(sum(categories) for categories in sizes) - sum(sizes[0])


@pytest.mark.parametrize("form", ["moment", "lr"])
def test_the_smet_step_makes_under_4_bytes_per_slot(form):
    """One flat tensor of slots of several cohorts (ZeRO-1/2's partition): a step's temporaries, counted, stay
    under 4 bytes per slot (an int64 copy of the cohort ids and four gathered fp32 tables were 24)."""
    cfg = sparse_config(optimizer={"lr": 0.01, "weight_decay": 0.1}, smet={"warmup_form": form})
    layer = SparseLinear(1000, 1000, 0.5, WeightInit(0.02))
    optimizer = build_optimizer(cfg, layer)
    slots = layer.values.numel()
    layer.values.grad = torch.randn(slots)
    optimizer.step()
    for cohort_slots in (torch.arange(0, slots, 7), torch.arange(3, slots, 11)):
        optimizer.regrow(layer.values, cohort_slots, optimizer.open_cohort())
        optimizer.step()
    assert step_temporaries(optimizer) < 4 * slots


def constant_gradient_run(mode: str, steps_before: int, steps_after: int, warmup: int = 10, form: str = "moment"):
    """One 4x4 layer at density 0.5, a constant gradient of 1, one regrowth after ``steps_before``
    steps: returns the regrown slot's weight after each later step."""
    cfg = sparse_config(optimizer={"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.0},
                        smet={"mode": mode, "slot_warmup_steps": warmup, "density_lr_power": 0.0,
                              "warmup_form": form})
    layer = SparseLinear(4, 4, 0.5, WeightInit(1.0))
    optimizer = build_optimizer(cfg, layer)
    for _ in range(steps_before):
        layer.values.grad = torch.ones_like(layer.values)
        optimizer.step()
    cohort = optimizer.open_cohort()
    optimizer.regrow(layer.values, torch.tensor([0]), cohort)
    weights = []
    for _ in range(steps_after):
        layer.values.grad = torch.ones_like(layer.values)
        optimizer.step()
        weights.append(layer.values[0].item())
    return weights


def updates(weights: list[float]) -> list[float]:
    return (-torch.diff(torch.tensor([0.0] + weights, dtype=torch.float64))).tolist()


def test_naive_regrown_slot_takes_a_3x_step():
    steps = updates(constant_gradient_run("naive", steps_before=20000, steps_after=300))
    assert steps[0] / 1e-3 == pytest.approx((1 - 0.9) / math.sqrt(1 - 0.999), rel=1e-6)
    assert steps[0] / 1e-3 == pytest.approx(3.16228, rel=1e-5)
    peak = max(range(300), key=lambda k: steps[k])  # (1 - b1^t) / sqrt(1 - b2^t) with global bias corrections ~1
    assert peak + 1 == 12 and steps[peak] / 1e-3 == pytest.approx(6.6, abs=0.05)
    assert min(steps[:280]) > 2e-3 and steps[299] < 2e-3  # above 2 lr until age ~290


def test_smet_regrown_slot_warms_up_linearly():
    steps = updates(constant_gradient_run("smet", steps_before=50, steps_after=12, warmup=10, form="lr"))
    expected = [1e-3 * min(1, t / 10) for t in range(1, 13)]
    assert steps == pytest.approx(expected, rel=1e-6)


def test_smet_moment_warmup_damps_the_first_moment_at_every_step():
    """The reference's form: the count restarts at 1 on regrowth, so the first update is at t = 2, and
    m_t = min(t/W, 1) (b1 m_{t-1} + (1 - b1) g) compounds; for g = 1 written out here."""
    steps = updates(constant_gradient_run("smet", steps_before=50, steps_after=150, warmup=100))
    m = v = 0.0
    expected = []
    for t in range(2, 152):
        m = min(t / 100, 1.0) * (0.9 * m + 0.1)
        v = 0.999 * v + 0.001
        expected.append(1e-3 * (m / (1 - 0.9**t)) / (math.sqrt(v / (1 - 0.999**t)) + 1e-8))
    assert steps == pytest.approx(expected, rel=1e-5)
    assert steps[0] / 1e-3 == pytest.approx(0.0149, abs=2e-4)  # the first update: 0.015 lr (lr form: lr / W)
    assert sum(steps[:100]) / 1e-3 == pytest.approx(16, abs=1)  # 16 lr over W = 100 updates (lr form: 50 lr)


@pytest.mark.parametrize("power", [0.5, 1.0])
def test_density_scaled_rates(power):
    """``all``: every group at lr d^-p with the model's density (the paper's hand-set rates); ``sparse``:
    each sparse layer at its own density, the rest at lr; naive mode: no scaling."""
    model = nn.Module()
    model.a, model.b = SparseLinear(12, 10, 0.3, WeightInit(0.5)), SparseLinear(10, 8, 0.6, WeightInit(0.5))
    model.emb, model.gain = nn.Parameter(torch.ones(5, 4)), nn.Parameter(torch.ones(4))
    for groups, mode in (("all", "smet"), ("sparse", "smet"), ("all", "naive")):
        cfg = sparse_config(optimizer={"lr": 0.01}, sparse={"density": 0.25},
                            smet={"mode": mode, "density_lr_power": power, "density_lr_groups": groups})
        rates = [(g.get("density"), g["lr"]) for g in build_optimizer(cfg, model).param_groups]
        if mode == "naive":
            expected = [(0.3, 0.01), (0.6, 0.01), (None, 0.01), (None, 0.01)]
        elif groups == "all":
            expected = [(0.3, 0.01 * 0.25**-power), (0.6, 0.01 * 0.25**-power), (None, 0.01 * 0.25**-power),
                        (None, 0.01 * 0.25**-power)]
        else:
            expected = [(0.3, 0.01 * 0.3**-power), (0.6, 0.01 * 0.6**-power), (None, 0.01), (None, 0.01)]
        assert [d for d, _ in rates] == [d for d, _ in expected]
        assert [lr for _, lr in rates] == pytest.approx([lr for _, lr in expected]), (groups, mode)


def test_topology_update_keeps_density_exact_and_prunes_the_smallest():
    """Each update prunes the smallest |w|, regrows where nothing was, and every kept weight keeps its value and its
    optimizer state (moments, cohort) at its position while the slots renumber in position order."""
    cfg = sparse_config(sparse={"density": 0.4, "update_interval": 1, "prune_fraction": 0.5})
    model = TwoLayers(0.4)
    optimizer = build_optimizer(cfg, model)
    updater = TopologyUpdater(model, cfg.sparse, 10, seed=3, optimizer=optimizer,
                              fragments=lambda p: [Fragment(p, 0, 0, p.numel())])

    def by_position(layer):
        state = optimizer.state[layer.values]
        return {p: (layer.values[s].item(), state["exp_avg"][s].item(), state["exp_avg_sq"][s].item(),
                    state["cohort"][s].item()) for s, p in enumerate(layer.positions().tolist())}

    for step in range(1, 6):
        for layer in (model.a, model.b):
            layer.values.grad = torch.randn_like(layer.values)
        optimizer.step()
        before = {id(m): by_position(m) for m in (model.a, model.b)}
        updater.update(step)
        for layer in (model.a, model.b):
            old, new = before[id(layer)], by_position(layer)
            numel = layer.in_features * layer.out_features
            assert len(new) == layer.nnz == round(0.4 * numel) and layer.positions().unique().numel() == layer.nnz
            assert (layer.dense_weight() != 0).sum() <= layer.nnz
            pruned, regrown = set(old) - set(new), set(new) - set(old)
            assert len(pruned) == len(regrown) == int(prune_fraction(cfg.sparse, step, 10) * layer.nnz)
            kept = set(old) & set(new)
            assert max(abs(old[p][0]) for p in pruned) <= min(abs(old[p][0]) for p in kept)  # the smallest went
            assert all(new[p] == old[p] for p in kept)  # weight, moments and cohort moved with the position
            assert all(new[p][:3] == (0.0, 0.0, 0.0) for p in regrown)
            assert len({new[p][3] for p in regrown}) == 1 and not {new[p][3] for p in regrown} & {0}


def test_slot_sources_keep_the_order_and_place_the_regrown():
    positions = torch.tensor([1, 4, 6, 9, 12])
    source, landing = slot_sources(positions, torch.tensor([0, 3]), torch.tensor([2, 13]))
    # new positions 2, 4, 6, 12, 13: regrown 2 and 13 at slots 0 and 4, kept 4, 6, 12 from old slots 1, 2, 4
    assert source.tolist() == [-1, 1, 2, 4, -1] and landing.tolist() == [0, 4]


def test_regrowth_by_gradient_takes_the_largest_inactive_gradients():
    values = torch.tensor([0.5, -0.1, 0.3, 0.05])
    active = torch.tensor([True] * 4 + [False] * 5)
    grad = torch.tensor([9.0, 9.0, 9.0, 9.0, 0.1, -5.0, 0.2, 3.0, -0.3])
    assert pruned_slots(values, 2).tolist() == [1, 3]
    assert gradient_regrowth(grad, active, 2).tolist() == [5, 7]


def test_regrowth_by_gradient_equals_a_stable_sort_of_the_scores_with_ties():
    """The choice without a whole-matrix sort equals RigL's definition: a stable descending sort of |dL/dW| with
    the active positions last, its first ``count`` (integer gradients make many ties at the threshold)."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(400):
        numel = int(torch.randint(1, 80, (), generator=generator))
        grad = (torch.randint(-3, 4, (numel,), generator=generator).float() if trial % 2
                else torch.randn(numel, generator=generator))
        active = torch.rand(numel, generator=generator) < torch.rand((), generator=generator)
        count = int(torch.randint(0, int((~active).sum()) + 1, (), generator=generator))
        scores = grad.abs().masked_fill(active, -1.0)
        expected = torch.argsort(scores, descending=True, stable=True)[:count].sort().values
        assert torch.equal(gradient_regrowth(grad.clone(), active, count), expected), (grad, active, count)


@pytest.mark.parametrize("last_only", [False, True])
def test_regrowth_by_gradient_of_the_step_or_of_its_last_micro_batch(last_only):
    """RigL's choice at an update step of two micro-batches: from the sum of both dense gradients
    (``sparse.regrow_gradient: step``), or from the last one's alone (``last_micro_batch``), holding nothing
    of the first."""
    layer = SparseLinear(6, 4, 0.5, WeightInit(0.3))
    first, last = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)), torch.randn(4, 6)
    regrowth = GradientRegrowth(layer, 5, micro_batches=2, dp_group=None, last_only=last_only)
    regrowth(first.clone())
    assert (regrowth.total is None) == last_only
    regrowth(last.clone())
    active = layer.active().clone()
    expected = gradient_regrowth(last.clone() if last_only else first + last, active, 5)
    assert torch.equal(regrowth.positions[0], expected)


def test_active_counts_are_rounded_to_the_multiple_with_the_density_moved_by_under_half_of_it():
    """``sparse.active_multiple`` rounds each layer's ERK count to a multiple (what tensor-parallel ranks share),
    and the overall density moves by under half a multiple per layer; 1 leaves them as the densities give them."""
    from megasparse.model.factory import active_counts, density_rounding, sparse_densities

    for multiple in (1, 8):
        cfg = sparse_config(sparse={"init": "erk", "density": 0.3, "active_multiple": multiple})
        counts = active_counts(cfg)
        for role, (density, nnz, rounded, numel) in counts.items():
            assert rounded % multiple == 0 and abs(rounded - nnz) <= multiple / 2
            assert round(sparse_densities(cfg)[role] * numel) == rounded
            assert (sparse_densities(cfg)[role] == density) == (rounded == nnz)  # unrounded: as configured
        assert any(nnz % 8 for _, nnz, _, _ in counts.values())  # ERK's counts are not multiples of 8 by themselves
        before, after = density_rounding(cfg)
        assert (before == after) == (multiple == 1) and abs(before - after) < 1e-3


def test_random_regrowth_is_seeded():
    active = torch.arange(100) < 20
    picks = [random_regrowth(active, 5, torch.Generator().manual_seed(s)).tolist() for s in (1, 1, 2)]
    assert picks[0] == picks[1] != picks[2]
    assert all(p >= 20 for p in picks[0])


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_rigl_chooses_in_the_backward_from_the_summed_dense_gradient(micro_batches):
    """Inside ``TopologyUpdater.around_step`` each layer's backward hands over dL/dW; after the last micro-batch the
    layer's regrowth is chosen from the sum (as from the dense model's gradient) and no dense gradient is kept."""
    cfg = sparse_config(sparse={"density": 0.4, "update_interval": 2, "regrow": "gradient"})
    model = TwoLayers(0.4)
    updater = TopologyUpdater(model, cfg.sparse, 10, seed=3, optimizer=build_optimizer(cfg, model),
                              fragments=lambda p: [Fragment(p, 0, 0, p.numel())])
    inputs = torch.randn(micro_batches, 4, 12, generator=torch.Generator().manual_seed(5))
    dense_a = model.a.dense_weight().detach().clone().requires_grad_()
    dense_b = model.b.dense_weight().detach().clone().requires_grad_()
    with updater.around_step(1, micro_batches):  # not an update step: nothing is collected
        assert model.a.dense_grad_hook is None
    with updater.around_step(2, micro_batches):
        for i, x in enumerate(inputs, 1):
            model.b(model.a(x).tanh()).square().sum().backward()
            F.linear(F.linear(x, dense_a).tanh(), dense_b).square().sum().backward()
            assert (updater.regrowth[0].positions is None) == (i < micro_batches)
    assert model.a.dense_grad_hook is None and model.b.dense_grad_hook is None
    with pytest.raises(RuntimeError, match="backward ran more than the step's"):
        updater.regrowth[0](torch.zeros(10, 12))  # once more than the step's micro-batches
    zeta = prune_fraction(cfg.sparse, 2, 10)
    for layer, dense, regrowth in zip((model.a, model.b), (dense_a, dense_b), updater.regrowth):
        assert regrowth.total is None and regrowth.seen == micro_batches
        active = layer.active()
        assert regrowth.positions[0].tolist() == gradient_regrowth(dense.grad, active, regrowth_count(layer, zeta)).tolist()
    chosen, before = updater.regrowth[0].positions[0].tolist(), set(model.a.positions().tolist())
    updater.optimizer.step()
    updater.update(2)
    assert set(model.a.positions().tolist()) - before == set(chosen) and updater.regrowth == []
    with pytest.raises(RuntimeError, match="RigL's regrowth of a was not chosen"):
        updater.update(4)  # an update step whose backward ran outside updater.around_step


def test_prune_fraction_decays_by_cosine():
    cfg = sparse_config(sparse={"prune_fraction": 0.2, "prune_fraction_min": 0.005, "stop_step": 1000})
    assert prune_fraction(cfg.sparse, 0, 5000) == pytest.approx(0.2)
    assert prune_fraction(cfg.sparse, 500, 5000) == pytest.approx((0.2 + 0.005) / 2)
    assert prune_fraction(cfg.sparse, 1000, 5000) == pytest.approx(0.005)


def test_updates_stop_at_the_stop_step():
    cfg = sparse_config(sparse={"update_interval": 10, "stop_step": 30})
    updater = TopologyUpdater(TwoLayers(0.5), cfg.sparse, 100, 0, optimizer=None, fragments=None)
    assert [s for s in range(1, 101) if updater.due(s)] == [10, 20]


def test_erk_keeps_the_overall_density_and_favours_small_layers():
    cfg = sparse_config(sparse={"density": 0.2, "init": "erk"}, model={"preset": "llama-60m"})
    shapes, counts = projection_shapes(cfg.model)
    assert shapes["gate_proj"] == (512, 1376) and shapes["down_proj"] == (1376, 512) and counts["q_proj"] == 8
    densities = layer_densities(shapes, counts, cfg.sparse)
    total = sum(shapes[r][0] * shapes[r][1] * counts[r] for r in shapes)
    active = sum(densities[r] * shapes[r][0] * shapes[r][1] * counts[r] for r in shapes)
    assert active / total == pytest.approx(0.2)
    assert densities["q_proj"] > 0.2 > densities["gate_proj"]
    uniform = layer_densities(shapes, counts, sparse_config(sparse={"density": 0.2}).sparse)
    assert set(uniform.values()) == {0.2}


def test_sparse_layer_matches_its_dense_weight():
    torch.manual_seed(0)
    layer = SparseLinear(6, 5, 0.4, WeightInit(1.0))
    x = torch.randn(3, 6, requires_grad=True)
    dense = layer.dense_weight().detach().clone().requires_grad_()
    (layer(x) ** 2).sum().backward()
    (torch.nn.functional.linear(x, dense) ** 2).sum().backward()
    torch.testing.assert_close(layer.values.grad, dense.grad.reshape(-1)[layer.positions()])
    assert layer.mask.dtype == torch.uint8 and layer.mask.numel() == 4 and not layer.mask.requires_grad
    assert layer.nnz == 12 == int(layer.active().sum()) and (layer.positions().diff() > 0).all()


def test_the_mask_packs_as_numpy_does():
    import numpy as np
    bits = torch.rand(1003, generator=torch.Generator().manual_seed(0)) < 0.3
    packed = pack(bits, int(bits.sum()))
    assert packed.tolist() == np.packbits(bits.numpy()).tolist() == pack_bits(bits).tolist()
    assert torch.equal(unpack(packed, 1003, int(bits.sum())), bits) and torch.equal(unpack_bits(packed, 1003), bits)
    assert active_positions(packed, 1003, int(bits.sum())).tolist() == bits.nonzero().squeeze(1).tolist()


def test_a_sparse_mask_is_stored_as_its_positions_offsets_where_that_is_smaller():
    """Below d of about 3/16 the mask is the positions' Elias-Fano code (4 low bits): at d = 0.1 about 5.6 bits per
    active weight, 0.07 byte per weight of W instead of the bits' 1/8; it round-trips at every density and size,
    including the edges (position 0, the last position, whole blocks active, an odd count)."""
    generator = torch.Generator().manual_seed(0)
    cases = [(n, max(1, round(d * n))) for n in (1, 15, 16, 17, 33, 1003, 4096) for d in (0.01, 0.1, 0.18, 0.19, 0.5, 1)]
    for numel, count in cases:
        active = torch.zeros(numel, dtype=torch.bool)
        active[torch.randperm(numel, generator=generator)[:count]] = True
        for chosen in (active, torch.arange(numel) < count, torch.arange(numel) >= numel - count):
            code = pack(chosen, count)
            assert code.dtype == torch.uint8 and code.numel() == mask_bytes(numel, count) <= -(-numel // 8)
            assert torch.equal(unpack(code, numel, count), chosen), (numel, count)
            assert torch.equal(active_positions(code, numel, count), chosen.nonzero().squeeze(1)), (numel, count)
    n = 4096 * 1024
    assert mask_bytes(n, n // 10) / n == pytest.approx(0.0703, abs=1e-4) and uses_offsets(n, n // 10)
    assert [uses_offsets(n, round(d * n)) for d in (0.18, 0.1875, 0.19, 0.5)] == [True, False, False, False]


@pytest.mark.parametrize("base", [{1, 15, 40}, set(range(0, 64, 3))], ids=["offsets", "bits"])
def test_the_mask_checksum_tells_one_moved_bit(base):
    """Every single active position moved elsewhere changes the checksum, in either code (among them a move that
    weights proportional to the byte number missed: {1, 15, 40} against {1, 6, 40})."""
    def checksum(positions):
        active = torch.zeros(64, dtype=torch.bool)
        active[list(positions)] = True
        return int(mask_checksum(pack(active, len(positions))))

    assert uses_offsets(64, len(base)) == (len(base) == 3)
    sums = {checksum(base - {moved} | {to}) for moved in base for to in range(64) if to not in base}
    assert checksum(base) not in sums and len(sums) == len(base) * (64 - len(base))  # all the moves differ
    assert len(base) > 3 or checksum({1, 6, 40}) != checksum(base)


@pytest.mark.parametrize("raw,message", [
    ({"sparse": {"density": 0.0}}, "sparse.density: must be in (0, 1], got 0.0"),
    ({"sparse": {"density": 1.5}}, "sparse.density: must be in (0, 1], got 1.5"),
    ({"sparse": {"prune_fraction": 1.0}}, "sparse.prune_fraction: must be in [0, 1), got 1.0"),
    ({"sparse": {"prune_fraction": -0.1}}, "sparse.prune_fraction: must be in [0, 1), got -0.1"),
    ({"smet": {"slot_warmup_steps": -1}}, "smet.slot_warmup_steps: must be >= 0, got -1"),
    ({"sparse": {"regrow": "magic"}}, "sparse.regrow: 'magic' is not one of 'random', 'gradient'"),
    ({"smet": {"mode": "fast"}}, "smet.mode: 'fast' is not one of 'smet', 'naive'"),
    ({"sparse": {"targets": ["q_proj", "lm_head"]}}, "sparse.targets: unknown projection ['lm_head']"),
    ({"optimizer": {"name": "adamw"}}, "model.layer: sparse projections need optimizer.name=smet"),
    ({"model": {"layer": "dense"}}, "optimizer.name: smet trains sparse projections"),
])
def test_bad_sparse_configs(raw, message):
    with pytest.raises(ConfigError) as error:
        sparse_config(**raw)
    assert message in str(error.value)
