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

from fxdp.batching import BatchDim
from fxdp.registry import GRAD, OpRule, ParamRule, call_with_schema_args, out_of_place

__all__ = ["generic_rule"]


def _one_sample(t: torch.Tensor, layout: BatchDim) -> torch.Tensor:
    """A sample's slice of a batch-major tensor, back in the op's layout (batch of one)."""
    if layout.dim in ("raw", "shared", None):
        return t
    if bool(layout.inner == 1):
        return t.unsqueeze(layout.dim)
    return t.movedim(0, layout.dim)


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
    template = [None if i in tensor_indices else a for i, a in enumerate(args)]

    def rebuild(tensors) -> list:
        full = list(template)
        for i, t in zip(tensor_indices, tensors):
            full[i] = t
        return full

    def make_param_rule(index: int) -> ParamRule:
        in_dims = (0, *[None if layouts[i].dim in ("raw", "shared", None) else 0 for i in tensor_indices])

        def per_sample_grad(g, *tensors, **config):
            def one(g_one, *ts):
                full = rebuild([_one_sample(t, layouts[i]) for i, t in zip(tensor_indices, ts)])

                def f(p):
                    a = list(full)
                    a[index] = p
                    return call_with_schema_args(compute, a)

                _, vjp_fn = torch.func.vjp(f, full[index])
                return vjp_fn(_one_sample(g_one, out_layout))[0]

            return torch.func.vmap(one, in_dims=in_dims)(g, *tensors)

        def sum_grad(g, *tensors, **config):
            return per_sample_grad(g, *tensors, **config).sum(0)

        return ParamRule(
            name=f"generic.{op.__name__.split('.')[0]}[{index}]",
            operands=(GRAD, *tensor_indices),
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
