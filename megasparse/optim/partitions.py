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
from deepspeed.accelerator import get_accelerator


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
    """The fragments of ``param`` held by ``client_optimizer`` on this rank (possibly none; none at all for a
    parameter that does not train)."""
    if not param.requires_grad:
        return []
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


class PartitionGather:
    """Whole parameters on every data-parallel rank, from the one flat optimizer tensor per rank that holds their
    partitions (ZeRO-1/2: a group's partition; ZeRO-3: a sub-group's).

    :meth:`gather` all-gathers every rank's flat tensor, or tensors laid out like it (optimizer state), in one
    collective: the ranks' tensors back to back, each padded to the longest. :meth:`pieces` reads one parameter
    out of the result as a list of 1-D views in element order: a single view where its pieces lie back to back
    (ZeRO-1/2 cut one flat buffer of the group, in order, into equal partitions), else one per rank holding a
    piece (ZeRO-3 cuts every parameter on its own). Building it is collective too: every rank's fragments of
    every parameter are exchanged once."""

    def __init__(self, params: list[torch.Tensor], fragments, group) -> None:
        owners = {id(f.owner): f.owner for p in params for f in fragments(p)}
        if len(owners) > 1 or any(len(fragments(p)) > 1 for p in params):
            raise ValueError("PartitionGather needs every parameter in one flat tensor per rank, one piece each")
        self.owner = next(iter(owners.values()), None)
        self.group, self.size = group, dist.get_world_size(group=group)
        device = get_accelerator().current_device_name()
        table = [[f.offset, f.start, f.numel] for p in params for f in fragments(p) or [Fragment(None, 0, 0, 0)]]
        table.append([0 if self.owner is None else self.owner.numel(), 0, 0])
        local = torch.tensor(table, dtype=torch.int64, device=device)
        every = torch.empty(self.size * local.numel(), dtype=torch.int64, device=device)
        dist.allgather_fn(every, local.view(-1), group=group)  # flat: gloo gathers into a list of chunks
        every = every.view(self.size, *local.shape).tolist()
        self.length = max(rank[-1][0] for rank in every)
        self.shapes = [full_shape(p) for p in params]
        self._spans = [self._spans_of(i, every) for i in range(len(params))]

    def _spans_of(self, index: int, every: list) -> list[tuple[int, int]]:
        """(position in the gathered tensor, numel) of parameter ``index``'s pieces in element order, merged
        where they touch."""
        pieces = sorted((rank[index][1], r * self.length + rank[index][0], rank[index][2])
                        for r, rank in enumerate(every) if rank[index][2] > 0)
        spans: list[list[int]] = []
        expected = 0
        for start, position, numel in pieces:
            assert start == expected, "the ranks' pieces of a parameter do not cover it"
            if spans and spans[-1][0] + spans[-1][1] == position:
                spans[-1][1] += numel
            else:
                spans.append([position, numel])
            expected += numel
        assert expected == self.shapes[index].numel(), "the ranks' pieces of a parameter do not cover it"
        return [(position, numel) for position, numel in spans]

    def gather(self, *sources: torch.Tensor | None) -> list[torch.Tensor]:
        """Each of ``sources`` (laid out like this rank's flat tensor; None on a rank that holds none) from every
        rank, back to back: one all-gather for all of them."""
        device = get_accelerator().current_device_name() if self.owner is None else self.owner.device
        first = sources[0]
        if len(sources) == 1 and first is not None and first.numel() == self.length and first.dtype == torch.float32:
            send = first.reshape(1, -1)  # sent as it is
        else:
            send = torch.zeros(len(sources), self.length, dtype=torch.float32, device=device)
            for k, source in enumerate(sources):
                if source is not None:
                    send[k, :source.numel()] = source.reshape(-1)
        received = torch.empty(self.size * send.numel(), dtype=torch.float32, device=device)
        dist.allgather_fn(received, send.view(-1), group=self.group)
        received = received.view(self.size, len(sources), self.length)
        return [received[:, k].reshape(-1) for k in range(len(sources))]

    def pieces(self, gathered: torch.Tensor, index: int) -> list[torch.Tensor]:
        """Parameter ``index``'s elements in order, as views of a tensor :meth:`gather` returned."""
        return [gathered[position:position + numel] for position, numel in self._spans[index]]
