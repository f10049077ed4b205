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
from itertools import accumulate

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


def choose_owners(held: list[list[int]], costs: list[float]) -> list[int]:
    """An owner rank for each parameter, from ``held[r][i]``, the elements of parameter i rank r holds, and each
    parameter's cost: the rank holding most of it, so that little has to move (ZeRO-1/2 cut one flat buffer
    into consecutive partitions, so most parameters lie on one rank and every rank's elements, hence roughly its
    cost, are 1/N of the whole); among ranks holding equal largest shares (ZeRO-3 cuts every parameter evenly)
    the one with the least cost so far, taking the parameters from the costliest down, so that where all ranks
    tie every rank's total is within the largest cost of the mean. The same on every rank."""
    loads, owners = [0.0] * len(held), [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        largest = max(rank[i] for rank in held)
        owners[i] = min((r for r, rank in enumerate(held) if rank[i] == largest), key=lambda r: (loads[r], r))
        loads[owners[i]] += costs[i]
    return owners


class OwnerExchange:
    """Parameters held in pieces by the data-parallel ranks (one flat optimizer tensor per rank, as ZeRO-1/2/3
    hand the client optimizer), each sent whole to one owner rank (:func:`choose_owners`, by the pieces and the
    parameters' ``costs``), and the owners' results sent back in pieces.

    :meth:`to_owners` sends every rank's pieces of a parameter, read from tensors laid out like this rank's flat
    tensor (optimizer state), to the parameter's owner in one all-to-all. :meth:`from_owners` sends each owner's
    whole results back to the ranks holding the pieces, in one all-to-all. Only pieces held away from their
    owner travel: under ZeRO-1/2 those of the parameters that cross a partition's boundary, at most two per
    rank each way; under ZeRO-3 (1 - 1/N) of what a rank holds, and of what it owns. An all-gather of every
    partition would hand each rank all of them. Building the exchange is collective: every rank's pieces of every
    parameter are made known to all once."""

    def __init__(self, params: list[torch.Tensor], fragments, group, costs: list[float]) -> None:
        held = {id(f.owner): f.owner for p in params for f in fragments(p)}
        if len(held) > 1 or any(len(fragments(p)) > 1 for p in params):
            raise ValueError("OwnerExchange needs every parameter in one flat tensor per rank, one piece each")
        self.owner = next(iter(held.values()), None)  # this rank's flat tensor (None where it holds no piece)
        self.group, size, rank = group, dist.get_world_size(group=group), dist.get_rank(group=group)
        device = get_accelerator().current_device_name()
        self.device = device if self.owner is None else self.owner.device
        table = [[f.offset, f.start, f.numel] for p in params for f in fragments(p) or [Fragment(None, 0, 0, 0)]]
        local = torch.tensor(table, dtype=torch.int64, device=device)
        every = torch.empty(size * local.numel(), dtype=torch.int64, device=device)
        dist.allgather_fn(every, local.view(-1), group=group)  # flat: gloo gathers into a list of chunks
        every = every.view(size, *local.shape).tolist()  # rank -> parameter -> [offset, start, numel]
        owners = choose_owners([[piece[2] for piece in rank] for rank in every], costs)
        self.owned = [i for i, o in enumerate(owners) if o == rank]  # the parameters this rank receives whole
        self.moves = any(every[r][i][2] for r in range(size) for i, o in enumerate(owners) if o != r)  # on any rank
        # this rank's pieces held away from their owners, by owner in rank order, as (offset in its flat tensor,
        # numel): sent to the owners in this order, and received back from them in it
        self._pieces = [[(every[rank][i][0], every[rank][i][2]) for i in range(len(params))
                         if owners[i] == r and every[rank][i][2]] if r != rank else [] for r in range(size)]
        # the other ranks' pieces of the parameters this rank owns, by rank, as (owned index, start, numel):
        # received from the ranks in this order, and sent back to them in it
        self._held = [[(k, every[r][i][1], every[r][i][2]) for k, i in enumerate(self.owned) if every[r][i][2]]
                      if r != rank else [] for r in range(size)]
        # this rank's own pieces of the parameters it owns: (owned index, start, numel, offset in its flat tensor)
        self._local = [(k, every[rank][i][1], every[rank][i][2], every[rank][i][0])
                       for k, i in enumerate(self.owned) if every[rank][i][2]]
        spans: list[list[tuple[int, bool, int, int]]] = [[] for _ in self.owned]
        position = 0
        for held in self._held:
            for k, start, numel in held:
                spans[k].append((start, True, position, numel))
                position += numel
        for k, start, numel, offset in self._local:
            spans[k].append((start, False, offset, numel))
        # per owned parameter, its pieces in element order: (received?, position received or offset, numel)
        self._spans = []
        for k, i in enumerate(self.owned):
            pieces = sorted(spans[k])
            starts = list(accumulate([numel for *_, numel in pieces], initial=0))
            if [start for start, *_ in pieces] != starts[:-1] or starts[-1] != full_shape(params[i]).numel():
                raise AssertionError("the ranks' pieces of a parameter do not cover it")
            self._spans.append([piece[1:] for piece in pieces])

    def to_owners(self, sources: list[torch.Tensor | None], dtype: torch.dtype) -> list[list[list[torch.Tensor]]]:
        """``sources`` (laid out like this rank's flat tensor; None on a rank that holds none), in ``dtype``, at
        their parameters' owners, in one all-to-all of the pieces held away from them: per source, per owned
        parameter (in the order of :attr:`owned`), its elements in order as a list of 1-D tensors. Each piece
        travels with the same piece of every source after it, so a piece received at position p of n elements
        lies at count p + k n for source k."""
        count = len(sources)
        send = [source.reshape(-1)[offset:offset + numel] for pieces in self._pieces for offset, numel in pieces
                for source in sources]
        received = self._all_to_all(send, [count * sum(n for _, n in pieces) for pieces in self._pieces],
                                    [count * sum(n for *_, n in held) for held in self._held], dtype)

        def piece(k: int, away: bool, position: int, numel: int) -> torch.Tensor:
            if away:
                return received[count * position + k * numel:][:numel]
            return sources[k].reshape(-1)[position:position + numel].to(dtype)

        return [[[piece(k, *span) for span in spans] for spans in self._spans] for k in range(count)]

    def from_owners(self, results: list[torch.Tensor], dtype: torch.dtype) -> list[tuple[int, torch.Tensor]]:
        """Each owned parameter's whole result (1-D, in the order of :attr:`owned`), in ``dtype``, at the ranks
        holding its pieces, in one all-to-all of the pieces held away from their owners: this rank's pieces of
        every parameter as (offset in this rank's flat tensor, values)."""
        send = [results[k][start:start + numel] for held in self._held for k, start, numel in held]
        received = self._all_to_all(send, [sum(n for *_, n in held) for held in self._held],
                                    [sum(n for _, n in pieces) for pieces in self._pieces], dtype)
        pieces = [piece for by_owner in self._pieces for piece in by_owner]
        positions = accumulate([numel for _, numel in pieces], initial=0)
        return [(offset, results[k][start:start + numel].to(dtype)) for k, start, numel, offset in self._local] + \
            [(offset, received[position:position + numel]) for (offset, numel), position in zip(pieces, positions)]

    def _all_to_all(self, send: list[torch.Tensor], send_sizes: list[int], receive_sizes: list[int],
                    dtype: torch.dtype) -> torch.Tensor:
        """One all-to-all, unless no rank holds a piece away from its owner."""
        send = torch.cat(send).to(dtype) if send else torch.empty(0, dtype=dtype, device=self.device)
        received = torch.empty(sum(receive_sizes), dtype=dtype, device=self.device)
        if self.moves:
            dist.all_to_all_single(received, send, receive_sizes, send_sizes, group=self.group)
        return received
