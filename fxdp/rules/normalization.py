"""Normalisation layers: ``aten.layer_norm``, ``aten.rms_norm``, ``aten.group_norm``,
``aten.instance_norm`` (``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``,
``nn.InstanceNorm*d(affine=True)``).

Index letters: ``n`` batch, ``…`` the dims of one sample that are not normalised
(positions, spatial dims), ``c`` the affine dims (the normalised shape for
layer/RMS norm, the channels for group/instance norm).

``y = x̂ ⊙ w + b`` with ``x̂`` the normalised input, so per sample
``∂w_n = Σ_… g_n…c x̂_n…c`` and ``∂b_n = Σ_… g_n…c``. ``x̂`` is recomputed in the
backward from the saved input (mean and variance of each sample's own rows, which is
why these ops are per-sample at all). The per-sample gradients have the size of the
affine parameters, so they are always instantiated.

Instance norm normalises each (sample, channel) over its spatial dims: it is group
norm with one channel per group. With ``track_running_stats=True`` in training its
running buffers average the statistics of all samples (they leak data, as
BatchNorm's do): refused.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import torch

from fxdp.batching import BatchDim
from fxdp.registry import GRAD, OpRule, ParamRule, register_rule

__all__ = [
    "LAYER_NORM",
    "RMS_NORM",
    "GROUP_NORM",
    "INSTANCE_NORM",
    "layer_norm_weight",
    "layer_norm_bias",
    "rms_norm_weight",
    "group_norm_weight",
    "group_norm_bias",
    "instance_norm_weight",
    "instance_norm_bias",
    "MODULE_OPS",
    "BATCH_NORMS",
    "BATCH_NORM_EVAL_OPS",
    "INSTANCE_NORMS",
]

aten = torch.ops.aten

_DEFAULT_EPS = 1e-5


def _arg(args: Sequence[Any], index: int, default: Any = None) -> Any:
    return args[index] if len(args) > index and args[index] is not None else default


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # Statistics of half-precision inputs are taken in float32, as the kernels do.
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


# ---------------------------------------------------------------------------
# Shared maths: x̂ and the per-sample affine gradients
# ---------------------------------------------------------------------------


def _normalized_trailing(x: torch.Tensor, num_dims: int, eps: float | None, center: bool) -> torch.Tensor:
    """``x̂`` over the last ``num_dims`` dims: layer norm (``center``) or RMS norm."""
    dtype = x.dtype
    x = x.to(_compute_dtype(x))
    dims = tuple(range(x.dim() - num_dims, x.dim()))
    if eps is None:  # rms_norm's default
        eps = torch.finfo(x.dtype).eps
    if center:
        var, mean = torch.var_mean(x, dims, correction=0, keepdim=True)
        return ((x - mean) * torch.rsqrt(var + eps)).to(dtype)
    return (x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)).to(dtype)


def _spatial_dims(t: torch.Tensor) -> list[int]:
    return list(range(2, t.dim()))


def _channel_sums(t: torch.Tensor) -> torch.Tensor:
    """``[n, c, *spatial] -> [n, c]``, reduced in place over the spatial dims: any
    memory layout is read in an order Inductor vectorises, no copy."""
    dims = _spatial_dims(t)
    return t.sum(dims) if dims else t


def _per_group(t: torch.Tensor, groups: int) -> torch.Tensor:
    """``[n, C] -> [n, G, C/G]``."""
    return t.reshape(t.shape[0], groups, t.shape[1] // groups)


def _to_channels(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[n, G, 1]`` (a value per group) or ``[n, C]`` -> ``[n, C, 1, …]`` to broadcast over ``like``."""
    n, channels = like.shape[0], like.shape[1]
    if t.dim() == 3:
        t = t.expand(n, t.shape[1], channels // t.shape[1])
    return t.reshape(n, channels, *([1] * (like.dim() - 2)))


@dataclasses.dataclass
class _GroupMoments:
    """One pass of per-channel Welford moments of ``x`` ``[n, C, *spatial]``, and each
    sample's group statistics combined from them exactly (Chan et al.:
    ``var_G = mean_c(var_c) + mean_c((μ_c − μ_G)²)``), all in the compute dtype.

    Attributes:
        channel_mean: ``μ_c``, ``[n, C]``.
        mean: ``μ_G`` broadcast to ``[n, C, 1, …]``.
        rstd: ``1/σ_G`` broadcast to ``[n, C, 1, …]``.
        per_channel: ``HW``, the elements of one channel of one sample.
    """

    channel_mean: torch.Tensor
    mean: torch.Tensor
    rstd: torch.Tensor
    per_channel: int

    @classmethod
    def of(cls, x: torch.Tensor, groups: int, eps: float) -> "_GroupMoments":
        x = x.to(_compute_dtype(x))
        dims = _spatial_dims(x)
        if dims:
            channel_var, channel_mean = torch.var_mean(x, dims, correction=0)
        else:
            channel_var, channel_mean = torch.zeros_like(x), x
        mean_g = _per_group(channel_mean, groups).mean(-1, keepdim=True)
        var_g = (_per_group(channel_var, groups) + (_per_group(channel_mean, groups) - mean_g).pow(2)).mean(
            -1, keepdim=True)
        return cls(channel_mean, _to_channels(mean_g, x), _to_channels(torch.rsqrt(var_g + eps), x),
                   math.prod(x.shape[2:]))

    def gradient_sums(self, g: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Σ g, Σ g·x̂)`` over each channel's spatial dims, ``[n, C]`` each: one pass
        over ``g`` and ``x`` (``x`` centred on its channel mean, for stability)."""
        g = g.to(self.rstd.dtype)
        centred = x.to(g.dtype) - _to_channels(self.channel_mean, x)
        sum_g, sum_gx = _channel_sums(g), _channel_sums(g * centred)
        shift = (self.channel_mean - self.mean.reshape(self.channel_mean.shape))
        return sum_g, self.rstd.reshape(sum_g.shape) * (sum_gx + shift * sum_g)


def _sum_leading(t: torch.Tensor, num_kept: int) -> torch.Tensor:
    """``[n, …, *c] -> [n, *c]`` (``num_kept`` trailing dims kept)."""
    dims = tuple(range(1, t.dim() - num_kept))
    return t.sum(dims) if dims else t


# ---------------------------------------------------------------------------
# aten.layer_norm(input, normalized_shape, weight, bias, eps, cudnn_enable)
# aten.rms_norm(input, normalized_shape, weight, eps)
# ---------------------------------------------------------------------------


def _layer_norm_config(args: Sequence[Any]) -> dict:
    return {"num_dims": len(args[1]), "eps": float(_arg(args, 4, _DEFAULT_EPS))}


def _rms_norm_config(args: Sequence[Any]) -> dict:
    eps = _arg(args, 3)
    return {"num_dims": len(args[1]), "eps": None if eps is None else float(eps)}


def _trailing_weight_rule(name: str, center: bool) -> ParamRule:
    def per_sample_grad(g, x, *, num_dims, eps):
        return _sum_leading(g * _normalized_trailing(x, num_dims, eps, center), num_dims)

    def sum_grad(g, x, *, num_dims, eps):
        return per_sample_grad(g, x, num_dims=num_dims, eps=eps).sum(0)

    return ParamRule(name=name, operands=(GRAD, 0), per_sample_grad=per_sample_grad, sum_grad=sum_grad)


def _trailing_bias_per_sample_grad(g, *, num_dims, eps):
    return _sum_leading(g, num_dims)


def _trailing_bias_sum_grad(g, *, num_dims, eps):
    return g.sum(tuple(range(g.dim() - num_dims)))


layer_norm_weight = _trailing_weight_rule("layer_norm.weight", center=True)
layer_norm_bias = ParamRule(
    name="layer_norm.bias",
    operands=(GRAD,),
    per_sample_grad=_trailing_bias_per_sample_grad,
    sum_grad=_trailing_bias_sum_grad,
)
rms_norm_weight = _trailing_weight_rule("rms_norm.weight", center=False)


def _layer_norm_input_grad(args, grad_out, index):
    x, shape, weight, bias = args[0], list(args[1]), _arg(args, 2), _arg(args, 3)
    _, mean, rstd = aten.native_layer_norm.default(x, shape, weight, bias, float(_arg(args, 4, _DEFAULT_EPS)))
    mask = [index == 0, index == 2, index == 3]
    grads = aten.native_layer_norm_backward.default(grad_out, x, shape, mean, rstd, weight, bias, mask)
    return grads[{0: 0, 2: 1, 3: 2}[index]]


def _rms_norm_input_grad(args, grad_out, index):
    """``y = x r w`` with ``r = (mean(x²) + eps)^(-1/2)`` over the normalised dims:
    ``∂x = r (g w) - x r³ mean(g w x)``, ``∂w = Σ g x r``."""
    x, weight = args[0], _arg(args, 2)
    num_dims = len(args[1])
    eps = _arg(args, 3)
    if index == 2:
        return (grad_out * _normalized_trailing(x, num_dims, eps, False)).sum_to_size(weight.shape)
    dtype = x.dtype
    xc = x.to(_compute_dtype(x))
    gw = grad_out.to(xc.dtype) if weight is None else grad_out.to(xc.dtype) * weight.to(xc.dtype)
    dims = tuple(range(x.dim() - num_dims, x.dim()))
    if eps is None:
        eps = torch.finfo(xc.dtype).eps
    rstd = torch.rsqrt(xc.pow(2).mean(dims, keepdim=True) + eps)
    grad = rstd * gw - xc * rstd.pow(3) * (gw * xc).mean(dims, keepdim=True)
    return grad.to(dtype)


def _trailing_batch_rule(args_batch, args_meta, out_meta, config):
    """The batch may sit in any leading dim (merged or not), never in a normalised one."""
    b = args_batch[0]
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    if b.dim >= args_meta[0].dim() - len(args_meta[1]):
        raise ValueError("it normalises over the batch dim")
    return b


def _check_batched_input(args_batch, args_meta, index):
    if args_batch[0] is None:
        return (
            "the input of this normalisation has no batch dim, so its parameter gradient is "
            "shared by all samples; give the input a batch dim or freeze the parameter"
        )
    return None


LAYER_NORM = register_rule(OpRule(
    op=aten.layer_norm.default,
    params={2: layer_norm_weight, 3: layer_norm_bias},
    input_grad=_layer_norm_input_grad,
    batch_rule=_trailing_batch_rule,
    config=_layer_norm_config,
    check=_check_batched_input,
))

RMS_NORM = register_rule(OpRule(
    op=aten.rms_norm.default,
    params={2: rms_norm_weight},
    input_grad=_rms_norm_input_grad,
    batch_rule=_trailing_batch_rule,
    config=_rms_norm_config,
    check=_check_batched_input,
))


# ---------------------------------------------------------------------------
# aten.group_norm(input, num_groups, weight, bias, eps, cudnn_enabled)
# aten.instance_norm(input, weight, bias, running_mean, running_var,
#                    use_input_stats, momentum, eps, cudnn_enabled)
# ---------------------------------------------------------------------------


def _rank(value: Any) -> int:
    """The number of dims of an op argument (an fx node, or a tensor)."""
    return (value.meta["val"] if hasattr(value, "meta") else value).dim()


def _group_norm_config(args: Sequence[Any]) -> dict:
    return {"groups": int(args[1]), "eps": float(_arg(args, 4, _DEFAULT_EPS)), "rank": _rank(args[0])}


def _instance_norm_config(args: Sequence[Any]) -> dict:
    # groups=None: one group per channel.
    return {"groups": None, "eps": float(_arg(args, 7, _DEFAULT_EPS)), "rank": _rank(args[0])}


def _groups_of(x: torch.Tensor, groups: int | None) -> int:
    return x.shape[1] if groups is None else groups


def _summed_over_rows(per_row_grad: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A group norm's per-sample gradient where the batch is merged with other rows of
    dim 0 (``[B·F, C, T]``: frames or frequencies folded into the batch, as video
    diffusion UNets and HDemucs do). Each row is normalised on its own, so a sample's
    gradient is the sum of its rows': batch-major operands are ``[n, r, C, …]``, one
    dim more than the op's input (``rank``)."""
    def per_sample_grad(*operands, rank, **config):
        if operands[0].dim() == rank:
            return per_row_grad(*operands, **config)
        rows = operands[0].shape[1]
        out = per_row_grad(*(t.flatten(0, 1) for t in operands), **config)
        return out.reshape(-1, rows, *out.shape[1:]).sum(1)
    return per_sample_grad


@_summed_over_rows
def _group_weight_per_sample_grad(g, x, *, groups, eps):
    """``Σ_spatial g ⊙ x̂`` per channel, from per-channel sums (two passes over ``x``)."""
    _, sum_g_normalized = _GroupMoments.of(x, _groups_of(x, groups), eps).gradient_sums(g, x)
    return sum_g_normalized.to(g.dtype)


def _group_weight_sum_grad(g, x, **config):
    return _group_weight_per_sample_grad(g, x, **config).sum(0)


@_summed_over_rows
def _group_bias_per_sample_grad(g, *, groups, eps):
    return _channel_sums(g)


def _group_bias_sum_grad(g, **config):
    return _group_bias_per_sample_grad(g, **config).sum(0)


group_norm_weight = ParamRule(
    name="group_norm.weight",
    operands=(GRAD, 0),
    per_sample_grad=_group_weight_per_sample_grad,
    sum_grad=_group_weight_sum_grad,
)
group_norm_bias = ParamRule(
    name="group_norm.bias",
    operands=(GRAD,),
    per_sample_grad=_group_bias_per_sample_grad,
    sum_grad=_group_bias_sum_grad,
)
instance_norm_weight = ParamRule(
    name="instance_norm.weight",
    operands=(GRAD, 0),
    per_sample_grad=_group_weight_per_sample_grad,
    sum_grad=_group_weight_sum_grad,
)
instance_norm_bias = ParamRule(
    name="instance_norm.bias",
    operands=(GRAD,),
    per_sample_grad=_group_bias_per_sample_grad,
    sum_grad=_group_bias_sum_grad,
)


def _native_group_norm_grad(x, grad_out, weight, bias, groups, eps, which):
    """One of (input, weight, bias) gradients of group norm, by ATen's own backward."""
    n, c = x.shape[0], x.shape[1]
    spatial = math.prod(x.shape[2:])
    # The native kernels want contiguous inputs (a movedim'd activation is not).
    x, grad_out = x.contiguous(), grad_out.contiguous()
    _, mean, rstd = aten.native_group_norm.default(x, weight, bias, n, c, spatial, groups, eps)
    mask = [which == 0, which == 1, which == 2]
    return aten.native_group_norm_backward.default(grad_out, x, mean, rstd, weight, n, c, spatial, groups, mask)[which]


def _group_norm_input_gradient(x, grad_out, weight, groups, eps):
    """``∂L/∂x = (1/σ)(ĝ − mean(ĝ) − x̂·mean(ĝ·x̂))``, ``ĝ = γ ⊙ ∂L/∂y``, the means over
    each sample's group.

    Three passes over activation-sized tensors, in any memory layout: per-channel
    moments of ``x``; per-channel ``Σ g`` and ``Σ g·x̂`` (from which both group means
    follow, ``γ`` being constant on a channel); the elementwise result.
    """
    moments = _GroupMoments.of(x, groups, eps)
    sum_g, sum_g_normalized = moments.gradient_sums(grad_out, x)
    scaled = grad_out.to(moments.rstd.dtype)
    if weight is not None:
        w = weight.to(scaled.dtype)
        scaled = scaled * w.reshape(1, x.shape[1], *([1] * (x.dim() - 2)))
        sum_g, sum_g_normalized = sum_g * w, sum_g_normalized * w
    count = moments.per_channel * (x.shape[1] // groups)
    mean_scaled = _to_channels(_per_group(sum_g, groups).sum(-1, keepdim=True) / count, x)
    mean_scaled_normalized = _to_channels(_per_group(sum_g_normalized, groups).sum(-1, keepdim=True) / count, x)
    normalized = (x.to(scaled.dtype) - moments.mean) * moments.rstd
    grad = moments.rstd * (scaled - mean_scaled - normalized * mean_scaled_normalized)
    return grad.to(x.dtype)


def _group_norm_input_grad(args, grad_out, index):
    if index == 0:
        return _group_norm_input_gradient(args[0], grad_out, _arg(args, 2), int(args[1]),
                                          float(_arg(args, 4, _DEFAULT_EPS)))
    which = {0: 0, 2: 1, 3: 2}[index]
    return _native_group_norm_grad(args[0], grad_out, _arg(args, 2), _arg(args, 3), int(args[1]),
                                   float(_arg(args, 4, _DEFAULT_EPS)), which)


def _instance_norm_input_grad(args, grad_out, index):
    """With the input's own statistics, group norm with one channel per group (with
    running statistics, eval mode, canonicalisation writes the op as its affine map)."""
    x, weight, bias = args[0], _arg(args, 1), _arg(args, 2)
    eps = float(_arg(args, 7, _DEFAULT_EPS))
    which = {0: 0, 1: 1, 2: 2}[index]
    if which == 0:
        return _group_norm_input_gradient(x, grad_out, weight, x.shape[1], eps)
    return _native_group_norm_grad(x, grad_out, weight, bias, x.shape[1], eps, which)


def _batch_first_rule(args_batch, args_meta, out_meta, config):
    """``[N, C, *spatial]``: the samples must be dim 0, possibly merged with other rows
    (each row of dim 0 has statistics of its own)."""
    b = args_batch[0]
    for other in args_batch[1:]:
        if isinstance(other, BatchDim):
            raise ValueError("an affine parameter or running statistic of the normalisation is batched")
    if not isinstance(b, BatchDim) or b.dim is None:
        return b
    if b.dim != 0:
        raise ValueError("it needs the batch at dim 0 ([N, C, ...])")
    return b


def _instance_norm_batch_rule(args_batch, args_meta, out_meta, config):
    b = _batch_first_rule(args_batch, args_meta, out_meta, config)
    use_input_stats, running_mean = args_meta[5], args_meta[3]
    if isinstance(b, BatchDim) and b.dim is not None and use_input_stats and running_mean is not None:
        raise ValueError(
            "InstanceNorm with track_running_stats=True in training averages every sample's "
            "statistics into its running buffers (they leak data); use "
            "track_running_stats=False or call .eval() on it"
        )
    return b


GROUP_NORM = register_rule(OpRule(
    op=aten.group_norm.default,
    params={2: group_norm_weight, 3: group_norm_bias},
    input_grad=_group_norm_input_grad,
    batch_rule=_batch_first_rule,
    config=_group_norm_config,
    check=_check_batched_input,
))

INSTANCE_NORM = register_rule(OpRule(
    op=aten.instance_norm.default,
    params={1: instance_norm_weight, 2: instance_norm_bias},
    input_grad=_instance_norm_input_grad,
    batch_rule=_instance_norm_batch_rule,
    config=_instance_norm_config,
    check=_check_batched_input,
))


MODULE_OPS = {
    torch.nn.LayerNorm: (aten.layer_norm.default,),
    torch.nn.RMSNorm: (aten.rms_norm.default,),
    torch.nn.GroupNorm: (aten.group_norm.default,),
    torch.nn.InstanceNorm1d: (aten.instance_norm.default,),
    torch.nn.InstanceNorm2d: (aten.instance_norm.default,),
    torch.nn.InstanceNorm3d: (aten.instance_norm.default,),
}

# BatchNorm has no rule of its own: in eval mode with running statistics canonicalisation
# writes it as a per-channel affine map (``_batch_norm_eval_as_affine``), whose parameters
# meet the elementwise rules; in training mode it mixes samples. ``fxdp.is_supported``
# answers for an instance by its mode.
BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm,
               torch.nn.LazyBatchNorm1d, torch.nn.LazyBatchNorm2d, torch.nn.LazyBatchNorm3d)
BATCH_NORM_EVAL_OPS = (aten.mul.Tensor, aten.add.Tensor)
# An InstanceNorm with running statistics updates them from the batch in training mode
# (refused); the lazy ones keep them by default, so their classes are not supported.
INSTANCE_NORMS = (torch.nn.InstanceNorm1d, torch.nn.InstanceNorm2d, torch.nn.InstanceNorm3d,
                  torch.nn.LazyInstanceNorm1d, torch.nn.LazyInstanceNorm2d, torch.nn.LazyInstanceNorm3d)
