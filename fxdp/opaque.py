"""Per-sample VJPs run at run time, opaque to the trace of the backward (``fxdp::per_sample``).

``vmap`` reads the batch size as an int in some batching rules (``native_batch_norm``
in eval, ``embedding`` of a batched table). Traced on a graph whose batch size is
symbolic, such a rule would add the guard ``B == <this size>``: the graph would be
specialised, and every new batch size would compile again until Dynamo's recompile
limit stops training. On such graphs the per-sample VJPs of the generic rule and of
parameter transforms are one opaque op each: its fake implementation gives only the
output shapes, and its kernel runs the VJP on the real tensors, whose sizes are numbers.

The op finds its functions by an integer key. They live as long as the graph that calls
them: ``holding()`` collects those traced inside it, the caller keeps the list with the
compiled graph, and the registry holds them weakly.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Callable, Iterator, Sequence

import torch

__all__ = ["holding", "symbolic_batch", "run_opaque"]


class _Call:
    """``compute(*tensors) -> tensors``, and ``shapes(*tensors)``: empty tensors of the
    outputs' shapes."""

    __slots__ = ("compute", "shapes", "__weakref__")

    def __init__(self, compute: Callable, shapes: Callable):
        self.compute = compute
        self.shapes = shapes


_CALLS: "weakref.WeakValueDictionary[int, _Call]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()
_HOLDERS: list[list[_Call]] = []


@contextlib.contextmanager
def holding() -> Iterator[list]:
    """Collect the opaque calls ``run_opaque`` traces inside; keep the list as long as
    the graph they were traced into can run."""
    calls: list[_Call] = []
    _HOLDERS.append(calls)
    try:
        yield calls
    finally:
        _HOLDERS.pop()


@torch.library.custom_op("fxdp::per_sample", mutates_args=())
def _per_sample(key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    # Fresh tensors: a custom op's outputs may not alias its inputs (a VJP can return
    # its cotangent itself), and the fake implementation promises contiguous ones.
    return [t.clone(memory_format=torch.contiguous_format) for t in _CALLS[key].compute(*tensors)]


@_per_sample.register_fake
def _per_sample_fake(key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(_CALLS[key].shapes(*tensors))


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
    if not _HOLDERS:
        raise RuntimeError("fxdp internal error: run_opaque outside opaque.holding()")
    call = _Call(compute, shapes)
    _HOLDERS[-1].append(call)
    key = next(_KEYS)
    _CALLS[key] = call
    return torch.ops.fxdp.per_sample(key, list(tensors))
