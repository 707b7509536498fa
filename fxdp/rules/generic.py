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

from typing import Any

import torch

from fxdp.batching import RAW, BatchDim, batch_major, retrack
from fxdp.opaque import run_opaque, symbolic_batch
from fxdp.registry import GRAD, OpRule, ParamRule, call_with_schema_args, out_of_place

__all__ = ["generic_rule"]


def _one_sample(t: torch.Tensor, layout: BatchDim) -> torch.Tensor:
    """A sample's slice of a batch-major tensor, back in the op's layout (batch of one)."""
    if layout.dim in ("raw", "shared", None):
        return t
    if bool(layout.inner == 1):
        return t.unsqueeze(layout.dim)
    return t.movedim(0, layout.dim)


def _listed_layout(node: Any) -> BatchDim:
    """Batch layout of a tensor inside a list argument (``RAW`` where it is shared)."""
    batch = node.meta.get("fxdp_batch")
    return batch if isinstance(batch, BatchDim) and isinstance(batch.dim, int) else RAW


_INDEXING = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default,
             torch.ops.aten.index_put_.default, torch.ops.aten._unsafe_index_put.default)


def _batch_ranges(op: Any, args: tuple, layouts: dict[int, BatchDim]) -> dict[tuple[int, int], int]:
    """``{(1, d): dim}`` where ``op`` indexes its data's batch dim ``d`` with ``arange(B)``
    along ``dim`` (``out[arange(B)[:, None], ids] = v``): each sample reads or writes its
    own row, row 0 of its batch of one."""
    from fxdp.passes.batch_dims import arange_dim

    layout = layouts.get(0)
    if op not in _INDEXING or layout is None or not isinstance(layout.dim, int) or not bool(layout.inner == 1):
        return {}
    indices, d = args[1], layout.dim
    dim = arange_dim(indices[d]) if d < len(indices) else None
    return {} if dim is None else {(1, d): dim}


def generic_rule(op: Any, args: tuple, param_indices: set[int], layouts: dict[int, BatchDim],
                 out_layout: BatchDim) -> OpRule:
    """An ``OpRule`` for one call of ``op`` (built per node, never registered).

    Args:
        op: The ATen op.
        args: The call's arguments (fx nodes for tensors).
        param_indices: Arguments that are parameters (or parameter-only values).
        layouts: Batch layout of each tensor argument (``RAW`` for shared ones).
        out_layout: Batch layout of the output.
    """
    import torch.fx as fx

    # An in-place op's gradients are its out-of-place twin's at the old value, which
    # ``_Tagged`` saves; vjp cannot write into a captured tensor.
    compute = out_of_place(op) or op
    tensor_indices = [i for i, a in enumerate(args) if isinstance(a, fx.Node)]
    # Tensors inside list arguments (aten.index's indices): marker operands numbered past
    # the op's arguments (see ``ParamRule.operands``); they arrive as they are, and their
    # batch layout is the one the analysis left on their nodes.
    listed = [(i, j) for i, a in enumerate(args) if isinstance(a, (list, tuple))
              for j, x in enumerate(a) if isinstance(x, fx.Node)]
    listed_layouts = [_listed_layout(args[i][j]) for i, j in listed]
    ranges = _batch_ranges(op, args, layouts)
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

    def make_param_rule(index: int) -> ParamRule:
        in_dims = (0, *[None if b.dim in ("raw", "shared", None) else 0 for b in layouts_all])

        position = tensor_indices.index(index)

        def per_sample_grad(g, *tensors, **config):
            if not symbolic_batch(g.shape[0]) or layouts_all[position].dim not in ("raw", "shared", None):
                return vjps(g, *tensors)

            def shapes(g, *tensors):
                return [g.new_empty((g.shape[0], *tensors[position].shape), dtype=tensors[position].dtype)]

            return run_opaque(lambda *ts: [vjps(*ts)], shapes, (g, *tensors))[0]

        def vjps(g, *tensors):
            size = g.shape[0]
            # The layouts' sizes come from the forward's trace: rebuilt from this one's.
            known = (g, *tensors)
            tensors = [*tensors[:len(tensor_indices)],
                       *[t if b.dim in ("raw", "shared", None) else batch_major(t, retrack(b, known), size)
                         for t, b in zip(tensors[len(tensor_indices):], listed_layouts)]]
            layouts_now = [retrack(b, known) for b in layouts_all]
            out_now = retrack(out_layout, known)

            def one(g_one, *ts):
                full = rebuild([_one_sample(t, b) for t, b in zip(ts, layouts_now)])
                for (i, j), dim in ranges.items():  # the sample's own row: row 0 of its batch of one
                    full[i][j] = torch.zeros_like(full[i][j].narrow(dim, 0, 1))

                def f(p):
                    a = list(full)
                    a[index] = p
                    return call_with_schema_args(compute, a)

                _, vjp_fn = torch.func.vjp(f, full[index])
                return vjp_fn(_one_sample(g_one, out_now))[0]

            return torch.func.vmap(one, in_dims=in_dims)(g, *tensors)

        def sum_grad(g, *tensors, **config):
            return per_sample_grad(g, *tensors, **config).sum(0)

        return ParamRule(
            name=f"generic.{op.__name__.split('.')[0]}[{index}]",
            operands=(GRAD, *tensor_indices, *range(len(args), len(args) + len(listed))),
            per_sample_grad=per_sample_grad,
            sum_grad=sum_grad,
        )

    def input_grad(call_args, grad_out, index):
        def f(x):
            a = list(call_args)
            a[index] = x
            return call_with_schema_args(compute, a)

        _, vjp_fn = torch.func.vjp(f, call_args[index])
        return vjp_fn(grad_out)[0]

    return OpRule(
        op=op,
        params={i: make_param_rule(i) for i in param_indices},
        input_grad=input_grad,
        batch_rule=lambda *a: out_layout,
    )
