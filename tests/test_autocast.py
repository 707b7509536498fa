"""Mixed precision: ``torch.autocast`` around the call or inside the forward; and
models whose parameters are in half precision.

fxdp writes autocast's casts into the graph (``passes/autocast.py``) and runs it with
autocast off, so it computes what eager autocast computes. Ground truth is the
microbatch loop run under the same autocast; the tolerance is the low precision's
(each sample's gradient is rounded differently when computed alone and in a batch).
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import fxdp
from models import FirstOutput
from reference import assert_close_all, reference

B, T, D = 4, 5, 8
# Relative to the largest reference value: a few roundings of the low precision.
TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


MODELS = {
    "mlp": (lambda: nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 3)), lambda: [_randn(B, D)]),
    "sequence-layernorm": (lambda: nn.Sequential(nn.Linear(D, 16), nn.LayerNorm(16), nn.Linear(16, 3)),
                           lambda: [_randn(B, T, D)]),
    "conv-groupnorm": (lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.ReLU(), nn.Conv2d(8, 4, 3)),
                       lambda: [_randn(B, 3, 9, 9)]),
    "embedding": (lambda: nn.Sequential(nn.Embedding(20, D), nn.Linear(D, 3)),
                  lambda: [torch.randint(0, 20, (B, T), generator=torch.Generator().manual_seed(2))]),
    "attention": (lambda: FirstOutput(nn.MultiheadAttention(D, 2, batch_first=True)),
                  lambda: [_randn(B, T, D), _randn(B, T, D, seed=2), _randn(B, T, D, seed=3)]),
    "encoder-layer": (lambda: nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True),
                      lambda: [_randn(B, T, D)]),
    "lstm": (lambda: FirstOutput(nn.LSTM(D, 6, batch_first=True)), lambda: [_randn(B, T, D)]),
}


def _bfloat16_lstm_runs() -> bool:
    """Whether this CPU runs a bfloat16 LSTM at all: oneDNN needs instructions for it
    that some CPUs lack (an AMD EPYC without AVX-512 BF16: "could not create a primitive
    descriptor for the LSTM forward propagation primitive", in eager autocast too)."""
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            nn.LSTM(2, 2)(torch.ones(1, 1, 2))
    except RuntimeError:
        return False
    return True


# oneDNN has no float16 LSTM on CPU (eager autocast fails too).
CASES = [pytest.param(name, dtype, id=f"{name}-{str(dtype)[6:]}", marks=pytest.mark.skipif(
             name == "lstm" and not _bfloat16_lstm_runs(), reason="this CPU's oneDNN runs no bfloat16 LSTM"))
         for name in MODELS for dtype in (torch.bfloat16, torch.float16)
         if not (name == "lstm" and dtype == torch.float16)]


def _sq_loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).sum()


def _against_the_loop(model, args, dtype, mode, context=contextlib.nullcontext):
    """``mode``'s transform (``grad_sample-sum`` or ``clip-mean``) of ``model`` called in
    ``context``, its ``p.grad``, ``p.grad_sample`` and norms against the microbatch loop
    run in the same context, compared in float32 at the low precision's tolerance.

    Returns:
        The transformed copy's trainable parameters by name, and its output.
    """
    with context():
        ref = reference(model, args, lambda out, i: _sq_loss(out))
    clip = float(ref.norms.median()) if mode.startswith("clip") else None
    reduction = mode.split("-")[1]
    m = copy.deepcopy(model)
    dp = fxdp.transform(m, max_grad_norm=clip, grad_sample=clip is None, loss_reduction=reduction,
                        compiler="eager")
    with context():
        out = dp(*args)
    loss = _sq_loss(out)
    (loss / B if reduction == "mean" else loss).backward()
    tol = TOL[dtype]
    trainable = {n: p for n, p in m.named_parameters() if p.requires_grad}
    assert_close_all({n: p.grad.float() for n, p in trainable.items()},
                     {n: g.float() for n, g in ref.grad(reduction, clip).items()}, tol, "p.grad")
    if clip is None:
        assert_close_all({n: p.grad_sample.float() for n, p in trainable.items()},
                         {n: g.float() for n, g in ref.per_sample.items()}, tol, "p.grad_sample")
    assert (dp.per_sample_norms.float() - ref.norms.float()).abs().max() <= tol * ref.norms.float().max()
    return trainable, out


@pytest.mark.parametrize("mode", ["grad_sample-sum", "clip-mean"])
@pytest.mark.parametrize("name,dtype", CASES)
def test_autocast_around_the_call(name, dtype, mode):
    make, make_args = MODELS[name]
    torch.manual_seed(0)
    model, args = make(), make_args()
    with torch.autocast("cpu", dtype=dtype):
        eager_out = model(*args)
    trainable, out = _against_the_loop(model, args, dtype, mode, lambda: torch.autocast("cpu", dtype=dtype))
    if name != "lstm":  # decomposed into linears (bfloat16) and a float32 state update
        assert out.dtype == eager_out.dtype  # autocast's precision, not float32
    assert all(p.grad.dtype == torch.float32 for p in trainable.values())


class RegionsInside(nn.Module):
    """An autocast region in the forward, with a float32 island (``enabled=False``)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, 16)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))
        self.b = nn.Linear(16, 3)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.a(x)
            with torch.autocast("cpu", enabled=False):
                h = h.float() * self.scale
            return self.b(h)


def test_autocast_regions_inside_the_forward():
    torch.manual_seed(0)
    model, x = RegionsInside(), _randn(B, T, D)
    ref = reference(model, [x], lambda out, i: _sq_loss(out))
    m = copy.deepcopy(model)
    dp = fxdp.transform(m, grad_sample=True, loss_reduction="sum", compiler="eager")
    out = dp(x)
    assert out.dtype == torch.bfloat16
    _sq_loss(out).backward()
    assert_close_all({n: p.grad_sample for n, p in m.named_parameters()}, ref.per_sample, TOL[torch.bfloat16],
                     "p.grad_sample")
    forward = str(dp.explain()).split("--- backward")[0]
    assert "_enter_autocast" not in forward and "_to_copy" in forward


def test_parameter_casts_keep_the_rules_strategies():
    """Autocast's ``w.to(bfloat16)`` is a parameter transform whose VJP keeps norms: the
    rules still pick their own strategies, not a per-sample VJP: here ghost norms for the
    weights, kept per-sample gradients (summed with the clip factors) for the biases."""
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        text = str(fxdp.explain(model, _randn(B, 4, 64), max_grad_norm=1.0))
    assert "0.weight: rule=linear.weight uses=1 strategy=ghost" in text
    assert "0.bias: rule=linear.bias uses=1 strategy=instantiate + keep" in text
    assert "per-sample VJP" not in text


def test_autocast_with_inductor():
    torch.manual_seed(0)
    make, make_args = MODELS["sequence-layernorm"]
    model, args = make(), make_args()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = reference(model, args, lambda out, i: _sq_loss(out))
    m = copy.deepcopy(model)
    dp = fxdp.transform(m, grad_sample=True, loss_reduction="sum", compiler="inductor")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = dp(*args)
    _sq_loss(out).backward()
    assert_close_all({n: p.grad_sample for n, p in m.named_parameters()}, ref.per_sample, TOL[torch.bfloat16],
                     "p.grad_sample")


class ConstantAndEinsum(nn.Module):
    """A tensor built in the forward (DeBERTa-v2's log buckets) and an einsum of a
    bfloat16 projection with a float32 sum (Funnel's relative attention): eager autocast
    casts inside the einsum, sub-op by sub-op."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.bias = nn.Parameter(torch.linspace(-1, 1, D))

    def forward(self, x):
        scale = torch.tensor(0.5).type_as(x)
        return torch.einsum("bid,bjd->bij", x + self.bias, self.fc(x)) * scale


def test_autocast_constants_and_composite_ops():
    torch.manual_seed(0)
    model, x = ConstantAndEinsum(), _randn(B, T, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = reference(model, [x], lambda out, i: _sq_loss(out))
        eager_out = model(x)
    m = copy.deepcopy(model)
    dp = fxdp.transform(m, grad_sample=True, loss_reduction="sum", compiler="eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = dp(x)
    assert out.dtype == eager_out.dtype == torch.bfloat16
    _sq_loss(out).backward()
    assert_close_all({n: p.grad_sample for n, p in m.named_parameters()}, ref.per_sample, TOL[torch.bfloat16],
                     "p.grad_sample")


@pytest.mark.parametrize("positions", [1, 128])
def test_gram_norms_of_half_precision_operands(positions):
    """Autocast's ghost norms: whole Gram matrices in bfloat16, their inner product in
    float32, the result in the operands' dtype (what the fake kernels declare)."""
    from fxdp.rules._common import gram_inner

    g, a = _randn(3, positions, 24, seed=4), _randn(3, positions, 40, seed=5)
    expected = torch.einsum("nto,nti->noi", g.double(), a.double()).pow(2).sum((1, 2))
    got = gram_inner(g.bfloat16(), a.bfloat16())
    assert got.dtype == torch.bfloat16
    assert ((got.double() - expected).abs() / expected).max() < 2e-2


@pytest.mark.parametrize("weight", [1e3, 3e-4], ids=["overflow", "underflow"])
@pytest.mark.parametrize("name", ["mlp", "sequence-layernorm", "conv-groupnorm", "embedding", "attention"])
def test_float16_norms_neither_overflow_nor_underflow(name, weight):
    """Squared norms of float16 per-sample gradients: a norm above 256 squares past
    float16's 65504 (a loss weight, a loss scale), and a mean's 1/B squared falls below
    its 6e-8. Either would give that sample a clip factor of 0 or 1, silently; fxdp takes
    the squares in float32 (ghost norms and instantiated ones alike). Ground truth: the
    microbatch loop under the same autocast, each sample's norm to a relative 1e-2."""
    make, make_args = MODELS[name]
    torch.manual_seed(0)
    model, args = make(), make_args()
    autocast = lambda: torch.autocast("cpu", dtype=torch.float16)  # noqa: E731
    with autocast():
        ref = reference(model, args, lambda out, i: weight * _sq_loss(out))
    clip = float(ref.norms.median())
    m = copy.deepcopy(model)
    dp = fxdp.transform(m, max_grad_norm=clip, compiler="eager")
    with autocast():
        out = dp(*args)
    (weight * _sq_loss(out) / B).backward()
    assert ((dp.per_sample_norms - ref.norms.float()).abs() / ref.norms.float()).max() < 1e-2
    assert_close_all({n: p.grad.float() for n, p in m.named_parameters()},
                     {n: g.float() for n, g in ref.grad("mean", clip).items()}, 1e-2, "p.grad")


def test_loss_scaling_clips_the_scaled_gradients_and_a_fixed_scale_recipe_undoes_it():
    """The user guide's account of GradScaler: fxdp clips what backward sees (S·g_i), so
    under a scaler the bound is C/S; a fixed scale with max_grad_norm=C·S undoes it. Both
    up to the 1e-6 in the factor (C/(S·‖g‖ + 1e-6) against (C/S)/(‖g‖ + 1e-6)): 1e-5."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = _randn(B, D).double()
    ref = reference(model, [x], lambda out, i: out.pow(2).sum())
    clip, scale = float(ref.norms.median()), 1024.0
    grads = lambda: {n: p.grad.clone() for n, p in model.named_parameters()}  # noqa: E731

    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    dp = fxdp.transform(model, max_grad_norm=clip, compiler="eager")
    scaler.scale(dp(x).pow(2).sum(1).mean()).backward()
    scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
    assert_close_all(grads(), ref.grad("mean", clip / scale), 1e-5, "clipped at C/S")
    torch.testing.assert_close(dp.per_sample_norms, scale * ref.norms)

    model.zero_grad()
    dp = fxdp.transform(model, max_grad_norm=clip * scale, compiler="eager")
    (scale * dp(x).pow(2).sum(1).mean()).backward()
    for p in model.parameters():
        p.grad /= scale
    assert_close_all(grads(), ref.grad("mean", clip), 1e-5, "fixed-scale recipe")


@pytest.mark.parametrize("mode", ["grad_sample-sum", "clip-mean"])
@pytest.mark.parametrize("name,dtype", CASES)
def test_parameters_in_low_precision(name, dtype, mode):
    """A model converted to half precision (``model.to(torch.bfloat16)``, as LLM fine-tuning
    does with its frozen base): gradients, grad samples and their arithmetic stay in
    that precision, as they do under eager autograd and in Opacus; the norms are
    float32. Ground truth is the microbatch loop of the same half-precision model."""
    make, make_args = MODELS[name]
    torch.manual_seed(0)
    model = make().to(dtype)
    args = [a.to(dtype) if a.is_floating_point() else a for a in make_args()]
    params, out = _against_the_loop(model, args, dtype, mode)
    assert out.dtype == dtype
    if mode.startswith("grad_sample"):
        assert all(p.grad_sample.dtype == dtype for p in params.values())
    assert all(p.grad.dtype == dtype for p in params.values())
