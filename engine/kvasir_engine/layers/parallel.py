"""`TensorParallelGroup`: the handle parallel layers receive to talk to their peer ranks.

Layers never reach for `torch.distributed` globals (docs/architecture.md, rule 9): the executor builds the group (in
`distributed/`) and passes it down. At `tp_size == 1` no group is needed and layers are plain.
"""

from __future__ import annotations

from typing import Protocol

import torch


class TensorParallelGroup(Protocol):
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:  # sum over ranks
        ...

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:  # concat over ranks
        ...


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp_size ({denominator})")
    return numerator // denominator
