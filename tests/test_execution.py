"""How the blocks run (megasparse.model.execution): activation checkpointing gives the losses and gradients
of the plain model (and collects a sparse layer's RigL dense gradient once), recomputing what its mode
says; compiled blocks give eager's losses and do not recompile when a topology update moves the slots."""
from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from megasparse.config import config_from_dict
from megasparse.model.execution import checkpoint_blocks, compile_blocks
from megasparse.model.factory import layer_factory
from megasparse.model.llama import Llama
from megasparse.sparse.layer import SparseLinear
from megasparse.sparse.topology import TopologyUpdater

LAYERS = {"dense": "adamw", "sparse": "smet", "lowrank": "spectron"}


def build(layer: str, n_layers: int = 2) -> Llama:
    cfg = config_from_dict({"model": {"preset": "llama-tiny", "layer": layer, "n_layers": n_layers},
                            "optimizer": {"name": LAYERS[layer]}})
    torch.manual_seed(0)
    return Llama(cfg.model, 300, layer_factory(cfg))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 300, (2, 24), generator=generator), torch.randint(0, 300, (2, 24), generator=generator)


def collect_dense_gradients(model: Llama) -> None:
    """What RigL's update steps do: every sparse layer's backward hands its dense dL/dW to a hook (here: kept)."""
    for layer in model.modules():
        if isinstance(layer, SparseLinear):
            layer.collected = []
            layer.dense_grad_hook = layer.collected.append


def step(model: Llama) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss, gradients (and the dense gradients collected, stacked: one per backward expected) of one forward and
    backward."""
    model.zero_grad()
    loss = model(*batch())
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    grads |= {f"{name}.dense_grad": torch.stack(m.collected) for name, m in model.named_modules()
              if getattr(m, "collected", None)}
    return loss.detach(), grads


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


class CountProducts(TorchDispatchMode):
    """Counts the matrix products run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.products = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.products += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


def products_in_backward(model: Llama) -> int:
    loss = model(*batch())
    with CountProducts() as count:
        loss.backward()
    return count.products


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_gives_the_same_losses_and_gradients(layer, mode):
    plain = build(layer)
    checkpointed = copy.deepcopy(plain)
    checkpoint_blocks(checkpointed, mode)
    collect_dense_gradients(plain)
    collect_dense_gradients(checkpointed)
    (loss, grads), (expected_loss, expected) = step(checkpointed), step(plain)
    assert relative(loss, expected_loss) <= 1e-6
    assert grads.keys() == expected.keys() and any(k.endswith("dense_grad") for k in grads) == (layer == "sparse")
    for name in expected:  # the dense gradient handed over once, though the forward ran twice
        assert grads[name].shape == expected[name].shape and relative(grads[name], expected[name]) <= 1e-6, name
    assert all(len(grads[name]) == 1 for name in grads if name.endswith("dense_grad"))


@pytest.mark.parametrize("layer", list(LAYERS))
def test_what_each_mode_recomputes(layer):
    """full reruns each block's forward in backward, matrix products included; selective keeps the products'
    outputs (the backward runs the products of the plain backward only) and recomputes the rest."""
    models = {}
    for mode in ("none", "full", "selective"):
        models[mode] = build(layer)
        checkpoint_blocks(models[mode], mode)
    products = {mode: products_in_backward(model) for mode, model in models.items()}
    blocks = len(models["none"].layers)
    recomputed = (products["full"] - products["none"]) / blocks
    # q k v o gate up (A and B of each when low-rank), not down_proj's last product: the recomputation stops once
    # it has every tensor the backward saved, and that output is not one; a sparse layer's forward (an
    # autograd.Function) saves its input only as it runs whole, so down_proj's product runs too
    assert recomputed == {"dense": 6, "sparse": 7, "lowrank": 13}[layer]
    assert products["selective"] == products["none"]

    calls = {mode: 0 for mode in models}
    for mode, model in models.items():
        def count(*_, mode=mode):
            calls[mode] += 1
        model.layers[0].input_layernorm.register_forward_hook(count)
        products_in_backward(model)
    assert calls == {"none": 1, "full": 2, "selective": 2}


# Each compiled variant is one entry of a block's code: a recompilation past the limit fails instead of falling
# back to eager (whether the blocks share their graphs is asserted below).
@torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True)
def test_compiled_blocks_match_eager_and_neither_rigl_nor_a_topology_update_recompiles():
    """A sparse model, fully checkpointed (selective with compile: test_execution_training) and compiled, against
    eager; RigL's update steps (inside ``TopologyUpdater.around_step``) run eagerly and choose the same regrowth."""
    torch._dynamo.reset()
    counters.clear()
    eager = build("sparse", n_layers=3)
    compiled = copy.deepcopy(eager)
    checkpoint_blocks(compiled, "full")
    compile_blocks(compiled)
    cfg = config_from_dict({"model": {"preset": "llama-tiny", "layer": "sparse"}, "optimizer": {"name": "smet"},
                            "sparse": {"regrow": "gradient", "update_interval": 2}})
    updaters = [TopologyUpdater(model, cfg.sparse, 10, 0, optimizer=None, fragments=None) for model in (compiled, eager)]

    def same_steps() -> None:  # an ordinary step, RigL's update step, an ordinary step
        for number in (1, 2, 3):
            with updaters[0].around_step(number, 1), updaters[1].around_step(number, 1):
                (loss, grads), (expected_loss, expected) = step(compiled), step(eager)
            assert relative(loss, expected_loss) <= 1e-5
            for name in expected:
                assert relative(grads[name], expected[name]) <= 1e-5, name
            chosen = [[[p.tolist() for p in regrowth.positions] for regrowth in updater.regrowth] for updater in updaters]
            assert chosen[0] == chosen[1] and len(chosen[0]) == (3 * 7 if number == 2 else 0)

    same_steps()
    graphs = counters["stats"]["unique_graphs"]
    assert 0 < graphs < len(compiled.layers)  # the blocks share their graphs
    for model in (eager, compiled):  # a topology update: other bits set in the masks, the shapes unchanged
        for layer in model.modules():
            if isinstance(layer, SparseLinear):
                numel = layer.out_features * layer.in_features
                active = torch.zeros(numel, dtype=torch.bool)
                active[torch.randperm(numel, generator=torch.Generator().manual_seed(2))[:layer.nnz]] = True
                layer.set_active(active)
    same_steps()
    assert counters["stats"]["unique_graphs"] == graphs
    assert not counters["graph_break"]  # RigL's hooks were never traced (dynamo breaks the graph at them)
