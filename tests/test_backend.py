"""``torch.compile(model, backend="fxdp")`` and ``fxdp.backend(**options)`` (DESIGN.md,
"Backend" and "Clipping is global or it is refused")."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import types

import pytest
import torch
from torch import nn

import fxdp
from expect import refused
from models import AsksTheType
from reference import assert_close_all, reference, tolerance

DTYPE = torch.float64
TOL = tolerance(DTYPE)
TESTS = os.path.dirname(os.path.abspath(__file__))


class MLP(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.lin1 = nn.Linear(4, 8)
        self.lin2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.lin2(torch.relu(self.lin1(x)))


def randn(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def mean_sq_loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum(1).mean()


def per_sample_sq_loss(out: torch.Tensor, i: int) -> torch.Tensor:
    return out.pow(2).sum()


def grads(model: nn.Module) -> dict:
    return {n: p.grad for n, p in model.named_parameters()}


def grad_samples(model: nn.Module) -> dict:
    return {n: getattr(p, "grad_sample", None) for n, p in model.named_parameters()}


def assert_norms(got: torch.Tensor | None, ref: torch.Tensor) -> None:
    assert got is not None and got.shape == ref.shape
    assert (got - ref).abs().max().item() <= TOL * ref.abs().max().item()


_ENTRY_POINT_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    from reference import assert_close_all, reference

    def make(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()

    def loss_fn(out, i):
        return out.pow(2).sum()

    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    # model.compile(backend="fxdp") first: the entry point imports fxdp within that call,
    # which must still compile the torch.nn module's call (Dynamo skips torch.nn's frames).
    model = make(2)
    ref = reference(model, [x], loss_fn)
    assert "fxdp" not in sys.modules, "the test must not import fxdp itself"
    model.compile(backend="fxdp", options={"max_grad_norm": 1.0, "compiler": "eager"})
    assert "fxdp" in sys.modules, "the entry point loads fxdp"
    model(x).pow(2).sum(1).mean().backward()
    assert_close_all({n: p.grad for n, p in model.named_parameters()}, ref.grad("mean", 1.0), 1e-9, "clipped grad")
    torch._dynamo.reset()

    # backend="fxdp" alone: fxdp.backend(grad_sample=True), transform's defaults (Inductor).
    model = make(0)
    ref = reference(model, [x], loss_fn)
    compiled = torch.compile(model, backend="fxdp")
    compiled(x).pow(2).sum(1).mean().backward()
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample, 1e-9, "grad_sample")
    assert_close_all({n: p.grad for n, p in model.named_parameters()}, ref.grad("mean"), 1e-9, "grad")

    # options={...} reach the backend.
    torch._dynamo.reset()
    model = make(1)
    ref = reference(model, [x], loss_fn)
    compiled = torch.compile(model, backend="fxdp", options={"max_grad_norm": 1.0, "compiler": "eager"})
    compiled(x).pow(2).sum(1).mean().backward()
    assert ref.clip_factors(1.0).min() < 1, "the test must clip"
    assert_close_all({n: p.grad for n, p in model.named_parameters()}, ref.grad("mean", 1.0), 1e-9, "clipped grad")
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample, 1e-9, "grad_sample")
    import fxdp
    norms = fxdp.per_sample_norms(model)
    assert (norms - ref.norms).abs().max() <= 1e-9 * ref.norms.abs().max(), (norms, ref.norms)
    print("ENTRY POINT OK")
""")


def test_entry_point_backend_without_importing_fxdp():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _ENTRY_POINT_SCRIPT], cwd=TESTS, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "ENTRY POINT OK" in proc.stdout


_RESIZED_GRID_SCRIPT = textwrap.dedent("""
    import torch
    from reference import assert_close_all, reference
    from test_rules_elementwise import GridResizedToTheImage
    torch.manual_seed(0)
    model = GridResizedToTheImage("bicubic").double()
    compiled = torch.compile(model, backend="fxdp", options={"grad_sample": True, "compiler": "eager"})
    for b, h, w in ((3, 4, 4), (4, 8, 6)):
        x = torch.randn(b, 4, h, w, dtype=torch.float64)
        ref = reference(model, [x], lambda out, i: out.pow(2).sum())
        for p in model.parameters():
            p.grad, p.grad_sample = None, None
        compiled(x).pow(2).sum((1, 2, 3)).mean().backward()
        assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample, 1e-9,
                         f"grad_sample at {h}x{w}")
    print("RESIZED GRID OK")
""")


def test_an_antialiased_bicubic_resize_at_a_second_size_under_the_backend():
    """The fake kernel PyTorch lacks for the bicubic resize's backward is registered on the
    backend's path too (``torch.compile(backend="fxdp")`` captures without fxdp): in a
    fresh process, where no ``fxdp.transform`` registered it first, the second image
    size crashed ("Expected IntList but got GenericList")."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _RESIZED_GRID_SCRIPT], cwd=TESTS, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "RESIZED GRID OK" in proc.stdout


def test_backend_with_options_clips():
    model = MLP().to(DTYPE)
    x = randn(6, 4)
    ref = reference(model, [x], per_sample_sq_loss)
    max_grad_norm = ref.norms.median().item()
    compiled = torch.compile(model, backend=fxdp.backend(max_grad_norm=max_grad_norm, compiler="eager"))
    mean_sq_loss(compiled(x)).backward()
    assert_close_all(grads(model), ref.grad("mean", max_grad_norm), TOL, "p.grad")
    assert all(gs is None for gs in grad_samples(model).values()), "grad_sample defaults to False"
    assert_norms(fxdp.per_sample_norms(model), ref.norms)


@pytest.mark.parametrize("how", ["backward", "backward_and_sgd_step", "autograd_grad"])
def test_a_train_step_that_takes_gradients_inside_clips(how):
    """``loss.backward()`` (or ``torch.autograd.grad``) inside the compiled function, a
    whole train step: Dynamo breaks the graph there, after the loss's whole forward, so
    one fxdp backward covers every parameter and the clipped gradient is exact; the
    optimizer step after it (a graph of its own, under no_grad) applies it. Two batch
    sizes."""
    model = MLP().to(DTYPE)
    lr = 0.5
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    backend = fxdp.backend(max_grad_norm=1.0, compiler="eager")

    @torch.compile(backend=backend)
    def step(x):
        loss = mean_sq_loss(model(x))
        if how == "autograd_grad":
            return torch.autograd.grad(loss, list(model.parameters()))
        loss.backward()
        if how == "backward_and_sgd_step":
            opt.step()
        return loss.detach()

    for seed, batch_size in [(1, 5), (2, 3)]:
        x = randn(batch_size, 4, seed=seed)
        ref = reference(model, [x], per_sample_sq_loss)
        backend.max_grad_norm = ref.norms.median().item()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        out = step(x)
        expected = ref.grad("mean", backend.max_grad_norm)
        if how == "autograd_grad":
            assert_close_all(dict(zip(expected, out)), expected, TOL, "torch.autograd.grad")
            assert all(p.grad is None for p in model.parameters())
        else:
            assert_close_all(grads(model), expected, TOL, "p.grad")
        assert_norms(fxdp.per_sample_norms(model), ref.norms)
        if how == "backward_and_sgd_step":
            moved = {n: (before[n] - p.detach()) / lr for n, p in model.named_parameters()}
            assert_close_all(moved, expected, TOL, "the SGD step")
        model.zero_grad()


def test_backend_takes_transform_options_and_defaults():
    backend = fxdp.backend()
    assert backend.options == fxdp.transform(MLP()).options
    with pytest.raises(TypeError):
        fxdp.backend(max_norm=1.0)
    with pytest.raises(ValueError):
        fxdp.backend(max_grad_norm=-1.0)


def test_two_instances_get_their_own_results():
    backend = fxdp.backend(grad_sample=True, max_grad_norm=1.0, compiler="eager")
    model1, model2 = MLP(seed=0).to(DTYPE), MLP(seed=1).to(DTYPE)
    compiled1, compiled2 = torch.compile(model1, backend=backend), torch.compile(model2, backend=backend)
    x1, x2 = randn(5, 4, seed=1), randn(5, 4, seed=2)
    ref1 = reference(model1, [x1], per_sample_sq_loss)
    ref2 = reference(model2, [x2], per_sample_sq_loss)

    mean_sq_loss(compiled1(x1)).backward()
    assert all(p.grad is None for p in model2.parameters())
    assert fxdp.per_sample_norms(model2) is None
    mean_sq_loss(compiled2(x2)).backward()
    # One class, one compiled graph: the results follow the parameters passed at run time.
    assert len(backend.records) == 1
    assert_close_all(grad_samples(model1), ref1.per_sample, TOL, "model1 grad_sample")
    assert_close_all(grad_samples(model2), ref2.per_sample, TOL, "model2 grad_sample")
    assert_close_all(grads(model1), ref1.grad("mean", 1.0), TOL, "model1 grad")
    assert_close_all(grads(model2), ref2.grad("mean", 1.0), TOL, "model2 grad")
    assert_norms(fxdp.per_sample_norms(model1), ref1.norms)
    assert_norms(fxdp.per_sample_norms(model2), ref2.norms)


def test_transforms_with_different_options_never_share_a_graph():
    model = MLP().to(DTYPE)
    x = randn(6, 4)
    ref = reference(model, [x], per_sample_sq_loss)
    max_grad_norm = ref.norms.min().item() / 2  # every sample is clipped
    plain = fxdp.transform(model, compiler="eager")
    clipped = fxdp.transform(model, max_grad_norm=max_grad_norm, compiler="eager")
    for dp, norm in [(plain, None), (clipped, max_grad_norm), (plain, None), (clipped, max_grad_norm)]:
        model.zero_grad()
        mean_sq_loss(dp(x)).backward()
        assert_close_all(grads(model), ref.grad("mean", norm), TOL, f"max_grad_norm={norm}")
    assert [g.options.max_grad_norm for g in plain.explain().graphs] == [None]
    assert [g.options.max_grad_norm for g in clipped.explain().graphs] == [max_grad_norm]


def test_backends_with_different_options_never_share_a_graph():
    model = MLP().to(DTYPE)
    x = randn(6, 4)
    ref = reference(model, [x], per_sample_sq_loss)
    max_grad_norm = ref.norms.min().item() / 2
    plain = torch.compile(model, backend=fxdp.backend(compiler="eager"))
    clipped = torch.compile(model, backend=fxdp.backend(max_grad_norm=max_grad_norm, compiler="eager"))
    for compiled, norm in [(plain, None), (clipped, max_grad_norm), (plain, None)]:
        model.zero_grad()
        mean_sq_loss(compiled(x)).backward()
        assert_close_all(grads(model), ref.grad("mean", norm), TOL, f"max_grad_norm={norm}")


class WithGraphBreak(MLP):
    def forward(self, x):
        h = torch.relu(self.lin1(x))
        torch._dynamo.graph_break()
        return self.lin2(h)


def test_graph_break_under_clipping_raises_with_dynamos_reason():
    model = WithGraphBreak().to(DTYPE)
    compiled = torch.compile(model, backend=fxdp.backend(max_grad_norm=1.0, compiler="eager"))
    with pytest.raises(Exception) as info:
        mean_sq_loss(compiled(randn(5, 4))).backward()
    message = str(info.value)
    assert "cannot clip globally across a graph break" in message
    assert "torch._dynamo.graph_break()" in message  # Dynamo's own reason, quoted
    assert f"(at {__file__}:" in message and "in forward: torch._dynamo.graph_break()" in message  # and where
    assert all(p.grad is None for p in model.parameters())


def test_graph_break_without_clipping_gives_per_sample_results():
    """Without clipping nothing is global: each graph's parameters get their own results."""
    model = WithGraphBreak().to(DTYPE)
    x = randn(5, 4)
    ref = reference(model, [x], per_sample_sq_loss)
    compiled = torch.compile(model, backend=fxdp.backend(grad_sample=True, compiler="eager"))
    mean_sq_loss(compiled(x)).backward()
    assert_close_all(grad_samples(model), ref.per_sample, TOL, "grad_sample")
    assert_close_all(grads(model), ref.grad("mean"), TOL, "grad")
    assert_norms(fxdp.per_sample_norms(model), ref.norms)  # both graphs' parts, combined


class StatisticBeforeTheBreak(MLP):
    def forward(self, x):
        mu = x.mean(0)  # a statistic of the whole batch
        torch._dynamo.graph_break()
        return self.lin2(torch.relu(self.lin1(x - mu)))


class PairsAfterTheBreak(MLP):
    """The graph after the break reads ``B`` from a list of pairs (its first tensor
    argument) and compares samples with each other (an in-batch contrastive loss)."""

    def forward(self, x):
        h = self.lin2(torch.relu(self.lin1(x)))
        anchors, positives = torch.triu_indices(x.shape[0], x.shape[0], 1)
        torch._dynamo.graph_break()
        return (h @ h.T)[anchors, positives][:, None]


@pytest.mark.parametrize("model", [StatisticBeforeTheBreak, PairsAfterTheBreak], ids=["statistic", "pairs"])
def test_values_without_the_batch_across_a_break_are_refused(model):
    """Without clipping a break is allowed, and each graph is judged on its own: a value
    computed before the break that has no batch dim in the graph after it could mix
    samples where neither graph sees it (before, both gave mixed grad samples silently)."""
    compiled = torch.compile(model().to(DTYPE), backend=fxdp.backend(grad_sample=True, compiler="eager"))
    with pytest.raises(Exception, match="cannot follow the batch across a graph break"):
        compiled(randn(5, 4)).sum().backward()


class CentredBeforeTheBreak(MLP):
    def forward(self, x):
        x = x - x.mean(0)  # folded into batched values: the graph after the break sees [B, 4]
        torch._dynamo.graph_break()
        return self.lin2(torch.relu(self.lin1(x)))


class MixedUpBeforeTheBreak(MLP):
    def forward(self, x):
        x = 0.7 * x + 0.3 * x.flip(0)  # mixup with the batch reversed
        torch._dynamo.graph_break()
        return self.lin2(torch.relu(self.lin1(x)))


class CentredBeforeTwoBreaks(MLP):
    def forward(self, x):
        x = x - x.mean(0)
        torch._dynamo.graph_break()
        x = torch.tanh(x) * 2  # a graph without parameters between the breaks
        torch._dynamo.graph_break()
        return self.lin2(torch.relu(self.lin1(x)))


class FrozenBatchNormBeforeTheBreak(MLP):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(4).requires_grad_(False)  # training mode: the batch's statistics

    def forward(self, x):
        x = self.norm(x)
        torch._dynamo.graph_break()
        return self.lin2(torch.relu(self.lin1(x)))


class CentredInAList(MLP):
    def forward(self, x):
        held = [x - x.mean(0)]  # the graph after the break reads it out of the list
        torch._dynamo.graph_break()
        return self.lin2(torch.relu(self.lin1(held[0])))


class CentredInPlace(MLP):
    def forward(self, x):
        x.sub_(x.mean(0))  # written into the argument itself
        torch._dynamo.graph_break()
        return self.lin2(torch.relu(self.lin1(x)))


class CentredThroughAView(MLP):
    def forward(self, x):
        h = x * 1.0
        part = h[:, :2]
        part.sub_(part.mean(0))  # written into h through a view of it
        torch._dynamo.graph_break()
        return self.lin2(torch.relu(self.lin1(h)))


class _BreaksInside(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.lin1, self.lin2 = mlp.lin1, mlp.lin2

    def forward(self, x):
        h = torch.relu(self.lin1(x))
        torch._dynamo.graph_break()
        return self.lin2(h)


class CentredIntoASubmodule(MLP):
    """The break inside the submodule makes Dynamo compile the submodule's frame apart,
    called with the centred batch: no resumed frame."""

    def __init__(self):
        super().__init__()
        self.inner = _BreaksInside(self)

    def forward(self, x):
        return self.inner(x - x.mean(0))


@pytest.mark.parametrize("model", [CentredBeforeTheBreak, MixedUpBeforeTheBreak, CentredBeforeTwoBreaks,
                                   FrozenBatchNormBeforeTheBreak, CentredInAList, CentredInPlace,
                                   CentredThroughAView, CentredIntoASubmodule],
                         ids=["centred", "mixed up", "two breaks", "frozen batchnorm", "in a list", "in place",
                              "through a view", "into a submodule"])
def test_values_mixed_before_a_break_are_refused(model):
    """A graph without trainable inputs before the break mixes samples into values that
    keep the batch dim: the graph after it cannot tell, so the backend marks what the
    first computed (before, sample 0's grad sample moved when only sample 1 changed)."""
    compiled = torch.compile(model().to(DTYPE), backend=fxdp.backend(grad_sample=True, compiler="eager"))
    with pytest.raises(Exception, match="computed by mixing samples") as info:
        compiled(randn(5, 4)).sum().backward()
    assert f"(mixed at {__file__}:" in str(info.value)


class MixedUpAfterWarmUp(MLP):
    def __init__(self):
        super().__init__()
        self.mix = False

    def forward(self, x):
        if self.mix:
            x = 0.7 * x + 0.3 * x.flip(0)
        torch._dynamo.graph_break()
        return self.lin2(torch.relu(self.lin1(x)))


def test_values_mixed_before_a_break_are_refused_by_a_graph_compiled_before_they_were():
    """Only the graph before the break recompiles when the mixing starts (a mixup switched
    on after warm-up): the graph after it, compiled with per-sample values, checks its
    inputs at every run."""
    model = MixedUpAfterWarmUp().to(DTYPE)
    compiled = torch.compile(model, backend=fxdp.backend(grad_sample=True, compiler="eager"))
    compiled(randn(5, 4)).sum().backward()
    model.mix = True
    with pytest.raises(fxdp.UnsupportedError, match="computed by mixing samples"):
        compiled(randn(5, 4)).sum().backward()


class ScaledBeforeTheBreak(MLP):
    def forward(self, x):
        x = (x - x.mean(1, keepdim=True)) * 2  # each sample's own statistic
        torch._dynamo.graph_break()
        return self.lin2(torch.relu(self.lin1(x)))


@torch.compiler.disable
def _centred_eagerly(h):
    return h - h.mean(0)


@torch.compiler.disable
def _scaled_eagerly(h):
    return h * 2.0


class EagerBetweenTheGraphs(MLP):
    """A ``torch.compiler.disable``'d function between two layers: Dynamo runs it eagerly,
    between the graph before it and the one it resumes after it."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def forward(self, x):
        return self.lin2(self.step(torch.relu(self.lin1(x))))


@pytest.mark.parametrize("step", [_centred_eagerly, _scaled_eagerly], ids=["mixing", "per-sample"])
def test_values_computed_eagerly_between_graphs_with_a_gradient_are_refused(step):
    """No graph sees the code Dynamo ran eagerly at the break, which may mix samples in its
    values and in the gradient it sends back. Before, the mixing one was accepted
    without clipping: sample 0's grad sample of the layer after it moved when only
    sample 2 changed. The per-sample one is refused too, as it is under clipping."""
    compiled = torch.compile(EagerBetweenTheGraphs(step).to(DTYPE),
                             backend=fxdp.backend(grad_sample=True, compiler="eager"))
    with pytest.raises(Exception, match="fxdp cannot follow the samples across a graph break: the graph after "
                       r"the break at .* computes with .*\((SubBackward0|MulBackward0)\), which code Dynamo ran "
                       "eagerly there computed with a gradient"):
        compiled(randn(5, 4)).sum().backward()


class ReadsTheBatchBeforeTheLayers(MLP):
    """The forward reads a number or a branch from the whole batch (a graph break), which
    the graph with the parameters after the break sees as a constant."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, x):
        if self.how == "count":
            n = int((x > 0).sum())  # over every sample
            return self.lin2(torch.relu(self.lin1(x))) / n
        if (x > 2).any():  # "branch": decided by any sample
            return self.lin2(torch.relu(self.lin1(x))) * 2
        return self.lin2(torch.relu(self.lin1(x)))


@pytest.mark.parametrize("how", ["count", "branch"])
def test_a_value_read_from_the_batch_before_the_layers_is_refused_without_clipping(how):
    """Before, accepted without clipping (refused under it): sample 0's grad sample moved
    when only sample 2 changed (a helper's twin check: by 0.06 for a count, 4.5 for a
    branch). A value read after the layers, for a print, still passes (the first test
    of this file's graph breaks, and the train steps that log ``loss.item()``)."""
    compiled = torch.compile(ReadsTheBatchBeforeTheLayers(how).to(DTYPE),
                             backend=fxdp.backend(grad_sample=True, compiler="eager"))
    x = randn(5, 4)
    x[2, 0] = 3.0  # the branch is taken
    with pytest.raises(Exception, match="fxdp cannot follow the samples across a graph break: the code reads a "
                       r"tensor's value at .*, and the graph after that computes with .*lin1.weight"):
        compiled(x).sum().backward()


class ReportsAStatisticBeforeTheBreak(MLP):
    def forward(self, x):
        centred = x - x.mean(0)  # mixes samples, but only into a value returned beside the output
        spread = x.std()
        torch._dynamo.graph_break()
        return self.lin2(torch.relu(self.lin1(x))), centred, spread


class MeasuresAStatisticBeforeTheBreak(MLP):
    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, x):
        stat = x - x.mean(0)  # mixes samples, into values no gradient flows through
        torch._dynamo.graph_break()
        out = self.lin2(torch.relu(self.lin1(x)))
        if self.how == "norm":
            return out, stat.norm(dim=1)
        if self.how == "shape":
            return out + torch.zeros_like(stat[:, :3])
        agree = (out.detach().argmax(1) == stat[:, :3].argmax(1)).to(x.dtype).sum()
        return out, agree


@pytest.mark.parametrize("model", [ScaledBeforeTheBreak, ReportsAStatisticBeforeTheBreak,
                                   lambda: MeasuresAStatisticBeforeTheBreak("norm"),
                                   lambda: MeasuresAStatisticBeforeTheBreak("shape"),
                                   lambda: MeasuresAStatisticBeforeTheBreak("metric")],
                         ids=["per-sample", "reported", "its norm reported", "its shape", "a metric"])
def test_values_computed_before_a_break_without_mixing_into_parameters_are_exact(model):
    """What the graph before the break computes per sample, or mixes only into values the
    graph after it returns without computing with them, leaves each sample's gradient its
    own."""
    model = model().to(DTYPE)
    x = randn(5, 4)
    ref = reference(model, [x], lambda out, i: (out[0] if isinstance(out, tuple) else out).pow(2).sum())
    compiled = torch.compile(model, backend=fxdp.backend(grad_sample=True, loss_reduction="sum",
                                                         compiler="eager"))
    out = compiled(x)
    (out[0] if isinstance(out, tuple) else out).pow(2).sum().backward()
    assert_close_all(grad_samples(model), ref.per_sample, TOL, "grad_sample")


class BranchOnTheBatch(MLP):
    def forward(self, x):
        h = torch.tanh(self.lin1(x))
        if h.sum() > 0:  # a statistic of the whole batch decides every sample's path
            h = h * 2
        return self.lin2(h)


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_a_branch_on_a_batch_statistic_is_refused(loss_reduction):
    """The graph before the break returns ``h.sum() > 0``: a reduction over the batch,
    which is not the loss. It ran, and one sample's gradient followed the other
    samples' branch."""
    model = BranchOnTheBatch().to(DTYPE)
    compiled = torch.compile(model, backend=fxdp.backend(grad_sample=True, loss_reduction=loss_reduction,
                                                         compiler="eager"))
    with pytest.raises(Exception) as info:
        mean_sq_loss(compiled(randn(5, 4))).backward()
    assert "a reduction over the batch (the loss, or a statistic of the batch) is used by an op" in str(info.value)


@pytest.mark.parametrize("joined", ["chained", "summed"])
@pytest.mark.parametrize("how", ["backend", "transform"])
def test_graphs_compiled_one_by_one_under_clipping_raise(how, joined):
    """Two fxdp graphs in one backward, each with max_grad_norm, would each clip with only
    their own parameters' norms: no sample's whole gradient would be bounded. Chained,
    the second graph's input carries the first one's parameters' gradient: refused when
    it compiles. Summed in the loss, the second graph to run in the backward raises."""
    model = MLP().to(DTYPE)
    if how == "backend":
        backend = fxdp.backend(max_grad_norm=1.0, compiler="eager")
        first, second = torch.compile(model.lin1, backend=backend), torch.compile(model.lin2, backend=backend)
    else:
        first = fxdp.transform(model.lin1, max_grad_norm=1.0, compiler="eager")
        second = fxdp.transform(model.lin2, max_grad_norm=1.0, compiler="eager")
    x = randn(5, 4)
    with refused("outside the compiled graph" if joined == "chained" else "second fxdp graph ran in this backward"):
        if joined == "chained":
            mean_sq_loss(second(torch.relu(first(x)))).backward()
        else:
            (mean_sq_loss(first(x)) + mean_sq_loss(second(torch.cat([x, x], 1)))).backward()
    if joined == "chained":
        assert all(p.grad is None for p in model.parameters()), "refused before any backward"
    else:
        assert sum(p.grad is None for p in model.parameters()) == 2, "the graph that would clip second writes nothing"
    # The whole model once is the way.
    model.zero_grad()
    x = randn(5, 4)
    ref = reference(model, [x], per_sample_sq_loss)
    mean_sq_loss(fxdp.transform(model, max_grad_norm=1.0, compiler="eager")(x)).backward()
    assert_close_all(grads(model), ref.grad("mean", 1.0), TOL, "p.grad")



_LOCK = threading.Lock()


def _locked(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with _LOCK:
        pass
    return layer(x)


class EagerInside(nn.Module):
    """A layer called by a function Dynamo cannot compile after its ``with`` of a lock
    (as transformers 5's output capturing does on a model's first call): it would run
    eagerly, and only the module around it be compiled."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(_locked(self.inner, x)))


def test_parameters_run_eagerly_before_a_clipping_graph_are_refused():
    """The head's graph would get an input whose gradient reaches parameters Dynamo ran
    eagerly: they would get the ordinary gradient, the head one clipped with its own
    norms only (0.09 off, no error). Refused where Dynamo skips the function that calls
    the layer it is given, nothing written. (Where no skipped frame shows the layer, the
    graph after the eager part is refused when it compiles: ``disabled_body`` below.)"""
    model = EagerInside().to(DTYPE)
    step = torch.compile(lambda x: mean_sq_loss(model(x)), backend=fxdp.backend(max_grad_norm=0.1,
                                                                                compiler="eager"))
    with refused(r"Dynamo cannot compile _locked \(.*test_backend.py:\d+\) and would run it eagerly, outside any "
                 r"fxdp graph: layer.weight, layer.bias would get ordinary, unclipped gradients. Dynamo's reason: "
                 r"Unsupported context manager"):
        step(randn(3, 4)).backward()
    assert all(p.grad is None for p in model.parameters())


class TryExceptBranch(nn.Module):
    """A break inside ``try``: Dynamo cannot resume there, so it skips the whole frame
    and runs this module eagerly."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        try:
            h = self.lin(x).optional_method()
        except AttributeError:
            h = torch.tanh(self.lin(x))
        return h


class SkippedSubmodule(nn.Module):
    """A submodule Dynamo runs eagerly, beside or before the compiled rest."""

    def __init__(self, how: str):
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.branch = TryExceptBranch() if how == "try_except" else MLP()
        if how == "disabled_body":
            self.branch.forward = torch.compiler.disable(self.branch.forward)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        if self.how == "disabled_body":
            return self.branch(x * 2.0)
        return self.branch(x) + self.fc(x)


@pytest.mark.parametrize("how", ["try_except", "disabled_body"])
@pytest.mark.parametrize("compiled", ["model", "step"])
def test_a_submodule_dynamo_runs_eagerly_under_clipping_is_refused(how, compiled):
    """Dynamo runs the submodule eagerly, without any backend: its parameters got the
    ordinary gradient, the rest was clipped with its own norms only (0.16 off), and
    ``per_sample_norms`` looked fine; with every parameter in it nothing was clipped.
    A submodule whose frame Dynamo skips (a break inside ``try``) is refused when it is
    skipped, naming its parameters; for one run eagerly on purpose
    (``torch.compiler.disable``) the graph after the break (or the one that ends at
    it) is refused."""
    model = SkippedSubmodule(how).to(DTYPE)
    backend = fxdp.backend(max_grad_norm=0.1, compiler="eager")
    forward = torch.compile(model, backend=backend) if compiled == "model" else model

    def step(x):
        mean_sq_loss(forward(x)).backward()

    message = ("Dynamo cannot compile TryExceptBranch.forward .*: lin.weight, lin.bias would get ordinary, "
               "unclipped gradients" if how == "try_except" else "fxdp cannot clip globally across a graph break")
    with refused(message):
        (step if compiled == "model" else torch.compile(step, backend=backend))(randn(3, 4))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("how", ["object", "entry-point"])
def test_a_torch_nn_module_compiled_in_place_is_clipped(how):
    """``nn.Sequential(...).compile(backend=...)`` (the in-place ``nn.Module.compile``)
    compiled nothing, as Dynamo skips torch.nn's own frames: the model trained eagerly,
    unclipped, with no fxdp code running. With an fxdp backend the module's call is now
    compiled as ``torch.compile(seq)`` compiles it; another backend keeps PyTorch's
    behaviour."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).to(DTYPE)
    x = randn(3, 4)
    ref = reference(seq, [x], per_sample_sq_loss)
    options = {"max_grad_norm": 0.1, "grad_sample": True, "compiler": "eager"}
    if how == "object":
        seq.compile(backend=fxdp.backend(**options))
    else:
        seq.compile(backend="fxdp", options=options)
    mean_sq_loss(seq(x)).backward()
    assert_close_all(grads(seq), ref.grad("mean", 0.1), TOL, "p.grad")
    assert_close_all(grad_samples(seq), ref.per_sample, TOL, "p.grad_sample")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    other = nn.Sequential(nn.Linear(4, 3)).to(DTYPE)
    other.compile(backend="eager")
    other(x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0


class PrintsInALoop(nn.Module):
    """A ``forward`` that Dynamo skips whole: a break inside a ``for`` loop."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
            _LOGGED.append(x.abs().max().item())
        return x


_LOGGED: list[float] = []


@pytest.mark.parametrize("first", ["train", "evaluate"])
def test_a_forward_dynamo_skips_whole_is_refused(first):
    """With a break inside a loop Dynamo skipped the whole ``forward``: no graph reached
    the backend, the model trained eagerly, unclipped, and nothing said so. Refused
    when Dynamo skips it, naming the parameters its code reaches. An evaluation under
    ``no_grad()`` still runs eagerly, and a training call after it is refused too."""
    torch._dynamo.reset()
    model = PrintsInALoop().to(DTYPE)
    compiled = torch.compile(model, backend=fxdp.backend(max_grad_norm=0.1, compiler="eager"))
    if first == "evaluate":
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(compiled(randn(3, 4)), model(randn(3, 4)))
    with refused(r"Dynamo cannot compile PrintsInALoop.forward \(.*test_backend.py:\d+\) and would run it eagerly, "
                 r"outside any fxdp graph: layers.0.weight, layers.0.bias, layers.2.weight, layers.2.bias would "
                 r"get ordinary, unclipped gradients. Dynamo's reason: .*item"):
        mean_sq_loss(compiled(randn(3, 4))).backward()
    assert all(p.grad is None for p in model.parameters())
    torch._dynamo.reset()
    plain = torch.compile(PrintsInALoop().to(DTYPE), backend="eager")
    mean_sq_loss(plain(randn(3, 4))).backward()  # another backend keeps Dynamo's skip


_SEQUENTIAL: nn.Module | None = None  # the model a step function reads as a global


@pytest.mark.parametrize("reached", ["argument", "global", "list", "attribute", "closure"])
def test_a_skipped_function_calling_a_torch_nn_model_is_refused(reached):
    """A compiled step function that Dynamo skips whole (a break in its loop) ran a
    ``torch.nn`` model it was given (itself, in a list, or held by an object it was
    given), closed over, or read as a global, eagerly: Dynamo skips ``torch.nn``'s ``forward`` too, so
    the model trained unclipped and nothing said so."""
    global _SEQUENTIAL
    torch._dynamo.reset()
    _SEQUENTIAL = seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).to(DTYPE)
    backend = fxdp.backend(max_grad_norm=0.1, compiler="eager")

    def logged_loss(model, x):
        total = 0
        for _ in range(2):
            out = model(x)
            _LOGGED.append(out.abs().max().item())
            total = total + mean_sq_loss(out)
        return total

    def logged_loss_of_first(models, x):
        total = 0
        for _ in range(2):
            out = models[0](x)
            _LOGGED.append(out.abs().max().item())
            total = total + mean_sq_loss(out)
        return total

    def logged_loss_of_held(trainer, x):
        total = 0
        for _ in range(2):
            out = trainer.model(x)
            _LOGGED.append(out.abs().max().item())
            total = total + mean_sq_loss(out)
        return total

    if reached == "argument":
        step = torch.compile(logged_loss, backend=backend)
        call, name, prefix = (lambda x: step(seq, x)), "logged_loss", "model"
    elif reached == "list":
        step = torch.compile(logged_loss_of_first, backend=backend)
        call, name, prefix = (lambda x: step([seq], x)), "logged_loss_of_first", r"models\[0\]"
    elif reached == "attribute":
        step = torch.compile(logged_loss_of_held, backend=backend)
        holder = types.SimpleNamespace(model=seq)
        call, name, prefix = (lambda x: step(holder, x)), "logged_loss_of_held", "trainer.model"
    elif reached == "closure":
        @torch.compile(backend=backend)
        def step_on_closure(x):
            total = 0
            for _ in range(2):
                out = seq(x)
                _LOGGED.append(out.abs().max().item())
                total = total + mean_sq_loss(out)
            return total

        call, name, prefix = step_on_closure, "step_on_closure", "seq"
    else:
        @torch.compile(backend=backend)
        def step_on_global(x):
            total = 0
            for _ in range(2):
                out = _SEQUENTIAL(x)
                _LOGGED.append(out.abs().max().item())
                total = total + mean_sq_loss(out)
            return total

        call, name, prefix = step_on_global, "step_on_global", "_SEQUENTIAL"
    with refused(rf"Dynamo cannot compile .*{name} \(.*\) and would run it eagerly, outside any fxdp graph: "
                 rf"{prefix}.0.weight, {prefix}.0.bias, {prefix}.2.weight, {prefix}.2.bias would get ordinary"):
        call(randn(3, 4)).backward()
    assert all(p.grad is None for p in seq.parameters())
    _SEQUENTIAL = None


def test_a_train_step_may_log_after_its_backward():
    """What follows an accepted break at ``backward()`` runs after the clipping: a graph
    resumed there may break again (the loss logged with ``.item()``)."""
    model = MLP().to(DTYPE)
    x, logged = randn(5, 4), []
    ref = reference(model, [x], per_sample_sq_loss)

    @torch.compile(backend=fxdp.backend(max_grad_norm=1.0, compiler="eager"))
    def step(x):
        loss = mean_sq_loss(model(x))
        loss.backward()
        logged.append((loss * 2).item())
        return loss.detach()

    step(x)
    assert_close_all(grads(model), ref.grad("mean", 1.0), TOL, "p.grad")
    assert len(logged) == 1


@pytest.mark.parametrize("read", ["item", "float", "print", "tolist"])
def test_a_train_step_may_read_its_loss_before_its_backward(read, capsys):
    """Logging the loss before ``backward()`` breaks the graph at the read: the graph
    before it holds the loss's whole forward, and the read runs nothing of the model's.
    It was refused as a split step; now the step is clipped exactly, also at a second
    batch size, and what follows the backward (the norm of the gradients) may run."""
    model = MLP().to(DTYPE)
    logged = []

    @torch.compile(backend=fxdp.backend(max_grad_norm=1.0, compiler="eager"))
    def step(x):
        loss = mean_sq_loss(model(x))
        if read == "item":
            logged.append(loss.item())
        elif read == "float":
            logged.append(float(loss))
        elif read == "print":
            print("loss", loss)
        else:
            logged.append(loss.detach().tolist())
        loss.backward()
        return sum(p.grad.norm() ** 2 for p in model.parameters()).sqrt()

    for x in (randn(5, 4), randn(3, 4, seed=2)):
        model.zero_grad()
        norm = step(x)
        ref = reference(model, [x], per_sample_sq_loss)
        assert_close_all(grads(model), ref.grad("mean", 1.0), TOL, "p.grad")
        assert_close_all({"norm": norm}, {"norm": torch.cat([g.flatten() for g in grads(model).values()]).norm()},
                         TOL, "gradient norm")
    assert len(logged) == (0 if read == "print" else 2)
    assert capsys.readouterr().out.count("loss") == (2 if read == "print" else 0)


def test_dynamo_does_not_trace_fxdp_compiling_the_backward_of_a_train_step():
    """AOTAutograd compiles the backward at the first ``loss.backward()``, which a
    compiled train step runs in the eager code Dynamo resumes around it. Under
    ``compiler="eager"`` Dynamo traced fxdp's backward compiler there as user code: 136
    frames for an MLP, and for a small CNN it hit the recompile limit inside fxdp's own
    graph walks, which the backend makes a hard error, so the step failed on its first
    call. No fxdp function is traced now, and the step is exact."""
    import inspect

    import fxdp._torch_internals
    import fxdp.compiler
    import fxdp.passes.writes

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).to(DTYPE)

    @torch.compile(backend=fxdp.backend(max_grad_norm=0.5, compiler="eager"))
    def step(x):
        loss = mean_sq_loss(model(x))
        loss.backward()
        return loss.detach()

    for x in (randn(4, 3, 5, 5), randn(3, 3, 5, 5, seed=2)):
        model.zero_grad()
        step(x)
        assert_close_all(grads(model), reference(model, [x], per_sample_sq_loss).grad("mean", 0.5), TOL, "p.grad")
    traced = [f"{module.__name__}.{name}"
              for module in (fxdp.compiler, fxdp._torch_internals, fxdp.passes.writes)
              for name, fn in vars(module).items()
              if inspect.isfunction(fn) and torch._C._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__)]
    assert traced == []


class Trainer:
    def __init__(self, model, opt):
        self.model, self.opt = model, opt


class AcceleratedOptimizer:
    """accelerate's wrapper, as far as fxdp knows it: its ``zero_grad`` by name."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @torch.compiler.disable
    def zero_grad(self, set_to_none=None):
        self.optimizer.zero_grad(set_to_none=True if set_to_none is None else set_to_none)


AcceleratedOptimizer.zero_grad.__module__ = "accelerate.optimizer"


@pytest.mark.parametrize("zero", ["opt", "opt_set_to_none_false", "attribute", "after_a_cast", "model",
                                  "opacus_dp_optimizer", "accelerate"])
def test_a_train_step_may_zero_the_gradients_first(zero):
    """``opt.zero_grad()`` at the top of a compiled step (the usual order: zero, forward,
    backward, step) breaks the graph, as Dynamo must not trace ``Optimizer.zero_grad``.
    It was refused as a break before the forward where any code could have run eagerly;
    a torch optimizer's (or module's) ``zero_grad`` only clears ``.grad``, so the step
    is now clipped exactly, at two batch sizes, and its update matches the microbatch
    loop's. So do the ``zero_grad`` of Opacus's ``DPOptimizer`` (it also drops
    ``p.grad_sample``) and of accelerate's ``AcceleratedOptimizer`` wrapped around it."""
    import copy

    from opacus.optimizers import DPOptimizer

    model = MLP().to(DTYPE)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    trainer = Trainer(model, opt)
    wrapper = (DPOptimizer(opt, noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=5)
               if zero == "opacus_dp_optimizer" else AcceleratedOptimizer(opt))

    @torch.compile(backend=fxdp.backend(max_grad_norm=0.5, compiler="eager"))
    def step(x):
        if zero == "opt":
            opt.zero_grad()
        elif zero == "opt_set_to_none_false":
            opt.zero_grad(set_to_none=False)
        elif zero == "attribute":
            trainer.opt.zero_grad()
        elif zero == "after_a_cast":
            x = x * 2
            opt.zero_grad()
        elif zero in ("opacus_dp_optimizer", "accelerate"):
            wrapper.zero_grad()
        else:
            model.zero_grad()
        loss = mean_sq_loss(model(x))
        loss.backward()
        opt.step()
        return loss.detach()

    for x in (randn(5, 4), randn(3, 4, seed=2), randn(5, 4, seed=3)):
        step(x)
        scale = 2 if zero == "after_a_cast" else 1
        ref = reference(twin, [x * scale], per_sample_sq_loss).grad("mean", 0.5)
        with torch.no_grad():
            for p, g in zip(twin.parameters(), ref.values()):
                p -= 0.5 * g
        assert_close_all(dict(model.named_parameters()), dict(twin.named_parameters()), TOL, "parameters")


class HomemadeOptimizer:
    def __init__(self, params, x):
        self.params, self.x = list(params), x

    @torch.compiler.disable
    def zero_grad(self):
        self.scale = self.x.abs().max().item()  # a statistic of the batch, read eagerly


def test_a_zero_grad_that_is_not_torchs_or_that_splits_the_forward_is_refused():
    """What fxdp accepts at a break is ``zero_grad`` of a torch optimizer or module as
    the step's first break. A ``zero_grad`` of another class may do anything eagerly
    (here it reads a statistic of the batch that the forward then uses), a zero_grad
    between two layers splits the forward, and one after a read of a value follows a
    break that already ran code unseen: all three stay refused."""
    model, x = MLP().to(DTYPE), randn(5, 4)
    homemade = HomemadeOptimizer(model.parameters(), x)
    backend = fxdp.backend(max_grad_norm=1.0, compiler="eager")

    @torch.compile(backend=backend)
    def homemade_step(x):
        homemade.zero_grad()
        mean_sq_loss(model(x / homemade.scale)).backward()

    with refused("a break at .*, before this graph, where the code ran eagerly"):
        homemade_step(x)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @torch.compile(backend=backend)
    def split_step(x):
        h = torch.relu(model.lin1(x))
        opt.zero_grad()
        mean_sq_loss(model.lin2(h)).backward()

    model.zero_grad()
    with refused(r"zero_grad\(\) at .* splits the forward: .* from the graph before it \(h\)"):
        split_step(x)
    logged = []

    @torch.compile(backend=backend)
    def after_a_read(x):
        logged.append(x.abs().max().item())
        opt.zero_grad()
        mean_sq_loss(model(x)).backward()

    model.zero_grad()
    with refused("a break at .*, before this graph, where the code ran eagerly"):
        after_a_read(x)
    assert all(p.grad is None for p in model.parameters())


def test_a_logger_call_in_a_compiled_step_is_logged_when_captured():
    """A ``logging.Logger`` call in a compiled step's forward (Hugging Face's
    ``loss_function`` warns once about an unset ``loss_type`` when called with
    ``labels=``) broke the graph inside the forward, which the backend refuses under
    clipping. Captured for fxdp, it is logged once, as under ``fxdp.transform``, and the
    step is exact; a function compiled with another backend still breaks there."""
    import logging

    logger = logging.getLogger("fxdp.tests.backend")
    logged = []

    class Records(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    model = MLP().to(DTYPE)

    def loss_of(x):
        logger.warning("`loss_type=%s` was set in the config", None)
        return mean_sq_loss(model(x))

    @torch.compile(backend=fxdp.backend(max_grad_norm=0.5, compiler="eager"))
    def step(x):
        loss = loss_of(x)
        loss.backward()
        return loss.detach()

    handler = Records()
    logger.addHandler(handler)
    try:
        for x in (randn(5, 4), randn(3, 4, seed=2)):
            model.zero_grad()
            step(x)
            assert_close_all(grads(model), reference(model, [x], per_sample_sq_loss).grad("mean", 0.5), TOL,
                             "p.grad")
        torch._dynamo.utils.counters.clear()
        torch.compile(loss_of, backend="eager")(randn(5, 4))
    finally:
        logger.removeHandler(handler)
    assert set(logged) == {"`loss_type=None` was set in the config"}
    # Dynamo's own break at the logger call
    assert any("logging.Logger" in reason for reason in torch._dynamo.utils.counters["graph_break"])


def test_a_string_method_of_a_class_name_in_a_compiled_model():
    """peft's DoRA asks ``type(weight).__module__.startswith("torchao.")`` of every
    weight. Dynamo alone breaks the graph there, inside the forward, which the backend
    refuses under clipping; captured for fxdp it is answered from the name, as under
    ``fxdp.transform``, and the model is exact. Another backend still breaks there."""
    model = AsksTheType().to(DTYPE)
    compiled = torch.compile(model, backend=fxdp.backend(max_grad_norm=0.5, compiler="eager"))
    for x in (randn(5, 4), randn(3, 4, seed=2)):
        model.zero_grad()
        mean_sq_loss(compiled(x)).backward()
        assert_close_all(grads(model), reference(model, [x], per_sample_sq_loss).grad("mean", 0.5), TOL, "p.grad")
    torch._dynamo.utils.counters.clear()
    torch.compile(AsksTheType().to(DTYPE), backend="eager")(randn(5, 4))
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) >= 1


class RecurrentFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 6, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("how", ["entry-point", "object"])
def test_a_compiled_model_whose_first_call_is_an_rnn_is_clipped(how):
    """Dynamo refuses an RNN module unless ``allow_rnn`` is on; with the RNN a
    ``forward``'s first call it then skips the whole ``forward``, and the model trained
    eagerly with ordinary, unclipped gradients, no fxdp code having run. Captured for
    fxdp an RNN is traced, as under ``fxdp.transform``, whatever the setting; another
    backend still skips the frame."""
    assert not torch._dynamo.config.allow_rnn
    torch.manual_seed(0)
    model = RecurrentFirst().to(DTYPE)
    options = {"max_grad_norm": 0.1, "grad_sample": True, "loss_reduction": "sum", "compiler": "eager"}
    compiled = (torch.compile(model, backend="fxdp", options=options) if how == "entry-point"
                else torch.compile(model, backend=fxdp.backend(**options)))
    x = randn(3, 5, 4)
    ref = reference(model, [x], lambda out, i: out.pow(2).sum())
    compiled(x).pow(2).sum().backward()
    assert_close_all(grad_samples(model), ref.per_sample, TOL, "p.grad_sample")
    assert_close_all(grads(model), ref.grad("sum", 0.1), TOL, "p.grad")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.compile(RecurrentFirst().to(DTYPE), backend="eager")(x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0


def test_a_value_read_inside_the_forward_is_refused():
    """``.item()`` between two layers splits the forward into two graphs, each of which
    would clip its own parameters: the graph after the read is refused, and says why."""
    model, logged = MLP().to(DTYPE), []

    @torch.compile(backend=fxdp.backend(max_grad_norm=1.0, compiler="eager"))
    def step(x):
        h = torch.relu(model.lin1(x))
        logged.append(h.mean().item())
        mean_sq_loss(model.lin2(h)).backward()

    with refused(r"Tensor.item\(\).*and the graph after that uses parameters too \(lin2.weight, lin2.bias\)"):
        step(randn(5, 4))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("use", ["loss_scaled_by_its_value", "input_normalised_by_its_max"])
def test_a_value_read_from_the_batch_that_may_enter_the_gradients_is_refused(use):
    """A value read from the batch at a break reaches the graph after it as a number
    fxdp cannot see: dividing the loss by it, or the input by its largest element before
    the model, would tie every sample's gradient to the others. Refused, nothing written."""
    model = MLP().to(DTYPE)

    @torch.compile(backend=fxdp.backend(max_grad_norm=1.0, compiler="eager"))
    def step(x):
        if use == "loss_scaled_by_its_value":
            loss = mean_sq_loss(model(x))
            value = loss.item()
            (loss / value).backward()
        else:
            if x.abs().max() > 1.0:
                x = x / 10.0
            mean_sq_loss(model(x)).backward()

    with refused("computes with values that carry gradients" if use == "loss_scaled_by_its_value"
                 else r"and the graph after that uses parameters too \(lin1.weight"):
        step(randn(5, 4))
    assert all(p.grad is None for p in model.parameters())


def test_parameters_used_eagerly_after_a_logged_loss_are_refused():
    """After an accepted read of the loss, a regulariser Dynamo runs eagerly (here a
    ``torch.compiler.disable``'d one) adds the ordinary gradient of its parameters to the
    loss: the graph that sums the two is refused before anything is written."""
    model, logged = MLP().to(DTYPE), []

    @torch.compiler.disable
    def regulariser():
        return model.lin1.weight.pow(2).sum()

    @torch.compile(backend=fxdp.backend(max_grad_norm=1.0, compiler="eager"))
    def step(x):
        loss = mean_sq_loss(model(x))
        logged.append(loss.item())
        (loss + regulariser()).backward()

    with refused(r"broke the graph because: a break at .*test_backend.py:\d+, before this graph"):
        step(randn(5, 4))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("wrapped", ["transform", "backend"])
def test_a_forward_that_turns_gradients_on_under_no_grad_refuses_its_backward(wrapped):
    """``with torch.enable_grad():`` inside the forward, called under ``no_grad``: fxdp
    compiles that call without gradients, so a backward through its output would leave
    ordinary gradients (it did, silently). The forward runs; its backward raises."""

    class EnablesGrad(MLP):
        def forward(self, x):
            with torch.enable_grad():
                return super().forward(x)

    model = EnablesGrad().to(DTYPE)
    call = (fxdp.transform(model, max_grad_norm=1.0, compiler="eager") if wrapped == "transform"
            else torch.compile(model, backend=fxdp.backend(max_grad_norm=1.0, compiler="eager")))
    with torch.no_grad():
        out = call(randn(5, 4))
    torch.testing.assert_close(out, MLP().to(DTYPE)(randn(5, 4)))
    with pytest.raises(fxdp.UnsupportedError, match="turned gradients on itself"):
        mean_sq_loss(out).backward()
    assert all(p.grad is None for p in model.parameters())


def test_an_input_computed_from_parameters_outside_the_transform_is_refused():
    """A trainable embedding applied before the transformed model: its gradient would be
    the ordinary one. Detached, or frozen, it is data."""
    torch.manual_seed(0)
    embed, model = nn.Linear(4, 4).to(DTYPE), MLP().to(DTYPE)
    dp = fxdp.transform(model, max_grad_norm=1.0, compiler="eager")
    x = randn(5, 4)
    with pytest.raises(fxdp.UnsupportedError, match="outside the compiled graph"):
        dp(embed(x))
    mean_sq_loss(dp(embed(x).detach())).backward()
    embed.requires_grad_(False)
    mean_sq_loss(dp(embed(x))).backward()
    assert embed.weight.grad is None and model.lin1.weight.grad is not None


@pytest.mark.parametrize("leaf", ["plain tensor", "parameter"])
@pytest.mark.parametrize("own_parameters", [True, False], ids=["with_parameters", "without_parameters"])
@pytest.mark.parametrize("how", ["attribute", "argument"])
def test_a_weight_computed_outside_the_forward_is_refused(how, own_parameters, leaf):
    """A weight computed once outside the forward (``self.w = w0 * 1.0``; a deep copy of
    a module whose weights are non-leaf views), read as a module attribute or passed as a
    shared argument: its gradient reaches ``w0`` unclipped. Refused whether ``w0`` is an
    ``nn.Parameter`` or a plain tensor that needs a gradient, and whether the graph has
    parameters of its own or none (it ran, unclipped, in both cases)."""
    torch.manual_seed(0)
    w0 = torch.randn(4, 4, dtype=DTYPE, requires_grad=True) if leaf == "plain tensor" else nn.Parameter(
        torch.randn(4, 4, dtype=DTYPE))

    class Outside(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4).to(DTYPE) if own_parameters else nn.Identity()
            self.w = w0 * 1.0

        def forward(self, x, w=None):
            return self.lin(x) @ (self.w if w is None else w)

    dp = fxdp.transform(Outside(), max_grad_norm=1.0, compiler="eager", in_dims=(0, None))
    with pytest.raises(fxdp.UnsupportedError, match="1 trainable tensor.s. outside the compiled graph"):
        dp(randn(5, 4)) if how == "attribute" else dp(randn(5, 4), w0 * 1.0)
    assert w0.grad is None


def test_input_gradients_of_batched_data_computed_before_the_model_stay_allowed():
    """The data's own leaf may need a gradient (input gradients): behind a batched input
    only parameters are refused."""
    torch.manual_seed(0)
    model = MLP().to(DTYPE)
    x = randn(5, 4).requires_grad_()
    dp = fxdp.transform(model, max_grad_norm=1.0, compiler="eager")
    mean_sq_loss(dp(x * 2.0)).backward()
    assert x.grad is not None and model.lin1.weight.grad is not None


class LeakyState(nn.Module):
    """A spiking neuron as snntorch writes it: the forward keeps its membrane state on
    the module (``self.mem``), and the next call starts from ``zeros_like(self.mem)``,
    or (``carried``) from the state itself, across steps."""

    def __init__(self, carried: bool):
        super().__init__()
        self.carried = carried
        self.fc = nn.Linear(4, 3)
        self.register_buffer("mem", torch.zeros(0), persistent=False)

    def forward(self, x):  # [B, T, 4]
        mem = self.mem if self.carried and self.mem.shape[0] == x.shape[0] else torch.zeros_like(self.mem)
        if mem.shape != (x.shape[0], 3):
            mem = x.new_zeros(x.shape[0], 3)
        for t in range(x.shape[1]):
            mem = 0.8 * mem + self.fc(x[:, t])
        self.mem = mem
        return mem


@pytest.mark.parametrize("wrapped", ["transform", "backend"])
def test_a_state_the_previous_step_left_on_the_module_is_read_for_its_shape_only(wrapped):
    """The state a call leaves on the module still carries that call's gradient path; a
    later call reading only its shape (``zeros_like``) sends it no gradient, so it is no
    input computed from parameters outside the graph. Read as a value, it is."""
    torch.manual_seed(0)
    model = LeakyState(carried=False).to(DTYPE)
    clip = 0.5
    call = (fxdp.transform(model, max_grad_norm=clip, compiler="eager") if wrapped == "transform"
            else torch.compile(model, backend=fxdp.backend(max_grad_norm=clip, compiler="eager")))
    for step in range(3):
        x = randn(5, 2, 4, seed=step)
        fresh = LeakyState(carried=False).to(DTYPE)
        fresh.load_state_dict(model.state_dict())
        ref = reference(fresh, (x,), per_sample_sq_loss)
        for p in model.parameters():
            p.grad = None
        mean_sq_loss(call(x)).backward()
        assert model.mem.requires_grad
        assert_close_all(grads(model), ref.grad("mean", clip), tolerance(DTYPE), f"step {step}")
    carried = LeakyState(carried=True).to(DTYPE)
    dp = fxdp.transform(carried, max_grad_norm=clip, compiler="eager")
    mean_sq_loss(dp(randn(5, 2, 4))).backward()
    with pytest.raises(fxdp.UnsupportedError, match="state a previous call left"):
        dp(randn(5, 2, 4))


def test_a_parameter_free_graph_beside_a_clipping_one_is_no_second_clip():
    """A loss compiled with the fxdp backend has nothing to clip: no refusal, and the
    model's clipped gradient and norms are the loop's."""
    model = MLP().to(DTYPE)
    x = randn(5, 4)
    ref = reference(model, [x], lambda out, i: out.tanh().pow(2).sum())
    dp = fxdp.transform(model, max_grad_norm=1.0, compiler="eager")
    loss = torch.compile(lambda out: out.tanh().pow(2).sum(1).mean(),
                         backend=fxdp.backend(max_grad_norm=1.0, compiler="eager"))
    loss(dp(x)).backward()
    assert_close_all(grads(model), ref.grad("mean", 1.0), TOL, "p.grad")
    assert_norms(dp.per_sample_norms, ref.norms)

class SharedAcrossGraphBreak(nn.Module):
    """``lin1`` is used on both sides of the break: its parameters are in two graphs."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(4, 4)
        self.lin2 = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin1(x))
        torch._dynamo.graph_break()
        return self.lin2(torch.tanh(self.lin1(h)))


def test_parameter_in_two_graphs_of_a_break_raises():
    """Each graph would give lin1 only its own part of the per-sample gradient (the later
    replacing the earlier); fxdp raises instead, before lin1's gradient is written."""
    model = SharedAcrossGraphBreak().to(DTYPE)
    compiled = torch.compile(model, backend=fxdp.backend(grad_sample=True, compiler="eager"))
    with pytest.raises(fxdp.UnsupportedError, match="ran twice for parameter 'lin1.weight'"):
        mean_sq_loss(compiled(randn(5, 4))).backward()
    assert model.lin1.weight.grad is None and model.lin1.bias.grad is None


@pytest.fixture
def recompile_limit_one():
    # Dynamo's default, eager at the limit (conftest raises everywhere); config.patch
    # restores both settings afterwards
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=False):
        yield


def test_recompile_limit_raises_instead_of_running_eager(recompile_limit_one):
    """At its recompile limit a frame the backend compiled a trainable graph of raises,
    and says why, where Dynamo would run it eagerly; under ``torch.no_grad()`` it runs
    eagerly (no gradient to leave), and so does an unrelated compiled function."""
    model = MLP().to(DTYPE)
    compiled = torch.compile(model, backend=fxdp.backend(max_grad_norm=1.0, compiler="eager"))
    mean_sq_loss(compiled(randn(5, 4))).backward()
    model.zero_grad()
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit,
                       match=r"fxdp: Dynamo hit its recompile limit .* would run forward \(.*test_backend.py:\d+\) "
                             "eagerly, without the fxdp backward.* The last recompile's reason: .* rank mismatch"):
        # a new rank needs a new graph, beyond the limit of one
        compiled(randn(2, 5, 4)).pow(2).sum((1, 2)).mean().backward()
    assert all(p.grad is None for p in model.parameters()), "no unclipped gradient left behind"
    with torch.no_grad():  # an evaluation past the limit runs eagerly: no gradient to leave
        assert torch.equal(compiled(randn(2, 5, 4)), model(randn(2, 5, 4)))
    unrelated = torch.compile(lambda x: x.sum(), backend="eager")
    for rank in range(1, 4):  # a new rank each call, past the limit: eager
        unrelated(torch.ones([2] * rank))


def test_a_scheduled_learning_rate_in_a_compiled_step_runs_past_the_recompile_limit():
    """Under Inductor the optimizer update that a compiled step runs after
    ``backward()`` recompiles for each new float learning rate of a scheduler. At
    Dynamo's recompile limit (two here) it runs eagerly, after the clipping, as under any
    backend; it used to raise ``FailOnRecompileLimitHit``, as the backend made every
    frame of the process raise there. Six steps match the same optimizer and scheduler
    fed the microbatch loop's clipped gradients."""
    import copy

    C, steps = 0.5, 6
    model = MLP().to(DTYPE)
    twin = copy.deepcopy(model)
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
                     for m in (model, twin))
    sched, twin_sched = (torch.optim.lr_scheduler.LambdaLR(o, lambda k: 0.9 ** k) for o in (opt, twin_opt))

    @torch.compile(backend=fxdp.backend(max_grad_norm=C))
    def step(x):
        mean_sq_loss(model(x)).backward()
        opt.step()
        opt.zero_grad()

    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=False):
        for k in range(steps):
            x = randn(5, 4, seed=k)
            step(x)
            sched.step()
            for p, g in zip(twin.parameters(), reference(twin, [x], per_sample_sq_loss).grad("mean", C).values()):
                p.grad = g
            twin_opt.step()
            twin_opt.zero_grad()
            twin_sched.step()
    assert_close_all(dict(model.named_parameters()), dict(twin.named_parameters()), TOL, "parameters")


def test_transform_refuses_silent_eager_fallback(recompile_limit_one):
    """Even if Dynamo is told to fall back to eager at the limit, the step raises
    (Dynamo itself, since transform compiles with fullgraph=True, or fxdp's check that
    its graph ran)."""
    model = MLP().to(DTYPE)
    dp = fxdp.transform(model, max_grad_norm=1.0, compiler="eager")
    mean_sq_loss(dp(randn(5, 4))).backward()
    model.zero_grad()
    torch._dynamo.config.fail_on_recompile_limit_hit = False
    with pytest.raises((torch._dynamo.exc.FailOnRecompileLimitHit, fxdp.UnsupportedError)):
        dp(randn(2, 5, 4)).pow(2).sum((1, 2)).mean().backward()
    assert all(p.grad is None for p in model.parameters())


def test_plain_tensors_given_to_functional_call_are_refused():
    """``torch.func.functional_call(model, params, ...)`` with a dict of plain leaf tensors
    that need a gradient: fxdp cannot tell they are trained (they would get the ordinary,
    unclipped gradient); as ``nn.Parameter`` objects they are clipped like the model's own."""
    model = MLP().to(DTYPE)
    x = randn(5, 4)
    ref = reference(model, [x], per_sample_sq_loss)
    step = torch.compile(lambda params, x: mean_sq_loss(torch.func.functional_call(model, params, (x,))),
                         backend=fxdp.backend(max_grad_norm=1.0, compiler="eager"))
    plain = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    with pytest.raises(Exception, match="needs a gradient but is no nn.Parameter"):  # in Dynamo's wrapper
        step(plain, x).backward()
    assert all(t.grad is None for t in plain.values())
    params = {n: nn.Parameter(p.detach().clone()) for n, p in model.named_parameters()}
    step(params, x).backward()
    assert_close_all({n: p.grad for n, p in params.items()}, ref.grad("mean", 1.0), TOL, "clipped grad")


def test_a_batched_input_that_needs_a_gradient_is_data():
    """``x.requires_grad_()`` (input gradients, adversarial training) stays batched data:
    the parameters are clipped and ``x.grad`` is autograd's."""
    model = MLP().to(DTYPE)
    x = randn(5, 4)
    ref = reference(model, [x], per_sample_sq_loss)
    x_eager = x.clone().requires_grad_()
    mean_sq_loss(model(x_eager)).backward()
    model.zero_grad()
    x.requires_grad_()
    compiled = torch.compile(model, backend=fxdp.backend(max_grad_norm=1.0, compiler="eager"))
    mean_sq_loss(compiled(x)).backward()
    assert_close_all(grads(model), ref.grad("mean", 1.0), TOL, "clipped grad")
    assert torch.allclose(x.grad, x_eager.grad)


def test_a_graph_resumed_after_the_loss_runs_as_it_is():
    """Without clipping a graph may break after the loss: Dynamo resumes with a graph
    whose first argument is the 0-d loss and that holds no parameter."""
    model = MLP().to(DTYPE)
    x = randn(5, 4)
    ref = reference(model, [x], per_sample_sq_loss)

    def step(x):
        loss = mean_sq_loss(model(x))
        torch._dynamo.graph_break()
        return loss * 2

    torch.compile(step, backend=fxdp.backend(grad_sample=True, compiler="eager"))(x).backward()
    assert_close_all(grad_samples(model), {n: 2 * g for n, g in ref.per_sample.items()}, TOL, "grad_sample")


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x):
        return self.bn(self.lin(x))


@pytest.mark.parametrize("model", [WithGraphBreak, WithBatchNorm], ids=["graph_break", "batch_norm"])
def test_a_refusal_under_suppress_errors_raises_when_the_frame_runs(model):
    """``torch._dynamo.config.suppress_errors`` swallows a backend's error and runs the
    frame eagerly, with ordinary, unclipped gradients: the refusal is raised when the
    frame runs instead."""
    model = model().to(DTYPE)
    compiled = torch.compile(model, backend=fxdp.backend(max_grad_norm=1.0, compiler="eager"))
    with torch._dynamo.config.patch(suppress_errors=True):
        with pytest.raises(fxdp.UnsupportedError, match="graph break|mixes samples"):
            mean_sq_loss(compiled(randn(5, 4))).backward()
    assert all(p.grad is None for p in model.parameters()), "no unclipped gradient left behind"


def test_a_backward_traced_into_the_graph_is_refused():
    """Under ``torch._dynamo.config.trace_autograd_ops`` (the hint Dynamo's graph-break
    message gives for ``loss.backward()``) a compiled train step computes the ordinary
    gradients inside its graph: refused with what to do instead, nothing written."""
    model = MLP().to(DTYPE)

    @torch.compile(backend=fxdp.backend(max_grad_norm=1.0, compiler="eager"))
    def step(x):
        loss = mean_sq_loss(model(x))
        loss.backward()
        return loss.detach()

    with torch._dynamo.config.patch(trace_autograd_ops=True):
        with refused(re.escape("call loss.backward() outside")):
            step(randn(5, 4))
    assert all(p.grad is None for p in model.parameters())


class GradientPenalty(nn.Module):
    """A forward that takes a gradient and uses it (as WGAN-GP's penalty does)."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(4, 4)
        self.lin2 = nn.Linear(4, 1)

    def forward(self, x):
        h = self.lin1(x)
        out = self.lin2(h).tanh()
        (g,) = torch.autograd.grad(out.sum(), h, create_graph=True)
        return out + g.square().sum(1, keepdim=True)


def test_a_gradient_taken_inside_the_forward_is_refused():
    model = GradientPenalty().to(DTYPE)
    x = randn(5, 4)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        assert [p.op for p in fxdp.validate(model, x)] == ["torch.autograd.grad"]
        with pytest.raises(fxdp.UnsupportedError, match="needs double backward"):
            fxdp.transform(model, max_grad_norm=1.0, compiler="eager")(x)
    assert all(p.grad is None for p in model.parameters())


@pytest.fixture
def default_stance():
    yield
    torch.compiler.set_stance("default")


@pytest.mark.parametrize("stance", ["eager_on_recompile", "eager_then_compile"])
def test_a_stance_that_runs_steps_without_the_backend_is_refused(default_stance, stance):
    """Under these stances Dynamo runs some training steps eagerly, unclipped and unseen
    by fxdp: a step that runs an fxdp graph under them raises, before any gradient is
    written."""
    model = MLP().to(DTYPE)
    compiled = torch.compile(model, backend=fxdp.backend(max_grad_norm=1.0, compiler="eager"))
    if stance == "eager_then_compile":  # the first call runs eagerly: compile on the second
        torch.compiler.set_stance(stance)
        compiled(randn(5, 4))
    else:
        mean_sq_loss(compiled(randn(5, 4))).backward()  # compiled and clipped
        torch.compiler.set_stance(stance)
    model.zero_grad()
    with pytest.raises(fxdp.UnsupportedError, match=r"set_stance\(.*without fxdp"):
        mean_sq_loss(compiled(randn(5, 4))).backward()
    assert all(p.grad is None for p in model.parameters())
    torch.compiler.set_stance("fail_on_recompile")  # raises at a new shape itself: allowed
    mean_sq_loss(compiled(randn(5, 4))).backward()
    assert fxdp.per_sample_norms(model) is not None


def test_transform_names_the_stance_that_ran_it_eagerly(default_stance):
    model = MLP().to(DTYPE)
    dp = fxdp.transform(model, max_grad_norm=1.0, compiler="eager")
    mean_sq_loss(dp(randn(5, 4))).backward()
    model.zero_grad()
    torch.compiler.set_stance("eager_on_recompile")
    mean_sq_loss(dp(randn(5, 4))).backward()  # its graph runs: fine
    model.zero_grad()
    with pytest.raises(fxdp.UnsupportedError, match=r"did not run .*set_stance\('eager_on_recompile'\)"):
        mean_sq_loss(dp(randn(3, 4))).backward()  # a new batch size would run eagerly
    assert all(p.grad is None for p in model.parameters())


def test_an_rnn_fed_a_new_sequence_length_beyond_the_limit_says_to_pad(recompile_limit_one):
    """An RNN is unrolled per sequence length: a batch of a new length needs a new graph,
    and at the limit the error says to pad to fixed lengths."""
    torch.manual_seed(0)
    model = nn.GRU(3, 4, batch_first=True).to(DTYPE)
    dp = fxdp.transform(model, max_grad_norm=1.0, compiler="eager")
    dp(randn(2, 5, 3))[0].pow(2).sum((1, 2)).mean().backward()
    model.zero_grad()
    with pytest.raises(fxdp.UnsupportedError, match="unrolled per sequence length"):
        dp(randn(2, 6, 3))[0].pow(2).sum((1, 2)).mean().backward()
    assert all(p.grad is None for p in model.parameters())


BATCH_IN_A_GLOBAL = randn(5, 4)


def test_a_batch_read_from_a_global_is_named():
    """A compiled step that reads its batch from a global has no argument to take the
    batch size from: the message names the global it took as shared."""
    model = MLP().to(DTYPE)

    @torch.compile(backend=fxdp.backend(max_grad_norm=1.0, compiler="eager"))
    def step():
        mean_sq_loss(model(BATCH_IN_A_GLOBAL)).backward()

    with pytest.raises(Exception, match=r"pass the batch to the compiled function \(or module\) as an argument; "
                                        r"G\['BATCH_IN_A_GLOBAL'\] comes from a global"):
        step()
    assert all(p.grad is None for p in model.parameters())


def test_a_forward_that_reads_only_the_batch_size_is_named():
    """Only ``x.shape[0]`` of the input is read: the graph has no tensor argument, and the
    message says why rather than naming a buffer as the culprit."""

    class SizeOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))
            self.register_buffer("scale", torch.ones(4))

        def forward(self, x):
            return self.w.expand(x.shape[0], 4) * self.scale

    with pytest.raises(fxdp.UnsupportedError, match=r"reads only the sizes of its arguments \(x.shape\[0\]\)") as info:
        fxdp.transform(SizeOnly().to(DTYPE), max_grad_norm=1.0, compiler="eager")(randn(5, 4))
    assert "_buffers" not in str(info.value)


def test_a_test_of_the_loss_belongs_after_its_backward():
    """``if not torch.isfinite(loss): raise`` before ``backward()`` is a branch on a
    statistic of the batch: refused, with the line and where to move it. After the
    backward it runs after the clipping, and the step is exact."""
    model = MLP().to(DTYPE)

    def step(x, check_first):
        loss = mean_sq_loss(model(x))
        if check_first and not torch.isfinite(loss):
            raise RuntimeError("the loss is not finite")
        loss.backward()
        if not check_first and not torch.isfinite(loss):
            raise RuntimeError("the loss is not finite")

    backend = fxdp.backend(max_grad_norm=1.0, compiler="eager")
    with refused(r"aten.isfinite.default in <top level> \(at .*test_backend.py:\d+: if check_first and not "
                 r"torch.isfinite\(loss\):\).*test it after loss.backward\(\)"):
        torch.compile(step, backend=backend)(randn(5, 4), True)
    assert all(p.grad is None for p in model.parameters())
    x = randn(5, 4)
    torch.compile(step, backend=backend)(x, False)
    assert_close_all(grads(model), reference(model, [x], per_sample_sq_loss).grad("mean", 1.0), TOL, "p.grad")
