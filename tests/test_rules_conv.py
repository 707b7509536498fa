"""Convolution rules (``fxdp/rules/conv.py``) against the microbatch reference.

One table of cases: conv1d/2d/3d × stride × padding (int, "same", "valid") ×
dilation × groups (1, 2, depthwise) × bias × padding_mode, transposed convolutions
with stride/output_padding/groups/dilation, and small stacks that exercise the input
gradient, merged batch dims, shared inputs and parameter transforms. Each case runs
with per-sample gradients and clipping in float64 (tol 1e-9) and float32 (tol 1e-3),
the loss reduction alternating so that every case meets both; a second float64 pass
without grad samples (float32 too where the route is ghost) lets the cost model pick
"ghost" or "instantiate" per layer, and pins the route where the table says which.
"""
from __future__ import annotations

import dataclasses
import re
import time
from typing import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

import fxdp
from fxdp.batching import BatchDim
from fxdp.rules import conv as conv_module
from fxdp.rules._common import forced_route
from fxdp.rules.conv import CONV_RULES, _weight_grad_by_convolution, conv_bias, conv_config, conv_weight
from reference import assert_close_all, reference, tolerance

aten = torch.ops.aten


# ---------------------------------------------------------------------------
# Models that are not a single module
# ---------------------------------------------------------------------------


class Frames(nn.Module):
    """A video as a batch of frames: the conv sees ``[B·T, C, H, W]`` (batch merged)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        b, t = x.shape[:2]
        return self.conv(x.flatten(0, 1)).view(b, t, 4, *x.shape[3:])


class TimeMajorFrames(nn.Module):
    """``[T, B, C, H, W]`` (``batch_first=False``) as frames: the conv sees ``[T·B, C, H, W]``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        t, b = x.shape[:2]
        return self.conv(x.flatten(0, 1)).view(t, b, 4, *x.shape[3:])


class Functional(nn.Module):
    """``torch.convolution`` called directly: canonical ``aten.convolution.default``."""

    def __init__(self, transposed: bool):
        super().__init__()
        self.transposed = transposed
        shape = (4, 3, 3, 3) if transposed else (6, 2, 3, 3)
        self.weight = nn.Parameter(torch.randn(shape) * 0.3)
        self.bias = nn.Parameter(torch.randn(6) * 0.1)

    def forward(self, x):
        if self.transposed:
            return torch.convolution(x, self.weight, self.bias, [2, 2], [1, 1], [1, 1], True, [1, 1], 2)
        return torch.convolution(x, self.weight, self.bias, [1, 2], [1, 0], [2, 1], False, [0, 0], 2)


class WeightStandardized(nn.Conv2d):
    """The conv sees a parameter-only function of its weight (a transform of the parameter)."""

    def forward(self, x):
        w = self.weight
        w = (w - w.mean((1, 2, 3), keepdim=True)) / (w.std((1, 2, 3), keepdim=True) + 1e-5)
        return nn.functional.conv2d(x, w, self.bias, self.stride, self.padding)


class AppliedTwice(nn.Module):
    """One conv used twice per sample: its per-sample gradient is the sum of both uses."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):
        return self.conv(torch.tanh(self.conv(x)))


class SharedImage(nn.Module):
    """The conv sees a buffer, not the batch; its result is added to the batch.

    ``image`` ``[1, C, H, W]``: the conv is a parameter-only computation (a transform);
    ``image`` ``[C, H, W]`` (unbatched call): its output is broadcast to the batch.
    """

    def __init__(self, unbatched: bool):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.register_buffer("image", torch.randn((2, 4, 4) if unbatched else (1, 2, 4, 4)))

    def forward(self, x):
        return torch.tanh(x * self.conv(self.image))


class LayerNormedFeatures(nn.Module):
    """wav2vec2's layer-normed feature encoder: conv, a ``LayerNorm`` over the channels
    of the transposed output, transposed back, the next conv. The fake kernel of
    ``native_layer_norm_backward`` promises the gradient's strides and the CPU kernel
    returns it contiguous, so the conv rule's traced ``view`` failed at run time."""

    def __init__(self):
        super().__init__()
        self.conv0 = nn.Conv1d(1, 8, 4, stride=2, bias=False)  # the raw waveform: one channel
        self.norm = nn.LayerNorm(8)
        self.conv1 = nn.Conv1d(8, 4, 3, stride=2)

    def forward(self, x):
        h = self.norm(self.conv0(x).transpose(-2, -1)).transpose(-2, -1)
        return self.conv1(nn.functional.gelu(h))


class ConvOverTime(nn.Module):
    """A conv over a sequence's positions, on the transposed output of a linear: with
    one position, ``[B, C, 1]`` has strides ``(C, 1, C)``, which the CPU's slow_conv2d
    (float64) read as channels-last."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.conv = nn.Conv1d(3, 5, 3, stride=2, padding=1)

    def forward(self, x):
        return self.conv(self.lin(x).transpose(1, 2))


def _frozen_weight() -> nn.Module:
    model = nn.Sequential(nn.Conv1d(3, 4, 3, padding=1), nn.Tanh(), nn.Conv1d(4, 2, 3, stride=2))
    model[0].weight.requires_grad_(False)
    return model


# ---------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    id: str
    make: Callable[[], nn.Module]
    shape: tuple  # input shape, batch first
    strategy: str | None = None  # the weight strategy the cost model must pick (grad_sample=False)


C1, C2, C3 = nn.Conv1d, nn.Conv2d, nn.Conv3d
T1, T2, T3 = nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d

CASES = [
    # conv1d
    Case("conv1d-k3", lambda: C1(3, 4, 3), (3, 3, 9)),
    Case("conv1d-s2-p1", lambda: C1(3, 4, 3, stride=2, padding=1), (3, 3, 9)),
    Case("conv1d-same-k4-asymmetric", lambda: C1(3, 4, 4, padding="same"), (3, 3, 8)),
    Case("conv1d-valid-nobias", lambda: C1(3, 4, 3, padding="valid", bias=False), (3, 3, 8)),
    Case("conv1d-d2-g2", lambda: C1(4, 6, 3, dilation=2, groups=2, padding=2), (3, 4, 9)),
    Case("conv1d-depthwise", lambda: C1(4, 8, 3, groups=4), (3, 4, 7)),
    Case("conv1d-reflect", lambda: C1(3, 4, 3, padding=2, padding_mode="reflect"), (3, 3, 8)),
    Case("conv1d-circular-same-k4", lambda: C1(3, 4, 4, padding="same", padding_mode="circular"), (3, 3, 8)),
    # conv2d
    Case("conv2d-k3-p1", lambda: C2(3, 4, 3, padding=1), (3, 3, 6, 6)),
    Case("conv2d-s2-p2-d2-nobias", lambda: C2(3, 4, 3, stride=2, padding=2, dilation=2, bias=False), (3, 3, 7, 7)),
    Case("conv2d-rect-s21-p10", lambda: C2(3, 4, (3, 1), stride=(2, 1), padding=(1, 0)), (3, 3, 7, 5)),
    Case("conv2d-same-k2x3", lambda: C2(3, 4, (2, 3), padding="same"), (3, 3, 5, 6)),
    Case("conv2d-same-k4-d2", lambda: C2(3, 4, 4, padding="same", dilation=2), (3, 3, 7, 7)),
    Case("conv2d-valid", lambda: C2(3, 4, 3, padding="valid"), (3, 3, 6, 5)),
    Case("conv2d-g2", lambda: C2(4, 6, 3, groups=2, padding=1), (3, 4, 5, 5)),
    Case("conv2d-depthwise-nobias", lambda: C2(4, 4, 3, groups=4, bias=False), (3, 4, 6, 6)),
    Case("conv2d-reflect", lambda: C2(3, 4, 3, padding=1, padding_mode="reflect"), (3, 3, 6, 6)),
    Case("conv2d-replicate-s2", lambda: C2(3, 4, 3, stride=2, padding=1, padding_mode="replicate"), (3, 3, 7, 7)),
    Case("conv2d-circular", lambda: C2(3, 4, 3, padding=(1, 2), padding_mode="circular"), (3, 3, 6, 6)),
    Case("conv2d-small-map", lambda: C2(16, 16, 3), (3, 16, 4, 4), strategy="ghost"),
    Case("conv2d-1x1-one-position", lambda: C2(16, 24, 1), (3, 16, 1, 1), strategy="ghost"),
    Case("conv2d-large-map", lambda: C2(2, 3, 3, padding=1), (3, 2, 10, 10), strategy="instantiate"),
    # conv3d
    Case("conv3d-k3-p1", lambda: C3(2, 3, 3, padding=1), (2, 2, 4, 4, 4)),
    Case("conv3d-s2-g2-nobias", lambda: C3(4, 4, 2, stride=2, groups=2, bias=False), (2, 4, 4, 5, 4)),
    Case("conv3d-same-k2", lambda: C3(2, 3, 2, padding="same"), (2, 2, 3, 4, 3)),
    Case("conv3d-valid-d2", lambda: C3(2, 3, 2, padding="valid", dilation=2), (2, 2, 4, 4, 5)),
    Case("conv3d-replicate", lambda: C3(2, 3, 3, padding=1, padding_mode="replicate"), (2, 2, 3, 4, 3)),
    # transposed
    Case("convT1d-s2-op1", lambda: T1(3, 4, 3, stride=2, output_padding=1), (3, 3, 5)),
    Case("convT1d-g2-d2-p1", lambda: T1(4, 6, 3, groups=2, dilation=2, padding=1), (3, 4, 5)),
    Case("convT2d-s2-p1-op1-g2", lambda: T2(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2), (3, 4, 3, 3)),
    Case("convT2d-d2-op1-nobias", lambda: T2(3, 4, 3, dilation=2, output_padding=1, bias=False), (3, 3, 3, 4)),
    Case("convT2d-s3-op2-rect", lambda: T2(3, 2, (2, 3), stride=(3, 2), output_padding=(2, 1)), (3, 3, 3, 2)),
    Case("convT2d-depthwise", lambda: T2(4, 4, 3, groups=4, stride=2), (3, 4, 3, 3)),
    Case("convT2d-small-map", lambda: T2(16, 16, 2), (3, 16, 2, 2), strategy="ghost"),
    Case("convT3d-s2-op1", lambda: T3(2, 3, 2, stride=2, output_padding=1), (2, 2, 2, 3, 2)),
    Case("convT3d-g2-p1", lambda: T3(4, 2, 3, groups=2, padding=1), (2, 4, 3, 2, 3)),
    # input gradients, merged batch, B == 1, aten.convolution
    Case("stack-same-k2-then-s2", lambda: nn.Sequential(C2(3, 4, 2, padding="same"), nn.Tanh(), C2(4, 3, 3, stride=2)),
         (3, 3, 6, 6)),
    Case("stack-conv-then-convT", lambda: nn.Sequential(C2(3, 4, 3, stride=2, padding=1, padding_mode="reflect"),
                                                        nn.Tanh(), T2(4, 3, 3, stride=2, padding=1, output_padding=1)),
         (3, 3, 6, 6)),
    Case("stack-conv1d-frozen-weight", _frozen_weight, (3, 3, 8)),
    Case("frames-merged-batch", Frames, (2, 3, 3, 4, 4)),
    Case("conv2d-applied-twice", AppliedTwice, (3, 3, 5, 5)),
    Case("conv1d-layer-normed-features", LayerNormedFeatures, (3, 1, 20)),
    Case("conv1d-over-one-position-of-a-transposed-view", ConvOverTime, (3, 1, 4)),
    Case("conv2d-weight-standardized", lambda: WeightStandardized(3, 4, 3, padding=1), (3, 3, 5, 5)),
    Case("conv2d-on-shared-buffer", lambda: SharedImage(unbatched=False), (3, 2, 4, 4)),
    Case("conv2d-unbatched-shared-broadcast", lambda: SharedImage(unbatched=True), (3, 2, 4, 4)),
    Case("conv2d-batch-of-one", lambda: C2(3, 4, 3, padding=1), (1, 3, 5, 5)),
    Case("convolution-op", lambda: Functional(transposed=False), (3, 4, 6, 6)),
    Case("convolution-op-transposed", lambda: Functional(transposed=True), (3, 4, 3, 3)),
]

def _per_sample_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).flatten(1).sum(1)


def _setup(case: Case, dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    model = case.make().to(dtype)
    x = torch.randn(case.shape, dtype=dtype)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    ref = reference(model, (x,), lambda out, i: _per_sample_loss(out, target[i:i + 1]).sum())
    return model, x, target, ref


def _max_grad_norm(ref) -> float:
    """Between the two smallest norms: the smallest sample is not clipped, the others are."""
    norms = ref.norms.sort().values
    return norms[0].item() / 2 if len(norms) == 1 else (norms[0] + norms[1]).item() / 2


def _params(model: nn.Module, attr: str) -> dict:
    return {n: getattr(p, attr, None) for n, p in model.named_parameters() if p.requires_grad}


def _step(model, x, target, reduction, **options):
    model.zero_grad(set_to_none=True)
    dp = fxdp.transform(model, loss_reduction=reduction, compiler=options.pop("compiler", "eager"), **options)
    loss = _per_sample_loss(dp(x), target)
    (loss.mean() if reduction == "mean" else loss.sum()).backward()
    return dp


def _route(plan) -> str:
    """"ghost" or "instantiate" ("instantiate + keep" keeps the result until the factors exist)."""
    return plan.strategy.split(" ")[0]


def _check_norms(dp, ref, max_grad_norm, tol, what):
    assert_close_all({"norms": dp.per_sample_norms}, {"norms": ref.norms}, tol, f"{what}: per-sample norms")
    factors = ref.clip_factors(max_grad_norm)
    assert int((factors < 1).sum()) == max(len(factors) - 1, 1), "clipping binds for all but the smallest sample"
    assert_close_all({"clip": dp.clip_factors}, {"clip": factors}, tol, f"{what}: clip factors")


def _runs(cases, dtypes):
    """(case, dtype, reduction) with the reduction alternating so that every case meets both."""
    runs = []
    for i, case in enumerate(cases):
        for j, (dtype, name) in enumerate(dtypes):
            reduction = ("mean", "sum")[(i + j) % 2]
            runs.append(pytest.param(case, dtype, reduction, id=f"{case.id}-{name}-{reduction}"))
    return runs


F64, F32 = (torch.float64, "f64"), (torch.float32, "f32")


@pytest.mark.parametrize("case,dtype,reduction", _runs(CASES, [F64, F32]))
def test_grad_sample_and_clipping(case, dtype, reduction):
    model, x, target, ref = _setup(case, dtype)
    max_grad_norm = _max_grad_norm(ref)
    tol = tolerance(dtype, conv=True)
    dp = _step(model, x, target, reduction, max_grad_norm=max_grad_norm, grad_sample=True)
    assert_close_all(_params(model, "grad_sample"), ref.per_sample, tol, f"{case.id}: grad_sample")
    _check_norms(dp, ref, max_grad_norm, tol, case.id)
    assert_close_all(_params(model, "grad"), ref.grad(reduction, max_grad_norm), tol, f"{case.id}: clipped grad")
    for p in model.parameters():
        if not p.requires_grad:
            assert p.grad is None


@pytest.mark.parametrize("route", ["grouped convolution", "patches"])
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_per_sample_grad_by_each_route(case, route, monkeypatch):
    """The per-sample weight gradient has two routes, timed against each other on first
    use (``fastest_route``): each, forced, gives the microbatch loop's grad samples
    (weights with one channel per group, depthwise ones, always take the grouped
    convolution)."""
    ran = {"grouped convolution": 0, "patches": 0}

    def counted(name, fn):
        def run(g, x, config, **kwargs):
            ran[name] += kwargs.get("per_sample", True)
            return fn(g, x, config, **kwargs)
        return run

    monkeypatch.setattr(conv_module, "_weight_grad_by_convolution",
                        counted("grouped convolution", conv_module._weight_grad_by_convolution))
    monkeypatch.setattr(conv_module, "_per_sample_grad_chunk", counted("patches", conv_module._per_sample_grad_chunk))
    model, x, target, ref = _setup(case, torch.float64, seed=4)
    with forced_route(route):
        _step(model, x, target, "sum", grad_sample=True)
    assert_close_all(_params(model, "grad_sample"), ref.per_sample, 1e-9, f"{case.id} by {route}: grad_sample")
    one_channel_per_group = any(isinstance(m, nn.modules.conv._ConvNd) and m.weight.shape[1] == 1
                                for m in model.modules())
    other = "patches" if route == "grouped convolution" else "grouped convolution"
    assert ran[other] == 0 or (other == "grouped convolution" and one_channel_per_group), ran


# float64 with the other reduction than above; float32 where the cost model picks ghost
STRATEGY_RUNS = [r for r in _runs(CASES, [F32, F64]) if r.values[1] == torch.float64 or r.values[0].strategy == "ghost"]


@pytest.mark.parametrize("case,dtype,reduction", STRATEGY_RUNS)
def test_norm_strategy(case, dtype, reduction):
    """Without grad samples each weight takes the cheaper route; both are exact."""
    model, x, target, ref = _setup(case, dtype, seed=1)
    max_grad_norm = _max_grad_norm(ref)
    tol = tolerance(dtype, conv=True)
    dp = _step(model, x, target, reduction, max_grad_norm=max_grad_norm)
    _check_norms(dp, ref, max_grad_norm, tol, case.id)
    assert_close_all(_params(model, "grad"), ref.grad(reduction, max_grad_norm), tol, f"{case.id}: clipped grad")
    for plan in dp.explain().plans:
        if plan.rule == "conv.weight" and plan.costs:
            assert _route(plan) == min(plan.costs, key=plan.costs.get), plan
            if case.strategy is not None:
                assert _route(plan) == case.strategy, plan
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())


def test_both_strategies_in_one_model():
    """Mixed ghost clipping: layers of one model take different routes, all exact."""
    torch.manual_seed(2)
    model = nn.Sequential(
        C2(3, 8, 3, padding=1), nn.Tanh(), C2(8, 16, 3, stride=2), nn.Tanh(), T2(16, 4, 3, stride=2, groups=4),
    ).double()
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    ref = reference(model, (x,), lambda out, i: _per_sample_loss(out, target[i:i + 1]).sum())
    max_grad_norm = _max_grad_norm(ref)
    dp = _step(model, x, target, "sum", max_grad_norm=max_grad_norm)
    strategies = {p.name: _route(p) for p in dp.explain().plans if p.rule == "conv.weight"}
    assert set(strategies.values()) == {"ghost", "instantiate"}, strategies
    _check_norms(dp, ref, max_grad_norm, 1e-9, "mixed")
    assert_close_all(_params(model, "grad"), ref.grad("sum", max_grad_norm), 1e-9, "mixed: clipped grad")


def test_batch_and_image_size_change():
    """Recompiles with a symbolic batch and symbolic image sizes stay exact."""
    torch.manual_seed(5)
    model = nn.Sequential(C2(3, 4, 3, padding="same"), nn.Tanh(), T2(4, 2, 3, stride=2, output_padding=1)).double()
    dp = fxdp.transform(model, max_grad_norm=1.0, grad_sample=True, loss_reduction="sum", compiler="eager")
    for shape in [(4, 3, 6, 6), (3, 3, 6, 6), (2, 3, 7, 5), (3, 3, 5, 8)]:
        x = torch.randn(shape, dtype=torch.float64)
        with torch.no_grad():
            target = torch.randn_like(model(x))
        ref = reference(model, (x,), lambda out, i: _per_sample_loss(out, target[i:i + 1]).sum())
        model.zero_grad(set_to_none=True)
        _per_sample_loss(dp(x), target).sum().backward()
        assert_close_all(_params(model, "grad_sample"), ref.per_sample, 1e-9, f"{shape}: grad_sample")
        assert_close_all(_params(model, "grad"), ref.grad("sum", 1.0), 1e-9, f"{shape}: clipped grad")
        assert_close_all({"norms": dp.per_sample_norms}, {"norms": ref.norms}, 1e-9, f"{shape}: norms")


@pytest.mark.parametrize("grad_sample", [True, False])
def test_time_major_frames(grad_sample):
    """The batch merged behind another dim (``BatchDim(0, outer=T)``), ``batch_first=False``."""
    torch.manual_seed(7)
    model = TimeMajorFrames().double()
    x = torch.randn(2, 3, 3, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    ref = reference(model, (x,), lambda out, i: (out - target[:, i:i + 1]).pow(2).sum(), batch_dim=1)
    max_grad_norm = _max_grad_norm(ref)
    dp = fxdp.transform(model, max_grad_norm=max_grad_norm, grad_sample=grad_sample, batch_first=False,
                        loss_reduction="sum", compiler="eager")
    (dp(x) - target).pow(2).sum().backward()
    _check_norms(dp, ref, max_grad_norm, 1e-9, "time-major")
    assert_close_all(_params(model, "grad"), ref.grad("sum", max_grad_norm), 1e-9, "time-major: clipped grad")
    if grad_sample:
        assert_close_all(_params(model, "grad_sample"), ref.per_sample, 1e-9, "time-major: grad_sample")


# ---------------------------------------------------------------------------
# The rule functions alone, on aten.convolution's argument layout
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("transposed,groups,output_padding", [
    (False, 1, 0), (False, 2, 0), (False, 4, 0), (True, 2, 1), (True, 1, 2), (True, 4, 0),
], ids=["conv", "conv-g2", "conv-depthwise", "convT-g2-op1", "convT-op2", "convT-depthwise"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last-one_sample_chunks"])
def test_rule_functions(transposed, groups, output_padding, layout, monkeypatch):
    """Per-sample, summed and ghost quantities on ``aten.convolution``, both routes;
    channels-last operands (as Inductor's layout optimisation leaves them) take the
    positions-major patch copy, and a tiny chunk size unfolds one sample at a time."""
    torch.manual_seed(3)
    out_channels = 4 if groups == 4 else 6
    x = torch.randn(3, 4, 5, 6, dtype=torch.float64)
    weight = torch.randn((4, out_channels // groups, 3, 2) if transposed else (out_channels, 4 // groups, 3, 2),
                         dtype=torch.float64)
    bias = torch.randn(out_channels, dtype=torch.float64)
    args = (x, weight, bias, [3, 2], [1, 0], [2, 1], transposed, [output_padding, 0], groups)
    config = conv_config(args, layout="convolution")
    y = aten.convolution.default(*args)
    g = torch.randn_like(y)
    per_sample_w, per_sample_b = [], []
    for i in range(3):
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        aten.convolution.default(x[i:i + 1], w, b, *args[3:]).backward(g[i:i + 1])
        per_sample_w.append(w.grad)
        per_sample_b.append(b.grad)
    ref_w, ref_b = torch.stack(per_sample_w), torch.stack(per_sample_b)
    if layout != "contiguous":
        monkeypatch.setattr(conv_module, "PATCH_CHUNK_BYTES", 1)
        x, g = x.contiguous(memory_format=torch.channels_last), g.contiguous(memory_format=torch.channels_last)
    got = {
        "weight.per_sample": conv_weight.per_sample_grad(g, x, **config),
        "weight.per_sample.by_convolution": _weight_grad_by_convolution(g, x, config, per_sample=True),
        "weight.sum": conv_weight.sum_grad(g, x, **config),
        "weight.ghost": conv_weight.ghost_sq_norm(g, x, **config),
        "bias.per_sample": conv_bias.per_sample_grad(g, **config),
        "bias.sum": conv_bias.sum_grad(g, **config),
    }
    want = {
        "weight.per_sample": ref_w, "weight.per_sample.by_convolution": ref_w, "weight.sum": ref_w.sum(0),
        "weight.ghost": ref_w.flatten(1).pow(2).sum(1),
        "bias.per_sample": ref_b, "bias.sum": ref_b.sum(0),
    }
    for k in got:
        assert_close_all({k: got[k]}, {k: want[k]}, 1e-12, k)
    costs = conv_weight.costs([g.shape, x.shape], **config)
    assert set(costs) == {"ghost", "instantiate"} and min(costs.values()) > 0


@pytest.mark.parametrize("layout", ["contiguous", "contiguous-one_sample_chunks", "channels_last", "strided"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_input_grad_any_input_layout(layout, compiled, monkeypatch):
    """The 2-D input gradient runs channels-last on the CPU with ``x`` standing in for
    itself (a channels-last view of a contiguous ``x``, ``x`` as it is when already
    channels-last, a fresh tensor otherwise); every layout gives aten's gradient, and
    a contiguous ``x`` gets a contiguous one, computed in chunks of samples."""
    if layout.endswith("one_sample_chunks"):
        monkeypatch.setattr(conv_module, "INPUT_GRAD_CHUNK_BYTES", 1)
        layout = "contiguous"
    torch.manual_seed(0)
    base = torch.randn(4, 3, 10, 9 if layout != "strided" else 18)
    x = {"contiguous": base, "channels_last": base.contiguous(memory_format=torch.channels_last),
         "strided": base[..., ::2]}[layout]
    weight, bias = torch.randn(5, 3, 3, 3), torch.randn(5)
    args = (x, weight, bias, [2, 2], [1, 1], [1, 1], 1)
    g = torch.randn_like(aten.conv2d.default(*args))
    want = aten.convolution_backward(g, x, weight, [5], [2, 2], [1, 1], [1, 1], False, [0, 0], 1,
                                     [True, False, False])[0]
    before = x.clone()
    input_grad = CONV_RULES[aten.conv2d.default].input_grad
    fn = (lambda x, weight, g: input_grad((x, weight, bias, *args[3:]), g, 0))
    got = (torch.compile(fn, backend="inductor", fullgraph=True) if compiled else fn)(x, weight, g)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(x, before), "the stand-in is read-only"
    if layout == "contiguous":  # copied back to the activations' layout
        assert got.is_contiguous()


def test_same_padding_is_pytorch_asymmetric():
    x = torch.empty(1, 1, 8, 8)
    config = conv_config((x, torch.empty(1, 1, 4, 3), None, [1, 1], "same", [1, 2]), layout="conv")
    assert config["padding"] == ((1, 2), (2, 2))
    valid = conv_config((x, torch.empty(1, 1, 3, 3), None, [1, 1], "valid"), layout="conv")
    assert valid["padding"] == ((0, 0), (0, 0))


# ---------------------------------------------------------------------------
# Refusals and the registry
# ---------------------------------------------------------------------------


class BatchAsChannels(nn.Module):
    """``[B, H, W]`` fed as an unbatched ``[C, H, W]`` conv input: the conv mixes samples."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 2, 3)

    def forward(self, x):
        return self.conv(x)


def test_check_refuses_unbatched_input():
    """Defence behind the core's own handling of shared inputs (broadcast, transform)."""
    x, w = torch.empty(2, 3, 5, 5), torch.empty(4, 3, 3, 3)
    rule = CONV_RULES[aten.conv2d.default]
    assert "no batch dim" in rule.check([None, None, None], [x, w, None], 1)
    assert "itself is batched" in rule.check([BatchDim(0), BatchDim(0), None], [x, w, None], 1)
    assert rule.check([BatchDim(0), None, None], [x, w, None], 1) is None


def test_refuses_batch_in_channels():
    problems = fxdp.validate(BatchAsChannels(), torch.randn(4, 5, 5))
    assert [p.op for p in problems] == ["aten.conv2d.default"], problems
    assert "unbatched convolution input" in problems[0].reason and problems[0].module_path == "conv", problems
    with pytest.raises(fxdp.UnsupportedError, match="unbatched convolution input"):
        fxdp.transform(BatchAsChannels(), compiler="eager")(torch.randn(4, 5, 5))


class ModulatedConv(nn.Module):
    """StyleGAN2's modulated convolution: weights scaled per sample by a style (and
    demodulated), the batch folded into the channels and the groups; ``up`` is its
    upsampling form, a grouped ``conv_transpose2d``. ``mixed`` convolves the whole batch
    with every sample's weights (no groups): that mixes samples."""

    def __init__(self, form: str, c: int = 3, e: int = 2):
        super().__init__()
        self.form = form
        self.weight = nn.Parameter(torch.randn(e, c, 3, 3))
        self.bias = nn.Parameter(torch.randn(e))
        self.style = nn.Linear(c, c)

    def forward(self, x):
        n, c, h, w_ = x.shape
        w = self.weight[None] * (self.style(x.mean((2, 3))) + 1)[:, None, :, None, None]
        w = w * torch.rsqrt(w.pow(2).sum((2, 3, 4), keepdim=True) + 1e-8)
        e = w.shape[1]
        if self.form == "mixed":
            return F.conv2d(x, w.reshape(n * e, c, 3, 3), padding=1)
        if self.form == "up":
            y = F.conv_transpose2d(x.reshape(1, n * c, h, w_), w.transpose(1, 2).reshape(n * c, e, 3, 3),
                                   stride=2, padding=1, groups=n)
        else:
            y = F.conv2d(x.reshape(1, n * c, h, w_), w.reshape(n * e, c, 3, 3), padding=1, groups=n)
        return y.view(n, e, *y.shape[2:]) + self.bias[None, :, None, None]


@pytest.mark.parametrize("form", ["same", "up"])
def test_modulated_convolution_with_the_samples_as_groups(form):
    """It was refused ("the convolution's weight is batched"): each group is one
    sample's. A second batch size, where ``groups`` is the symbolic ``B``, too."""
    torch.manual_seed(0)
    _grad_samples_at_two_batch_sizes(ModulatedConv(form).double(), (3, 5, 5))


def _grad_samples_at_two_batch_sizes(model: nn.Module, sample_shape: tuple) -> None:
    """``grad_sample`` of ``Σ out²`` against the loop, at batch sizes 3 and then 5."""
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    for batch in (3, 5):
        x = torch.randn(batch, *sample_shape, dtype=torch.float64)
        ref = reference(model, [x], lambda out, i: out.pow(2).sum())
        for p in model.parameters():
            p.grad_sample = None
        dp(x).pow(2).sum().backward()
        assert_close_all(_params(model, "grad_sample"), ref.per_sample, tolerance(torch.float64), "grad_sample")


class LearnedBlur(nn.Module):
    """kornia's ``gaussian_blur2d`` with a learned sigma given one row per sample
    (``sigma.expand(B, 2)``): a Gaussian kernel per sample, normalised with a guard
    against zero (``where(den == 0, ones_like(den), den)``), the batch folded into the
    channels and the groups."""

    def __init__(self, guard: str):
        super().__init__()
        self.guard = guard
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.log_sigma = nn.Parameter(torch.tensor([[0.1, -0.2]]))

    def forward(self, x):  # [B, 2, H, W]
        b, c, h, w = x.shape
        sigma = self.log_sigma.exp().expand(b, 2)
        grid = torch.arange(5, dtype=x.dtype) - 2
        gauss = torch.exp(-grid[None, None] ** 2 / (2 * sigma[..., None] ** 2))  # [B, 2, 5]
        den = gauss.sum(-1, keepdim=True)
        if self.guard == "ones_like":
            den = torch.where(den == 0, torch.ones_like(den), den)
        elif self.guard == "full_like":
            den = den + torch.full_like(den, 1e-12)
        gauss = gauss / den
        kernel = gauss[:, 0, :, None] * gauss[:, 1, None, :]  # [B, 5, 5]
        y = self.conv(x).reshape(1, b * c, h, w)
        kernel = kernel[:, None].expand(b, c, 5, 5).reshape(b * c, 1, 5, 5)
        return F.conv2d(y, kernel, padding=2, groups=b * c).view(b, c, h, w)


@pytest.mark.parametrize("guard", ["none", "ones_like", "full_like"])
def test_a_kernel_per_sample_from_a_shared_parameter_with_a_constant_like_it(guard):
    """A constant shaped like a parameter expanded to the batch (``ones_like(k)``) is the
    expand of that constant: it was taken for data of the samples, and the grouped
    convolution over the batch in its channels was refused as mixing them."""
    torch.manual_seed(0)
    _grad_samples_at_two_batch_sizes(LearnedBlur(guard).double(), (2, 6, 6))


def test_a_batched_weight_over_the_whole_batch_is_refused():
    with pytest.raises(fxdp.UnsupportedError, match="weight is batched"):
        dp = fxdp.transform(ModulatedConv("mixed").double(), compiler="eager")
        dp(torch.randn(3, 3, 5, 5, dtype=torch.float64))


def test_is_supported():
    for cls in (C1, C2, C3, T1, T2, T3, nn.LazyConv2d):
        assert fxdp.is_supported(cls), cls
    assert fxdp.is_supported(nn.Conv2d(2, 2, 3, padding_mode="circular"))
    for op in (aten.conv2d.padding, aten.conv_transpose2d.input, aten.convolution.default, aten.conv1d):
        assert fxdp.is_supported(op), op


# ---------------------------------------------------------------------------
# Drawn conv2d configurations
# ---------------------------------------------------------------------------


@st.composite
def conv2d_configs(draw):
    groups = draw(st.sampled_from([1, 2, 3]))
    in_channels = groups * draw(st.integers(1, 2))
    out_channels = groups * draw(st.integers(1, 3))
    kernel = (draw(st.integers(1, 4)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    padding = draw(st.sampled_from(["same", "valid", 0, 1, 2]))
    stride = (1, 1) if padding == "same" else (draw(st.integers(1, 3)), draw(st.integers(1, 2)))
    padding_mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    extent = [d * (k - 1) + 1 for d, k in zip(dilation, kernel)]
    # reflect needs padding < input size; every mode needs an output
    size = [draw(st.integers(max(e, 3), e + 4)) for e in extent]
    return dict(
        module=dict(in_channels=in_channels, out_channels=out_channels, kernel_size=kernel, stride=stride,
                    padding=padding, dilation=dilation, groups=groups, bias=draw(st.booleans()),
                    padding_mode=padding_mode),
        shape=(draw(st.integers(1, 4)), in_channels, *size),
        reduction=draw(st.sampled_from(["mean", "sum"])),
        grad_sample=draw(st.booleans()),
    )


@settings(max_examples=20, deadline=None)
@given(conv2d_configs())
def test_drawn_conv2d(config):
    torch._dynamo.reset()
    case = Case("drawn", lambda: nn.Conv2d(**config["module"]), config["shape"])
    model, x, target, ref = _setup(case, torch.float64)
    max_grad_norm = _max_grad_norm(ref)
    dp = _step(model, x, target, config["reduction"], max_grad_norm=max_grad_norm, grad_sample=config["grad_sample"])
    what = f"drawn {config}"
    assert_close_all({"norms": dp.per_sample_norms}, {"norms": ref.norms}, 1e-9, what)
    assert_close_all(_params(model, "grad"), ref.grad(config["reduction"], max_grad_norm), 1e-9, what)
    if config["grad_sample"]:
        assert_close_all(_params(model, "grad_sample"), ref.per_sample, 1e-9, what)


# ---------------------------------------------------------------------------
# Inductor
# ---------------------------------------------------------------------------


def test_inductor_mixed_strategies():
    torch.manual_seed(4)
    model = nn.Sequential(C2(3, 8, 3, padding=1, padding_mode="circular"), nn.Tanh(), C2(8, 16, 3, stride=2))
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    ref = reference(model, (x,), lambda out, i: _per_sample_loss(out, target[i:i + 1]).sum())
    max_grad_norm = _max_grad_norm(ref)
    dp = _step(model, x, target, "mean", max_grad_norm=max_grad_norm, compiler="inductor")
    assert {_route(p) for p in dp.explain().plans if p.rule == "conv.weight"} == {"ghost", "instantiate"}
    _check_norms(dp, ref, max_grad_norm, 1e-3, "inductor")
    assert_close_all(_params(model, "grad"), ref.grad("mean", max_grad_norm), 1e-3, "inductor: clipped grad")


def test_inductor_grad_sample_lands_on_conv_weight():
    torch.manual_seed(6)
    model = C2(3, 4, 3, bias=False)
    x = torch.randn(2, 3, 5, 5)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    ref = reference(model, (x,), lambda out, i: _per_sample_loss(out, target[i:i + 1]).sum())
    dp = _step(model, x, target, "sum", grad_sample=True, compiler="inductor")
    assert_close_all(_params(model, "grad_sample"), ref.per_sample, 1e-3, "inductor: grad_sample")
    assert_close_all({"norms": dp.per_sample_norms}, {"norms": ref.norms}, 1e-3, "inductor: norms")


class PooledConv(nn.Module):
    """A conv followed by an average pool given one size for all its dims."""

    def __init__(self, pool: Callable[[torch.Tensor], torch.Tensor], conv: nn.Module):
        super().__init__()
        self.conv, self.pool = conv, pool

    def forward(self, x):
        return self.pool(self.conv(x)).flatten(1)


@pytest.mark.parametrize("pool,conv,shape", [
    (lambda h: F.avg_pool2d(h, 3, stride=2, padding=(1,)), C2(3, 4, 3, padding=1), (3, 3, 8, 8)),
    (lambda h: F.avg_pool2d(h, (3,), stride=(2,), padding=1, count_include_pad=False), C2(3, 4, 3), (3, 3, 9, 8)),
    (lambda h: F.avg_pool2d(h, (2,), padding=(1,), ceil_mode=True), C2(3, 4, 3), (3, 3, 7, 7)),
    (lambda h: F.avg_pool3d(h, 3, stride=2, padding=(1,)), C3(2, 3, 3, padding=1), (3, 2, 5, 5, 4)),
    (lambda h: F.avg_pool2d(h, (3,)), C2(3, 4, 3), (3, 3, 8, 8)),
    (lambda h: F.avg_pool2d(h, 2), C2(3, 4, 3), (3, 3, 8, 8)),
    (lambda h: F.avg_pool2d(h, (2, 2), (2, 2), (0, 0)), C2(3, 4, 3), (3, 3, 8, 8)),
], ids=["padding", "kernel-and-stride", "no-stride-ceil", "3d", "kernel-only", "full-no-padding",
        "full-zero-padding"])
def test_inductor_avg_pool_with_one_size_for_all_dims(pool, conv, shape):
    """``avg_pool{2,3}d`` reads a one-element ``kernel_size``/``stride``/``padding`` as
    that size in every dim; Inductor's lowering of its backward asserts full lists
    (torch 2.13: plain ``torch.compile`` fails too). Canonicalisation widens them, and
    leaves full ones, and the defaults it is called back with, alone (a pool without
    padding recursed until Python's limit)."""
    torch.manual_seed(8)
    model, x = PooledConv(pool, conv), torch.randn(shape)
    ref = reference(model, (x,), lambda out, i: out.pow(2).sum())
    model.zero_grad(set_to_none=True)
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="inductor")
    dp(x).pow(2).sum().backward()
    assert_close_all(_params(model, "grad_sample"), ref.per_sample, 1e-3, "inductor: grad_sample")
    spatial = x.dim() - 2
    canonical = dp.explain().graphs[0].stages["canonical"]
    full = ", ".join([r"\d+"] * spatial)  # the kernel size, one entry per spatial dim
    assert re.search(rf"avg_pool{spatial}d\.default\(\w+, \[{full}\]", canonical), canonical


@pytest.mark.parametrize("layer", [
    nn.Conv2d(1, 4, 3),  # one input channel: a grayscale image's first layer
    nn.Conv2d(4, 4, 3, padding=1, groups=4),  # depthwise (ConvNeXt, MobileNet)
    nn.ConvTranspose1d(4, 4, 3, groups=4),
], ids=["one-input-channel", "depthwise", "transposed-depthwise"])
def test_inductor_depthwise_per_sample_grads_keep_the_batch_size_symbolic(layer: nn.Module):
    """A weight with one input channel per group gets its per-sample gradients by a
    convolution with the samples as groups. Inductor's lowering of that convolution
    reads ``n·groups`` as an int, which pinned the batch size: every new size compiled
    again until Dynamo's recompile limit stopped training. Four sizes, two graphs."""
    torch.manual_seed(5)
    spatial = (6,) if isinstance(layer, nn.ConvTranspose1d) else (6, 6)
    model = nn.Sequential(layer, nn.Tanh(), nn.Flatten(), nn.LazyLinear(3))
    model(torch.randn(1, layer.in_channels, *spatial))  # materialise the lazy layer
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    dp = fxdp.transform(model, max_grad_norm=0.1, grad_sample=True, compiler="inductor")
    for batch in (4, 6, 5, 7):
        x = torch.randn(batch, layer.in_channels, *spatial)
        model.zero_grad()
        dp(x).pow(2).sum(1).mean().backward()
        ref = reference(model, (x,), lambda out, i: out.pow(2).sum())
        assert_close_all(_params(model, "grad_sample"), ref.per_sample, 1e-3, f"grad_sample (B={batch})")
        assert_close_all(_params(model, "grad"), ref.grad("mean", 0.1), 1e-3, f"clipped grad (B={batch})")
    assert counters["stats"]["unique_graphs"] == 2


class OneChannelBottleneck(nn.Module):
    """A depthwise block narrowing to one channel, then a conv reading it."""

    def __init__(self, channels: int):
        super().__init__()
        self.dw = nn.Conv2d(channels, channels, 3, 2, 1, groups=channels, bias=False)
        self.norm = nn.GroupNorm(1, channels)
        self.proj = nn.Conv2d(channels, 1, 1, bias=False)
        self.head = nn.Conv2d(1, 2, 1)

    def forward(self, x):
        return self.head(self.proj(F.hardswish(self.norm(self.dw(x)))))


@pytest.mark.parametrize("channels", [2, 3])
def test_inductor_a_conv_reading_one_channel(channels):
    """A one-channel activation has the same elements at channels-first and
    channels-last strides. Inductor (``layout_optimization=False``, torch 2.13) planned
    one and the kernel wrote the other; the next convolution chose its output's layout
    from them and the planned strides failed Inductor's check (``expected size 2==2,
    stride 6==1``). Plain ``torch.compile`` fails the same way under that setting."""
    torch.manual_seed(0)
    model = OneChannelBottleneck(channels)
    x = torch.randn(3, channels, 4, 5).to(memory_format=torch.channels_last)
    ref = reference(model, (x,), lambda out, i: out.pow(2).sum())
    model.zero_grad(set_to_none=True)
    dp = fxdp.transform(model, max_grad_norm=0.5, grad_sample=True, loss_reduction="sum", compiler="inductor")
    dp(x).pow(2).sum().backward()
    assert_close_all(_params(model, "grad_sample"), ref.per_sample, 1e-3, "inductor: grad_sample")
    assert_close_all(_params(model, "grad"), ref.grad("sum", 0.5), 1e-3, "inductor: clipped grad")


def test_fastest_route_times_each_route_once_per_key():
    """``fastest_route`` runs every route on a key's first call and keeps the fastest
    run's result and name; later calls run that route only; ``forced_route`` wins, and
    deterministic algorithms take the first route."""
    from fxdp.rules import _common

    calls = {"slow": 0, "fast": 0}

    def route(name, seconds):
        def run():
            calls[name] += 1
            time.sleep(seconds)
            return torch.tensor(seconds, dtype=torch.float64)
        return run

    routes = {"slow": route("slow", 0.02), "fast": route("fast", 0.0)}
    key = ("test_fastest_route", object())
    assert _common.fastest_route(key, routes, torch.device("cpu")).item() == 0.0
    assert calls == {"slow": _common.ROUTE_TRIALS, "fast": _common.ROUTE_TRIALS}
    assert _common.ROUTE_CHOICES[(*key, torch.get_num_threads())] == "fast"
    assert _common.fastest_route(key, routes, torch.device("cpu")).item() == 0.0
    assert calls == {"slow": _common.ROUTE_TRIALS, "fast": _common.ROUTE_TRIALS + 1}
    with forced_route("slow"):
        assert _common.fastest_route(key, routes, torch.device("cpu")).item() == 0.02
    with forced_route("not offered here"):
        assert _common.fastest_route(key, routes, torch.device("cpu")).item() == 0.0
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:  # the first route, untimed: a timed choice may differ between runs
        assert _common.fastest_route(("test_fastest_route", object()), routes, torch.device("cpu")).item() == 0.02
    finally:
        torch.use_deterministic_algorithms(deterministic)
