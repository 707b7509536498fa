"""A loop over chunks of the batch, concatenated again, as one call on the whole batch.

``torch.cat([f(c) for c in x.chunk(k)])`` (TabNet's ghost batch norm with a virtual
batch smaller than ``B``, an attention run on a few samples at a time to save memory,
``torch.cat([layer(x[i:i + 1]) for i in range(B)])``) is ``f(x)`` whenever ``f``
keeps the rows of its input apart. Dynamo unrolls the loop, so the graph holds one copy
of ``f`` per chunk, each on a ``split`` or ``slice`` of the batch; the batch analysis
would refuse the split (or a parameter used on one sample's rows). This pass finds the
copies, checks that they are the same code, and writes ``f`` once on the whole batch::

    split = aten.split.Tensor(x, 2)                   fused = aten.linear.default(x, w, b)
    linear = aten.linear.default(split[0], w, b)  ->  relu = aten.relu.default(fused)
    relu = aten.relu.default(linear)                  (cat's uses read relu)
    linear_1 = aten.linear.default(split[1], w, b)
    relu_1 = aten.relu.default(linear_1)
    cat = aten.cat.default([relu, relu_1])

Sizes that count the chunk's rows (``view(c, [L * T, d])``) become the batch's. The
batch analysis then checks the fused code as it checks any other: the rewrite is exact
because ``f`` on the whole batch, row-wise, is ``f`` on each chunk concatenated. The
chunks' memory saving is given up: the fused ``f`` runs on all samples at once.

A loop over the samples, ``torch.stack([f(x[i]) for i in range(B)])``, has copies of
``f`` on rows without the batch dim (``select``, ``unbind``): there ``f`` is mapped
over the rows by ``torch.func.vmap``, traced to ATen (``_map``).
"""
from __future__ import annotations

import operator
import re
from typing import Any, Iterable

import torch
import torch.fx as fx

from fxdp._torch_internals import make_fx_traced, vmap_safe_solves
from fxdp.batching import BatchDim
from fxdp.errors import Problem
from fxdp.passes.batch_dims import batch_dim_pass, module_path_of, op_name, pure_op, reached, source_of
from fxdp.passes.canonicalize import in_place_as_out_of_place_pass
from fxdp.passes.copies import SIZE_ARITHMETIC, SIZE_LISTS, equal, piece_of, same_code, size_value
from fxdp.passes.writes import written_chain
from fxdp.registry import named_arg

__all__ = ["chunk_loops_as_whole_pass", "unmapped_problems"]

aten = torch.ops.aten

def chunk_loops_as_whole_pass(gm: fx.GraphModule, batch: dict[fx.Node, Any], param_names: dict[fx.Node, str],
                              fake_mode: Any, unmapped: dict | None = None) -> int:
    """Write each ``cat`` of one function's results on consecutive chunks of the batch
    as that function on the whole batch, and each ``stack`` of its results on the
    samples' rows as that function mapped over the batch.

    Args:
        gm: The canonical graph, changed in place.
        batch: Layouts from a batch analysis of ``gm`` (a chunked tensor must be batched
            along the dim it is chunked; every other tensor the loop reads must be shared
            by the samples).
        param_names: Trainable-parameter placeholders and their names.
        fake_mode: The fake mode of the graph's example values.
        unmapped: Filled, where given, with each ``cat`` of a loop over the samples that
            ``vmap`` could not trace, or over chunks whose body mixes a chunk's rows ->
            ``(why, the nodes of its copies and pieces)``, for ``unmapped_problems``.

    Returns:
        How many loops were fused (the graph is unchanged when none).
    """
    fused, unmapped = 0, {} if unmapped is None else unmapped
    for cat in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.cat.default]:
        loop = _loop(cat, batch)
        if loop is not None and (_map(gm, cat, loop, batch, fake_mode, unmapped) if loop.mapped
                                 else _fuse(gm, cat, loop, batch, param_names, fake_mode, unmapped)
                                 or (_of_single_rows(loop) and _map(gm, cat, loop, batch, fake_mode, unmapped))
                                 or (_of_samples_rows(loop, batch)
                                     and _map(gm, cat, loop, batch, fake_mode, unmapped, samples_rows=True))):
            fused += 1
    if fused:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return fused


class _Loop:
    """Copies of one function over chunks, matched with the first copy's nodes.

    Attributes:
        body: The first copy's nodes, in graph order (from the chunks to its result,
            the last).
        copies: For each chunk, the first copy's node -> this copy's node.
        pieces: The first chunk's pieces -> ``(source, dim)``, the tensor they split.
        ranges: ``(start, length)`` of each chunk along the split dim.
        varied: For each copy, ``(node, path, first copy's value, this copy's value)``
            for the integers of a size list that differ from the first copy's.
        dim: The dim of the ``cat``.
        mapped: Whether the pieces are single rows, some without their dim (``x[i]``):
            the first copy is then a function of one sample, mapped over the rows by
            ``vmap``; else of a chunk, run on the whole tensor (where that fails, a
            loop over rows ``x[i:i + 1]`` is mapped too: ``(f(x[i:i + 1]))[0]``).
        kept: The first chunk's pieces that keep the dim they were taken along.
    """

    def __init__(self, body, copies, pieces, ranges, varied, dim, mapped, kept):
        self.body, self.copies, self.pieces, self.ranges, self.varied, self.dim, self.mapped, self.kept = (
            body, copies, pieces, ranges, varied, dim, mapped, kept)


def _of_single_rows(loop: _Loop) -> bool:
    """Whether every piece of ``loop`` is one row (``x[i:i + 1]``), the rows in order:
    then the copy is a function of one sample, as with ``x[i]``."""
    return not any(loop.varied) and all(equal(length, 1) for _, length in loop.ranges) \
        and equal(loop.body[-1].meta["val"].shape[loop.dim], 1)


def _of_samples_rows(loop: _Loop, batch: dict) -> bool:
    """Whether every piece of ``loop`` is one sample's rows of a merged batch, the
    samples in order (``torch.split(h, [n] * B)`` of ``h`` ``[B·n, …]``: Llava-OneVision's
    tiles split back per image): then the copy is a function of one sample's ``n`` rows."""
    if any(loop.varied) or not loop.ranges:
        return False
    for source, dim in loop.pieces.values():
        layout = batch.get(source)
        if not (isinstance(layout, BatchDim) and layout.dim == dim and equal(layout.outer, 1)
                and not equal(layout.inner, 1) and all(equal(length, layout.inner) for _, length in loop.ranges)):
            return False
    return True


def _allowed(node: fx.Node) -> bool:
    """An op that may be fused: no write, no random draw, no call into other code."""
    target = node.target
    if target is operator.getitem or target in SIZE_ARITHMETIC:
        return True
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    # attention is tagged random for its dropout, which a probability of 0 turns off
    return pure_op(target) or (
        any(a.name == "dropout_p" for a in target._schema.arguments) and named_arg(node, "dropout_p", 0.0) == 0)


def _loop(cat: fx.Node, batch: dict) -> _Loop | None:
    """The loop whose results ``cat`` concatenates, or ``None`` where it is not one."""
    results = cat.args[0]
    if len(results) < 2 or not all(isinstance(r, fx.Node) for r in results) or len(set(results)) < len(results):
        return None
    first = results[0]
    copies, pieces_of_copy, varied = [], [], [[]]
    for result in results[1:]:
        corr, pieces, differing = {}, {}, []
        if not same_code(first, result, corr, pieces, differing, _allowed):
            return None
        copies.append(corr)
        pieces_of_copy.append(pieces)
        varied.append(differing)
    first_pieces = set(pieces_of_copy[0])
    body_set = {a for a, b in copies[0].items() if a is not b and a not in first_pieces}
    if not first_pieces or not body_set or any(
            set(p) != first_pieces or {a for a, b in corr.items() if a is not b and a not in first_pieces} != body_set
            for p, corr in zip(pieces_of_copy, copies)):
        return None
    copies.insert(0, {a: a for a in body_set | first_pieces})
    pieces_of_copy.insert(0, {p0: p0 for p0 in first_pieces})
    # The copies' code is what their values are computed by, unless a write in place
    # changes one of them (``h = x[i].clone(); h[:, 0] = h[:, 0] / 7``, SAM's prompt
    # coordinates): the write is no input of the ops after it, so it would be left out.
    read = {b for corr in copies for b in corr.values()} | {piece_of(p)[0] for p in first_pieces}
    if any(n in read for node in first.graph.nodes for n in written_chain(node) or ()):
        return None
    # Each copy reads its own chunk: the same rows of every chunked tensor, the chunks
    # in order and covering the whole tensor.
    ranges = None
    kinds = {piece_of(p0)[4] for p0 in first_pieces}  # kept the dim, or dropped it
    for p0 in first_pieces:
        source, dim, _, _, kept = piece_of(p0)
        spans = []
        for pieces in pieces_of_copy:
            s, d, start, length, k = piece_of(pieces[p0])
            if s is not source or d != dim or k != kept:
                return None
            spans.append((start, length))
        layout = batch.get(source)
        if not (isinstance(layout, BatchDim) and layout.dim == dim):
            return None
        if not all(equal(start, sum(n for _, n in spans[:k])) for k, (start, _) in enumerate(spans)) \
                or not equal(sum(n for _, n in spans), source.meta["val"].shape[dim]):
            return None
        if ranges is not None and not all(equal(a, b) for span, other in zip(spans, ranges)
                                          for a, b in zip(span, other)):
            return None
        ranges = spans
    # Nothing the copies share may come from a chunk. A copy's values may be read
    # elsewhere: the fused code computes the result anew, and the copies stay for their
    # other users. A loop with two results, each concatenated by its own ``cat``, is then
    # fused once for each (what they share computed twice); a chunk's value read by
    # anything else keeps its copy, and the refusal of its chunk.
    from_chunks = reached([pieces[p0] for pieces in pieces_of_copy for p0 in first_pieces], lambda n: n.users)
    for corr in copies:
        if any(b in from_chunks for a, b in corr.items() if a is b and a not in body_set and a not in first_pieces):
            return None
    body = [n for n in first.graph.nodes if n in body_set]
    rank = first.meta["val"].dim()
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    # A row taken with its dim (``l[i:i + 1]``) beside one without (``x[i]``, SAM's
    # image embedding beside its prompts) is mapped as the unsqueezed row.
    mapped = False in kinds
    if mapped and (any(varied) or not equal(first.meta["val"].shape[dim % rank], 1)
                   or (len(kinds) > 1 and not all(equal(length, 1) for _, length in ranges))):
        return None
    return _Loop(body, copies, {p0: piece_of(p0)[:2] for p0 in first_pieces}, ranges, varied, dim % rank, mapped,
                 {p0 for p0 in first_pieces if piece_of(p0)[4]})


def _fuse(gm: fx.GraphModule, cat: fx.Node, loop: _Loop, batch: dict, param_names: dict, fake_mode: Any,
          unmapped: dict) -> bool:
    """Write ``loop`` as its first copy on the whole chunked tensors, in place of ``cat``;
    ``False`` (and the graph unchanged) where the copy does not keep rows apart (then
    ``unmapped[cat]`` says where) or its sizes cannot be read.

    A shared tensor expanded (or built) to the chunk's rows, ``arange(n).expand_as(c)``
    (reformer's LSH ``ticker``), is first read as shared, its size a constant; where
    the fused code then does not fit the whole tensor, the copy is analysed again with
    such tensors batched along their dim of the chunk's size, which must keep the rows
    apart too, and that size becomes the whole tensor's."""
    mixing = []
    for reading in ("none", "all"):
        layouts = _body_layouts(gm, loop, batch, param_names, loop.ranges[0][1], reading,
                                mixing if reading == "none" else None)
        if layouts is not None and _fuse_as(gm, cat, loop, layouts, fake_mode):
            return True
    if mixing:
        pieces = [pieces[p0] for pieces in loop.copies for p0 in loop.pieces]
        unmapped[cat] = (_NOT_FUSED.format(why=mixing[0]),
                         {b for corr in loop.copies for b in corr.values()} | {a for p in pieces for a in p.all_input_nodes})
    return False


def _fuse_as(gm: fx.GraphModule, cat: fx.Node, loop: _Loop, layouts: dict, fake_mode: Any) -> bool:
    """``_fuse`` with the copy's batch layouts ``layouts``."""
    first_length = loop.ranges[0][1]
    result = loop.body[-1]
    out = layouts[result]
    if not (isinstance(out, BatchDim) and out.dim == loop.dim and out.outer == 1):
        return False
    # The integers that count the chunk's rows, each as (rows per sample) times the rows.
    # (With a symbolic batch size the sizes are nodes: those the copy computes from its
    # chunk's sizes follow the whole tensor's.)
    per_row = {}
    body = set(loop.body)
    for node in loop.body:
        at = SIZE_LISTS.get(node.target)
        layout = layouts.get(node)
        if at is None or not isinstance(layout, BatchDim) or layout.dim is None:
            continue
        sizes = node.args[at]
        if not isinstance(sizes, (list, tuple)) or layout.dim >= len(sizes):
            continue
        rows, entry = layout.inner * layout.outer, sizes[layout.dim]
        if (isinstance(entry, fx.Node) and entry in body) or entry == -1:
            continue
        value = size_value(entry)
        if value is None or not equal(value, first_length * rows):
            return False
        per_row[(node, (at, layout.dim))] = rows
    for k, differing in enumerate(loop.varied):
        for node, path, _, value in differing:
            rows = per_row.get((node, path))
            if rows is None or not equal(value, loop.ranges[k][1] * rows):
                return False
    total = sum(length for _, length in loop.ranges)
    env = {p0: source for p0, (source, _) in loop.pieces.items()}
    added = []
    try:
        with gm.graph.inserting_before(cat):
            if not isinstance(total, int):  # the whole tensor's size, as a node of the graph
                source, dim = next(iter(loop.pieces.values()))
                total = gm.graph.call_function(aten.sym_size.int, (source, dim))
                total.meta["val"] = source.meta["val"].shape[dim]
                added.append(total)
            for node in loop.body:
                new = gm.graph.node_copy(node, lambda n: env.get(n, n))
                added.append(new)
                at = SIZE_LISTS.get(node.target)
                if at is not None:
                    sizes = list(new.args[at]) if isinstance(new.args[at], (list, tuple)) else None
                    for (owner, (_, j)), rows in per_row.items():
                        if owner is node:
                            sizes[j] = _times(gm, total, rows, added)
                    if sizes is not None:
                        new.args = new.args[:at] + (sizes,) + new.args[at + 1:]
                with fake_mode:
                    args, kwargs = fx.node.map_arg((new.args, new.kwargs), lambda n: n.meta["val"])
                    new.meta["val"] = new.target(*args, **kwargs)
                env[node] = new
    except Exception:  # noqa: BLE001 - the sizes do not fit the whole batch: keep the loop
        for new in reversed(added):
            gm.graph.erase_node(new)
        return False
    fused, expected = env[result].meta["val"], cat.meta["val"]
    if fused.shape != expected.shape or fused.dtype != expected.dtype:
        for new in reversed(added):
            gm.graph.erase_node(new)
        return False
    cat.replace_all_uses_with(env[result])
    if all(equal(length, 1) for _, length in loop.ranges):  # (a chunk of samples' result kept: refused)
        _results_read_from(gm, loop, cat, env[result])
    gm.graph.erase_node(cat)
    return True


def _times(gm: fx.GraphModule, total: Any, rows: int, added: list) -> Any:
    """``total * rows``, a new node where ``total`` is a node."""
    if not isinstance(total, fx.Node):
        return total * rows
    if rows == 1:
        return total
    product = gm.graph.call_function(operator.mul, (total, rows))
    product.meta["val"] = total.meta["val"] * rows
    added.append(product)
    return product


def _body_layouts(gm: fx.GraphModule, loop: _Loop, batch: dict, param_names: dict, rows: int,
                  sized_batched: str, mixing: list | None = None) -> dict | None:
    """The batch layouts of the first copy's nodes, its chunks read as a batch of
    ``rows`` samples and the tensors built from ``rows`` as ``sized_batched`` says
    (``batch_dim_pass``); ``None`` where the copy mixes rows (its problems then added to
    ``mixing``, where given) or reads batched values."""
    graph, env, placeholder_batch, names = fx.Graph(), {}, {}, {}

    def placeholder(node: fx.Node, layout: Any) -> fx.Node:
        new = graph.placeholder(node.name)
        new.meta = dict(node.meta)
        placeholder_batch[new] = layout
        if node in param_names:
            names[new] = param_names[node]
        return new

    for p0, (_, dim) in loop.pieces.items():
        # Each row read as a sample: a copy that keeps them apart is exact on the whole
        # tensor however the samples lie in its rows (``x.reshape(B * T, d).chunk(k)``).
        env[p0] = placeholder(p0, BatchDim(dim))
    for node in loop.body:
        for arg in node.all_input_nodes:
            if arg not in env and arg not in loop.body:
                if batch.get(arg) is not None:  # batched, or after a refusal
                    return None
                env[arg] = placeholder(arg, None)
    for node in loop.body:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[loop.body[-1]])
    # As in a Function's body, a value that mixes rows may not reach the result even
    # when it carries no gradient: the fused code would compute a different value.
    analysis = batch_dim_pass(fx.GraphModule(gm, graph), placeholder_batch, names, batch_size=rows,
                              function_body=True, chunk=True, sized_batched=sized_batched)
    if analysis.problems:
        if mixing is not None:
            mixing.extend(analysis.problems)
        return None
    return {node: analysis.batch.get(env[node]) for node in loop.body}


def _map(gm: fx.GraphModule, cat: fx.Node, loop: _Loop, batch: dict, fake_mode: Any, unmapped: dict,
         samples_rows: bool = False) -> bool:
    """Write ``loop``, a function of one row stacked over every row, as that function
    mapped over the rows by ``vmap``, traced to ATen in place of ``cat``; ``False`` (and
    the graph unchanged) where it reads batched values or an op has no batching rule
    (then ``unmapped[cat]`` says why).

    ``torch.stack([f(x[i]) for i in range(B)])`` is ``vmap(f)(x)`` for any pure ``f``,
    whether or not ``f`` keeps the rows of a sample apart: the batching rules write
    ``f`` for the whole batch (``linear`` on ``[T, d]`` becomes ``mm`` on ``[B * T, d]``).
    With ``samples_rows`` each piece is one sample's ``n`` rows of a merged batch
    (``_of_samples_rows``), mapped over ``h.unflatten(dim, (B, -1))``; results of other
    than one row along the ``cat``'s dim are joined as the ``cat`` joins them.
    """
    body = set(loop.body)
    free = list(dict.fromkeys(a for node in loop.body for a in node.all_input_nodes
                              if a not in body and a not in loop.pieces))
    if any(batch.get(a) is not None for a in free):  # batched, or after a refusal
        return False
    graph, env = fx.Graph(), {}
    for node in [*loop.pieces, *free]:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in loop.body:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(env[loop.body[-1]])
    row = fx.Interpreter(fx.GraphModule(gm, graph))
    in_dims = tuple(dim for _, dim in loop.pieces.values()) + (None,) * len(free)

    # a row taken with its dim is the mapped row with it put back (a sample's rows are the piece)
    unsqueezed = [dim if piece in loop.kept and not samples_rows else None
                  for piece, (_, dim) in loop.pieces.items()]
    # (the samples, as many as the loop's copies: ``n`` may be symbolic, untraced here)
    samples = [len(loop.ranges) if samples_rows else None for _ in loop.pieces]
    joined = not equal(loop.body[-1].meta["val"].shape[loop.dim], 1)  # each result of several rows

    def one_row(*args):
        args = [a if d is None else a.unsqueeze(d) for a, d in zip(args, unsqueezed)] + list(args[len(unsqueezed):])
        out = row.run(*args)
        return out if joined else out.squeeze(loop.dim)

    def mapped(*args):
        args = [a if b is None else a.unflatten(d, (b, -1)) for a, b, d in zip(args, samples, in_dims)] \
            + list(args[len(samples):])
        with vmap_safe_solves():
            out = torch.func.vmap(one_row, in_dims=in_dims, out_dims=loop.dim)(*args)
        return out.flatten(loop.dim, loop.dim + 1) if joined else out

    sources = [source for source, _ in loop.pieces.values()]
    examples = [node.meta["val"] for node in [*sources, *free]]
    fallback = torch._C._functorch._is_vmap_fallback_enabled()
    torch._C._functorch._set_vmap_fallback_enabled(False)
    try:
        traced = make_fx_traced(mapped, examples, fake_mode=fake_mode)
    except Exception as e:  # noqa: BLE001 - an op without a batching rule: keep the loop
        unmapped[cat] = (_NOT_MAPPED.format(why=_why_not_mapped(e)), {b for corr in loop.copies for b in corr.values()})
        return False
    finally:
        torch._C._functorch._set_vmap_fallback_enabled(fallback)
    # vmap's batching rules may write into their own results (a row's ``linear``: ``squeeze_``)
    traced = in_place_as_out_of_place_pass(traced)
    expected, value = cat.meta["val"], traced.graph.output_node().args[0].meta.get("val")
    if value is None or value.shape != expected.shape or value.dtype != expected.dtype:
        return False
    inputs = iter([*sources, *free])
    env = {}
    with gm.graph.inserting_before(cat):
        for node in traced.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(inputs)
            elif node.op == "get_attr":
                name = _free_attr(gm, node.target)
                setattr(gm, name, getattr(traced, node.target))
                env[node] = gm.graph.get_attr(name)
                env[node].meta = dict(node.meta)
            elif node.op == "output":
                cat.replace_all_uses_with(env[node.args[0]])
                _results_read_from(gm, loop, cat, env[node.args[0]])
            else:
                env[node] = gm.graph.node_copy(node, env.__getitem__)
    gm.graph.erase_node(cat)
    return True


def _why_not_mapped(error: Exception) -> str:
    """What ``vmap`` said when it could not trace a loop's body, in one line."""
    said = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    fallback = re.match(r"(\S+) hit the vmap fallback", said)
    if fallback:
        return f"torch.func.vmap has no batching rule for {fallback.group(1)}"
    return f"torch.func.vmap raised {type(error).__name__}: {said}"


def unmapped_problems(gm: fx.GraphModule, unmapped: dict, mixing: Iterable[fx.Node]) -> list[Problem]:
    """A problem for each loop over the samples that ``vmap`` could not trace, or over
    chunks whose body mixes a chunk's rows (``unmapped``, filled by
    ``chunk_loops_as_whole_pass``), still in ``gm`` with a copy or piece among the nodes a
    batch analysis refused (``mixing``): the refusals there say how such loops run, this
    says why that one did not."""
    live, refused = set(gm.graph.nodes), set(mixing)
    return [Problem(op_name(cat.target), module_path_of(cat), "", reason, source_of(cat))
            for cat, (reason, copies) in unmapped.items() if cat in live and copies & refused]


_NOT_FUSED = (
    "it joins the results of a loop over chunks of the batch, torch.cat([f(c) for c in x.chunk(k)]), that fxdp "
    "could not run as f on the whole batch: f must keep the rows of its chunk apart, and in f, {why}")


_NOT_MAPPED = (
    "it joins the results of a loop over the samples, torch.stack([f(x[i]) for i in range(B)]), that fxdp could "
    "not run as torch.func.vmap(f): {why}, so the loop's parameter uses on one sample's values are refused; "
    "write f with ops vmap can batch, or apply them to the whole batch")


def _results_read_from(gm: fx.GraphModule, loop: _Loop, cat: fx.Node, mapped: fx.Node) -> None:
    """Each copy's result, where read after ``mapped`` (their ``cat``, mapped or fused),
    read as its rows of ``mapped`` instead: Hugging Face's Llava-OneVision returns every image's
    features as a list beside their ``cat``, which would keep the copies (and their
    parameter uses on one sample's piece) in the graph."""
    sizes = [corr[loop.body[-1]].meta["val"].shape[loop.dim] for corr in loop.copies]
    if not all(isinstance(size, int) for size in sizes):
        return
    order = {node: k for k, node in enumerate(gm.graph.nodes)}
    for k, corr in enumerate(loop.copies):
        result, start = corr[loop.body[-1]], sum(sizes[:k])
        read = [(result, aten.slice.Tensor, (mapped, loop.dim, start, start + sizes[k]))]
        if result.target is aten.unsqueeze.default and result.args[1] % result.meta["val"].dim() == loop.dim:
            # a ``stack``'s row: what it unsqueezed is row ``start`` of the stack
            read.append((result.args[0], aten.select.int, (mapped, loop.dim, start)))
        for value, op, args in read:
            later = [user for user in value.users if user is not cat and user not in corr.values()
                     and order.get(user, -1) > order[mapped]]
            if not later:
                continue
            with gm.graph.inserting_after(mapped):
                rows = gm.graph.call_function(op, args)
            rows.meta = {**value.meta, "val": value.meta["val"]}
            for user in later:
                user.replace_input_with(value, rows)


def _free_attr(gm: fx.GraphModule, name: str) -> str:
    k = 0
    while hasattr(gm, f"_fxdp_mapped_{name}_{k}"):
        k += 1
    return f"_fxdp_mapped_{name}_{k}"
