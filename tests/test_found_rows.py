"""Rows of the batch a ``nonzero`` found (``Rows`` with ``column`` in
``fxdp/batching.py``): a mixture of experts written as a loop over its experts runs each
one on the tokens routed to it, ``torch.where(expert_mask[e])``, and adds the results
back into their tokens' rows. The models of ``models.LoopedExperts`` run in
``test_models_e2e.py`` (``experts_looped_*``, float64, float32 and Inductor); here: a
token found twice, a loss over the rows found, the batch sizes of the backend, rows put
back by a scatter, parameters without a rule on the rows, and the refusals of what
depends on every sample's routing.
"""
from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

import fxdp
from models import LoopedExperts
from reference import assert_close_all, reference, tolerance

D = 8


def _reasons(model: nn.Module, *args) -> str:
    return "\n".join(str(p) for p in fxdp.validate(model, *args))


def _exact(model: nn.Module, args: tuple, loss, clip: float | None = None) -> None:
    """``grad_sample`` and the clipped sum of a ``loss_reduction="sum"`` step against the
    microbatch loop (``loss(out)`` is each sample's loss summed)."""
    ref = reference(model, args, lambda out, i: loss(out))
    clip = float(ref.norms.median()) if clip is None else clip
    trained = copy.deepcopy(model)
    dp = fxdp.transform(trained, grad_sample=True, max_grad_norm=clip, loss_reduction="sum", compiler="eager")
    loss(dp(*args)).backward()
    tol = tolerance(torch.float64)
    params = dict(trained.named_parameters())
    assert_close_all({n: p.grad_sample for n, p in params.items()}, ref.per_sample, tol, "grad_sample")
    torch.testing.assert_close(dp.per_sample_norms, ref.norms)
    assert_close_all({n: p.grad for n, p in params.items()}, ref.grad("sum", clip), tol, "clipped")


class _Routed(nn.Module):
    """Tokens routed to one expert by a router, found by ``torch.where``, the expert run
    on them and added back; ``misuse`` does one thing more with the rows found."""

    def __init__(self, misuse: str = "none"):
        super().__init__()
        self.router = nn.Linear(D, 2, bias=False)
        self.expert = nn.Linear(D, D)
        self.misuse = misuse

    def forward(self, x):
        h = x.reshape(-1, D)
        probs = self.router(h).softmax(-1)
        mask = probs.argmax(-1) == 1
        if self.misuse == "twice":  # every token it finds, found by two slots
            slot, token = torch.where(torch.stack([mask, mask]))
        else:
            (token,) = torch.where(mask)
        rows = self.expert(h[token]) * probs[token][:, 1:]
        if self.misuse == "twice":
            rows = rows * (slot + 1).unsqueeze(-1).to(rows.dtype)  # each slot's copy its own weight
        if self.misuse == "positions":  # each row scaled by its place among the rows found
            rows = rows * torch.arange(rows.shape[0], dtype=rows.dtype).unsqueeze(-1)
        if self.misuse == "tokens as values":  # each row scaled by its token's place in the batch
            rows = rows * (1 + token).unsqueeze(-1).to(rows.dtype)
        if self.misuse == "count":  # divided by how many the whole batch routed
            rows = rows / token.numel()
        if self.misuse == "returned":  # a loss outside pairs row j with sample j's target
            return rows
        if self.misuse == "reduced":
            return x + rows.sum(0)
        return x + torch.zeros_like(h).index_add(0, token, rows).view(x.shape)


def test_a_token_found_twice_is_put_back_in_two_places():
    """Two slots of the mask name the same token: its two rows go to their own positions
    of the mask flattened, so both copies' gradients count (one place for the token would
    keep one copy)."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, D, dtype=torch.float64)
    _exact(_Routed("twice").double(), (x,), lambda out: out.pow(2).sum())


class _Selected(nn.Module):
    """A head on the positions a per-token mask selects, ``h[mask.nonzero(as_tuple=True)]``
    (the samples' masks select different numbers of positions), the loss its rows' sum."""

    def __init__(self, reduction: str):
        super().__init__()
        self.proj, self.head = nn.Linear(D, D), nn.Linear(D, 3)
        self.reduction = reduction

    def forward(self, x, mask):
        h = torch.tanh(self.proj(x))
        if self.reduction == "flattened mean":  # one coordinate: the rows a nonzero found
            rows = self.head(h.reshape(-1, h.shape[-1])[mask.reshape(-1).nonzero(as_tuple=True)])
            return rows.pow(2).mean()
        rows = self.head(h[mask.nonzero(as_tuple=True)])
        return rows.pow(2).sum() if self.reduction == "sum" else rows.pow(2).mean()


def test_a_loss_summed_over_the_rows_found_is_the_samples_losses():
    torch.manual_seed(0)
    x = torch.randn(4, 5, D, dtype=torch.float64)
    mask = torch.rand(4, 5, generator=torch.Generator().manual_seed(1)) > 0.4
    mask[0] = False  # a sample with no row found: a zero gradient
    mask[1] = True
    _exact(_Selected("sum").double(), (x, mask), lambda loss: loss)
    # Indexed by all its coordinates, the nonzero is the mask: a mean over its list is each
    # sample's mean where the masks select as many, checked when the step runs.
    dp = fxdp.transform(_Selected("mean").double(), max_grad_norm=1.0, compiler="eager")
    with pytest.raises(fxdp.UnsupportedError, match="the samples' masks select different numbers of elements"):
        dp(x, mask).backward()
    assert "it averages the rows a nonzero found over the whole batch" in _reasons(
        _Selected("flattened mean").double(), x, mask)


@pytest.mark.parametrize("misuse, reason", [
    ("positions", "how many elements a boolean mask selected from the whole batch, or a nonzero found in it"),
    ("count", "how many elements a boolean mask selected from the whole batch, or a nonzero found in it"),
    ("tokens as values", "it computes with the position of each row in the whole batch"),
    ("returned", "returns rows in an order the whole batch's data decides (a sort, an argsort or a nonzero"),
    ("reduced", "mixes samples: it reduces over the batch dim"),
])
def test_what_depends_on_every_sample_s_routing_is_refused(misuse, reason):
    x = torch.randn(3, 4, D, dtype=torch.float64)
    assert reason in _reasons(_Routed(misuse).double(), x)
    assert _reasons(_Routed().double(), x) == ""


@pytest.mark.parametrize("dispatch", ["where", "flat"])
def test_under_the_backend_at_several_batch_sizes_and_lengths(dispatch):
    """The rows found are put back at positions of a mask whose sizes Dynamo makes
    symbolic after the first call (``top_k · B · T``), rebuilt in the backward."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = LoopedExperts(dispatch=dispatch).double()
    compiled = torch.compile(model, backend=fxdp.backend(grad_sample=True, max_grad_norm=1.0, compiler="eager"))
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        for batch_size, length in ((3, 4), (5, 4), (4, 6), (1, 7)):
            x = torch.randn(batch_size, length, D, dtype=torch.float64)
            ref = reference(copy.deepcopy(model), (x,), lambda out, i: out.pow(2).sum())
            model.zero_grad(set_to_none=True)
            compiled(x).pow(2).sum(dim=(1, 2)).mean().backward()
            what = f"B = {batch_size}, T = {length}"
            params = dict(model.named_parameters())
            assert_close_all({n: p.grad_sample for n, p in params.items()}, ref.per_sample,
                             tolerance(torch.float64), what)
            assert_close_all({n: p.grad for n, p in params.items()}, ref.grad("mean", 1.0),
                             tolerance(torch.float64), what)


def test_the_backend_without_dynamic_output_shapes_names_the_setting():
    """Without ``capture_dynamic_output_shape_ops`` Dynamo breaks the graph at the
    ``nonzero`` (inside the loop: it skips the whole forward), which fxdp refuses."""
    torch._dynamo.reset()
    model = LoopedExperts().double()
    compiled = torch.compile(model, backend=fxdp.backend(max_grad_norm=1.0, compiler="eager"))
    with pytest.raises(fxdp.UnsupportedError, match="capture_dynamic_output_shape_ops is True: set it"):
        compiled(torch.randn(3, 4, D, dtype=torch.float64)).sum().backward()
    assert all(p.grad is None for p in model.parameters())


def test_a_batch_of_none_and_of_one():
    torch.manual_seed(0)
    model = LoopedExperts().double()
    dp = fxdp.transform(model, grad_sample=True, max_grad_norm=1.0, loss_reduction="sum", compiler="eager")
    dp(torch.randn(0, 4, D, dtype=torch.float64)).pow(2).sum().backward()
    assert all(p.grad_sample.shape[0] == 0 and not p.grad.any() for p in model.parameters())
    model.zero_grad(set_to_none=True)
    x = torch.randn(1, 4, D, dtype=torch.float64)
    ref = reference(copy.deepcopy(model), (x,), lambda out, i: out.pow(2).sum())
    dp(x).pow(2).sum().backward()
    assert_close_all({n: p.grad for n, p in model.named_parameters()}, ref.grad("sum", 1.0),
                     tolerance(torch.float64), "B = 1")


class _Scattered(nn.Module):
    """Two experts' rows added back into their tokens by ``scatter_add`` / ``scatter_reduce``
    with the ids broadcast along each row, the rows sorted by expert or found per expert;
    ``"shifted"`` writes half of each row's entries one token further (into another
    sample's row at a sample's last token)."""

    def __init__(self, how: str):
        super().__init__()
        self.router = nn.Linear(D, 2, bias=False)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.how = how

    def forward(self, x):
        h = x.reshape(-1, D)
        weights, chosen = self.router(h).softmax(-1).topk(2)
        out = torch.zeros_like(h)
        if self.how == "sorted":
            keys, order = chosen.reshape(-1).sort()
            token = order // 2
            rows = h[token] * weights.reshape(-1)[order, None]
            y = sum(expert(rows) * (keys == e).unsqueeze(-1) for e, expert in enumerate(self.experts))
            return x + out.scatter_add(0, token.unsqueeze(-1).expand(-1, D), y).view(x.shape)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            y = expert(h[token]) * weights[token, slot, None]
            if self.how == "found":
                out = out.scatter_reduce(0, token.view(-1, 1).repeat(1, D), y, reduce="sum")
            else:
                out = out.scatter_add(0, token[:, None] + torch.arange(D) % 2, y)
        return x + out.view(x.shape)


@pytest.mark.parametrize("how", ["sorted", "found"])
def test_rows_scattered_back_into_their_tokens_are_exact(how):
    """(Refused before the forty-ninth session: "it combines rows that a sort of the
    whole batch ordered with values in another order".)"""
    torch.manual_seed(0)
    _exact(_Scattered(how).double(), (torch.randn(3, 4, D, dtype=torch.float64),), lambda out: out.pow(2).sum())


def test_rows_scattered_into_other_rows_are_refused():
    x = torch.randn(3, 4, D, dtype=torch.float64)
    assert "it computes with the position of each row in the whole batch" in _reasons(
        _Scattered("shifted").double(), x)


class _EveryToken(nn.Module):
    """Every token found (``n = B·T``), the rows put back by the ids' ``argsort`` or by an
    inverse written as for sorted rows: neither is a permutation's inverse here (the rows
    a nonzero finds are a subset of the batch, or hold a token twice), so neither is taken
    for the batch in order (before the fix both were)."""

    def __init__(self, how: str):
        super().__init__()
        self.router, self.lin, self.how = nn.Linear(D, 2, bias=False), nn.Linear(D, D), how

    def forward(self, x):
        h = x.reshape(-1, D)
        (token,) = torch.where(self.router(h).argmax(-1) >= 0)
        rows = self.lin(h[token])
        if self.how == "argsort":
            return rows[token.argsort()].view(x.shape)
        inverse = torch.empty_like(token)
        inverse[token] = torch.arange(token.shape[0])
        return rows[inverse].view(x.shape)


@pytest.mark.parametrize("how, reason", [
    ("argsort", "it computes with the position of each row in the whole batch"),
    ("inverse", "it computes with the position of each row in the whole batch"),
])
def test_the_ids_argsort_or_inverse_is_no_way_back(how, reason):
    assert reason in _reasons(_EveryToken(how).double(), torch.randn(3, 4, D, dtype=torch.float64))


class _SkipsEmptyExperts(LoopedExperts):
    """transformers' older Mixtral loop: an expert no token chose is skipped by a branch
    on the rows found, which Dynamo cannot capture."""

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(h).softmax(-1).topk(self.top_k)
        out = torch.zeros_like(h)
        for e in range(self.experts):
            token, slot = torch.where(chosen == e)
            if token.shape[0] == 0:
                continue
            out.index_add_(0, token, self.mlps[e](h[token]) * weights[token, slot, None])
        return x + out.view(x.shape)


def test_a_branch_on_how_many_rows_were_found_says_it_can_go():
    model = _SkipsEmptyExperts(dispatch="where_eq").double()
    dp = fxdp.transform(model, max_grad_norm=1.0, compiler="eager")
    with pytest.raises(fxdp.UnsupportedError, match="if token.shape\\[0\\] == 0: continue`\\) can go"):
        dp(torch.randn(3, 4, D, dtype=torch.float64))


class _WithoutARule(nn.Module):
    """A parameter used on the rows found by an op without a per-sample rule, taken by
    the generic per-sample VJP: ``torch.maximum(rows, p)``, or a table gathered by each
    row's slot (the count of rows, which the data decides, crashed the first before the
    fix: "an unbacked size")."""

    def __init__(self, how: str):
        super().__init__()
        self.router = nn.Linear(D, 2, bias=False)
        self.p = nn.Parameter(torch.randn(D)) if how == "maximum" else None
        self.table = nn.Parameter(torch.randn(2, D)) if how == "gathered" else None

    def forward(self, x):
        h = x.reshape(-1, D)
        probs = self.router(h).softmax(-1)
        slot, token = torch.where(torch.stack([probs[:, 0] > 0.3, probs[:, 1] > 0.3]))
        rows = h[token] * probs[token, slot, None]
        rows = torch.maximum(rows, self.p) if self.p is not None else rows * self.table[slot]
        return x + torch.zeros_like(h).index_add(0, token, rows).view(x.shape)


@pytest.mark.parametrize("how", ["maximum", "gathered"])
def test_parameters_without_a_rule_on_the_rows_found(how):
    torch.manual_seed(0)
    _exact(_WithoutARule(how).double(), (torch.randn(3, 4, D, dtype=torch.float64),), lambda out: out.pow(2).sum())


class _LoopsOverExpertsHit(LoopedExperts):
    """transformers' eager experts: a loop over the experts some token chose
    (``expert_hit``), whose length the data decides."""

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(h).softmax(-1).topk(self.top_k)
        out = torch.zeros_like(h)
        for e in torch.unique(chosen):
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, self.mlps[e](h[token]) * weights[token, slot, None])
        return x + out.view(x.shape)


def test_a_loop_over_the_experts_hit_says_to_loop_over_every_expert():
    dp = fxdp.transform(_LoopsOverExpertsHit(dispatch="where_eq").double(), max_grad_norm=1.0, compiler="eager")
    with pytest.raises(fxdp.UnsupportedError, match="a loop over the values of a tensor.*"
                       "`for e in range\\(num_experts\\)`") as info:
        dp(torch.randn(3, 4, D, dtype=torch.float64))
    assert "experts_implementation" not in str(info.value)  # not a transformers model


class _ConfiguredWithEagerExperts(nn.Module):
    """A transformers model without experts whose config still says
    ``_experts_implementation="eager"`` (transformers 5 sets it where grouped_mm cannot
    dispatch), stopped in Dynamo by a data-dependent loop of its own."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(_experts_implementation="eager")
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        for k in torch.unique((x > 0).sum(-1)):
            x = x + self.lin(x) * k
        return x


def test_the_eager_experts_hint_needs_experts():
    dp = fxdp.transform(_ConfiguredWithEagerExperts().double(), max_grad_norm=1.0, compiler="eager")
    with pytest.raises(fxdp.UnsupportedError, match="a loop over the values of a tensor") as info:
        dp(torch.randn(3, 4, D, dtype=torch.float64))
    assert "experts_implementation" not in str(info.value)
