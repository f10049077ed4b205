"""Hybrid projections (W = A B + S: Spectron's factors plus a SMET residual) in real DeepSpeed runs on gloo: the
same losses, masks and weights in every layout (ZeRO 0-2, data and tensor parallelism, accumulation), the residual
learning on a moving support, exact resume, and the composed optimizer's parts."""
from __future__ import annotations

import pytest
import torch
from helpers import assert_same_model, megasparse, tiny_config, train_losses, write_config

from megasparse.checkpoint.files import open_checkpoint
from megasparse.checkpoint.state import read_training_state
from megasparse.config import config_from_dict
from megasparse.errors import ConfigError
from megasparse.sparse.mask import unpack
from megasparse.train.metrics import read_metrics

# (ZeRO stage, processes, accumulation steps, tensor-parallel degree)
LAYOUTS = [(0, 2, 1, 1), (1, 2, 4, 1), (2, 2, 1, 1), (3, 2, 1, 1), (1, 2, 1, 2), (2, 4, 1, 2), (3, 4, 1, 2)]
# Splitting a layer over tensor-parallel ranks, or the gradients' sum over data-parallel ranks, changes the order of
# sums; SMET's Adam magnifies that in regrown slots (as in test_smet_training's TP_WEIGHTS), and the residuals, which
# start at zero, are small against that after 8 steps (up to 3.9e-5 of their norm in the data-parallel layouts)
TP_WEIGHTS = RESIDUALS = 1e-4


def whole(run, step: int) -> dict:
    return read_training_state(open_checkpoint(run / "checkpoints" / f"step_{step:08d}")).weights


@pytest.mark.parametrize("zero,nproc,accumulation,tp", LAYOUTS)
def test_every_layout_equals_one_process(runs, zero, nproc, accumulation, tp):
    reference, run = runs(0, 1, 1, method="hybrid"), runs(zero, nproc, accumulation, method="hybrid", tp=tp)
    assert [r["step"] for r in read_metrics(run, "topology")] == [3, 6]
    assert train_losses(run) == pytest.approx(train_losses(reference), rel=1e-5)
    for step in (4, 8):
        actual, expected = whole(run, step), whole(reference, step)
        for name, tensor in expected.items():
            if name.endswith(".mask"):
                assert torch.equal(actual[name], tensor), name
        residual = {name for name in expected if name.endswith("residual.values")}
        assert_same_model({n: t for n, t in actual.items() if n not in residual},
                          {n: t for n, t in expected.items() if n not in residual}, rel=TP_WEIGHTS if tp > 1 else 1e-5)
        assert_same_model({n: actual[n] for n in residual}, {n: expected[n] for n in residual}, rel=RESIDUALS)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_bf16_hybrid_trains_close_to_fp32(runs, zero):
    bf16 = train_losses(runs(zero, 2, 1, "bf16", method="hybrid"))
    assert bf16 == pytest.approx(train_losses(runs(0, 1, 1, method="hybrid")), rel=0.03)


def test_the_residual_learns_on_a_moving_support(runs):
    run = runs(0, 1, 1, method="hybrid")
    before, after = whole(run, 4), whole(run, 8)
    residuals = [name for name in after if name.endswith("residual.values")]
    assert len(residuals) == 2 * 7  # llama-tiny: 2 blocks of 7 projections
    assert all(after[name].abs().sum() > 0 for name in residuals)  # S starts at zero
    count = round(0.15 * 64 * 176)  # the residual's active weights (its mask stored as offsets)
    moved = sum(int((unpack(after[n], 64 * 176, count) != unpack(before[n], 64 * 176, count)).sum())
                for n in after if n.endswith("residual.mask") and ("gate" in n or "up" in n or "down" in n))
    assert moved > 0
    assert train_losses(run)[-1] < train_losses(run)[0]


def test_resume_is_exact(runs, dataset, tmp_path):
    uninterrupted = runs(1, 2, 1, method="hybrid")
    cfg = tiny_config(dataset, tmp_path / "out", "hybrid", parallel={"zero_stage": 1},
                      training={"micro_batch_size": 4})
    megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), "--resume",
               str(uninterrupted / "checkpoints" / "step_00000004"), nproc=2).check()
    assert train_losses(tmp_path / "out") == pytest.approx(train_losses(uninterrupted)[4:], rel=1e-6)
    assert_same_model(whole(tmp_path / "out", 8), whole(uninterrupted, 8), rel=1e-6)


@pytest.mark.parametrize("raw,message", [
    ({"model": {"layer": "hybrid"}}, "model.layer: hybrid projections and optimizer.name=hybrid go together"),
    ({"optimizer": {"name": "hybrid"}}, "optimizer.name: hybrid projections and optimizer.name=hybrid go together"),
    ({"model": {"layer": "hybrid"}, "optimizer": {"name": "hybrid"}, "sparse": {"targets": ["q_proj"]}},
     "sparse.targets: a hybrid model's residuals lie on its factorised projections"),
])
def test_bad_hybrid_configs_name_the_key(raw, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        config_from_dict(raw).validate()


def test_the_optimizer_steps_each_part_as_its_own_optimizer_would():
    """Two steps on a llama-tiny hybrid model: the factors move as Spectron moves them, the residuals' values as
    SMETAdam moves them (per-slot state), every other parameter as AdamW (Spectron's other groups)."""
    from megasparse.lowrank.spectron import Spectron, factor_pairs
    from megasparse.model.factory import layer_factory
    from megasparse.model.llama import Llama
    from megasparse.optim.groups import parameter_groups
    from megasparse.optim.partitions import Fragment
    from megasparse.sparse.optimizer import SMETAdam
    from megasparse.train.optim import build_optimizer

    raw = {"model": {"preset": "llama-tiny", "layer": "hybrid"}, "optimizer": {"name": "hybrid"},
           "sparse": {"density": 0.25}, "smet": {"slot_warmup_steps": 3}}
    cfg = config_from_dict(raw).validate()
    def built() -> Llama:  # (a deep copy would drop the marks the optimizer groups read off the parameters)
        torch.manual_seed(0)
        return Llama(cfg.model, 64, layer_factory(cfg))

    model, models = built(), [built() for _ in range(3)]
    o, s, m = cfg.optimizer, cfg.spectron, cfg.smet
    adam = dict(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    optimizers = [
        build_optimizer(cfg, models[0]),
        Spectron(parameter_groups(models[1], cfg), **adam, momentum=s.momentum, nesterov=s.nesterov,
                 ns_steps=s.ns_steps),
        SMETAdam(parameter_groups(models[2], cfg), **adam, slot_warmup_steps=m.slot_warmup_steps),
    ]
    for optimizer, each in zip(optimizers[:2], models):
        optimizer.attach(factor_pairs(each), fragments=lambda p: [Fragment(p, 0, 0, p.numel())])
    for step in range(2):
        generator = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=generator) for p in model.parameters() if p.requires_grad]
        for each, optimizer in zip(models, optimizers):
            for p, g in zip((p for p in each.parameters() if p.requires_grad), grads):
                p.grad = g.clone()
            optimizer.step()
    hybrid, spectron, smet = (dict(each.named_parameters()) for each in models)
    for name, p in hybrid.items():
        expected = smet[name] if name.endswith("residual.values") else spectron[name]
        assert torch.equal(p, expected), name
    state = optimizers[0].state[hybrid["layers.0.self_attn.q_proj.residual.values"]]
    assert state["cohort"].dtype == torch.uint8 and state["momentum"] is None
    rates = {("sparse" if g["sparse"] else "spectron" if g["spectron"] else "other"): g["lr"]
             for g in optimizers[0].param_groups}  # only the residuals take SMET's density rule
    assert rates == {"sparse": o.lr * 0.25**-m.density_lr_power, "spectron": s.lr, "other": o.lr}


def test_a_hybrid_projection_is_written_dense_only_as_one_matrix(runs, tmp_path):
    from helpers import megasparse_here, one_error_line

    tag = runs(0, 1, 1, method="hybrid") / "checkpoints" / "step_00000008"
    result = megasparse_here("convert", "consolidate", str(tag), "--out", str(tmp_path / "c"), "--lowrank", "dense")
    one_error_line(result, "a hybrid model's projections are dense as one matrix W = A B + S")
    assert not (tmp_path / "c").exists()
    megasparse_here("convert", "consolidate", str(tag), "--out", str(tmp_path / "d"), "--lowrank", "dense",
                    "--sparse", "dense").check()


@pytest.mark.parametrize("name, rank", [("hybrid-llama-130m", 72), ("hybrid-tiny", 6)])
def test_the_shipped_configs_hold_30_percent_of_the_projections_half_in_each_part(name, rank):
    """CHTsL's 70 %-sparsity setting: the factors and the residual each hold about 15 % of the dense projections'
    weights, counted on the models the configs build (on the meta device)."""
    from megasparse.config import load_config
    from megasparse.model.factory import layer_factory
    from megasparse.model.llama import Llama
    from megasparse.train.memory import is_projection

    cfg = load_config(name)
    with torch.device("meta"):
        hybrid = Llama(cfg.model, 8000, layer_factory(cfg))
        cfg.model.layer = "dense"
        dense = Llama(cfg.model, 8000, layer_factory(cfg))
    weights = sum(p.numel() for n, p in dense.named_parameters() if is_projection(n))
    factors = sum(p.numel() for n, p in hybrid.named_parameters() if is_projection(n) and ".factors." in n)
    residual = sum(p.numel() for n, p in hybrid.named_parameters() if n.endswith(".residual.values"))
    assert cfg.lowrank.rank == rank and {m.factors.rank for m in hybrid.modules() if hasattr(m, "factors")} == {rank}
    assert abs(factors / weights - 0.15) < 0.01 and abs(residual / weights - 0.15) < 0.002, (factors, residual)


def test_the_tiny_twin_trains_as_shipped_with_a_topology_update(dataset, tmp_path):
    """hybrid-tiny's recipe on the test corpus, cut to 30 steps: it learns, and SET updates the residual at step
    25 (the 200-step run as shipped: tests/test_paper_recipes.py)."""
    out = tmp_path / "run"
    megasparse("train", "hybrid-tiny", "--set", f"data.path={dataset}", "--set", "training.steps=30",
               "--set", "training.eval_interval=30", "--set", "checkpoint.interval=0", "--set",
               f"training.output_dir={out}").check()
    losses = train_losses(out)
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5, losses
    assert [r["step"] for r in read_metrics(out, "topology")] == [25]
