"""Batch-dim analysis: where the batch of each value lives, and which ops mix samples.

``batch_dim_pass`` walks the canonical ATen graph in order, vmap style: each
placeholder starts with the batch dim the caller gave it (``None`` = shared by all
samples, e.g. parameters), and each op's rule says where the output's batch goes.
Sizes are never matched to find the batch. An op that mixes rows of the batch
(a reduction over it other than the final loss, BatchNorm in training, indexing the
batch) becomes a ``Problem``; so does a trainable parameter consumed by an op
without a per-sample rule.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
import os
import re
import sys
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, statically_known_true

from fxdp._torch_internals import plain_expression
from fxdp.batching import WHOLE, BatchDim, Groups, Inverse, Masked, Packed, Piece, Rows, broadcast_batch
from fxdp.errors import Problem
from fxdp.functions import FUNCTION_APPLY, function_batch, function_call, function_param_rule
from fxdp.passes.copies import SIZE_ARITHMETIC, same_code
from fxdp.passes.masked_rows import BATCH_TO_ROWS, ROWS_TO_BATCH
from fxdp.passes.writes import (PIECE_INTO_SHARED, carries_no_gradient, computed_without_grad, follow_write,
                               is_detach, is_view, parameter_write, views_read_after, writes_in_place,
                               written_chain, written_through)
from fxdp.registry import lookup, named_arg, out_of_place
from fxdp.rules.grouped import is_grouped_mm

__all__ = ["BatchAnalysis", "UseSite", "Broadcast", "MixesSamples", "batch_dim_pass", "pure_op", "module_path_of", "op_name", "arange_dim",
           "rule_layout", "reached"]

aten = torch.ops.aten


class MixesSamples(Exception):
    """Raised by a propagation rule when an op mixes the rows of the batch."""


class _NoPropagation(MixesSamples):
    """An op without rule or propagation: whether it mixes samples is unknown."""


class _MixesButKeepsLayout(MixesSamples):
    """An op that mixes samples but keeps the batch's layout (BatchNorm in training):
    the analysis goes on with ``batch``, so that every such op is listed at once."""

    def __init__(self, message: str, batch: Any):
        super().__init__(message)
        self.batch = batch


@dataclasses.dataclass
class Loss:
    """A reduction over the batch to a scalar: the loss inside the graph."""

    reduction: str  # "mean" | "sum"


@dataclasses.dataclass
class Broadcast:
    """A shared parameter op whose output is expanded to the batch (see ``_broadcast_plan``).

    Attributes:
        batch_dim: Where the batch goes in the expanded output.
        ndim: Rank of the expanded output.
        ref: A batched value to read the size of the batch dim from at run time (``B``,
            or ``B·n`` where ``n`` rows of each sample are merged into it).
        ref_dim: Its batch dim.
    """

    batch_dim: int
    ndim: int
    ref: fx.Node
    ref_dim: int
    # The batch data it meets has several rows per sample merged into that dim
    # (``BatchDim.inner``, ``outer``): ``"inner"``, ``"outer"`` or ``"both"`` (``outer·B·
    # inner`` rows, ``inner`` a static count), and a plain batched value to read ``B``
    # from, to sum each sample's copies of the output's gradient.
    merged: str = ""
    sample_ref: "fx.Node | None" = None
    sample_ref_dim: int = 0
    inner: int = 1

    @property
    def refs(self) -> tuple:
        """The values the marker reads the sizes from, passed after the op's arguments."""
        return (self.ref, self.sample_ref) if self.merged else (self.ref,)


@dataclasses.dataclass
class UseSite:
    """One place where a trainable parameter's gradient must be made per-sample.

    Attributes:
        node: The consuming op.
        index: Its argument that is the parameter (or parameter-only value).
        kind: "direct" or "transform" (through a parameter-only computation).
        sources: The trainable parameters (placeholders) the argument is computed from.
        broadcast: The op's output is expanded to the batch (see ``Broadcast``).
        generic: No rule for this argument: a per-sample VJP of the op is used.
    """

    node: fx.Node
    index: int
    kind: str
    sources: frozenset
    broadcast: bool = False
    generic: bool = False


@dataclasses.dataclass
class BatchAnalysis:
    """What ``batch_dim_pass`` found.

    Attributes:
        batch: Node -> ``BatchDim`` (batched), ``None`` (shared) or ``Loss`` (the loss);
            tuples/lists of these for multi-output nodes.
        problems: Everything that cannot be made per-sample.
        uses: Every place a parameter's gradient is made per-sample.
        loss: The reduction of the in-graph loss, or ``None`` if the loss is outside:
            ``"mean"``, ``"sum"``, or ``"batchmean"``, a sum divided by the batch size
            afterwards (``kl_div(reduction="batchmean")``, ``loss.sum() / x.shape[0]``),
            which is the mean of the samples' losses ``l_i`` and the sum of their shares
            ``l_i / B`` alike.
        single: ``B`` is 1 or 0: the batch is one sample, whose gradient is the
            ordinary gradient, or none; no use needs a rule (``uses`` is empty, see
            ``tag_pass``).
        empty: ``B == 0``.
        notes: Hints for an error message about how the inputs were read (set by the
            compiler, which reads them).
        sized_by_batch: Tensors built from sizes with ``B`` among them (see
            ``batch_dim_pass``).
        normalisers: ``(division, mask, its layout, floor)`` for each loss divided by the sum
            of a mask over the whole batch (see ``_mask_normaliser``), which
            ``loss_normaliser_pass`` checks at run time.
        sized_normaliser: The loss is divided by the sum of a shared mask built from
            ``B`` (read batched, it is a ``normalisers`` entry: see ``batch_dim_pass``).
        own_rows: Each gather of rows along a merged batch dim by indices the samples
            computed, or write into such rows (see ``OwnRows``), and each view of a
            boolean mask's rows per sample (see ``SameCounts``), which ``own_rows_pass``
            checks at run time.
        rows_in_place: ``(op, {selected operand: its mask})`` for each parameter use on
            rows a boolean mask selected by an op that keeps rows apart, which
            ``rows_in_place_pass`` runs on the rows put back in place (its uses are
            found once that pass has run and the graph is analysed again).
        mixing: The nodes the propagation found problems at (an op that mixes samples or
            that no rule follows, a write the analysis cannot follow): with ``UNKNOWN``
            values, what a graph's outputs may have mixed from (see
            ``fxdp.compiler.mixed_outputs``).
        stored: Each value of parameters alone the forward stores and does not return
            (``torch.nn.utils.prune``'s ``module.weight = weight_orig * weight_mask``, a
            cache recomputed every call), with the parameters it is computed from: its
            gradient must be zero at run time (see ``fxdp.compiler``), as the loss may not
            use it.
        sized_shared: The tensors built from ``B`` are read as shared (the first reading,
            see ``batch_dim_pass``), not batched.
    """

    batch: dict[fx.Node, Any]
    problems: list[Problem]
    uses: list[UseSite]
    loss: str | None
    broadcasts: dict[fx.Node, Broadcast] = dataclasses.field(default_factory=dict)
    param_only: dict[fx.Node, frozenset] = dataclasses.field(default_factory=dict)
    single: bool = False
    empty: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)
    sized_by_batch: list[fx.Node] = dataclasses.field(default_factory=list)
    normalisers: list[tuple[fx.Node, fx.Node, BatchDim, float | None]] = dataclasses.field(default_factory=list)
    sized_normaliser: bool = False
    own_rows: list["OwnRows | SameCounts | CountedKeys"] = dataclasses.field(default_factory=list)
    rows_in_place: list[tuple[fx.Node, dict]] = dataclasses.field(default_factory=list)
    mixing: list[fx.Node] = dataclasses.field(default_factory=list)
    stored: dict[fx.Node, list[str]] = dataclasses.field(default_factory=dict)
    sized_shared: bool = True


def op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def module_path_of(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # Dynamo writes sources such as "L['self'].layers[0]", "L['model']" (the root
    # module of transform's wrapper: a top-level op) or "G['m'].0": drop the root.
    path = re.sub(r"^[LG]\['[^']*'\]\.?", "", path)
    path = path.split("'].", 1)[-1] if "']." in path else path
    return path.replace("._modules['", ".").replace("']", "").replace("[", ".").replace("]", "")


# Frames of these packages are not the model's code.
_NOT_THE_MODEL = tuple(os.path.dirname(os.path.abspath(f)) + os.sep
                       for f in (torch.__file__, sys.modules["fxdp"].__file__, __file__))
# Nor those of tensor-notation helpers the model calls (``einops.reduce``): the model's
# line is the one that called them.
_HELPERS = tuple(f"{os.sep}{name}{os.sep}" for name in ("einops", "opt_einsum"))


def source_of(node: fx.Node) -> str:
    """The line of the model's code that ``node`` was traced from, as ``"file:line: code"``
    (the innermost frame of its stack trace outside torch, fxdp and ``_HELPERS``), or ""."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n[ \t]*([^\n]*)',
                        node.meta.get("stack_trace") or "")
    frames = [f for f in frames if not os.path.abspath(f[0]).startswith(_NOT_THE_MODEL)
              and not any(helper in os.path.abspath(f[0]) for helper in _HELPERS)]
    if not frames:
        return ""
    file, line, code = frames[-1]
    return f"{file}:{line}: {code.strip()}"


def _meta(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _joined_along(node: fx.Node) -> int:
    """The dim of its output a ``cat`` or ``stack`` joins its pieces along."""
    return _norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), _meta(node).dim())


# ---------------------------------------------------------------------------
# Propagation rules for parameter-free ops. Each takes (node, batch of each arg)
# and returns the output's batch.
# ---------------------------------------------------------------------------

PROPAGATION: dict[Any, Callable] = {}


def _register(*ops: Any) -> Callable:
    def deco(fn: Callable) -> Callable:
        for op in ops:
            PROPAGATION[op] = fn
        return fn

    return deco


# Ops that copy a tensor's values (a cast at most): what holds for the tensor holds for them.
_COPIES = {aten.clone.default, aten.contiguous.default, aten.detach.default, aten.alias.default,
           aten._to_copy.default, aten.to.dtype, aten.to.device, aten.to.dtype_layout,
           aten.lift_fresh_copy.default}


def _agreed(result: Any, candidate: Any) -> Any:
    """The batch of an op's operands so far, with one more operand's ``candidate``."""
    if result is None:
        return candidate
    if not result.same_as(candidate):
        raise MixesSamples("its batched operands have their batch at different dims")
    return result


def _pointwise(node: fx.Node, arg_batch: list) -> Any:
    """Broadcasting elementwise op: dims align from the right. An op with several outputs
    (``native_dropout``'s, a fake quantisation's output and mask) gives each the layout
    of the first: they have its shape."""
    out = _meta(node)
    first = out[0] if isinstance(out, (list, tuple)) else out
    metas = [_meta(a) if isinstance(a, fx.Node) else None for a in node.args]
    result = broadcast_batch(arg_batch, metas, first.dim() if isinstance(first, torch.Tensor) else 0)
    return [result] * len(out) if isinstance(out, (list, tuple)) else result


_SAME_DIMS = _COPIES | {aten.slice.Tensor}
_PIECES_OF_ALL = {aten.unbind.int, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_VIEWS_OF_ALL = _RESHAPES | {aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
                             aten.permute.default, aten.transpose.int, aten.t.default, aten.select.int,
                             aten.flatten.using_ints}


def _uniform_along(node: Any, dim: int, memo: dict | None = None, resized: bool = False) -> bool:
    """Whether a shared value (no batch dim of its own) holds the same values all along
    ``dim`` (negative: a dim it broadcasts along), or values drawn alike there: one of
    size 1 there, a constant fill or an independent random draw (``ones(B, T)``,
    ``zeros_like``, ``randn(B, d)``), an ``expand`` along it (``arange(T).expand(B, T)``),
    a table looked up at such positions, an input or buffer as the size rule read it
    (``in_dims`` settles that reading), and elementwise ops, copies, slices, views and
    pieces of such. Not a range, a window of a table (``buffer[:B]``) or a cumulative
    sum along it. ``memo`` holds the answers found so far (shared masks are diamonds of
    ops). ``resized``: ``dim`` has another size in the tensor first asked about (tiles of
    ``buffer.repeat(B // 2, 1)``, a reshape): the size rule never read an input or buffer
    there, whose rows then differ by position as far as the graph knows."""
    if not isinstance(node, fx.Node):
        return True  # a number
    memo = {} if memo is None else memo
    if (node, dim, resized) not in memo:
        memo[node, dim, resized] = _uniform_along_uncached(node, dim, memo, resized)
    return memo[node, dim, resized]


def _uniform_along_uncached(node: fx.Node, dim: int, memo: dict, resized: bool) -> bool:
    value = _meta(node)
    if not isinstance(value, torch.Tensor) or dim < 0 or dim >= value.dim() \
            or statically_known_true(value.shape[dim] == 1):
        return True
    if node.op == "placeholder":
        # An input or buffer read as shared: the size rule's reading, which in_dims settles
        # (an RNN state [layers, B, hidden] is the samples' own, row by row).
        return not resized
    if _written_unlike_along(node, dim):
        return False
    if node.op == "get_attr":
        # A constant made in the forward from Python values, whose values the graph holds
        # (TimesFM's ``torch.tensor(freq)``: the same id for every series, or not).
        return _constant_alike_along(node, dim)
    target = node.target
    if target is aten.slice.Tensor and (node.args[1] if len(node.args) > 1 else 0) % value.dim() == dim \
            and not statically_known_true(_meta(node.args[0]).shape[dim] == value.shape[dim]):
        return False  # a window of a table along it (``table[:B]``), placed by position
    if target in _SIZED_BY_ARGUMENT or target in SHAPED_LIKE or target in _DRAWS \
            or target is aten.scalar_tensor.default:
        return True
    if target in (aten.index.Tensor, aten.index_select.default, aten.embedding.default):
        # A shared table looked up by positions alike all along ``dim`` (diffusion's
        # ``alphas[t]`` with ``t = randint(0, N, (B,))`` drawn in the forward).
        return _looked_up_alike(node, dim, memo, resized)
    if target is aten.expand.default:
        new = value.dim() - _meta(node.args[0]).dim()
        return dim < new or _uniform_along(node.args[0], dim - new, memo, resized)
    if target in _SAME_DIMS:
        return _uniform_along(node.args[0], dim, memo, resized)
    if target is aten.repeat.default:
        # Copies along the dims it adds in front, tiles of the source along the others.
        new = value.dim() - _meta(node.args[0]).dim()
        return dim < new or _uniform_along(node.args[0], dim - new, memo,
                                           resized or _resized(node.args[0], dim - new, value.shape[dim]))
    if target in (aten.cat.default, aten.stack.default):
        # Pieces side by side: alike along another dim where every piece is (HiDream's
        # positions, a table repeated over the batch with text positions of zeros after it).
        at = _joined_along(node)
        if dim == at:
            # Alike only where the pieces are: fills of one number (TimesFM's padding mask,
            # ``stack([zeros(L) for ts in x])``), or one computation over and over.
            pieces = list(node.args[0])
            first = _fill_number(pieces[0])
            if first is not None and all(_fill_number(p) == first and _meta(p).dtype == value.dtype
                                         for p in pieces):
                return True
            # (Pieces of more than one row along it are tiles: a buffer's ``cat([w, w])``.)
            return all(_computed_alike(pieces[0], p) for p in pieces[1:]) and (
                target is aten.stack.default or statically_known_true(_meta(pieces[0]).shape[dim] == 1))
        pieces = [p for p in node.args[0] if _meta(p).dim() == value.dim() - (target is aten.stack.default)]
        own = dim if target is aten.cat.default or dim < at else dim - 1
        return all(_uniform_along(p, own, memo, resized) for p in pieces)
    moved = _moved_from(node, dim)
    if moved is not None:
        return _uniform_along(node.args[0], moved, memo, resized)
    if target is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0].target in _PIECES_OF_ALL:
        node = node.args[0]  # a piece of an unbind or split: alike where its whole source is
        target = node.target
    if target in _RESHAPES or target is aten.flatten.using_ints:
        group = _reshaped_from(node, dim)
        if group is not None and _whole_tiles(node, dim, group):
            return True
        if group is not None:
            return all(_uniform_along(node.args[0], d, memo, resized or _resized(node.args[0], d, value.shape[dim]))
                       for d in group)
    if target in _VIEWS_OF_ALL or target in _PIECES_OF_ALL:
        # Alike along every dim of its source; a piece of a split is a window of it along the
        # dims where it is smaller.
        source = _meta(node.args[0])
        cut = target in _PIECES_OF_ALL and target is not aten.unbind.int
        return all(_uniform_along(node.args[0], d, memo, resized or (cut and _resized(node.args[0], d, value.shape[d])))
                   for d in range(source.dim()))
    if _is_pointwise(target) or (target is aten._sample_dirichlet.default and dim < value.dim() - 1
                                 # (a draw over as many as the batch has samples: alone, over one)
                                 and not statically_known_true(value.shape[-1] == value.shape[dim])):
        return all(_uniform_along(a, dim - (value.dim() - _meta(a).dim()), memo, resized)
                   for a in node.all_input_nodes if isinstance(_meta(a), torch.Tensor))
    if target is aten.slice_scatter.default:
        # A slice along another dim written with values alike along ``dim`` (PatchTST's forecast
        # mask, ``mask[:, -k:] = 1`` into ``zeros(B, L)``).
        at = _norm_dim(node.args[2] if len(node.args) > 2 else named_arg(node, "dim", 0), value.dim())
        return at != dim and _uniform_along(node.args[0], dim, memo, resized) \
            and _uniform_along(node.args[1], dim, memo, resized)
    if target is aten.index_put.default:
        # One value put at positions of other dims, all along ``dim`` (sinkhorn-transformer's
        # causal mask, ``mask[:, i, j] = True`` into ``zeros(B * h, n, m)``).
        # (A boolean mask spans as many dims as it has: position and dim part ways.)
        indices, values = node.args[1], _meta(node.args[2])
        return (dim >= len(indices) or indices[dim] is None) and statically_known_true(values.numel() == 1) \
            and not any(isinstance(i, fx.Node) and _meta(i).dtype in (torch.bool, torch.uint8) for i in indices) \
            and _uniform_along(node.args[0], dim, memo, resized)
    if target in _REDUCED_ALONG_DIMS:
        # A reduction along other dims (TimesFM's count of its padding, ``(1 - pad).sum(1)``):
        # alike where its source is.
        source = _meta(node.args[0])
        reduced = node.args[1] if len(node.args) > 1 else named_arg(node, "dim", None)
        if isinstance(reduced, int):
            reduced = [reduced]
        if not reduced:
            return True  # over every dim: one number
        reduced = {_norm_dim(d, source.dim()) for d in reduced}
        keep = bool(node.args[2] if len(node.args) > 2 else named_arg(node, "keepdim", False))
        kept = list(range(source.dim())) if keep else [d for d in range(source.dim()) if d not in reduced]
        return kept[dim] in reduced or _uniform_along(node.args[0], kept[dim], memo, resized)
    return False


def _whole_tiles(node: fx.Node, dim: int, group: list[int]) -> bool:
    """Whether reshape ``node`` splits the dims ``group`` of a ``repeat`` so that every
    position along ``dim`` holds whole tiles, the same values: the repeat tiles the
    first of them alone, and a position spans a multiple of its tiles
    (``table.repeat(B, 1).view(B, n, d)`` of a table of ``n`` rows, or of a divisor of
    ``n``; ``.view(B, n * d)``)."""
    tiles = node.args[0]
    while isinstance(tiles, fx.Node) and tiles.target in _RESHAPES and _same_sizes(tiles, tiles.args[0]):
        tiles = tiles.args[0]  # (a view of the same sizes)
    if not isinstance(tiles, fx.Node) or tiles.target is not aten.repeat.default:
        return False
    source, shape, counts = _meta(tiles.args[0]), _meta(tiles).shape, list(tiles.args[1])
    new = len(shape) - source.dim()
    first = group[0]
    if first < new or any(not statically_known_true(counts[g] == 1)
                          and not statically_known_true(source.shape[g - new] == 1) for g in group[1:]):
        return False  # copies of all the source put in front, or tiles of a later dim of the group
    after = math.prod(_meta(node).shape[dim + 1:])  # elements from one position along ``dim`` to the next
    return statically_known_true(after % (source.shape[first - new] * math.prod(shape[first + 1:])) == 0)


def _constant_alike_along(node: fx.Node, dim: int) -> bool:
    """Whether the graph's constant ``node`` holds the same values all along ``dim``
    (``-0.0`` apart from ``0.0``, NaN alike)."""
    value = getattr(node.graph.owning_module, node.target, None)
    return isinstance(value, torch.Tensor) and value.dim() > dim and values_alike_along(value, dim)


def values_alike_along(value: torch.Tensor, dim: int, nan_alike: bool = True) -> bool:
    """Whether ``value`` holds the same values all along ``dim`` (``-0.0`` apart from
    ``0.0``; NaN alike where ``nan_alike``); ``False`` for an empty dim, or values not at
    hand (a fake tensor)."""
    try:
        first = value.narrow(dim, 0, 1).expand_as(value)
        same = value == first
        if value.is_floating_point():
            same &= value.signbit() == first.signbit()
            if nan_alike:
                same |= value.isnan() & first.isnan()
        return bool(same.all())
    except Exception:  # noqa: BLE001 - values not at hand (a fake tensor): not known alike
        return False


def _same_sizes(a: fx.Node, b: fx.Node) -> bool:
    shape_a, shape_b = _meta(a).shape, _meta(b).shape
    return len(shape_a) == len(shape_b) and all(statically_known_true(x == y) for x, y in zip(shape_a, shape_b))


def _resized(source: fx.Node, d: int, size: Any) -> bool:
    """Whether dim ``d`` of ``source`` may have another size than ``size``."""
    return not statically_known_true(_meta(source).shape[d] == size)


_REDUCED_ALONG_DIMS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
                       aten.prod.dim_int, aten.any.dim, aten.all.dim, aten.logsumexp.default}


def _computed_alike(first: fx.Node, other: fx.Node) -> bool:
    """Whether ``other`` holds ``first``'s values: the same node, or the same ops on the
    same numbers and the same inputs (TimesFM's front padding of each series,
    ``cat([ones(k), zeros(n)])`` once per sample), nothing of it written in place."""
    if first is other:
        return True
    corr: dict = {}
    pieces: dict = {}
    varied: list = []
    if not same_code(first, other, corr, pieces, varied, _comparable) or pieces or varied:
        return False
    # Nothing either reads may be written in place, an input both read included (``s.view(-1).add_(1)``
    # between the pieces).
    return all(_same_numbers(a.args, b.args) and _same_numbers(a.kwargs, b.kwargs)
               and not _written_into(a) and not _written_into(b) for a, b in corr.items())


def _same_numbers(a: Any, b: Any) -> bool:
    """``a == b`` for the numbers in two argument structures, with ``-0.0`` apart from ``0.0``
    and the types alike (``same_code`` compares them with ``==``)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_numbers(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_numbers(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, (bool, int, float)) or isinstance(b, (bool, int, float)):
        return type(a) is type(b) and a == b
    return True


def _written_unlike_along(node: fx.Node, dim: int) -> bool:
    """Whether a write in place into ``node`` (through views of it) makes its values
    differ along ``dim``: it writes some positions along ``dim`` only (``buf[-1] = 1``
    into ``zeros(B, 1)``, a row the size of which is symbolic, left in place), or goes
    through a view fxdp does not follow."""
    stack, views = [node], {node: dim}
    while stack:
        base = stack.pop()
        d = views[base]
        for user in base.users:
            if user.op != "call_function" or not user.args or user.args[0] is not base:
                continue
            if writes_in_place(user.target):
                continue  # over the whole of ``dim``: batched values make it batched (``follow_write``)
            if not is_view(user) or user in views:
                continue
            if user.target in (aten.select.int, aten.slice.Tensor, aten.narrow.default):
                at = _norm_dim(named_arg(user, "dim", 0), _meta(base).dim())
                if at == d and not (user.target is aten.slice.Tensor
                                    and statically_known_true(_meta(user).shape[d] == _meta(base).shape[d])):
                    if written_through(user):
                        return True  # part of ``dim`` viewed, and written
                    continue
                views[user] = d - (user.target is aten.select.int and at < d)
            elif user.target is aten.unsqueeze.default:
                views[user] = d + (_norm_dim(user.args[1], _meta(user).dim()) <= d)
            elif user.target in (aten.alias.default, aten.detach.default):
                views[user] = d
            else:
                if written_through(user):
                    return True  # another view (a reshape, a permute), written through
                continue
            stack.append(user)
    return False


# Random draws: each element its own, alike wherever it is.
_DRAWS = {aten.randint.low, aten.randint.default, aten.normal.float_float, aten.rand_like.default,
          aten.randn_like.default, aten.randint_like.default, aten.randint_like.low_dtype}


_FILL_ARGUMENT = {aten.full.default: 1, aten.new_full.default: 2, aten.full_like.default: 1}
_FILLED_WITH = {aten.zeros.default: 0, aten.new_zeros.default: 0, aten.zeros_like.default: 0,
                aten.ones.default: 1, aten.new_ones.default: 1, aten.ones_like.default: 1}


_KEEPING_VALUES = {aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
                   aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
                   aten.permute.default, aten.transpose.int, aten.clone.default, aten.alias.default}


def _fill_number(node: Any) -> Any:
    """The number a constant fill holds everywhere (``zeros(L)``: 0, ``full(s, 2.5)``:
    2.5, and views of such) as ``(value, its sign)`` (``-0.0`` is no ``0.0`` to
    ``copysign``), or ``None``; ``None`` too where anything writes into the fill in place
    (through a view: ``row.view(1, -1)[0, 1] = 4``)."""
    while isinstance(node, fx.Node) and node.target in _KEEPING_VALUES:
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.op != "call_function" or _written_into(node):
        return None
    if node.target in _FILLED_WITH:
        number = _FILLED_WITH[node.target]
    elif node.target in _FILL_ARGUMENT and len(node.args) > _FILL_ARGUMENT[node.target]:
        number = node.args[_FILL_ARGUMENT[node.target]]
        if not isinstance(number, (int, float, bool)) or math.isnan(number):  # (NaN: no number is alike)
            return None
    else:
        return None
    return float(number), math.copysign(1.0, float(number))


def _moved_from(node: fx.Node, dim: int) -> int | None:
    """The dim of its source that ``dim`` of a view which only moves or drops dims
    (``permute``, ``transpose``, ``select``, ``unsqueeze``) shows; None for other ops."""
    target, rank = node.target, _meta(node).dim()
    if target is aten.permute.default:
        return node.args[1][dim] % rank
    if target in (aten.transpose.int, aten.t.default):
        a, b = (node.args[1] % rank, node.args[2] % rank) if target is aten.transpose.int else (0, rank - 1)
        return b if dim == a else a if dim == b else dim
    if target is aten.select.int:
        return dim + (dim >= node.args[1] % (rank + 1))
    if target is aten.unsqueeze.default:
        return dim - (dim > node.args[1] % rank)  # the new dim has size 1: answered before
    return None


def _reshaped_from(node: fx.Node, dim: int) -> list[int] | None:
    """The dims of its source that ``dim`` of a reshape takes its values from: those of
    the group of dims, source and output, that hold the same elements (``[B, T, 8]`` to
    ``[B, T, 2, 4]``: dim 3 from dim 2; ``[B, T, d]`` to ``[B * T, d]``: dim 0 from dims
    0 and 1). None where the sizes do not tell."""
    src, dst = list(_meta(node.args[0]).shape), list(_meta(node).shape)
    i = j = 0
    while i < len(src) and j < len(dst):
        group, have, want, first = [i], src[i], dst[j], j
        i, j = i + 1, j + 1
        while not statically_known_true(have == want):
            if i < len(src) and statically_known_true(have < want):
                group, have, i = [*group, i], have * src[i], i + 1
            elif j < len(dst) and statically_known_true(want < have):
                want, j = want * dst[j], j + 1
            else:
                return None
        if first <= dim < j:
            return group
    return None


def _looked_up_alike(node: fx.Node, dim: int, memo: dict, resized: bool = False) -> bool:
    """For ``table[idx]`` (one integer index, on the first dim), ``index_select`` or
    ``embedding``: whether ``dim`` of the result comes from ``idx`` where it is alike all
    along it, or from the table where that is; along ``idx``'s dims, also where every
    row of the table holds the same values, whichever rows ``idx`` picks (PatchTST's
    forecast mask, one row repeated, shuffled: ``mask[torch.randperm(B)]``)."""
    if node.target is aten.index_select.default:
        table, at, idx = node.args
        if dim != at:
            return _uniform_along(table, dim, memo, resized)
        return _uniform_along(idx, 0, memo, resized) or _uniform_along(table, at, memo, True)
    if node.target is aten.embedding.default:
        table, idx = node.args[0], node.args[1]
    else:
        table, indices = node.args[0], node.args[1]
        if len(indices) != 1 or not isinstance(indices[0], fx.Node) or _meta(indices[0]).dtype is torch.bool:
            return False
        idx = indices[0]
    rank = _meta(idx).dim()
    if dim >= rank:
        return _uniform_along(table, dim - rank + 1, memo, resized)
    # (the table's rows counted apart from the result's: an input's or buffer's rows differ)
    return _uniform_along(idx, dim, memo, resized) or _uniform_along(table, 0, memo, True)


_ALONG_THE_BATCH = (
    "it combines the batch with a shared tensor whose values vary along the batch dim (arange(B), a buffer "
    "sliced or tiled to B, a cumulative sum over the batch): each sample would get the entry at its position in the "
    "batch, so its gradient would change as other samples are added or removed; give such values no batch "
    "dim (size 1 there) or compute them from each sample")


# Ops that write values along ``dim`` at an index, ``(self, dim, index, values)``.
_SCATTERED_ALONG = {aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce,
                    aten.scatter_add.default, aten.scatter_reduce.two, aten.index_copy.default}


# Ops that read or write ``x[indices]``: ``(x, indices, ...)``.
_AT_INDICES = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._unsafe_index_put.default}


def _in_line_with_the_batch(node: fx.Node, arg_batch: list, memo: dict) -> list[tuple[Any, Any, int]]:
    """For ``x[indices]`` (``index``) or ``x[indices] = v`` (``index_put``) with ``x``
    batched: ``(operand, its batch, dim)`` for each operand with a dim in line with the
    batch dim. Where ``arange(B)`` indexes the batch dim, the other index tensors, along
    their dim that broadcasts with it (``buf[arange(B), pos] = 1``: sample ``b`` writes
    at ``pos[b]``); and ``v``, right-aligned with ``x[indices]`` (``buf[arange(B), 0] =
    arange(B)``, ``buf[:, idx] = table``: sample ``b`` gets row ``b`` of the value). With
    ``x`` shared and batched index tensors (a lookup, ``table[arange(B)[:, None], pos]``),
    the shared index tensors, along their dim that broadcasts with the batch's, where
    ``x`` is not alike along the dim they index (``memo``: see ``_uniform_along``)."""
    b, indices = arg_batch[0], node.args[1]
    if any(isinstance(ix, fx.Node) and _meta(ix).dtype in (torch.bool, torch.uint8) for ix in indices):
        return []  # a mask: its own rules
    dims, broadcast = _advanced_index_layout(indices)
    if b is None and node.target is aten.index.Tensor:
        batched = [(ix, ib) for ix, ib in zip(indices, arg_batch[1]) if isinstance(ib, BatchDim)
                   and isinstance(ib.dim, int)]
        if not batched:
            return []
        at = batched[0][1].dim + broadcast - _meta(batched[0][0]).dim()  # the batch's among the broadcast dims
        shared = [(d, ix, ib) for d, i in dims.items() for ix, ib in [(indices[i], arg_batch[1][i])]
                  if ib is None and isinstance(ix, fx.Node) and at - broadcast + _meta(ix).dim() >= 0]
        if not shared:
            return []
        # A buffer or input read as shared is no sample's rows along a dim the batch's size
        # is not (the size rule's reading, see ``_uniform_along``): a table there.
        rows = _meta(batched[0][0]).shape[batched[0][1].dim]
        tables = dict(memo)
        tables.update({(p, d, r): False for p in node.graph.nodes if p.op == "placeholder"
                       and isinstance(_meta(p), torch.Tensor) for d in range(_meta(p).dim()) for r in (False, True)
                       if not statically_known_true(_meta(p).shape[d] == 1)
                       and not statically_known_true(_meta(p).shape[d] == rows)})
        return [(ix, ib, at - broadcast + _meta(ix).dim()) for d, ix, ib in shared
                if not _uniform_along(node.args[0], d, tables)]
    if not (isinstance(b, BatchDim) and isinstance(b.dim, int)):
        return []
    pairs = []
    if b.dim in dims:
        by_batch = indices[dims[b.dim]]
        along = (batch_index_dim(by_batch) or (None,))[0]
        if along is None:
            return []  # each sample's own rows picked (``_gathered_from_own_rows``), or refused
        at = along + broadcast - _meta(by_batch).dim()
        region = (min(dims) if _adjacent(dims) else 0) + at
        pairs += [(ix, ib, at - broadcast + _meta(ix).dim()) for ix, ib in zip(indices, arg_batch[1])
                  if isinstance(ix, fx.Node) and ix is not by_batch]
    else:
        region = _kept_dim(dims, broadcast, b.dim)
    if node.target is not aten.index.Tensor:
        values = node.args[2]
        rank = _meta(node.args[0]).dim() - len(dims) + broadcast
        if isinstance(values, fx.Node):
            pairs.append((values, arg_batch[2], region - rank + _meta(values).dim()))
    return [(a, ab, d) for a, ab, d in pairs if d >= 0]


def _varies_along_the_batch(node: fx.Node, arg_batch: list, out_batch: Any, sources: dict) -> bool:
    """Whether the elementwise op ``node`` (or a ``cat``/``stack`` along another dim, a
    ``select_scatter``/``slice_scatter`` of a value along the batch dim, a ``scatter`` or
    ``index_copy`` along another dim, an ``index``/``index_put`` with operands in line
    with the batch dim), batched as ``out_batch``, takes a shared tensor that spans its batch dim with values
    that may differ along it (see ``_uniform_along``): ``cat((zeros(B, T), arange(B)[:, None]),
    1)`` gives each sample the entry at its position as surely as a product does.
    Integer and boolean results too (``pos + arange(B)`` used as a value, an id or a
    position), except the first rows of the samples' blocks added to their own positions
    (``arange(B)[:, None] * T + pos``, each sample's own rows of a flattened batch,
    which ``own_rows_pass`` checks); values computed from parameters are left to their
    rules (a parameter with a row per sample)."""
    out = _meta(node)
    out = out[0] if isinstance(out, (list, tuple)) else out
    if not (isinstance(out_batch, (BatchDim, Packed)) and isinstance(out_batch.dim, int)
            and isinstance(out, torch.Tensor)):
        return False
    if node.target in (aten.cat.default, aten.stack.default):
        at = _joined_along(node)
        dim = out_batch.dim - (node.target is aten.stack.default and out_batch.dim > at)
        pairs = [(piece, b, dim) for piece, b in zip(node.args[0], arg_batch[0])]
    elif node.target in (aten.select_scatter.default, aten.slice_scatter.default):
        # a shared value written along the batch dim (``m[:, 1] = torch.arange(B)``)
        at = _norm_dim(named_arg(node, "dim", 0), out.dim())
        if node.target is aten.select_scatter.default and at == out_batch.dim:
            return False  # one row of the batch (its own rules)
        dim = out_batch.dim - (node.target is aten.select_scatter.default and at < out_batch.dim)
        pairs = [(node.args[1], arg_batch[1], dim)]
    elif node.target in _SCATTERED_ALONG:
        # values (and where they go) written along another dim than the batch's, each
        # sample's slot its own: ``zeros_like(h).scatter(1, index, src)``, ``index_copy``
        if _norm_dim(node.args[1], out.dim()) == out_batch.dim:
            return False  # rows placed along the batch dim (their own rules)
        pairs = [(a, b, out_batch.dim) for a, b in zip(node.args[2:4], arg_batch[2:4])
                 if isinstance(a, fx.Node) and _meta(a).dim() == out.dim()]
    elif node.target in _AT_INDICES:
        # No rule of a parameter judges these: a value computed from one varies along
        # the dims of the parameter it keeps (``buf[arange(B)] = table[:B]``).
        memo = {(p, d, r): False for p, of in sources.items() if of == {p} for r in (False, True)
                for d in range(_meta(p).dim()) if not statically_known_true(_meta(p).shape[d] == 1)}
        return any(b is None and _meta(arg).dim() and not _uniform_along(arg, dim, memo)
                   for arg, b, dim in _in_line_with_the_batch(node, arg_batch, memo))
    else:
        pairs = [(arg, b, out_batch.dim - (out.dim() - _meta(arg).dim())) for arg, b in zip(node.args, arg_batch)
                 if isinstance(arg, fx.Node) and isinstance(_meta(arg), torch.Tensor)
                 and not (_integer(out) and node.target is aten.add.Tensor and _row_starts(arg) is not None)]
    return any(b is None and arg not in sources and _meta(arg).dim() and not _uniform_along(arg, dim)
               for arg, b, dim in pairs)


# Views and copies through which a value of ``arange`` stays one (as ``arange_dim`` follows).
_AS_ARANGE = {aten.unsqueeze.default, aten.slice.Tensor, aten.permute.default, aten.expand.default,
              aten.broadcast_to.default, aten.expand_as.default, aten.view.default, aten.reshape.default,
              aten._unsafe_view.default}


def _integer(value: torch.Tensor) -> bool:
    """Whether ``value`` holds integers (not floats, complex numbers or booleans)."""
    return not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)


def _row_starts(node: Any) -> Any:
    """The rows per block ``S`` where the shared ``node`` holds the first rows of the
    samples' blocks of a merged batch, ``arange(B) * S`` (or ``arange(0, B * S, S)``,
    ``(arange(B * g) // g) * S``), as views of ``arange`` show it (what ``arange(B)[:, None] * T + pos`` adds to each
    sample's own positions); ``None`` otherwise. ``S`` is a number, or the node of a size
    or of a one-element tensor."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    target, args = node.target, node.args
    if target is aten.arange.start_step:
        step = named_arg(node, "step", 1)
        return step if args[0] == 0 and step is not None and not (isinstance(step, int) and step == 1) else None
    if target in (aten.mul.Tensor, aten.mul.Scalar):
        for a, step in (args, args[::-1]):
            if batch_index_dim(a) is not None and not (isinstance(step, int) and step == 1) and (
                    not isinstance(step, fx.Node) or not isinstance(_meta(step), torch.Tensor)
                    or statically_known_true(_meta(step).numel() == 1)):
                return step
        return None
    return _row_starts(args[0]) if target in _COPIES or target in _AS_ARANGE else None


def _track_flat_index(node: fx.Node, flat_indices: dict, batch: dict) -> None:
    """Follow the indices into a flattened batch, ``arange(B)[:, None] * S + pos``
    (``flat_indices``: each one's ``S``), which ``_varies_along_the_batch`` lets combine
    the batch with the samples' positions. Such an index is each sample's own only as the
    index of a gather or write among each sample's own rows (recorded as ``OwnRows``,
    whose run-time check then also asserts that ``S`` is the rows per sample), rearranged,
    cut into pieces or joined with others, or moved by the samples' own values or by
    values alike for every sample (``+ arange(w)`` along another dim, a number); as a
    value, an id or another position it holds the sample's place in the batch (``b * S``).
    """
    target, out_batch = node.target, batch.get(node)
    used = [a for a in node.all_input_nodes if a in flat_indices]
    if target in SHAPED_LIKE or target in _NEW_LIKE or target in _CREATION:
        return  # its sizes only
    if not used:
        if target is aten.add.Tensor and _integer(_meta(node)) and isinstance(out_batch, BatchDim) \
                and isinstance(out_batch.dim, int):
            rank = _meta(node).dim()
            for a in node.args:
                step = _row_starts(a)
                if step is not None and not _uniform_along(a, out_batch.dim - rank + _meta(a).dim()):
                    flat_indices[node] = step  # the row starts along the batch: ``b * S + pos``
                    return
        return
    step = flat_indices[used[0]]
    if target in _IDS_KEPT or target in _PIECES_OF_ALL or (
            target in (aten.cat.default, aten.stack.default) and all(a in flat_indices for a in node.args[0])
            and all(_same_step(flat_indices[a], step) for a in node.args[0])):
        flat_indices[node] = step
        return
    if target in (aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar) and len(used) == 1 \
            and (node.args[0] is used[0] or target in (aten.add.Tensor, aten.add.Scalar)) \
            and node.args[0] is not node.args[1]:
        other = node.args[1] if node.args[0] is used[0] else node.args[0]
        if not isinstance(other, fx.Node) or not isinstance(_meta(other), torch.Tensor) or (
                isinstance(batch.get(other), BatchDim) and batch[other].dim is not None) or (
                batch.get(other) is None and isinstance(out_batch, BatchDim) and isinstance(out_batch.dim, int)
                and _uniform_along(other, out_batch.dim - _meta(node).dim() + _meta(other).dim())):
            flat_indices[node] = step  # moved by each sample's own values, or by values alike for all
            return
    own = _OWN_ROWS[-1]
    for i, record in enumerate(own):
        if isinstance(record, OwnRows) and record.node is node and used == [record.index] \
                and _occurrences(node, record.index) == 1:
            own[i] = dataclasses.replace(record, step=step)
            return
    raise MixesSamples(
        "it computes with an index into the samples' rows of a flattened batch (arange(B)[:, None] * T + pos) "
        "other than to index those rows: the index holds each sample's place in the batch (b * T); compute with "
        "the sample's own positions (pos) instead")


def _same_step(a: Any, b: Any) -> bool:
    """Whether two flat indices' ``S`` are the same (a number, or one node)."""
    return a is b or (not isinstance(a, fx.Node) and not isinstance(b, fx.Node) and statically_known_true(a == b))


def _occurrences(node: fx.Node, value: fx.Node) -> int:
    """How many times ``value`` is among ``node``'s arguments."""
    seen: list = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: seen.append(a) if a is value else None)
    return len(seen)


_EXTRA_POINTWISE = [
    aten.dropout.default, aten.native_dropout.default, aten.clone.default, aten.contiguous.default,
    aten.detach.default, aten.alias.default, aten._to_copy.default, aten.to.dtype, aten.to.device,
    aten.to.dtype_layout, aten.lift_fresh_copy.default,
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
    aten.rsub.Tensor, aten.rsub.Scalar, aten.zero.default, aten._conj.default, aten.conj_physical.default,
    aten.rand_like.default, aten.randn_like.default, aten.bernoulli.default, aten.bernoulli.p, aten.bernoulli.Tensor,
    aten.randint_like.default, aten.randint_like.low_dtype,  # (BERT's random tokens: randint_like(ids, V))
    # draws of each element on its own (``torch.distributions``' Gamma, Poisson, Binomial)
    aten._standard_gamma.default, aten.poisson.default, aten.binomial.default, aten._standard_gamma_grad.default,
    aten._dirichlet_grad.default,  # (each element's, given the draw's total along its last dim)
    aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.feature_dropout.default,
    aten.alpha_dropout.default, aten.gelu.default, aten.silu.default, aten.hardtanh.default,
    aten.leaky_relu.default, aten.elu.default, aten.softplus.default, aten.mish.default,
    aten.hardswish.default, aten.hardsigmoid.default, aten.relu6.default, aten.celu.default,
    aten.selu.default,
    aten.copy.default, aten.copy_.default, aten.fill_.Scalar, aten.fill.Scalar, aten.fill_.Tensor,
    aten.fill.Tensor,
    aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar,
    # In-place random fills of a tensor: each element on its own, as ``bernoulli``.
    aten.bernoulli_.Tensor, aten.bernoulli_.float, aten.uniform_.default, aten.normal_.default,
    aten.uniform.default,
    aten.zero_.default,
    # ``mask_a & mask_b`` (transformers' masking_utils): bitwise_and and friends.
    aten.__and__.Tensor, aten.__and__.Scalar, aten.__or__.Tensor, aten.__or__.Scalar,
    aten.__xor__.Tensor, aten.__xor__.Scalar, aten.__iand__.Tensor, aten.__iand__.Scalar,
    aten.__ior__.Tensor, aten.__ior__.Scalar, aten.__ixor__.Tensor, aten.__ixor__.Scalar,
    # ``lengths // 2`` (Speech2Text's output lengths from the attention mask), untagged.
    aten.floor_divide.default, aten.floor_divide.Scalar, aten.floor_divide_.Tensor, aten.floor_divide_.Scalar,
    aten.true_divide.Scalar,
    # Untagged elementwise ops: complex numbers from parts, and the other random fills
    # (``F.gumbel_softmax`` draws ``exponential_``).
    aten.complex.default, aten.polar.default, aten.exponential.default, aten.exponential_.default,
    aten.geometric_.default, aten.log_normal_.default, aten.cauchy_.default, aten.random_.default,
    getattr(aten.random_, "from"), aten.random_.to,
    aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor,
    # Activations' gradients from the output's gradient and the input (or output), untagged
    # (a Function's backward may call them).
    aten.hardtanh_backward.default, aten.leaky_relu_backward.default, aten.elu_backward.default,
    aten.softplus_backward.default, aten.hardswish_backward.default, aten.hardsigmoid_backward.default,
    aten.mish_backward.default,
    # Fake quantisation with given scale and zero point (quantisation-aware training with
    # its observers off): each element on its own. Observing (min/max over the batch) is
    # another op, refused. (Per channel: ``_fake_quantize_per_channel``.)
    aten.fake_quantize_per_tensor_affine.default, aten.fake_quantize_per_tensor_affine.tensor_qparams,
    aten.fake_quantize_per_tensor_affine_cachemask.default,
    aten._fake_quantize_per_tensor_affine_cachemask_tensor_qparams.default,
]


def _is_pointwise(target: Any) -> bool:
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.pointwise in target.tags or target in _EXTRA_POINTWISE:
        return True
    # An in-place op writes what its out-of-place twin returns, so it propagates the same
    # way (torch tags only some in-place twins ``pointwise``).
    twin = out_of_place(target)
    return twin is not None and _is_pointwise(twin)


def _reshape(node: fx.Node, arg_batch: list) -> Any:
    """Where the batch lands after a reshape, from the flat-index structure.

    In flat order the samples occupy blocks: index ``o·(B·s) + b·s + r`` with
    ``s`` the elements of one sample's slab that follow its index. An output dim
    ``j`` of stride ``st`` holds the batch when ``st`` divides ``s`` and the span of
    dim ``j`` is a multiple of ``B·s``: then ``inner = s / st`` and
    ``outer = span / (B·s)``.
    """
    b = arg_batch[0]
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    src = list(_meta(node.args[0]).shape)
    dst = _sizes_asked(node)
    batch = src[b.dim] // (b.inner * b.outer)
    if statically_known_true(batch == 0):  # (not a list's length the data sets: x[mask])
        # no samples: any layout is right; keep the dim where the sizes still say it is
        return b if b.dim < len(dst) else BatchDim(0)
    if len(dst) > b.dim and all(statically_known_true(d == s) for d, s in zip(dst[:b.dim + 1], src[:b.dim + 1])):
        # The dims up to the batch's kept: only what follows it is reshaped, whatever its
        # sizes (``reshape(B, -1)`` of ``[B, u]`` with ``u`` from a nonzero, as
        # torch.distributions' ``_sum_rightmost`` does).
        return b
    if any(statically_known_true(size == 0) for size in src):
        # No values, so nothing to mix: the batch dim is the one with the same sizes
        # before it and itself (Wan's [B, 0, d] text beyond its 512 tokens, unflattened).
        for j, size in enumerate(dst):
            if bool(math.prod(dst[:j]) == math.prod(src[:b.dim])) and bool(size == src[b.dim]):
                return b.at(j)
        raise MixesSamples("it reshapes the batch dim of an empty tensor into several dims")
    for j, size in enumerate(dst):
        # The batch dim kept whole, as many elements before it (``[1, n, d]`` to ``[n, d]``
        # with ``n`` rows a nonzero found: no guard on the data-dependent ``n``).
        if statically_known_true(size == src[b.dim]) \
                and statically_known_true(math.prod(dst[:j]) == math.prod(src[:b.dim])):
            return b.at(j)
    stride = b.inner
    for size in src[b.dim + 1:]:
        stride = stride * size
    for j, size in enumerate(dst):
        after = 1
        for s in dst[j + 1:]:
            after = after * s
        span = size * after
        if bool(size == 1) and not bool(batch == 1):
            continue
        if bool(stride % after == 0) and bool(span % (batch * stride) == 0):
            # outer = span / (B·stride), counted as the blocks before the dim instead (the
            # same number: both sides hold every element), which needs no divisibility
            # the symbols do not show (``3·(s // 3) // s`` is 1 only where 3 divides s).
            return BatchDim(j, stride // after, math.prod(src[:b.dim]) * b.outer // math.prod(dst[:j]))
    raise MixesSamples("it reshapes the batch dim into several dims")


def _sizes_asked(node: fx.Node) -> list:
    """The output sizes of a view or reshape, each as the call gave it where it did:
    the fake tensor infers a size it was given from the others (``s // (s // 3)`` for
    ``reshape(B·(s // 3), 3, d)`` of ``[B, s, d]``), an expression the analysis cannot
    match to ``3`` without the divisibility the reshape itself guards on."""
    sizes = list(_meta(node).shape)
    asked = node.args[1] if node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default) \
        and len(node.args) > 1 else None
    if not isinstance(asked, (list, tuple)) or len(asked) != len(sizes):
        return sizes
    for j, size in enumerate(asked):
        if isinstance(size, int) and size >= 0:
            sizes[j] = size
        elif isinstance(size, fx.Node) and isinstance(size.meta.get("val"), (int, torch.SymInt)):
            sizes[j] = size.meta["val"]
    return sizes


def _same(node: fx.Node, arg_batch: list) -> Any:
    return arg_batch[0]


# Ops whose arguments at these positions give only a dtype and device: ``x.type_as(y)``
# and ``x.to(y)`` are ``x``'s values in ``y``'s dtype and device.
_DTYPE_DONORS = {aten.type_as.default: (1,), aten.to.other: (1,)}
_register(*_DTYPE_DONORS)(_same)


def _dim_op(check_dims: Callable[[fx.Node, int], list[int]], keep_shape: bool = True):
    """An op along some dims that must not include the batch dim."""

    def rule(node: fx.Node, arg_batch: list) -> Any:
        b = arg_batch[0]
        if not isinstance(b, BatchDim) or b.dim is None:
            return b
        ndim = _meta(node.args[0]).dim()
        dims = [_norm_dim(d, ndim) for d in check_dims(node, ndim)]
        if b.dim in dims:
            raise MixesSamples("it works along the batch dim")
        return b

    return rule


def _arg_dim(index: int, default: Any = None):
    def dims(node: fx.Node, ndim: int) -> list[int]:
        d = node.args[index] if len(node.args) > index else node.kwargs.get("dim", default)
        if d is None or (isinstance(d, (list, tuple)) and len(d) == 0):
            return list(range(ndim))
        return list(d) if isinstance(d, (list, tuple)) else [d]

    return dims


for _op, _idx in [
    (aten.softmax.int, 1), (aten._softmax.default, 1), (aten.log_softmax.int, 1),
    (aten._log_softmax.default, 1), (aten.cumsum.default, 1), (aten.cumprod.default, 1),
    (aten.index_select.default, 1), (aten.gather.default, 1), (aten.flip.default, 1),
    (aten.narrow.default, 1), (aten._safe_softmax.default, 1),
    (aten.logcumsumexp.default, 1),
    # ``torch.fft``'s kernels (``rfft``, ``irfft``, ``fftn``, ...) along their ``dim`` list
    (aten._fft_r2c.default, 1), (aten._fft_c2r.default, 1), (aten._fft_c2c.default, 1),
]:
    PROPAGATION[_op] = _dim_op(_arg_dim(_idx))


def _rolled_dims(node: fx.Node, ndim: int) -> list[int]:
    """The dims ``roll`` moves elements along: a shift of 0 moves none (``roll(x, 0, 0)``,
    a shift set to 0 by a config); with no dims the flattened tensor rolls, every dim."""
    shifts = node.args[1]
    dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dims", [])
    shifts = list(shifts) if isinstance(shifts, (list, tuple)) else [shifts]
    dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
    moved = [not (isinstance(shift, int) and shift == 0) for shift in shifts]
    if not dims:
        return list(range(ndim)) if any(moved) else []
    return [dim for dim, move in zip(dims, moved) if move]


PROPAGATION[aten.roll.default] = _dim_op(_rolled_dims)
# ``rot90`` turns the plane of dims (0, 1) unless told otherwise.
PROPAGATION[aten.rot90.default] = _dim_op(lambda node, ndim: list(node.args[2]) if len(node.args) > 2 else [0, 1])


# ``F.glu`` halves its dim (default the last) into a value and a gate.
PROPAGATION[aten.glu.default] = _dim_op(_arg_dim(1, -1))


def _dirichlet_draw(node: fx.Node, arg_batch: list) -> Any:
    """A Dirichlet draw (``torch.distributions``' Dirichlet and Beta) normalises along the
    last dim, the concentrations of one draw: not the batch dim, nor one of the batch's
    size where the concentrations are built from sizes alone (``ones(B, B)``: alone, a
    sample would draw over one)."""
    b = arg_batch[0]
    value = _meta(node.args[0])
    if isinstance(b, BatchDim) and isinstance(b.dim, int) and value.dim() > 1 \
            and statically_known_true(value.shape[-1] == value.shape[b.dim]) \
            and not any(n.op == "placeholder" for n in reached(
                [node.args[0]], lambda n: [] if n.target in _SIZES else n.all_input_nodes)):
        raise MixesSamples("it draws over as many categories as the batch has samples, from concentrations "
                           "built from sizes alone (torch.ones(B, B)): alone, each sample would draw over one")
    return _along_the_last_dim(node, arg_batch)


_along_the_last_dim = _dim_op(lambda node, ndim: [ndim - 1])


PROPAGATION[aten._sample_dirichlet.default] = _dirichlet_draw


for _op in (aten.tril.default, aten.triu.default, aten.tril_.default, aten.triu_.default):
    # A triangle of the last two dims (a causal mask of batched scores).
    PROPAGATION[_op] = _dim_op(lambda node, ndim: [ndim - 2, ndim - 1])


@dataclasses.dataclass(frozen=True)
class OwnRows:
    """A gather of rows along a merged batch dim by per-sample indices, or a write into
    such rows, where every index must fall among its own sample's rows: ``flat[arange(B)
    [:, None] * T + pos]`` on ``flat = h.reshape(B * T, d)``, the flattened batched gather
    written by hand; ``zeros(B * S, d).scatter_add(0, arange(B)[:, None] * S + segment, v)``,
    segment pooling over a flattened batch.

    Attributes:
        node: The op (``index_select``, ``gather``, ``index.Tensor``; ``scatter``,
            ``scatter_add``, ``scatter_reduce``, ``index_add``, ``index_copy``, ...).
        index: The index tensor, batched along its dim ``index_dim``.
        data: The tensor gathered from or written into (``self``), whose dim
            ``data_dim`` merges the samples' rows.
        alike: The index is shared (the same positions every call, TAPAS's segments
            offset by ``arange(B)``): each sample's indices must also fall at the same
            places among its own rows (``arange(B) * (S + 1)`` writes sample ``b`` at
            its row ``b``).
        step: The ``S`` of an index ``arange(B)[:, None] * S + pos`` (see
            ``_track_flat_index``), which must be the rows per sample (with ``S = T +
            1`` sample ``b``'s positions move by ``b`` among its rows), or ``None``.
    """

    node: fx.Node
    index: fx.Node
    index_dim: int
    data: fx.Node
    data_dim: int
    alike: bool = False
    step: Any = None


@dataclasses.dataclass(frozen=True)
class SameCounts:
    """A view of the rows a boolean mask selected over the batch as ``[B, n, ...]``
    (``h[eos_mask].view(B, -1, d)``, the sentence representation of Hugging Face's BART
    and T5 classification heads): row ``(b, j)`` is sample ``b``'s ``j``-th selected
    row only where every sample's mask selects as many (``n``), which ``own_rows_pass``
    checks at run time. Or an elementwise op broadcasting the selected elements against
    the batch (``cos + mask * f(cos[mask])[:, None]``, see ``_paired_per_sample``):
    every sample's mask must select exactly one. Or a mean over every element of the selected rows
    (``x[mask].mean()``, ``bce_with_logits(logits[mask], labels[mask])``, ELECTRA's
    discriminator loss), the mean over the samples of each one's own mean where every
    sample's mask selects as many. Or a ``masked_scatter`` of a source batched along its dim 0
    (see ``_masked_scatter``): every sample's mask must select as many positions as
    one sample's source holds.

    Attributes:
        node: The view, or the ``masked_scatter``.
        mask: The boolean mask, batched along its dim ``dim``.
        source: The ``masked_scatter``'s source, or ``None``.
        like: The ``masked_scatter``'s input, to whose shape the mask broadcasts
            (``(ids == k)[..., None]`` over ``[B, T, d]`` embeddings).
        rows: ``source`` holds rows written at the mask's positions (an ``index_put``
            by the mask), not elements.
    """

    node: fx.Node
    mask: fx.Node
    dim: int
    source: "fx.Node | None" = None
    like: "fx.Node | None" = None
    rows: bool = False
    mean: bool = False  # ``node`` is a mean over every element of the selected rows
    one: bool = False  # ``node`` pairs the selected elements with the batch's samples: one each


@dataclasses.dataclass(frozen=True)
class CountedKeys:
    """A ``histc`` of the keys a sort of the whole batch ordered, whose cumulative counts
    a grouped matmul reads as the groups' ends (see ``Groups``): row ``r`` is in group
    ``keys[r]`` only where every key is counted in its own bin or in none, after all the
    counted ones. A negative key is sorted first and counted in none (every group after
    it moves by how many the whole batch has), and with ``max >= bins`` a key ``bins …
    max`` is counted in the last bin: ``own_rows_pass`` checks at run time that no key is
    either (one past the experts, a dropped choice, is sorted last and counted in none
    where ``max < bins``).

    Attributes:
        node: The ``histc``.
        keys: Its keys.
        bins, high: Its ``bins`` and ``max``.
    """

    node: fx.Node
    keys: fx.Node
    bins: int
    high: float


# The gathers and writes of each propagation running now, innermost last (``_propagate``).
_OWN_ROWS: list[list[OwnRows | SameCounts | CountedKeys]] = []
# Its parameter uses on rows a mask selected, to run on the rows put back in place
# (``rows_in_place_pass``): ``(op, {selected operand: its mask})``.
_ROWS_IN_PLACE: list[list[tuple[fx.Node, dict]]] = []


def _gathered_from_own_rows(node: fx.Node, b: Any, index: fx.Node, ib: Any, out_dim: int) -> BatchDim | None:
    """The batch of ``node``, which gathers rows of its first argument along that
    argument's batch dim ``b`` at the integer ``index`` (batched as ``ib``), if each
    index may be read as one of its own sample's rows; ``None`` otherwise.

    Sample ``s`` holds rows ``[s·R, (s+1)·R)`` of the data (``R = b.inner``, any ``R``),
    and the index's rows along its batch dim belong to the samples in turn. Where each
    index lies among its own sample's rows the gather keeps samples apart, and its
    output is batched as the index (along ``out_dim``). Nothing in the graph proves it
    (``pos`` is data): ``own_rows_pass`` checks it at run time, and the gathers are
    recorded for it in ``_OWN_ROWS``."""
    data = node.args[0]
    # With one row per sample (nothing merged) only ``arange(B)`` keeps samples apart.
    if not (isinstance(b, BatchDim) and isinstance(b.dim, int) and bool(b.outer == 1) and not bool(b.inner == 1)
            and isinstance(ib, BatchDim) and isinstance(ib.dim, int) and bool(ib.outer == 1)
            and isinstance(index, fx.Node) and isinstance(data, fx.Node)
            and _meta(index).dtype in (torch.int64, torch.int32, torch.int16, torch.int8)):
        return None
    _OWN_ROWS[-1].append(OwnRows(node, index, ib.dim, data, b.dim))
    return BatchDim(out_dim, ib.inner)


@_register(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def _softmax_backward(node, arg_batch):
    """The gradient through ``softmax``/``log_softmax`` along ``dim`` from the output's
    gradient and the output (a Function's backward written with it: DeBERTa's and SEW-D's
    ``XSoftmax``): elementwise in the two, mixing along ``dim``, which must not be the
    batch dim."""
    b = _pointwise(node, arg_batch[:2] + [None] * (len(arg_batch) - 2))
    if isinstance(b, BatchDim) and isinstance(b.dim, int) and b.dim == _norm_dim(node.args[2], _meta(node).dim()):
        raise MixesSamples("it works along the batch dim")
    return b


@_register(aten.gather.default, aten.index_select.default, aten.narrow.default)
def _indexing_along(node, arg_batch):
    b = arg_batch[0]
    index = arg_batch[-1] if len(arg_batch) > 1 else None
    if b is None and isinstance(index, BatchDim) and index.dim is not None:
        # Shared data looked up by each sample's own indices (``centers.index_select(0,
        # y)``): the output's batch is the indices' batch, along the indexed dim.
        dim = _norm_dim(node.args[1], _meta(node.args[0]).dim())
        if node.target is aten.index_select.default:
            return index.at(dim)
        if node.target is aten.gather.default and (index.dim == dim or _broadcast_along(node.args[0], index.dim)):
            # Along the indices' batch dim every sample reads the same broadcast row.
            return index
        raise MixesSamples("it gathers shared data along another dim than the batch of its indices "
                           "(each sample would read the row at its own position in the batch)")
    if isinstance(b, BatchDim) and isinstance(b.dim, int) and isinstance(index, BatchDim) \
            and isinstance(index.dim, int) and (index.dim if node.target is aten.gather.default else _norm_dim(
                node.args[1], _meta(node.args[0]).dim())) != b.dim:
        # The indices' batch lands on another dim than the data's (``index_select(h, 1,
        # lengths - 1)``: every sample reads the positions all the samples chose).
        raise MixesSamples("it picks positions along another dim with indices of the whole batch: each "
                           "sample would read the positions every other sample chose (pick each sample's "
                           "own with h[arange(B), idx] or gather)")
    if (node.target is not aten.narrow.default and isinstance(b, BatchDim) and isinstance(b.dim, int)
            and b.dim == _norm_dim(node.args[1], _meta(node.args[0]).dim())):
        # Rows of the batch dim picked by per-sample indices (``index_select`` of a flat
        # ``[B·T, d]`` at ``arange(B) * T + pos``; ``gather`` along it).
        rows_at = 0 if node.target is aten.index_select.default else b.dim  # the index's batch dim
        own = (_gathered_from_own_rows(node, b, node.args[2], index, b.dim)
               if isinstance(index, BatchDim) and index.dim == rows_at else None)
        if own is not None:
            return own
    if (node.target is aten.gather.default and isinstance(b, BatchDim) and isinstance(b.dim, int)
            and not bool(_meta(node).shape[b.dim] == _meta(node.args[0]).shape[b.dim])):
        # The output has the index's shape, which may cover the first rows only.
        raise MixesSamples("its index covers only part of the batch dim: the output holds the first "
                           "samples' values only (broadcast it to every sample, or use take_along_dim)")
    if (node.target is aten.gather.default and isinstance(b, BatchDim) and isinstance(b.dim, int)
            and index is None and not _uniform_along(node.args[2], b.dim)):
        # Each sample would read at its own position's row of the indices
        # (``gather(h, 1, (arange(B) % T)[:, None])``), which alone is always the first.
        raise MixesSamples("it gathers with a shared index whose values vary along the batch dim: each "
                           "sample would read at the indices of its position in the batch")
    return _dim_op(_arg_dim(1))(node, arg_batch)


def _broadcast_along(data: Any, dim: int) -> bool:
    """Whether ``data`` is an expand that broadcasts its dim ``dim`` (added, or from
    size 1, also through an expand of an expand: reformer's ``ticker.expand_as(...)``
    of an ``arange(n)[None].expand_as(buckets)``): the same row for every index along it."""
    while isinstance(data, fx.Node) and data.op == "call_function" and data.target in (
            aten.expand.default, aten.broadcast_to.default, aten.expand_as.default):
        lead = _meta(data).dim() - _meta(data.args[0]).dim()
        if dim < lead or bool(_meta(data.args[0]).shape[dim - lead] == 1):
            return True
        data, dim = data.args[0], dim - lead
    return False


@_register(aten.embedding_renorm_.default)
def _embedding_renorm(node, arg_batch):
    """``nn.Embedding(max_norm=...)`` rescales, under ``no_grad``, every row the batch
    looks up whose norm exceeds ``max_norm``: a row's new value depends on that row
    alone, so samples stay independent and the table stays shared. (The in-place write
    into the parameter is refused by ``parameter_write``, with what to do instead.)"""
    return arg_batch[0]


@_register(aten.view.default, aten.reshape.default, aten._unsafe_view.default,
           aten.flatten.using_ints, aten.unflatten.int, aten.view_as.default, aten.reshape_as.default)
def _view(node, arg_batch):
    return _reshape(node, arg_batch)


@_register(aten.broadcast_tensors.default)
def _broadcast_tensors(node, arg_batch):
    """Every output has the broadcast shape: batch dims align from the right, as in a
    pointwise op; a shared operand broadcast against a batched one is batched."""
    outs = _meta(node)
    out_ndim = outs[0].dim()
    result = None
    for t, b in zip(node.args[0], arg_batch[0]):
        if not isinstance(b, BatchDim) or not isinstance(t, fx.Node):
            continue
        candidate = WHOLE if b.dim is None else b.at(b.dim + out_ndim - _meta(t).dim())
        result = _agreed(result, candidate)
    return [result] * len(outs)


@_register(aten.permute.default)
def _permute(node, arg_batch):
    b = arg_batch[0]
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    ndim = _meta(node.args[0]).dim()
    dims = [_norm_dim(d, ndim) for d in node.args[1]]
    return b.at(dims.index(b.dim))


@_register(aten.transpose.int, aten.t.default, aten.swapaxes.default, aten.movedim.int)
def _transpose(node, arg_batch):
    b = arg_batch[0]
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    ndim = _meta(node.args[0]).dim()
    if node.target is aten.t.default:
        d0, d1 = 0, 1
    else:
        d0, d1 = (_norm_dim(d, ndim) for d in node.args[1:3])
    if node.target is aten.movedim.int:
        order = list(range(ndim))
        order.insert(d1, order.pop(d0))
        return b.at(order.index(b.dim))
    swap = {d0: d1, d1: d0}
    return b.at(swap.get(b.dim, b.dim))


@_register(aten.unsqueeze.default)
def _unsqueeze(node, arg_batch):
    b = arg_batch[0]
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    d = _norm_dim(node.args[1], _meta(node).dim())
    return b.at(b.dim + 1 if d <= b.dim else b.dim)


@_register(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _squeeze(node, arg_batch):
    b = arg_batch[0]
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    shape = _meta(node.args[0]).shape
    if node.target in (aten.squeeze.default, aten.squeeze_copy.default):
        dims = [i for i, s in enumerate(shape) if bool(s == 1)]
    else:
        ds = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        dims = [_norm_dim(d, len(shape)) for d in ds if bool(shape[_norm_dim(d, len(shape))] == 1)]
    if b.dim in dims:
        raise MixesSamples("it squeezes the batch dim away")
    return b.at(b.dim - sum(1 for d in dims if d < b.dim))


@_register(aten.as_strided.default)
def _as_strided(node, arg_batch):
    """``x.as_strided(size, stride, offset)`` of a contiguous ``x`` at the start of its
    memory, batched along dim 0, with ``x``'s strides and ``B`` rows, each row's window
    within its own sample's block of memory (the offset, a storage offset, and the
    window's extent short of one row's stride): batched along dim 0 as ``x``. The
    backward of a write into a view (``out.narrow(-1, 0, 2).copy_(h)``) is such a
    window, traced where the forward differentiates itself: ``grad.new_empty_strided(…)``,
    ``copy_``, ``as_strided``. Any other window reads memory the graph cannot place."""
    b = arg_batch[0]
    if b is None:
        return None
    x, out = node.args[0], _meta(node)
    base = _meta(x)
    size, stride = [_meta(n) for n in node.args[1]], [_meta(n) for n in node.args[2]]
    offset = _meta(named_arg(node, "storage_offset", None))
    offset = 0 if offset is None else offset
    if not (isinstance(b, BatchDim) and b.dim == 0 and b.plain and isinstance(x, fx.Node)
            and base.is_contiguous() and statically_known_true(base.storage_offset() == 0)
            and len(size) == base.dim() == out.dim() and base.dim() >= 1
            and all(statically_known_true(a == c) for a, c in zip(stride, base.stride()))
            and statically_known_true(size[0] == base.shape[0]) and statically_known_true(offset >= 0)
            and statically_known_true(offset + sum((n - 1) * st for n, st in zip(size[1:], stride[1:])) < stride[0])):
        raise _NoPropagation("no batch-dim propagation for aten.as_strided.default (other than a window "
                             "of each row of a contiguous tensor): fxdp cannot tell whether it keeps "
                             "samples independent; register a rule for it with fxdp.register_rule")
    return BatchDim(0)


@_register(aten.expand.default, aten.expand_as.default, aten.broadcast_to.default)
def _expand(node, arg_batch):
    b = arg_batch[0]
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    added = _meta(node).dim() - _meta(node.args[0]).dim()
    return b.at(b.dim + added)


@_register(aten._linalg_check_errors.default)
def _check_only(node, arg_batch):
    """A check of a decomposition's ``info`` that returns nothing."""
    return None


@_register(aten.log_sigmoid_forward.default)
def _log_sigmoid(node, arg_batch):
    """``F.logsigmoid``'s kernel: the values and a buffer of the same shape (or empty)."""
    return [arg_batch[0], arg_batch[0]]


@_register(aten.mv.default)
def _matrix_vector(node, arg_batch):
    from fxdp.rules.matmul import matmul_batch

    return matmul_batch(arg_batch[0], arg_batch[1], 2, 1)


@_register(aten.diag_embed.default)
def _diag_embed(node, arg_batch):
    """``torch.diag_embed(x)``: the last dim of ``x`` becomes a diagonal of two new
    dims (by default the last two); the leading dims stay."""
    b = arg_batch[0]
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    ndim = _meta(node.args[0]).dim()
    out_ndim = ndim + 1
    dims = sorted(_norm_dim(d, out_ndim) for d in (named_arg(node, "dim1", -2), named_arg(node, "dim2", -1)))
    if b.dim == ndim - 1:
        raise MixesSamples("it spreads the batch dim over a diagonal")
    d = b.dim
    for new in dims:  # the new dims are inserted in order around the kept ones
        if new <= d:
            d += 1
    return b.at(d)


@_register(aten.diagonal.default)
def _diagonal(node, arg_batch):
    """``x.diagonal(offset, dim1, dim2)``: the two dims are removed and their diagonal
    becomes a new last dim; the other dims keep their order."""
    b = arg_batch[0]
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    ndim = _meta(node.args[0]).dim()
    dims = [_norm_dim(named_arg(node, "dim1", 0), ndim), _norm_dim(named_arg(node, "dim2", 1), ndim)]
    if b.dim in dims:
        raise MixesSamples("it takes a diagonal across the batch dim")
    return b.at(b.dim - sum(1 for d in dims if d < b.dim))


@_register(aten.nonzero.default, aten.nonzero_static.default, aten.argwhere.default,
           aten.masked_select.default)
def _flattens_by_value(node, arg_batch):
    """Positions or elements found by value, in one list for the whole tensor: the
    samples' entries are flattened together (their count depends on the data).

    The positions a ``nonzero`` finds name rows of the batch in one of its columns:
    rows some samples' values chose (``Rows`` with ``column``), which ops that keep
    rows apart may follow and an ``index_add`` by that column puts back.

    ``masked_select(x, mask)`` of a mask of ``x``'s own shape and batch is ``x[mask]``:
    a ``Masked`` list."""
    if node.target is aten.masked_select.default:
        x, mask = arg_batch[:2]
        if isinstance(x, BatchDim) and x.dim is not None and isinstance(mask, BatchDim) and x.same_as(mask) \
                and _meta(node.args[0]).shape == _meta(node.args[1]).shape:
            return Masked(node.args[1], mask)
    b = arg_batch[0]
    if node.target in (aten.nonzero.default, aten.argwhere.default) and isinstance(b, BatchDim) \
            and isinstance(b.dim, int) and _equal_one(b.outer):
        # Rows of the batch, in an order every sample's values decide (see ``Rows``).
        shape = _meta(node.args[0]).shape
        found = BatchDim(0, b.inner * math.prod(shape[b.dim + 1:]), math.prod(shape[:b.dim]))
        return Rows(0, node, b.inner, column=b.dim, found=found)
    if any(isinstance(b, BatchDim) and b.dim is not None for b in arg_batch):
        raise MixesSamples("it flattens the batch into one list of what it finds, whose length "
                           "depends on the data (compute densely with a mask instead: torch.where(mask, a, b), a "
                           "one-hot or scatter combine, as a mixture of experts can route its tokens)")
    return None


@_register(aten.take.default)
def _take(node, arg_batch):
    """``torch.take(x, ids)`` reads ``x`` as one flat vector: shared ``x`` looked up
    by each sample's ``ids`` keeps the ids' batch; a batched ``x`` is read across samples."""
    x, ids = arg_batch[0], arg_batch[1]
    if isinstance(x, BatchDim) and x.dim is not None:
        raise MixesSamples("it indexes the flattened tensor, across the samples' rows")
    return ids


@_register(aten.put.default, aten.put_.default)
def _put(node, arg_batch):
    """``x.put(ids, values)`` writes into ``x`` read as one flat vector."""
    if any(isinstance(b, BatchDim) and b.dim is not None for b in arg_batch):
        raise MixesSamples("it writes into the flattened tensor, across the samples' rows")
    return None


@_register(aten.masked_scatter.default, aten.masked_scatter_.default)
def _masked_scatter(node, arg_batch):
    """``x.masked_scatter(mask, source)`` fills ``x``'s masked positions with ``source``'s
    elements read as one flat list, in order over the whole (broadcast) tensor.

    With the batch leading the mask (of the output's rank; a shared one is read by
    rows) and the source (each batched along dim 0), sample ``b``'s positions come
    after those of the samples before it, and are filled from its own row of the
    source exactly where every sample's mask selects as many positions as a row holds
    (a lower triangle filled from per-sample vectors, zuko's full covariances): a
    run-time check in the graph (see ``SameCounts``)."""
    x, mask, source = arg_batch[:3]
    if not any(isinstance(b, BatchDim) and b.dim is not None for b in arg_batch):
        return WHOLE if any(isinstance(b, BatchDim) for b in arg_batch) else None
    out = _meta(node)
    leading = BatchDim(0)
    # A shared mask of the output's rank (``tril(ones_like(x))``) is each sample's row of it.
    # The source may hold several rows per sample (``BatchDim(0, inner=n)``: a vision
    # tower's ``[B * n, d]`` image features, ``torch.cat(list(features))``).
    if (mask is None or (isinstance(mask, BatchDim) and mask.same_as(leading))) and isinstance(source, BatchDim) \
            and source.dim == 0 and bool(source.outer == 1) and (x is None or (isinstance(x, BatchDim) and x.same_as(
                leading.at(_meta(node.args[0]).dim() - out.dim())))) \
            and _meta(node.args[1]).dim() == out.dim() \
            and not statically_known_true(_meta(node.args[2])[0].numel() * source.inner >= out[0].numel()):
        # (A sample's source as large as its output fills it whole, or reads past it: a
        # model that means that has no use for the mask, and one that does not fails the
        # check on almost any data. At sizes that only run time knows, the check decides.)
        _OWN_ROWS[-1].append(SameCounts(node, node.args[1], 0, node.args[2], node.args[0]))
        return leading
    raise MixesSamples("it fills the masked positions from one flat list over the whole batch: which "
                       "elements a sample gets depends on the samples before it (use torch.where with a "
                       "source of the output's shape instead, or a source and a mask each batched along "
                       "dim 0, every sample's mask selecting as many positions as its source row holds)")


@_register(aten.view_as_real.default, aten.view_as_complex.default)
def _complex_view(node, arg_batch):
    """``view_as_real`` appends a dim of 2 (real, imaginary), ``view_as_complex`` reads
    the last dim of 2 as one complex number (what ``.real``/``.imag`` and complex rotary
    embeddings become)."""
    b = arg_batch[0]
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    if node.target is aten.view_as_complex.default and b.dim == _meta(node.args[0]).dim() - 1:
        raise MixesSamples("it pairs the batch dim's entries into complex numbers")
    return b


@_register(aten.bucketize.Tensor, aten.searchsorted.Tensor)
def _bucketize(node, arg_batch):
    """``bucketize(x, boundaries)`` and ``searchsorted(sorted, x)``: each value of ``x``
    looked up in a sorted sequence, shared (1-D) or one per leading index of ``x``."""
    sequence, values = ((arg_batch[1], arg_batch[0]) if node.target is aten.bucketize.Tensor
                        else (arg_batch[0], arg_batch[1]))
    sequence_node = node.args[1] if node.target is aten.bucketize.Tensor else node.args[0]
    if isinstance(sequence, BatchDim) and sequence.dim is not None:
        if sequence.dim == _meta(sequence_node).dim() - 1:
            raise MixesSamples("the batch is the dim of the sorted sequence it searches")
        return _agreed(values if isinstance(values, BatchDim) else None, sequence)
    return values


@_register(aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar, aten.isin.Scalar_Tensor)
def _isin(node, arg_batch):
    """``torch.isin(x, set)``: each element of ``x`` looked up in ``set``, which the
    samples must share (a set of special token ids: Grounding DINO's mask over them)."""
    if len(arg_batch) > 1 and _any_batched(arg_batch[1]):
        raise MixesSamples("the set it looks each element up in holds the batch (every sample's values)")
    if node.target is aten.isin.Scalar_Tensor:
        return None  # (one number looked up in a shared set)
    return arg_batch[0]


@_register(aten.renorm.default)
def _renorm(node, arg_batch):
    """``torch.renorm(x, p, dim, maxnorm)`` rescales each slice ``x.select(dim, i)`` by
    its norm over every other dim: per sample only when ``dim`` is the batch dim."""
    b = arg_batch[0]
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    if _norm_dim(node.args[2], _meta(node.args[0]).dim()) != b.dim:
        raise MixesSamples("its norms run over the batch dim (every dim but the one it renormalises)")
    return b


@_register(aten.native_layer_norm.default)
def _native_layer_norm(node, arg_batch):
    """``aten.native_layer_norm(x, normalized_shape, w, b, eps)``: the output and the
    statistics (``[*leading, 1, ..]``, as many dims as ``x``) normalise the trailing
    ``normalized_shape`` dims, which must not hold the batch."""
    b = arg_batch[0]
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    return _rows_normalised(b, node.args[0], node.args[1])


def _rows_normalised(b: BatchDim, x: fx.Node, normalized_shape: Sequence) -> BatchDim:
    """``b``, the batch of ``x`` normalised over its trailing ``normalized_shape`` dims,
    which must not hold it."""
    if b.dim >= _meta(x).dim() - len(normalized_shape):
        raise MixesSamples("the batch is one of the dims it normalises over")
    return b


@_register(aten.native_layer_norm_backward.default)
def _native_layer_norm_backward(node, arg_batch):
    """The gradients of ``native_layer_norm`` (a gradient the forward takes itself: an
    inner step of ``vmap(grad(f))``, titans' neural memory): the input's gradient is
    normalised along the same trailing dims, row by row; the weight's and bias's sum
    over every other dim, the batch's too, and must not be asked for
    (``output_mask``) where the rows are batched."""
    layouts = [b for b in arg_batch[:2] + arg_batch[3:5] if isinstance(b, BatchDim) and b.dim is not None]
    if not layouts:
        return [arg_batch[0]] * 3
    b = layouts[0]
    for other in layouts[1:]:
        b = _agreed(b, other)
    b = _rows_normalised(b, node.args[1], node.args[2])
    if any(named_arg(node, "output_mask", [True, True, True])[1:]):
        raise MixesSamples("the gradient of its weight or bias sums over the batch")
    return [b, None, None]


def _foreach(node, arg_batch):
    """``torch._foreach_*`` elementwise ops (tensordict's arithmetic on a dict of
    tensors): each output is the op on the tensors at its position in the lists (a
    single tensor argument goes with every one), batched as they broadcast."""
    layouts = []
    for i, out in enumerate(_meta(node)):
        batches, metas = [], []
        for arg, b in zip(node.args, arg_batch):
            if isinstance(arg, (list, tuple)) and arg and isinstance(arg[0], fx.Node):
                arg, b = arg[i], b[i]
            if isinstance(arg, fx.Node):
                batches.append(b)
                metas.append(_meta(arg))
        layouts.append(broadcast_batch(batches, metas, out.dim()))
    return layouts


# Out of place only (an in-place one writes its lists, which the analysis does not
# follow), and not the reductions (``_foreach_norm``, ``_foreach_max``).
for _name in ("abs", "acos", "add", "addcdiv", "addcmul", "asin", "atan", "ceil", "clamp_max", "clamp_min",
              "clone", "copy", "cos", "cosh", "div", "erf", "erfc", "exp", "expm1", "floor", "frac", "lerp",
              "lgamma", "log", "log10", "log1p", "log2", "maximum", "minimum", "mul", "neg", "pow", "reciprocal",
              "round", "rsqrt", "sigmoid", "sign", "sin", "sinh", "sqrt", "sub", "tan", "tanh", "trunc", "zero"):
    _packet = getattr(aten, f"_foreach_{_name}", None)
    for _overload in _packet.overloads() if _packet is not None else ():
        if not getattr(_packet, _overload)._schema.is_mutable:  # not the ``out=`` ones
            PROPAGATION[getattr(_packet, _overload)] = _foreach


# Matrix functions of the last two dims (``torch.linalg`` decompositions, inverses,
# determinants, exponentials): every output keeps the leading dims.
_MATRIX_OPS = [
    aten.linalg_inv_ex.default, aten._linalg_det.default, aten._linalg_slogdet.default, aten.linalg_qr.default,
    aten._linalg_svd.default, aten._linalg_eigh.default, aten.linalg_cholesky_ex.default,
    aten.linalg_lu_factor_ex.default, aten.linalg_lu.default, aten.linalg_matrix_exp.default,
    aten.linalg_householder_product.default, aten.linalg_eig.default, aten.linalg_pinv.atol_rtol_tensor,
    aten.cholesky.default, aten.cholesky_inverse.default,
]


@_register(*_MATRIX_OPS)
def _matrix_function(node, arg_batch):
    """The matrices are the first argument's last two dims; other tensor arguments
    (``householder_product``'s ``tau``, ``pinv``'s tolerances) share its leading dims."""
    first = arg_batch[0]
    if isinstance(first, BatchDim) and first.dim is not None and first.dim >= _meta(node.args[0]).dim() - 2:
        raise MixesSamples("the batch is a row or column of the matrices it works on")
    result = None
    for b in arg_batch:
        if isinstance(b, BatchDim):
            result = _agreed(result, b)
    out = _meta(node)
    return [result] * len(out) if isinstance(out, (list, tuple)) else result


@_register(aten.linalg_cross.default)
def _cross(node, arg_batch):
    """``linalg.cross(a, b, dim)``: broadcast like a pointwise op, one vector of 3 along ``dim``."""
    result = _pointwise(node, arg_batch)
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    if isinstance(result, BatchDim) and result.dim == _norm_dim(dim, _meta(node).dim()):
        raise MixesSamples("it takes cross products along the batch dim")
    return result


def _solve_matrix_dims(node: fx.Node) -> dict[int, int]:
    """How many trailing dims of each tensor argument of a linear solve are its matrix
    (or vector): the dims before them are batch dims, broadcast together."""
    if node.target is aten._linalg_solve_ex.default:
        a, b = _meta(node.args[0]), _meta(node.args[1])
        vector = b.dim() == 1 or (b.dim() == a.dim() - 1 and bool(b.shape == a.shape[:-1]))
        return {0: 2, 1: 1 if vector else 2}
    if node.target is aten.linalg_lu_solve.default:  # (LU, pivots, B)
        return {0: 2, 1: 1, 2: 2}
    if node.target is aten.lu_solve.default:  # (B, LU, pivots)
        return {0: 2, 1: 2, 2: 1}
    return {0: 2, 1: 2}  # solve_triangular, cholesky_solve, triangular_solve


@_register(aten._linalg_solve_ex.default, aten.linalg_solve_triangular.default, aten.cholesky_solve.default,
           aten.triangular_solve.default, aten.linalg_lu_solve.default, aten.lu_solve.default)
def _solve(node, arg_batch):
    """A linear solve of matrices (the trailing dims of each argument) batched over the
    leading dims, which broadcast together, right-aligned; every output keeps them."""
    matrix_dims = _solve_matrix_dims(node)
    columns = _independent_columns(node, arg_batch, matrix_dims)
    if columns is not None:
        return columns
    lead = max(_meta(node.args[i]).dim() - k for i, k in matrix_dims.items())
    from_right = None
    whole = False
    for i, k in matrix_dims.items():
        b = arg_batch[i] if i < len(arg_batch) else None
        if not isinstance(b, BatchDim):
            continue
        if b.dim is None:
            whole = True
            continue
        own_lead = _meta(node.args[i]).dim() - k
        if b.dim >= own_lead:
            raise MixesSamples("the batch is a row or column of the matrices it works on")
        candidate = b.at(own_lead - 1 - b.dim)
        from_right = _agreed(from_right, candidate)
    result = WHOLE if whole and from_right is None else (
        None if from_right is None else from_right.at(lead - 1 - from_right.dim))
    out = _meta(node)
    if node.target is aten._linalg_solve_ex.default:
        # (solution, LU, pivots, info): the factors are the matrix's own, not broadcast
        # against the right-hand side, so they keep its layout (shared for a shared matrix).
        factors = arg_batch[0] if isinstance(arg_batch[0], BatchDim) else None
        return [result] + [factors] * (len(out) - 1)
    return [result] * len(out) if isinstance(out, (list, tuple)) else result


# The right-hand side of each solve, and whether it solves ``A X = B`` (``left``).
_RIGHT_HAND_SIDE = {
    aten.linalg_solve_triangular.default: 1, aten._linalg_solve_ex.default: 1, aten.linalg_lu_solve.default: 2,
    aten.cholesky_solve.default: 0, aten.triangular_solve.default: 0, aten.lu_solve.default: 0,
}


def _independent_columns(node: fx.Node, arg_batch: list, matrix_dims: dict[int, int]) -> Any:
    """The layout of a solve with a shared matrix whose right-hand side holds the batch
    along the columns it solves one by one: ``A X = B`` solves each column of ``B`` on
    its own (``X A = B`` each row). ``torch.distributions.MultivariateNormal`` with a
    shared ``scale_tril`` computes ``solve_triangular(L, (x - loc).T)``: the samples are
    ``B``'s columns. ``None`` where the solve is not such a case."""
    rhs = _RIGHT_HAND_SIDE[node.target]
    b = arg_batch[rhs] if rhs < len(arg_batch) else None
    if not (isinstance(b, BatchDim) and isinstance(b.dim, int) and matrix_dims.get(rhs) == 2) \
            or _any_batched([a for i, a in enumerate(arg_batch) if i != rhs]):
        return None
    left = named_arg(node, "left", True)
    rank = _meta(node.args[rhs]).dim()
    if b.dim != rank - (1 if left else 2):
        return None
    out = _meta(node)
    if isinstance(out, (list, tuple)):  # the solution, then shared factors (LU, pivots) or A's copy
        return [b.at(out[0].dim() - (rank - b.dim))] + [None] * (len(out) - 1)
    return b.at(out.dim() - (rank - b.dim))


@_register(aten.repeat.default)
def _repeat(node, arg_batch):
    """``x.repeat(*counts)`` tiles each dim ``count`` times (more counts than dims add
    leading dims). Tiling the batch dim repeats the whole batch: the samples are then
    ``count`` times as many ``outer`` blocks of it, as after ``cat([x, x])``."""
    b = arg_batch[0]
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    counts = list(node.args[1])
    d = b.dim + len(counts) - _meta(node.args[0]).dim()
    count = _meta(counts[d]) if isinstance(counts[d], fx.Node) else counts[d]  # a symbolic count, its SymInt
    if statically_known_true(count == 1):
        return b.at(d)
    return BatchDim(d, b.inner, b.outer * count)


_PER_SAMPLE_LOOP = (" (a loop over chunks of samples concatenated again, torch.cat([f(c) for c in x.chunk(k)]) "
                    "or torch.func.vmap(f, chunk_size=k), runs as f on the whole batch where f keeps each chunk's "
                    "rows apart, draws no random numbers and reads no other values of the batch (a chunk's "
                    "value read outside the loop keeps its chunk); otherwise run f on the whole batch, or map it over "
                    "the samples with torch.func.vmap(f))")


@_register(aten.select.int)
def _select(node, arg_batch):
    b = arg_batch[0]
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    d = _norm_dim(node.args[1], _meta(node.args[0]).dim())
    if d == b.dim:
        size, index = _meta(node.args[0]).shape[d], node.args[2]
        if b.plain and isinstance(size, int) and isinstance(index, int):
            return Piece(index % size)
        if b.plain and isinstance(index, int) and index >= 0:  # (a loop over a symbolic batch)
            return Piece(index)
        raise MixesSamples("it selects one row of the batch" + _PER_SAMPLE_LOOP)
    return b.at(b.dim - 1 if d < b.dim else b.dim)


@_register(aten.slice.Tensor)
def _slice(node, arg_batch):
    b = arg_batch[0]
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    x = _meta(node.args[0])
    d = _norm_dim(node.args[1] if len(node.args) > 1 else 0, x.dim())
    if d == b.dim and not bool(_meta(node).shape[d] == x.shape[d]):
        start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
        start = start.meta.get("val") if isinstance(start, fx.Node) else start  # a symbolic size
        step = node.args[4] if len(node.args) > 4 else 1
        blocks = _whole_blocks(b, x.shape[d], [(start, _meta(node).shape[d])]) if step == 1 else None
        if blocks is None and b.plain and isinstance(x.shape[d], int) and isinstance(start, int) \
                and _meta(node).shape[d] == 1:
            return Piece(start % x.shape[d])
        samples = _samples_blocks(b, [(start, _meta(node).shape[d])]) if blocks is None and step == 1 else None
        if samples is not None:  # one sample's rows of a merged batch (``h[i * n:(i + 1) * n]``)
            return Piece(samples[0])
        if blocks is None and _one_row_of_each_sample(b, start, step):
            return BatchDim(b.dim)
        if blocks is None:
            raise MixesSamples("it slices the batch dim" + _PER_SAMPLE_LOOP)
        return blocks[0]
    return b


def _one_row_of_each_sample(b: BatchDim, start: Any, step: Any) -> bool:
    """Whether ``x[start::step]`` along a batch dim that holds ``n`` rows per sample
    (``[B·n, …]``, sample-major) takes row ``start`` of every sample: a step of ``n``
    from ``0 <= start < n``, which always gives ``B`` rows (with ``n = 1``, the whole
    batch). Granite Speech masks each sample's last block of attention windows as
    ``a[n - 1::n]``. (The row count the fake tensor gives, ``(B·n - start + n - 1) // n``,
    reduces to ``B`` for no symbolic ``start`` but ``n - 1``.)"""
    start, step = (_meta(v) if isinstance(v, fx.Node) else v for v in (start, step))
    return _equal_one(b.outer) and isinstance(start, (int, torch.SymInt)) and statically_known_true(start >= 0) \
        and statically_known_true(step == b.inner) and statically_known_true(start < b.inner)


def _samples_blocks(b: BatchDim, pieces: list) -> list[int] | None:
    """The sample whose rows each ``(start, length)`` piece of a batch dim laid out as
    ``b`` is, all of them: ``length`` is the ``inner`` rows of one sample, from the first
    of them (``n`` symbolic too); ``None`` where a piece is not."""
    inner = b.inner
    if not (_equal_one(b.outer) and isinstance(inner, (int, torch.SymInt)) and statically_known_true(inner >= 1)):
        return None
    samples = []
    for start, length in pieces:
        sample = _whole_multiple(start, inner)
        if sample is None or not (isinstance(length, (int, torch.SymInt)) and statically_known_true(length == inner)):
            return None
        samples.append(sample)
    return samples


def _whole_multiple(value: Any, size: Any) -> int | None:
    """``k`` where ``value`` is ``k·size`` for a number ``k >= 0`` (``i * n`` with a
    symbolic ``n``), else ``None``."""
    import sympy

    def expression(v: Any) -> Any:
        return plain_expression(v) if isinstance(v, torch.SymInt) else sympy.Integer(v)

    if not isinstance(value, (int, torch.SymInt)):
        return None
    ratio = sympy.simplify(expression(value) / expression(size))
    return int(ratio) if ratio.is_Integer and ratio >= 0 else None


def _whole_blocks(b: BatchDim, size: Any, pieces: list) -> list[BatchDim] | None:
    """The layouts of ``(start, length)`` pieces of a batch dim of ``size`` rows laid out
    as ``b``, where each piece is whole ``outer`` blocks of ``B·inner`` rows (``v[:B]``
    of ``cat([x1, x2])``: every sample keeps its rows); ``None`` where one is not."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if bool(b.outer == 1):
        return None
    block = size // b.outer  # B·inner rows: every sample's rows once
    layouts = []
    for start, length in pieces:
        if not (isinstance(start, (int, torch.SymInt)) and statically_known_true(start % block == 0)
                and statically_known_true(length % block == 0) and statically_known_true(length > 0)):
            return None
        layouts.append(BatchDim(b.dim, b.inner, length // block))
    return layouts


@_register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
           aten.unsafe_split.Tensor, aten.unsafe_chunk.default, aten.split.sizes, aten.tensor_split.sections)
def _split(node, arg_batch):
    b = arg_batch[0]
    n = len(_meta(node))
    if not isinstance(b, BatchDim) or b.dim is None:
        return [b] * n
    d = _norm_dim(node.args[2] if len(node.args) > 2 else 0, _meta(node.args[0]).dim())
    if d == b.dim:
        if n == 1:  # the whole batch in one piece (reformer's ``x.chunk(1, dim=0)``)
            return [b]
        pieces, start = [], 0
        for out in _meta(node):
            pieces.append((start, out.shape[d]))
            start = start + out.shape[d]
        blocks = _whole_blocks(b, _meta(node.args[0]).shape[d], pieces)
        samples = _samples_blocks(b, pieces) if blocks is None else None
        if samples is not None:
            # each sample's rows, ``n`` of them in a merged batch ``[B·n, …]`` (Llava-OneVision
            # splits its images' tiles back per image, ``split(h, [n] * B)``)
            return [Piece(i) for i in samples]
        if blocks is None:
            raise MixesSamples("it splits the batch dim" + _PER_SAMPLE_LOOP)
        return blocks
    return [b] * n


@_register(aten.unbind.int)
def _unbind(node, arg_batch):
    b = arg_batch[0]
    n = len(_meta(node))
    if not isinstance(b, BatchDim) or b.dim is None:
        return [b] * n
    d = _norm_dim(node.args[1] if len(node.args) > 1 else 0, _meta(node.args[0]).dim())
    if d == b.dim and b.plain and isinstance(n, int):
        return [Piece(i) for i in range(n)]
    if d == b.dim:
        raise MixesSamples("it unbinds the batch dim")
    return [b.at(b.dim - 1 if d < b.dim else b.dim)] * n


@_register(aten.cat.default, aten.stack.default)
def _cat(node, arg_batch):
    tensors = node.args[0]
    batches = arg_batch[0]
    d = _joined_along(node)
    result = None
    for t, b in zip(tensors, batches):
        if not isinstance(b, (BatchDim, Packed)):
            continue
        if b.dim is None:
            cand = WHOLE
        elif node.target is aten.stack.default:
            cand = b.at(b.dim + 1 if d <= b.dim else b.dim)
        else:
            if b.dim == d:
                return _cat_of_batches(batches, d)
            cand = b
        result = _agreed(result, cand)
    return result


def _cat_of_batches(batches: list, d: int) -> BatchDim | Packed:
    """``cat([x1, x2], batch dim)`` of batched tensors: laid out alike (two views of each
    sample, a siamese pair), sample ``b``'s rows are in every block, as after
    ``x.repeat(2, 1)`` — the ``outer`` blocks add up; with different rows per sample
    (``z.reshape(-1)`` of ``[B, D]`` beside ``logp.reshape(-1)`` of ``[B]``), the blocks
    are ``Packed``."""
    if any(not _any_batched(b) for b in batches):
        raise MixesSamples("it concatenates a shared tensor along the batch dim: its rows would join the "
                           "samples' as if they were one sample's")
    if not all(isinstance(b, (BatchDim, Packed)) and b.dim == d for b in batches):
        raise MixesSamples("it concatenates along the batch dim tensors batched along other dims")
    return _packed(d, [block for b in batches for block in (b.blocks if isinstance(b, Packed) else [b])])


def _packed(d: int, blocks: list) -> BatchDim | Packed:
    """Batches laid end to end along ``d``: one batch where every block has as many rows
    per sample (the ``outer`` blocks add up), ``Packed`` otherwise."""
    if all(bool(b.inner == blocks[0].inner) for b in blocks):
        return BatchDim(d, blocks[0].inner, sum(b.outer for b in blocks))
    return Packed(d, tuple(b.at(d) for b in blocks))


def _reduction(node: fx.Node, arg_batch: list, kind: str) -> Any:
    b = arg_batch[0]
    x = _meta(node.args[0])
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    dims, keepdim = named_arg(node, "dim", None), named_arg(node, "keepdim", False)
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(x.dim()))
    if isinstance(dims, int):
        dims = [dims]
    dims = [_norm_dim(d, x.dim()) for d in dims]
    if b.dim in dims:
        if kind in ("sum", "mean") and ((len(dims) == x.dim() and not keepdim) or _summed_to_a_scalar(node)):
            return Loss(kind)
        raise MixesSamples("it reduces over the batch dim (only the final loss may)")
    if keepdim:
        return b
    return b.at(b.dim - sum(1 for d in dims if d < b.dim))


def _summed_to_a_scalar(node: fx.Node) -> bool:
    """``node``'s value is only summed, averaged, scaled or added to on, through copies,
    views and selections, to scalars: ``l.mean(0).sum()``, ``l.sum(0).mean()``, a
    multi-task loss ``(l.mean(0) * task_weights).sum()``. Reduced over the batch first,
    it is still the loss, a sum (or mean) of each sample's own terms; what it meets on
    the way is judged as what meets any loss (``_scales_the_loss``)."""
    if not node.users:
        return False
    for user in node.users:
        op = (out_of_place(user.target) or user.target) if user.op == "call_function" else None
        if op in _LOSS_VECTORS or op in _COPIES or op in (aten.div.Tensor, aten.div.Scalar):
            along = user.args[0] is node
        else:
            along = op in _LINEAR_IN_THE_LOSS or op in (aten.mul.Tensor, aten.mul.Scalar)
        if not along or (_meta(user).dim() > 0 and not _summed_to_a_scalar(user)):
            return False
    return True


for _op, _kind in [
    (aten.sum.dim_IntList, "sum"), (aten.sum.default, "sum"), (aten.mean.dim, "mean"),
    (aten.mean.default, "mean"), (aten.amax.default, "max"), (aten.amin.default, "min"),
    (aten.var.correction, "var"), (aten.var.dim, "var"), (aten.std.correction, "std"), (aten.std.dim, "std"),
    (aten.logsumexp.default, "logsumexp"), (aten.linalg_vector_norm.default, "norm"),
    (aten.prod.dim_int, "prod"), (aten.argmax.default, "arg"), (aten.argmin.default, "arg"),
    (aten.any.dim, "any"), (aten.all.dim, "all"), (aten.norm.ScalarOpt_dim, "norm"),
    (aten.var_mean.correction, "var"), (aten.std_mean.correction, "std"), (aten.prod.default, "prod"),
    (aten.aminmax.default, "min"), (aten.nansum.default, "sum"),
    (aten.count_nonzero.default, "count"), (aten.count_nonzero.dim_IntList, "count"),
    # over every dim: ``x.max()`` (Nystromformer's initialisation scale over the batch)
    (aten.max.default, "max"), (aten.min.default, "min"), (aten.median.default, "median"),
    (aten.nanmedian.default, "median"), (aten.any.default, "any"), (aten.all.default, "all"),
]:
    PROPAGATION[_op] = (lambda k: lambda node, ab: _reduction(node, ab, k))(_kind)


@_register(aten.max.dim, aten.min.dim, aten.sort.default, aten.sort.stable, aten.topk.default,
           aten.kthvalue.default, aten.mode.default, aten.median.dim, aten.nanmedian.dim,
           aten.cummax.default, aten.cummin.default)
def _values_indices(node, arg_batch):
    """Values and their indices along one dim (``dim`` by the op's schema; ``sort``,
    ``topk`` and the cumulative ones keep it, the others drop it unless ``keepdim``)."""
    b = arg_batch[0]
    if not isinstance(b, BatchDim) or b.dim is None:
        return [b, b]
    x = _meta(node.args[0])
    d = named_arg(node, "dim", -1)
    keep = node.target in (aten.sort.default, aten.sort.stable, aten.topk.default, aten.cummax.default,
                           aten.cummin.default) or bool(named_arg(node, "keepdim", False))
    d = _norm_dim(d, x.dim())
    if d == b.dim and node.target in (aten.sort.default, aten.sort.stable):
        order = _sorted_along_batch(node, b, x)
        descending = bool(named_arg(node, "descending", False))
        return [dataclasses.replace(order, ids=None, keys=not descending), order]
    if d == b.dim:
        raise MixesSamples("it works along the batch dim")
    out = b if keep else b.at(b.dim - (1 if d < b.dim else 0))
    return [out, out]


@_register(aten.argsort.default, aten.argsort.stable)
def _argsort(node, arg_batch):
    """The order that sorts along one dim; along the batch of a 1-D tensor, a mixture
    of experts' dispatch (``Rows``, as ``sort``'s indices)."""
    b = arg_batch[0]
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    x = _meta(node.args[0])
    d = _norm_dim(named_arg(node, "dim", -1), x.dim())
    return b if d != b.dim else _sorted_along_batch(node, b, x)


def _sorted_along_batch(node: fx.Node, b: BatchDim, x: torch.Tensor) -> Rows:
    """The indices of a sort along the batch dim: of a 1-D tensor, a mixture of experts'
    dispatch (the batch's rows sorted by expert, see ``Rows``); refused otherwise."""
    if x.dim() == 1 and _equal_one(b.outer):
        return Rows(0, node, b.inner, ids=b.inner)
    raise MixesSamples(
        "it sorts along the batch dim, so the order it gives each sample's values depends on the "
        "other samples' (a mixture of experts that groups the batch's tokens by expert does this: "
        "route the tokens densely instead, with a one-hot or scatter combine; Hugging Face MoE "
        "models do with experts_implementation=\"batched_mm\" in from_pretrained or their config, "
        "or model.set_experts_implementation(\"batched_mm\"))")


@_register(aten.histc.default, aten.bincount.default)
def _counts(node, arg_batch):
    """How many of the batch's keys fall in each bin: a count over every sample, which
    only a grouped matmul of the same keys sorted may read (``Groups``; counting the
    sorted keys gives the same, see ``_sorted_rows_batch``)."""
    b = arg_batch[0]
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    sort = _sort_of(node.args[0])
    if sort is not None and _counts_each_key(node):
        # The rule reads each row's key from the sorted tensor, in batch order.
        _record_counted_keys(node)
        return Groups(sort, sort.args[0])
    raise MixesSamples("it counts values over the whole batch")


# Ops that rearrange or cast values without adding or dropping any.
_SAME_VALUES = _COPIES | {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                          aten.flatten.using_ints, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
                          aten.squeeze.default, aten.permute.default, aten.transpose.int, aten.t.default}


def _sort_of(keys: fx.Node) -> fx.Node | None:
    """An ascending sort (or argsort) along its only dim of the same values as ``keys``
    (both rearranged or cast from one tensor): its order groups the rows as the counts
    of ``keys`` do, whatever order the counted values were in."""
    root = keys
    while root.op == "call_function" and root.target in _SAME_VALUES and isinstance(root.args[0], fx.Node):
        root = root.args[0]
    pending, seen = [root], set()
    while pending:
        n = pending.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if user.target in _SAME_VALUES and user.args[0] is n:
                pending.append(user)
            elif user.target in (aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable) \
                    and user.args[0] is n and _meta(n).dim() == 1 and not named_arg(user, "descending", False) \
                    and statically_known_true(_meta(n).numel() == _meta(keys).numel()):
                return user
    return None


# mm / bmm / matmul / addmm / baddbmm propagate through their rules in
# fxdp/rules/matmul.py (a parameter may be either operand).


@_register(aten.cdist.default, aten._cdist_forward.default)
def _cdist(node, arg_batch):
    """``torch.cdist(x1 [*, P, M], x2 [*, R, M])``: distances between rows, batched as
    ``x1 @ x2.mT`` (prototype networks: ``cdist(encoder(x), prototypes)``)."""
    from fxdp.rules.matmul import matmul_batch

    a, b = arg_batch[0], arg_batch[1]
    a_ndim, b_ndim = _meta(node.args[0]).dim(), _meta(node.args[1]).dim()
    if isinstance(b, BatchDim) and b.dim is not None and b.dim >= b_ndim - 2:
        b = b.at(2 * b_ndim - 3 - b.dim)  # the last two dims swapped
    return matmul_batch(a, b, a_ndim, b_ndim)


@_register(aten.scaled_dot_product_attention.default)
def _sdpa(node, arg_batch):
    result = None
    for i, bd in enumerate(arg_batch[:4]):
        if not isinstance(bd, BatchDim):
            continue
        t = _meta(node.args[i])
        if bd.dim is None:
            cand = WHOLE
        else:
            pos = bd.dim - t.dim()
            if pos >= -2 and i != 3:
                raise MixesSamples("the batch dim is a sequence or feature dim of attention")
            cand = bd.at(_meta(node).dim() + pos)
        if result is None:
            result = cand
        elif not result.same_as(cand):
            raise MixesSamples("query, key and value have their batch at different dims")
    return result


_LOSS_REDUCTION = {0: None, 1: "mean", 2: "sum"}


def _loss_with_classes(node, arg_batch, reduction_index):
    """cross_entropy / nll_loss: input ``[N, C, *d]``, target ``[N, *d]``."""
    b = arg_batch[0] if isinstance(arg_batch[0], BatchDim) else arg_batch[1]
    if not isinstance(b, BatchDim):
        return None
    args = list(node.args)
    reduction = args[reduction_index] if len(args) > reduction_index else 1
    if b.dim is not None and b.dim == 1 and isinstance(arg_batch[0], BatchDim):
        raise MixesSamples("the batch dim is the class dim")
    if _LOSS_REDUCTION[reduction] is None:
        if b.dim is None:
            return WHOLE
        return b.at(b.dim - 1 if (isinstance(arg_batch[0], BatchDim) and b.dim > 1) else b.dim)
    # A mean with class weights over class indices divides by the weights of the batch's
    # labels, Σ_i w[y_i]; with class probabilities as targets it divides by N as always.
    indices = not _meta(node.args[1]).dtype.is_floating_point
    if len(args) > 2 and args[2] is not None and _LOSS_REDUCTION[reduction] == "mean" and indices:
        raise MixesSamples("class weights make the mean's normaliser depend on other samples' labels; use reduction='sum' and divide by the batch size")
    return Loss(_LOSS_REDUCTION[reduction])


@_register(aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default, aten.nll_loss2d.default)
def _class_loss(node, arg_batch):
    return _loss_with_classes(node, arg_batch, 3)


# Losses of elements, each on its own, and where their ``reduction`` argument is.
_ELEMENTWISE_LOSSES = {
    aten.mse_loss.default: 2, aten.l1_loss.default: 2, aten.smooth_l1_loss.default: 2,
    aten.huber_loss.default: 2, aten.binary_cross_entropy.default: 3,
    aten.binary_cross_entropy_with_logits.default: 4, aten.soft_margin_loss.default: 2,
    aten.kl_div.default: 2,
}


@_register(*_ELEMENTWISE_LOSSES)
def _elementwise_loss(node, arg_batch):
    index = _ELEMENTWISE_LOSSES[node.target]
    reduction = node.args[index] if len(node.args) > index else node.kwargs.get("reduction", 1)
    batched = [b for b in arg_batch[:2] if isinstance(b, BatchDim)]
    if not batched:
        return None
    if _LOSS_REDUCTION[reduction] is None:
        return _pointwise(node, arg_batch)
    return Loss(_LOSS_REDUCTION[reduction])


# Not ``F.multilabel_margin_loss``: torch.compile's gradient of it is wrong in torch 2.13
# (``aot_eager`` against eager autograd), so it stays without propagation (refused);
# outside the model it works.
@_register(aten.multi_margin_loss.default)
def _margin_loss(node, arg_batch):
    """``F.multi_margin_loss``: input ``[N, C]`` (classes along dim 1), target ``[N]``,
    one loss per row; the mean divides by ``N`` (class weights scale each row's own
    terms)."""
    batched = [b for b in arg_batch[:2] if isinstance(b, BatchDim) and b.dim is not None]
    if not batched:
        return None
    if any(b.dim != 0 for b in batched) or _meta(node.args[0]).dim() < 2:
        raise MixesSamples("the batch dim is the class dim")
    reduction = _LOSS_REDUCTION[named_arg(node, "reduction", 1)]
    return batched[0].at(0) if reduction is None else Loss(reduction)


# conv, embedding and the normalisations propagate through their rules (fxdp/rules/).
@_register(aten.pixel_shuffle.default, aten.pixel_unshuffle.default, aten.channel_shuffle.default,
           aten.native_channel_shuffle.default)
def _batch_first_only(node, arg_batch):
    """Ops over ``[N, C, *spatial]`` that mix or weight the channels: samples must be dim 0."""
    result = None
    for b in arg_batch:
        if not isinstance(b, BatchDim):
            continue
        if b.dim not in (0, None):
            raise MixesSamples("it needs the batch at dim 0 ([N, C, ...])")
        if result is None:
            result = b
        elif not result.same_as(b):
            raise MixesSamples("its operands have their batch at different dims")
    return result


@_register(aten.prelu.default)
def _prelu(node, arg_batch):
    """``F.prelu(x, w)``: one slope for every element, or one per channel (dim 1 of
    ``x``); the samples may be any other dim."""
    b = arg_batch[0]
    w = arg_batch[1] if len(arg_batch) > 1 else None
    if isinstance(w, BatchDim) and w.dim is not None:
        raise MixesSamples("its slopes are batched")
    x = _meta(node.args[0])
    if isinstance(b, BatchDim) and b.dim == 1 and x.dim() >= 2 and _meta(node.args[1]).numel() != 1:
        raise MixesSamples("the batch is the channel dim its slopes run along")
    return b


_SPATIAL_OPS = [
    aten.max_pool2d.default, aten.avg_pool2d.default, aten.adaptive_avg_pool2d.default, aten.max_pool1d.default,
    aten.avg_pool1d.default, aten.adaptive_avg_pool1d.default, aten.max_pool3d.default, aten.avg_pool3d.default,
    aten.adaptive_avg_pool3d.default, aten.reflection_pad1d.default, aten.reflection_pad2d.default,
    aten.reflection_pad3d.default, aten.replication_pad1d.default, aten.replication_pad2d.default,
    aten.replication_pad3d.default,
    *[getattr(getattr(aten, name), overload) for name in (
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
        "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
        "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa")
      for overload in ("default", "vec")],
]


def _spatial_dims(target: Any) -> int:
    """How many trailing dims an ``…1d``/``…2d``/``…3d`` op works over."""
    return int(re.search(r"([123])d", str(target)).group(1))


@_register(*_SPATIAL_OPS)
def _per_channel(node, arg_batch):
    """Pools, resizes and edge pads over ``[N, C, *spatial]`` (or ``[C, *spatial]``):
    each ``(n, c)`` slice on its own, so the samples may be along any dim before the
    spatial ones (dim 1 in ``stft``'s ``[1, B, L]`` padding)."""
    return _before_last(node, arg_batch, _spatial_dims(node.target))


@_register(aten.pad.default, aten.constant_pad_nd.default)
def _pad(node, arg_batch):
    """``F.pad``: the last ``len(pad) // 2`` dims are padded, the others untouched; a
    dim listed with ``(0, 0)`` is untouched too (MobileBERT's ``F.pad(h, (0, 0, 0, 1,
    0, 0))`` lists the batch)."""
    pad = list(node.args[1])
    b = arg_batch[0]
    if isinstance(b, BatchDim) and b.dim is not None:
        at = _meta(node.args[0]).dim() - 1 - b.dim  # F.pad's order: the last dim first
        if 2 * at + 1 < len(pad) and bool(pad[2 * at] == 0) and bool(pad[2 * at + 1] == 0):
            return b
    return _before_last(node, arg_batch, len(pad) // 2)


def _before_last(node, arg_batch, k: int):
    b = arg_batch[0]
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    if b.dim >= _meta(node.args[0]).dim() - k:
        raise MixesSamples(f"the batch is one of the {k} last dims it works over")
    return b


@_register(aten.max_unpool2d.default, aten.max_unpool3d.default)
def _max_unpool(node, arg_batch):
    """``max_unpool2d(x, indices, size)``: each ``(n, c)`` slice written back at its own
    indices, which come batched as ``x`` (from the pool) or shared."""
    result = _before_last(node, arg_batch, _spatial_dims(node.target))
    indices = arg_batch[1] if len(arg_batch) > 1 else None
    if isinstance(indices, BatchDim) and not (isinstance(result, BatchDim) and indices.same_as(result)):
        raise MixesSamples("its indices are batched differently from its input")
    return result


@_register(aten.multinomial.default)
def _multinomial(node, arg_batch):
    """``torch.multinomial(probs, n)``: draws from each row of ``[rows, categories]``
    (or from one ``[categories]`` vector) on its own."""
    b = arg_batch[0]
    if isinstance(b, BatchDim) and b.dim is not None and b.dim == _meta(node.args[0]).dim() - 1:
        raise MixesSamples("the batch is the dim of the categories it draws from")
    return b


@_register(aten.stft.default, aten.stft.center, aten.istft.default)
def _short_time_fourier(node, arg_batch):
    """``torch.stft(x [B, L])`` / ``torch.istft(X [B, F, frames])``: row ``b`` is
    transformed alone; the window is shared."""
    b = arg_batch[0]
    if isinstance(b, BatchDim) and b.dim not in (0, None):
        raise MixesSamples("it transforms along the batch: the samples must be dim 0 of a batched signal")
    if any(isinstance(w, BatchDim) and w.dim is not None for w in arg_batch[1:]):
        raise MixesSamples("a window per sample")
    return b


@_register(aten.grid_sampler.default, aten.grid_sampler_2d.default, aten.grid_sampler_3d.default)
def _grid_sample(node, arg_batch):
    """``F.grid_sample(input [N, C, …], grid [N, …, k])``: output ``n`` samples
    ``input[n]`` at ``grid[n]``."""
    return _batch_first_only(node, arg_batch[:2])


@_register(aten.max_pool1d_with_indices.default, aten.max_pool2d_with_indices.default,
           aten.max_pool3d_with_indices.default, aten.adaptive_max_pool1d.default,
           aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)
def _pool_with_indices(node, arg_batch):
    """A max pool and its argmax positions (``return_indices=True``, the adaptive max
    pools): both batched as the input."""
    b = _before_last(node, arg_batch[:1], _spatial_dims(node.target))
    return [b, b]


@_register(aten.fractional_max_pool2d.default, aten.fractional_max_pool3d.default)
def _fractional_max_pool(node, arg_batch):
    """A fractional max pool over ``[N, C, *spatial]`` with its random offsets
    ``[N, C, k]``: each ``(n, c)`` slice with its own offsets. Offsets shared by the
    batch (drawn in the forward, ``nn.FractionalMaxPool2d``) give each sample its row,
    values that hold no other sample's data; batched offsets must sit where the input's
    batch is."""
    b = _before_last(node, arg_batch[:1], _spatial_dims(node.target))
    offsets = arg_batch[3] if len(arg_batch) > 3 else None
    if isinstance(offsets, BatchDim) and offsets.dim is not None:
        if not (isinstance(b, BatchDim) and b.dim == 0 and offsets.dim == 0):
            raise MixesSamples("its random offsets are batched elsewhere than the input's batch dim 0")
    return [b, b]


@_register(aten.slice_scatter.default, aten.select_scatter.default)
def _view_scatter(node, arg_batch):
    """``base`` with ``src`` written into a slice or select of it (the functional form of
    an in-place write into that view): batched as ``base`` and ``src`` agree, never
    along the dim written into."""
    base, src = arg_batch[0], arg_batch[1]
    ndim = _meta(node.args[0]).dim()
    dim = _norm_dim(node.args[2] if len(node.args) > 2 else 0, ndim)
    if isinstance(src, BatchDim) and src.dim is not None and node.target is aten.select_scatter.default:
        src = src.at(src.dim + (src.dim >= dim))  # src lacks the selected dim
    if node.target is aten.slice_scatter.default and isinstance(base, BatchDim) and base.dim == dim \
            and (src is None and _fill_number(node.args[1]) is not None
                 or isinstance(src, BatchDim) and src.dim == dim and src.plain) \
            and _one_row_of_each_sample(base, named_arg(node, "start", 0), named_arg(node, "step", 1)):
        # Row ``start`` of each sample's ``n`` rows written (``a[n - 1::n] = v``), by the
        # samples' own values or one number (a parameter's value there was made
        # per-sample by no rule: a crash, found by a red team).
        return base
    result = base if isinstance(base, BatchDim) else None
    if isinstance(src, BatchDim):
        result = _agreed(result, src)
    if isinstance(result, BatchDim) and result.dim == dim:
        raise MixesSamples("it writes into part of the batch dim")
    return result


@_register(aten.select_backward.default, aten.slice_backward.default)
def _view_backward(node, arg_batch):
    """``select_backward(grad, sizes, dim, index)`` and ``slice_backward(grad, sizes, dim,
    start, end, step)``: zeros of ``sizes`` with ``grad`` written into that select or
    slice, the derivative of a view that ``torch.func.grad`` traces inside a forward
    (forces through ``r[:, 0]``): batched as ``grad``, never along the dim written into."""
    b = arg_batch[0]
    if not (isinstance(b, BatchDim) and b.dim is not None):
        return b
    dim = _norm_dim(node.args[2], len(node.args[1]))
    if node.target is aten.select_backward.default:
        b = b.at(b.dim + (b.dim >= dim))  # grad lacks the selected dim
    elif b.dim == dim and _whole_slice(node):
        return b  # ``x[:, 0]`` traced with a symbolic B slices dim 0 whole: the identity
    if b.dim == dim:
        raise MixesSamples("it writes into part of the batch dim")
    return b


def _whole_slice(node: fx.Node) -> bool:
    """Whether ``slice_backward(grad, sizes, dim, start, end, step)`` writes ``grad`` into
    the whole of ``sizes`` (start 0, step 1, ``grad`` as long as ``sizes`` along ``dim``)."""
    grad, sizes, dim, start, _, step = (_meta(a) for a in node.args[:6])
    dim = _norm_dim(dim, len(sizes))
    return (statically_known_true(start == 0) and statically_known_true(step == 1)
            and statically_known_true(grad.shape[dim] == _meta(sizes[dim])))


@_register(aten.fake_quantize_per_channel_affine.default, aten.fake_quantize_per_channel_affine_cachemask.default)
def _fake_quantize_per_channel(node, arg_batch):
    """Fake quantisation with a scale and zero point per index of ``axis``: each element on
    its own, as the input is batched, where the scales are the model's (shared); scales
    computed from the samples would quantise each sample's entries along ``axis`` by
    another sample's scale."""
    if any(isinstance(b, BatchDim) and b.dim is not None for b in arg_batch[1:3]):
        raise MixesSamples("its per-channel scale or zero point is computed from the samples")
    b = arg_batch[0]
    return [b, b] if node.target is aten.fake_quantize_per_channel_affine_cachemask.default else b


@_register(aten.im2col.default, aten.col2im.default)
def _patches(node, arg_batch):
    """``nn.Unfold`` (``im2col``, ``[N, C, H, W] -> [N, C·k, L]``) and ``nn.Fold``
    (``col2im``, back): each sample's patches, the batch at dim 0 of a batched call."""
    b = arg_batch[0]
    batched_rank = 4 if node.target is aten.im2col.default else 3
    if isinstance(b, BatchDim) and b.dim is not None and _meta(node.args[0]).dim() != batched_rank:
        raise MixesSamples("it needs the batch at dim 0 ([N, C, ...])")
    return _batch_first_only(node, arg_batch[:1])


@_register(aten.repeat_interleave.self_int, aten.repeat_interleave.self_Tensor)
def _repeat_interleave(node, arg_batch):
    """``x.repeat_interleave(r, dim)``: each slice along ``dim`` repeated in place.

    Along the batch dim with one int count ``r``, sample ``b``'s rows stay together
    (rows ``b·inner·r`` to ``(b+1)·inner·r``): a merged batch ``BatchDim(dim,
    inner=inner·r)``, as a per-sample query repeated once per window (timm's GCViT)."""
    b = arg_batch[0]
    if isinstance(arg_batch[1], BatchDim) and arg_batch[1].dim is not None:
        raise MixesSamples("its repeat counts are per-sample data")
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    dim = named_arg(node, "dim", None)
    if dim is None and _meta(node.args[0]).dim() == 1:
        dim = 0  # (a 1-D tensor flattened is itself)
    if dim is None:
        raise MixesSamples("it flattens the batch dim into one dim (no dim given)")
    if _norm_dim(dim, _meta(node.args[0]).dim()) != b.dim:
        return b
    repeats = node.args[1]
    if node.target is aten.repeat_interleave.self_int and isinstance(repeats, (int, torch.SymInt)) \
            and bool(b.outer == 1):
        return BatchDim(b.dim, b.inner * repeats)
    raise MixesSamples("it repeats along the batch dim by counts per row (a tensor of counts)")


@_register(aten.unfold.default)
def _sliding_windows(node, arg_batch):
    """``x.unfold(dim, size, step)``: windows along ``dim`` (a new last dim holds each
    window's elements); the batch stays where it is, unless the windows slide over it."""
    b = arg_batch[0]
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    if _norm_dim(node.args[1], max(1, _meta(node.args[0]).dim())) == b.dim:
        raise MixesSamples("its windows slide along the batch dim")
    return b


# The ``*_copy`` twins of view ops (what functionalisation writes) move the batch as
# their views do.
for _copy, _viewed in [
    (aten.unsqueeze_copy.default, aten.unsqueeze.default), (aten.transpose_copy.int, aten.transpose.int),
    (aten.squeeze_copy.dim, aten.squeeze.dim), (aten.squeeze_copy.dims, aten.squeeze.dims),
    (aten.unbind_copy.int, aten.unbind.int), (aten.unfold_copy.default, aten.unfold.default),
    (aten.narrow_copy.default, aten.narrow.default), (aten.permute_copy.default, aten.permute.default),
    (aten.expand_copy.default, aten.expand.default), (aten.select_copy.int, aten.select.int),
    (aten.slice_copy.Tensor, aten.slice.Tensor), (aten.view_copy.default, aten.view.default),
    (aten.squeeze_copy.default, aten.squeeze.default), (aten.diagonal_copy.default, aten.diagonal.default),
    (aten.split_with_sizes_copy.default, aten.split_with_sizes.default),
]:
    if _viewed in PROPAGATION:
        PROPAGATION[_copy] = PROPAGATION[_viewed]


_RUNNING_STATISTICS = {
    aten.batch_norm.default, aten._native_batch_norm_legit_functional.default,
    aten._native_batch_norm_legit.default,
    aten.native_batch_norm.default, aten._batch_norm_impl_index.default, aten.instance_norm.default,
}


def _records_running_statistics(node: fx.Node) -> str | None:
    """Why a normalisation that writes the batch's statistics into its buffers is
    refused at any batch size (the buffers are data, released without noise)."""
    if node.target not in _RUNNING_STATISTICS or len(node.args) < 6:
        return None
    if not (node.args[5] and isinstance(node.args[3], fx.Node)):  # training / use_input_stats
        return None
    name = "InstanceNorm" if node.target is aten.instance_norm.default else "BatchNorm"
    return (f"{name} with track_running_stats=True in training writes the batch's statistics into "
            "its running buffers, which leak data outside the private gradient; use "
            "track_running_stats=False or call .eval() on it")


@_register(aten.batch_norm.default, aten._native_batch_norm_legit_functional.default,
           aten.native_batch_norm.default, aten._batch_norm_impl_index.default,
           aten._native_batch_norm_legit.default, aten._native_batch_norm_legit.no_stats,
           aten._native_batch_norm_legit_no_training.default)
def _batch_norm(node, arg_batch):
    training = named_arg(node, "training", False)
    if training and isinstance(arg_batch[0], BatchDim) and arg_batch[0].dim is not None:
        without_statistics = (node.target is aten._native_batch_norm_legit.no_stats
                              or (len(node.args) > 3 and node.args[3] is None))
        raise _MixesButKeepsLayout(
            "BatchNorm in training mode normalises over the batch, and so does one without running "
            "statistics (track_running_stats=False) in eval mode: replace it with GroupNorm/LayerNorm"
            if without_statistics else
            "BatchNorm in training mode normalises over the batch (and its running statistics "
            "leak data); replace it with GroupNorm/LayerNorm or call .eval() on it",
            _batch_first_only(node, arg_batch[:1]),
        )
    return _batch_first_only(node, arg_batch[:1])


def arange_dim(node: Any) -> int | None:
    """The dim along which ``node`` is ``arange(n)`` (n its size there), constant along
    every other dim; ``None`` if the graph does not show that structurally.

    Followed back through the ops that build ``arange(B)[:, None, None, None]`` and
    its expansions: unsqueeze, a slice that keeps everything, view/reshape, expand,
    permute and dtype/device copies; none of them written in place, through a view too
    (``idx = torch.arange(B).detach(); idx[1:] = 0``: sample 1 on reads sample 0).
    """
    dim = _arange_dim_built(node)
    return None if dim is None or written_through(node) else dim  # (the walk only where it is one)


def _arange_dim_built(node: Any) -> int | None:
    """``arange_dim`` as the ops that build ``node`` show it, writes aside."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    target, args = node.target, node.args
    if target is aten.arange.default:
        return 0
    if target is aten.arange.start:
        return 0 if args[0] == 0 else None
    if target is aten.arange.start_step:
        return 0 if args[0] == 0 and named_arg(node, "step", 1) == 1 else None
    if target in _COPIES:
        return arange_dim(args[0])
    dim = arange_dim(args[0]) if args else None
    if dim is None:
        return None
    src, out = _meta(args[0]), _meta(node)
    if target is aten.unsqueeze.default:
        d = _norm_dim(args[1], out.dim())
        return dim + 1 if d <= dim else dim
    if target is aten.slice.Tensor:
        # ``x[:, None]`` of a symbolic length keeps a slice of the whole dim.
        return dim if bool(out.numel() == src.numel()) and (len(args) < 5 or args[4] == 1) else None
    if target is aten.permute.default:
        return [_norm_dim(d, src.dim()) for d in args[1]].index(dim)
    if target in (aten.expand.default, aten.broadcast_to.default, aten.expand_as.default):
        at = dim + out.dim() - src.dim()
        return at if bool(out.shape[at] == src.shape[dim]) else None
    if target is aten.repeat.default:  # copies along the other dims (and new ones in front)
        at = dim + out.dim() - src.dim()
        return at if args[1][at] == 1 else None
    if target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        # Only a reshape of the bare vector (every other dim of size 1) keeps it one.
        if not bool(src.numel() == src.shape[dim]):
            return None
        varying = [j for j, size in enumerate(out.shape) if not bool(size == 1)]
        return varying[0] if len(varying) == 1 else None
    return None


def batch_index_dim(node: Any) -> tuple[int, Any] | None:
    """``(dim, k)`` where ``node`` is ``arange(n)`` along ``dim`` with each value ``k``
    times in a row, constant along every other dim: ``arange(n)`` itself (``k = 1``,
    see ``arange_dim``), or flattened from ``[n, k]`` rows of one value
    (``arange(B).unsqueeze(-1).repeat(1, k).view(-1)``, ``.expand(B, k).reshape(-1)``:
    RT-DETR's batch index beside each sample's ``k`` flattened top-k positions),
    ``arange(n).repeat_interleave(k)`` or ``arange(n * k) // k``; ``None`` otherwise."""
    dim = arange_dim(node)
    if dim is not None:
        return dim, 1
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target in _COPIES:
        return batch_index_dim(node.args[0])
    if (node.target in (aten.floor_divide.default, aten.floor_divide.Scalar) or (
            node.target is aten.div.Tensor_mode and named_arg(node, "rounding_mode", None) == "floor")) \
            and arange_dim(node.args[0]) == 0 and _meta(node.args[0]).dim() == 1 and isinstance(node.args[1], int) \
            and node.args[1] > 0:
        return 0, node.args[1]  # ``arange(B * k) // k`` (Big Bird's rows of each sample's blocks)
    if node.target is aten.repeat_interleave.self_int and arange_dim(node.args[0]) == 0 \
            and _meta(node.args[0]).dim() == 1 and named_arg(node, "dim", None) in (None, 0):
        return 0, node.args[1]
    if node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                       aten.flatten.using_ints) and isinstance(node.args[0], fx.Node):
        src, out = _meta(node.args[0]), _meta(node)
        if src.dim() == 2 and out.dim() == 1 and arange_dim(node.args[0]) == 0:
            return 0, src.shape[1]
    return None


@_register(aten.one_hot.default)
def _one_hot(node, arg_batch):
    """``[*ids] -> [*ids, C]``: the dims of the ids keep their place."""
    num_classes = node.args[1] if len(node.args) > 1 else node.kwargs.get("num_classes", -1)
    if isinstance(arg_batch[0], BatchDim) and arg_batch[0].dim is not None and num_classes == -1:
        raise MixesSamples("without num_classes the number of classes is the largest id of the whole batch")
    return arg_batch[0]


@_register(aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce,
           aten.scatter_add.default, aten.scatter_reduce.two, aten.scatter_.src, aten.scatter_.value,
           aten.scatter_add_.default, aten.scatter_reduce_.two)
def _scatter(node, arg_batch):
    """``self.scatter(dim, index, src)`` writes along ``dim`` at each position of the other
    dims (index and src have self's rank): samples stay apart unless ``dim`` is the batch,
    or the samples' rows are merged there and each writes into its own (see
    ``_scattered_into_own_rows``)."""
    own = _scattered_into_own_rows(node, arg_batch, 2, None)
    return own if own is not None else _written_along(node, arg_batch, (0, 2, 3), "scatters")


def _scattered_into_own_rows(node: fx.Node, arg_batch: list, index_at: int, index_dim: int | None) -> BatchDim | None:
    """The batch of a write along ``dim`` (``node.args[1]``) into rows of ``self`` merged
    from the samples' (``zeros(B * S).scatter_reduce(0, arange(B)[:, None] * S + segment,
    values)``, segment pooling over a flattened batch), if each source row may be read as
    writing among its own sample's rows; ``None`` otherwise.

    The index (at ``index_at``, batched along its dim ``index_dim``: ``dim`` for
    ``scatter``'s, ``0`` for ``index_add``'s vector) and the source hold the samples' rows
    in turn along ``dim``; ``self``, batched along ``dim`` or created by the forward
    (``zeros``), holds ``S`` rows per sample, as the output. Where each index lies among
    its own sample's rows samples stay apart; ``own_rows_pass`` checks that at run time
    (see ``_gathered_from_own_rows``)."""
    out = _meta(node)
    dim = _norm_dim(node.args[1], out.dim())
    index = node.args[index_at] if len(node.args) > index_at else None
    ib = arg_batch[index_at] if len(arg_batch) > index_at else None
    if index_dim is None:
        index_dim = dim
    source = arg_batch[index_at + 1] if len(arg_batch) > index_at + 1 else None
    alike = ib is None
    if (alike and isinstance(index, fx.Node) and isinstance(source, BatchDim) and source.dim == dim
            and bool(_meta(index).shape[index_dim] == _meta(node.args[index_at + 1]).shape[dim])):
        # The same positions every call (built from sizes: TAPAS's range of segments offset
        # by arange(B)), one per source row: the source says whose row each one writes.
        ib = source.at(index_dim)
    if not (isinstance(ib, BatchDim) and ib.dim == index_dim and bool(ib.outer == 1)
            and isinstance(index, fx.Node) and isinstance(node.args[0], fx.Node)):
        return None
    for i, b in enumerate(arg_batch):
        if i in (1, index_at) or not isinstance(b, BatchDim):
            continue
        if b.dim != dim or not bool(b.outer == 1) or (i != 0 and not bool(b.inner == ib.inner)):
            return None  # batched along another dim, or rows other than the index's
    samples = _meta(index).shape[index_dim] // ib.inner
    rows = out.shape[dim] // samples
    if statically_known_true(rows * samples != out.shape[dim]):
        return None  # not a whole number of rows per sample (fewer rows than samples: pooled together)
    self_batch = arg_batch[0]
    if isinstance(self_batch, BatchDim) and not bool(self_batch.inner == rows):
        return None
    if self_batch is None and not _created(node.args[0]):
        return None  # a table of the model's (a buffer): every sample writes into the one table
    if bool(rows == 1):
        return None  # one row per sample: only arange(B) keeps samples apart
    _OWN_ROWS[-1].append(OwnRows(node, index, index_dim, node.args[0], dim, alike))
    return BatchDim(dim, rows)


def _created(node: Any) -> bool:
    """Whether ``node`` is a tensor the forward creates from sizes (``zeros(B * S, d)``),
    not a table of the model's that every sample would write into."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in _CREATION


def _written_along(node: fx.Node, arg_batch: list, operands: tuple, verb: str) -> Any:
    """The batch of an op that writes along its dim ``node.args[1]``, from its
    ``operands`` (self's rank, batched or not); the batch dim may not be that dim."""
    out = _meta(node)
    d = _norm_dim(node.args[1], out.dim())
    result = None
    for i in operands:
        b = arg_batch[i] if i < len(arg_batch) else None
        if not isinstance(b, BatchDim):
            continue
        if b.dim is None:
            candidate = WHOLE
        elif b.dim == d:
            raise MixesSamples(f"it {verb} along the batch dim")
        elif not bool(_meta(node.args[i]).shape[b.dim] == out.shape[b.dim]):
            raise MixesSamples("its batched index or source covers only part of the batch dim")
        else:
            candidate = b
        result = _agreed(result, candidate)
    return result


@_register(aten.index_add.default, aten.index_add_.default, aten.index_copy.default, aten.index_copy_.default,
           aten.index_fill.int_Scalar, aten.index_fill.int_Tensor, aten.index_fill_.int_Scalar,
           aten.index_fill_.int_Tensor, aten.index_reduce.default, aten.index_reduce_.default)
def _index_along(node, arg_batch):
    """``self.index_add(dim, index, source)`` (``index_copy``, ``index_reduce``;
    ``index_fill`` with a value) writes along ``dim`` at the positions of a vector
    ``index``: every sample at the same positions, so samples stay apart unless ``dim``
    is the batch dim or the positions come from the samples."""
    index = arg_batch[2] if len(arg_batch) > 2 else None
    own = _scattered_into_own_rows(node, arg_batch, 2, 0) if _meta(node.args[2]).dim() == 1 else None
    if own is not None:
        return own
    if isinstance(index, BatchDim) and index.dim is not None:
        raise MixesSamples("its index vector comes from the batch: the samples' positions are written "
                           "into one tensor")
    return _written_along(node, arg_batch, (0, 3), "writes")


@_register(aten.cosine_similarity.default)
def _cosine_similarity(node, arg_batch):
    """Broadcast ``x1``, ``x2`` (dims align from the right), then reduce over ``dim``."""
    ndim = max(_meta(node.args[0]).dim(), _meta(node.args[1]).dim())
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 1)
    d = _norm_dim(dim, ndim)
    result = None
    for arg, b in zip(node.args[:2], arg_batch[:2]):
        if not isinstance(b, BatchDim):
            continue
        candidate = WHOLE if b.dim is None else b.at(b.dim + ndim - _meta(arg).dim())
        result = _agreed(result, candidate)
    if result is None or result.dim is None:
        return result
    if result.dim == d:
        raise MixesSamples("it reduces over the batch dim")
    return result.at(result.dim - (1 if d < result.dim else 0))


@_register(aten.index.Tensor)
def _index(node, arg_batch):
    """``x[i0, i1, ...]``: the batch dim may be indexed only by ``arange(B)`` (row ``b``
    of the result takes sample ``b``, as in ``h[arange(B), last]`` and transformers'
    ``mask[arange(B)[:, None, None, None], kv]``); batched index tensors must then
    have their batch on the same broadcast dim."""
    b = arg_batch[0]
    indices = node.args[1]
    index_batches = arg_batch[1]
    dims, broadcast = _advanced_index_layout(indices)
    if isinstance(b, BatchDim) and b.dim is not None:
        masked = _masked_selection(b, indices, index_batches)
        if masked is not None:
            return masked
        if b.dim < len(indices) and indices[b.dim] is not None and dims.get(b.dim) == b.dim:
            tensors = [i for i, ix in enumerate(indices) if ix is not None]
            ib = index_batches[b.dim]
            if tensors == [b.dim] and arange_dim(indices[b.dim]) is None and isinstance(ib, BatchDim):
                # ``flat[arange(B)[:, None] * T + pos]``: rows picked by per-sample indices.
                own = _gathered_from_own_rows(node, b, indices[b.dim], ib, b.dim + (ib.dim or 0))
                if own is not None:
                    return own
            return _index_batch_by_arange(node, b, index_batches)
        if b.dim in dims:
            raise MixesSamples("it indexes the batch dim with a tensor (a boolean mask over it and "
                               "other dims)")
        if any(isinstance(ib, BatchDim) for ib in index_batches if ib is not None):
            raise MixesSamples("batched indices into a batched tensor")
        return b.at(_kept_dim(dims, broadcast, b.dim))
    batched = [(ix, ib) for ix, ib in zip(indices, index_batches) if isinstance(ib, BatchDim)]
    if not batched:
        return b
    if any(ib.dim is None for _, ib in batched):
        return WHOLE
    first = min(dims) if _adjacent(dims) else 0
    result = None
    for ix, ib in batched:
        if _meta(ix).dtype in (torch.bool, torch.uint8):
            raise MixesSamples("it selects with a batched boolean mask, which flattens the samples' "
                               "selections into one list whose length depends on the data")
        # The index tensors broadcast together, right-aligned.
        at = ib.at(first + ib.dim + broadcast - _meta(ix).dim())
        if result is not None and not result.same_as(at):
            raise MixesSamples("its batched index tensors broadcast their batch dims against each other")
        result = at
    return result


def _advanced_index_layout(indices: Sequence[Any]) -> tuple[dict[int, int], int]:
    """``(dims, broadcast)`` of ``x[indices]``: each dim of ``x`` an index tensor indexes,
    with that tensor's position in ``indices``, and the rank of the index tensors
    broadcast together (a boolean mask of ``k`` dims indexes ``k`` dims and adds one)."""
    dims, position, broadcast = {}, 0, 0
    for i, ix in enumerate(indices):
        if ix is None:
            position += 1
            continue
        meta = _meta(ix)
        mask = meta.dtype in (torch.bool, torch.uint8)
        for d in range(position, position + (meta.dim() if mask else 1)):
            dims[d] = i
        position += meta.dim() if mask else 1
        broadcast = max(broadcast, 1 if mask else meta.dim())
    return dims, broadcast


def _adjacent(dims: dict[int, int]) -> bool:
    """Indexed dims next to each other keep the broadcast dims in their place; index
    tensors separated by a slice put them in front (as PyTorch and NumPy do)."""
    return not dims or sorted(dims) == list(range(min(dims), max(dims) + 1))


def _kept_dim(dims: dict[int, int], broadcast: int, d: int) -> int:
    """Where ``x[indices]`` puts ``x``'s dim ``d``, which no index tensor indexes."""
    kept = d - sum(1 for i in dims if i < d)  # its place among the dims not indexed
    after_broadcast = not _adjacent(dims) or (dims and min(dims) < d)
    return kept + (broadcast if after_broadcast else 0)


def _masked_selection(b: BatchDim, indices: Sequence[Any], index_batches: Sequence[Any]) -> Masked | None:
    """``h[mask]`` with one boolean mask over ``h``'s leading dims, the batch's among
    them, batched as ``h``: the elements it selects, as a ``Masked`` list."""
    if not (len(indices) >= 1 and isinstance(indices[0], fx.Node) and all(ix is None for ix in indices[1:])):
        return None
    mask, layout = indices[0], index_batches[0]
    return Masked(mask, layout) if (
        _meta(mask).dtype == torch.bool and b.dim < _meta(mask).dim()
        and isinstance(layout, BatchDim) and layout.same_as(b)) else None


_MASKED = ("it works on the elements a boolean mask over the batch dim selected (x[mask]), one list of every "
           "sample's elements whose length depends on the data: only ops that keep the list's rows apart "
           "(elementwise, or along each row's trailing dims), written back by the same mask (out[mask] = "
           "f(x[mask])), keep each element its sample's; compute on the whole "
           "tensor and select with torch.where(mask, f(x), other), or select per sample: x[torch.arange(B), "
           "position] with each sample's position, e.g. the last True of each row")
_MASKED_OUTPUT = (_MASKED + "; returned by the forward, the list leaves its loss outside, where fxdp cannot tell "
                  "each row's sample: compute the loss in the forward, where a sum over the rows "
                  "(loss_reduction='sum') is the sum of the samples' own")
_ROWS_OUTPUT = ("returns rows in an order the whole batch's data decides (a sort, an argsort or a nonzero over "
                "the samples): a loss outside the forward pairs row j with sample j's target, so each sample's "
                "gradient would depend on the others' data. Put the rows back in batch order inside the forward "
                "(rows[order.argsort()] with the sort's own indices, "
                "torch.empty_like(rows).index_copy(0, order, rows), or torch.zeros_like(h).index_add(0, token, "
                "rows) for the rows of h a nonzero found), or compute the loss in the forward")

_PIECE_OUTPUT = ("returns values of one sample taken out of the batch (x[i], x[i:i + 1], with i a number): a loss "
                 "computed from them is the sample's at that position alone, not a sum of every sample's own, "
                 "and changes as samples are added or removed; return the whole batch, or the pieces of every "
                 "sample concatenated in their order (torch.cat([f(x[i:i + 1]) for i in range(B)]))")


def _masked_batch(node: fx.Node, arg_batch: list, kwarg_batch: list, uses_parameter: bool) -> Any:
    """The layout of an op on ``Masked`` lists (see there)."""
    flat = list(_flat(arg_batch)) + list(_flat(kwarg_batch))
    lists = [b for b in flat if isinstance(b, Masked)]
    first = lists[0]
    if not all(_same_computation(m.mask, first.mask) or _same_mask_reshaped(m, first) for m in lists):
        raise MixesSamples("it combines elements selected by different boolean masks over the batch, "
                           "which line up no sample's elements")
    if node.target in (aten.masked_scatter.default, aten.masked_scatter_.default):
        # The rows written back, each over a block of trailing positions its mask entry
        # covers (``out.masked_scatter(mask[..., None].expand_as(out), rows)``).
        base, values = arg_batch[0], arg_batch[2]
        covered = _meta(node.args[1]).shape[_meta(first.mask).dim():]
        if isinstance(values, Masked) and isinstance(base, BatchDim) and base.same_as(first.layout) \
                and _blocks_of(node.args[1], first.mask) and _meta(node).shape == _meta(node.args[1]).shape \
                and tuple(_meta(node.args[2]).shape[1:]) == tuple(covered):
            return base
        raise MixesSamples(_MASKED)
    if node.target in (aten.index_put.default, aten.index_put_.default, aten._unsafe_index_put.default):
        base, indices, values = arg_batch[0], node.args[1], arg_batch[2]
        if isinstance(values, Masked) and len(indices) == 1 and isinstance(base, BatchDim) \
                and base.same_as(first.layout) and _same_computation(indices[0], first.mask) \
                and _meta(node.args[0]).shape[:_meta(first.mask).dim()] == _meta(first.mask).shape:
            return base
        raise MixesSamples(_MASKED)
    viewed = _viewed_per_sample(node, arg_batch, first)
    if viewed is not None:
        return viewed
    if node.target is ROWS_TO_BATCH:  # the list put back in place by its own mask (masked_rows.py)
        if arg_batch[0] is first and _same_computation(node.args[1], first.mask):
            return first.layout
        raise MixesSamples(_MASKED)
    if any(_any_batched(b) and not isinstance(b, Masked) for b in flat):
        paired = None if uses_parameter else _paired_per_sample(node, arg_batch, kwarg_batch, first)
        if paired is None:
            raise MixesSamples(_MASKED)
        return paired
    if node.target is aten.index.Tensor and arg_batch[0] is None and len(node.args[1]) == 1 \
            and isinstance(arg_batch[1][0], Masked):
        # A shared table looked up at each row's index (``table[ids[mask]]``, torchgeo's
        # Panopticon channel embedding): row by row, as a lookup on the batch in place.
        out = first if _meta(node.args[1][0]).dim() == 1 else None
        if out is None:
            raise MixesSamples(_MASKED)
        if uses_parameter:
            _ROWS_IN_PLACE[-1].append((node, {node.args[1][0]: first.mask}))
        return out
    rule = lookup(node.target) if pure_op(node.target) else None
    if uses_parameter and rule is None and not (_is_pointwise(node.target) or node.target in PROPAGATION):
        raise _NoPropagation(_MASKED_PARAMETER)
    outs = _meta(node)
    rank = (outs[0] if isinstance(outs, (list, tuple)) else outs).dim()
    for arg, b in list(zip(node.args, arg_batch)) + list(zip(node.kwargs.values(), kwarg_batch)):
        # A shared operand may broadcast along the elements' trailing dims only (a
        # rule's own operands, a linear's weight, are no broadcast).
        value = _meta(arg) if isinstance(arg, fx.Node) else None
        if b is None and isinstance(value, torch.Tensor) and value.dim() >= rank and (
                rule is None or _is_pointwise(node.target)) and not statically_known_true(value.shape[-rank] == 1):
            raise MixesSamples(_MASKED)
    # Each element (a row along the list's dim 0: a spline's bins, a softmax's logits)
    # is its sample's alone, as a sample of a plain batch is: an op that keeps rows
    # apart keeps them so.
    plain = BatchDim(0)
    as_plain = [_masked_as_plain(b, plain) for b in arg_batch]
    try:
        out = _read_as_plain(node, rule, as_plain)
    except (MixesSamples, GuardOnDataDependentSymNode, ValueError):  # along the list: a flip, a slice of its length
        raise MixesSamples(_MASKED_PARAMETER if uses_parameter else _MASKED) from None
    out = _as_masked(out, first, node)
    if uses_parameter:
        # Run on the rows put back in place, it is a use on the batch (masked_rows.py).
        masks = {a: b.mask for a, b in zip(node.args, arg_batch) if isinstance(a, fx.Node) and isinstance(b, Masked)}
        masks.update((a, b.mask) for a, b in zip(node.kwargs.values(), kwarg_batch)
                     if isinstance(a, fx.Node) and isinstance(b, Masked))
        if len(masks) != sum(isinstance(b, Masked) for b in flat):  # a list inside a list argument
            raise _NoPropagation(_MASKED_PARAMETER)
        if writes_in_place(node.target):  # (the write would land in the rows put back, not in the list)
            raise _NoPropagation(_MASKED_PARAMETER_IN_PLACE)
        _ROWS_IN_PLACE[-1].append((node, masks))
    return out


_MASKED_PARAMETER_IN_PLACE = (
    "it writes in place with a parameter into the elements a boolean mask selected from the whole batch "
    "(x[mask]): fxdp runs a parameter's use on such elements on the whole batch with the elements put back in "
    "place, where an in-place write would not reach the selected elements; compute it out of place "
    "(c = c * s, c = torch.cat([s.expand(n, 1), c[:, 1:]], 1), torch.where)")


_COUNTED = ("it computes with how many elements a boolean mask selected from the whole batch, or a nonzero "
            "found in it (x[mask].shape[0], mask.nonzero().shape[0], mask.sum() as a number): every "
            "sample's share would depend on the other samples' masks; sum each sample's elements and divide "
            "by a fixed number instead, with loss_reduction='sum'")
_TENSORS_OF_COUNTS = {aten.scalar_tensor.default, aten.full.default}
_SIZES = {aten.sym_size.int, aten.sym_numel.default}
_COUNT_AS_SIZE = (
    "it takes how many elements a boolean mask selected from the whole batch, or a nonzero found in it "
    "(x[mask].shape[0], x.masked_select(mask).numel(), mask.nonzero().shape[0]) as a size, an index or an "
    "offset of other values: what each sample's values are would depend on the other samples' masks; use "
    "sizes the data does not decide, or each sample's own count as a tensor (mask.sum(1))")


def _count_as_rows(node: fx.Node, counts: set) -> bool:
    """Whether ``node``, which takes a count of masked elements (see ``_counts_selected``)
    as an argument, only gives the rows of a list their own number: a view of them
    (``rows.view(n, h, d)``: the sizes are forced by the elements, which the layout
    rule places), the list taken back from the batch (``batch_to_rows``), an ``expand``
    that leaves every size the count decides as it was (``rows.expand(n, d)``) or a
    ``slice`` that keeps everything (``rows[:n]``). A count anywhere else
    (``h[:, :n]``, ``h.roll(n, 1)``, ``topk(k=n)``, ``pad`` by it) decides other
    values by the other samples' masks. Ops without a tensor result (Dynamo's asserts
    on the count) only read it."""
    out = _meta(node)
    if not isinstance(out, torch.Tensor) and not (
            isinstance(out, (list, tuple)) and any(isinstance(o, torch.Tensor) for o in out)):
        return True
    if node.target in _RESHAPES or node.target is BATCH_TO_ROWS:
        return True
    if node.target not in (aten.slice.Tensor, aten.expand.default):
        return False
    before = _meta(node.args[0]).shape
    if node.target is aten.slice.Tensor:
        return out.dim() == len(before) and all(statically_known_true(a == b) for a, b in zip(out.shape, before))
    symbols = set().union(*(_meta(c).node.expr.free_symbols for c in node.all_input_nodes
                            if c in counts and isinstance(_meta(c), torch.SymInt)))
    lead = out.dim() - len(before)  # the dims an expand adds in front
    return all(not (isinstance(size, torch.SymInt) and size.node.expr.free_symbols & symbols)
               or (d >= lead and statically_known_true(size == before[d - lead]))
               for d, size in enumerate(out.shape))


def _list_positions(node: fx.Node, counts: set, positions: set, batch: dict) -> bool:
    """Whether ``node`` is ``arange(n)`` over the length ``n`` of a ``Masked`` list (a
    size of it, not a number computed from one), or a view of such that keeps it an
    ``arange`` along one dim (``ar[:, None]``): its values are positions in the list,
    which only an index of that list's own rows may read (``_indexes_its_list``)."""
    if node.target in (aten.arange.default, aten.arange.start, aten.arange.start_step):
        end = named_arg(node, "end", None)
        return isinstance(end, fx.Node) and end in counts and end.target in _SIZES and arange_dim(node) == 0
    return any(a in positions for a in node.all_input_nodes) and node.target not in (
        aten.index.Tensor, operator.getitem) and arange_dim(node) is not None \
        and not _any_batched([batch.get(a) for a in node.all_input_nodes])


def _indexes_its_list(node: fx.Node, positions: set, batch: dict) -> bool:
    """Whether ``node``, reading positions of a list (``_list_positions``), is an index
    of a ``Masked`` list by them along its rows, ``rows[ar[:, None], cols]``: its
    rule then checks that they cover the list's length, each row reading itself."""
    if node.target is not aten.index.Tensor or not isinstance(batch.get(node.args[0]), Masked):
        return not any(a in positions for a in node.all_input_nodes)
    indices = node.args[1]
    return node.args[0] not in positions and bool(indices) and all(
        i == 0 or not (isinstance(ix, fx.Node) and ix in positions) for i, ix in enumerate(indices))


def _counts_selected(node: fx.Node, batch: dict, counts: set) -> bool:
    """Whether ``node`` is the length of a ``Masked`` list (``x[mask].shape[0]``, its
    ``numel()``), or a number or 0-d tensor computed from one: a count over every
    sample's mask, which a shape argument (a view of the list's rows) may take but no
    arithmetic on values may."""
    if node.target in _SIZES:
        b = batch.get(node.args[0]) if isinstance(node.args[0], fx.Node) else None
        if isinstance(b, Rows) and b.column is not None:  # how many rows a nonzero found
            return node.target is aten.sym_numel.default or _norm_dim(node.args[1], _meta(node.args[0]).dim()) == b.dim
        return isinstance(b, Masked) and (node.target is aten.sym_numel.default or node.args[1] == 0)
    if not any(a in counts for a in node.all_input_nodes):
        return False
    # Arithmetic on the count as a number (``n * 2``, ``float(n)``), or the count as a tensor.
    return isinstance(_meta(node), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)) \
        or node.target in _TENSORS_OF_COUNTS


def _blocks_of(mask: Any, rows: fx.Node) -> bool:
    """Whether the boolean ``mask`` is the mask ``rows`` with trailing dims added and
    expanded (``m[..., None].expand(B, T, d)``, or its ``~``), so that it selects a whole
    block of trailing positions for each position ``rows`` selects."""
    if not isinstance(mask, fx.Node) or mask.op != "call_function":
        return False
    if _same_computation(mask, rows):
        return True
    inner = _meta(mask.args[0]) if mask.args and isinstance(mask.args[0], fx.Node) else None
    lead = _meta(rows).dim()  # the dims the mask ``rows`` covers, kept by each view
    if mask.target in (aten.unsqueeze.default, aten.expand.default, aten.view.default, aten.reshape.default) \
            and isinstance(inner, torch.Tensor) and inner.shape[:lead] == _meta(mask).shape[:lead]:
        return _blocks_of(mask.args[0], rows)
    if mask.target is aten.bitwise_not.default and isinstance(rows, fx.Node) \
            and rows.target is aten.bitwise_not.default:
        return _blocks_of(mask.args[0], rows.args[0])
    return False


_MASKED_PARAMETER = (
    "it uses a parameter on the elements a boolean mask selected from the whole batch (x[mask]), in a way "
    "fxdp cannot run on the whole batch with the elements in place (only ops that keep the rows apart, "
    "such as a linear, an embedding lookup, a norm over each row or an elementwise op, can); apply it to "
    "the whole tensor and select with torch.where(mask, f(x), other)")


def _batch_to_rows(node: fx.Node, arg_batch: list) -> Any:
    """``fxdp.batch_to_rows(dense, mask, n)``: ``dense[mask]``, a ``Masked`` list (see
    ``masked_rows.py``)."""
    dense, mask = arg_batch[0], arg_batch[1]
    if isinstance(dense, BatchDim) and isinstance(mask, BatchDim) and dense.same_as(mask):
        return Masked(node.args[1], mask)
    raise MixesSamples(_MASKED)


PROPAGATION[BATCH_TO_ROWS] = _batch_to_rows


def _read_as_plain(node: fx.Node, rule: Any, as_plain: list) -> Any:
    """The layout ``node``'s rule, elementwise propagation or propagation rule gives
    operands read as plain batches (``as_plain``: a ``Masked`` list's rows, a packed
    dim); ``MixesSamples`` where it has none (the caller names why)."""
    if rule is not None:
        return rule.batch_rule(as_plain, [_meta(a) for a in node.args], _meta(node), rule.config(node.args))
    if _is_pointwise(node.target) or node.target in _COPIES:
        return _pointwise(node, as_plain)
    if node.target in PROPAGATION:
        return PROPAGATION[node.target](node, as_plain)
    raise MixesSamples("no propagation")


def _masked_as_plain(b: Any, plain: BatchDim) -> Any:
    if isinstance(b, (list, tuple)):
        return type(b)(_masked_as_plain(x, plain) for x in b)
    return plain if isinstance(b, Masked) else b


def _as_masked(out: Any, selected: Masked, node: fx.Node) -> Any:
    """An op's layout on ``Masked`` lists taken as a plain batch along dim 0, as lists
    again: the rows must stay along dim 0, each on its own."""
    if isinstance(out, (list, tuple)):
        return type(out)(_as_masked(b, selected, node) for b in out)
    if out is None:
        return None
    if isinstance(out, BatchDim) and out.dim == 0 and out.plain:
        return selected
    if isinstance(out, Loss) and out.reduction == "sum":
        # Every element summed (``cross_entropy(logits[mask], y[mask], reduction="sum")``,
        # flair's tagger): the sum over the samples of each sample's own elements' sum.
        return out
    layout = selected.layout
    if isinstance(out, Loss) and (node.target in _MEANS_OF_EVERY_ELEMENT) \
            and isinstance(layout, BatchDim) and isinstance(layout.dim, int) and layout.plain:
        # A mean divides by how many elements every sample's mask selected: the mean of
        # the samples' own means where they select as many (checked at run time).
        _OWN_ROWS[-1].append(SameCounts(node, selected.mask, layout.dim, mean=True))
        return out
    raise MixesSamples(_MASKED)


# Means over every element alike: not a cross entropy, whose mean counts the targets
# that are not ``ignore_index``.
_MEANS_OF_EVERY_ELEMENT = {aten.mean.default, aten.mean.dim, *_ELEMENTWISE_LOSSES}


def _paired_per_sample(node: fx.Node, arg_batch: list, kwarg_batch: list, selected: Masked) -> BatchDim | None:
    """``cos + mask * f(cos[mask == 1])[:, None]`` (pytorch-metric-learning's ArcFace and
    CosFace margins: each sample's target-class cosine selected by a one-hot mask,
    changed, and added back): an elementwise op that broadcasts the list ``[N, ...]``
    against the batch ``[B, ...]`` along both their dims 0 pairs element ``i`` with sample
    ``i``, its own where every sample's mask selects exactly one element (recorded for a
    run-time check, see ``SameCounts``). ``None`` where ``node`` is no such op."""
    layout, out = selected.layout, _meta(node)
    if not (_is_pointwise(node.target) and isinstance(out, torch.Tensor) and out.dim() > 0
            and isinstance(layout, BatchDim) and layout.dim == 0 and layout.plain
            and statically_known_true(out.shape[0] == _meta(selected.mask).shape[0])):
        return None
    batched = False
    for arg, b in list(zip(node.args, arg_batch)) + list(zip(node.kwargs.values(), kwarg_batch)):
        value = _meta(arg) if isinstance(arg, fx.Node) else None
        if not isinstance(value, torch.Tensor):
            if b is not None:
                return None
        elif isinstance(b, Masked) or (isinstance(b, BatchDim) and b.dim == 0 and b.plain):
            if value.dim() != out.dim():  # (the list's dim 0, or the batch's, is not the result's)
                return None
            batched = batched or isinstance(b, BatchDim)
        elif b is not None or (value.dim() == out.dim() and not statically_known_true(value.shape[0] == 1)):
            return None
    if not batched:
        return None
    _OWN_ROWS[-1].append(SameCounts(node, selected.mask, 0, one=True))
    return BatchDim(0)


def _viewed_per_sample(node: fx.Node, arg_batch: list, selected: Masked) -> BatchDim | None:
    """``h[mask].view(B, -1, *rest)`` with the batch leading the mask: the selected rows
    come sample by sample, so the view is batched along dim 0 where every sample's mask
    selects as many rows (recorded for a run-time check, see ``SameCounts``); ``None``
    where ``node`` is no such view."""
    layout = selected.layout
    if not (node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
            and arg_batch[0] is selected and isinstance(layout, BatchDim) and layout.dim == 0
            and bool(layout.inner == 1) and bool(layout.outer == 1)):
        return None
    rows, out = _meta(node.args[0]).shape, _meta(node).shape
    if not (len(out) == len(rows) + 1 and statically_known_true(out[0] == _meta(selected.mask).shape[0])
            and all(statically_known_true(a == b) for a, b in zip(out[2:], rows[1:]))):
        return None
    _OWN_ROWS[-1].append(SameCounts(node, selected.mask, layout.dim))
    return BatchDim(0)


def pure_op(target: Any) -> bool:
    """An ATen op that writes nothing and draws no random numbers: the same arguments
    give the same value."""
    return isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable \
        and torch.Tag.nondeterministic_seeded not in target.tags


def _same_mask_reshaped(a: Masked, b: Masked) -> bool:
    """Whether two masks over the batch hold the same values in the same row-major order,
    one a reshape of the other (``mask`` and ``mask.flatten(1)``: lightly's iBOT loss
    selects its per-token losses with one and their weights with the other), the batch
    leading both: the ``k``-th element either selects is then at the same place of the
    same sample."""
    def unreshaped(mask: Any) -> Any:
        while isinstance(mask, fx.Node) and mask.op == "call_function" \
                and (mask.target in _RESHAPES or mask.target is aten.flatten.using_ints) \
                and statically_known_true(_meta(mask).shape[0] == _meta(mask.args[0]).shape[0]):
            mask = mask.args[0]
        return mask

    return a.layout.dim == 0 and b.layout.dim == 0 and a.layout.plain and b.layout.plain \
        and _same_computation(unreshaped(a.mask), unreshaped(b.mask))


def _same_computation(a: Any, b: Any, depth: int = 6) -> bool:
    """Whether ``a`` and ``b`` are the same node, or compute the same value from the same
    nodes by the same deterministic ops (``~mask`` written twice)."""
    if a is b:
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_computation(x, y, depth) for x, y in zip(a, b))
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return not isinstance(a, fx.Node) and not isinstance(b, fx.Node) and type(a) is type(b) and a == b
    if depth == 0 or a.op != "call_function" or b.op != "call_function" or a.target != b.target \
            or not pure_op(a.target) or a.kwargs.keys() != b.kwargs.keys():
        return False
    return _same_computation(list(a.args), list(b.args), depth - 1) and all(
        _same_computation(a.kwargs[k], b.kwargs[k], depth - 1) for k in a.kwargs)


def _index_batch_by_arange(node: fx.Node, b: BatchDim, index_batches: list) -> BatchDim:
    """The batch dim of ``x[indices]`` (``node``'s first two arguments) where ``indices``
    index ``x``'s batch dim ``b``."""
    data = _meta(node.args[0])
    indices = node.args[1]
    by_batch = indices[b.dim]
    dim, repeats = batch_index_dim(by_batch) or (None, 1)
    # ``arange`` over the whole dim: the identity on its rows, a merged batch dim
    # (``[B·C, …]``, BertForMultipleChoice) included; or each row ``k`` times in a row
    # (``arange(B).unsqueeze(-1).repeat(1, k).view(-1)``): ``k`` rows per sample.
    if dim is None or not bool(_meta(by_batch).shape[dim] == data.shape[b.dim] * repeats) \
            or not (repeats == 1 or b.plain):
        if _meta(by_batch).dtype == torch.bool:
            # ``x[mask]``: the samples' selections end up in one list.
            raise MixesSamples(
                "it selects with a boolean mask over the batch dim, which flattens the samples' "
                "selections into one list whose length depends on the data (select per sample "
                "instead: x[torch.arange(B), position] with each sample's position, e.g. the last "
                "True of each row)")
        raise MixesSamples("it indexes the batch dim with a tensor other than torch.arange(B)")
    # The index tensors broadcast together, right-aligned, into ``broadcast`` dims.
    dims, broadcast = _advanced_index_layout(indices)
    at = dim + broadcast - _meta(by_batch).dim()
    region = b if repeats == 1 else BatchDim(b.dim, repeats)
    for ix, ib in zip(indices, index_batches):
        if ix is None or ix is by_batch or not isinstance(ib, BatchDim) or ib.dim is None:
            continue
        if not ib.at(b.dim).same_as(region) or ib.dim + broadcast - _meta(ix).dim() != at:
            raise MixesSamples("batched indices do not line up with torch.arange(B) on the batch dim")
    return region.at((min(dims) if _adjacent(dims) else 0) + at)


@_register(aten.index_put.default, aten.index_put_.default, aten._unsafe_index_put.default)
def _index_put(node, arg_batch):
    """``x[i0, i1, ...] = v`` (``+=`` with ``accumulate``): each sample may write only into
    its own rows of ``x``. So ``x`` is batched, and its batch dim is indexed by
    ``arange(B)`` (MAE's unshuffle ``out[arange(B)[:, None], ids] = v``), or by a boolean
    mask batched as ``x`` with shared values (``scores[padding] = -inf``), or not indexed;
    ``v`` is batched where ``x[i0, i1, ...]`` has the batch (right-aligned, as ``v``
    broadcasts there) or shared."""
    b, indices, index_batches = arg_batch[0], node.args[1], arg_batch[1]
    values, vb = node.args[2], arg_batch[2]
    batched_indices = [ib for ib in index_batches if isinstance(ib, BatchDim)]
    own = (_written_into_own_rows(node, b, indices, index_batches, vb)
           or _written_one_per_row(node, b, index_batches, vb))
    if own is not None:
        return own
    if not isinstance(b, BatchDim) or b.dim is None:
        if isinstance(vb, BatchDim) or batched_indices:
            raise MixesSamples("it writes batched values, or at batched positions, into a tensor "
                               "shared by all samples")
        return b
    data = _meta(node.args[0])
    indexed = [i for i, ix in enumerate(indices) if ix is not None]
    masks = [i for i in indexed if _meta(indices[i]).dtype in (torch.bool, torch.uint8)]
    # A mask of k dims stands for k index vectors over the dims it covers.
    covered = {i: _meta(indices[i]).dim() if i in masks else 1 for i in indexed}
    index_dims, broadcast = _advanced_index_layout(indices)
    region_dims = data.dim() - len(index_dims) + broadcast
    if masks and len(indexed) > 1:
        raise MixesSamples("it indexes with a boolean mask beside other index tensors")
    if masks and masks[0] <= b.dim < masks[0] + covered[masks[0]]:
        mask_batch = index_batches[masks[0]]
        if not (isinstance(mask_batch, BatchDim) and mask_batch.dim == b.dim - masks[0]
                and mask_batch.at(b.dim).same_as(b)):
            raise MixesSamples("a boolean mask over the batch dim that is not batched as the tensor")
        if isinstance(vb, BatchDim):
            value = _meta(values)
            if masks[0] == 0 and b.dim == 0 and vb.dim == 0 and bool(vb.outer == 1) \
                    and value.dim() == data.dim() - covered[0] + 1 \
                    and all(statically_known_true(v == d) for v, d in zip(value.shape[1:], data.shape[covered[0]:])):
                # Rows of every sample in order, written at the positions its mask selects
                # (Kosmos-2: ``embeds[image_mask] = image_embeds.view(-1, d)``): each sample's
                # own where every sample's mask selects as many as it has rows (checked at run time).
                _OWN_ROWS[-1].append(SameCounts(node, indices[0], 0, values, rows=True))
                return b
            raise MixesSamples("it writes batched values at the positions of a mask over the batch "
                               "dim (the values are one list for the whole batch)")
        return b
    if not indexed:
        region = b
    elif b.dim < len(indices) and indices[b.dim] is not None and index_dims.get(b.dim) == b.dim:
        region = _index_batch_by_arange(node, b, index_batches)
        if not region.same_as(b.at(region.dim)) and isinstance(values, fx.Node) and not isinstance(vb, BatchDim):
            raise MixesSamples("it writes a tensor of values shared by all samples at a batch index repeated for "
                               "each sample's k positions; index each sample's rows with arange(B)[:, None] "
                               "beside its positions [B, k] instead")
    elif b.dim not in index_dims and not batched_indices:
        region = b.at(_kept_dim(index_dims, broadcast, b.dim))
    else:
        raise MixesSamples("it writes at positions given by tensors along the batch dim, or at "
                           "batched positions in front of it")
    if isinstance(vb, BatchDim):
        at = region.dim + _meta(values).dim() - region_dims
        if vb.dim is None or vb.dim != at or not vb.at(region.dim).same_as(region):
            raise MixesSamples("its batched values do not line up with the batch dim of the rows "
                               "they are written into")
    return b


def _written_one_per_row(node: fx.Node, b: Any, index_batches: Sequence[Any], vb: Any) -> BatchDim | None:
    """The batch of ``x[arange(N), j] = v`` (``index_put``) into a shared ``x`` alike along
    its dim of ``N`` rows (a fresh ``zeros``), with ``j`` batched along its one dim of ``N``
    entries (BERT4Rec's multi-hot rows, ``zeros(B * K, L)[arange(B * K), idx.view(-1)] =
    1``): row ``r`` is written at ``j[r]`` alone, so it is the sample's whose ``j[r]`` it
    is, batched as ``j``. ``v`` is batched as ``j`` or alike along those rows. ``None``
    where this is not such a write."""
    indices = node.args[1]
    tensors = [i for i, ix in enumerate(indices) if ix is not None]
    data = _meta(node.args[0])
    rows = [i for i in tensors if arange_dim(indices[i]) == 0 and _meta(indices[i]).dim() == 1
            and statically_known_true(_meta(indices[i]).shape[0] == data.shape[i])]
    # (Index tensors first, so that the written rows lead the values' dims; a fresh
    # target, and values batched or constant: a parameter there is a use fxdp follows
    # on the batched target, as ``zeros(B, C)[arange(B), y] = w`` is read otherwise.)
    if b is not None or len(rows) != 1 or len(tensors) < 2 or tensors != list(range(len(tensors))) \
            or not _created(node.args[0]):
        return None
    d = rows[0]
    layout = index_batches[tensors[0] if tensors[0] != d else tensors[1]]
    if not (isinstance(layout, BatchDim) and layout.dim == 0):
        return None
    for i in tensors:
        if i != d and not (_meta(indices[i]).dim() == 1 and isinstance(index_batches[i], BatchDim)
                           and index_batches[i].same_as(layout)):
            return None
    if _meta(indices[d]).dtype in (torch.bool, torch.uint8) or not _uniform_along(node.args[0], d):
        return None
    values = node.args[2]
    at = _meta(values).dim() - (1 + data.dim() - len(tensors)) if isinstance(values, fx.Node) else -1
    if isinstance(vb, BatchDim):
        if vb.dim != at or not vb.same_as(layout.at(at)):
            return None
    elif isinstance(values, fx.Node) and not (
            values.target in (aten.lift_fresh_copy.default, aten.scalar_tensor.default)
            and statically_known_true(_meta(values).numel() == 1) or _fill_number(values) is not None):
        return None
    return layout.at(d)


def _written_into_own_rows(node: fx.Node, b: Any, indices: Sequence[Any], index_batches: Sequence[Any],
                           vb: Any) -> BatchDim | None:
    """The batch of ``x[i] = v`` (``index_put``, ``+=`` with ``accumulate``) where one index
    tensor ``i``, batched, picks rows of ``x``'s dim ``d`` that merges the samples' rows
    (``x.view(B * T, d)[arange(B)[:, None] * T + pos] = v``), or of a shared ``x`` the
    forward creates with ``S`` rows per sample (``zeros(B * S, d)[arange(B)[:, None] * S +
    seg] += v``), and ``v`` is batched as the rows it is written into: each sample then
    writes into its own rows, if each index lies among them, which ``own_rows_pass``
    checks at run time (see ``_gathered_from_own_rows``). ``None`` where this is not such
    a write."""
    tensors = [i for i, ix in enumerate(indices) if ix is not None]
    if len(tensors) != 1:
        return None
    d = tensors[0]
    index, ib = indices[d], index_batches[d]
    data = _meta(node.args[0])
    if not (isinstance(index, fx.Node) and _meta(index).dtype not in (torch.bool, torch.uint8)
            and isinstance(ib, BatchDim) and isinstance(ib.dim, int) and bool(ib.outer == 1)
            and isinstance(vb, BatchDim) and isinstance(vb.dim, int) and arange_dim(index) is None):
        return None
    if isinstance(b, BatchDim) and b.dim == d:
        region = _gathered_from_own_rows(node, b, index, ib, d + ib.dim)
        layout = b
    elif b is None and _created(node.args[0]):
        samples = _meta(index).shape[ib.dim] // ib.inner
        rows = data.shape[d] // samples
        if bool(rows == 1):
            return None
        region = _gathered_from_own_rows(node, BatchDim(d, rows), index, ib, d + ib.dim)
        layout = BatchDim(d, rows)
    else:
        return None
    if region is None:
        return None
    at = region.dim + _meta(node.args[2]).dim() - (data.dim() - 1 + _meta(index).dim())
    if vb.dim != at or not vb.at(region.dim).same_as(region):
        raise MixesSamples("its batched values do not line up with the batch dim of the rows "
                           "they are written into")
    return layout


_CREATION = {
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default, aten.ones.default,
    aten.full.default, aten.empty.memory_format, aten.randn.default, aten.rand.default,
    aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
    aten.empty_strided.default, aten.new_empty_strided.default,  # (the gradient of a write into a view)
    aten.scalar_tensor.default, aten.eye.default, aten.ones_like.default,
    # Sizes are shared: every sample has the same ``B`` and ``T``.
    aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int, aten.sym_storage_offset.default,
}


# Tensors that hold no data of any sample, only their sizes: built with ``B`` among
# them (timm's ``PositionalEncodingFourier`` starts from ``torch.zeros(B, H, W)``), row
# ``b`` is what sample ``b`` would get alone (the same values, or its own random draw).
_SIZED_BY_ARGUMENT = {
    aten.zeros.default, aten.ones.default, aten.full.default, aten.empty.memory_format,
    aten.randn.default, aten.rand.default, aten.randint.default, aten.randint.low, aten.normal.float_float,
    aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
    aten.empty_strided.default, aten.new_empty_strided.default,
}


_NEW_LIKE = {aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
             aten.new_empty_strided.default}


def _check_batch_rows(node: fx.Node, layout: Any, batch_size: Any) -> None:
    """Raise if an output said to be batched cannot hold every sample: its batch dim's
    size is known to differ from ``outer·B·inner`` (an output shaped by a shared
    operand that covers the first samples only). A safety net under every rule."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    outs = _meta(node)
    for out, b in zip(outs if isinstance(outs, (list, tuple)) else [outs],
                      layout if isinstance(layout, (list, tuple)) else [layout]):
        if not (isinstance(b, BatchDim) and isinstance(b.dim, int) and isinstance(out, torch.Tensor)):
            continue
        if b.dim >= out.dim() or statically_known_true(out.shape[b.dim] != b.outer * batch_size * b.inner):
            raise MixesSamples(f"its output's batch dim has {out.shape[b.dim] if b.dim < out.dim() else 'no'} "
                               f"rows where the batch has {b.outer * batch_size * b.inner}: it drops or "
                               "mixes samples")


def _sized_by_batch(node: fx.Node, batch_size: Any, batched: bool, *, unambiguous: bool = False,
                    at: int | None = None, like: Any = None) -> "BatchDim | None":
    """The batch dim of a tensor built from sizes with ``B`` among them: a
    ``_SIZED_BY_ARGUMENT`` tensor's dim of size ``B``, or a dim of size ``B`` that an
    ``expand`` of shared data no parameter computed broadcasts (diffusers' frame
    positions ``arange(F).repeat(B, 1)``, which canonicalisation writes as an expand),
    or the batch of the tensor a ``FILLED_LIKE`` op (``ones_like(x)``) takes its shape
    from (stable-baselines3's ``ones_like(mean) * log_std.exp()``, ``like``).

    Its values are the same all along such a dim, so whichever of them is read as the
    batch, each sample's slice holds the same values: with several (``zeros(B, F)``
    when ``F == B`` on a static compile), the first is taken, and the analysis that
    follows checks that its layout agrees with the batched data it meets; with
    ``unambiguous``, none is taken, unless ``like``, the batch layout of the tensor a
    ``new_zeros`` is called on, has its batch at one of them
    (``x.new_zeros(B, 1, d)`` with ``d == B``: the batch is where ``x`` has it); ``at``,
    one of them, is taken where given, or none with ``_READ_SHARED`` (see
    ``_choose_sized_dims``).
    """
    if node.target in FILLED_LIKE:  # constants shaped like a batched tensor: batched as it
        return like if batched and isinstance(like, BatchDim) and like.dim is not None else None
    if node.target not in _SIZED_BY_ARGUMENT and not _lifted_constant(node) \
            and (node.target is not aten.expand.default or batched):
        return None
    shape = _meta(node).shape
    if node.target is aten.expand.default:
        source = _meta(node.args[0]).shape
        new = len(shape) - len(source)
        dims = [d for d, size in enumerate(shape)
                if _same_size(size, batch_size) and (d < new or not _same_size(source[d - new], batch_size))]
    else:
        dims = _dims_sized_by_batch(node, batch_size)
    if unambiguous and len(dims) > 1:
        at = like.dim if isinstance(like, BatchDim) and like.plain and node.target in _NEW_LIKE else None
        return BatchDim(at) if at in dims else None
    if at == _READ_SHARED:
        return None
    if at is not None and at in dims:
        return BatchDim(at)
    return BatchDim(dims[0]) if dims else None


_READ_SHARED = "shared"  # ``_sized_by_batch``'s ``at`` that reads the tensor as shared


def _dims_sized_by_batch(node: fx.Node, batch_size: Any) -> list[int]:
    """The dims of size ``B`` of a tensor ``_sized_by_batch`` reads as batched: of a
    constant made in the forward, those its values are alike along (``torch.tensor([row]
    * B)``: Dynamo guards the list's length, so each batch size compiles a graph where
    ``B`` is a number, and the rows' count is the batch's as ``zeros(B, T)``'s is)."""
    shape = _meta(node).shape
    if _lifted_constant(node):
        return [d for d, size in enumerate(shape)
                if _same_size(size, batch_size) and _constant_alike_along(node.args[0], d)]
    return [d for d, size in enumerate(shape) if _same_size(size, batch_size)] if node.target in _SIZED_BY_ARGUMENT \
        else []


def _lifted_constant(node: fx.Node) -> bool:
    """``torch.tensor(values)`` in the forward: a copy of a constant of the graph."""
    return node.op == "call_function" and node.target is aten.lift_fresh_copy.default \
        and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr"


# What may follow the loss: ops linear in it, and copies. The loss stays a sum (or
# mean) of per-sample terms only so: ``loss ** 2``, ``loss.log()``, ``clamp`` or a
# product of two losses would make each sample's term depend on the others'.
_LINEAR_IN_THE_LOSS = {aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Tensor,
                       aten.rsub.Scalar, aten.neg.default, aten.positive.default}


def _scales_the_loss(target: Any, arg_batch: list) -> bool:
    """``target`` applied to the loss keeps it a sum of per-sample terms: added to
    shared values or other losses, multiplied by a shared value, divided by one,
    copied. A value computed from batched data reduced over the batch (another mean,
    ``l.detach().mean()``) is a loss too: dividing by it is refused, as a normaliser
    from other samples' data."""
    op = out_of_place(target) or target
    if any(isinstance(b, BatchDim) for b in _flat(arg_batch)):
        return False
    if op in _LINEAR_IN_THE_LOSS or op in _COPIES or op in _LOSS_VECTORS:
        return True
    losses = [isinstance(b, Loss) for b in arg_batch[:2]]
    if op in (aten.mul.Tensor, aten.mul.Scalar):
        return losses.count(True) == 1
    if op in (aten.div.Tensor, aten.div.Scalar):
        return losses[0] and not any(losses[1:])
    return False


# Ops that gather losses into a vector, take them back out, or add them up (a residual
# quantizer's ``torch.stack(aux_losses)``, summed later): each entry stays a sum of
# per-sample terms.
_LOSS_VECTORS = {aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
                 aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
                 aten.cat.default, aten.stack.default, aten.select.int, aten.slice.Tensor, aten.sum.default,
                 aten.sum.dim_IntList, aten.mean.default, aten.mean.dim}

_FULL_REDUCTIONS = {aten.sum.default: "sum", aten.sum.dim_IntList: "sum", aten.mean.default: "mean",
                    aten.mean.dim: "mean"}


def _mask_normaliser(node: fx.Node, losses: dict[fx.Node, str], placeholder_batch: dict,
                     param_names: dict) -> fx.Node | None:
    """The mask ``m`` when ``node`` is ``(l * m).sum() / m.sum()`` (ViTMAE's loss over its
    masked patches, Hugging Face's ``weighted_average``): a loss divided by the sum
    (or mean, over a mean) of a mask over the whole batch.

    Where every sample's mask sums to the same ``k`` (a fixed masking ratio, no
    padding), that is the mean over the samples of each sample's own ``l_b / k``;
    ``loss_normaliser_pass`` checks it at run time. The numerator is one reduction
    used by nothing else. The mask is data, not a value of the model: no parameter
    and no batched floating-point input is behind it (a statistic of the inputs,
    ``loss / x.abs().mean()``, is refused as before, when the graph compiles); it
    may be built from the batch size (ViTMAE draws it), from integer or boolean
    inputs (labels, an attention mask), or from shared tensors, or be ``ones_like`` of
    anything (Hugging Face's default weights: each sample's count is its number of
    elements); floating-point data may place its values (ViTMAE's mask gathered by the
    ``noise`` passed in)."""
    if (out_of_place(node.target) or node.target) is not aten.div.Tensor or len(node.args) != 2 \
            or not all(isinstance(a, fx.Node) for a in node.args):
        return None
    numerator, denominator = _division_operands(node)
    if numerator not in losses or denominator.op != "call_function" or denominator.target not in _FULL_REDUCTIONS:
        return None
    if not _used_only_on_the_way(numerator, node):
        return None
    if denominator in losses and _FULL_REDUCTIONS[denominator.target] != losses[numerator]:
        return None  # a mean over a sum: each sample's share would depend on B
    mask = denominator.args[0]
    data = [p for p, b in placeholder_batch.items()
            if b is not None and isinstance(_meta(p), torch.Tensor) and _meta(p).is_floating_point()]
    return None if _built_from(mask, [*param_names, *data], values_only=True) else mask


def _division_operands(node: fx.Node) -> tuple[fx.Node, fx.Node]:
    """The numerator and denominator of ``node`` (a division) behind copies, and the
    denominator behind a floor: ``(l * m).sum() / clamp(m.sum(), min=1)`` (Hugging
    Face's ``weighted_average``, whose floor keeps an all-masked batch from dividing by
    zero). Sample b's share of it is ``l_b / max(B·k, c)`` where every sample's mask sums
    to ``k`` (checked at run time): its own count and the batch size decide it, as for
    the mean without a floor."""
    numerator, denominator = (_behind_copies(a) for a in node.args)
    floor = _floor(denominator)
    return numerator, denominator if floor is None else _behind_copies(floor[0])


_FLOORS = {aten.clamp.default, aten.clamp_min.default}


def _floor(node: fx.Node) -> tuple[fx.Node, float] | None:
    """What ``node`` floors and its floor ``c``, where it is ``clamp(x, min=c)`` (or
    ``clamp_min``) with a number ``c`` and no ceiling."""
    if node.op != "call_function" or node.target not in _FLOORS or not isinstance(node.args[0], fx.Node):
        return None
    low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
    high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
    if isinstance(low, (int, float)) and not isinstance(low, bool) and high is None:
        return node.args[0], float(low)
    return None


def _floor_value(node: fx.Node) -> float | None:
    """The ``c`` of ``node`` where it is a floor (``_floor``) of a sum. (A floor of a mean,
    ``clamp(m.mean(), min=c)``, takes the same value on the batch as on each sample, where
    every sample's mask sums alike: nothing to check.)"""
    floor = _floor(node)
    if floor is None or _FULL_REDUCTIONS.get(_behind_copies(floor[0]).target) != "sum":
        return None
    return floor[1]


def _floors_a_divisor(node: fx.Node) -> bool:
    """``node`` floors a value (see ``_floor``) that, through copies, only divides."""
    if _floor(node) is None:
        return False
    while len(node.users) == 1:
        user = next(iter(node.users))
        if user.target in _COPIES:
            node = user
            continue
        return (out_of_place(user.target) or user.target) is aten.div.Tensor and len(user.args) == 2 \
            and user.args[1] is node and user.args[0] is not node
    return False


def _behind_copies(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in _COPIES and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _used_only_on_the_way(node: fx.Node, end: fx.Node) -> bool:
    """``node`` reaches nothing but ``end``, through copies."""
    while node is not end:
        if len(node.users) != 1:
            return False
        node = next(iter(node.users))
        if node is not end and node.target not in _COPIES:
            return False
    return True


def _built_from(node: fx.Node, sources: Sequence[fx.Node], *, values_only: bool = False) -> bool:
    """Whether any of ``sources`` is behind ``node``'s value. With ``values_only``, not
    through the tensor a ``FILLED_LIKE`` op (``ones_like(x)``) takes only its shape from,
    nor through the indices that only place values (``_value_inputs``)."""
    sources, seen, stack = set(sources), set(), [node]
    while stack:
        n = stack.pop()
        if n in sources:
            return True
        if n not in seen and not (values_only and n.target in FILLED_LIKE):
            seen.add(n)
            stack.extend(_value_inputs(n) if values_only else n.all_input_nodes)
    return False


# Arguments that only say where values are read or written (a gather's index): the
# values come from the other arguments. (``take_along_dim`` is a ``gather`` here.)
_POSITION_ARGUMENTS = {
    aten.gather.default: (2,), aten.index_select.default: (2,), aten.index.Tensor: (1,),
    aten.scatter.src: (2,), aten.scatter.value: (2,),
    aten.scatter_add.default: (2,), aten.index_put.default: (1,), aten._unsafe_index_put.default: (1,),
}


def _value_inputs(node: fx.Node) -> list[fx.Node]:
    """The inputs ``node``'s values come from: all but the indices that only place them
    (ViTMAE's ``gather(ones_mask, 1, argsort(argsort(noise)))`` is zeros and ones, wherever
    the noise puts them)."""
    target = (out_of_place(node.target) or node.target) if node.op == "call_function" else None
    positions = _POSITION_ARGUMENTS.get(target, ())
    if not positions:
        return node.all_input_nodes
    found: list[fx.Node] = []
    fx.node.map_arg([a for i, a in enumerate(node.args) if i not in positions] + list(node.kwargs.values()),
                    found.append)
    return found


def _loss_misuse(target: Any, arg_batch: list, out: Any = None) -> str:
    """Why ``target`` (its example value ``out``) may not follow the loss
    (``_scales_the_loss`` said no)."""
    reason = ("a reduction over the batch (the loss, or a statistic of the batch) is used by an op "
              "other than a sum, a scaling by shared values or a copy: each sample's term "
              "would depend on the other samples")
    if isinstance(out, torch.Tensor) and out.dtype == torch.bool:
        reason += ("; a test of the loss that decides a branch (torch.isfinite(loss), loss > limit) makes "
                   "whether and how every sample's gradient counts depend on the others: test it after "
                   "loss.backward(), where it runs after the clipping")
    if (out_of_place(target) or target) in (aten.div.Tensor, aten.div.Scalar) and len(arg_batch) > 1 \
            and isinstance(arg_batch[1], Loss):
        reason += ("; here it divides by one, a normaliser from the whole batch's data "
                   "((l * mask).sum() / mask.sum() is a mean only with a mask built from integer or "
                   "boolean inputs or from the batch size, not from floating-point inputs or the model): "
                   "sum the per-sample terms and divide by a fixed number instead, with loss_reduction='sum'")
    return reason


def _batch_power(node: fx.Node, batch_size: Any, counts: Callable[[], set[int]]) -> tuple[int, bool] | None:
    """How ``node`` scales a loss by the batch size: ``1`` for ``x / (B·k)`` or
    ``x * (1 / (B·k))``, ``-1`` for ``x * (B·k)``, with ``k > 0`` a number of entries per
    sample (``x / B``, ``l.sum() / l.numel()``, ``l.sum() / (B * T)``, ``l.mean() * B``);
    ``0`` for a scaling that does not involve ``B``; ``None`` for a symbolic one that
    involves ``B`` otherwise (``x / (B + 1)``, ``x / B ** 2``). On a static compile ``B·k``
    is a literal, read so only where ``k`` is one of ``counts()`` (a product of some of
    the summed tensor's sizes per sample: a number that happens to be a multiple of
    ``B`` is no sign of it); a symbolic ``B·k`` shows its factor ``B``. With the power,
    whether it was read from a literal (which may be ``B`` or a number equal to it)."""
    op = node.target
    if op not in (aten.div.Tensor, aten.div.Scalar, aten.mul.Tensor, aten.mul.Scalar) or len(node.args) < 2:
        return 0, False
    operands = [_meta(a) if isinstance(a, fx.Node) else a for a in node.args[:2]]
    numbers = [f for f in (operands[1:] if op in (aten.div.Tensor, aten.div.Scalar) else operands)
               if isinstance(f, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(f, bool)]
    if not numbers:
        return 0, False
    factor, divides = _as_number(numbers[0]), op in (aten.div.Tensor, aten.div.Scalar)
    batch_size = _as_number(batch_size)
    if isinstance(factor, (torch.SymInt, torch.SymFloat)):
        if not isinstance(batch_size, torch.SymInt):
            return 0, False
        b = plain_expression(batch_size)
        f = plain_expression(factor)
        if not (f.free_symbols & b.free_symbols):
            return 0, False
        for power, k in ((1 if divides else -1, f / b), (-1 if divides else 1, 1 / (f * b))):
            k = k.simplify()
            if not (k.free_symbols & b.free_symbols) and bool(k.is_positive):
                return power, False
        return None
    if isinstance(batch_size, torch.SymInt) or batch_size <= 0 or factor == 0:
        return 0, False
    for power, k in ((1 if divides else -1, factor / batch_size), (-1 if divides else 1, 1 / (factor * batch_size))):
        if abs(k - round(k)) <= 1e-9 * abs(k) and round(k) in counts():
            return power, True
    return 0, False


def _sums_along_the_batch_size(node: fx.Node, sized_by_batch: Sequence[fx.Node], batch_size: Any) -> bool:
    """Whether ``node``'s value adds up, along a dim of size ``B``, a tensor built from
    sizes with ``B`` among them (``mask.sum() + 1e-10`` of a mask ``zeros(B, T)`` made
    inside the model: a count that grows with the batch)."""
    for n in reached([node], lambda n: n.all_input_nodes):
        if n.op == "call_function" and n.target in (aten.sum.default, aten.sum.dim_IntList) \
                and _built_from(n.args[0], sized_by_batch):
            shape = _meta(n.args[0]).shape
            dims = n.args[1] if n.target is aten.sum.dim_IntList and len(n.args) > 1 and n.args[1] else range(len(shape))
            if any(_same_size(shape[_norm_dim(d, len(shape))], batch_size) for d in dims):
                return True
    return False


_SCALED_BY_A_COUNT = (
    "the loss inside the graph is scaled by a count over a tensor the model makes with the batch's size "
    "(l.sum() / (mask.sum() + 1e-10) of a mask torch.zeros(B, T) filled inside): the count grows with the "
    "batch, so no sample's own loss would give its gradient; divide by mask.sum() itself, or by "
    "mask.sum().clamp(min=1), which fxdp reads as a mean over the samples")


_SCALED_BY_THE_BATCH = (
    "the loss inside the graph is scaled by the batch size so that it is neither a mean over the samples "
    "nor a sum (l.mean() / B, l.sum() * B, l.sum() / B ** 2, l.sum() / (B + 1)): no sample's own loss would "
    "give its gradient; divide a sum by B (or by B times a count per sample) for a mean, or by a fixed number "
    "for a sum")


def _scaled_kind(kind: str, steps: list[tuple[int, bool]]) -> str | None:
    """The kind of a loss reduced as ``kind`` ("sum" or "mean") and then divided by the
    batch size once per ``steps`` power (multiplied where negative; see ``_batch_power``):
    a sum, a mean, a sum divided by ``B`` once ("batchmean", which fits either
    ``loss_reduction``), or ``None``. A literal read as ``B`` where that leaves neither is
    a number equal to it instead (``l.mean() * B * T`` on a static compile with ``T ==
    B``; a constant divisor): the symbolic graph of a later batch size tells them apart."""
    total = int(kind == "mean") + sum(power for power, literal in steps if not literal)
    literals = [power for power, literal in steps if literal]
    if total + sum(literals) in (0, 1):
        total += sum(literals)
    else:
        for power in literals:
            total += power if total + power in (0, 1) else 0
    if total == 0:
        return "sum"
    if total == 1:
        return "batchmean" if kind == "sum" else "mean"
    return None


def _counts_per_sample(node: fx.Node, batch: dict, losses: dict[fx.Node, str], batch_size: int) -> set[int]:
    """The numbers of entries per sample that the sums over the batch behind the loss
    ``node`` may be divided by, with ``B``, to give a mean: the products of any of a
    summed tensor's sizes, its batch dim's counted per sample (``B·T`` rows of ``T``)."""
    counts = {1}
    for r in _reductions_behind(node, batch, losses):
        x, b = _meta(r.args[0]), batch.get(r.args[0])
        if not (isinstance(x, torch.Tensor) and isinstance(b, BatchDim) and isinstance(b.dim, int)):
            continue
        sizes = [_as_number(s) for d, s in enumerate(x.shape) if d != b.dim]
        sizes.append(_as_number(x.shape[b.dim]) // batch_size if batch_size else 0)
        for size in sizes:
            if isinstance(size, int) and size > 0:
                counts |= {c * size for c in counts}
    return counts


def _reductions_behind(node: fx.Node, batch: dict, losses: dict[fx.Node, str]) -> list[fx.Node]:
    """The reductions over the batch (``losses``' nodes) whose sums made the loss ``node``."""
    found, stack, seen = [], list(node.all_input_nodes), set()
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(batch.get(n), Loss):
            continue
        seen.add(n)
        if n in losses:
            found.append(n)
        else:
            stack.extend(n.all_input_nodes)
    return found


def _same_size(size: Any, batch_size: Any) -> bool:
    # A symbol Dynamo specialised (a recompile for a size seen before) is its number.
    size, batch_size = _as_number(size), _as_number(batch_size)
    if isinstance(size, torch.SymInt) or isinstance(batch_size, torch.SymInt):
        return (isinstance(size, torch.SymInt) and isinstance(batch_size, torch.SymInt)
                and size.node.expr == batch_size.node.expr)
    return size == batch_size


def _as_number(size: Any) -> Any:
    number = size.node.maybe_as_int() if isinstance(size, torch.SymInt) else None
    return size if number is None else number


def _is_number(node: fx.Node) -> bool:
    """A size, stride or number of elements (``sym_size`` of a tensor computed from
    parameters), or a Python number read from a tensor (``w.abs().max().item()``): it
    carries no gradient back to them."""
    value = node.meta.get("val")
    return isinstance(value, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(value, bool)


def _arg_batch(value: Any, batch: dict) -> Any:
    if isinstance(value, fx.Node):
        return batch.get(value)
    if isinstance(value, (list, tuple)):
        return [_arg_batch(v, batch) for v in value]
    return None


def _any_batched(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_any_batched(v) for v in value)
    return isinstance(value, (BatchDim, Loss, _Unknown, Piece, Masked, Packed, Rows, Groups, Inverse))


def _any_packed(value: Any) -> bool:
    return any(isinstance(b, Packed) for b in _flat(value))


def _any_piece(value: Any) -> bool:
    return any(isinstance(b, Piece) for b in _flat(value))


def _any_masked(value: Any) -> bool:
    return any(isinstance(b, Masked) for b in _flat(value))


def _any_rows(value: Any) -> bool:
    return any(isinstance(b, Rows) for b in _flat(value))


# Ops whose first argument is sliced by the sizes (or a position) the others give.
_SIZED_BY_SAMPLE = {aten.slice.Tensor, aten.select.int, aten.narrow.default}


_PACKED = ("it reads across batches of different sizes per sample laid end to end (torch.cat([z.reshape(-1), "
           "logp.reshape(-1)]), a solver's tuple state): only elementwise ops on values packed alike, ops along "
           "other dims, and slices of whole pieces (flat[:B * D].view(B, D)) keep each sample's values its own")
_PACKED_OUTPUT = (_PACKED + "; returned by the forward, the pieces leave the loss outside, where fxdp cannot "
                  "tell each element's sample: return the pieces sliced back (flat[:B * D].view(B, D))")


def _packed_batch(node: fx.Node, arg_batch: list, kwarg_batch: list, uses_parameter: bool) -> Any:
    """The layout of an op on ``Packed`` values (see there): a ``cat`` along their dim
    packs more, a slice of whole blocks is a batch again, and any other op must treat
    the dim as it treats a batch dim, keeping it whole."""
    flat = [b for b in list(_flat(arg_batch)) + list(_flat(kwarg_batch)) if _any_batched(b)]
    first = next(b for b in flat if isinstance(b, Packed))
    target = node.target
    if target is aten.cat.default and _joined_along(node) == first.dim:
        return _cat(node, arg_batch)
    if uses_parameter:
        raise _NoPropagation(_PACKED + "; fxdp makes a parameter's uses per-sample on batches: use it on the "
                             "pieces sliced back")
    if not all(isinstance(b, Packed) and len(b.blocks) == len(first.blocks)
               and all(x.at(0).same_as(y.at(0)) for x, y in zip(b.blocks, first.blocks)) for b in flat):
        raise MixesSamples(_PACKED)
    if target in (aten.slice.Tensor, *_PIECES_OF_ALL) and arg_batch[0] is first \
            and _norm_dim(named_arg(node, "dim", 0), _meta(node.args[0]).dim()) == first.dim:
        return _packed_pieces(node, first)
    # Anything else, with every packed value read as a plain batch along its dim, must
    # keep that dim whole and apart.
    as_plain = [_as_plain(b, BatchDim(0)) for b in arg_batch]
    try:
        out = _read_as_plain(node, lookup(target) if pure_op(target) else None, as_plain)
    except (MixesSamples, ValueError):  # along the packed dim: a flip, a view of it by B
        raise MixesSamples(_PACKED) from None
    arg, packed = next((a, b) for a, b in zip(_flat(node.args), _flat(arg_batch)) if isinstance(b, Packed))
    return _as_packed(out, _meta(node), first, _meta(arg).shape[packed.dim])


def _as_packed(out: Any, value: Any, packed: Packed, size: Any) -> Any:
    """An op's layout on packed values read as plain batches, as packed again: the dim
    must have kept its ``size``. A sum or mean of every element is the loss: each
    sample has as many elements, so it is the sum (or the mean) of the samples' own."""
    if isinstance(out, (list, tuple)):
        return type(out)(_as_packed(b, v, packed, size) for b, v in zip(out, value))
    if out is None or isinstance(out, Loss):
        return out
    if isinstance(out, BatchDim) and isinstance(out.dim, int) and out.plain \
            and statically_known_true(value.shape[out.dim] == size):
        return packed.at(out.dim)
    raise MixesSamples(_PACKED)


def _packed_pieces(node: fx.Node, packed: Packed) -> Any:
    """Slices or split pieces of a packed dim: each must be whole blocks, or whole
    ``outer`` blocks of one (see ``_whole_blocks``)."""
    d = packed.dim
    rows = _meta(node.args[0]).shape[d]
    per_sample = sum(b.inner * b.outer for b in packed.blocks)
    batch = rows // per_sample
    starts, start = [], 0
    for b in packed.blocks:
        starts.append(start)
        start = start + b.outer * batch * b.inner
    starts.append(start)
    if node.target is aten.slice.Tensor:
        begin = named_arg(node, "start", None) or 0
        begin = begin.meta.get("val") if isinstance(begin, fx.Node) else begin
        begin = begin + rows if statically_known_true(begin < 0) else begin
        if named_arg(node, "step", 1) != 1:
            raise MixesSamples(_PACKED)
        pieces = [(begin, _meta(node).shape[d])]
    else:
        pieces, begin = [], 0
        for out in _meta(node):
            pieces.append((begin, out.shape[d]))
            begin = begin + out.shape[d]
    layouts = []
    for begin, length in pieces:
        end = begin + length
        first = next((i for i, s in enumerate(starts) if statically_known_true(s == begin)), None)
        last = next((i for i, s in enumerate(starts) if statically_known_true(s == end)), None)
        if first is not None and last is not None and first < last:
            layouts.append(_packed(d, list(packed.blocks[first:last])))
            continue
        within = next((i for i in range(len(packed.blocks)) if statically_known_true(starts[i] <= begin)
                       and statically_known_true(end <= starts[i + 1])), None)
        whole = None if within is None else _whole_blocks(
            packed.blocks[within], starts[within + 1] - starts[within], [(begin - starts[within], length)])
        if whole is None:
            raise MixesSamples(_PACKED)
        layouts.append(whole[0])
    return layouts[0] if node.target is aten.slice.Tensor else layouts


def _piece_batch(node: fx.Node, arg_batch: list, batch_size: Any, uses_parameter: bool, batch: dict) -> Any:
    """The layout of an op on ``Piece``s (see there): the pieces of every sample, each
    computed by the same code, concatenated in order are a batch again; any other op on
    pieces of one sample gives that sample's."""
    if node.target is aten.cat.default:
        joined = _pieces_joined(node, arg_batch[0], batch_size)
        if joined is not None:
            pieces = list(node.args[0])
            slots = len(pieces) // _as_number(batch_size)
            if not all(_alike(pieces[slot::slots], batch) for slot in range(slots)):
                raise MixesSamples(_POSITIONED)
            return joined
        if _every_samples_piece(arg_batch[0], batch_size):
            raise MixesSamples(_RAGGED)
    if node.target in (aten.slice_scatter.default, aten.select_scatter.default):
        if _writes_its_own_row(node, arg_batch):
            return arg_batch[0]
        if arg_batch[0] is None and isinstance(arg_batch[1], Piece):
            raise MixesSamples(PIECE_INTO_SHARED)  # (a write in place into it: see follow_write)
    if node.target in SHAPED_LIKE and not _any_batched(arg_batch[1:]):
        # Only the piece's shape is read: SpeechT5's prenet draws one dropout mask for the
        # batch with ``torch.bernoulli(h[0], p)``.
        out = _meta(node)
        return [None] * len(out) if isinstance(out, (list, tuple)) else None
    flat = list(_flat(arg_batch))
    samples = {b.sample for b in flat if isinstance(b, Piece)}
    if len(samples) > 1 or any(isinstance(b, (BatchDim, Loss)) for b in flat):
        raise MixesSamples("it combines the values of one sample taken out of the batch (x[i], "
                           "x[i:i + 1]) with other samples' (only all samples' pieces concatenated in "
                           "their order are a batch again)")
    if uses_parameter and not isinstance(arg_batch[0], Piece) and node.target in _SIZED_BY_SAMPLE:
        raise _NoPropagation(
            "it slices a parameter by sizes or positions read from one sample's values (a loop "
            "over the samples, torchtune's tile position embedding): fxdp makes parameter uses per-sample on "
            "whole batches, and torch.func.vmap cannot slice by a sample's values either; index the "
            "parameter for the whole batch at once with index tensors computed from every sample's values "
            "and mask what a sample does not use (table[rows, cols] * valid[..., None])")
    if uses_parameter:
        raise _NoPropagation(
            "it uses a parameter on the values of one sample taken out of the batch (x[i], x[i:i + 1]): "
            "fxdp makes parameter uses per-sample on whole batches; a loop over the samples whose results "
            "are stacked in their order, torch.stack([f(x[i]) for i in range(B)]), runs as "
            "torch.func.vmap(f) where f draws no random numbers, writes nothing in place and reads no "
            "other values of the batch; otherwise apply the layer to the whole batch, or map it over the "
            "samples with torch.func.vmap")
    out, piece = _meta(node), Piece(samples.pop())
    return [piece] * len(out) if isinstance(out, (list, tuple)) else piece


_PARTLY_WRITTEN = (
    "it reads a tensor of the batch's shape into which only some samples' rows were written by their own values "
    "(out[i] = f(x[i]) for some i into torch.zeros(B, ...), h[0] = h[0] * 2): the other rows hold what those "
    "samples' code would have replaced had they been at those positions, so each sample's values depend on its "
    "position in the batch (alone, every sample is the first); write every sample's row (a loop over "
    "range(B)), or build the tensor from the samples (torch.stack)")


_RAGGED = (
    "it concatenates every sample's piece taken out of the batch in their order, but the pieces' sizes along the "
    "joined dim differ, or may (lengths read from the data: torch.cat([feat[:length] for feat, length in "
    "zip(features, lengths)]), flair's token scores): a ragged list of every sample's rows, in which fxdp cannot tell where "
    "one sample's rows end; keep the padded batch and mask what each sample does not use "
    "((loss * mask).sum() with mask = arange(T) < lengths[:, None])")


_POSITIONED = (
    "it puts the samples' pieces taken out of the batch (x[i], x[i:i + 1]) back together as a batch, but "
    "computes them with different code at different positions (cat([h[0:1] * 2, h[1:2] * 3]), out[i] = h[i] * "
    "(i + 1)): each sample's values depend on its position in the batch (alone, every sample is the first); "
    "run the same code on every sample")


def _alike(values: list, batch: dict) -> bool:
    """Whether every sample's piece in ``values`` (sample 0's first, each a ``Piece``
    there) is computed by the same code as the first from that sample's own rows of the
    same batched tensors: where the code differs (``cat([h[0:1] * 2, h[1:2] * 3])``,
    ``out[i] = h[i] * (i + 1)``), so do a sample's values at different positions. A
    value may be a write in place into the sample's row (``out[i].copy_(…)``). Where a
    piece ends may differ (``h[i, :lengths[i]]``, each sample's own length from a list
    fixed per batch: a length that depends on the position, ``h[i, :i + 1]``, passes too),
    not where it starts, nor the sizes of a view or a new tensor."""
    first, written = values[0], None
    for other in values[1:]:
        corr, pieces, varied = {}, {}, []
        if not same_code(first, other, corr, pieces, varied, _comparable, through_writes=True, bounds=True) \
                or any(sizes_of is not None for sizes_of, *_ in varied):  # (sizes of new tensors, of views)
            return False
        if not all(isinstance(batch.get(a), Piece) and isinstance(batch.get(b), Piece) for a, b in pieces.items()):
            return False  # rows of a tensor the samples share (a table indexed by position)
        if written is None:  # the copies' code is what computes their values, unless a write in place changes one
            written = {n for node in first.graph.nodes for n in written_chain(node) or () if node not in values}
        if any(a in written or b in written for a, b in corr.items() if a is not b and a not in pieces):
            return False
    return True


def _comparable(node: fx.Node) -> bool:
    target = node.target
    return target is operator.getitem or target in SIZE_ARITHMETIC or target is FUNCTION_APPLY \
        or isinstance(target, torch._ops.OpOverload)


def _sample_row_written(node: fx.Node, arg_batch: list, rows_written: dict, rows_whole: dict, batch: dict,
                        batch_size: Any) -> dict | None:
    """The writes into each row of a batched tensor (built from sizes, or the batch
    itself) that samples' own pieces have been written into once ``node`` has written one
    (``_writes_its_own_row``): ``None`` for any other op. ``rows_written`` holds the
    tensors some of whose rows are still not written, ``rows_whole`` those whose every
    row is."""
    base = node.args[0] if node.args else None
    if node.target not in (aten.slice_scatter.default, aten.select_scatter.default) or not isinstance(
            base, fx.Node) or not (base in rows_written or isinstance(batch.get(base), BatchDim)) \
            or not _writes_its_own_row(node, arg_batch):
        return None
    return _with_row(rows_written, rows_whole, base, arg_batch[1].sample, _written(node.args[1]))


def _with_row(rows_written: dict, rows_whole: dict, base: fx.Node, sample: int, entry: tuple) -> dict:
    """The writes into each row of ``base`` so far, in order, with ``entry`` (see
    ``_written``) added to ``sample``'s."""
    old = rows_written.get(base) or rows_whole.get(base, {})
    return {**old, sample: old.get(sample, ()) + (entry,)}


def _written(value: fx.Node, views: Sequence[fx.Node] = ()) -> tuple:
    """``(value, place)``: what a write into a sample's row computes, however it was
    written (the source of a ``copy_``, else the op run in place; of a
    ``select_scatter``/``slice_scatter`` into the row, ``out[i, :n] = piece`` out of place;
    without the dim of size 1 a ``slice_scatter`` of one row adds), and where in the row
    it goes: the starts and indices of the ``views`` it is written through in place
    (from the row in), then of the scatters."""
    place = [_place(view.target, view.args[1:]) for view in views]
    if value.target is aten.copy_.default:
        value = value.args[1]
    while True:
        if value.target in (aten.select_scatter.default, aten.slice_scatter.default) and isinstance(
                value.args[0], fx.Node) and value.args[0].target in (aten.select.int, aten.slice.Tensor):
            place.append(_place(value.target, value.args[2:]))
            value = value.args[1]
        elif value.target is aten.unsqueeze.default and _meta(value).shape[named_arg(value, "dim", 0)] == 1:
            value = value.args[0]
        else:
            return value, tuple(p for p in place if p is not None)


def _place(target: Any, args: Sequence) -> tuple | None:
    """Where a view (or a scatter through it) of ``args`` (after the tensors) starts:
    ``None`` for a slice from the start (as a slice of the whole dim, or none)."""
    if target in (aten.select.int, aten.select_scatter.default):
        return "select", *args[:2]
    if target in (aten.slice.Tensor, aten.slice_scatter.default):
        dim, start, _, step = (list(args) + [0, None, None, 1][len(args):])[:4]
        return None if start in (None, 0) and step == 1 else ("slice", dim, start, step)
    return "view", target, *(tuple(a) if isinstance(a, list) else a for a in args if not isinstance(a, fx.Node))


def _rows_alike(written: dict, batch: dict) -> bool:
    """Whether every row was written the same number of times, each time into the same
    place in the row and by the same code as row 0's that time (``_alike``)."""
    rows = [written[i] for i in sorted(written)]
    if len({len(r) for r in rows}) > 1:
        return False  # (the last row written once more: ``h[-1] = h[-1].cos()``)
    for k in range(len(rows[0])):
        entries = [r[k] for r in rows]
        if len({place for _, place in entries}) > 1 or not _alike([value for value, _ in entries], batch):
            return False
    return True


def _rows_alike_at(base: fx.Node, rows_whole: dict, memo: dict, batch: dict) -> bool:
    """``_rows_alike`` of ``base``'s writes, each set of writes judged once."""
    written = rows_whole[base]
    if base not in memo or memo[base][0] is not written:
        memo[base] = written, _rows_alike(written, batch)
    return memo[base][1]


def _reads_a_row(node: fx.Node, base: fx.Node, arg_batch: list, batch: dict) -> bool:
    """Whether ``node`` takes one row of ``base`` (``out[i]``, ``out[i:i + 1]``) or
    writes one sample's row into it: the steps of a loop over its rows, where a read of
    the whole of it reads every row's writes at once."""
    if node.target in (aten.slice_scatter.default, aten.select_scatter.default):
        return node.args[0] is base and _writes_its_own_row(node, arg_batch)
    layout = batch.get(base)
    if node.target not in (aten.select.int, aten.slice.Tensor) or node.args[0] is not base \
            or not isinstance(layout, BatchDim) or _norm_dim(named_arg(node, "dim", 0), _meta(base).dim()) != layout.dim:
        return False
    return node.target is aten.select.int or (named_arg(node, "step", 1) == 1
                                            and statically_known_true(_meta(node).shape[layout.dim] == 1))


def _every_row(written: dict, batch_size: Any) -> bool:
    return statically_known_true(len(written) >= _as_number(batch_size))


def _row_written_in_place(node: fx.Node, batch: dict, rows_written: dict, rows_whole: dict,
                          batch_size: Any) -> str | None:
    """Why an in-place write of one sample's values (a ``Piece``) into a batched tensor
    cannot be followed, or ``None``; a write into that sample's row,
    or part of it (``buf[i] = f(h[i])`` into ``zeros_like(h)``, ``out[i, :n] = piece``),
    counts its row as written (``_sample_row_written``)."""
    chain = written_chain(node)
    if not chain or not isinstance(batch.get(node), Piece):
        return None
    base, held = chain[-1], batch.get(chain[-1])
    if not (isinstance(base, fx.Node) and isinstance(held, BatchDim) and isinstance(held.dim, int)):
        return None
    row = chain[-2] if len(chain) > 1 else base  # the view the write goes through first: the sample's row
    size = _meta(base).shape[held.dim]
    if row.target is aten.select.int and held.plain and isinstance(size, int) and isinstance(row.args[2], int) \
            and _norm_dim(row.args[1], _meta(base).dim()) == held.dim and row.args[2] % size == batch[node].sample:
        written = _with_row(rows_written, rows_whole, base, batch[node].sample, _written(node, chain[-3::-1]))
        if _every_row(written, batch_size):
            rows_written.pop(base, None)
            rows_whole[base] = written
        else:
            rows_written[base] = written
        return None
    return ("it writes one sample's values, taken out of the batch (x[i]), in place into part of a tensor of the "
            "batch's shape other than that sample's row: build the tensor from every sample's values "
            "(torch.stack)")


def _read_through_views_after_a_partial_write(gm: fx.GraphModule, rows_written: dict) -> list[fx.Node]:
    """For each tensor some but not all of whose rows were written in place by samples'
    own values, a view of it taken before the first such write and read after it: a row
    taken so (``ps = [h[i] for i in range(B)]; h[0].mul_(2); stack(ps)``) holds the value
    written where it is the written row, so sample 0's row changes only at position 0."""
    found = []
    for base in rows_written:
        if base.target in (aten.select_scatter.default, aten.slice_scatter.default):
            continue  # written out of place: each write a new tensor, its reads followed by ``rows_read``
        first = next((n for n in gm.graph.nodes if n.op == "call_function" and writes_in_place(n.target)
                      and (written_chain(n) or [None])[-1] is base), None)
        stale = None if first is None else views_read_after(base, first, set(written_chain(first)))
        if stale is not None:
            found.append(stale)
    return found


_BATCH_SIZE_AS_A_VALUE = (
    "it computes with the batch size as a number (h * x.shape[0], torch.full(..., B), h / B ** 0.5, "
    "cls.expand(B, d).sum(0), table[:B].sum(0)): "
    "the batched model is then another function than the one each sample alone computes (there B = 1), "
    "so no sample's gradient is its own; keep the batch size out of the model's values (a mean over the "
    "batch belongs to the loss, where loss_reduction handles it; a loss scaled by the number B itself is fine)")

# Ops whose numbers are sizes or positions, whatever their schema calls them: ``arange(B)``
# numbers the samples (followed as positions), ``randperm``/``randint`` draw by them.
_NUMBERS_AS_SIZES = {aten.arange.default, aten.arange.start, aten.arange.start_step, aten.randint.default,
                     aten.randint.low, aten.randperm.default}


_DRAWN_BETWEEN = {aten.randint.default, aten.randint.low, aten.randint.generator, aten.randint.low_generator}


def _batch_size_as_a_value(node: fx.Node, batch_size: Any) -> bool:
    """Whether ``node`` takes a number that involves the symbolic batch size where its
    schema takes a value (a ``Scalar``, a ``float``, a ``Tensor``), not a size, an index
    or a dim: ``mul(h, s0)`` for ``h * x.shape[0]``. Only a graph compiled with the batch
    size symbolic shows it (in a static one ``B`` is a literal like any other)."""
    size = _as_number(batch_size)
    target, out = node.target, _meta(node)
    if isinstance(size, torch.SymInt) and target in _DRAWN_BETWEEN:
        # Its bounds are the values it draws among (``randint(0, B, (B, 1))``: alone,
        # every sample draws 0), its size a size.
        return any(isinstance(bound, fx.Node) and _involves(_meta(bound), size)
                   for bound in (named_arg(node, "low", None), named_arg(node, "high", None)))
    if not isinstance(size, torch.SymInt) or not isinstance(target, torch._ops.OpOverload) \
            or target in _NUMBERS_AS_SIZES or not (isinstance(out, torch.Tensor) or (
                isinstance(out, (list, tuple)) and any(isinstance(o, torch.Tensor) for o in out))):
        return False  # (Dynamo's asserts on sizes have no tensor result)
    schema = target._schema.arguments
    values = list(zip(schema, node.args)) + [(a, node.kwargs[a.name]) for a in schema if a.name in node.kwargs]
    return any(_involves(_meta(a), size) for argument, value in values if not _of_ints(argument.type)
               for a in _flat(value) if isinstance(a, fx.Node))  # (not a size, an index, a dim)


# Ops that mix the values of their first argument along ``dim`` (their schema's, with its
# default; all dims where it names none or none is given); products that contract the
# last dim of theirs; norms over the trailing ``normalized_shape``.
_ALONG_DIMS = {aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim, aten.prod.default,
               aten.prod.dim_int, aten.amax.default, aten.amin.default, aten.logsumexp.default,
               aten.linalg_vector_norm.default, aten.std.correction, aten.var.correction, aten.std_mean.correction,
               aten.var_mean.correction, aten.max.dim, aten.min.dim, aten.max.default, aten.min.default,
               aten.argmax.default, aten.argmin.default, aten.median.default, aten.median.dim,
               aten.nanmedian.default, aten.nanmedian.dim, aten.nansum.default, aten.mode.default,
               aten.kthvalue.default, aten.topk.default, aten.sort.default, aten.sort.stable, aten.argsort.default,
               aten.argsort.stable, aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default,
               aten.cummax.default, aten.cummin.default, aten._softmax.default, aten._log_softmax.default,
               aten.softmax.int, aten.log_softmax.int,
               aten.count_nonzero.default, aten.count_nonzero.dim_IntList, aten.any.dim, aten.all.dim,
               aten.any.default, aten.all.default, aten.any.dims, aten.all.dims,
               # (no dim argument: every dim, which holds for the last two of a determinant)
               aten._safe_softmax.default, aten.norm.ScalarOpt_dim, aten.trace.default, aten.det.default,
               aten.linalg_det.default, aten._linalg_det.default, aten.logdet.default,
               aten._linalg_slogdet.default, aten.linalg_slogdet.default}
_CONTRACTED = {aten.mm.default, aten.bmm.default, aten.matmul.default, aten.addmm.default, aten.mv.default,
               aten.dot.default, aten.linear.default, aten.embedding_bag.default, aten.embedding_bag.padding_idx,
               aten._embedding_bag.default, aten._cdist_forward.default}
_NORMALISED = {aten.layer_norm.default, aten.native_layer_norm.default}


def _mixes_along_the_batch_size(node: fx.Node, arg_batch: list, batch_size: Any) -> bool:
    """Whether ``node`` mixes the values of a tensor the samples share along a dim whose
    size involves the symbolic batch size (``cls.expand(B, d).sum(0)``,
    ``table[:B].sum(0)``, ``torch.ones(B).cumsum(0)``, a softmax over it), or those of a
    batched tensor along such a dim other than its batch dim (``ones(B, B).sum(1)`` read
    batched along dim 0, ``h[:, None].expand(B, B, d).sum(1)``): the result changes with
    the batch, where each sample alone would read one row."""
    size = _as_number(batch_size)
    target = node.target
    if not isinstance(size, torch.SymInt) or target not in _ALONG_DIMS | _CONTRACTED | _NORMALISED:
        return False
    at = 1 if target in (aten.addmm.default, aten.embedding_bag.default, aten.embedding_bag.padding_idx,
                         aten._embedding_bag.default) else 0
    operand, layout = node.args[at], arg_batch[at]
    own_batch = None
    if _any_batched(arg_batch):
        if not (isinstance(layout, BatchDim) and isinstance(layout.dim, int) and layout.plain) \
                or any(_any_batched(b) and not isinstance(b, BatchDim) for b in _flat(arg_batch)):
            return False  # (the batch's other layouts: judged as such)
        own_batch = layout.dim
    value = _meta(operand) if isinstance(operand, fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    if target in _CONTRACTED:
        dims = [value.dim() - 1]
    elif target in _NORMALISED:
        dims = range(value.dim() - len(node.args[1]), value.dim())
    else:
        named = next((a for a in target._schema.arguments if a.name == "dim"), None)
        dims = None if named is None else named_arg(
            node, "dim", named.default_value if named.has_default_value() else None)
        dims = range(value.dim()) if dims in (None, []) else [dims] if isinstance(dims, int) else dims
    return any(_involves(value.shape[d % value.dim()], size) for d in dims if d % value.dim() != own_batch)


def _indexes_by_the_batch_size(node: fx.Node, arg_batch: list, batch_size: Any) -> bool:
    """Whether ``node`` picks positions by a number that involves the symbolic batch size
    along a dim that is no batch dim: ``t[B]``, ``t[:B][-1]`` (row ``B - 1``),
    ``t.narrow(0, B - 1, 1)``, ``h[:, B:]``, ``h.roll(B, 1)``: each sample alone would
    read other positions."""
    size = _as_number(batch_size)
    target = node.target
    if not isinstance(size, torch.SymInt) or target not in (
            aten.select.int, aten.narrow.default, aten.slice.Tensor, aten.roll.default):
        return False
    value, layout = _meta(node.args[0]), arg_batch[0] if arg_batch else None
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    if target is aten.roll.default:
        dims = named_arg(node, "dims", [])
        return not (_any_batched([layout]) and getattr(layout, "dim", None) in [d % value.dim() for d in dims]) \
            and any(_involves(shift.meta.get("val") if isinstance(shift, fx.Node) else shift, size)
                    for shift in node.args[1])
    dim = _norm_dim(named_arg(node, "dim", 0), value.dim())
    if _any_batched([layout]) and getattr(layout, "dim", dim) == dim:
        return False  # (positions of the samples, or of packed blocks: judged as such)
    at = named_arg(node, "index", None) if target is aten.select.int else named_arg(node, "start", None)
    at = at.meta.get("val") if isinstance(at, fx.Node) else at
    if at is None:
        return False
    if isinstance(at, int) and at < 0:
        at = value.shape[dim] + at  # (counted from the end of a dim whose size may involve it)
    # (a position B alone decides: ``u0 // B - 1``, the last of the rows a mask selected per
    # sample, is each sample's own)
    return _involves(at, size) and plain_expression(at).free_symbols <= plain_expression(size).free_symbols


def _involves(number: Any, batch_size: torch.SymInt) -> bool:
    """Whether ``number`` is symbolic in the batch size's symbols."""
    return isinstance(number, (torch.SymInt, torch.SymFloat)) and bool(
        plain_expression(number).free_symbols & plain_expression(batch_size).free_symbols)


def _of_ints(kind: Any) -> bool:
    """Whether a schema's type is ``int`` or ``SymInt``, optional or a list of them."""
    while isinstance(kind, (torch._C.OptionalType, torch._C.ListType)):
        kind = kind.getElementType()
    return isinstance(kind, (torch._C.IntType, torch._C.SymIntType))


def _row_taken(node: fx.Node, layout: Any) -> tuple[fx.Node, int] | None:
    """``(base, row)`` where ``node`` takes one row (``h[i]``, ``h[i:i + 1]``) at a
    position known of a batch ``base`` held as ``layout``, else ``None``."""
    if node.target not in (aten.select.int, aten.slice.Tensor) or not isinstance(node.args[0], fx.Node):
        return None
    base = node.args[0]
    if not (isinstance(layout, BatchDim) and isinstance(layout.dim, int) and layout.plain) \
            or _norm_dim(named_arg(node, "dim", 0), _meta(base).dim()) != layout.dim:
        return None
    size = _meta(base).shape[layout.dim]
    if node.target is aten.select.int:
        row = named_arg(node, "index", 0)
    else:
        row = named_arg(node, "start", None) or 0
        if named_arg(node, "step", 1) != 1 or not statically_known_true(_meta(node).shape[layout.dim] == 1):
            return None
    return (base, row % size) if isinstance(row, int) and isinstance(size, int) else None


def _rows_read_alike(reads: dict, batch_size: Any, batch: dict) -> bool:
    """Whether every row of a batch was read as often, each time after as many of its
    own writes, as every other (``row_reads``), and its writes by then were alike
    (``_rows_alike``: into the same place in the row, by the same code): then each
    sample reads its row as it would alone."""
    size = _as_number(batch_size)
    if not (isinstance(size, int) and sorted(reads) == list(range(size))):
        return False
    counts = [[len(w) for w in reads[row]] for row in range(size)]
    return all(c == counts[0] for c in counts) and _rows_alike({row: reads[row][-1] for row in reads}, batch)


def _first_written(node: fx.Node) -> fx.Node:
    """The tensor a chain of row writes (``select_scatter``/``slice_scatter``) began with."""
    while node.target in (aten.select_scatter.default, aten.slice_scatter.default) and isinstance(
            node.args[0], fx.Node):
        node = node.args[0]
    return node


def _reads_rows_written_so_far(node: fx.Node, arg_batch: list, rows_written: dict) -> bool:
    """Whether ``node``, which reads a tensor only some of whose rows samples have written
    (``_sample_row_written``), writes another sample's row into it, or takes one row
    (``out[i]``: its constant values before ``out[i] = …``, the values written after,
    ``out[i] += g(x[i])`` after ``out[i] = f(x[i])``): the steps of a loop that fills
    every row."""
    base = node.args[0] if node.args else None
    if any(a in rows_written for a in node.all_input_nodes if a is not base):
        return False
    if node.target in (aten.slice_scatter.default, aten.select_scatter.default):
        return _writes_its_own_row(node, arg_batch)
    return _row_taken(node, arg_batch[0] if arg_batch else None) is not None


def _writes_its_own_row(node: fx.Node, arg_batch: list) -> bool:
    """Whether a ``slice_scatter``/``select_scatter`` writes one sample's piece into that
    sample's row of a batch, which stays the batch: ``pad_sequence`` of the samples'
    sequences (``[h[i, :n_i] for i in range(B)]``), a loop that fills a buffer sized by
    the batch row by row (``out[i] = f(x[i])``)."""
    base, src = arg_batch[0], arg_batch[1]
    if not (isinstance(base, BatchDim) and isinstance(base.dim, int) and base.plain and isinstance(src, Piece)
            and not _any_batched(arg_batch[2:])):
        return False
    size = _meta(node.args[0]).shape
    if _norm_dim(named_arg(node, "dim", 0), len(size)) != base.dim:
        return False
    if node.target is aten.select_scatter.default:
        start, end, step = named_arg(node, "index", 0), None, 1
        start = start + size[base.dim] if statically_known_true(start < 0) else start
        end = start + 1
    else:
        start, end, step = (named_arg(node, "start", None) or 0, named_arg(node, "end", None),
                            named_arg(node, "step", 1))
    return statically_known_true(start == src.sample) and end is not None \
        and statically_known_true(end == src.sample + 1) and step == 1


def _any_sorted(value: Any) -> bool:
    return any(isinstance(b, (Rows, Groups, Inverse)) for b in _flat(value))


def _equal_one(size: Any) -> bool:
    return statically_known_true(size == 1)


_SORTED_ELSEWHERE = (
    "it combines rows that a sort of the whole batch ordered (or a nonzero found: a mixture of experts' "
    "dispatch) with values in another order")


def _sorted_rows_batch(node: fx.Node, arg_batch: list, kwarg_batch: list, rule: Any, batch: dict) -> Any:
    """The layout of an op on rows sorted across the batch (``Rows``), their counts by
    key (``Groups``) or the sort's inverse (``Inverse``): a mixture of experts' dispatch
    as Hugging Face's ``grouped_mm`` experts write it::

        keys, order = expert_ids.sort()          # Rows(keys), Rows(ids)
        rows = hidden[order // top_k]            # Rows
        offsets = keys.histc(E, 0, E - 1).cumsum(0)  # Groups
        out = grouped_mm(rows, w, offsets)       # Rows: row r by expert keys[r]
        inv = empty_like(order); inv[order] = arange(S)  # Inverse (or order.argsort())
        out[inv]                                 # BatchDim(0, inner) again

    Anything else that meets the counts or the inverse, or a sorted row with a value in
    another order, mixes samples."""
    target = node.target
    flat = [b for b in _flat(arg_batch + kwarg_batch) if b is not None]
    args = node.args
    if target in _COPIES:
        b = arg_batch[0]
        if isinstance(b, (Groups, Inverse)):
            return b
        if isinstance(b, Rows):
            keep_values = target is not aten.detach.default
            return dataclasses.replace(b, ids=b.ids if keep_values else None, keys=b.keys and keep_values)
    if target in (aten.argsort.default, aten.argsort.stable) and isinstance(arg_batch[0], Rows) \
            and arg_batch[0].ids is not None and statically_known_true(arg_batch[0].ids == arg_batch[0].inner) \
            and arg_batch[0].column is None and _meta(args[0]).dim() == 1:
        return Inverse(arg_batch[0].order, arg_batch[0].inner)  # a permutation's argsort: its inverse
    if target is aten.cumsum.default and isinstance(arg_batch[0], Groups) and not arg_batch[0].cumulative \
            and _norm_dim(args[1], 1) == 0:
        return dataclasses.replace(arg_batch[0], cumulative=True)
    if is_grouped_mm(target):
        rows, offsets = arg_batch[0], (arg_batch[2] if len(arg_batch) > 2 else None)
        if (isinstance(rows, Rows) and rows.dim == 0 and isinstance(offsets, Groups) and offsets.cumulative
                and offsets.order is rows.order and arg_batch[1] is None):
            return dataclasses.replace(rows, ids=None, keys=False)
        raise MixesSamples(
            "a grouped matmul groups rows of the whole batch: fxdp follows it only on rows a sort of "
            "the batch's keys ordered, with the offsets counted from those sorted keys")
    if any(isinstance(b, Groups) for b in flat):
        raise MixesSamples("it reads how many rows of the whole batch each key has, which depends on "
                           "every sample; only a grouped matmul of the sorted rows may")
    if target in (aten.histc.default, aten.bincount.default) and isinstance(arg_batch[0], Rows) \
            and arg_batch[0].keys and _counts_each_key(node):
        b = arg_batch[0]
        _record_counted_keys(node)
        return Groups(b.order, args[0])
    if target is aten.index.Tensor and len(args[1]) == 1 and args[1][0] is not None:
        data, ids = arg_batch[0], arg_batch[1][0]
        if isinstance(ids, Inverse) and isinstance(data, Rows) and data.dim == 0 and data.order is ids.order:
            return BatchDim(0, ids.inner)  # the sorted rows put back
    if target is aten.index.Tensor:
        rows = _rows_indexed(args[0], args[1], arg_batch[0], arg_batch[1])
        if rows is not None:
            return rows
    if target is aten.index_select.default:
        d = _norm_dim(args[1], _meta(args[0]).dim())
        rows = _rows_indexed(args[0], [None] * d + [args[2]], arg_batch[0], [None] * d + [arg_batch[2]])
        if rows is not None:
            return rows
    found = _found_columns(node, arg_batch[0])
    if found is not None:
        return found
    if any(isinstance(b, Inverse) for b in flat):
        raise MixesSamples("it reads the position of each row among the rows of the whole batch sorted, "
                           "which depends on every sample")
    if target in (aten.index_put.default, aten.index_put_.default, aten._unsafe_index_put.default) \
            and len(args[1]) == 1:
        ids, values = arg_batch[1][0], arg_batch[2]
        if isinstance(ids, Rows) and ids.ids is not None and statically_known_true(ids.ids == ids.inner) \
                and ids.column is None and _is_arange(args[2], _meta(args[1][0]).shape[0]) \
                and not (len(args) > 3 and args[3]):
            return Inverse(ids.order, ids.inner)  # inv[order] = arange(S)
        written = _written_back(ids, values, arg_batch[0], args[0])
        if written is not None:
            return written
    if target in (aten.index_add.default, aten.index_copy.default, aten.index_add_.default,
                  aten.index_copy_.default) and _norm_dim(args[1], _meta(args[0]).dim()) == 0:
        written = _written_back(arg_batch[2], arg_batch[3], arg_batch[0], args[0])
        if written is not None:
            return written
    if target in _SCATTERS and isinstance(args[2], fx.Node) and _norm_dim(args[1], _meta(args[0]).dim()) == 0:
        # ``out.scatter_add_(0, ids[:, None].expand(-1, d), rows)``: each row's entries all
        # written into the batch row its id names.
        written = _written_back(_ids_along_rows(args[2], batch), arg_batch[3], arg_batch[0], args[0])
        if written is not None:
            return written
    if target in (aten.floor_divide.default, aten.floor_divide.Scalar) or (
            target is aten.div.Tensor_mode and named_arg(node, "rounding_mode", None) == "floor"):
        b, k = arg_batch[0], args[1]
        if isinstance(b, Rows) and b.ids is not None and isinstance(k, int) and k > 0 \
                and statically_known_true(b.ids % k == 0):
            return dataclasses.replace(b, ids=b.ids // k, keys=False)  # row ids of a coarser batch
    rows = [b for b in flat if isinstance(b, Rows)]
    first = rows[0]
    if target not in _IDS_KEPT and target not in SHAPED_LIKE and target not in _CREATION:  # (those read sizes)
        ids = [_row_ids(a, batch) for a in node.all_input_nodes]
        if any(i is not None for i in ids):
            if target in (aten.remainder.Scalar, aten.remainder.Tensor) and isinstance(args[1], int) \
                    and args[1] > 0 and ids[0] is not None and statically_known_true(ids[0] % args[1] == 0):
                return dataclasses.replace(arg_batch[0], ids=None, keys=False)  # each row's place in its own
            raise MixesSamples(
                "it computes with the position of each row in the whole batch (a sort's indices, the batch "
                "column of a nonzero): a sample alone has its rows at other positions; use such positions only "
                "to index batched tensors and to put the rows back")
    if any(not first.same_order(b) for b in rows) or any(not isinstance(b, Rows) for b in flat):
        raise MixesSamples(_SORTED_ELSEWHERE)
    if _is_pointwise(target):
        _check_shared_along_rows(node, arg_batch, first.dim)
    # Each sorted row is on its own, as a sample of a plain batch would be.
    plain = BatchDim(first.dim)
    as_plain = [_as_plain(b, plain) for b in arg_batch]
    if rule is not None:
        out = rule.batch_rule(as_plain, [_meta(a) for a in args], _meta(node), rule.config(args))
    elif target in PROPAGATION:
        out = PROPAGATION[target](node, as_plain)
    elif _is_pointwise(target):
        out = _pointwise(node, as_plain)
    else:
        raise _NoPropagation(_no_propagation(target))
    return _as_rows(out, first)


def _no_propagation(target: Any) -> str:
    """Why an op without a rule or a propagation is refused, and what to do."""
    if isinstance(target, torch._ops.HigherOrderOperator):
        return (f"no batch-dim propagation for {op_name(target)}, a higher-order op (control flow: while_loop, "
                "scan, cond, map) whose body fxdp does not look into, nor can fxdp.register_rule describe; "
                "write a loop as a Python loop over a fixed count, which Dynamo unrolls into the graph, and a "
                "branch on a value as torch.where of both branches")
    return (f"no batch-dim propagation for {op_name(target)}: fxdp cannot tell whether it keeps samples "
            "independent; register a rule for it with fxdp.register_rule")


# Ops that rearrange, cast or copy the row ids of a ``Rows`` (a sort's indices, a
# nonzero's batch column) without computing anything from them.
_IDS_KEPT = _SAME_VALUES | {aten.expand.default, aten.expand_as.default, aten.broadcast_to.default,
                            aten.repeat.default, aten.slice.Tensor, aten.select.int}


def _row_ids(node: fx.Node, batch: dict) -> Any:
    """The ``ids`` of the ``Rows`` whose row ids ``node`` holds, through ``_IDS_KEPT``
    ops (``order[:, None].expand(-1, d)``), or ``None``."""
    while isinstance(batch.get(node), Rows):
        if batch[node].ids is not None:
            return batch[node].ids
        if not (node.op == "call_function" and node.target in _IDS_KEPT and isinstance(node.args[0], fx.Node)):
            return None
        node = node.args[0]
    return None


# Writes of a source's entries at the positions an index tensor of its shape names.
_SCATTERS = {aten.scatter.src, aten.scatter_.src, aten.scatter_add.default, aten.scatter_add_.default,
             aten.scatter_reduce.two, aten.scatter_reduce_.two}


def _ids_along_rows(index: fx.Node, batch: dict) -> Rows | None:
    """The row ids a scatter's ``index`` holds in every entry of each row: a 1-D tensor
    of ids (``Rows`` with ``ids``) with trailing dims added and expanded or repeated
    (``ids[:, None].expand(-1, d)``, ``ids.view(-1, 1).repeat(1, d)``), else ``None``."""
    node, layout = index, batch.get(index)
    while isinstance(layout, Rows) and layout.ids is None and node.op == "call_function" and node.args:
        source = node.args[0]
        if not isinstance(source, fx.Node) or _meta(source).dim() < 1:
            return None
        before, after = _meta(source).shape, _meta(node).shape
        keeps_rows = statically_known_true(before[0] == after[0])
        copies_each_row = (
            (node.target is aten.unsqueeze.default and _norm_dim(node.args[1], len(after)) >= 1)
            or (node.target is aten.expand.default and keeps_rows and len(after) == len(before))
            or (node.target is aten.repeat.default and len(node.args[1]) == len(before) and node.args[1][0] == 1)
            or (node.target in _RESHAPES and keeps_rows and statically_known_true(math.prod(before[1:]) == 1)))
        if not copies_each_row:
            return None
        node, layout = source, batch.get(source)
    return layout if isinstance(layout, Rows) and layout.ids is not None and _meta(node).dim() == 1 else None


def _rows_indexed(source: fx.Node, indices: Sequence[Any], data: Any, index_batches: Sequence[Any]) -> Rows | None:
    """``h[ids]`` (``h[None, ids]``, ``w[ids, slot]``): the batch dim of ``h`` indexed by
    row ids of such a batch (``Rows`` with ``ids``), any other dim by values of the same
    rows, one per row: each row reads its own sample's row of ``h``, the rows in the
    order of the ids. The keys a sort sorted, taken in its order (``keys[keys.argsort()]``),
    are its sorted keys, which a count may read (``Groups``)."""
    if not (isinstance(data, BatchDim) and isinstance(data.dim, int) and _equal_one(data.outer)
            and data.dim < len(indices) and isinstance(indices[data.dim], fx.Node)):
        return None
    ids = index_batches[data.dim]
    if not (isinstance(ids, Rows) and ids.ids is not None and statically_known_true(data.inner == ids.ids)):
        return None
    tensors = [i for i, ix in enumerate(indices) if ix is not None]
    if any(not (isinstance(index_batches[i], Rows) and index_batches[i].same_order(ids)
                and _meta(indices[i]).dim() == 1 and not _meta(indices[i]).dtype.is_floating_point
                and _meta(indices[i]).dtype not in (torch.bool, torch.uint8)) for i in tensors):
        return None
    adjacent = tensors == list(range(tensors[0], tensors[-1] + 1))
    keys = (len(tensors) == 1 and ids.column is None and statically_known_true(ids.ids == ids.inner)
            and _meta(source).dim() == 1 and _sort_of(source) is ids.order)
    return dataclasses.replace(ids, dim=tensors[0] if adjacent else 0, ids=None, keys=keys)


def _found_columns(node: fx.Node, b: Any) -> Any:
    """The columns of a ``nonzero`` of a batched tensor (``unbind(1)``, ``select(1, c)``,
    the one column of a 1-D tensor's squeezed or viewed): the one that holds the batch
    dim's positions gives the rows' ids."""
    if not (isinstance(b, Rows) and b.column is not None and node.args[0] is b.order):
        return None
    found = _meta(b.order)
    columns = found.shape[1]

    def column(c: int) -> Rows:
        return dataclasses.replace(b, ids=b.inner if c == b.column else None, keys=False)

    if node.target is aten.unbind.int and _norm_dim(named_arg(node, "dim", 0), 2) == 1:
        return [column(c) for c in range(columns)]
    if node.target is aten.select.int and _norm_dim(node.args[1], 2) == 1:
        return column(_norm_dim(node.args[2], columns))
    if columns == 1 and _meta(node).dim() == 1 and node.target in _VIEWS_OF_ALL:
        return column(0)
    return None


def rule_layout(b: Any) -> Any:
    """A layout as rules see it (and ``meta["fxdp_batch"]`` holds it): sorted rows reach
    their markers put back in batch order."""
    if isinstance(b, (list, tuple)):
        return type(b)(rule_layout(x) for x in b)
    return b.in_batch_order if isinstance(b, Rows) else b


def _as_plain(b: Any, plain: BatchDim) -> Any:
    if isinstance(b, (list, tuple)):
        return type(b)(_as_plain(x, plain) for x in b)
    return plain.at(b.dim) if isinstance(b, (Rows, Packed)) else b


def _as_rows(out: Any, rows: Rows) -> Any:
    if isinstance(out, (list, tuple)):
        return type(out)(_as_rows(b, rows) for b in out)
    if out is None:
        return None
    if isinstance(out, BatchDim) and isinstance(out.dim, int) and out.plain:
        return dataclasses.replace(rows, dim=out.dim, ids=None, keys=False, major=True)
    if isinstance(out, Loss):
        # Every row summed (or, of all the batch's rows sorted, averaged): the samples'
        # losses together. A mean of the rows a nonzero found divides by their count.
        if rows.found is None or out.reduction == "sum":
            return out
        raise MixesSamples(
            "it averages the rows a nonzero found over the whole batch, dividing by how many every sample "
            "has together: each sample's share would depend on the others'; sum them with "
            "loss_reduction='sum' and divide by a fixed number")
    raise MixesSamples("it groups or reduces rows that a sort of the whole batch ordered (or a nonzero found), "
                       "which belong to different samples")


def _check_shared_along_rows(node: fx.Node, arg_batch: list, dim: int) -> None:
    """A shared operand of an elementwise op on sorted rows must not vary along them:
    which sample's row meets its entry ``r`` depends on every sample's keys."""
    out = _meta(node)
    for a, b in zip(node.args, arg_batch):
        m = _meta(a) if isinstance(a, fx.Node) else None
        if b is not None or not isinstance(m, torch.Tensor):
            continue
        at = dim - (out.dim() - m.dim())
        if 0 <= at < m.dim() and not _equal_one(m.shape[at]):
            raise MixesSamples(
                "it meets a shared value that varies along rows a sort of the whole batch ordered (or a "
                "nonzero found), so which sample's row meets which entry depends on every sample")


def _counts_each_key(node: fx.Node) -> bool:
    """``histc(keys, bins, min, max)`` puts each integer key ``0 … bins - 1`` in its own
    bin (the group of a row is then its key); ``bincount`` always does."""
    if node.target is aten.bincount.default:
        return True
    bins = named_arg(node, "bins", 100)
    low, high = named_arg(node, "min", 0), named_arg(node, "max", 0)
    if not all(isinstance(v, (int, float)) for v in (bins, low, high)) or high <= low or low != 0:
        return False
    return all(min(int((v - low) * bins / (high - low)), bins - 1) == v for v in range(int(bins)))


def _record_counted_keys(node: fx.Node) -> None:
    """Record a ``histc`` that counts each key in its own bin for its run-time check
    (see ``CountedKeys``); a ``bincount`` counts every key it is given (negative ones
    fail)."""
    if node.target is aten.histc.default:
        _OWN_ROWS[-1].append(CountedKeys(node, node.args[0], named_arg(node, "bins", 100), named_arg(node, "max", 0)))


def _is_arange(node: Any, length: Any) -> bool:
    """``node`` is ``arange(length)`` (start 0, step 1)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target is aten.arange.default:
        end = node.args[0]
    elif node.target is aten.arange.start and node.args[0] == 0:
        end = node.args[1]
    elif node.target is aten.arange.start_step and node.args[0] == 0 and named_arg(node, "step", 1) == 1:
        end = node.args[1]
    else:
        return False
    end = _meta(end) if isinstance(end, fx.Node) else end  # a symbolic size's node
    return statically_known_true(end == length)


# Ops that fill a tensor shaped like their argument with a constant (or nothing).
FILLED_LIKE = (aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default)
# Ops that read only their first argument's shape (and dtype): constants, or random
# draws whose probabilities are numbers (``bernoulli(x, p)``; ``bernoulli(x)`` reads x).
SHAPED_LIKE = (*FILLED_LIKE, aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
               aten.randint_like.low_dtype, aten.bernoulli.p)


def _written_back(ids: Any, values: Any, into: Any, destination: Any) -> BatchDim | None:
    """Sorted rows written (or added) at the batch rows their ids name: each lands in
    its own sample's row, a batch with ``ids.ids`` rows per sample. The destination is
    shared, that batch, or a tensor filled with a constant in the sorted rows' shape."""
    if not (isinstance(ids, Rows) and ids.ids is not None and isinstance(values, Rows)
            and values.order is ids.order and values.dim == 0):
        return None
    layout = BatchDim(0, ids.ids)
    filled = isinstance(destination, fx.Node) and destination.op == "call_function" and (
        destination.target in FILLED_LIKE)
    if into is None or filled or (isinstance(into, BatchDim) and into.same_as(layout)):
        return layout
    return None


def _pieces_joined(node: fx.Node, batches: list, batch_size: Any) -> BatchDim | None:
    """``cat`` of ``Piece(0)``, …, ``Piece(B - 1)`` in order, ``k`` pieces of each sample
    in turn (``k`` slots), each slot's pieces of one size along the dim they are
    concatenated along: that dim holds the batch, the slots' rows of a sample together
    (``cat([x[i:i + 1] for i in range(B)])`` is ``x``, ``cat([x[i] for i in range(B)])``
    and ``cat(x.unbind(0))`` are ``x.flatten(0, 1)``; TimesFM's ``stack`` of each
    series' trend and residual, ``[a0, b0, a1, b1, …]``, is ``[B·2, …]``)."""
    if not _every_samples_piece(batches, batch_size):
        return None
    d = _joined_along(node)
    sizes = [_meta(t).shape[d] if _meta(t).dim() > d else 0 for t in node.args[0]]
    slots = len(batches) // _as_number(batch_size)
    if all(statically_known_true(size == sizes[i % slots]) for i, size in enumerate(sizes)) \
            and not any(statically_known_true(size == 0) for size in sizes[:slots]):
        return BatchDim(d, sum(sizes[:slots]))
    return None


def _every_samples_piece(batches: list, batch_size: Any) -> bool:
    """Whether ``batches`` are ``Piece(0)``, …, ``Piece(B - 1)`` in order, ``k`` of each
    sample in turn (as ``_pieces_joined`` reads them, their sizes aside)."""
    # A loop over ``range(x.shape[0])`` made Dynamo specialise ``B`` to its count.
    count = _as_number(batch_size)
    if not batches or not isinstance(count, int) or count <= 0 or len(batches) % count:
        return False
    slots = len(batches) // count
    return all(isinstance(b, Piece) and b.sample == i // slots for i, b in enumerate(batches))


def _flat(value: Any):
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat(v)
    else:
        yield value


def _any_unknown(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_any_unknown(v) for v in value)
    return isinstance(value, _Unknown)


class _Unknown:
    """The batch layout after a refused op: nothing downstream is judged again."""

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN = _Unknown()


def batch_dim_pass(
    gm: fx.GraphModule,
    placeholder_batch: dict[fx.Node, BatchDim | None],
    param_names: dict[fx.Node, str],
    *,
    batch_size: Any,
    function_body: bool = False,
    chunk: bool = False,
    sized_batched: str | None = None,
    stored_outputs: Mapping[int, bool] | None = None,
) -> BatchAnalysis:
    """Propagate batch dims through ``gm`` and collect everything that mixes samples.

    A tensor built from sizes alone, with ``B`` among them (``torch.zeros(B, H, W)``),
    is first taken as shared by all samples; only if that leaves problems is the
    analysis run again with it batched along its dim of size ``B`` (each row is what
    its sample would get alone), and that reading is kept if it has none. Failing that,
    only the tensors with a single dim of size ``B`` (or a ``new_zeros`` of a batched
    tensor's batch dim) are batched: with a static ``B`` equal to the length, a causal
    mask ``full((T, T))`` stays shared while a learned start token's
    ``x.new_zeros(B, 1, d) + start`` is batched. A model that works either way is read
    as before; and with a static ``B`` (the first compile) a feature size equal to ``B``
    is no batch dim unless the model needs it to be. Where every reading finds problems,
    a later reading's are named instead of the first's when they are some of them (the
    others came from reading those tensors as shared).

    Args:
        gm: The canonical ATen graph.
        placeholder_batch: Batch dim of each placeholder (``None`` for shared inputs,
            parameters and buffers).
        param_names: Trainable-parameter placeholders and their names.
        batch_size: ``B``; with ``B == 1`` everything derived from the inputs is one
            sample (``WHOLE``) and nothing can mix samples; ``B == 0`` likewise.
        function_body: ``gm`` is the body of an ``autograd.Function``: its outputs are the
            Function's, which its backward differentiates, so a value that mixes samples
            may not reach them (in a forward, one that carries no gradient may: a
            statistic the forward reports, see ``reaches_no_gradient``).
        chunk: ``gm`` is the body of a loop over chunks of the batch (see
            ``chunk_loops_as_whole_pass``): its batched inputs hold ``batch_size`` rows,
            read as samples even when there is one.
        sized_batched: Only this reading of the tensors built from ``B`` (``"all"``:
            batched along their first dim of size ``B``; ``"unambiguous"``: only those
            with one), not the first that leaves no
            problems.
        stored_outputs: The positions among ``gm``'s outputs of the values the forward
            stores and does not return, each with whether into the model's state (a
            buffer, or a place the forward read an input from: ``fxdp._torch_internals.stored_outputs``).

    Returns:
        The analysis; the graph is not changed (nodes get ``meta["fxdp_batch"]``).
    """
    stored_outputs = stored_outputs or {}
    analysis = _propagate(gm, placeholder_batch, param_names, batch_size, sized_batched=sized_batched or "none",
                          function_body=function_body, chunk=chunk, stored_outputs=stored_outputs)
    if sized_batched is None and (analysis.problems or analysis.sized_normaliser) and analysis.sized_by_batch:
        readings = {}
        for reading in ("all", "unambiguous"):
            readings[reading] = retried = _propagate(gm, placeholder_batch, param_names, batch_size,
                                                     sized_batched=reading, function_body=function_body,
                                                     chunk=chunk, stored_outputs=stored_outputs)
            if not retried.problems or set(retried.problems) < set(analysis.problems) \
                    or _only_read_as_shared(analysis, retried):
                # Refused either way, for some of the same reasons (or for others, found
                # past where the first reading stopped): name only those, not the ones
                # this reading of the same tensors explains away.
                analysis = retried
            if not retried.problems:
                break
        if analysis.problems:
            chosen = _choose_sized_dims(gm, placeholder_batch, param_names, batch_size, readings["all"],
                                        function_body=function_body, chunk=chunk, stored_outputs=stored_outputs)
            analysis = analysis if chosen.problems else chosen
    for node in gm.graph.nodes:
        node.meta["fxdp_batch"] = rule_layout(analysis.batch.get(node))
    return analysis


def _only_read_as_shared(first: BatchAnalysis, retried: BatchAnalysis) -> bool:
    """Whether a reading with the tensors built from ``B`` batched explains away only
    problems of the first reading's sharing them (a shared tensor whose values vary along
    the batch dim) and finds its own only after those, where the first reading stopped
    following the batch. Its problems are then the ones to name: Doge's router, which
    reshapes the batch dim after an attention whose mask has ``B`` rows, not the mask."""
    explained = set(first.problems) - set(retried.problems)
    if not explained or not all(p.reason.endswith(_ALONG_THE_BATCH) for p in explained):
        return False
    stopped = set(first.mixing) - set(retried.mixing)
    found = set(retried.mixing) - set(first.mixing)
    return bool(found) and found <= reached(list(stopped), lambda n: n.users) - stopped


def _choose_sized_dims(gm: fx.GraphModule, placeholder_batch: dict, param_names: dict, batch_size: Any,
                       analysis: BatchAnalysis, **kwargs: Any) -> BatchAnalysis:
    """The first reading without problems of the tensors built from sizes with ``B``
    among them, or ``analysis`` where none is. First those with several dims of size
    ``B``, each batched along one of them (xLSTM's sLSTM at ``B == 4``: its states
    ``zeros(4, B, H)`` and ``zeros(4, S + 1, B, H)`` and gates ``zeros(S + 1, 4, B, H)``
    have the batch second or third, and one read wrongly refuses what the others write
    into it, so they are chosen together); then each one either batched or shared (an
    ODE solver's ``empty(len(t), N)`` for the solution at ``len(t) == B`` is shared,
    filled with the packed state, while the state's ``zeros(B, 1)`` is batched). A
    static compile's coincidence of sizes, so tried only where every other reading is
    refused, and for a few such tensors only."""
    sized = [(node, dims) for node in analysis.sized_by_batch if (dims := _dims_sized_by_batch(node, batch_size))]
    for options in ([(node, dims) for node, dims in sized if len(dims) > 1],
                    [(node, [*dims, _READ_SHARED]) for node, dims in sized]):
        if not options or math.prod(len(dims) for _, dims in options) > 16:
            continue
        for choice in itertools.islice(itertools.product(*(dims for _, dims in options)), 1, None):
            trial = _propagate(gm, placeholder_batch, param_names, batch_size,
                               sized_batched={node: at for (node, _), at in zip(options, choice)}, **kwargs)
            if not trial.problems:
                return trial
    return analysis


def _propagate(gm: fx.GraphModule, placeholder_batch: dict, param_names: dict, batch_size: Any, *,
               sized_batched: str | dict, function_body: bool, chunk: bool = False,
               stored_outputs: Mapping[int, bool]) -> BatchAnalysis:
    """``batch_dim_pass`` with the tensors built from ``B`` shared (``"none"``), batched
    (``"all"``), or batched where a single dim has size ``B`` (``"unambiguous"``), or
    batched along the dims a dict gives (the others as ``"all"`` reads them)."""
    _OWN_ROWS.append([])  # this propagation's (a Function's body is analysed inside another)
    _ROWS_IN_PLACE.append([])
    try:
        analysis = _propagate_rules(gm, placeholder_batch, param_names, batch_size, sized_batched, function_body,
                                    chunk, stored_outputs)
    finally:
        own_rows = _OWN_ROWS.pop()
        in_place = _ROWS_IN_PLACE.pop()
    # Only the checks of values the analysis kept (not of a refused op's).
    analysis.own_rows = [g for g in own_rows if isinstance(analysis.batch.get(g.node), BatchDim) or (
        isinstance(g, SameCounts) and g.mean and isinstance(analysis.batch.get(g.node), Loss)) or (
        isinstance(g, CountedKeys) and isinstance(analysis.batch.get(g.node), Groups))]
    analysis.rows_in_place = [(n, masks) for n, masks in in_place if _any_masked(analysis.batch.get(n))]
    if function_body:  # the rewrite runs on the model's graph only
        analysis.problems += [Problem(op_name(n.target), module_path_of(n), "", _MASKED_PARAMETER, source_of(n))
                              for n, _ in analysis.rows_in_place]
    return analysis


def _propagate_rules(gm: fx.GraphModule, placeholder_batch: dict, param_names: dict, batch_size: Any,
                     sized_batched: str, function_body: bool, chunk: bool,
                     stored_outputs: Mapping[int, bool]) -> BatchAnalysis:
    sized_by_batch: list[fx.Node] = []
    expanded_params: dict[fx.Node, BatchDim] = {}  # read batched: see _classify_parameter_uses
    batch: dict[fx.Node, Any] = {}
    problems: list[Problem] = []
    # Trainable parameters each parameter-only value is computed from (no batched input).
    sources: dict[fx.Node, frozenset] = {p: frozenset([p]) for p in param_names}
    flat_indices: dict[fx.Node, Any] = {}  # indices into a flattened batch, and their S (``_track_flat_index``)
    # (consumer, argument index or None, consumed parameter-only value)
    consumed: list[tuple[fx.Node, int | None, fx.Node]] = []
    stored: dict[fx.Node, list[str]] = {}  # values of parameters alone the forward stores
    losses: dict[fx.Node, str] = {}  # the reductions that made a loss, and their kind
    misused: set[fx.Node] = set()  # those refused where a use made them no loss
    divided: dict[fx.Node, list] = {}  # the loss's divisions by B since, and their kind (see _batch_power)
    normalisers: list[tuple[fx.Node, fx.Node, BatchDim, float | None]] = []
    sized_normaliser = False
    single = isinstance(batch_size, int) and batch_size in (0, 1) and not chunk
    checks_only = _checks_only(gm)
    without_grad, gradient_free = computed_without_grad(gm.graph), {}
    counts: set[fx.Node] = set()  # how many elements a mask selected from the whole batch
    positions: set[fx.Node] = set()  # ``arange`` over such a count, as an index of the list's rows
    # Tensors built from sizes, read batched, into some of whose rows samples' own pieces
    # were written (``out[i] = f(x[i])``), with each row's writes (``_written``), until every row is.
    rows_written: dict[fx.Node, dict[int, tuple]] = {}
    rows_whole: dict[fx.Node, dict[int, tuple]] = {}  # each row's writes, once every row is written
    rows_alike: dict[fx.Node, tuple] = {}  # those read whole: (their writes, whether every row's are alike)
    # Rows of such a tensor read before every row is written, by the tensor they were first
    # written into: each read, and whether its row was written by then.
    rows_read: dict[fx.Node, list[tuple[fx.Node, bool]]] = {}
    # Every read of one row of a batch, by the tensor first written and the row: the row's
    # writes so far at each read (``_written``'s entries).
    row_reads: dict[fx.Node, dict[int, list[tuple]]] = {}
    batch_size_values: list[fx.Node] = []  # values computed with the (symbolic) batch size
    normaliser_divisors: set[fx.Node] = set()  # the mask sums losses are divided by (``_mask_normaliser``)
    counted: list[tuple[fx.Node, list[fx.Node]]] = []  # losses scaled by a count sized by the batch
    returned = gm.graph.output_node().args[0]
    returned = returned if isinstance(returned, (list, tuple)) else (returned,)
    # values stored into the model's state: a statistic of the batch there is the next step's
    into_state = frozenset(out for i, out in enumerate(returned) if stored_outputs.get(i) and isinstance(out, fx.Node))
    mixing: list[fx.Node] = []  # where problems were found
    found = 0

    previous = None
    for node in gm.graph.nodes:
        # An in-place write by the op before changes what later reads of its base hold.
        # (With one sample nothing per-sample is written, but a write into a parameter
        # is refused all the same.)
        reason = None if previous is None else (
            parameter_write(previous, sources) if single else
            _row_written_in_place(previous, batch, rows_written, rows_whole, batch_size)
            or follow_write(previous, batch, sources))
        if reason:
            problems.append(Problem(op_name(previous.target), module_path_of(previous),
                                    _names(sources.get(previous.args[0], ()), param_names), reason,
                                    source_of(previous)))
        if len(problems) > found:  # at the op before (its write included)
            mixing.append(previous)
            found = len(problems)
        previous = node
        if node.op == "placeholder":
            b = placeholder_batch.get(node)
            batch[node] = WHOLE if (single and b is not None) else b
            continue
        if node.op == "output":
            outputs = node.args[0] if isinstance(node.args[0], (list, tuple)) else (node.args[0],)
            pieces: list[fx.Node] = []  # outputs holding one sample's values (with a gradient)
            for out in node.all_input_nodes:
                if out in sources and all(i in stored_outputs for i, o in enumerate(outputs) if o is out):
                    # stored, not returned: its gradient is checked to be zero at run time
                    stored[out] = sorted({param_names[p] for p in sources[out]})
                elif out in sources:
                    consumed.append((node, None, out))
                value = _meta(out)
                if _any_rows(batch.get(out)) and not carries_no_gradient(out, without_grad) and not (
                        isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex())):
                    problems.append(Problem(op_name(out.target), module_path_of(out), "", _ROWS_OUTPUT,
                                            source_of(out)))
                    mixing.append(out)  # what a later graph reads (see fxdp.compiler.mixed_outputs)
                if _any_piece(batch.get(out)) and not carries_no_gradient(out, without_grad) and not (
                        isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex())):
                    pieces.append(out)
                if out in rows_written:
                    problems.append(Problem(op_name(out.target), module_path_of(out), "", _PARTLY_WRITTEN,
                                            source_of(out)))
                if out in rows_whole and not _rows_alike_at(out, rows_whole, rows_alike, batch):
                    problems.append(Problem(op_name(out.target), module_path_of(out), "", _POSITIONED,
                                            source_of(out)))
                if _any_packed(batch.get(out)):
                    problems.append(Problem(op_name(out.target), module_path_of(out), "", _PACKED_OUTPUT,
                                            source_of(out)))
                if _any_masked(batch.get(out)):
                    # a loss over the list is no sum of the samples' own losses
                    op = out.args[0] if out.target is BATCH_TO_ROWS else out  # (the op run in place)
                    problems.append(Problem(op_name(op.target), module_path_of(out), "", _MASKED_OUTPUT,
                                            source_of(out)))
            # Every sample's own pieces, returned apart (Hugging Face's list of each image's
            # features), are each sample's; some of them alone are those at their positions.
            returned = {b.sample for out in pieces for b in _flat(batch.get(out)) if isinstance(b, Piece)}
            count = _as_number(batch_size)  # (a loop over the samples specialises a symbolic B)
            if pieces and returned != set(range(count if isinstance(count, int) else -1)):
                for out in pieces:
                    problems.append(Problem(op_name(out.target), module_path_of(out), "", _PIECE_OUTPUT,
                                            source_of(out)))
                    mixing.append(out)
            continue
        if node.op != "call_function":
            batch[node] = None
            continue
        target = node.target
        path = module_path_of(node)
        # An argument that only lends its dtype and device (``x.type_as(y)``) holds no data.
        # (by position: ``t.type_as(t)``, as ESM's attention casts, reads ``t`` still)
        donors = set(_DTYPE_DONORS.get(target, ()))
        arg_batch = [None if i in donors else _arg_batch(a, batch) for i, a in enumerate(node.args)]
        kwarg_batch = [_arg_batch(v, batch) for v in node.kwargs.values()]
        taken = _row_taken(node, batch.get(node.args[0]) if node.args else None)
        if any(a in rows_written for a in node.all_input_nodes):
            if not _reads_rows_written_so_far(node, arg_batch, rows_written):
                problems.append(Problem(op_name(target), path, "", _PARTLY_WRITTEN, source_of(node)))
            elif taken is not None:
                base, row = taken
                rows_read.setdefault(_first_written(base), []).append((node, row in rows_written[base]))
        if taken is not None:
            base, row = taken
            writes = (rows_written.get(base) or rows_whole.get(base) or {}).get(row, ())
            row_reads.setdefault(_first_written(base), {}).setdefault(row, []).append(writes)
        if any(a in rows_whole and not _reads_a_row(node, a, arg_batch, batch)
               and not _rows_alike_at(a, rows_whole, rows_alike, batch) for a in node.all_input_nodes):
            problems.append(Problem(op_name(target), path, "", _POSITIONED, source_of(node)))
        if _counts_selected(node, batch, counts):
            counts.add(node)
            if not isinstance(_meta(node), torch.Tensor):
                batch[node] = None
                continue
        if _list_positions(node, counts, positions, batch):
            # ``arange(n)`` over a list's length, as an index of its rows alone: each row
            # reads itself (transformers' mask builder on Idefics3's real images).
            positions.add(node)
            batch[node] = None
            continue
        if any(a in counts or a in positions for a in node.all_input_nodes) and (
                _is_pointwise(target) or target in _TENSORS_OF_COUNTS or target in _CREATION
                or not _indexes_its_list(node, positions, batch)):
            problems.append(Problem(op_name(target), path, "", _COUNTED, source_of(node)))
            out = _meta(node)
            batch[node] = [UNKNOWN] * len(out) if isinstance(out, (list, tuple)) else UNKNOWN
            continue
        if any(a in counts for a in node.all_input_nodes) and not _count_as_rows(node, counts):
            problems.append(Problem(op_name(target), path, "", _COUNT_AS_SIZE, source_of(node)))
            out = _meta(node)
            batch[node] = [UNKNOWN] * len(out) if isinstance(out, (list, tuple)) else UNKNOWN
            continue
        batched = _any_batched(arg_batch) or _any_batched(kwarg_batch)
        read: set = set()  # (``p.new_zeros(B, d)`` reads only its parameter's dtype: no use of it)
        shaped = {0} if target in _NEW_LIKE or target in SHAPED_LIKE else set()
        fx.node.map_arg(([a for i, a in enumerate(node.args) if i not in donors | shaped], node.kwargs), read.add)
        paramish = [a for a in node.all_input_nodes if a in sources and a in read]
        if paramish and (is_detach(node) or node in without_grad) and not writes_in_place(target) \
                and not _written_into(node):
            # no gradient flows back to the parameters: a constant (torchtune's DoRA divides
            # a frozen magnitude by the detached norm of its adapted weight); an alias that
            # is written into writes into the parameter (``embedding_renorm_``)
            paramish = []
        if paramish:
            if not batched and not _is_number(node):
                sources[node] = frozenset().union(*(sources[a] for a in paramish))
            for a in paramish:
                # Every argument it is (``layer_norm(x, s, w, w)``): each use is per-sample.
                for index in [i for i, x in enumerate(node.args) if x is a and i not in donors] or [None]:
                    consumed.append((node, index, a))
        if target is operator.getitem:
            src = batch.get(node.args[0])
            batch[node] = src[node.args[1]] if isinstance(src, (list, tuple)) else src
            if node.args[0] in flat_indices:  # a piece of an index into a flattened batch
                flat_indices[node] = flat_indices[node.args[0]]
            continue
        rule = lookup(target)
        if _any_unknown(arg_batch):
            if problems:
                # A loss that meets a value after a refusal is no longer judged as the loss (the
                # fallback scale of HF's time-series scalers, ``ts_sum.sum(0) / counts.sum(0)``;
                # a value unknown without a problem, a run-time check's, keeps it judged).
                misused.update(_reductions_behind(node, batch, losses))
            out = _meta(node)
            batch[node] = [UNKNOWN] * len(out) if isinstance(out, (list, tuple)) else UNKNOWN
            continue
        if not single and (_batch_size_as_a_value(node, batch_size)
                           or _mixes_along_the_batch_size(node, arg_batch, batch_size)
                           or _indexes_by_the_batch_size(node, arg_batch, batch_size)) \
                and not any(isinstance(b, Loss) for b in _flat(arg_batch)) and node not in checks_only \
                and (function_body or not reaches_no_gradient(node, without_grad, gradient_free, into_state)):
            batch_size_values.append(node)  # judged once every use is known (a mask normaliser passes)

        sized = None if single else _sized_by_batch(
            node, batch_size, batched, like=batch.get(node.args[0]) if target in FILLED_LIKE else None)
        if sized is not None:
            sized_by_batch.append(node)
            if sized_batched == "unambiguous" or isinstance(sized_batched, dict):
                sized = _sized_by_batch(node, batch_size, batched, unambiguous=sized_batched == "unambiguous",
                                        at=sized_batched.get(node) if isinstance(sized_batched, dict) else None,
                                        like=batch.get(node.args[0]) if node.args else None)
            if sized is not None and sized_batched != "none":
                batch[node] = sized
                if node in sources:  # a parameter expanded to the batch: row b is sample b's
                    del sources[node]
                    expanded_params[node] = sized
                continue
        if not batched or (target in _CREATION and not _any_masked(arg_batch)):
            out = _meta(node)
            batch[node] = [None] * len(out) if isinstance(out, (list, tuple)) else None
            continue
        if any(isinstance(b, Loss) for b in _flat(arg_batch)):
            if node in checks_only:  # a count of the batch that a run-time check alone reads
                out = _meta(node)
                batch[node] = [UNKNOWN] * len(out) if isinstance(out, (list, tuple)) else UNKNOWN
                continue
            if _floors_a_divisor(node):  # decided by the division (a mask normaliser or refused)
                batch[node] = next(b for b in _flat(arg_batch) if isinstance(b, Loss))
                continue
            mask = _mask_normaliser(node, losses, placeholder_batch, param_names)
            if mask is not None:
                normaliser_divisors.add(_division_operands(node)[1])
            if mask is not None and isinstance(batch.get(mask), BatchDim):
                # (l * mask).sum() / mask.sum(): a mean over the samples (checked at run time).
                numerator, denominator = _division_operands(node)
                del losses[numerator], losses[denominator]
                losses[node] = "mean"
                batch[node] = Loss("mean")
                normalisers.append((node, mask, batch[mask], _floor_value(_behind_copies(node.args[1]))))
                continue
            sized_normaliser |= mask is not None and batch.get(mask) is None and _built_from(mask, sized_by_batch)
            # Only sums, scalings by shared values and copies may follow the loss.
            if _scales_the_loss(target, arg_batch):
                batch[node] = next(b for b in _flat(arg_batch) if isinstance(b, Loss))
                if any(isinstance(a, fx.Node) and not isinstance(batch.get(a), Loss)
                       and _sums_along_the_batch_size(a, sized_by_batch, batch_size) for a in node.args[:2]):
                    # judged once every use is known: a statistic of the batch that meets the
                    # samples later is refused there, as no loss
                    counted.append((node, _reductions_behind(node, batch, losses)))
                    continue
                power = _batch_power(node, batch_size,
                                     functools.partial(_counts_per_sample, node, batch, losses, batch_size))
                if power is None:
                    problems.append(Problem(op_name(target), path, "", _SCALED_BY_THE_BATCH, source_of(node)))
                    batch[node] = None
                    continue
                for r in _reductions_behind(node, batch, losses) if power[0] else ():
                    divided.setdefault(r, []).append(power)
                continue
            problems.append(Problem(op_name(target), path, "", _loss_misuse(target, arg_batch, _meta(node)),
                                    source_of(node)))
            # A statistic of the batch (a fallback scale from every sample's sum) is no
            # loss: neither it nor what it meets is judged again.
            misused.update(_reductions_behind(node, batch, losses))
            out = _meta(node)
            batch[node] = [UNKNOWN] * len(out) if isinstance(out, (list, tuple)) else UNKNOWN
            continue
        try:
            if single:
                leak = _records_running_statistics(node)
                if leak:
                    problems.append(Problem(op_name(target), path, "", leak, source_of(node)))
                out = _meta(node)
                batch[node] = [WHOLE] * len(out) if isinstance(out, (list, tuple)) else WHOLE
                continue
            if _any_packed(arg_batch) or _any_packed(kwarg_batch):
                batch[node] = _packed_batch(node, arg_batch, kwarg_batch, bool(paramish))
            elif _any_sorted(arg_batch) or _any_sorted(kwarg_batch):
                batch[node] = _sorted_rows_batch(node, arg_batch, kwarg_batch, rule, batch)
            elif _any_piece(arg_batch) or _any_piece(kwarg_batch):
                batch[node] = _piece_batch(node, arg_batch + kwarg_batch, batch_size, bool(paramish), batch)
            elif _any_masked(arg_batch) or _any_masked(kwarg_batch):
                batch[node] = _masked_batch(node, arg_batch, kwarg_batch, bool(paramish))
            elif target is FUNCTION_APPLY:
                batch[node] = function_batch(node, arg_batch, batch_size)
            elif rule is not None:
                metas = [_meta(a) for a in node.args]
                batch[node] = rule.batch_rule(arg_batch, metas, _meta(node), rule.config(node.args))
            elif target in PROPAGATION:
                batch[node] = PROPAGATION[target](node, arg_batch)
            elif _is_pointwise(target):
                batch[node] = _pointwise(node, [b for b in arg_batch])
            else:
                raise _NoPropagation(_no_propagation(target))
            if (_is_pointwise(target) or target in _SCATTERED_ALONG or target in _AT_INDICES or target in (
                    aten.cat.default, aten.stack.default, aten.select_scatter.default, aten.slice_scatter.default)) \
                    and _varies_along_the_batch(node, arg_batch, batch[node], sources):
                raise MixesSamples(_ALONG_THE_BATCH)
            _track_flat_index(node, flat_indices, batch)
            _check_batch_rows(node, batch[node], batch_size)
            written = _sample_row_written(node, arg_batch, rows_written, rows_whole, batch, batch_size)
            if written is not None:
                (rows_whole if _every_row(written, batch_size) else rows_written)[node] = written
            if isinstance(batch[node], Loss):
                losses[node] = batch[node].reduction
        except (MixesSamples, ValueError, GuardOnDataDependentSymNode) as e:
            # Where nothing with a gradient depends on it (a run-time check, a statistic the
            # forward reports), no sample's gradient does: nothing after it is judged.
            if node in checks_only or (
                    not function_body and reaches_no_gradient(node, without_grad, gradient_free, into_state)):
                out = _meta(node)
                batch[node] = [UNKNOWN] * len(out) if isinstance(out, (list, tuple)) else UNKNOWN
                continue
            consumed_params = sorted({param_names[p] for a in paramish for p in sources.get(a, ())})
            consumes = (f" (it consumes the trainable parameter(s) {', '.join(consumed_params)})"
                        if consumed_params else "")
            if isinstance(e, GuardOnDataDependentSymNode):
                reason = ("its sizes depend on the data (a split by a tensor of indices, a nonzero), so "
                          "fxdp cannot tell where the batch goes")
            else:
                reason = str(e) if isinstance(e, _NoPropagation) else f"mixes samples: {e}"
            name = (f"torch.autograd.Function {function_call(node).name}" if target is FUNCTION_APPLY
                    else op_name(target))
            problems.append(Problem(name, path, "", f"{reason}{consumes}", source_of(node)))
            # What follows a refused op is unknown, not shared: one refusal must not
            # cascade into spurious problems downstream.
            out = _meta(node)
            if isinstance(e, _MixesButKeepsLayout):
                batch[node] = e.batch
            else:
                batch[node] = [UNKNOWN] * len(out) if isinstance(out, (list, tuple)) else UNKNOWN

    # Rows read as the steps of a loop, some written by then and some not
    # (``h[0, 0].mul_(2)``, then ``stack([h[i, 0] for i in range(B)])``): row 0 read
    # written, the others not (alone, every sample is the first). A loop reads every row
    # before its write, or every row after it; or reads every row at the same points of
    # its writes (``h[i] = h[i] * 2; ps.append(h[i])``: each row read before its write and after).
    for key, reads in rows_read.items():
        if len({written for _, written in reads}) > 1 \
                and not _rows_read_alike(row_reads.get(key, {}), batch_size, batch):
            first = reads[0][0]
            problems.append(Problem(op_name(first.target), module_path_of(first), "", _PARTLY_WRITTEN,
                                    source_of(first)))
            mixing.extend(node for node, _ in reads)
    for node in batch_size_values:
        # (a mask of ones made inside counts B·T: as the loss's normaliser it is judged as such;
        # an index into the flattened batch moved by B·T, as its rows are checked at run time)
        if node not in normaliser_divisors and node not in flat_indices:
            problems.append(Problem(op_name(node.target), module_path_of(node), "", _BATCH_SIZE_AS_A_VALUE,
                                    source_of(node)))
            mixing.append(node)
    for node in _read_through_views_after_a_partial_write(gm, rows_written):
        problems.append(Problem(op_name(node.target), module_path_of(node), "", _PARTLY_WRITTEN, source_of(node)))
        mixing.append(node)
    if len(problems) > found:
        mixing.append(previous)
    live = _live_nodes(gm)
    for node, reductions in counted:
        if any(r in live and r not in misused for r in reductions):
            problems.append(Problem(op_name(node.target), module_path_of(node), "", _SCALED_BY_A_COUNT,
                                    source_of(node)))
            mixing.append(node)
            misused.update(reductions)
    # A use on a mask's rows is a use on the batch once the rows are put back in place.
    in_place = {n for n, _ in _ROWS_IN_PLACE[-1]}
    uses, broadcasts = ([], {}) if single else _classify_parameter_uses(
        [c for c in consumed if c[0] not in in_place], sources, batch, param_names, problems, without_grad,
        expanded_params)

    loss = None
    # A loss computed and dropped (dense_diff_pool's entropy term its caller ignores)
    # is none: only the losses the outputs depend on count.
    losses = {n: kind for n, kind in losses.items() if n in live and n not in misused}
    losses = {n: _scaled_kind(kind, divided.get(n, [])) for n, kind in losses.items()}
    if None in losses.values():
        problems.append(Problem("loss", "", "", _SCALED_BY_THE_BATCH))
        losses = {n: kind for n, kind in losses.items() if kind is not None}
    # A sum divided by the batch size fits beside a mean and beside a sum alike.
    loss_kinds = set(losses.values())
    if loss_kinds:
        plain = loss_kinds - {"batchmean"}
        if len(plain) > 1:
            problems.append(Problem("loss", "", "", f"the graph adds losses of different reductions {sorted(plain)}"))
        loss = min(plain, default="batchmean")
    return BatchAnalysis(batch=batch, problems=problems, uses=uses, loss=loss,
                         broadcasts=broadcasts, param_only=sources, single=single,
                         empty=single and batch_size == 0, sized_by_batch=sized_by_batch,
                         normalisers=normalisers, sized_normaliser=sized_normaliser, mixing=mixing,
                         stored=stored, sized_shared=sized_batched == "none")


def _live_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose values the graph's outputs depend on (or that write in place: a
    write's base is read later), not those read only for a shape (``ones_like(s)``:
    ``torch.func.grad`` of a sum seeds its backward so, and the sum is no loss)."""
    return reached([n for n in gm.graph.nodes if n.op == "output" or (
        n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable)],
        lambda n: () if n.op == "call_function" and n.target in SHAPED_LIKE else n.all_input_nodes)


def reached(nodes: Sequence[fx.Node], step: Callable[[fx.Node], Sequence[fx.Node]]) -> set[fx.Node]:
    """``nodes`` and every node reached from them by ``step`` (``n.users``: what is
    computed from them; ``n.all_input_nodes``: what they are computed from)."""
    seen: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(step(n))
    return seen


_ASSERTIONS = {aten._assert_scalar.default, aten._assert_async.default, aten._assert_async.msg,
               aten.sym_constrain_range.default, aten.sym_constrain_range_for_size.default}


def _checks_only(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose values reach nothing but run-time assertions (or nothing).

    Dynamo turns a size read from the data into such checks where it can prove the size
    (torchaudio's ``max_length = int(lengths.max().item())`` of a padding mask, which
    the input's own length pins: ``_assert_scalar(Eq(u0, 6))``; on a graph with symbolic
    sizes the size becomes the input's and the max is left without users). The max
    mixes the samples' lengths, but into an assertion only, never into a value: no
    sample's gradient depends on it. Only ATen ops that write nothing and symbolic
    arithmetic qualify: not a write, nor a BatchNorm that records the batch's statistics
    in its buffers (its output may go unused), nor a call of unknown effects."""
    found: set[fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        if node.op != "call_function" or node.target in _ASSERTIONS or not _pure(node):
            continue
        if all(u.target in _ASSERTIONS or u in found for u in node.users):
            found.add(node)
    return found


def _written_into(node: fx.Node) -> bool:
    """Whether an in-place op writes into ``node`` or a view of it."""
    views = reached([node], lambda n: [u for u in n.users if is_view(u) and u.args[0] is n])
    return any(writes_in_place(u.target) and u.args[0] is v for v in views for u in v.users)


def reaches_no_gradient(node: fx.Node, without_grad: set[fx.Node], memo: dict,
                        stored: frozenset[fx.Node] = frozenset()) -> bool:
    """Whether everything computed from ``node``'s value carries no gradient, and none of
    it writes into anything else: a statistic of the whole batch that the forward only
    reports (the perplexity a VQ-VAE's quantizer computes from a ``histc`` of the batch's
    codes, pykan's ``x.std(0).detach()`` of each layer's input), which no sample's
    gradient can depend on.

    A value carries no gradient when it is not floating point (indices, masks), is
    detached or computed under ``no_grad``, or is computed from such values alone. Every
    value computed from ``node`` must be of these: an index, a mask or a size read from
    it that then selects, masks or shapes a value with a gradient makes that value
    depend on every sample, and so does an in-place write of it into a tensor computed
    before it. ``node`` itself (and its outputs) may carry one (``x.std(0)`` before its
    ``detach``), but then may not be an output of the graph, which a loss could
    differentiate. An input
    may ask for gradients (the graph cannot tell), so a floating one counts as carrying
    them.

    Args:
        node: An op the batch analysis finds mixing samples (or cannot follow).
        without_grad: The nodes run under ``no_grad`` (``computed_without_grad``).
        memo: Shared by the calls on one graph.
        stored: The values the forward stores into the model's state, where the next
            call reads them (``self.center = 0.9 * self.center + 0.1 * t.mean(0)``,
            lightly's DINO centre): one computed from ``node`` carries the batch into
            the next step, as a write into a buffer does.
    """
    # The op and its outputs (``var_mean``'s two, taken by getitem).
    own = {node} | {u for u in node.users if u.target is operator.getitem}
    reached, pending = set(), [node]
    while pending:
        n = pending.pop()
        if n not in reached and n.op != "output":
            reached.add(n)
            pending.extend(n.users)
    if any(u.op == "output" for n in own for u in n.users) and not _gradient_free(node, without_grad, memo):
        return False
    if reached & stored:
        return False
    return all((n in own or _gradient_free(n, without_grad, memo)) and _writes_only_into(n, reached)
               for n in reached)


def _writes_only_into(node: fx.Node, values: set[fx.Node]) -> bool:
    """Whether ``node`` writes into nothing, or in place into one of ``values`` (or a
    view of one) alone: not a buffer (BatchNorm's running statistics, which its schema
    does not mark), nor a tensor computed before them, nor through a call fxdp does not
    see into."""
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator) or _records_running_statistics(node):
        return False  # an autograd.Function, a wrapped region; BatchNorm's buffers
    if not isinstance(target, torch._ops.OpOverload):
        return True
    written = [i for i, a in enumerate(target._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    if not written:
        return True
    return written == [0] and written_chain(node)[-1] in values  # the memory written, not a view of it


def _gradient_free(node: fx.Node, without_grad: set[fx.Node], memo: dict) -> bool:
    """Whether no gradient can flow back through ``node``'s value (see
    ``reaches_no_gradient``)."""
    if node not in memo:
        values = node.meta.get("val")
        values = values if isinstance(values, (list, tuple)) else [values]
        if "val" in node.meta and not any(
                isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in values):
            memo[node] = True
        elif node.op != "call_function":
            memo[node] = node.op != "placeholder"  # a constant holds no gradient
        elif is_detach(node) or node in without_grad:
            memo[node] = True
        else:
            memo[node] = all(_gradient_free(a, without_grad, memo) for a in node.all_input_nodes)
    return memo[node]


_SYMBOLIC_ARITHMETIC = {torch.sym_int, torch.sym_float, torch.sym_max, torch.sym_min, torch.sym_not, torch.sym_ite}


def _pure(node: fx.Node) -> bool:
    if node.target in _SYMBOLIC_ARITHMETIC or getattr(node.target, "__module__", None) == "_operator":
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and not schema.is_mutable and not _records_running_statistics(node)


def _names(nodes, param_names) -> str:
    return ", ".join(sorted(param_names[p] for p in nodes))


_PENALTY = ("a value of parameters alone (a penalty, loss + λ·‖w‖²) meets the loss over the batch: it belongs "
            "to no sample, and the privacy of DP-SGD comes from clipping each sample's gradient. Put it in the "
            "optimizer (weight_decay, which needs no privacy), or add it to each sample's loss before the "
            "reduction over the batch (expanded to the batch), so that each sample's clipped gradient holds it")


def _classify_parameter_uses(consumed, sources, batch, param_names, problems, without_grad,
                             expanded_params=None):
    """Decide, for every place a parameter (or a parameter-only value) meets batched data,
    how its per-sample gradient is obtained.

    * ``direct``: a rule's parameter argument is the parameter itself;
    * ``transform``: it is a parameter-only value (``W.t()``, a slice, weight norm): the
      per-sample gradient is mapped back through the transform's per-sample VJP;
    * ``broadcast``: a rule op whose inputs are all shared (``wpe(arange(T))``) and whose
      result is only broadcast against batched data: its output is expanded to the batch;
      and an ``expand`` of a parameter-only value to the batch size that the analysis
      read batched (``expanded_params``: DETR's ``query.unsqueeze(0).expand(B, -1, -1)``
      run through attention before it meets the data), whose row ``b`` is sample ``b``'s;
    * ``generic``: an op without a rule for that argument but with a known batch rule: a
      per-sample VJP of the op itself.
    """
    uses: list[UseSite] = []
    broadcasts: dict[fx.Node, Broadcast] = {}
    # Shared rule ops that may be broadcast: their parameter arguments are rule'd and
    # some other tensor input is not parameter-derived.
    candidates: dict[fx.Node, Broadcast] = {}
    refused: set[fx.Node] = set()
    # A broadcast op's output, and the graph's own expands of it, reach batched data as
    # the broadcast: their consumers need nothing more.
    broadcast_values: set[fx.Node] = set()
    consumers = {n for n, _, _ in consumed}
    graph_nodes = next(iter(consumers)).graph.nodes if consumers else ()
    for node in (n for n in graph_nodes if n in consumers):  # producers before consumers
        if node in (expanded_params or {}):
            ref = next((p for p in graph_nodes if p.op == "placeholder" and isinstance(batch.get(p), BatchDim)
                        and batch[p].dim is not None and batch[p].plain), None)
            if ref is not None:
                candidates[node] = Broadcast(batch_dim=expanded_params[node].dim, ndim=_meta(node).dim(),
                                             ref=ref, ref_dim=batch[ref].dim)
            continue
        rule = lookup(node.target) if node.op == "call_function" else None
        if node not in sources or rule is None:
            continue
        param_positions = [i for i, a in enumerate(node.args) if isinstance(a, fx.Node) and a in sources]
        if param_positions and all(node.args[i] in broadcast_values for i in param_positions):
            continue  # an expand of a broadcast op's output
        # (A number read from a tensor, ``p * float(scale)``, is no operand to broadcast.)
        others = [a for i, a in enumerate(node.args) if isinstance(a, fx.Node) and a not in sources
                  and isinstance(_meta(a), torch.Tensor)]
        if param_positions and all(i in rule.params for i in param_positions) and (
                others or node.target is aten.expand.default) and not _complex_valued(node):
            plan = _broadcast_plan(node, batch)
            if plan is None:
                continue
            # Expanded to the batch, the op sees its other inputs batched: the rule's
            # check judges its settings (``scale_grad_by_freq``) and layouts as it would
            # there. (An expand of the parameter alone is the broadcast itself.)
            as_batched, metas = _batched_as_broadcast(node, plan, sources)
            for i in param_positions if others else ():
                reason = rule.check(as_batched, metas, i) if rule.check else None
                if reason:
                    problems.append(Problem(op_name(node.target), module_path_of(node),
                                            _names(sources[node.args[i]], param_names), reason, source_of(node)))
                    refused.add(node)
            if node not in refused:
                candidates[node] = plan
                broadcast_values.update(_own_expands(node, batch))
    for node, plan in candidates.items():
        broadcasts[node] = plan
        batch[node] = batch[plan.ref].at(plan.batch_dim) if plan.merged else BatchDim(plan.batch_dim)
        for i, a in enumerate(node.args):
            if isinstance(a, fx.Node) and a in sources:
                kind = "broadcast" if a in param_names else "transform"
                uses.append(UseSite(node, i, kind, sources[a], broadcast=True))

    for node, index, value in consumed:
        if node in candidates or node in refused:
            continue
        if node.op == "call_function" and (node in without_grad or carries_no_gradient(value, without_grad)):
            continue  # no gradient reaches the parameter through this use
        if value in broadcast_values:
            continue  # the consumer of a broadcast op's output: nothing to do
        if node.op == "output":
            if carries_no_gradient(value, without_grad):
                continue  # no gradient flows back (spectral norm's power-iteration vectors)
            problems.append(Problem("output", "", _names(sources[value], param_names),
                                    "a parameter (or a value computed from parameters alone) is returned; fxdp "
                                    "cannot see how each sample's loss uses it, so its gradient cannot be made "
                                    "per-sample: give it a batch dim inside the forward (a flow's "
                                    "log-determinant of its weights: logdet.expand(x.shape[0]), added to each "
                                    "sample's term). A value the forward computes and only stores (on a "
                                    "module, in a cache) is fine while the loss does not use it"))
            continue
        if node in sources or (node.op == "call_function" and _is_number(node)):
            continue  # a parameter-only computation (a transform, judged where it meets data), a size or number
        if node.op == "call_function" and (
                _any_unknown(batch.get(node)) or _any_unknown([batch.get(a) for a in node.all_input_nodes])):
            continue  # downstream of a refused op
        target, path = node.target, module_path_of(node)
        rule = lookup(target)
        kind = "direct" if value in param_names else "transform"
        ruled = rule is not None and index is not None and index in rule.params
        reason = rule.check([rule_layout(_arg_batch(a, batch)) for a in node.args], [_meta(a) for a in node.args],
                            index) if ruled and rule.check else None
        if reason and any(isinstance(batch.get(a), Loss) for a in node.all_input_nodes):
            reason = _PENALTY
        if _complex_valued(node) and not (
                target is FUNCTION_APPLY and index is not None and function_param_rule(node, index) is None):
            # The rules are written for real values (a complex gradient takes conjugates
            # they do not); the generic per-sample VJP is autograd's own, complex included,
            # as is a Function's own backward run per sample (below). A rule's check still
            # judges the op's arguments.
            if reason:
                problems.append(Problem(op_name(target), path, _names(sources[value], param_names), reason,
                                        source_of(node)))
            elif index is not None and node.op == "call_function" and target is not FUNCTION_APPLY and isinstance(
                    _differentiable_output(node, batch.get(node)), (BatchDim, Rows)):
                uses.append(UseSite(node, index, kind, sources[value], generic=True))
            else:
                problems.append(Problem(op_name(target), path, _names(sources[value], param_names), _COMPLEX,
                                        source_of(node)))
            continue
        if target is FUNCTION_APPLY and index is not None:
            generic = function_param_rule(node, index) is None
            outputs = batch.get(node) or []
            differentiable = [b for i, b in enumerate(outputs)
                              if i not in node.kwargs.get("non_differentiable_idx", [])]
            if generic and not all(isinstance(b, BatchDim) for b in differentiable):
                problems.append(Problem(
                    f"torch.autograd.Function {function_call(node).name}", path,
                    _names(sources[value], param_names),
                    "its backward can give per-sample gradients only when every differentiable output "
                    "is batched; register a rule for it with fxdp.register_rule", source_of(node)))
            else:
                uses.append(UseSite(node, index, kind, sources[value], generic=generic))
            continue
        if ruled:
            if reason:
                problems.append(Problem(op_name(target), path, _names(sources[value], param_names), reason,
                                        source_of(node)))
            else:
                uses.append(UseSite(node, index, kind, sources[value]))
            continue
        if index is not None and (target in PROPAGATION or _is_pointwise(target)) and isinstance(
                _differentiable_output(node, batch.get(node)), (BatchDim, Rows)):
            uses.append(UseSite(node, index, kind, sources[value], generic=True))
            continue
        problems.append(Problem(
            op_name(target), path, _names(sources[value], param_names),
            f"no per-sample rule for a parameter used by {op_name(target)}"
            + ("" if index is None else f" (argument {index})")
            + "; register one with fxdp.register_rule", source_of(node)))
    return uses, broadcasts


def _differentiable_output(node: fx.Node, layout: Any) -> Any:
    """The layout of the one output of ``node`` that carries a gradient: the output
    itself, or the first of several where autograd marks the others non-differentiable
    (``linalg.solve``'s ``(solution, LU, pivots, info)``; the tagged op marks them so
    too), found by running the op on the meta device. ``None`` otherwise: the generic
    rule takes the VJP of one output."""
    if not isinstance(layout, (list, tuple)):
        return layout
    out = _meta(node)

    def on_meta(a: Any) -> Any:
        value = _meta(a) if isinstance(a, fx.Node) else a
        if isinstance(value, (list, tuple)):
            return type(value)(on_meta(v) for v in value)
        if not isinstance(value, torch.Tensor):
            return value
        shape = [size.node.hint if isinstance(size, torch.SymInt) else size for size in value.shape]
        empty = torch.empty(shape, dtype=value.dtype, device="meta")
        return empty.requires_grad_(value.is_floating_point() or value.is_complex())

    try:
        with torch.enable_grad():
            result = node.target(*[on_meta(a) for a in node.args], **{k: on_meta(v) for k, v in node.kwargs.items()})
    except Exception:  # noqa: BLE001 - no meta kernel, or sizes the hints cannot give
        return None
    if not (isinstance(out, (list, tuple)) and isinstance(result, (list, tuple))
            and len(result) == len(layout) and result[0].requires_grad
            and not any(isinstance(r, torch.Tensor) and r.requires_grad for r in result[1:])):
        return None
    return layout[0]


_COMPLEX = ("it computes with complex values, whose per-sample gradients fxdp takes only by the generic "
            "per-sample VJP (its rules are written for real values: a complex gradient needs conjugates they "
            "do not take), and that needs the parameter as an argument of an op with one differentiable, "
            "batched output (not inside a list argument; a torch.autograd.Function only without a registered "
            "rule, its own backward run per sample): keep the parameter's "
            "path real here, or freeze the parameter")


def _complex_valued(node: fx.Node) -> bool:
    """Whether an op reads or gives a complex tensor."""
    values = [_meta(a) for a in node.all_input_nodes] + [_meta(node)]
    flat = [v for value in values for v in (value if isinstance(value, (list, tuple)) else [value])]
    return any(isinstance(v, torch.Tensor) and v.is_complex() for v in flat)


def _batched_as_broadcast(node: fx.Node, plan: "Broadcast", sources: dict) -> tuple[list, list]:
    """The batch dims and example values of a shared op's arguments as its broadcast
    ``plan`` makes them. Every input but the parameter-only values is batched: along a
    new leading dim where the expand adds one (in ``buffer * p`` broadcast from ``[d]``
    to ``[B, d]``, the buffer reads as ``[1, d]`` batched at 0, and the parameter ``[d]``
    does not span the batch), where the output has it for a pointwise op's operand of
    fewer dims, else along its dim 0 (``wpe(arange(T)[None])``'s ``[1, T]`` positions).
    """
    added = plan.ndim - _meta(node).dim()
    as_batched, metas = [], []
    for a in node.args:
        meta = _meta(a)
        if isinstance(a, fx.Node) and a not in sources and isinstance(meta, torch.Tensor):
            if _is_pointwise(node.target) and meta.dim() < plan.ndim:
                # It broadcasts to the output's trailing dims (``rel[None] + ones(T, T)``
                # with ``rel [H, T, T]``; a 0-d buffer in ``p * scale``): batched where the
                # output is, padded to reach it.
                meta = meta.reshape((1,) * (plan.ndim - meta.dim()) + tuple(meta.shape))
                as_batched.append(BatchDim(plan.batch_dim))
            elif added > 0:
                meta = meta.reshape((1,) * added + tuple(meta.shape))
                as_batched.append(BatchDim(plan.batch_dim))
            else:
                as_batched.append(BatchDim(0))
        else:
            as_batched.append(None)
        metas.append(meta)
    return as_batched, metas


def _own_expands(node: fx.Node, batch: dict) -> set[fx.Node]:
    """``node`` and the shared expands of it that the graph itself applies."""
    found, stack = {node}, [node]
    while stack:
        for user in stack.pop().users:
            if user.target is aten.expand.default and batch.get(user) is None and user not in found:
                found.add(user)
                stack.append(user)
    return found


def _expanded_to_batch(node: fx.Node, dim: int) -> bool:
    """``node``'s output has size 1 at ``dim`` (HF GPT-2's ``wpe(arange(T)[None])``), or
    ``node`` is an ``expand`` that creates ``dim`` from a size-1 (or missing) dim: its
    rows along ``dim`` are copies, so handing row ``b`` to sample ``b`` is exact."""
    out = _meta(node)
    if bool(out.shape[dim] == 1):
        return True
    if node.target not in (aten.expand.default,):
        return False
    src = _meta(node.args[0])
    pad = out.dim() - src.dim()
    return dim < pad or bool(src.shape[dim - pad] == 1)


def _broadcast_plan(node: fx.Node, batch: dict) -> "Broadcast | None":
    """How to expand a shared parameter op's output to the batch, if its users allow it.

    ``pos = wpe(arange(T))`` ([T, d]) used only by ``x + pos`` with ``x`` [B, T, d]:
    the op's output can be expanded to ``[B, T, d]`` (a view) without changing any
    result, and then its output gradient is per-sample. ViT's
    ``cat([cls_token.expand(B, -1, -1), x], 1)`` is the same with the expand written
    by the user.
    """
    out = _meta(node)
    if not isinstance(out, torch.Tensor) or not node.users:
        return None
    plan = None
    for user in node.users:
        if user.op != "call_function":
            return None
        if user.target is aten.expand.default and batch.get(user) is None:
            # The output expanded by the graph itself (an embedding of indices that were
            # expanded, after ``expand_after_lookup_pass``): the expand's users decide, and
            # the output broadcasts to the expand's shape wherever the expand does.
            candidate = _broadcast_plan(user, batch)
            if candidate is None or candidate.ndim < out.dim():
                return None
        else:
            candidate = _user_plan(node, out, user, batch)
        if candidate is None:
            return None
        if plan is None:
            plan = candidate
        elif (plan.batch_dim, plan.ndim, plan.merged) != (candidate.batch_dim, candidate.ndim, candidate.merged) \
                or not batch[plan.ref].at(0).same_as(batch[candidate.ref].at(0)):
            return None
    return plan


def _user_plan(node: fx.Node, out: torch.Tensor, user: fx.Node, batch: dict) -> "Broadcast | None":
    """The broadcast of ``node``'s output that its pointwise or ``cat`` user needs.

    The batch it meets may merge several rows of each sample into its batch dim: the
    sequence folded into windows ``[B·n, m, d]`` with a memory token
    ``mem.expand(B·n, -1, -1)`` put in front of each, two views of every sample stacked
    ``[2·B, …]`` with one ``cls_token`` expanded to them all, or both (``[2·B·n, …]``,
    with a static ``n``). Every row is a copy of the output, so sample ``b``'s gradient
    is the sum over its rows (the marker takes it).
    """
    is_cat = user.target is aten.cat.default
    if not (_is_pointwise(user.target) or is_cat):
        return None
    b = batch.get(user)
    if not isinstance(b, BatchDim) or not isinstance(b.dim, int):
        return None
    merged = "" if b.plain else "inner" if _equal_one(b.outer) else "outer" if _equal_one(b.inner) else "both"
    if merged == "both" and not isinstance(b.inner, int):
        return None  # B and the dim's size alone do not tell one sample's copies apart
    n = _meta(user).dim()
    added = n - out.dim()
    if is_cat or b.dim >= added:
        if not _expanded_to_batch(node, b.dim - added):
            return None
    flat_args = [a for arg in user.args for a in (arg if isinstance(arg, (list, tuple)) else [arg])]
    ref = next((a for a in flat_args if isinstance(a, fx.Node) and a is not node
                and isinstance(batch.get(a), BatchDim) and isinstance(batch[a].dim, int)
                and batch[a].at(b.dim).same_as(b)), None)
    if ref is None:
        return None
    sample_ref = None
    if merged:
        sample_ref = next((p for p in node.graph.nodes if p.op == "placeholder" and isinstance(batch.get(p), BatchDim)
                           and isinstance(batch[p].dim, int) and batch[p].plain), None)
        if sample_ref is None:
            return None
    # the refs' batch dims in their own layouts, for reading the sizes at run time
    return Broadcast(batch_dim=b.dim - added if (is_cat or b.dim >= added) else b.dim,
                     ndim=out.dim() if (is_cat or b.dim >= added) else n,
                     ref=ref, ref_dim=batch[ref].dim, merged=merged, sample_ref=sample_ref,
                     sample_ref_dim=batch[sample_ref].dim if merged else 0,
                     inner=b.inner if merged == "both" else 1)
