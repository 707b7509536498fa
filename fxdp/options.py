"""The options of ``fxdp.transform`` / ``fxdp.backend``, validated once."""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

from fxdp.clip_norm import check_max_grad_norm

__all__ = ["Options"]

_LOSS_REDUCTIONS = ("mean", "sum")
_COMPILERS = ("inductor", "eager")


@dataclasses.dataclass(frozen=True)
class Options:
    """What the compiled backward must produce. Hashable: options are part of every cache key.

    Attributes:
        max_grad_norm: Clip each sample's gradient to this L2 norm (``None``: no clipping).
        grad_sample: Also materialise ``p.grad_sample`` of shape ``[B, *p.shape]``.
        loss_reduction: How the loss is reduced over the batch, "mean" or "sum".
        batch_first: ``False`` puts the batch at dim 1 of batched inputs (``[T, B, ...]``).
        strict: ``False`` warns about unsupported parameters (they get ``grad=None``).
        compiler: "inductor", or "eager" to run the rewritten graphs without Inductor.
        in_dims: Per positional argument, its batch dim or ``None`` for shared inputs,
            as ``vmap``'s ``in_dims``; or a dict keyed by argument name (keyword
            arguments too) or position. Overrides the size rule of DESIGN.md; an int
            applies to every tensor inside a tuple or list argument. A dict is kept
            as a frozenset of its items (options are hashable).
        memory_budget_bytes: Bytes of per-sample gradients layers may keep alive
            across the backward (strategy "instantiate + keep"); ``None`` keeps a
            layer's where they are smaller than the operands they replace, ``0`` never.
    """

    max_grad_norm: float | None = None
    grad_sample: bool = False
    loss_reduction: str = "mean"
    batch_first: bool = True
    strict: bool = True
    compiler: str = "inductor"
    in_dims: tuple | frozenset | None = None
    memory_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        c = self.max_grad_norm
        if c is not None:
            try:
                object.__setattr__(self, "max_grad_norm", check_max_grad_norm(c))
            except ValueError:
                raise ValueError(f"max_grad_norm must be a finite number > 0 or None, got {c!r}") from None
        if self.loss_reduction not in _LOSS_REDUCTIONS:
            raise ValueError(
                f"loss_reduction must be one of {_LOSS_REDUCTIONS}, got {self.loss_reduction!r}"
            )
        if self.compiler not in _COMPILERS:
            raise ValueError(f"compiler must be one of {_COMPILERS}, got {self.compiler!r}")
        for name in ("grad_sample", "batch_first", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.in_dims is not None:
            if isinstance(self.in_dims, (Mapping, frozenset)):
                items = frozenset(self.in_dims.items() if isinstance(self.in_dims, Mapping) else self.in_dims)
                for key, _ in items:
                    if isinstance(key, bool) or not isinstance(key, (int, str)) or (
                            isinstance(key, int) and key < 0):
                        raise TypeError(f"in_dims keys must be argument names or positions >= 0, got {key!r}")
                dims = [d for _, d in items]
                object.__setattr__(self, "in_dims", items)
            else:
                dims = self.in_dims if isinstance(self.in_dims, (tuple, list)) else (self.in_dims,)
                object.__setattr__(self, "in_dims", tuple(dims))
            for d in dims:
                if d is not None and (isinstance(d, bool) or not isinstance(d, int)):
                    raise TypeError(f"in_dims entries must be int or None, got {d!r}")
        budget = self.memory_budget_bytes
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < 0:
                raise ValueError(f"memory_budget_bytes must be an int >= 0 or None, got {budget!r}")
            object.__setattr__(self, "memory_budget_bytes", int(budget))

    def batch_dim_of(self, position: int | None, name: str | None) -> tuple[int | None, bool]:
        """The batch dim of a forward argument and whether ``in_dims`` chose it.

        Args:
            position: Its position among the positional arguments, or ``None``.
            name: Its parameter or keyword name, or ``None`` where unknown.
        """
        if isinstance(self.in_dims, frozenset):
            given = dict(self.in_dims)
            for key in (name, position):
                if key is not None and key in given:
                    return given[key], True
        elif self.in_dims is not None and position is not None and position < len(self.in_dims):
            return self.in_dims[position], True
        return self.default_batch_dim, False

    @property
    def default_batch_dim(self) -> int:
        return 0 if self.batch_first else 1

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> "Options":
        unknown = set(kwargs) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown fxdp option(s): {sorted(unknown)}")
        return cls(**kwargs)
