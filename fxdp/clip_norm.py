"""The clipping norm ``C`` that a compiled backward reads at every run.

``max_grad_norm`` shapes the backward graph only by being there: the clip factors
``min(1, C / (‖g_i‖ + 1e-6))`` read ``C`` through the opaque op
``fxdp::max_grad_norm(key, norms)``, so ``C`` may change between steps without a new
compile (adaptive clipping that follows a quantile of the norms, Andrew et al. 2021)::

    mul_1 = torch.ops.aten.mul.Tensor(sqrt, 5);  sqrt = None
    max_grad_norm = torch.ops.fxdp.max_grad_norm.default(3, mul_1)
    add = torch.ops.aten.add.Tensor(mul_1, 1e-06)
    div = torch.ops.aten.div.Tensor(max_grad_norm, add);  max_grad_norm = add = None
    clamp = torch.ops.aten.clamp.default(div, None, 1.0);  div = None
"""
from __future__ import annotations

import itertools
import math
import numbers
import weakref

import torch

__all__ = ["ClipNorm", "check_max_grad_norm"]

# key -> holder; a holder lives as long as the backend (and its graphs) that read it.
_HOLDERS: "weakref.WeakValueDictionary[int, ClipNorm]" = weakref.WeakValueDictionary()
_ids = itertools.count()


def check_max_grad_norm(c: object) -> float:
    """``c`` as a float, if it is a finite number > 0 (a one-element real tensor too, as
    an adaptive clipping rule computes it)."""
    if isinstance(c, torch.Tensor) and c.numel() == 1 and not (c.is_complex() or c.dtype == torch.bool):
        c = c.item()
    if isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(c) or c <= 0:
        raise ValueError(f"max_grad_norm must be a finite number > 0, got {c!r}")
    return float(c)


class ClipNorm:
    """The current ``C`` of one backend's graphs.

    Attributes:
        key: What the graphs pass to ``fxdp::max_grad_norm``.
        value: ``C``; setting it takes effect at the next backward.
    """

    def __init__(self, value: float):
        self.value = value
        self.key = next(_ids)
        _HOLDERS[self.key] = self

    @property
    def value(self) -> float:
        return self._value

    @value.setter
    def value(self, c: float) -> None:
        self._value = check_max_grad_norm(c)


@torch.library.custom_op("fxdp::max_grad_norm", mutates_args=())
def max_grad_norm(key: int, like: torch.Tensor) -> torch.Tensor:
    """The current ``C`` of holder ``key``: a 0-d tensor of ``like``'s dtype and device."""
    return torch.tensor(_HOLDERS[key].value, dtype=like.dtype, device=like.device)


@max_grad_norm.register_fake
def _max_grad_norm_fake(key, like):
    return like.new_empty(())
