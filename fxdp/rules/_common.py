"""Helpers shared by rule files: einsum by cost, flattening, cost lookups."""
from __future__ import annotations

from typing import Any, Sequence

import opt_einsum
import torch

from fxdp._torch_internals import size_hint

__all__ = ["contract", "contraction_cost", "as_sequence", "hint"]


def hint(size: Any) -> int:
    """A concrete size for cost decisions: the hint of a SymInt, the int itself otherwise."""
    return size_hint(size)


def contract(expr: str, *operands: torch.Tensor) -> torch.Tensor:
    """``einsum`` with the contraction order chosen by opt_einsum from the sizes (hints)."""
    shapes = [tuple(hint(s) for s in t.shape) for t in operands]
    path, _ = opt_einsum.contract_path(expr, *shapes, shapes=True, optimize="optimal")
    return opt_einsum.contract(expr, *operands, optimize=path, backend="torch")


def contraction_cost(expr: str, *shapes: Sequence[Any]) -> float:
    """Flops of ``expr`` on ``shapes`` (hints), contracted in opt_einsum's best order."""
    concrete = [tuple(hint(s) for s in shape) for shape in shapes]
    _, info = opt_einsum.contract_path(expr, *concrete, shapes=True, optimize="optimal")
    return float(info.opt_cost)


def as_sequence(t: torch.Tensor, last: int = 1) -> torch.Tensor:
    """``[B, *mid, *last_dims] -> [B, prod(mid), *last_dims]`` (``T = 1`` without mid dims)."""
    tail = t.shape[t.dim() - last:] if last else ()
    positions = 1
    for size in t.shape[1: t.dim() - last]:
        positions = positions * size
    # explicit, not -1: with B == 0 a -1 would be ambiguous
    return t.reshape(t.shape[0], positions, *tail)
