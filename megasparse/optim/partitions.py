"""Where each module parameter lives inside the client optimizer on this rank.

DeepSpeed hands the client optimizer different tensors depending on the layout:

- ZeRO-0 (fp32 only; see ``training.precision``): the module parameters themselves;
- ZeRO-1/2: per parameter group, one flat fp32 partition per rank.
  The parameters of a group are flattened in DeepSpeed's (round-robin) order and padded for
  alignment, then cut into equal partitions, so a parameter may be split between ranks or be
  absent from this rank; DeepSpeed records the piece this rank holds in ``param._hp_mapping``;
- ZeRO-3: per sub-group (a group, or a slice of one when it exceeds ``sub_group_size`` elements
  per rank), one flat fp32 tensor per rank, handed to the client optimizer only while that
  sub-group steps. Every parameter is cut on its own: padded to a multiple of the data-parallel
  size D, rank d holds elements [d P, (d + 1) P) with P = ceil(numel / D) (``param.ds_tensor``),
  and the flat tensor is those pieces back to back in the sub-group's order. The module
  parameter itself is then empty outside the forward and backward passes (``param.ds_shape`` is
  its shape).

A :class:`Fragment` names that piece uniformly: elements [start, start + numel) of the
flattened parameter are ``owner.view(-1)[offset : offset + numel]``, and the optimizer's
elementwise state for them sits at the same offsets of ``optimizer.state[owner]``.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import deepspeed.comm as dist
import torch


@dataclass(frozen=True)
class Fragment:
    owner: torch.Tensor
    offset: int
    start: int
    numel: int

    def positions(self, elements: torch.Tensor) -> torch.Tensor:
        """The positions in ``owner`` of those flat parameter indices ``elements`` that fall in this fragment."""
        inside = (elements >= self.start) & (elements < self.start + self.numel)
        return elements[inside] - self.start + self.offset


def full_shape(param: torch.Tensor) -> torch.Size:
    """The shape of ``param``, also while ZeRO-3 holds it partitioned (and the tensor itself is empty)."""
    return getattr(param, "ds_shape", param.shape)


def optimizer_fragments(engine, client_optimizer: torch.optim.Optimizer, param: torch.nn.Parameter) -> list[Fragment]:
    """The fragments of ``param`` held by ``client_optimizer`` on this rank (possibly none)."""
    if hasattr(param, "ds_tensor"):  # ZeRO-3
        sub_group, offset = _zero3_offsets(engine.optimizer)[id(param)]
        size = param.ds_tensor.ds_numel
        start = dist.get_rank(group=param.ds_process_group) * size
        owner = engine.optimizer.fp32_partitioned_groups_flat[sub_group]
        return [Fragment(owner, offset, start, max(0, min(size, param.ds_numel - start)))]
    if hasattr(param, "_hp_mapping"):  # ZeRO-1/2
        mapping = param._hp_mapping
        if mapping is None:
            return []
        owner = client_optimizer.param_groups[mapping.param_group_index]["params"][0]
        assert owner.untyped_storage().data_ptr() == mapping.hp_fragment.untyped_storage().data_ptr()
        return [Fragment(owner, mapping.hp_fragment_address.start, mapping.lp_fragment_address.start,
                         mapping.lp_fragment_address.numel)]
    if any(p is param for group in client_optimizer.param_groups for p in group["params"]):  # ZeRO-0
        return [Fragment(param, 0, 0, param.numel())]
    raise NotImplementedError(f"cannot locate a parameter in {type(engine.optimizer).__name__}: this DeepSpeed "
                              "optimizer wrapper is not supported")


_OFFSETS: "weakref.WeakKeyDictionary[object, dict[int, tuple[int, int]]]" = weakref.WeakKeyDictionary()


def _zero3_offsets(zero3_optimizer) -> dict[int, tuple[int, int]]:
    """Per parameter (by id): its sub-group and the offset of its piece in that sub-group's flat fp32 tensor."""
    if zero3_optimizer not in _OFFSETS:
        table = {}
        for sub_group, params in enumerate(zero3_optimizer.fp16_groups):
            offset = 0
            for p in params:
                table[id(p)] = (sub_group, offset)
                offset += p.ds_tensor.ds_numel
        _OFFSETS[zero3_optimizer] = table
    return _OFFSETS[zero3_optimizer]
