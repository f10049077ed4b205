"""Sparse masks in blocks along the split side (``sparse.mask_blocks``), in one process: the blocks' geometry, the
layer's passes against its dense masked matrix, and topology updates that keep each block's share."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megasparse.config import config_from_dict
from megasparse.errors import ConfigError
from megasparse.model.factory import sparse_densities
from megasparse.optim.partitions import Fragment
from megasparse.parallel.layers import WeightInit
from megasparse.sparse.blocks import Blocks
from megasparse.sparse.layer import SparseLinear
from megasparse.sparse.topology import (GradientRegrowth, TopologyUpdater, gradient_regrowth, prune_fraction,
                                        regrowth_count)
from megasparse.train.optim import build_optimizer


@pytest.mark.parametrize("by_rows", [True, False])
@pytest.mark.parametrize("first,held", [(0, 4), (1, 2), (3, 1)])
def test_blocks_cut_the_matrix_along_its_split_side(by_rows, first, held):
    """k consecutive blocks of a 8 x 12 matrix in 4 blocks: split and join are inverse, a block is whole rows or
    columns, and held_positions numbers each block's local positions in the matrix the k blocks form."""
    blocks = Blocks(8, 12, 4, by_rows, active=5)
    matrix = torch.arange(96).view(8, 12)
    part = matrix[2 * first:2 * (first + held)] if by_rows else matrix[:, 3 * first:3 * (first + held)]
    pieces = blocks.split(part)
    assert pieces.shape == (held, 24) and torch.equal(blocks.join(pieces), part)
    for i, piece in enumerate(pieces):
        b = first + i
        expected = matrix[2 * b:2 * b + 2] if by_rows else matrix[:, 3 * b:3 * b + 3]
        assert torch.equal(piece, expected.reshape(-1))
    local = torch.stack([torch.randperm(24, generator=torch.Generator().manual_seed(i))[:5].sort().values
                         for i in range(held)])
    assert torch.equal(part.reshape(-1)[blocks.held_positions(local)], pieces.gather(1, local).reshape(-1))


@pytest.mark.parametrize("parallel", ["column", "row"])
def test_a_blocked_layer_is_its_masked_matrix_with_its_share_in_each_block(parallel):
    torch.manual_seed(0)
    layer = SparseLinear(16, 24, 0.25, WeightInit(0.3), parallel=parallel, blocks=8)
    assert layer.nnz == 96 and layer.blocks.active == 12 and layer.held_blocks == 8
    assert (layer.block_active().sum(1) == 12).all() and layer.mask.numel() == 8 * layer.blocks.code_bytes
    dense = torch.zeros(24 * 16).index_copy_(0, layer.positions(), layer.values.detach()).view(24, 16)
    assert torch.equal(layer.active().view(24, 16), dense != 0)
    dense.requires_grad_()
    x = torch.randn(5, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    layer(x).square().sum().backward()
    F.linear(x_ref, dense).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(layer.values.grad, dense.grad.reshape(-1)[layer.positions()])


class Pair(nn.Module):
    """A column- then a row-parallel layer in 4 blocks each (on one process)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = SparseLinear(12, 16, 0.25, WeightInit(0.5), parallel="column", blocks=4)
        self.b = SparseLinear(16, 8, 0.25, WeightInit(0.5), parallel="row", blocks=4)


def updater_of(model: nn.Module, regrow: str) -> TopologyUpdater:
    raw = {"model": {"preset": "llama-tiny", "layer": "sparse"}, "optimizer": {"name": "smet"},
           "sparse": {"density": 0.25, "update_interval": 2, "regrow": regrow, "prune_fraction": 0.5}}
    cfg = config_from_dict(raw).validate()
    return TopologyUpdater(model, cfg.sparse, 10, seed=3, optimizer=build_optimizer(cfg, model),
                           fragments=lambda p: [Fragment(p, 0, 0, p.numel())])


@pytest.mark.parametrize("regrow", ["random", "gradient"])
def test_an_update_prunes_and_regrows_within_each_block(regrow):
    """Each block prunes its smallest |w| and regrows as many of its own inactive positions (RigL: those of
    largest |dL/dW| in the block); the kept weights keep their values, the regrown ones start at 0."""
    model = Pair()
    updater = updater_of(model, regrow)
    x = torch.randn(3, 12, generator=torch.Generator().manual_seed(4))
    with updater.around_step(2, 1):
        model.b(model.a(x).tanh()).square().sum().backward()
    updater.optimizer.step()
    before = {name: (layer.block_active().clone(), layer.values.detach().clone(), layer.local_positions())
              for name, layer in (("a", model.a), ("b", model.b))}
    chosen = [regrowth.positions for regrowth in updater.regrowth]
    updater.update(2)
    for number, (name, layer) in enumerate((("a", model.a), ("b", model.b))):
        active, values, local = before[name]
        count = regrowth_count(layer, prune_fraction(updater.cfg, 2, 10))
        assert count > 0
        after = layer.block_active()
        assert (after.sum(1) == layer.blocks.active).all()
        m = layer.blocks.active
        for i in range(layer.blocks.count):
            block_values = values[i * m:(i + 1) * m]
            pruned = set(local[i][block_values.abs().argsort(stable=True)[:count]].tolist())
            grown = set(after[i].nonzero().squeeze(1).tolist()) - set(active[i].nonzero().squeeze(1).tolist())
            assert set(active[i].nonzero().squeeze(1).tolist()) - set(after[i].nonzero().squeeze(1).tolist()) == pruned
            assert len(grown) == count and not grown & set(active[i].nonzero().squeeze(1).tolist())
            if regrow == "gradient":
                assert grown == set(chosen[number][i].tolist())
        kept = {p: v for p, v in zip(layer.blocks.held_positions(local).tolist(), values.tolist())}
        new = dict(zip(layer.positions().tolist(), layer.values.detach().tolist()))
        assert all(new[p] == kept.get(p, 0.0) for p in new)


def test_rigl_scores_each_block_from_its_own_dense_gradient():
    layer = SparseLinear(8, 12, 0.25, WeightInit(0.3), parallel="row", blocks=4)
    grad = torch.randn(12, 8, generator=torch.Generator().manual_seed(1))
    regrowth = GradientRegrowth(layer, 2, micro_batches=1, dp_group=None)
    regrowth(grad.clone())
    active, scores = layer.block_active(), layer.blocks.split(grad)
    for i in range(4):
        assert torch.equal(regrowth.positions[i], gradient_regrowth(scores[i].clone(), active[i].clone(), 2))


@pytest.mark.parametrize("overrides,message", [
    ({"sparse": {"mask_blocks": 8}, "parallel": {"tensor_parallel": 4}, "model": {"ffn_dim": 176}},
     "model.ffn_dim=176 is padded to a multiple of 32"),
    ({"sparse": {"mask_blocks": 6}, "parallel": {"tensor_parallel": 4}}, "6 blocks do not split over"),
    ({"sparse": {"mask_blocks": 8}, "model": {"ffn_dim": 180}}, "8 does not divide model.ffn_dim=180"),
])
def test_blocks_that_the_layout_cannot_take_are_refused_in_one_line(overrides, message):
    raw = {"model": {"preset": "llama-tiny", "layer": "sparse"}, "optimizer": {"name": "smet"}}
    for section, values in overrides.items():
        raw.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError, match=message):
        config_from_dict(raw).validate()


def test_active_counts_must_share_over_the_blocks():
    raw = {"model": {"preset": "llama-tiny", "layer": "sparse"}, "optimizer": {"name": "smet"},
           "sparse": {"mask_blocks": 8, "density": 0.3}}
    with pytest.raises(ConfigError, match="sparse.mask_blocks: 8 blocks cannot share the 1229 active weights"):
        sparse_densities(config_from_dict(raw).validate())
    raw["sparse"]["active_multiple"] = 8
    assert sparse_densities(config_from_dict(raw).validate())
