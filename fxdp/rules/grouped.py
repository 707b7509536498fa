"""Grouped matmuls: ``out[r] = x[r] @ w[g(r)]`` for rows sorted by group, the groups'
end offsets ``offs`` (``torch._grouped_mm``, ``F.grouped_mm``, Hugging Face's
``transformers::grouped_mm_fallback``): a mixture of experts runs each expert on the
batch's tokens routed to it, sorted by expert.

The rows are those of the whole batch in the sort's order (``Rows`` in
``fxdp/batching.py``), and the offsets count the sorted keys (``Groups``), so row
``r`` is in group ``keys[r]``, its own key. The marker receives the output gradient,
the rows and, for the offsets, those keys, all put back in batch order
(``[B, n, ...]``, ``n`` rows per sample). Index letters: ``b`` sample, ``t``/``s`` its
rows, ``k`` in features, ``o`` out features, ``e`` groups.

Per-sample gradients: ``∂w_b[e] = Σ_{t: key_bt = e} x_btᵀ g_bt``, the op's own weight
gradient with the ``E`` groups split into ``B·E`` groups (sample, key). Ghost norm:
``‖∂w_b‖² = Σ_{t,s: key_bt = key_bs} (x_bt·x_bs)(g_bt·g_bs)``, a Gram inner product
over pairs of rows in one group. A row whose key is no group (an expert-parallel
sentinel past the last offset) took no weight and has no gradient.
"""
from __future__ import annotations

from typing import Any

import torch

from fxdp.registry import GRAD, OpRule, ParamRule, call_with_schema_args, register_rule, register_rule_factory
from fxdp.rules._common import gram_cost, gram_inner, hint

__all__ = ["grouped_mm_rule", "is_grouped_mm", "GROUPED_MM_OPS"]

aten = torch.ops.aten

# Ops with the schema ``(rows [S, k], weight [E, k, o], offs [E], ...)`` that have a rule.
GROUPED_MM_OPS: set = set()
# Hugging Face's fallback for dtypes and devices ``torch._grouped_mm`` does not take
# (float32 under torch.compile, float64); registered once transformers defines it.
_BY_NAME = ("transformers::grouped_mm_fallback",)


def is_grouped_mm(target: Any) -> bool:
    """Whether ``target`` is a grouped matmul fxdp has a rule for."""
    if target in GROUPED_MM_OPS:
        return True
    schema = getattr(target, "_schema", None)
    return schema is not None and schema.name in _BY_NAME and target._overloadname == "default"


def _meta(arg: Any) -> Any:
    return arg.meta.get("val") if hasattr(arg, "meta") else arg


def grouped_mm_rule(op: Any) -> OpRule:
    """The rule of a grouped matmul ``op(rows, weight, offs, ...)`` whose weight is the
    parameter (register it with ``fxdp.register_rule`` for an op of one's own with
    ``torch._grouped_mm``'s meaning and first three arguments)."""

    def run(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return call_with_schema_args(op, (x, w, offs))

    def group_sums(g: torch.Tensor, x: torch.Tensor, key: torch.Tensor, groups: Any) -> torch.Tensor:
        """``[groups, k, o]``: ``Σ_{r: key_r = e} x_rᵀ g_r`` over rows ``[S, k]``,
        ``[S, o]``, by the op's own weight gradient on the rows sorted by key (a key
        outside ``0 … groups - 1`` is in no group)."""
        valid = (key >= 0) & (key < groups)
        key = torch.where(valid, key, groups)  # sorted past the last offset: no group's
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(groups + 1, dtype=torch.int64, device=key.device).index_add_(
            0, key, torch.ones_like(key))
        offs = counts[:groups].cumsum(0).to(torch.int32)
        x, g = x[order], g[order]
        with torch.enable_grad():  # the op's own backward (a custom op's has no functorch support)
            weight = x.detach().new_zeros(groups, x.shape[-1], g.shape[-1]).requires_grad_()
            return torch.autograd.grad(run(x.detach(), weight, offs), weight, g.to(x.dtype))[0]

    def rows(g, x, keys):
        return g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1]), keys.reshape(-1).long()

    def per_sample_grad(g, x, keys, *, groups):
        size = g.shape[0]
        sample = torch.arange(size, device=keys.device).unsqueeze(1).expand(keys.shape).reshape(-1)
        g2, x2, key = rows(g, x, keys)
        valid = (key >= 0) & (key < groups)
        key = torch.where(valid, sample * groups + key, size * groups)
        out = group_sums(g2, x2, key, size * groups)
        return out.reshape(size, groups, *out.shape[1:])

    def sum_grad(g, x, keys, *, groups):
        return group_sums(*rows(g, x, keys), groups)

    def weighted_sum_grad(w, g, x, keys, *, groups):
        return sum_grad(g * w.to(g.dtype).reshape(-1, 1, 1), x, keys, groups=groups)

    def ghost_sq_norm(g, x, keys, *, groups):
        key = keys.long()
        valid = (key >= 0) & (key < groups)
        same = (key.unsqueeze(-1) == key.unsqueeze(-2)) & valid.unsqueeze(-1) & valid.unsqueeze(-2)
        return gram_inner(g, x.to(g.dtype), same.to(g.dtype))

    def costs(shapes, *, groups):
        (n, t, o), (_, _, k), _ = shapes
        n, t, o, k, e = (hint(s) for s in (n, t, o, k, groups))
        ghost = gram_cost(n, t, k, o)
        instantiate = 4.0 * n * t * k * o + 2.0 * n * e * k * o
        return {"ghost": ghost, "instantiate": instantiate}

    weight = ParamRule(
        name="grouped_mm.weight",
        operands=(GRAD, 0, 2),
        per_sample_grad=per_sample_grad,
        sum_grad=sum_grad,
        ghost_sq_norm=ghost_sq_norm,
        costs=costs,
        weighted_sum_grad=weighted_sum_grad,
    )

    def input_grad(args, grad_out, index):
        if index != 0:
            raise NotImplementedError(f"{op}: only the rows (argument 0) take a gradient besides the weight")
        # Row r's gradient is g_r w[g(r)]ᵀ: the grouped matmul by the transposed weight
        # (a bias, ``torch._grouped_mm``'s fourth argument, has no part in it).
        return run(grad_out, args[1].transpose(-2, -1), args[2]).to(args[0].dtype)

    def batch_rule(args_batch, args_meta, out_meta, config):
        # Sorted rows (``Rows``) are followed by the batch analysis itself.
        if args_batch[0] is None and args_batch[2] is None:
            return None
        raise ValueError(
            "a grouped matmul groups rows of the whole batch: fxdp follows it only on rows a sort of "
            "the batch's keys ordered, with the offsets counted from those sorted keys")

    def check(args_batch, args_meta, index):
        from fxdp.batching import Groups

        if index != 1:
            return f"only the weight (argument 1) of {op} can be a trainable parameter here"
        if args_batch[1] is not None:
            return "the weight itself is batched"
        if not isinstance(args_batch[2], Groups):  # the analysis checked the rows are the sorted ones
            return ("its rows are not the batch's rows sorted by a key fxdp follows, with offsets "
                    "counted from those sorted keys")
        return None

    def config(args):
        return {"groups": _meta(args[1]).shape[0]}

    GROUPED_MM_OPS.add(op)
    return OpRule(op=op, params={1: weight}, input_grad=input_grad, batch_rule=batch_rule,
                  config=config, check=check)


register_rule(grouped_mm_rule(aten._grouped_mm.default))
for _name in _BY_NAME:
    register_rule_factory(_name, grouped_mm_rule)
