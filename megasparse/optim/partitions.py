"""Where each module parameter lives inside the client optimizer on this rank.

DeepSpeed hands the client optimizer different tensors depending on the layout:

- ZeRO-0 (fp32 only; see ``training.precision``): the module parameters themselves;
- ZeRO-1/2: per parameter group, one flat fp32 partition per rank.
  The parameters of a group are flattened in DeepSpeed's (round-robin) order and padded for
  alignment, then cut into equal partitions, so a parameter may be split between ranks or be
  absent from this rank; DeepSpeed records the piece this rank holds in ``param._hp_mapping``.

A :class:`Fragment` names that piece uniformly: elements [start, start + numel) of the
flattened parameter are ``owner.view(-1)[offset : offset + numel]``, and the optimizer's
elementwise state for them sits at the same offsets of ``optimizer.state[owner]``.
"""
from __future__ import annotations

from dataclasses import dataclass

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


def optimizer_fragments(engine, client_optimizer: torch.optim.Optimizer, param: torch.nn.Parameter) -> list[Fragment]:
    """The fragments of ``param`` held by ``client_optimizer`` on this rank (possibly none)."""
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
