"""``aten.expand`` of a parameter to the batch: ViT's ``cls_token.expand(B, -1, -1)``.

The expand's output rows along the batch dim are copies of the parameter, and the
batch analysis hands row ``b`` to sample ``b`` (see ``_broadcast_plan``); sample
``b``'s gradient is then its output gradient summed back to the parameter's shape.

Index letters: ``n`` batch; the rest are the parameter's own dims.
"""
from __future__ import annotations

import torch

from fxdp.registry import GRAD, OpRule, ParamRule, register_rule

__all__ = ["EXPAND", "expand_self"]


def _per_sample_grad(g: torch.Tensor, *, in_shape, batch_dim) -> torch.Tensor:
    # g: [n, *expanded shape without its batch dim]
    n = g.shape[0]
    full = g.movedim(0, batch_dim)  # the expanded shape, n at batch_dim
    pad = full.dim() - len(in_shape)
    target = [1] * pad + list(in_shape)
    target[batch_dim] = n
    dims = [d for d in range(full.dim()) if d != batch_dim and target[d] == 1 and full.shape[d] != 1]
    if dims:
        full = full.sum(dims, keepdim=True)
    return full.movedim(batch_dim, 0).reshape(n, *in_shape)


def _sum_grad(g: torch.Tensor, *, in_shape, batch_dim) -> torch.Tensor:
    return _per_sample_grad(g, in_shape=in_shape, batch_dim=batch_dim).sum(0)


expand_self = ParamRule(
    name="expand.self",
    operands=(GRAD,),
    per_sample_grad=_per_sample_grad,
    sum_grad=_sum_grad,
)


def _input_grad(args, grad_out, index):
    return grad_out.sum_to_size(args[0].shape)


def _batch_rule(args_batch, args_meta, out_meta, config):
    b = args_batch[0]
    if b is None or b.dim is None:
        return b
    return b.at(b.dim + out_meta.dim() - args_meta[0].dim())


EXPAND = register_rule(OpRule(
    op=torch.ops.aten.expand.default,
    params={0: expand_self},
    input_grad=_input_grad,
    batch_rule=_batch_rule,
    config=lambda args: {"in_shape": tuple(args[0].meta["val"].shape) if hasattr(args[0], "meta") else ()},
    check=lambda args_batch, args_meta, index: (
        "an expand of a parameter is only per-sample when it creates the batch dim"),
))
