"""The 512-1024-1024-10 ReLU MLP at batch 256 in float32, against the microbatch loop.

DESIGN.md: this is the model on which ``torch.func.vmap`` returns per-sample
gradients off by ~50% in float32 on CPU, so the ground truth is the loop of
``tests/reference.py`` — run over chunks of the batch, so that the 256 per-sample
gradients (1.6 GB in float32) are never all held twice. Clipped gradients are
checked against the loop run on a float64 copy of the model. Last, the privacy
invariant itself: one sample whose gradient is ~1e6 times the others' moves the
clipped sum by at most ``C``.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import pytest
import torch
from torch import nn

import fxdp
from reference import Reference, assert_close_all, reference, tolerance

BATCH = 256
SIZES = (512, 1024, 1024, 10)
MAX_GRAD_NORM = 1.0
CHUNK = 32
OUTLIER = 17            # the sample made an outlier in the privacy test
OUTLIER_SCALE = 1e6


def make_mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(d_in, d_out))
    return nn.Sequential(*layers).to(dtype)


def make_data(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs, and regression targets near the model's outputs at residual scales spread
    over two decades, so that with ``C = 1`` about half of the samples are clipped."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SIZES[0], generator=g)
    scale = torch.logspace(-1, 1, BATCH)[torch.randperm(BATCH, generator=g)]
    with torch.no_grad():
        y = model(x) + 0.02 * torch.randn(BATCH, SIZES[-1], generator=g) * scale.unsqueeze(1)
    return x, y


def per_sample_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).sum(1)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Batch-of-one ops gain nothing from threads, and on a busy 2-core machine the
    thread pool's synchronisation makes the loop several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def chunked_reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Iterator[tuple[int, Reference]]:
    """The microbatch loop over ``CHUNK`` samples at a time: ``(start, Reference)``."""
    for start in range(0, len(x), CHUNK):
        def loss_fn(out: torch.Tensor, i: int, start: int = start) -> torch.Tensor:
            return per_sample_loss(out, y[start + i:start + i + 1]).sum()

        with one_thread():
            ref = reference(model, [x[start:start + CHUNK]], loss_fn)
        yield start, ref


class Summary:
    """What the contract derives from the per-sample gradients, for ``loss_reduction="mean"``.

    Attributes:
        norms: ``[B]`` per-sample gradient norms.
        grad: The ordinary gradient.
        clipped: The clipped gradient for ``MAX_GRAD_NORM``.
    """

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
        norms, grad, clipped = [], {}, {}
        for _, ref in chunked_reference(model, x, y):
            norms.append(ref.norms)
            for total, part in ((grad, ref.grad("sum")), (clipped, ref.grad("sum", MAX_GRAD_NORM))):
                for n, g in part.items():
                    total[n] = total[n] + g if n in total else g
        self.norms = torch.cat(norms)
        self.grad = {n: g / BATCH for n, g in grad.items()}
        self.clipped = {n: g / BATCH for n, g in clipped.items()}

    def clip_factors(self) -> torch.Tensor:
        return (MAX_GRAD_NORM / (self.norms + 1e-6)).clamp(max=1.0)


@pytest.fixture(scope="module")
def float64_summary() -> Summary:
    """The loop on a float64 copy of the model and data."""
    model = make_mlp()
    x, y = make_data(model)
    return Summary(copy.deepcopy(model).double(), x.double(), y.double())


def test_data_straddles_the_clip_norm(float64_summary):
    """Otherwise the clip tests below would not tell clipped from unclipped samples."""
    clipped = (float64_summary.norms > MAX_GRAD_NORM).float().mean().item()
    assert 0.25 < clipped < 0.75


def test_grad_sample_and_norms_match_microbatch():
    model = make_mlp()
    x, y = make_data(model)
    dp_model = fxdp.transform(model, grad_sample=True, compiler="eager")
    per_sample_loss(dp_model(x), y).mean().backward()
    tol = tolerance(torch.float32)
    params = dict(model.named_parameters())
    for n, p in params.items():
        assert p.grad_sample.shape == (BATCH, *p.shape), n

    # assert_close_all's formula, accumulated over chunks: max over the whole batch.
    worst, where, scale = 0.0, "", 0.0
    norms, grad = [], {}
    for start, ref in chunked_reference(model, x, y):
        for n, r in ref.per_sample.items():
            got = params[n].grad_sample[start:start + CHUNK]
            err = (got - r).abs().max().item()
            scale = max(scale, r.abs().max().item())
            if err > worst:
                worst, where = err, f"{n}[{start}:{start + CHUNK}]"
        norms.append(ref.norms)
        for n, g in ref.grad("sum").items():
            grad[n] = grad[n] + g if n in grad else g
    assert worst <= tol * scale, f"grad_sample: max error {worst:.3g} at {where} > {tol} x {scale:.3g}"

    ref_norms = torch.cat(norms)
    assert_close_all({"norms": dp_model.per_sample_norms}, {"norms": ref_norms}, tol, "per_sample_norms")
    assert_close_all({n: p.grad for n, p in params.items()}, {n: g / BATCH for n, g in grad.items()},
                     tol, "p.grad")
    assert dp_model.clip_factors is None


def check_clipped(compiler: str, summary: Summary) -> None:
    model = make_mlp()
    x, y = make_data(model)
    dp_model = fxdp.transform(model, max_grad_norm=MAX_GRAD_NORM, compiler=compiler)
    per_sample_loss(dp_model(x), y).mean().backward()
    tol = tolerance(torch.float32)
    assert_close_all({n: p.grad for n, p in model.named_parameters()}, summary.clipped, tol,
                     f"{compiler} clipped p.grad")
    assert_close_all({"norms": dp_model.per_sample_norms}, {"norms": summary.norms}, tol,
                     f"{compiler} per_sample_norms")
    assert_close_all({"factors": dp_model.clip_factors}, {"factors": summary.clip_factors()}, tol,
                     f"{compiler} clip_factors")
    for p in model.parameters():
        assert getattr(p, "grad_sample", None) is None


def test_clipped_grad_matches_float64_microbatch(float64_summary):
    check_clipped("eager", float64_summary)


def test_inductor_clipped_grad_matches_float64_microbatch(float64_summary):
    check_clipped("inductor", float64_summary)


def test_outlier_moves_clipped_sum_by_at_most_max_grad_norm(float64_summary):
    """``‖Σ_i c_i g_i − Σ_{i≠k} c_i g_i‖ ≤ C`` with sample k's gradient ~1e6 times the others'.

    Sample k's target is moved 1e6 times as far from the output, which scales its
    gradient (``2(out − y)`` into every layer) by ~1e6. The same batch with k's loss
    weighted by zero is the batch without k's contribution: same shapes, one graph.
    """
    model = make_mlp()
    x, y = make_data(model)
    with torch.no_grad():
        y[OUTLIER] = model(x[OUTLIER:OUTLIER + 1])[0] + OUTLIER_SCALE * (y[OUTLIER] - model(x[OUTLIER:OUTLIER + 1])[0])
    dp_model = fxdp.transform(model, max_grad_norm=MAX_GRAD_NORM, compiler="eager")

    def clipped_sum(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dp_model.zero_grad()
        (weight * per_sample_loss(dp_model(x), y)).mean().backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters()]) * BATCH
        return flat, dp_model.per_sample_norms.clone(), dp_model.clip_factors.clone()

    keep = torch.ones(BATCH)
    with_outlier, norms, factors = clipped_sum(keep)
    keep[OUTLIER] = 0.0
    without_outlier, norms_without, factors_without = clipped_sum(keep)

    others = torch.arange(BATCH) != OUTLIER
    assert norms[OUTLIER] > 1e4 * norms[others].max(), "the outlier is not an outlier"
    assert norms_without[OUTLIER] == 0.0
    # The others' clipping is untouched by the outlier, and right.
    tol = tolerance(torch.float32)
    assert_close_all({"factors": factors[others]}, {"factors": factors_without[others]}, 1e-6, "others' factors")
    assert_close_all({"factors": factors[others]}, {"factors": float64_summary.clip_factors()[others].float()},
                     tol, "others' factors vs float64 microbatch")

    moved = (with_outlier - without_outlier).norm().item()
    assert moved <= MAX_GRAD_NORM * (1 + 1e-4), f"one sample moved the clipped sum by {moved} > C"
    # It is clipped to C, not dropped: the test above could not pass by accident.
    assert moved >= MAX_GRAD_NORM * (1 - 1e-3), f"the outlier contributed only {moved}"
