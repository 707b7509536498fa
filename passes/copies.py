"""Whether two values are computed by the same code from different rows of one tensor.

Dynamo unrolls a loop over chunks or samples, so the graph holds one copy of the loop's
body per chunk, each on a ``split``, ``slice`` or ``select`` of the batch. ``same_code``
matches two copies node by node: the loop over chunks is fused only where the copies
are one function (``fxdp.passes.chunk_loops``), and the samples' pieces joined into a
batch again are a batch only where every sample's piece was computed by the same code
(``fxdp.passes.batch_dims``: ``cat([h[0:1] * 2, h[1:2] * 3])`` gives each sample values
that depend on its position in the batch).
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxdp.registry import named_arg

__all__ = ["BOUNDS", "SIZE_ARITHMETIC", "SIZE_LISTS", "equal", "piece_of", "row_written", "same_code", "same_constant",
           "size_value", "unwritten_source"]

aten = torch.ops.aten

_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unsafe_split.Tensor,
           aten.unsafe_chunk.default, aten.unsafe_split_with_sizes.default, aten.tensor_split.sections}


# Ops that take the output's sizes as a list, and the position of that list.
SIZE_LISTS = {
    aten.view.default: 1, aten.reshape.default: 1, aten._unsafe_view.default: 1, aten.expand.default: 1,
    aten.new_zeros.default: 1, aten.new_ones.default: 1, aten.new_empty.default: 1, aten.new_full.default: 1,
    aten.zeros.default: 0, aten.ones.default: 0, aten.empty.memory_format: 0, aten.full.default: 0,
}


# Integer arguments that bound a piece's size from its end (``h[i, :lengths[i]]``, each
# sample's own length read from a list fixed per batch, and padded back), by position;
# ``constant_pad_nd``'s are the pads after each dim (its list's odd entries).
BOUNDS = {aten.slice.Tensor: 3, aten.narrow.default: 3, aten.slice_scatter.default: 4,
          aten.constant_pad_nd.default: 1}


# What a graph with a symbolic batch size computes sizes with.
SIZE_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg,
                    operator.truediv, torch.sym_int, torch.sym_float, torch.sym_max, torch.sym_min}


def piece_of(node: Any) -> tuple[fx.Node, int, int, int, bool] | None:
    """``(source, dim, start, length, kept)`` of a piece of ``source`` along ``dim``: an
    output of a ``split``/``chunk`` or a ``slice`` with step 1 from a static start, which
    keep the dim (``kept``), or one row of it, ``select`` or an ``unbind`` output, which
    drop it (``length`` 1)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    kept = True
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0].target in _SPLITS:
        split, index = node.args[0], node.args[1]
        source = split.args[0]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        outs = split.meta.get("val")
        if outs is None or not isinstance(index, int):
            return None
        dim = dim % outs[index].dim()
        start = sum(o.shape[dim] for o in outs[:index])
        length = outs[index].shape[dim]
    elif node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
            and node.args[0].target is aten.unbind.int:
        unbind, start = node.args[0], node.args[1]
        source, dim, kept, length = unbind.args[0], named_arg(unbind, "dim", 0), False, 1
        if not isinstance(source, fx.Node) or not isinstance(start, int):
            return None
        dim = dim % source.meta["val"].dim()
    elif node.target is aten.select.int:
        source, dim, start = node.args
        kept, length = False, 1
        if not isinstance(source, fx.Node) or not isinstance(start, int):
            return None
        dim = dim % source.meta["val"].dim()
        if start < 0:
            size = source.meta["val"].shape[dim]
            if not isinstance(size, int):
                return None
            start += size
    elif node.target is aten.slice.Tensor:
        source, dim, start, _, step = (list(node.args) + [0, None, None, 1][len(node.args) - 1:])[:5]
        value = node.meta.get("val")
        if value is None or step != 1 or not isinstance(source, fx.Node):
            return None
        dim = dim % value.dim()
        start = 0 if start is None else start
        if isinstance(start, int) and start < 0:
            size = source.meta["val"].shape[dim]
            start = max(start + size, 0) if isinstance(size, int) else None
        length = value.shape[dim]
    else:
        return None
    if not all(isinstance(v, (int, torch.SymInt)) for v in (start, length)) or not isinstance(source, fx.Node):
        return None
    return source, dim, start, length, kept


def equal(a: Any, b: Any) -> bool:
    return statically_known_true(a == b)


def unwritten_source(piece: tuple) -> tuple:
    """``piece`` (as ``piece_of`` gives it) with its source taken back through the
    ``select_scatter``/``slice_scatter`` ops that wrote other rows of it along the same
    dim: those rows' new values are not what the piece reads."""
    source, dim, start, length, kept = piece
    while isinstance(source, fx.Node) and source.op == "call_function" and source.target in (
            aten.select_scatter.default, aten.slice_scatter.default) and isinstance(source.args[0], fx.Node):
        rank = source.meta["val"].dim()
        if named_arg(source, "dim", 0) % rank != dim:
            break
        if source.target is aten.select_scatter.default:
            begin = named_arg(source, "index", 0)
            begin = begin + source.meta["val"].shape[dim] if isinstance(begin, int) and begin < 0 else begin
            end = begin + 1
        else:
            begin, end = named_arg(source, "start", None) or 0, named_arg(source, "end", None)
            if named_arg(source, "step", 1) != 1 or end is None:
                break
        if not (statically_known_true(end <= start) or statically_known_true(start + length <= begin)):
            break
        source = source.args[0]
    return source, dim, start, length, kept


def same_code(first: fx.Node, other: fx.Node, corr: dict, pieces: dict, varied: list,
              allowed: Callable[[fx.Node], bool], *, through_writes: bool = False, bounds: bool = False) -> bool:
    """Whether ``other`` computes what ``first`` does, from pieces at the same places;
    records the matched nodes in ``corr`` (``first``'s -> ``other``'s), the pieces in
    ``pieces``, and the integers of size lists that differ in ``varied``. Only ops
    ``allowed`` admits are compared; ``through_writes`` reads a piece of a tensor into
    whose other rows a ``select_scatter``/``slice_scatter`` wrote as a piece of the tensor
    written into (``h[1]`` after ``h[0] = …``: ``unwritten_source``), and a row written
    as the value written (``row_written``); with ``bounds``, the integers of ``BOUNDS``
    may differ too (recorded in ``varied``), and a ``slice`` from the start on one side
    may be missing on the other."""
    # (value, value, node whose size list it is in, path there, whether it is one of BOUNDS)
    pending = [(first, other, None, (), False)]
    while pending:
        a, b, sizes_of, path, bound = pending.pop()
        if sizes_of is not None and len(path) == 2 and a is not b and (
                isinstance(a, fx.Node) or isinstance(b, fx.Node)) \
                and size_value(a) is not None and size_value(b) is not None:
            # a size the graph computes for each chunk (``(B + 1) // 2`` and
            # ``B - (B + 1) // 2`` with a symbolic batch size): checked by its value
            varied.append((sizes_of, path, size_value(a), size_value(b)))
            continue
        if isinstance(a, fx.Node) or isinstance(b, fx.Node):
            if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
                return False
            if a in corr:
                if corr[a] is not b:
                    return False
                continue
            if a is b:
                corr[a] = b
                continue
            if through_writes:
                # a row read after a write of it: the value written (``out[i]`` after ``out[i] = v``)
                read_a, read_b = row_written(a), row_written(b)
                if read_a is not None and read_b is not None:
                    pending.append((read_a, read_b, None, (), False))
                    continue
            piece_a, piece_b = piece_of(a), piece_of(b)
            if through_writes and piece_a is not None and piece_b is not None:
                piece_a, piece_b = unwritten_source(piece_a), unwritten_source(piece_b)
            if piece_a is not None and piece_b is not None and not (
                    equal(piece_a[2], piece_b[2]) and equal(piece_a[3], piece_b[3])) \
                    and piece_a[:2] == piece_b[:2] and piece_a[4] == piece_b[4]:
                # other rows of one tensor: a chunk (a loop over them is checked later)
                corr[a] = pieces[a] = b
                continue
            if bounds and _prefix(a) != _prefix(b):
                # a bound that takes the whole dim is no op (``h[i, :lengths[i]]``, left out where
                # the length is the whole sequence)
                pending.append((a.args[0], b, None, (), False) if _prefix(a) else (a, b.args[0], None, (), False))
                continue
            if piece_a is not None and piece_b is not None and not (
                    equal(piece_a[2], piece_b[2]) and equal(piece_a[3], piece_b[3])):
                return False  # rows of different tensors
            if a.op == b.op == "get_attr" and same_constant(a, b):
                corr[a] = b  # each copy's own lift of one constant (``row[mask] = 0.0``)
                continue
            if not (a.op == b.op == "call_function" and a.target == b.target and allowed(a)
                    and len(a.args) == len(b.args) and a.kwargs.keys() == b.kwargs.keys()):
                return False
            corr[a] = b
            sizes_at, bounded = SIZE_LISTS.get(a.target), BOUNDS.get(a.target) if bounds else None
            pending.extend((x, y, a if i == sizes_at else None, (i,), i == bounded)
                           for i, (x, y) in enumerate(zip(a.args, b.args)))
            pending.extend((a.kwargs[k], b.kwargs[k], None, (), False) for k in a.kwargs)
        elif isinstance(a, (list, tuple)):
            if type(a) is not type(b) or len(a) != len(b):
                return False
            pending.extend((x, y, sizes_of, path + (j,), bound and j % 2 == 1) for j, (x, y) in enumerate(zip(a, b)))
        elif type(a) is not type(b):
            return False
        elif isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            if a is not b:
                return False
        elif type(a) is int and a != b and (bound or (sizes_of is not None and len(path) == 2)):
            varied.append((sizes_of, path, a, b))
        elif not (a == b or (a != a and b != b)):  # NaN constants are the same code
            return False
        elif isinstance(a, float) and a == 0.0 and math.copysign(1.0, a) != math.copysign(1.0, b):
            return False  # -0.0 is no 0.0 (``copysign``, ``atan2`` and division tell them apart)
    return True


def _prefix(node: fx.Node) -> bool:
    """Whether ``node`` is a ``slice`` from the start with step 1 (``h[i, :n]``)."""
    if node.target is not aten.slice.Tensor:
        return False
    start, step = named_arg(node, "start", None), named_arg(node, "step", 1)
    return (start is None or (isinstance(start, int) and start == 0)) and step == 1


def row_written(node: fx.Node) -> fx.Node | None:
    """The value a ``select_scatter``/``slice_scatter`` wrote into exactly the row
    ``node`` takes (``out[i]`` after ``out[i] = v``: ``v``), past writes into other rows;
    ``None`` where ``node`` takes no such row."""
    piece = piece_of(node)
    if piece is None or not equal(piece[3], 1):
        return None
    source, dim, start, _, kept = unwritten_source(piece)
    if not (isinstance(source, fx.Node) and source.op == "call_function"
            and source.target in (aten.select_scatter.default, aten.slice_scatter.default)
            and named_arg(source, "dim", 0) % source.meta["val"].dim() == dim):
        return None
    if source.target is aten.select_scatter.default and equal(named_arg(source, "index", 0), start) and not kept:
        return source.args[1]
    if source.target is aten.slice_scatter.default and equal(named_arg(source, "start", None) or 0, start) \
            and equal(named_arg(source, "end", None), start + 1) and named_arg(source, "step", 1) == 1:
        value = source.args[1]
        if kept:
            return value
        if isinstance(value, fx.Node) and value.target is aten.unsqueeze.default \
                and named_arg(value, "dim", 0) % value.meta["val"].dim() == dim:
            return value.args[0]
    return None


def same_constant(a: fx.Node, b: fx.Node) -> bool:
    """Whether two attributes of the graph's module are tensors of the same values (or
    graphs of the same code and constants)."""
    module = a.graph.owning_module
    x, y = (getattr(module, n.target, None) for n in (a, b))
    if isinstance(x, fx.GraphModule) and isinstance(y, fx.GraphModule):
        return _same_graph(x.graph, y.graph)
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
            and x.shape == y.shape and x.device == y.device):
        return False
    try:
        # (-0.0 is no 0.0: ``copysign`` and ``atan2`` tell them apart.)
        return bool(torch.equal(x, y)) and (not x.is_floating_point()
                                            or bool(torch.equal(torch.signbit(x), torch.signbit(y))))
    except Exception:  # noqa: BLE001 - values not at hand (a fake tensor): not known equal
        return False


def _same_graph(x: fx.Graph, y: fx.Graph) -> bool:
    """Whether two graphs run the same ops on the same arguments, node by node (each
    copy's own trace of one function: an autograd.Function's forward and backward)."""
    xs, ys = list(x.nodes), list(y.nodes)
    if len(xs) != len(ys):
        return False
    at_x, at_y = {n: i for i, n in enumerate(xs)}, {n: i for i, n in enumerate(ys)}
    for a, b in zip(xs, ys):
        if a.op != b.op or (a.op != "placeholder" and a.op != "get_attr" and a.target != b.target):
            return False
        if a.op == "get_attr" and not same_constant(a, b):
            return False
        if fx.node.map_arg((a.args, a.kwargs), lambda n: at_x[n]) != fx.node.map_arg((b.args, b.kwargs),
                                                                                      lambda n: at_y[n]):
            return False
    return True


def size_value(value: Any) -> int | torch.SymInt | None:
    """The integer ``value`` is or computes, ``None`` for anything else."""
    if isinstance(value, fx.Node):
        value = value.meta.get("val")
    return value if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool) else None
