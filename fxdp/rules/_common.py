"""Helpers shared by rule files: einsum by cost, flattening, cost lookups."""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Sequence

import opt_einsum
import torch

from fxdp._torch_internals import size_hint

__all__ = ["contract", "contraction_cost", "as_sequence", "hint", "gram_inner", "gram_cost", "fastest_route",
           "forced_route", "ROUTE_CHOICES"]


def hint(size: Any) -> int:
    """A concrete size for cost decisions: the hint of a SymInt, the int itself otherwise."""
    return size_hint(size)


def contract(expr: str, *operands: torch.Tensor) -> torch.Tensor:
    """``einsum`` with the contraction order chosen by opt_einsum from the sizes (hints).

    The pairwise steps run here as ``torch.einsum`` calls: ``opt_einsum.contract`` would
    check the operands' sizes against each other and so specialise a symbolic size
    (a sequence length) to the one it was traced with.
    """
    shapes = [tuple(hint(s) for s in t.shape) for t in operands]
    _, info = opt_einsum.contract_path(expr, *shapes, shapes=True, optimize="optimal")
    pending = list(operands)
    for positions, _, step, *_ in info.contraction_list:
        picked = [pending.pop(i) for i in sorted(positions, reverse=True)]
        pending.append(torch.einsum(step, *picked))
    return pending[0]


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


# From this many positions on, the Gram inner product skips the upper block triangle.
SYMMETRIC_GRAM_MIN_POSITIONS = 64


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def gram_inner(g: torch.Tensor, a: torch.Tensor, pairs: torch.Tensor | None = None) -> torch.Tensor:
    """``Σ_{t,s} (a_t·a_s)(g_t·g_s)`` per leading index, for ``g [..., T, o]`` and ``a [..., T, i]``;
    with ``pairs [..., T, T]`` (symmetric), over the pairs it marks only.

    The ghost norm's Gram route. Both Gram matrices are symmetric, so for long
    sequences the positions are split in two halves ``1, 2`` and the sum is
    ``⟨A₁₁,G₁₁⟩ + ⟨A₂₂,G₂₂⟩ + 2⟨A₂₁,G₂₁⟩``: three quarters of the matmul flops
    (15–25% faster on a CPU at ``T = 128``), exact for any ``T``. At ``T = 1`` the Gram
    matrices are scalars: ``‖g‖²·‖a‖²``.
    """
    # Half precision (autocast): whole Gram matrices. The CPU's half-precision batched
    # matmul copies a transposed operand whose batch stride is not its matrix size (a
    # slice of positions) first, which costs more than the product: at [16, 128, 1024]
    # the three blocks take 10.6 ms, the whole Gram 1.9 ms. Their inner product is
    # taken in float32 (a sum of T² products).
    low = g.dtype in _LOW_PRECISION or a.dtype in _LOW_PRECISION

    def inner(rows_g, cols_g, rows_a, cols_a, block=None):
        gram_a = torch.matmul(rows_a, cols_a.transpose(-1, -2))
        gram_g = torch.matmul(rows_g, cols_g.transpose(-1, -2))
        if low:
            gram_a, gram_g = gram_a.float(), gram_g.float()
        product = gram_a * gram_g
        return (product if block is None else product * block).sum((-1, -2))

    t = g.shape[-2]
    if pairs is not None:
        if low or hint(t) < SYMMETRIC_GRAM_MIN_POSITIONS:
            return inner(g, g, a, a, pairs).to(g.dtype)
        h = t // 2
        g1, g2, a1, a2 = g[..., :h, :], g[..., h:, :], a[..., :h, :], a[..., h:, :]
        return (inner(g1, g1, a1, a1, pairs[..., :h, :h]) + inner(g2, g2, a2, a2, pairs[..., h:, h:])
                + 2 * inner(g2, g1, a2, a1, pairs[..., h:, :h]))
    if t == 1:
        last_two = (g.dim() - 2, g.dim() - 1)
        g2, a2 = (g.float(), a.float()) if low else (g, a)
        return (g2.pow(2).sum(last_two) * a2.pow(2).sum(last_two)).to(g.dtype)
    if low:
        return inner(g, g, a, a).to(g.dtype)  # the dtype callers (fake kernels) expect
    if hint(t) < SYMMETRIC_GRAM_MIN_POSITIONS:
        return inner(g, g, a, a)
    h = t // 2
    g1, g2, a1, a2 = g[..., :h, :], g[..., h:, :], a[..., :h, :], a[..., h:, :]
    return inner(g1, g1, a1, a1) + inner(g2, g2, a2, a2) + 2 * inner(g2, g1, a2, a1)


def gram_cost(n: Any, t: Any, i: Any, o: Any) -> float:
    """Flops of ``gram_inner`` on ``[n, t, o]`` and ``[n, t, i]`` (``n`` may count
    groups too): two Gram matrices and their inner product, three quarters of that
    where the block triangle applies."""
    n, t, i, o = (hint(s) for s in (n, t, i, o))
    full = 2.0 * n * t * t * (i + o + 1)
    return full * 0.75 if t >= SYMMETRIC_GRAM_MIN_POSITIONS else full


# What ``fastest_route`` chose: key -> route name, for the life of the process.
ROUTE_CHOICES: dict[tuple, str] = {}
# How often each route runs, timed, the first time a key is seen (the fastest run counts).
ROUTE_TRIALS = 2
_FORCED: list[str] = []


def fastest_route(key: tuple, routes: dict[str, Callable[[], torch.Tensor]], device: torch.device) -> torch.Tensor:
    """The result of whichever of ``routes`` ran fastest the first time ``key`` was seen.

    The routes compute the same tensor with different kernels, and which is faster
    depends on the shapes and the machine in ways no flop count predicts (the choice
    ``cudnn.benchmark`` makes for convolutions). The first call with a ``key`` runs each
    route ``ROUTE_TRIALS`` times and returns the fastest run's result; later calls run
    the chosen route only. ``key`` must hold everything the speed depends on (shapes,
    strides, dtypes, device, settings); the thread count is added here. Under
    ``torch.use_deterministic_algorithms(True)`` the first route runs, untimed.
    """
    forced = next((name for name in reversed(_FORCED) if name in routes), None)
    if forced is None and torch.are_deterministic_algorithms_enabled():
        # The routes round differently, and a choice by timing can differ from one run
        # to the next: the first route, always.
        forced = next(iter(routes))
    if forced is not None:
        return routes[forced]()
    key = (*key, torch.get_num_threads())
    name = ROUTE_CHOICES.get(key)
    if name is not None:
        return routes[name]()
    best: tuple[float, str, torch.Tensor] | None = None
    for name, route in routes.items():
        for _ in range(ROUTE_TRIALS):
            _synchronize(device)
            start = time.perf_counter()
            out = route()
            _synchronize(device)
            elapsed = time.perf_counter() - start
            if best is None or elapsed < best[0]:
                best = (elapsed, name, out)
            del out
    assert best is not None, "no route to choose from"
    ROUTE_CHOICES[key] = best[1]
    return best[2]


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


@contextlib.contextmanager
def forced_route(name: str) -> Iterator[None]:
    """Inside, ``fastest_route`` takes the route called ``name`` wherever it is offered
    one (tests check each route this way)."""
    _FORCED.append(name)
    try:
        yield
    finally:
        _FORCED.pop()
