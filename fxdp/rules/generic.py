"""The generic fallback: any op that keeps samples independent (it has a batch rule)
but has no per-sample rule for a parameter argument.

Each sample's gradient is the VJP of the op applied to that sample alone, as a batch
of one (the batch dim kept with size 1, so every dim argument of the op stays valid):
``vmap`` over samples of ``vjp(lambda p: op(..., p, ...))``. Exact, but it
materialises ``[B, *p.shape]`` and recomputes the op; it is shown as strategy
"instantiate (per-sample VJP)" in ``explain()``. DESIGN.md warns that vmap'd float32 gradients can be off
for large matmuls: this path is tested against the microbatch loop in float32.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from fxdp._torch_internals import vmap_safe_solves
from fxdp.batching import RAW, BatchDim, batch_major, from_batch_major, retrack
from fxdp.opaque import run_opaque, symbolic_batch
from fxdp.registry import GRAD, OpRule, ParamRule, call_with_schema_args, out_of_place

__all__ = ["generic_rule"]


def _one_sample(t: torch.Tensor, layout: BatchDim) -> torch.Tensor:
    """A sample's slice of a batch-major tensor, back in the op's layout (batch of one)."""
    if layout.dim in ("raw", "shared", None):
        return t
    if layout.plain:
        return t.unsqueeze(layout.dim)
    return t.movedim(0, layout.dim)  # the sample's outer·inner rows, in their order


def _symbolic_sizes(layout: BatchDim) -> bool:
    return isinstance(layout.dim, int) and any(isinstance(s, torch.SymInt) for s in (layout.inner, layout.outer))


def _listed_layout(node: Any) -> BatchDim:
    """Batch layout of a tensor inside a list argument (``RAW`` where it is shared)."""
    batch = node.meta.get("fxdp_batch")  # sorted rows as the marker puts them back in batch order
    return batch if isinstance(batch, BatchDim) and isinstance(batch.dim, int) else RAW


_INDEXING = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default,
             torch.ops.aten.index_put_.default, torch.ops.aten._unsafe_index_put.default)


def _batch_ranges(op: Any, args: tuple, layouts: dict[int, BatchDim]) -> dict[tuple[int, int], int]:
    """``{(1, d): dim}`` where ``op`` indexes its data's batch dim ``d`` with ``arange(B)``
    along ``dim`` (``out[arange(B)[:, None], ids] = v``): each sample reads or writes its
    own row, row 0 of its batch of one."""
    from fxdp.passes.batch_dims import arange_dim

    layout = layouts.get(0)
    if op not in _INDEXING or layout is None or not isinstance(layout.dim, int) or not layout.plain:
        return {}
    indices, d = args[1], layout.dim
    dim = arange_dim(indices[d]) if d < len(indices) else None
    return {} if dim is None else {(1, d): dim}


def _rows_of_shared_indices(op: Any, args: tuple, listed: list[tuple[int, int]], layouts: list[BatchDim],
                            ranges: dict[tuple[int, int], int]) -> list[BatchDim]:
    """``layouts`` of the tensors in list arguments, where a shared index tensor broadcast
    against ``arange(B)`` (or, without one, against a batched index tensor) has a dim of
    size ``B`` at its place (``out[arange(B)[:, None], idx.expand(B, k)] = v``) batched
    along that dim: sample ``b`` writes at its row ``b`` of it. Taken whole, every
    sample's own op wrote at all ``B`` rows: ``B`` times its gradient of ``v`` (or, read,
    gave an output of ``B`` rows). The analysis refuses such an index where it is not
    alike along that dim."""
    from fxdp.passes.batch_dims import _advanced_index_layout

    if ranges:
        (i, d), dim = next(iter(ranges.items()))
    else:
        # No arange(B): the batch's place is a batched index tensor's (``cb[arange(Q).expand(B,
        # Q), codes]``, a shared index alike for every sample beside each sample's codes).
        batched = [(k, j, layout) for (k, j), layout in zip(listed, layouts)
                   if isinstance(layout.dim, int) and layout.plain and isinstance(args[k], (list, tuple))]
        if op not in _INDEXING or not batched:
            return layouts
        i, d, dim = batched[0][0], batched[0][1], batched[0][2].dim
    indices = args[i]
    by_batch = indices[d].meta["val"]
    broadcast = _advanced_index_layout(indices)[1]
    at = dim + broadcast - by_batch.dim()  # the batch's place among the broadcast dims
    out = []
    for (k, j), layout in zip(listed, layouts):
        index = args[k][j].meta["val"]
        own = at - broadcast + index.dim()
        if (k == i and j != d and layout.dim in ("raw", "shared", None) and 0 <= own < index.dim()
                and index.dtype not in (torch.bool, torch.uint8) and bool(index.shape[own] == by_batch.shape[dim])):
            layout = BatchDim(own)
        out.append(layout)
    return out


def _copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``copy_``'s values out of place: ``src`` broadcast to ``self`` in its dtype (ATen's
    ``aten.copy`` has no derivative)."""
    return src.to(self.dtype).expand(self.shape)


# Out-of-place twins with a derivative, where ATen's has none.
_DIFFERENTIABLE_TWINS = {torch.ops.aten.copy_.default: _copy}


def _hinted(value: Any) -> Any:
    """``value`` with its symbolic sizes replaced by the sizes of this trace's example."""
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        hint = value.node.hint
        if hint is None:
            raise NotImplementedError("an unbacked size")
        return hint
    if isinstance(value, (list, tuple)):
        return type(value)(_hinted(v) for v in value)
    return value


def _whole_batch_only(op: Any, args: tuple, layouts: dict[int, BatchDim], out_layout: BatchDim) -> bool:
    """The op cannot run on one sample alone: the batch reaches it only through a size
    argument or a parameter-only value expanded to ``B`` (``grid_sample(x,
    grid.expand(B, H, W, 2))``), so cutting its batched arguments to one sample leaves
    them inconsistent with the rest.

    Decided by running the op on one sample's shapes on the meta device: it must accept
    them and give one sample's output.
    """
    import torch.fx as fx

    if not isinstance(out_layout, BatchDim) or not isinstance(out_layout.dim, int):
        return False
    if any(isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a) for a in args):
        return False  # tensors in lists (an index's ids): the one-sample path knows them
    batched = [layouts[i] for i, a in enumerate(args) if isinstance(a, fx.Node) and isinstance(layouts[i].dim, int)]
    if not batched:
        return out_layout.plain
    if _shared_rows_line_up(args, layouts):
        return True
    if not out_layout.plain or not all(b.plain for b in batched):
        return False  # a batch merged with other dims: the one-sample path knows it

    def one_sample_on_meta(i: int, a: Any) -> Any:
        if not isinstance(a, fx.Node):
            return _hinted(a)
        value = a.meta.get("val")
        if not isinstance(value, torch.Tensor):
            return _hinted(value)
        shape = list(_hinted(tuple(value.shape)))
        if isinstance(layouts[i].dim, int):
            shape[layouts[i].dim] = 1
        return torch.empty(shape, dtype=value.dtype, device="meta")

    try:
        meta_args = [one_sample_on_meta(i, a) for i, a in enumerate(args)]
    except NotImplementedError:
        return False
    try:
        out = call_with_schema_args(out_of_place(op) or op, meta_args)
    except NotImplementedError:
        return False  # no meta kernel: the one-sample path, as always
    except Exception:  # noqa: BLE001 - the op refuses one sample's shapes
        return True
    out = out[0] if isinstance(out, (list, tuple)) else out
    return not isinstance(out, torch.Tensor) or out.dim() <= out_layout.dim or out.shape[out_layout.dim] != 1


def _shared_rows_line_up(args: tuple, layouts: dict[int, BatchDim]) -> bool:
    """A shared tensor of a batched one's rank has ``B`` rows along its batch dim
    (``h.index_add(1, ids, p.expand(B, T, d))``): sample ``b`` then meets row ``b``
    of it, which cutting the batched arguments to one sample cannot tell from a
    broadcast. (Some meta kernels, ``index_add``'s, do not check that the shapes
    agree.) Sizes are compared by their hints; where ``B`` equals another size by
    chance, the whole-batch path is as exact, only slower."""
    import torch.fx as fx

    def value(a: Any) -> Any:
        return a.meta.get("val") if isinstance(a, fx.Node) else None

    batched = [(value(a), layouts[i].dim) for i, a in enumerate(args)
               if isinstance(value(a), torch.Tensor) and isinstance(layouts[i].dim, int)]
    shared = [value(a) for i, a in enumerate(args)
              if isinstance(value(a), torch.Tensor) and not isinstance(layouts[i].dim, int)]
    for data, dim in batched:
        if isinstance(data.shape[dim], torch.SymInt) and data.shape[dim].node.hint is None:
            continue  # rows a nonzero found, as many as the data says: no shared tensor has them
        size = _hinted(data.shape[dim])
        if size == 1:
            continue
        if any(t.dim() == data.dim() and _hinted(t.shape[dim]) == size for t in shared):
            return True
    return False


def _of_argument(compute: Any, args: Sequence[Any], index: int):
    """``compute`` as a function of its argument ``index``, the others fixed at ``args``.
    Of a multi-output op, its first output: the analysis sends one here only where the
    others carry no gradient (``linalg.solve``'s LU factors, pivots and info)."""
    def call(value):
        full = list(args)
        full[index] = value
        out = call_with_schema_args(compute, full) if hasattr(compute, "_schema") else compute(*full)
        return out[0] if isinstance(out, (list, tuple)) else out

    return call


def generic_rule(op: Any, args: tuple, param_indices: set[int], layouts: dict[int, BatchDim],
                 out_layout: BatchDim) -> OpRule:
    """An ``OpRule`` for one call of ``op`` (built per node, never registered).

    Args:
        op: The ATen op.
        args: The call's arguments (fx nodes for tensors).
        param_indices: Arguments that are parameters (or parameter-only values).
        layouts: Batch layout of each tensor argument (``RAW`` for shared ones).
        out_layout: Batch layout of the output (of each output, for a multi-output op).
    """
    import torch.fx as fx

    rule_out_layout = out_layout
    if isinstance(out_layout, (list, tuple)):  # a multi-output op: its differentiable first output
        out_layout = out_layout[0]
    # An in-place op's gradients are its out-of-place twin's at the old value, which
    # ``_Tagged`` saves; vjp cannot write into a captured tensor.
    compute = _DIFFERENTIABLE_TWINS.get(op) or out_of_place(op) or op
    tensor_indices = [i for i, a in enumerate(args) if isinstance(a, fx.Node)]
    # Tensors inside list arguments (aten.index's indices): marker operands numbered past
    # the op's arguments (see ``ParamRule.operands``); they arrive as they are, and their
    # batch layout is the one the analysis left on their nodes.
    listed = [(i, j) for i, a in enumerate(args) if isinstance(a, (list, tuple))
              for j, x in enumerate(a) if isinstance(x, fx.Node)]
    ranges = _batch_ranges(op, args, layouts)
    listed_layouts = _rows_of_shared_indices(op, args, listed, [_listed_layout(args[i][j]) for i, j in listed],
                                             ranges)
    template = [None if i in tensor_indices else (list(a) if isinstance(a, (list, tuple)) else a)
                for i, a in enumerate(args)]

    def rebuild(tensors) -> list:
        full = [list(a) if isinstance(a, list) else a for a in template]
        for i, t in zip(tensor_indices, tensors):
            full[i] = t
        for (i, j), t in zip(listed, tensors[len(tensor_indices):]):
            full[i][j] = t
        return full

    layouts_all = [layouts[i] for i in tensor_indices] + listed_layouts
    whole_batch = _whole_batch_only(op, args, layouts, out_layout)

    def layouts_now_of(known) -> list[BatchDim]:
        # The layouts' sizes come from the forward's trace: rebuilt from this one's (the
        # output's last).
        return [retrack(b, known) for b in (*layouts_all, out_layout)]

    def make_param_rule(index: int) -> ParamRule:
        in_dims = (0, *[None if b.dim in ("raw", "shared", None) else 0 for b in layouts_all])

        position = tensor_indices.index(index)

        def per_sample_grad(g, *tensors, **config):
            layouts_now = layouts_now_of((g, *tensors))
            if not symbolic_batch(g.shape[0]) or layouts_all[position].dim not in ("raw", "shared", None):
                return vjps(g, *tensors, layouts_now=layouts_now)

            def shapes(g, *tensors):
                return [g.new_empty((g.shape[0], *tensors[position].shape), dtype=tensors[position].dtype)]

            # Run on the real tensors: a merged dim's symbolic sizes travel as the sizes of
            # empty tensors, which are numbers there.
            carried = [b for b in layouts_now if _symbolic_sizes(b)]
            carriers = [g.new_empty((0, b.inner, b.outer)) for b in carried]

            def compute(g, *rest):
                sizes = iter(rest[len(tensors):])
                concrete = [BatchDim(b.dim, *next(sizes).shape[1:]) if _symbolic_sizes(b) else b
                            for b in layouts_now]
                return [vjps(g, *rest[:len(tensors)], layouts_now=concrete)]

            return run_opaque(compute, shapes, (g, *tensors, *carriers))[0]

        def vjps(g, *tensors, layouts_now):
            if whole_batch:
                return masked_vjps(g, *tensors, layouts_now=layouts_now)
            size = g.shape[0]
            tensors = [*tensors[:len(tensor_indices)],
                       *[t if b.dim in ("raw", "shared", None) else batch_major(t, b, size)
                         for t, b in zip(tensors[len(tensor_indices):], layouts_now[len(tensor_indices):-1])]]
            layouts_now, out_now = layouts_now[:-1], layouts_now[-1]

            def one(g_one, *ts):
                full = rebuild([_one_sample(t, b) for t, b in zip(ts, layouts_now)])
                for (i, j), dim in ranges.items():  # the sample's own row: row 0 of its batch of one
                    full[i][j] = torch.zeros_like(full[i][j].narrow(dim, 0, 1))

                _, vjp_fn = torch.func.vjp(_of_argument(compute, full, index), full[index])
                return vjp_fn(_one_sample(g_one, out_now))[0]

            with vmap_safe_solves():
                return torch.func.vmap(one, in_dims=in_dims)(g, *tensors)

        def masked_vjps(g, *tensors, layouts_now):
            # The op on the whole batch, once per sample; sample b's gradient is the VJP
            # at the output gradient with every other sample's rows zeroed. Exact, as
            # the samples are independent; it costs B runs of the whole op. The copies
            # run under vmap in the forward, whose backward is ordinary: vmap over a
            # VJP function runs backward formulas under vmap, and cdist's is wrong there.
            in_op = [from_batch_major(t, b) for t, b in zip(tensors[:len(tensor_indices)], layouts_now)]
            full = rebuild([*in_op, *tensors[len(tensor_indices):]])

            size = g.shape[0]
            copies = full[index].detach().expand(size, *full[index].shape)
            with vmap_safe_solves():
                _, vjp_fn = torch.func.vjp(torch.func.vmap(_of_argument(compute, full, index)), copies)
            eye = torch.eye(size, dtype=g.dtype, device=g.device).view(size, size, *[1] * (g.dim() - 1))
            one_sample_each = from_batch_major(eye * g.unsqueeze(0), layouts_now[-1], lead=1)
            return vjp_fn(one_sample_each)[0]

        def sum_grad(g, *tensors, **config):
            return per_sample_grad(g, *tensors, **config).sum(0)

        return ParamRule(
            name=f"generic.{op.__name__.split('.')[0]}[{index}]",
            operands=(GRAD, *tensor_indices, *range(len(args), len(args) + len(listed))),
            per_sample_grad=per_sample_grad,
            sum_grad=sum_grad,
        )

    def input_grad(call_args, grad_out, index):
        _, vjp_fn = torch.func.vjp(_of_argument(compute, call_args, index), call_args[index])
        return vjp_fn(grad_out)[0]

    return OpRule(
        op=op,
        params={i: make_param_rule(i) for i in param_indices},
        input_grad=input_grad,
        batch_rule=lambda *a: rule_out_layout,
    )
