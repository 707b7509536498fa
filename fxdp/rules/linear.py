"""``aten.linear``: ``y = x Wᵀ + b`` over any number of leading dims.

Index letters: ``n`` batch, ``t``/``s`` positions of one sample (all leading dims of
one sample flattened, ``T`` of them), ``i`` in features, ``o`` out features.

Per-sample gradients: ``∂W_n = Σ_t g_nto a_nti`` and ``∂b_n = Σ_t g_nto``.
Ghost norm (Gram route): ``‖∂W_n‖² = Σ_{t,s} (a_nt·a_ns)(g_nt·g_ns)``, which costs
``O(T²(i+o))`` per sample against ``O(T·i·o)`` for instantiating ``∂W_n``; the
cheaper of the two is chosen per layer from the sizes at compile time.
"""
from __future__ import annotations

import torch

from fxdp.registry import GRAD, OpRule, ParamRule, register_rule
from fxdp.rules._common import as_sequence, contraction_cost, gram_cost, gram_inner

__all__ = ["LINEAR", "linear_weight", "linear_bias", "MODULE_OPS"]


def _weight_per_sample_grad(g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return torch.einsum("nto,nti->noi", as_sequence(g), as_sequence(a))


def _weight_sum_grad(g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    g, a = as_sequence(g), as_sequence(a)
    return torch.mm(g.reshape(-1, g.shape[-1]).t(), a.reshape(-1, a.shape[-1]))


def _weight_ghost_sq_norm(g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return gram_inner(as_sequence(g), as_sequence(a))


def _weight_costs(shapes, **config) -> dict[str, float]:
    (n, *mid_g, o), (_, *mid_a, i) = shapes
    t = 1
    for s in mid_g:
        t = t * s
    ghost = gram_cost(n, t, i, o)
    instantiate = contraction_cost("nto,nti->noi", (n, t, o), (n, t, i)) + contraction_cost(
        "noi,noi->n", (n, o, i), (n, o, i)
    )
    return {"ghost": ghost, "instantiate": instantiate}


def _weight_concat(uses: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [
        torch.cat([as_sequence(g) for g, _ in uses], dim=1),
        torch.cat([as_sequence(a) for _, a in uses], dim=1),
    ]


def _weight_weighted_sum_grad(w: torch.Tensor, g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    # Σ_n w_n g_nᵀ a_n: scale whichever operand is smaller, then one mm over all rows.
    g, a = as_sequence(g), as_sequence(a)
    w = w.to(g.dtype).reshape(-1, 1, 1)
    if g.shape[-1] <= a.shape[-1]:
        g = g * w
    else:
        a = a * w
    return torch.mm(g.reshape(-1, g.shape[-1]).t(), a.reshape(-1, a.shape[-1]))


def _bias_weighted_sum_grad(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return torch.mv(as_sequence(g).sum(1).t(), w.to(g.dtype))


def _bias_per_sample_grad(g: torch.Tensor) -> torch.Tensor:
    return as_sequence(g).sum(1)


def _bias_sum_grad(g: torch.Tensor) -> torch.Tensor:
    return g.reshape(-1, g.shape[-1]).sum(0)


def _bias_concat(uses: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [torch.cat([as_sequence(g) for (g,) in uses], dim=1)]


linear_weight = ParamRule(
    name="linear.weight",
    operands=(GRAD, 0),
    per_sample_grad=_weight_per_sample_grad,
    sum_grad=_weight_sum_grad,
    ghost_sq_norm=_weight_ghost_sq_norm,
    costs=_weight_costs,
    concat_uses=_weight_concat,
    weighted_sum_grad=_weight_weighted_sum_grad,
)

linear_bias = ParamRule(
    name="linear.bias",
    operands=(GRAD,),
    per_sample_grad=_bias_per_sample_grad,
    sum_grad=_bias_sum_grad,
    concat_uses=_bias_concat,
    weighted_sum_grad=_bias_weighted_sum_grad,
)


def _linear_input_grad(args, grad_out, index):
    if index == 0:
        return torch.matmul(grad_out, args[1])
    raise NotImplementedError(f"linear has no differentiable non-parameter argument {index}")


def _linear_batch_rule(args_batch, args_meta, out_meta, config):
    x_batch = args_batch[0]
    if x_batch is None:
        return None
    x = args_meta[0]
    if x_batch.dim is not None and x_batch.dim == x.dim() - 1:
        raise ValueError("the batch dim is the feature dim that linear contracts")
    return x_batch


def _linear_check(args_batch, args_meta, index):
    if args_batch[0] is None:
        return (
            "the input of this linear has no batch dim, so its parameter gradient is "
            "shared by all samples; give the input a batch dim (expand it) or freeze it"
        )
    if index == 1 and args_batch[1] is not None:
        return "the weight itself is batched"
    return None


LINEAR = register_rule(
    OpRule(
        op=torch.ops.aten.linear.default,
        params={1: linear_weight, 2: linear_bias},
        input_grad=_linear_input_grad,
        batch_rule=_linear_batch_rule,
        check=_linear_check,
    )
)


# nn.RNN/LSTM/GRU are unrolled by the canonicalise pass into per-step aten.linear calls.
MODULE_OPS = {cls: (torch.ops.aten.linear.default,)
              for cls in (torch.nn.Linear, torch.nn.RNNBase, torch.nn.RNNCellBase)}
