"""Where the batch lives in a tensor, and how to bring it to the front.

A batched tensor has its samples along one dim, possibly merged with the dims
after it, as ``x.view(-1, d)`` merges ``[B, T, d]`` into ``[B·T, d]``:
``BatchDim(dim=0, inner=T)`` says dim 0 has size ``B·inner`` and its index is
``b·inner + r``; with ``outer`` (``[T, B, d] -> [T·B, d]``) the dim has size
``outer·B·inner`` and index ``o·B·inner + b·inner + r``. ``WHOLE`` marks a tensor that is entirely one sample (``B == 1``);
``SHARED`` a tensor without batch dim that every sample sees whole (it is expanded).
``Piece`` is one sample's values taken out of the batch; ``Masked`` the elements a
boolean mask selected from the whole batch, one list; ``Rows``, ``Groups`` and
``Inverse`` follow a batch's rows sorted across samples (a mixture of experts' dispatch);
``Packed`` lays batches of different rows per sample end to end along one dim.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from fxdp._torch_internals import decided_size
from fxdp.errors import UnsupportedError

__all__ = ["retrack", "BatchDim", "Piece", "Masked", "Packed", "Rows", "Groups", "Inverse", "unpermute", "WHOLE", "SHARED", "RAW",
           "batch_major", "batch_major_all", "batch_size_of", "broadcast_batch", "from_batch_major", "scale_batch"]


@dataclasses.dataclass(frozen=True, eq=False)
class BatchDim:
    """The batch dim of one tensor.

    Attributes:
        dim: Index of the dim that holds the samples; ``None`` for ``WHOLE``.
        inner: How many rows of that dim belong to one sample (``B·inner`` in all).
    """

    dim: Any
    inner: Any = 1
    outer: Any = 1

    def same_as(self, other: Any) -> bool:
        return (isinstance(other, BatchDim) and self.dim == other.dim and _equal(self.inner, other.inner)
                and _equal(self.outer, other.outer))

    def at(self, dim: int) -> "BatchDim":
        """The same batch layout, moved to ``dim``."""
        return BatchDim(dim, self.inner, self.outer)

    @property
    def plain(self) -> bool:
        """The dim holds exactly the ``B`` samples (nothing merged into it)."""
        return _equal(self.inner, 1) and _equal(self.outer, 1)

    def __repr__(self) -> str:
        if self.dim in ("shared", "raw"):
            return self.dim.upper()
        if self.dim is None:
            return "WHOLE"
        extra = "" if _equal(self.inner, 1) else f", inner={self.inner}"
        extra += "" if _equal(self.outer, 1) else f", outer={self.outer}"
        return f"BatchDim({self.dim}{extra})"


@dataclasses.dataclass(frozen=True)
class Piece:
    """Values of one sample alone, taken out of the batch (``x[i]``, ``x[i:i + 1]``, a
    piece of ``x.unbind(0)``, with a static ``B``): what a loop over the samples works
    on. Any op on pieces of one sample (and shared values) keeps them that sample's; the
    pieces of all samples concatenated in order along a dim of size 1 are a batch again
    (``torch.cat([f(x[i:i + 1]) for i in range(B)])``). No parameter may be used on
    one: fxdp makes parameter uses per-sample on whole batches."""

    sample: int


@dataclasses.dataclass(frozen=True, eq=False)
class Masked:
    """The elements of a batched tensor that a boolean mask over its leading dims
    selected (``h[mask]``, ``mask`` batched as ``h``): one list of every sample's
    elements (rows along dim 0), its length set by the data. Ops that keep the rows
    apart (elementwise, or along their trailing dims: a spline's bins) on lists
    selected by the same mask (and on shared values that do not run along the list)
    keep each row its sample's, and writing the list back by that mask into a tensor
    batched as the mask (``out[mask] = f(h[mask])``, a piecewise function) puts every
    row back in its own place. Anything else that reads the list mixes the samples.

    Attributes:
        mask: The mask's node.
        layout: The mask's batch layout (the batch among the dims it covers).
    """

    mask: Any
    layout: "BatchDim"


@dataclasses.dataclass(frozen=True, eq=False)
class Packed:
    """Batches of different rows per sample laid end to end along ``dim``: torchdiffeq
    packs a tuple state ``(z [B, D], logp [B, 1])`` into one vector,
    ``torch.cat([z.reshape(-1), logp.reshape(-1)])``, and a solver steps that vector.
    ``blocks`` are the pieces' layouts in order, each ``outer·B·inner`` rows along
    ``dim``. Ops that keep the dim whole and its elements apart (elementwise ops on
    values packed alike, moving the dim, writing into another dim) keep each sample's
    elements its own, and a slice of whole blocks is a batch again
    (``flat[:B * D].view(B, D)``); anything else reads across the blocks.

    Attributes:
        dim: The dim the blocks are laid along.
        blocks: Their ``BatchDim`` layouts (at ``dim``), in order.
    """

    dim: int
    blocks: tuple

    def at(self, dim: int) -> "Packed":
        return Packed(dim, tuple(b.at(dim) for b in self.blocks))

    def same_as(self, other: Any) -> bool:
        return isinstance(other, Packed) and self.dim == other.dim and len(self.blocks) == len(other.blocks) \
            and all(a.same_as(b) for a, b in zip(self.blocks, other.blocks))


@dataclasses.dataclass(frozen=True, eq=False)
class Rows:
    """The rows of a batch taken in an order of the whole batch: a mixture of experts
    sorts the batch's tokens by expert (``expert_ids.sort()``) to run each expert on
    its rows at once. Row ``r`` along ``dim`` is row ``order[r]`` of a batch with
    ``inner`` rows per sample (``BatchDim(0, inner)``), so it is sample
    ``order[r] // inner``'s; ``order`` is the sort's node (its indices). An op that
    keeps rows apart keeps them each sample's, and putting them back where ``order``
    says gives the batch again. Position ``r`` itself depends on every sample's keys:
    it must not meet a shared value along ``dim``.

    The rows a ``nonzero`` of a batched mask found are such rows too, some of the
    batch's, not all: a mixture of experts written as a loop runs each expert on the
    tokens routed to it (``slot, token = torch.where(expert_mask[e])``, ``h[token]``,
    then ``out.index_add_(0, token, y)``). ``order`` is then the ``nonzero``, ``column``
    the column of its output that holds the batch's positions; put back, each row goes
    to its own position of the mask flattened (``found``), zeros where none was found.

    Attributes:
        ids: The values are row ids of a batch with ``ids`` rows per sample (the sort's
            indices, ``ids = inner``, and ``indices // k``), so indexing such a batch
            with them gives rows of this order.
        keys: The values are the sort's own ascending keys (or a cast of them): their
            counts, summed up, are the group offsets of these rows.
        major: As a marker operand: put back in batch order, also brought to ``[B, …]``
            (``False``: left in the op's layout, for a rule that does that itself).
        column: ``order`` is a ``nonzero`` whose output column ``column`` names the
            batch rows (``None``: a sort, whose indices do, every row once).
        found: The layout of the ``nonzero``'s mask flattened, where its rows are put
            back (``None`` for a sort).
    """

    dim: int
    order: Any
    inner: Any
    ids: Any = None
    keys: bool = False
    major: bool = True
    column: int | None = None
    found: BatchDim | None = None

    def same_order(self, other: Any) -> bool:
        return isinstance(other, Rows) and other.order is self.order and other.dim == self.dim

    @property
    def in_batch_order(self) -> BatchDim:
        """The layout of these rows put back in batch order (``unpermute``)."""
        return BatchDim(self.dim, self.inner) if self.found is None else self.found.at(self.dim)


@dataclasses.dataclass(frozen=True, eq=False)
class Groups:
    """How many rows of a ``Rows`` order each key has (``histc``/``bincount`` of the
    sorted keys), or with ``cumulative`` the groups' end offsets: a count over every
    sample, which only a grouped matmul of those rows may read (row ``r`` is then in
    group ``keys[r]``, its own key). ``keys`` is the node of the sorted keys (or of the
    keys the sort sorted, in batch order: their counts are the same)."""

    order: Any
    keys: Any
    cumulative: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class Inverse:
    """The inverse of a ``Rows`` order (``inv[order] = arange(S)``): in batch order,
    each row's position in the sorted rows; indexing those rows with it puts them back
    (``BatchDim(0, inner)``)."""

    order: Any
    inner: Any


def unpermute(t: torch.Tensor, order: torch.Tensor, rows: Rows, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``t``, whose rows along ``rows.dim`` are in ``order``, with its rows put back in
    batch order: then in layout ``rows.in_batch_order``.

    Rows a ``nonzero`` of ``mask`` found (``rows.found``) each go to their own position
    of ``mask`` flattened (a token routed by two slots has two), zeros where it found
    none."""
    if rows.found is None:
        return t.new_zeros(t.shape).index_copy(rows.dim, order, t)
    flat = order[:, 0]
    for j in range(1, order.shape[1]):
        flat = flat * mask.shape[j] + order[:, j]
    shape = list(t.shape)
    shape[rows.dim] = mask.numel()
    return t.new_zeros(shape).index_copy(rows.dim, flat, t)


WHOLE = BatchDim(None)
SHARED = BatchDim("shared")
RAW = BatchDim("raw")  # passed to a rule as it is (parameters, transform inputs)


def _equal(a: Any, b: Any) -> bool:
    # Sizes may be SymInts: comparing them records a guard, which is what we want
    # (the decision was taken on these sizes).
    return bool(a == b)


def retrack(batch: BatchDim, values) -> BatchDim:
    """``batch`` with its sizes usable in another trace (the backward's).

    ``inner``/``outer`` come from the forward's symbolic shapes. A constant one, or one
    the forward's guards decide, becomes an int; a symbolic one is rebuilt from the
    sizes that ``values`` (tensors and SymInts the tracer knows) carry: the same
    expression, or its symbols.
    """
    if batch.dim in (None, "shared", "raw"):
        return batch
    # (``5 // (s // 16)`` rows per sample of a batch merged with ``s // 16`` chunks, after a
    # recurrence unrolled over them under the guard ``s // 16 == 5``: asteroid's DPTNet)
    batch = BatchDim(batch.dim, decided_size(batch.inner), decided_size(batch.outer))
    if not any(isinstance(v, torch.SymInt) for v in (batch.inner, batch.outer)):
        return batch
    known: dict = {}
    for v in values:
        sizes = v.shape if isinstance(v, torch.Tensor) else [v]
        for size in sizes:
            if isinstance(size, torch.SymInt):
                # a symbol, or a product of them (sorted rows put back: ``[B, 2·T, d]``)
                known.setdefault(size.node.expr, size)

    def rebuild(expr):
        if expr.is_Integer:
            return int(expr)
        if expr in known:
            return known[expr]
        if expr.is_Symbol:
            if expr not in known:
                raise UnsupportedError(
                    f"fxdp cannot follow the symbolic size {expr} of a merged batch dim into the "
                    "backward; mark that size static (torch._dynamo.mark_static)")
            return known[expr]
        args = [rebuild(a) for a in expr.args]
        name = type(expr).__name__
        if name == "Mul":
            out = 1
            for a in args:
                out = out * a
            return out
        if name == "Add":
            out = 0
            for a in args:
                out = out + a
            return out
        if name == "FloorDiv":
            return args[0] // args[1]
        if name == "Pow" and expr.args[1].is_Integer:
            return args[0] ** int(expr.args[1])
        # ``math.ceil(T / w)`` windows (Granite Speech's projector): a true division
        # rounded up or down, and ``%``, ``max``, ``min`` of sizes.
        if name == "IntTrueDiv":
            return args[0] / args[1]
        if name == "CeilToInt":
            return math.ceil(args[0])
        if name == "FloorToInt":
            return math.floor(args[0])
        if name == "TruncToInt":
            return torch.sym_int(args[0])
        if name in ("PythonMod", "Mod"):
            return args[0] % args[1]
        if name == "Max" and len(args) == 2:
            return torch.sym_max(*args)
        if name == "Min" and len(args) == 2:
            return torch.sym_min(*args)
        raise UnsupportedError(f"fxdp cannot rebuild the size {expr} of a merged batch dim in the backward; "
                               "mark the sizes it is computed from static (torch._dynamo.mark_static)")

    def fix(size: Any) -> Any:
        return rebuild(size.node.expr) if isinstance(size, torch.SymInt) else size

    return BatchDim(batch.dim, fix(batch.inner), fix(batch.outer))


def broadcast_batch(batches, metas, out_ndim: int) -> BatchDim | None:
    """The batch of a broadcasting elementwise op's result: dims align from the right,
    and every batched operand must put its batch at the same output dim (``ValueError``
    if they do not). ``batches[i]`` is operand ``i``'s batch (or ``None``), ``metas[i]``
    its example value; non-tensor operands are skipped."""
    result = None
    for b, m in zip(batches, metas):
        if not isinstance(b, BatchDim) or not isinstance(m, torch.Tensor):
            continue
        candidate = WHOLE if b.dim is None else b.at(b.dim + out_ndim - m.dim())
        if result is None:
            result = candidate
        elif not result.same_as(candidate):
            raise ValueError("its batched operands have their batch at different dims")
    return result


def batch_size_of(t: torch.Tensor, batch: BatchDim) -> Any:
    if batch.dim in (None, "shared", "raw"):
        return 1
    return t.shape[batch.dim] // (batch.inner * batch.outer)


def batch_major(t: torch.Tensor, batch: BatchDim, batch_size: Any = None) -> torch.Tensor:
    """Return ``t`` as ``[B, *rest]``, the batch first (a view when possible)."""
    if batch.dim == "raw":
        return t
    if batch.dim == "shared":
        return t.unsqueeze(0).expand(batch_size, *t.shape)
    if batch.dim is None:
        # A whole parameter's gradient (B == 1) is sparse from Embedding(sparse=True);
        # per-sample gradients are dense, as for any B.
        return (t.to_dense() if t.is_sparse else t).unsqueeze(0)
    t = t.movedim(batch.dim, 0)
    if not _equal(batch.outer, 1):
        # [outer·B·inner, *rest] -> [B, outer·inner, *rest]: one sample's rows together
        rest = t.shape[1:]
        size = t.shape[0] // (batch.outer * batch.inner)
        t = t.reshape(batch.outer, size, batch.inner, *rest).movedim(1, 0)
        return t.reshape(size, batch.outer * batch.inner, *rest)
    if not _equal(batch.inner, 1):
        t = t.reshape(t.shape[0] // batch.inner, batch.inner, *t.shape[1:])
    return t


def from_batch_major(t: torch.Tensor, batch: BatchDim, lead: int = 0) -> torch.Tensor:
    """``batch_major``'s inverse: ``t`` with ``[B, …]`` at dim ``lead`` (after ``lead``
    dims kept as they are) back in ``batch``'s layout, a merged dim's rows in order."""
    if not isinstance(batch.dim, int):
        return t
    keep, size, rest = t.shape[:lead], t.shape[lead], t.shape[lead + 1:]
    if not _equal(batch.outer, 1):
        # [B, outer·inner, *rest] -> [outer, B, inner, *rest] -> [outer·B·inner, *rest]
        rest = rest[1:]
        t = t.reshape(*keep, size, batch.outer, batch.inner, *rest).movedim(lead, lead + 1)
        t = t.reshape(*keep, batch.outer * size * batch.inner, *rest)
    elif not _equal(batch.inner, 1):
        t = t.reshape(*keep, size * batch.inner, *rest[1:])
    return t.movedim(lead, lead + batch.dim)


def batch_major_all(values, layouts) -> list:
    """Every operand of one marker as ``[B, ...]``; ``B`` is read from a batched one
    (shared operands are expanded to it, ``None`` operands stay ``None``)."""
    size = next((batch_size_of(v, b) for v, b in zip(values, layouts)
                 if v is not None and b.dim not in (None, "shared", "raw")), 1)
    return [None if v is None else batch_major(v, b, size) for v, b in zip(values, layouts)]


def scale_batch(t: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """Multiply each sample of a batch-major ``t`` by ``factors[b]``."""
    return t * factors.reshape(-1, *([1] * (t.dim() - 1))).to(t.dtype)
