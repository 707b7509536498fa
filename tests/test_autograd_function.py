"""``torch.autograd.Function`` in a model, with its hand-written backward (``fxdp/functions.py``).

Real models carry their own Functions: straight-through estimators, memory-efficient
activations (timm's ``SwishAutoFn``), gradient reversal, fused layers that consume a
weight. fxdp keeps each call with its own backward, checks that both its forward and
its backward keep samples independent, and makes a parameter it consumes per-sample
either by a rule registered for the Function class or by running its backward on each
sample as a batch of one (under ``vmap``). Every case is checked against the microbatch
loop, whose eager autograd runs the very same Functions.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fxdp
from fxdp.registry import GRAD, RULES
from reference import assert_close_all, reference, tolerance

D = 6


# -- the Functions -------------------------------------------------------------------------------

class RoundSTE(torch.autograd.Function):
    """Quantise to quarters; the straight-through estimator passes the gradient as it is."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class Swish(torch.autograd.Function):
    """timm's memory-efficient Swish: saves the input, recomputes the sigmoid."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * (s * (1 + x * (1 - s)))


class GradReverse(torch.autograd.Function):
    """Gradient reversal (domain-adversarial training), with a constant argument."""

    @staticmethod
    def forward(ctx, x, strength):
        ctx.strength = strength
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.strength * grad, None


class ScaleWithMask(torch.autograd.Function):
    """Two outputs, the second non-differentiable; a constant between the tensors; the
    parameter ``scale`` (argument 2) is read before ``x`` in the forward."""

    @staticmethod
    def forward(ctx, x, alpha, scale):
        y = scale * x * alpha
        mask = (x > 0).to(x.dtype)
        ctx.mark_non_differentiable(mask)
        ctx.save_for_backward(x, scale)
        ctx.alpha = alpha
        return y, mask

    @staticmethod
    def backward(ctx, grad, _grad_mask):
        x, scale = ctx.saved_tensors
        grad_scale = (grad * x * ctx.alpha).reshape(-1, x.shape[-1]).sum(0)
        return grad * scale * ctx.alpha, None, grad_scale


class SquaredScale(torch.autograd.Function):
    """``x * w²`` whose backward leaves the gradient of ``w`` (shape ``[d]``) unreduced,
    shaped like ``x``: autograd sums it to ``w``'s shape, and each sample's must be summed
    the same way."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w * w, grad * x * 2 * w


class LinearFn(torch.autograd.Function):
    """A fused linear layer with weight and bias, as C++/Triton extensions write them."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        return grad @ weight, g2.t() @ x2, g2.sum(0)


class SwishLinearFn(torch.autograd.Function):
    """Calls other Functions in its forward; its own backward is the whole chain's."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return LinearFn.apply(Swish.apply(x), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        s = torch.sigmoid(x)
        g2, a2 = grad.reshape(-1, grad.shape[-1]), (x * s).reshape(-1, x.shape[-1])
        return (grad @ weight) * (s * (1 + x * (1 - s))), g2.t() @ a2, g2.sum(0)


class DoubleInPlace(torch.autograd.Function):
    """Writes into its input (``ctx.mark_dirty``)."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class CenterOverBatch(torch.autograd.Function):
    """Mixes samples in its forward (a batch statistic)."""

    @staticmethod
    def forward(ctx, x):
        return x - x.mean(0, keepdim=True)

    @staticmethod
    def backward(ctx, grad):
        return grad - grad.mean(0, keepdim=True)


class NormalizeGrad(torch.autograd.Function):
    """Samples independent forward, but its backward normalises the whole batch's gradient."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        return grad / grad.norm()


class ScaleAndReturnIt(torch.autograd.Function):
    """Returns the parameter-only ``2 * scale`` beside the batched output."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x, scale)
        return x * scale, scale * 2

    @staticmethod
    def backward(ctx, grad, grad_twice):
        x, scale = ctx.saved_tensors
        return grad * scale, (grad * x).reshape(-1, x.shape[-1]).sum(0) + 2 * grad_twice


class MaskedSoftmax(torch.autograd.Function):
    """DeBERTa's and SEW-D's ``XSoftmax``: a softmax over the last dim with masked entries,
    whose backward calls ``torch._softmax_backward_data``."""

    @staticmethod
    def forward(ctx, x, mask):
        out = torch.softmax(x.masked_fill(~mask, torch.finfo(x.dtype).min), -1).masked_fill(~mask, 0)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad, out, -1, out.dtype), None


# An activation, and the ATen op for its gradient (``grad``, the input): what a
# Function's hand-written backward may call.
ACTIVATION_GRADIENTS = {
    "hardtanh": (lambda x: torch.nn.functional.hardtanh(x, -0.5, 0.5),
                 lambda g, x: torch.ops.aten.hardtanh_backward(g, x, -0.5, 0.5)),
    "leaky_relu": (lambda x: torch.nn.functional.leaky_relu(x, 0.1),
                   lambda g, x: torch.ops.aten.leaky_relu_backward(g, x, 0.1, False)),
    "elu": (torch.nn.functional.elu, lambda g, x: torch.ops.aten.elu_backward(g, 1.0, 1.0, 1.0, False, x)),
    "softplus": (torch.nn.functional.softplus, lambda g, x: torch.ops.aten.softplus_backward(g, x, 1.0, 20.0)),
    "hardswish": (torch.nn.functional.hardswish, torch.ops.aten.hardswish_backward),
    "hardsigmoid": (torch.nn.functional.hardsigmoid, torch.ops.aten.hardsigmoid_backward),
    "mish": (torch.nn.functional.mish, torch.ops.aten.mish_backward),
}


class SolveFn(torch.autograd.Function):
    """``y = W⁻¹ h`` for each vector ``h``, with a backward written by hand that solves
    again with ``torch.linalg.solve``: its error check is an effectful op, so the
    backward graph threads an effect token out beside the gradients."""

    @staticmethod
    def forward(ctx, h, w):
        y = torch.linalg.solve(w, h.unsqueeze(-1)).squeeze(-1)
        ctx.save_for_backward(w, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        w, y = ctx.saved_tensors
        grad_h = torch.linalg.solve(w.mT, grad.unsqueeze(-1)).squeeze(-1)
        return grad_h, -(grad_h.unsqueeze(-1) * y.unsqueeze(-2)).flatten(0, -3).sum(0)


class SpectralScale(torch.autograd.Function):
    """``y = Re(ifft(fft(h) · w))`` for a complex filter ``w``, with a backward written
    by hand in PyTorch's convention for complex gradients (the conjugates autograd
    takes: ``grad_w = grad_z · conj(fft(h))``)."""

    @staticmethod
    def forward(ctx, h, w):
        spectrum = torch.fft.fft(h)
        ctx.save_for_backward(spectrum, w)
        return torch.fft.ifft(spectrum * w).real

    @staticmethod
    def backward(ctx, grad):
        spectrum, w = ctx.saved_tensors
        grad_z = torch.fft.fft(grad.to(spectrum.dtype)) / grad.shape[-1]
        grad_h = torch.fft.ifft(grad_z * w.conj()).real * grad.shape[-1]
        return grad_h, (grad_z * spectrum.conj()).reshape(-1, w.shape[-1]).sum(0)


class ActivationByATen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name):
        ctx.save_for_backward(x)
        ctx.name = name
        return ACTIVATION_GRADIENTS[name][0](x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return ACTIVATION_GRADIENTS[ctx.name][1](grad, x), None


@pytest.mark.parametrize("name", list(ACTIVATION_GRADIENTS))
def test_backward_written_with_an_activations_aten_gradient(name):
    torch.manual_seed(0)
    model = Model(lambda m, h: ActivationByATen.apply(h, name) * h, {}).double()
    dp_model = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    _check(model, dp_model, _batch((5, 3, D), torch.float64), mode="grad_sample", reduction="sum")


# -- the models ----------------------------------------------------------------------------------

class Model(nn.Module):
    """``fc -> body -> head``: ``body(self, h)`` calls the Functions."""

    def __init__(self, body: Callable, params: dict[str, tuple]):
        super().__init__()
        self.body = body
        self.fc = nn.Linear(D, D)
        for name, shape in params.items():
            self.register_parameter(name, nn.Parameter(torch.randn(*shape) / shape[-1] ** 0.5))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        return self.head(self.body(self, self.fc(x)))


def _scale_with_mask(m, h):
    y, mask = ScaleWithMask.apply(h, 3.0, m.scale)
    return y * mask + y


def _swish_linear(m, h):
    return LinearFn.apply(Swish.apply(h), m.weight, m.bias)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    body: Callable
    params: dict = dataclasses.field(default_factory=dict)


CASES = [
    Case("straight-through", lambda m, h: RoundSTE.apply(h)),
    Case("swish", lambda m, h: Swish.apply(h)),
    Case("gradient-reversal", lambda m, h: torch.tanh(GradReverse.apply(h, 0.5))),
    Case("multi-output-with-parameter", _scale_with_mask, {"scale": (D,)}),
    Case("linear-function", _swish_linear, {"weight": (D, D), "bias": (D,)}),
    Case("parameter-transformed-before", lambda m, h: LinearFn.apply(h, m.weight.t() * 2, m.bias),
         {"weight": (D, D), "bias": (D,)}),
    Case("checkpointed", lambda m, h: checkpoint(_swish_linear, m, h, use_reentrant=False),
         {"weight": (D, D), "bias": (D,)}),
    Case("composed-in-module-code", lambda m, h: Swish.apply(RoundSTE.apply(h)) + h),
    Case("function-calling-functions", lambda m, h: SwishLinearFn.apply(h, m.weight, m.bias),
         {"weight": (D, D), "bias": (D,)}),
    Case("in-place", lambda m, h: DoubleInPlace.apply(h * 1.0)),
    # On the parameters alone (quantisation-aware training): a parameter transform.
    Case("quantised-weight", lambda m, h: torch.nn.functional.linear(h, RoundSTE.apply(m.weight), m.bias),
         {"weight": (D, D), "bias": (D,)}),
    Case("weight-through-saving-function", lambda m, h: h * Swish.apply(m.scale), {"scale": (D,)}),
    Case("unreduced-parameter-gradient", lambda m, h: SquaredScale.apply(h, m.scale), {"scale": (D,)}),
    Case("softmax-backward-data", lambda m, h: MaskedSoftmax.apply(h, torch.arange(D) % 3 != 0) * h),
    Case("effectful-backward", lambda m, h: SolveFn.apply(h, m.weight + 2 * torch.eye(D, dtype=h.dtype)),
         {"weight": (D, D)}),
]


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).reshape(out.shape[0], -1).sum(1)


def _batch(shape, dtype, seed=1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _check(model: nn.Module, dp_model: Callable, x: torch.Tensor, *, mode: str, reduction: str,
           clip: float | None = None) -> fxdp.DPModule:
    ref = reference(model, (x,), lambda out, i: _loss(out).sum())
    for p in model.parameters():
        p.grad = None
    loss = _loss(dp_model(x))
    (loss.mean() if reduction == "mean" else loss.sum()).backward()
    params = dict(model.named_parameters())
    tol = tolerance(x.dtype)
    if mode == "grad_sample":
        assert_close_all({n: p.grad_sample for n, p in params.items()}, ref.per_sample, tol, "grad_sample")
        assert_close_all({n: p.grad for n, p in params.items()}, ref.grad(reduction), tol, "grad")
    else:
        assert_close_all({n: p.grad for n, p in params.items()}, ref.grad(reduction, clip), tol, "clipped grad")
        torch.testing.assert_close(fxdp.per_sample_norms(model).to(ref.norms.dtype), ref.norms,
                                   rtol=tol * 10, atol=tol * 10)
    return ref


@pytest.mark.parametrize("shape", [(5, D), (4, 3, D)], ids=["2d", "3d"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("mode", ["grad_sample", "clip"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_function_matches_the_loop(case: Case, mode: str, reduction: str, dtype: torch.dtype, shape):
    torch.manual_seed(0)
    model = Model(case.body, case.params).to(dtype)
    x = _batch(shape, dtype)
    clip = None
    if mode == "clip":
        clip = float(reference(model, (x,), lambda out, i: _loss(out).sum()).norms.median())
    dp_model = fxdp.transform(model, grad_sample=mode == "grad_sample", max_grad_norm=clip,
                              loss_reduction=reduction, compiler="eager")
    _check(model, dp_model, x, mode=mode, reduction=reduction, clip=clip)


@pytest.mark.parametrize("path", ["parameter", "transform"])
@pytest.mark.parametrize("mode", ["grad_sample", "clip"])
def test_a_function_computing_with_complex_values_runs_its_own_backward_per_sample(path, mode):
    """A complex parameter (or one made complex by ``view_as_complex``) given to a
    Function: the Function's own backward, run per sample, is autograd's convention for
    complex gradients whatever the rules assume, so no rule stands in for it. Norms are
    ``sqrt(Σ |g|²)``; the clipped gradient stays complex."""
    torch.manual_seed(0)
    model = Model(lambda m, h: h, {}).double()
    if path == "parameter":
        model.filter = nn.Parameter(torch.randn(D, dtype=torch.complex128))
        model.body = lambda m, h: SpectralScale.apply(h, m.filter)
    else:
        model.filter = nn.Parameter(torch.randn(D, 2, dtype=torch.float64))
        model.body = lambda m, h: SpectralScale.apply(h, torch.view_as_complex(m.filter))
    x = _batch((4, 3, D), torch.float64)
    clip = float(reference(model, (x,), lambda out, i: _loss(out).sum()).norms.median()) if mode == "clip" else None
    dp_model = fxdp.transform(model, grad_sample=mode == "grad_sample", max_grad_norm=clip, loss_reduction="sum",
                              compiler="eager")
    _check(model, dp_model, x, mode=mode, reduction="sum", clip=clip)
    assert dp_model.explain().rule_counts["function.SpectralScale[1]"] == 1
    _check(model, dp_model, _batch((6, 3, D), torch.float64, seed=6), mode=mode, reduction="sum", clip=clip)


def test_a_function_with_a_rule_is_refused_on_a_complex_path():
    """A rule registered for a Function is written for real values: on a complex path
    fxdp refuses it rather than use it (without the rule, the Function's own backward
    runs per sample, above)."""
    def per_sample_grad(g, h):  # [B, T, D] -> [B, D]
        return (torch.fft.fft(g.to(torch.complex128)) * torch.fft.fft(h).conj()).sum(1) / g.shape[-1]

    rule = fxdp.OpRule(op=SpectralScale, params={1: fxdp.ParamRule(
        name="spectral_scale.filter", operands=(GRAD, 0), per_sample_grad=per_sample_grad,
        sum_grad=lambda g, h: per_sample_grad(g, h).sum(0))})
    fxdp.register_rule(rule)
    try:
        model = Model(lambda m, h: SpectralScale.apply(h, m.filter), {}).double()
        model.filter = nn.Parameter(torch.randn(D, dtype=torch.complex128))
        dp_model = fxdp.transform(model, grad_sample=True, compiler="eager")
        with pytest.raises(fxdp.UnsupportedError, match="computes with complex values.*without a registered rule"):
            dp_model(_batch((4, 3, D), torch.float64))
    finally:
        del RULES[SpectralScale]


def test_function_parameter_without_rule_is_shown_as_its_backward_per_sample():
    torch.manual_seed(0)
    model = Model(_swish_linear, {"weight": (D, D), "bias": (D,)}).double()
    dp_model = fxdp.transform(model, grad_sample=True, compiler="eager")
    _loss(dp_model(_batch((5, D), torch.float64))).sum().backward()
    report = dp_model.explain()
    assert report.rule_counts == {"linear.weight": 2, "linear.bias": 2, "function.LinearFn[1]": 1,
                                  "function.LinearFn[2]": 1}, report.rule_counts
    text = str(report)
    assert "weight: rule=function.LinearFn[1]" in text and "strategy=instantiate (per-sample VJP)" in text, text


def test_new_batch_sizes_and_a_batch_of_one():
    """Dynamic batch sizes (the sizes the Function saves are symbolic) and ``B == 1``."""
    torch.manual_seed(0)
    model = Model(_swish_linear, {"weight": (D, D), "bias": (D,)}).double()
    dp_model = fxdp.transform(model, grad_sample=True, compiler="eager")
    for size in (5, 7, 9, 1):
        _check(model, dp_model, _batch((size, 3, D), torch.float64, seed=size), mode="grad_sample",
               reduction="mean")


class ScaleBySequence(torch.autograd.Function):
    """Saves a size on ``ctx`` (the sequence length, symbolic once lengths vary) and
    reads it in its backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x, scale)
        ctx.length = x.shape[1]
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        x, scale = ctx.saved_tensors
        return grad * scale, (grad * x).reshape(-1, ctx.length, x.shape[-1]).sum((0, 1))


def test_size_saved_on_ctx_over_new_sequence_lengths():
    torch.manual_seed(0)
    model = Model(lambda m, h: ScaleBySequence.apply(h, m.scale), {"scale": (D,)}).double()
    dp_model = fxdp.transform(model, grad_sample=True, compiler="eager")
    for length in (3, 4, 5):
        _check(model, dp_model, _batch((4, length, D), torch.float64, seed=length), mode="grad_sample",
               reduction="mean")


def test_through_the_torch_compile_backend():
    torch.manual_seed(0)
    model = Model(_scale_with_mask, {"scale": (D,)}).double()
    compiled = torch.compile(model, backend=fxdp.backend(grad_sample=True, compiler="eager"))
    for size in (5, 7):
        _check(model, compiled, _batch((size, D), torch.float64, seed=size), mode="grad_sample",
               reduction="mean")


class LayerNorm2dFunction(torch.autograd.Function):
    """NAFNet's (and KBNet's) ``LayerNorm2d``, as written there: over the channels of
    ``[N, C, H, W]``, reading the deprecated ``ctx.saved_variables`` in its backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        ctx.eps = eps
        _, C, _, _ = x.size()
        mu = x.mean(1, keepdim=True)
        var = (x - mu).pow(2).mean(1, keepdim=True)
        y = (x - mu) / (var + eps).sqrt()
        ctx.save_for_backward(y, var, weight)
        return weight.view(1, C, 1, 1) * y + bias.view(1, C, 1, 1)

    @staticmethod
    def backward(ctx, grad_output):
        _, C, _, _ = grad_output.size()
        y, var, weight = ctx.saved_variables
        g = grad_output * weight.view(1, C, 1, 1)
        mean_g = g.mean(dim=1, keepdim=True)
        mean_gy = (g * y).mean(dim=1, keepdim=True)
        gx = 1. / torch.sqrt(var + ctx.eps) * (g - y * mean_gy - mean_g)
        return gx, (grad_output * y).sum(dim=3).sum(dim=2).sum(dim=0), grad_output.sum(dim=3).sum(dim=2).sum(dim=0), None


class NAFBlock(nn.Module):
    def __init__(self, channels: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.weight = nn.Parameter(torch.rand(channels) + 0.5)
        self.bias = nn.Parameter(torch.randn(channels))

    def forward(self, x):
        return x + LayerNorm2dFunction.apply(self.conv(x), self.weight, self.bias, 1e-6)


@pytest.mark.filterwarnings("ignore:'saved_variables' is deprecated")
@pytest.mark.parametrize("entry", ["transform", "backend"])
@pytest.mark.parametrize("mode", ["grad_sample", "clip"])
def test_a_backward_reading_the_deprecated_saved_variables(entry, mode):
    """Dynamo knows ``ctx.saved_tensors`` only: fxdp reads ``saved_variables`` as it (plain
    ``torch.compile(fullgraph=True)`` fails on it, and fxdp refused the model)."""
    torch._dynamo.reset()
    model = NAFBlock().double()
    x = _batch((5, 4, 3, 3), torch.float64)
    clip = reference(model, (x,), lambda out, i: _loss(out).sum()).norms.median().item() if mode == "clip" else None
    options = {"grad_sample": True} if mode == "grad_sample" else {"max_grad_norm": clip}
    dp_model = (fxdp.transform(model, compiler="eager", **options) if entry == "transform"
                else torch.compile(model, backend=fxdp.backend(compiler="eager", **options)))
    _check(model, dp_model, x, mode=mode, reduction="mean", clip=clip)


def test_captures_do_not_accumulate():
    """What fxdp keeps of a Function call lives as long as the graphs that use it."""
    import gc

    from fxdp.functions import _CALLS

    def run_once():
        model = Model(_swish_linear, {"weight": (D, D), "bias": (D,)}).double()
        dp_model = fxdp.transform(model, grad_sample=True, compiler="eager")
        _loss(dp_model(_batch((4, 3, D), torch.float64))).sum().backward()

    torch._dynamo.reset()
    gc.collect()
    before = len(_CALLS)
    for _ in range(3):
        run_once()
        torch._dynamo.reset()
    gc.collect()
    assert len(_CALLS) == before


def test_inductor():
    torch.manual_seed(0)
    model = Model(_swish_linear, {"weight": (D, D), "bias": (D,)})
    x = _batch((8, 3, D), torch.float32)
    clip = float(reference(model, (x,), lambda out, i: _loss(out).sum()).norms.median())
    dp_model = fxdp.transform(model, max_grad_norm=clip, compiler="inductor")
    _check(model, dp_model, x, mode="clip", reduction="mean", clip=clip)


# -- a rule registered for a Function -------------------------------------------------------------

def _sequence(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1, t.shape[-1])


CALLED: list[str] = []


def _weight_per_sample(g, x):
    CALLED.append("per_sample_grad")
    return torch.einsum("nto,nti->noi", _sequence(g), _sequence(x))


def _weight_ghost(g, x):
    CALLED.append("ghost_sq_norm")
    g, x = _sequence(g), _sequence(x)
    return (torch.bmm(x, x.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))


def _bias_per_sample(g):
    return _sequence(g).sum(1)


LINEAR_FN_RULE = fxdp.OpRule(op=LinearFn, params={
    1: fxdp.ParamRule(name="linear_fn.weight", operands=(GRAD, 0), per_sample_grad=_weight_per_sample,
                      sum_grad=lambda g, x: _weight_per_sample(g, x).sum(0), ghost_sq_norm=_weight_ghost,
                      costs=lambda shapes: {"ghost": 1.0, "instantiate": 2.0}),
    2: fxdp.ParamRule(name="linear_fn.bias", operands=(GRAD,), per_sample_grad=_bias_per_sample,
                      sum_grad=lambda g: _bias_per_sample(g).sum(0)),
})


@pytest.fixture
def linear_fn_rule():
    fxdp.register_rule(LINEAR_FN_RULE)
    CALLED.clear()
    yield
    del RULES[LinearFn]


@pytest.mark.parametrize("mode", ["grad_sample", "clip"])
def test_registered_rule_for_a_function(linear_fn_rule, mode: str):
    torch.manual_seed(0)
    model = Model(_swish_linear, {"weight": (D, D), "bias": (D,)}).double()
    x = _batch((4, 3, D), torch.float64)
    clip = float(reference(model, (x,), lambda out, i: _loss(out).sum()).norms.median())
    dp_model = fxdp.transform(model, grad_sample=mode == "grad_sample",
                              max_grad_norm=clip if mode == "clip" else None, compiler="eager")
    _check(model, dp_model, x, mode=mode, reduction="mean", clip=clip)
    assert dp_model.explain().rule_counts == {"linear.weight": 2, "linear.bias": 2, "linear_fn.weight": 1,
                                              "linear_fn.bias": 1}
    # Clipping takes the weight's norm by the rule's ghost norm, never its per-sample gradient.
    assert CALLED == (["per_sample_grad"] if mode == "grad_sample" else ["ghost_sq_norm", "per_sample_grad"])
    assert fxdp.is_supported(LinearFn)


@pytest.mark.parametrize("backend", ["fxdp", "object"])
def test_registered_rule_through_the_torch_compile_backend(linear_fn_rule, backend: str):
    """Dynamo captures without fxdp on the stack; the Function's class is still recorded."""
    torch.manual_seed(0)
    model = Model(_swish_linear, {"weight": (D, D), "bias": (D,)}).double()
    torch._dynamo.reset()
    if backend == "fxdp":
        compiled = torch.compile(model, backend="fxdp", options={"compiler": "eager"})
    else:
        compiled = torch.compile(model, backend=fxdp.backend(grad_sample=True, compiler="eager"))
    _check(model, compiled, _batch((4, 3, D), torch.float64), mode="grad_sample", reduction="mean")
    assert CALLED == ["per_sample_grad"]


def test_other_backends_graphs_are_not_annotated():
    seen = []

    def inspecting(gm, example_inputs):
        seen.extend(n.meta.get("fxdp_function") for n in gm.graph.nodes
                    if n.target is torch.ops.higher_order.autograd_function_apply)
        return gm.forward

    torch._dynamo.reset()  # fxdp's backend module, imported with fxdp, hooks Dynamo's capture
    model = Model(_swish_linear, {"weight": (D, D), "bias": (D,)}).double()
    torch.compile(model, backend=inspecting)(_batch((4, 3, D), torch.float64))
    assert seen and all(v is None for v in seen)


def test_registered_rule_names_apply_arguments():
    """The rule's indices are ``apply``'s arguments, whatever order the forward reads them in."""
    class ScaleFirst(torch.autograd.Function):
        @staticmethod
        def forward(ctx, scale, x):
            ctx.save_for_backward(x, scale)
            return x * scale

        @staticmethod
        def backward(ctx, grad):
            x, scale = ctx.saved_tensors
            return (grad * x).reshape(-1, x.shape[-1]).sum(0), grad * scale

    fxdp.register_rule(fxdp.OpRule(op=ScaleFirst, params={0: fxdp.ParamRule(
        name="scale_first.scale", operands=(GRAD, 1),
        per_sample_grad=lambda g, x: (_sequence(g) * _sequence(x)).sum(1),
        sum_grad=lambda g, x: (_sequence(g) * _sequence(x)).sum((0, 1)))}))
    try:
        torch.manual_seed(0)
        model = Model(lambda m, h: ScaleFirst.apply(m.scale, torch.tanh(h)), {"scale": (D,)}).double()
        dp_model = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
        _check(model, dp_model, _batch((4, 3, D), torch.float64), mode="grad_sample", reduction="sum")
        assert "scale_first.scale" in dp_model.explain().rule_counts
    finally:
        del RULES[ScaleFirst]


def test_rule_for_a_function_takes_no_input_grad_or_batch_rule():
    with pytest.raises(ValueError, match="takes no input_grad, batch_rule"):
        fxdp.register_rule(dataclasses.replace(LINEAR_FN_RULE, input_grad=lambda *a: None,
                                               batch_rule=lambda *a: None))
    with pytest.raises(ValueError, match="needs input_grad and batch_rule"):
        fxdp.register_rule(fxdp.OpRule(op=torch.ops.aten.sinc.default, params={}))


# -- refusals --------------------------------------------------------------------------------------

@pytest.mark.parametrize("function, where, op", [
    (CenterOverBatch, "forward", "aten.mean.dim"),
    (NormalizeGrad, "backward", "aten.linalg_vector_norm.default"),
], ids=["forward", "backward"])
def test_function_that_mixes_samples_is_refused(function, where: str, op: str):
    torch.manual_seed(0)
    model = Model(lambda m, h: function.apply(h), {}).double()
    x = _batch((5, D), torch.float64)
    problems = fxdp.validate(model, x)
    assert [p.op for p in problems] == [f"torch.autograd.Function {function.__name__}"], problems
    assert f"in {function.__name__}.{where}, {op}: it reduces over the batch dim" in problems[0].reason
    with pytest.raises(fxdp.UnsupportedError, match=f"{function.__name__}.{where}"):
        fxdp.transform(model, grad_sample=True, compiler="eager")(x)


class LargestRowPerSample(torch.autograd.Function):
    """Each sample's largest row picked from the flattened batch (``flat[arange(B) * T +
    pos]``): fxdp checks such indices at run time in the model's graph, not in a
    Function's body."""

    @staticmethod
    def forward(ctx, h):
        batch, length, d = h.shape
        pos = h[:, :, 0].argmax(1)
        ctx.save_for_backward(pos)
        ctx.shape = h.shape
        return h.reshape(batch * length, d)[torch.arange(batch) * length + pos]

    @staticmethod
    def backward(ctx, grad):
        (pos,) = ctx.saved_tensors
        batch, length, d = ctx.shape
        return grad.new_zeros(batch, length, d).index_put((torch.arange(batch), pos), grad)


def test_rows_of_a_flattened_batch_inside_a_function_are_refused():
    torch.manual_seed(0)
    model = Model(lambda m, h: LargestRowPerSample.apply(h.view(h.shape[0], 2, -1)), {}).double()
    model.head = nn.Linear(D // 2, 3).double()
    problems = fxdp.validate(model, _batch((5, D), torch.float64))
    assert [p.op for p in problems] == ["torch.autograd.Function LargestRowPerSample"], problems
    assert "in LargestRowPerSample.forward" in problems[0].reason and "run time" in problems[0].reason, problems


def test_refusal_names_the_module_and_an_op_without_propagation():
    class Block(nn.Module):
        def forward(self, h):
            return CenterOverBatch.apply(h)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, D)
            self.block = Block()

        def forward(self, x):
            return self.block(self.fc(x))

    problems = fxdp.validate(Outer().double(), _batch((5, D), torch.float64))
    assert [(p.op, p.module_path) for p in problems] == [("torch.autograd.Function CenterOverBatch", "block")]

    class Opaque(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return torch.ops.fxdp_tests_functions.opaque(x)

        @staticmethod
        def backward(ctx, grad):
            return grad

    model = Model(lambda m, h: Opaque.apply(h), {}).double()
    (problem,) = fxdp.validate(model, _batch((5, D), torch.float64))
    assert problem.reason.startswith("in Opaque.forward, fxdp_tests_functions.opaque.default: no batch-dim "
                                     "propagation"), problem.reason


@torch.library.custom_op("fxdp_tests_functions::opaque", mutates_args=())
def _opaque(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_opaque.register_fake
def _(x):
    return torch.empty_like(x)


def test_parameter_through_a_function_with_a_shared_output_is_refused():
    torch.manual_seed(0)
    model = Model(lambda m, h: sum(ScaleAndReturnIt.apply(h, m.scale)), {"scale": (D,)}).double()
    problems = fxdp.validate(model, _batch((5, D), torch.float64))
    assert len(problems) == 1 and problems[0].parameter == "scale", problems
    assert "every differentiable output is batched" in problems[0].reason


def test_function_copies_of_the_model_are_independent():
    """Two transforms of copies of one model: each call keeps its own bodies."""
    torch.manual_seed(0)
    model = Model(_swish_linear, {"weight": (D, D), "bias": (D,)}).double()
    twin = copy.deepcopy(model)
    for m in (model, twin):
        _check(m, fxdp.transform(m, grad_sample=True, compiler="eager"), _batch((5, D), torch.float64),
               mode="grad_sample", reduction="mean")


def test_hugging_face_bloom_gelu_function():
    """BLOOM's MLP runs ``GeLUFunction.apply`` in training mode."""
    transformers = pytest.importorskip(
        "transformers", reason="Hugging Face models (the test extra)")
    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)
    bloom = transformers.BloomForCausalLM(config).double().train()

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.bloom = bloom

        def forward(self, ids):
            return self.bloom(input_ids=ids, use_cache=False).logits

    model = Logits()
    ids = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(2))
    ref = reference(model, (ids,), lambda out, i: _loss(out).sum())
    _loss(fxdp.transform(model, grad_sample=True, compiler="eager")(ids)).mean().backward()
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample, 1e-9,
                     "grad_sample")


class LinearAmp(torch.autograd.Function):
    """A fused linear layer written for autocast, as ``torch.amp`` documents it."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return x @ weight.t() + bias

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        return grad @ weight, g2.t() @ x2, g2.sum(0)


def test_under_autocast():
    """bfloat16 autocast around the model: ``custom_fwd`` casts the Function's inputs back
    to float32, the parameter-free Function runs in bfloat16."""
    torch.manual_seed(0)
    model = Model(lambda m, h: LinearAmp.apply(Swish.apply(h), m.weight, m.bias), {"weight": (D, D), "bias": (D,)})

    class Autocast(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.model(x).float()

    wrapped = Autocast()
    x = _batch((4, 3, D), torch.float32)
    ref = reference(wrapped, (x,), lambda out, i: _loss(out).sum())
    _loss(fxdp.transform(wrapped, grad_sample=True, compiler="eager")(x)).mean().backward()
    assert_close_all({n: p.grad_sample for n, p in wrapped.named_parameters()}, ref.per_sample, 3e-2,
                     "grad_sample")


class FusedCrossEntropy(torch.autograd.Function):
    """A mean cross entropy with its own backward, as fused-loss kernels write it
    (``ignore_index`` targets get no gradient; the mean divides by the kept ones)."""

    @staticmethod
    def forward(ctx, logits, target, kept_per_sample):
        ctx.save_for_backward(logits, target)
        ctx.kept_per_sample = kept_per_sample
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    @staticmethod
    def backward(ctx, grad):
        logits, target = ctx.saved_tensors
        flat, t = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
        kept = (t != -100).to(flat.dtype)[:, None]
        one_hot = torch.nn.functional.one_hot(t.clamp(min=0), flat.shape[-1]).to(flat.dtype)
        # the number of kept targets, from sizes: exact where every sample keeps as many
        count = logits.shape[0] * ctx.kept_per_sample
        return (grad * (flat.softmax(-1) - one_hot) * kept / count).reshape(logits.shape), None, None


class FusedLossStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, 3)

    def forward(self, x, target):
        return FusedCrossEntropy.apply(self.fc(x), target, 4)


def test_mean_loss_inside_a_function_checks_the_kept_targets():
    """A mean over kept targets inside a Function gets the same run-time check as one in
    the graph: exact where every sample keeps as many (4 of 5 here), refused where not."""
    torch.manual_seed(0)
    step = FusedLossStep().double()
    dp_model = fxdp.transform(step, grad_sample=True, compiler="eager")
    x = _batch((3, 5, D), torch.float64)
    target = torch.randint(0, 3, (3, 5), generator=torch.Generator().manual_seed(3))
    target[:, 1] = -100
    ref = reference(step, (x, target), lambda out, i: out)
    dp_model(x, target).backward()
    assert_close_all({n: p.grad_sample for n, p in step.named_parameters()}, ref.per_sample, 1e-9, "grad_sample")
    target[2, 4] = -100
    with pytest.raises(RuntimeError, match="samples keep different numbers of targets"):
        dp_model(x, target).backward()


class SelfLabelledLoss(torch.autograd.Function):
    """A mean cross entropy against targets it computes itself."""

    @staticmethod
    def forward(ctx, logits):
        ctx.save_for_backward(logits)
        return torch.nn.functional.cross_entropy(logits, logits.argmax(-1))

    @staticmethod
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        one_hot = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
        return grad * (logits.softmax(-1) - one_hot) / logits.shape[0]


def test_mean_loss_over_targets_computed_inside_a_function_is_refused():
    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, 3)

        def forward(self, x):
            return SelfLabelledLoss.apply(self.fc(x))

    (problem,) = fxdp.validate(Step().double(), _batch((5, D), torch.float64))
    assert "its targets are computed inside the Function" in problem.reason, problem.reason


class EulerAdjoint(torch.autograd.Function):
    """torchdiffeq's ``odeint_adjoint`` in small: Euler steps under ``no_grad``, and a
    backward that integrates the adjoint back with ``torch.autograd.grad`` over the state
    and the parameters (their gradient of the whole batch, summed over the samples)."""

    @staticmethod
    def forward(ctx, func, y0, *params):
        with torch.no_grad():
            y1 = y0 + 0.5 * func(y0)
        ctx.func = func
        ctx.save_for_backward(y0, *params)
        return y1

    @staticmethod
    def backward(ctx, a):
        y0, *params = ctx.saved_tensors
        with torch.enable_grad():
            y = y0.detach().requires_grad_(True)
            gy, *gp = torch.autograd.grad(ctx.func(y), (y, *params), 0.5 * a)
        return (None, a + gy, *gp)


class AdjointSolved(nn.Module):
    def __init__(self):
        super().__init__()
        self.func, self.head = nn.Linear(D, D), nn.Linear(D, 2)

    def forward(self, x):
        return self.head(EulerAdjoint.apply(self.func, x, *self.func.parameters()))


def test_an_adjoint_backward_taking_torch_autograd_grad_is_refused_with_what_to_do():
    """The adjoint method of ODE and SDE solvers is refused with its own message (it
    suggested torch.func.grad for the forward before the sixty-second session, found by a
    helper's sweep of torchdiffeq, torchdyn and torchsde)."""
    dp_model = fxdp.transform(AdjointSolved(), max_grad_norm=1.0, compiler="eager")
    with pytest.raises(fxdp.UnsupportedError, match="torch.autograd.grad inside a torch.autograd.Function. In its "
                       r"backward \(the adjoint method .*Backpropagate through the solver's steps instead"):
        dp_model(torch.randn(3, D))
