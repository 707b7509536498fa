"""Per-sample VJPs run at run time, opaque to the trace of the backward (``fxdp::per_sample``).

``vmap`` reads the batch size as an int in some batching rules (``native_batch_norm``
in eval, ``embedding`` of a batched table). Traced on a graph whose batch size is
symbolic, such a rule would add the guard ``B == <this size>``: the graph would be
specialised, and every new batch size would compile again until Dynamo's recompile
limit stops training. On such graphs the per-sample VJPs of the generic rule and of
parameter transforms are one opaque op each: its fake implementation gives only the
output shapes, and its kernel runs the VJP on the real tensors, whose sizes are numbers.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["symbolic_batch", "run_opaque"]

# key -> (compute(*tensors) -> tensors, shapes(*tensors) -> empty tensors of the outputs' shapes)
_CALLS: dict[int, tuple[Callable, Callable]] = {}


@torch.library.custom_op("fxdp::per_sample", mutates_args=())
def _per_sample(key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    # Fresh tensors: a custom op's outputs may not alias its inputs (a VJP can return
    # its cotangent itself), and the fake implementation promises contiguous ones.
    return [t.clone(memory_format=torch.contiguous_format) for t in _CALLS[key][0](*tensors)]


@_per_sample.register_fake
def _per_sample_fake(key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(_CALLS[key][1](*tensors))


def symbolic_batch(batch_size: int | torch.SymInt) -> bool:
    """Whether the traced graph's batch size is a symbol (a dynamic recompile)."""
    return isinstance(batch_size, torch.SymInt) and not batch_size.node.is_constant()


def run_opaque(compute: Callable, shapes: Callable, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``compute(*tensors)`` as one ``fxdp::per_sample`` node of the traced graph.

    Args:
        compute: The per-sample work; it runs at run time, on real tensors, below
            autograd (``torch.func.vjp`` works there, ``torch.autograd.grad`` does not).
        shapes: ``shapes(*tensors)``, new empty tensors shaped, typed and placed as
            ``compute``'s outputs (the fake implementation).
    """
    key = len(_CALLS)
    _CALLS[key] = (compute, shapes)
    return torch.ops.fxdp.per_sample(key, list(tensors))
