"""``aten.linear`` (``nn.Linear``, ``F.linear``) against the microbatch reference.

One table of cases — input rank x bias x loss reduction x batch layout x mode x
dtype — run with ``compiler="eager"``; a few ``test_inductor_*`` cases run the same
checks through Inductor. Every case checks, separately, ``p.grad``,
``p.grad_sample`` (shape and values), ``dp_model.per_sample_norms`` and
``dp_model.clip_factors`` against ``tests/reference.py``. Then the cases the table
cannot express: a weight passed to ``forward`` as an argument, a weight used twice
in one forward, the ghost-vs-instantiate choice, and hypothesis-drawn shapes.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxdp
from reference import Reference, assert_close_all, reference, tolerance

# Sizes of the table's inputs; all distinct so that a size mix-up shows.
B, H, T, D_IN, D_HIDDEN, D_OUT = 4, 2, 3, 7, 6, 5
PROJECTION_WIDTH = 3

MODES = {
    # name: (grad_sample, clip)
    "norms": (False, False),
    "grad_sample": (True, False),
    "clip": (False, True),
    "clip_grad_sample": (True, True),
}
# The table runs the three modes of the contract; "clip_grad_sample" runs in the
# other tests (weight argument, tied weights, hypothesis, Inductor).
TABLE_MODES = ("norms", "grad_sample", "clip")


# -- helpers -----------------------------------------------------------------------------

def projection(d_out: int, dtype: torch.dtype, seed: int = 1234) -> torch.Tensor:
    """A fixed random ``[d_out, PROJECTION_WIDTH]`` matrix the loss projects onto."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(d_out, PROJECTION_WIDTH, generator=g, dtype=torch.float64).to(dtype)


def per_sample_loss(out: torch.Tensor, proj: torch.Tensor, batch_dim: int) -> torch.Tensor:
    """``[B]``: each sample's sum over positions of ``‖out_t · proj‖²``."""
    y = (out @ proj).pow(2).movedim(batch_dim, 0)
    return y.reshape(y.shape[0], -1).sum(1)


def batched_loss(out: torch.Tensor, proj: torch.Tensor, reduction: str, batch_dim: int = 0) -> torch.Tensor:
    per = per_sample_loss(out, proj, batch_dim)
    return per.mean() if reduction == "mean" else per.sum()


def reference_loss(proj: torch.Tensor, batch_dim: int = 0):
    """``loss_fn(out, i)`` for ``reference``: the batched loss on a batch of one."""
    return lambda out, i: per_sample_loss(out, proj, batch_dim).sum()


def median_clip(ref: Reference) -> float:
    """A clip norm that clips about half of the samples and leaves the others."""
    return float(ref.norms.median())


def named(model: nn.Module, attribute: str) -> dict[str, torch.Tensor | None]:
    return {n: getattr(p, attribute, None) for n, p in model.named_parameters() if p.requires_grad}


def check_results(dp_model: fxdp.DPModule, params: dict[str, nn.Parameter], ref: Reference, *,
                  reduction: str, grad_sample: bool, clip: float | None, dtype: torch.dtype,
                  what: str = "") -> None:
    """``p.grad``, ``p.grad_sample``, ``per_sample_norms``, ``clip_factors``, each on its own.

    Args:
        params: reference parameter name -> the parameter the DP model trained.
    """
    tol = tolerance(dtype)
    batch_size = ref.batch_size

    assert_close_all({n: p.grad for n, p in params.items()}, ref.grad(reduction, clip), tol,
                     f"{what} p.grad")

    if grad_sample:
        for n, p in params.items():
            gs = getattr(p, "grad_sample", None)
            assert gs is not None, f"{what}: {n} has no grad_sample"
            assert gs.shape == (batch_size, *p.shape), f"{what}: {n}.grad_sample shape {tuple(gs.shape)}"
        # The reference holds each sample's own gradient: for "mean" the 1/B must be undone.
        assert_close_all({n: p.grad_sample for n, p in params.items()}, ref.per_sample, tol,
                         f"{what} p.grad_sample")
    else:
        for n, p in params.items():
            assert getattr(p, "grad_sample", None) is None, f"{what}: {n} got a grad_sample unasked"

    norms = dp_model.per_sample_norms
    assert norms is not None, f"{what}: no per_sample_norms"
    assert norms.shape == (batch_size,), f"{what}: per_sample_norms shape {tuple(norms.shape)}"
    assert_close_all({"norms": norms}, {"norms": ref.norms}, tol, f"{what} per_sample_norms")

    factors = dp_model.clip_factors
    if clip is None:
        assert factors is None, f"{what}: clip_factors without max_grad_norm"
    else:
        assert factors is not None and factors.shape == (batch_size,), f"{what}: clip_factors {factors}"
        assert_close_all({"clip_factors": factors}, {"clip_factors": ref.clip_factors(clip)}, tol,
                         f"{what} clip_factors")


# -- the table ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    rank: int            # 2: [B, d]; 3: [B, T, d]; 4: [B, H, T, d] (batch_first=False: B at dim 1)
    bias: bool
    reduction: str
    batch_first: bool
    mode: str
    dtype: torch.dtype

    @property
    def id(self) -> str:
        layout = "bfirst" if self.batch_first else "tfirst"
        bias = "bias" if self.bias else "nobias"
        return f"rank{self.rank}-{bias}-{self.reduction}-{layout}-{self.mode}-{str(self.dtype)[6:]}"


def input_shape(rank: int, batch_first: bool, batch: int = B, heads: int = H, steps: int = T,
                features: int = D_IN) -> tuple[int, ...]:
    if rank == 2:
        assert batch_first, "a [d, B] input puts the batch in the feature dim"
        return (batch, features)
    leading = (batch, steps) if rank == 3 else (batch, heads, steps)
    if not batch_first:  # [T, B, d], [T, B, H, d]: the batch at dim 1
        leading = (leading[-1], batch, *leading[1:-1])
    return (*leading, features)


def two_layer(d_in: int, d_hidden: int, d_out: int, bias: bool, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """``Linear -> Tanh -> Linear``: acts on the last dim, so whatever leads (T or B) stays first."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, d_hidden, bias=bias), nn.Tanh(),
                         nn.Linear(d_hidden, d_out, bias=bias)).to(dtype)


def run_case(case: Case, compiler: str = "eager") -> dict:
    model = two_layer(D_IN, D_HIDDEN, D_OUT, case.bias, case.dtype)
    torch.manual_seed(1)
    x = torch.randn(input_shape(case.rank, case.batch_first), dtype=case.dtype)
    batch_dim = 0 if case.batch_first else 1
    proj = projection(D_OUT, case.dtype)
    ref = reference(model, [x], reference_loss(proj, batch_dim), batch_dim=batch_dim)
    grad_sample, clipped = MODES[case.mode]
    clip = median_clip(ref) if clipped else None

    dp_model = fxdp.transform(model, max_grad_norm=clip, grad_sample=grad_sample,
                              loss_reduction=case.reduction, batch_first=case.batch_first,
                              compiler=compiler)
    out = dp_model(x)
    assert out.shape == (*x.shape[:-1], D_OUT)
    batched_loss(out, proj, case.reduction, batch_dim).backward()
    check_results(dp_model, dict(model.named_parameters()), ref, reduction=case.reduction,
                  grad_sample=grad_sample, clip=clip, dtype=case.dtype, what=case.id)
    return {"plans": dp_model.explain().plans}


TABLE = [
    Case(rank, bias, reduction, batch_first, mode, dtype)
    for dtype, rank, bias, reduction, batch_first, mode in itertools.product(
        (torch.float64, torch.float32), (2, 3, 4), (True, False), ("mean", "sum"), (True, False), TABLE_MODES)
    # rank 2 with batch_first=False is refused: see test_rank2_batch_second_is_refused.
    if batch_first or rank > 2
]


@pytest.mark.parametrize("case", TABLE, ids=[c.id for c in TABLE])
def test_linear(case: Case):
    run_case(case)


def test_table_covers_both_strategies():
    """Without grad_sample the cost model decides; the table's sizes must reach both routes."""
    strategies = set()
    for rank in (3, 4):
        plans = run_case(Case(rank, True, "mean", True, "clip", torch.float64))["plans"]
        # "instantiate + keep": instantiated, and small enough against its operands to keep
        strategies |= {p.strategy.removesuffix(" + keep") for p in plans if p.rule == "linear.weight"}
    assert strategies == {"ghost", "instantiate"}


INDUCTOR_CASES = [
    Case(3, True, "mean", True, "clip", torch.float32),
    Case(4, False, "sum", False, "grad_sample", torch.float32),
    Case(2, True, "mean", True, "clip_grad_sample", torch.float64),
]


@pytest.mark.parametrize("case", INDUCTOR_CASES, ids=[c.id for c in INDUCTOR_CASES])
def test_inductor_linear(case: Case):
    run_case(case, compiler="inductor")


def test_rank2_batch_second_is_refused():
    """``batch_first=False`` on ``[B, d]`` makes the features the batch: linear contracts it."""
    model = two_layer(D_IN, D_HIDDEN, D_OUT, True, torch.float64)
    dp_model = fxdp.transform(model, batch_first=False, compiler="eager")
    with pytest.raises(Exception, match="the batch dim is the feature dim that linear contracts"):
        dp_model(torch.randn(B, D_IN, dtype=torch.float64))


def test_rank2_batch_second_raises_unsupported_error():
    model = two_layer(D_IN, D_HIDDEN, D_OUT, True, torch.float64)
    dp_model = fxdp.transform(model, batch_first=False, compiler="eager")
    with pytest.raises(fxdp.UnsupportedError, match="feature dim that linear contracts"):
        dp_model(torch.randn(B, D_IN, dtype=torch.float64))


# -- a weight passed to forward ----------------------------------------------------------

class FunctionalWeight(nn.Module):
    """``F.linear(x, w)`` with ``w`` an argument, followed by an owned Linear."""

    def __init__(self, bias: bool):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(D_HIDDEN)) if bias else None
        self.head = nn.Linear(D_HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(F.linear(x, w, self.bias)))


class HoldsWeight(nn.Module):
    """The reference's view of ``FunctionalWeight``: ``w`` as a parameter of its own."""

    def __init__(self, inner: nn.Module, w: nn.Parameter):
        super().__init__()
        self.inner = inner
        self.w = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x, self.w)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_functional_weight_argument(dtype, bias, mode):
    torch.manual_seed(0)
    model = FunctionalWeight(bias).to(dtype)
    w = nn.Parameter(torch.randn(D_HIDDEN, D_IN, dtype=dtype))
    x = torch.randn(B, T, D_IN, dtype=dtype)
    proj = projection(D_OUT, dtype)
    ref = reference(HoldsWeight(model, w), [x], reference_loss(proj))
    grad_sample, clipped = MODES[mode]
    clip = median_clip(ref) if clipped else None

    dp_model = fxdp.transform(model, max_grad_norm=clip, grad_sample=grad_sample, compiler="eager")
    batched_loss(dp_model(x, w), proj, "mean").backward()
    params = {f"inner.{n}": p for n, p in model.named_parameters()}
    params["w"] = w
    check_results(dp_model, params, ref, reduction="mean", grad_sample=grad_sample, clip=clip,
                  dtype=dtype, what=f"functional weight {mode}")


# -- a weight used twice -----------------------------------------------------------------

class SameLinearTwice(nn.Module):
    """One ``nn.Linear`` applied twice in a row: ``W`` sees ``x`` and ``tanh(W x + b)``."""

    def __init__(self, d: int):
        super().__init__()
        self.layer = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.tanh(self.layer(x)))


class WeightOnTwoInputs(nn.Module):
    """``tanh(F.linear(x, W, b)) + F.linear(z, W)``: one weight, two inputs of the batch.

    ``detach_use`` (1 or 2) cuts one use from the gradient without changing the
    forward, to tell the per-use gradients apart in the reference.
    """

    def __init__(self, d_in: int, d_out: int, detach_use: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in ** 0.5)
        self.bias = nn.Parameter(torch.randn(d_out))
        self.detach_use = detach_use

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        w1 = self.weight.detach() if self.detach_use == 1 else self.weight
        w2 = self.weight.detach() if self.detach_use == 2 else self.weight
        return torch.tanh(F.linear(x, w1, self.bias)) + F.linear(z, w2)


def run_same_linear_twice(steps: int, dtype: torch.dtype, mode: str, compiler: str = "eager") -> None:
    torch.manual_seed(0)
    model = SameLinearTwice(D_IN).to(dtype)
    x = torch.randn(B, steps, D_IN, dtype=dtype)
    proj = projection(D_IN, dtype)
    ref = reference(model, [x], reference_loss(proj))
    grad_sample, clipped = MODES[mode]
    clip = median_clip(ref) if clipped else None

    dp_model = fxdp.transform(model, max_grad_norm=clip, grad_sample=grad_sample, compiler=compiler)
    batched_loss(dp_model(x), proj, "mean").backward()
    check_results(dp_model, dict(model.named_parameters()), ref, reduction="mean",
                  grad_sample=grad_sample, clip=clip, dtype=dtype, what=f"same linear twice {mode}")
    plan = {p.name: p for p in dp_model.explain().plans}
    assert plan["layer.weight"].uses == 2


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("steps", [1, T], ids=["T1", f"T{T}"])
def test_same_linear_twice(steps, dtype, mode):
    run_same_linear_twice(steps, dtype, mode)


def test_inductor_same_linear_twice():
    run_same_linear_twice(T, torch.float32, "clip")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_weight_on_two_inputs(dtype, mode):
    torch.manual_seed(0)
    model = WeightOnTwoInputs(D_IN, D_OUT).to(dtype)
    x = torch.randn(B, T, D_IN, dtype=dtype)
    z = torch.randn(B, T, D_IN, dtype=dtype)
    proj = projection(D_OUT, dtype)
    loss_fn = reference_loss(proj)
    ref = reference(model, [x, z], loss_fn)
    grad_sample, clipped = MODES[mode]
    clip = median_clip(ref) if clipped else None

    dp_model = fxdp.transform(model, max_grad_norm=clip, grad_sample=grad_sample, compiler="eager")
    batched_loss(dp_model(x, z), proj, "mean").backward()
    check_results(dp_model, dict(model.named_parameters()), ref, reduction="mean",
                  grad_sample=grad_sample, clip=clip, dtype=dtype, what=f"weight on two inputs {mode}")
    plan = {p.name: p for p in dp_model.explain().plans}
    assert plan["weight"].uses == 2


def test_weight_on_two_inputs_has_a_cross_term():
    """The case above is only a test of the cross term if leaving it out is visibly wrong."""
    dtype = torch.float64
    torch.manual_seed(0)
    model = WeightOnTwoInputs(D_IN, D_OUT).to(dtype)
    x = torch.randn(B, T, D_IN, dtype=dtype)
    z = torch.randn(B, T, D_IN, dtype=dtype)
    loss_fn = reference_loss(projection(D_OUT, dtype))
    full = reference(model, [x, z], loss_fn).per_sample["weight"]
    only = {}
    for use in (1, 2):
        cut = copy.deepcopy(model)
        cut.detach_use = 3 - use
        only[use] = reference(cut, [x, z], loss_fn).per_sample["weight"]
    torch.testing.assert_close(only[1] + only[2], full, rtol=0, atol=1e-12)
    with_cross = full.flatten(1).norm(dim=1)
    without = (only[1].flatten(1).norm(dim=1) ** 2 + only[2].flatten(1).norm(dim=1) ** 2).sqrt()
    assert (with_cross - without).abs().max() > 1e-3 * with_cross.max()


# -- ghost or instantiate ----------------------------------------------------------------

@pytest.mark.parametrize("steps,features,budget,expected,mode", [
    (2, 64, None, "ghost", "norms"),
    (2, 64, None, "ghost", "clip"),
    (64, 2, None, "instantiate + keep", "norms"),
    (64, 2, None, "instantiate + keep", "clip"),
    (64, 2, 0, "instantiate", "norms"),
    (64, 2, 0, "instantiate", "clip"),
    (2, 64, 0, "instantiate + keep", "grad_sample"),
], ids=["T_small-ghost-norms", "T_small-ghost-clip", "T_large-instantiate-keep-norms",
        "T_large-instantiate-keep-clip", "T_large-instantiate-no-budget-norms",
        "T_large-instantiate-no-budget-clip", "grad_sample-keeps-whatever-the-budget"])
def test_ghost_or_instantiate(steps, features, budget, expected, mode):
    """``Σ_t,s (a_t·a_s)(g_t·g_s)`` pays when T² ≪ d_in·d_out; otherwise instantiate, and
    keep the per-sample gradient when it is smaller than its operands (unless the
    memory budget is 0). With ``grad_sample=True`` it exists anyway and is always kept.
    All exact."""
    dtype = torch.float64
    torch.manual_seed(0)
    model = nn.Linear(features, features).to(dtype)
    x = torch.randn(3, steps, features, dtype=dtype)
    proj = projection(features, dtype)
    ref = reference(model, [x], reference_loss(proj))
    clip = median_clip(ref) if mode in ("clip", "grad_sample") else None
    grad_sample = mode == "grad_sample"

    dp_model = fxdp.transform(model, max_grad_norm=clip, grad_sample=grad_sample, compiler="eager",
                              memory_budget_bytes=budget)
    batched_loss(dp_model(x), proj, "mean").backward()
    plan = {p.name: p for p in dp_model.explain().plans}["weight"]
    assert plan.strategy == expected, plan
    assert set(plan.costs) == {"ghost", "instantiate"}, plan
    if not grad_sample:
        assert plan.costs[expected.removesuffix(" + keep")] == min(plan.costs.values()), plan
    check_results(dp_model, dict(model.named_parameters()), ref, reduction="mean", grad_sample=grad_sample,
                  clip=clip, dtype=dtype, what=f"{expected} {mode}")


# -- hypothesis ---------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 6), steps=st.integers(1, 5), heads=st.integers(1, 3),
    d_in=st.integers(1, 7), d_out=st.integers(1, 7), rank=st.integers(2, 4),
    bias=st.booleans(), reduction=st.sampled_from(["mean", "sum"]), batch_first=st.booleans(),
    mode=st.sampled_from(list(MODES)),
)
def test_drawn_shapes(batch, steps, heads, d_in, d_out, rank, bias, reduction, batch_first, mode):
    torch._dynamo.reset()  # a fresh compile per example: never near the recompile limit
    batch_first = batch_first or rank == 2
    batch_dim = 0 if batch_first else 1
    dtype = torch.float64
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d_in, d_out, bias=bias), nn.Tanh(),
                          nn.Linear(d_out, d_out, bias=bias)).to(dtype)
    x = torch.randn(input_shape(rank, batch_first, batch, heads, steps, d_in), dtype=dtype)
    proj = projection(d_out, dtype)
    ref = reference(model, [x], reference_loss(proj, batch_dim), batch_dim=batch_dim)
    grad_sample, clipped = MODES[mode]
    clip = median_clip(ref) if clipped else None
    if clip == 0.0:  # max_grad_norm must be > 0; cannot happen with these inputs, but be safe
        clip = 1.0

    dp_model = fxdp.transform(model, max_grad_norm=clip, grad_sample=grad_sample, loss_reduction=reduction,
                              batch_first=batch_first, compiler="eager")
    batched_loss(dp_model(x), proj, reduction, batch_dim).backward()
    check_results(dp_model, dict(model.named_parameters()), ref, reduction=reduction,
                  grad_sample=grad_sample, clip=clip, dtype=dtype,
                  what=f"x{tuple(x.shape)} batch_first={batch_first} {d_in}->{d_out} {reduction} {mode}")


@pytest.mark.parametrize("positions", [1, 5, 63, 64, 65, 128])
def test_gram_inner_block_triangle(positions):
    """The Gram route's inner product, blocked over the lower triangle from 64
    positions on (odd lengths split unevenly), equals the full ``Σ_{t,s} A_ts G_ts``
    and the norm of the instantiated gradient."""
    from fxdp.rules._common import gram_inner

    torch.manual_seed(positions)
    g = torch.randn(3, 2, positions, 7, dtype=torch.float64)
    a = torch.randn(3, 2, positions, 5, dtype=torch.float64)
    full = ((a @ a.transpose(-1, -2)) * (g @ g.transpose(-1, -2))).sum((-1, -2))
    instantiated = torch.einsum("...to,...ti->...oi", g, a).pow(2).sum((-1, -2))
    torch.testing.assert_close(gram_inner(g, a), full, rtol=1e-12, atol=0)
    torch.testing.assert_close(gram_inner(g, a), instantiated, rtol=1e-12, atol=0)


def test_dynamic_sizes_through_the_split_gram():
    """Calls with new batch and sequence sizes recompile with symbolic sizes (Dynamo's
    automatic dynamic shapes); the Gram route's half split then runs on symbolic ``T``,
    odd lengths and lengths below the split threshold included, and stays exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128)).double()
    # Nothing kept, so that the weights go by the Gram route (cheaper below T = 85).
    dp = fxdp.transform(model, max_grad_norm=0.5, compiler="eager", memory_budget_bytes=0)

    def loss_fn(out):
        return out.pow(2).sum((1, 2)).mean()

    for batch, steps in [(4, 70), (6, 81), (5, 65), (3, 40)]:
        x = torch.randn(batch, steps, 128, dtype=torch.float64)
        model.zero_grad(set_to_none=True)
        loss_fn(dp(x)).backward()
        strategies = {p.name: p.strategy for p in dp.explain().graphs[-1].plan.params}
        assert strategies["0.weight"] == strategies["2.weight"] == "ghost"
        ref = reference(model, (x,), lambda out, i: loss_fn(out))
        assert_close_all({"norms": dp.per_sample_norms}, {"norms": ref.norms}, 1e-10, f"{batch}x{steps}")
        assert_close_all({n: p.grad for n, p in model.named_parameters()}, ref.grad("mean", 0.5), 1e-10,
                         f"{batch}x{steps}: clipped grad")
    assert len(dp.explain().graphs) == 2  # the first static graph, then one dynamic


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_gram_norm_that_cancels_to_below_zero_is_not_nan(dtype):
    """Inputs normalised to a zero mean over time, then mean-pooled: each sample's
    gradient is nearly zero, and the Gram sum ``Σ_ts (a_t·a_s)(g_t·g_s)`` cancels to a
    rounding error that can fall below zero. Its root was NaN, and one NaN norm made
    every clip factor and ``p.grad`` NaN. The norms stay within rounding of the loop's
    (the root of a rounding error of the Gram terms) and ``p.grad`` finite."""
    torch.manual_seed(0)

    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.head = nn.Linear(32, 32, bias=False), nn.Linear(32, 4, bias=False)

        def forward(self, x):
            return self.head(self.proj(x).mean(1))

    model = Pooled().to(dtype)
    x = torch.randn(8, 16, 32, dtype=dtype)
    x = x - x.mean(1, keepdim=True)
    y = torch.randint(0, 4, (8,))
    dp = fxdp.transform(model, max_grad_norm=1.0, compiler="eager")
    F.cross_entropy(dp(x), y).backward()
    assert {p.strategy for p in dp.explain().plans} == {"ghost"}
    ref = reference(model.double(), (x.double(),), lambda out, i: F.cross_entropy(out, y[i:i + 1]))
    # The root of a rounding error: about the root of the dtype's eps, times the terms' scale (~1)
    atol = 1e-3 if dtype == torch.float32 else 1e-7
    torch.testing.assert_close(dp.per_sample_norms.double(), ref.norms, rtol=0, atol=atol)
    # Every factor is 1: the clipped gradient is the batch's, itself a rounding error of the terms
    for name, grad in ref.grad("mean", 1.0).items():
        got = dict(model.named_parameters())[name].grad
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), grad, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-14)
