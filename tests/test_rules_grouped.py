"""Grouped matmuls on the batch's tokens sorted by expert (``fxdp/rules/grouped.py``,
``Rows`` in ``fxdp/batching.py``): the rule's maths against an explicit loop over
samples and groups, ``torch._grouped_mm`` in bfloat16 and Hugging Face's Mixtral with
its default ``grouped_mm`` experts against the microbatch loop, and the refusals of
what depends on the order of the whole batch. The float64 and float32 models run in
``test_models_e2e.py`` (``experts_sorted_*``).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxdp
from fxdp.registry import lookup
from models import SortedExperts, loop_grouped_mm
from reference import assert_close_all, reference, tolerance

B, T, D = 3, 4, 8
# conftest.py registers the rule of the tests' loop op.
RULE = lookup(torch.ops.fxdp_tests.loop_grouped_mm.default).params[1]


def _rows(groups: int, rows: int = T, seed: int = 0):
    """``[B, rows, ·]`` gradients, inputs and keys (from 70 rows the ghost norm's Gram
    matrices go in blocks, see ``gram_inner``)."""
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(B, rows, 5, generator=g, dtype=torch.float64)
    x = torch.randn(B, rows, 6, generator=g, dtype=torch.float64)
    keys = torch.randint(0, groups, (B, rows), generator=g).to(torch.float32)
    keys[0, 1] = groups  # a sentinel past the last group: no weight, no gradient
    return grad, x, keys


def _loop_per_sample(grad, x, keys, groups):
    out = torch.zeros(B, groups, x.shape[-1], grad.shape[-1], dtype=grad.dtype)
    for b in range(B):
        for t in range(keys.shape[1]):
            e = int(keys[b, t])
            if e < groups:
                out[b, e] += torch.outer(x[b, t], grad[b, t])
    return out


@pytest.mark.parametrize("rows", [T, 70], ids=["few-rows", "gram-in-blocks"])
def test_the_rule_s_gradients_and_norms_against_a_loop_over_samples_and_groups(rows: int):
    groups = 3
    grad, x, keys = _rows(groups, rows=rows)
    expected = _loop_per_sample(grad, x, keys, groups)
    per_sample = RULE.per_sample_grad(grad, x, keys, groups=groups)
    torch.testing.assert_close(per_sample, expected)
    torch.testing.assert_close(RULE.sum_grad(grad, x, keys, groups=groups), expected.sum(0))
    weights = torch.tensor([0.5, 2.0, -1.0], dtype=torch.float64)
    torch.testing.assert_close(RULE.weighted_sum_grad(weights, grad, x, keys, groups=groups),
                               torch.einsum("b,bekn->ekn", weights, expected))
    torch.testing.assert_close(RULE.ghost_sq_norm(grad, x, keys, groups=groups), expected.pow(2).sum((1, 2, 3)))
    costs = RULE.costs([tuple(grad.shape), tuple(x.shape), tuple(keys.shape)], groups=groups)
    assert set(costs) == {"ghost", "instantiate"}


def test_torch_grouped_mm_in_bfloat16_against_the_microbatch_loop():
    """``torch._grouped_mm`` (bfloat16 only under ``torch.compile``) through its rule."""
    torch.manual_seed(0)
    model = SortedExperts(d=D, hidden=8).to(torch.bfloat16)
    x = torch.randn(B, T, D, dtype=torch.bfloat16)
    ref = reference(model, [x], lambda out, i: out.float().pow(2).sum())
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    dp(x).float().pow(2).sum().backward()
    got = {n: p.grad_sample.float() for n, p in model.named_parameters()}
    want = {n: g.float() for n, g in ref.per_sample.items()}
    assert_close_all(got, want, 3e-2, "grad_sample")


def _reasons(model: nn.Module, x: torch.Tensor) -> str:
    return "\n".join(str(p) for p in fxdp.validate(model, x))


class _Dispatch(nn.Module):
    """Sorted tokens, then one misuse of the order of the whole batch."""

    def __init__(self, misuse: str):
        super().__init__()
        self.router = nn.Linear(D, 2, bias=False)
        self.w = nn.Parameter(torch.randn(2, D, D))
        self.misuse = misuse

    def forward(self, x):
        h = x.reshape(-1, D)
        keys, order = self.router(h).argmax(-1).sort()
        rows = h[order]
        offsets = torch.histc(keys.float(), bins=2, min=0, max=1).cumsum(0, dtype=torch.int32)
        if self.misuse == "positions":  # each row scaled by its place in the sorted batch
            rows = rows * torch.arange(rows.shape[0], dtype=rows.dtype).unsqueeze(-1)
        if self.misuse == "ids as values":  # each row scaled by its token's place in the batch (b·T + t)
            rows = rows * torch.cos(order.to(rows.dtype)).unsqueeze(-1)
        if self.misuse == "ids into a table":  # a shared table's row per place in the batch
            rows = rows + self.w[0, 0][order % D].unsqueeze(-1)
        if self.misuse == "offsets":  # fixed groups: a row's expert depends on the other samples'
            offsets = torch.tensor([h.shape[0] // 2, h.shape[0]], dtype=torch.int32)
        out = loop_grouped_mm(rows, self.w, offsets)
        if self.misuse == "counts":
            out = out * offsets[-1].to(out.dtype)
        if self.misuse == "returned":  # a loss outside pairs row j with sample j's target
            return out
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.shape[0])
        if self.misuse == "inverse":
            out = out * inverse.to(out.dtype).unsqueeze(-1)
        return out[inverse].view(x.shape)


@pytest.mark.parametrize("misuse, reason", [
    ("positions", "varies along rows a sort of the whole batch ordered"),
    ("offsets", "with the offsets counted from those sorted keys"),
    ("counts", "how many rows of the whole batch each key has"),
    ("inverse", "the position of each row among the rows of the whole batch sorted"),
    ("returned", "returns rows in an order the whole batch's data decides"),
    ("ids as values", "it computes with the position of each row in the whole batch"),
    ("ids into a table", "it computes with the position of each row in the whole batch"),
])
def test_what_depends_on_the_order_of_the_whole_batch_is_refused(misuse, reason):
    x = torch.randn(B, T, D, dtype=torch.float64)
    model = _Dispatch(misuse).double()
    reasons = _reasons(model, x)
    assert reason in reasons
    assert _reasons(_Dispatch("none").double(), x) == ""


class _SortsBeforeABreak(nn.Module):
    """The batch's rows sorted by their first feature in a graph without parameters,
    then a graph break, then a layer: each row reaches the loss at its rank."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        x = x[x[:, 0].argsort()]
        torch._dynamo.graph_break()
        return self.lin(x)


@pytest.mark.parametrize("where", ["one graph", "before a break"])
def test_rows_returned_in_an_order_of_the_whole_batch_are_refused(where):
    """Row j of such an output is the sample at rank j, not sample j: a loss outside the
    forward pairs it with sample j's target, and every sample's gradient, norm and clip
    factor would depend on the other samples' data (it did: sample 0's ``grad_sample``
    moved when only the others changed)."""
    x = torch.randn(6, D, dtype=torch.float64)
    if where == "one graph":
        model = nn.Sequential(nn.Linear(D, D), nn.Tanh()).double()
        sorting = _Applied(model, lambda h: h[h[:, 0].argsort()])
        assert "returns rows in an order the whole batch's data decides" in _reasons(sorting, x)
        # the order itself, an integer tensor, carries no gradient: reported as a statistic is
        assert _reasons(_Applied(model, lambda h: (h, h[:, 0].argsort())), x) == ""
        return
    torch._dynamo.reset()
    model = _SortsBeforeABreak().double()
    step = torch.compile(model, backend=fxdp.backend(grad_sample=True, loss_reduction="sum", compiler="eager"))
    with pytest.raises(Exception, match="fxdp cannot follow the batch: this graph computes with parameters and with"):
        step(x).pow(2).sum().backward()
    assert model.lin.weight.grad is None


class _SortedAndPutBack(nn.Module):
    """Rows sorted by a key of the whole batch, a layer, and the rows put back with the
    order's own ``argsort`` (its inverse permutation)."""

    def __init__(self):
        super().__init__()
        self.inp, self.lin = nn.Linear(D, D), nn.Linear(D, 3)

    def forward(self, x):
        order = x[:, 0].argsort()
        rows = self.lin(torch.tanh(self.inp(x))[order])
        return rows[order.argsort()]


def test_rows_put_back_by_the_order_s_argsort_are_exact():
    """``order.argsort()`` of a sort's indices is its inverse, as ``inv[order] =
    arange(S)`` is (it was refused: "it groups or reduces rows that a sort … ordered")."""
    torch.manual_seed(0)
    model = _SortedAndPutBack().double()
    x = torch.randn(6, D, dtype=torch.float64)
    expected = reference(model, (x,), lambda out, i: out.pow(2).sum())
    dp = fxdp.transform(model, grad_sample=True, max_grad_norm=0.5, loss_reduction="sum", compiler="eager")
    dp(x).pow(2).sum().backward()
    tol = tolerance(torch.float64)
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, expected.per_sample, tol, "grad_sample")
    assert_close_all({n: p.grad for n, p in model.named_parameters()}, expected.grad("sum", 0.5), tol, "clipped")


class _Applied(nn.Module):
    def __init__(self, inner: nn.Module, then):
        super().__init__()
        self.inner, self.then = inner, then

    def forward(self, x):
        return self.then(self.inner(x))


def test_counts_of_the_batch_s_values_without_a_sort_are_refused():
    class Counted(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            h = self.lin(x)
            return h * torch.histc(h.argmax(-1).float().reshape(-1), bins=D, min=0, max=D)[:1]

    assert "it counts values over the whole batch" in _reasons(Counted().double(), torch.randn(B, T, D, dtype=torch.float64))


def test_hugging_face_mixtral_with_its_default_grouped_mm_experts_is_exact():
    """transformers' default experts sort the batch's tokens by expert and run
    ``grouped_mm`` (its fallback op under compilation): per-sample gradients and
    clipping against the microbatch loop run with the eager experts (a loop over
    experts, an independent implementation)."""
    transformers = pytest.importorskip(
        "transformers", reason="Hugging Face models (the test extra)")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16)
    model = transformers.MixtralForCausalLM(config).double()
    assert model.config._experts_implementation == "grouped_mm"
    ids = torch.randint(0, 40, (B, 6), generator=torch.Generator().manual_seed(1))
    eager = copy.deepcopy(model)  # its own config
    eager.set_experts_implementation("eager")
    assert model.config._experts_implementation == "grouped_mm"
    ref = reference(eager, [ids], lambda out, i: out.logits.pow(2).sum())
    dp = fxdp.transform(model, grad_sample=True, max_grad_norm=1.0, loss_reduction="sum", compiler="eager")
    dp(ids).logits.pow(2).sum().backward()
    got = {n: p.grad_sample for n, p in model.named_parameters()}
    assert_close_all(got, ref.per_sample, tolerance(torch.float64), "grad_sample")
    torch.testing.assert_close(dp.per_sample_norms, ref.norms)
    assert_close_all({n: p.grad for n, p in model.named_parameters()}, ref.grad("sum", 1.0),
                     tolerance(torch.float64), "grad")


def test_under_the_backend_at_several_batch_sizes_and_lengths():
    """Dynamo makes the batch and the sequence length symbolic after the first shapes: the
    sorted rows' ``inner`` (``top_k · T``) is then a symbolic product, which the
    backward rebuilds, also inside the generic VJP of the gathered biases that runs on
    the real tensors."""
    torch.manual_seed(0)
    model = SortedExperts(biases=True).double()
    model.router.requires_grad_(False)
    compiled = torch.compile(model, backend=fxdp.backend(grad_sample=True, max_grad_norm=1.0, compiler="eager"))
    for batch_size, length in ((3, 4), (5, 4), (4, 6), (6, 7)):
        x = torch.randn(batch_size, length, 8, dtype=torch.float64)
        ref = reference(copy.deepcopy(model), (x,), lambda out, i: out.pow(2).sum())
        model.zero_grad(set_to_none=True)
        compiled(x).pow(2).sum(dim=(1, 2)).mean().backward()
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        what = f"B = {batch_size}, T = {length}"
        assert_close_all({n: p.grad_sample for n, p in trained}, ref.per_sample, tolerance(torch.float64), what)
        assert_close_all({n: p.grad for n, p in trained}, ref.grad("mean", 1.0), tolerance(torch.float64), what)


class _SortedKeysCounted(nn.Module):
    """The keys taken in their own ``argsort``'s order (``keys[order]``: the sorted keys)
    and counted (``bincount`` or ``histc``) for the offsets (was refused: "it reads how
    many rows of the whole batch each key has")."""

    def __init__(self, count: str):
        super().__init__()
        self.router = nn.Linear(D, 3, bias=False)
        self.w = nn.Parameter(torch.randn(3, D, D))
        self.count = count

    def forward(self, x):
        h = x.reshape(-1, D)
        keys = self.router(h).argmax(-1)
        order = keys.argsort(stable=True)
        if self.count == "bincount":
            offsets = torch.bincount(keys[order], minlength=3)
        else:
            offsets = torch.histc(keys[order].float(), bins=3, min=0, max=2)
        out = loop_grouped_mm(h[order] * torch.tanh(self.router(h))[order][:, :1], self.w,
                              offsets.cumsum(0, dtype=torch.int32))
        return x + out[order.argsort()].view(x.shape)


@pytest.mark.parametrize("count", ["bincount", "histc"])
def test_the_keys_gathered_in_their_sort_s_order_are_the_sorted_keys(count):
    torch.manual_seed(0)
    model = _SortedKeysCounted(count).double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    expected = reference(model, (x,), lambda out, i: out.pow(2).sum())
    dp = fxdp.transform(model, grad_sample=True, max_grad_norm=1.0, loss_reduction="sum", compiler="eager")
    dp(x).pow(2).sum().backward()
    tol = tolerance(torch.float64)
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, expected.per_sample, tol, "grad_sample")
    assert_close_all({n: p.grad for n, p in model.named_parameters()}, expected.grad("sum", 1.0), tol, "clipped")


class _SlotOfEachChoice(nn.Module):
    """The sorted choices' ids taken modulo the choices per token (``order % k``): each
    choice's slot among its token's, the same for a sample alone (exact; ``order`` itself
    as a value is refused, see ``_Dispatch``)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, 3, bias=False)
        self.w = nn.Parameter(torch.randn(3, D, D))

    def forward(self, x):
        h = x.reshape(-1, D)
        weights, chosen = self.router(h).softmax(-1).topk(2)
        keys, order = chosen.reshape(-1).sort(stable=True)
        offsets = torch.histc(keys.double(), bins=3, min=0, max=2).cumsum(0).to(torch.int32)
        slot = (order % 2).to(h.dtype)
        out = loop_grouped_mm(h[order // 2], self.w, offsets) * (weights.reshape(-1)[order] * (1 + slot))[:, None]
        return torch.zeros_like(h).index_add(0, order // 2, out).view(x.shape)


def _grad_samples_match_the_loop(model: nn.Module, dp: nn.Module, x: torch.Tensor) -> None:
    """``dp``'s (``model`` transformed with ``grad_sample``) per-sample gradients of
    ``Σ out²`` against the microbatch loop."""
    expected = reference(model, (x,), lambda out, i: out.pow(2).sum())
    dp(x).pow(2).sum().backward()
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, expected.per_sample,
                     tolerance(torch.float64), "grad_sample")


def test_the_slot_of_each_sorted_choice_is_the_samples_own():
    torch.manual_seed(0)
    model = _SlotOfEachChoice().double()
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    _grad_samples_match_the_loop(model, dp, torch.randn(B, T, D, dtype=torch.float64))


class _DroppedChoices(nn.Module):
    """Weak choices dropped by a key outside ``0 … E - 1`` before the sort, the rows
    counted with ``histc``: with key ``E`` and ``max = E - 1`` they are sorted last and
    counted in no group (exact); with key ``-1`` they are sorted first and counted in
    none, so every group moves by how many the whole batch has, and with key ``E`` and
    ``max = E`` (torchtitan's count) they are counted in the last group. Both were
    accepted with wrong gradients (the rule puts a row in group ``keys[r]``, or none):
    now a run-time error."""

    def __init__(self, dropped: int, high: int):
        super().__init__()
        self.router = nn.Linear(D, 3, bias=False)
        self.w = nn.Parameter(torch.randn(3, D, D))
        self.dropped, self.high = dropped, high

    def forward(self, x):
        h = x.reshape(-1, D)
        weights, chosen = self.router(h).softmax(-1).topk(2)
        keys = torch.where(weights.reshape(-1) < 0.3, self.dropped, chosen.reshape(-1))
        order = keys.argsort(stable=True)
        offsets = torch.histc(keys.double(), bins=3, min=0, max=self.high).cumsum(0).to(torch.int32)
        out = loop_grouped_mm(h[order // 2], self.w, offsets) * weights.reshape(-1)[order, None]
        return torch.zeros_like(h).index_add(0, order // 2, out).view(x.shape)


@pytest.mark.parametrize("dropped,high", [(3, 2), (-1, 2), (3, 3)], ids=["past-the-last", "negative", "counted-last"])
def test_rows_of_dropped_choices_are_in_no_group_or_a_run_time_error(dropped, high):
    torch.manual_seed(0)
    model = _DroppedChoices(dropped, high).double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    with torch.no_grad():
        weights = model.router(x.reshape(-1, D)).softmax(-1).topk(2).values
    assert (weights < 0.3).any()  # some choices are dropped
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    if dropped == 3 and high == 2:
        _grad_samples_match_the_loop(model, dp, x)
    else:
        with pytest.raises(fxdp.UnsupportedError, match="some key is negative .* or is at least bins and at most max"):
            dp(x).pow(2).sum().backward()


def test_other_values_gathered_in_a_sort_s_order_are_no_keys():
    """``keys[order]`` counts as the sorted keys only where ``order`` sorts ``keys``
    themselves: a count of other values taken in that order is the batch's."""

    class OtherCounted(_SortedKeysCounted):
        def forward(self, x):
            h = x.reshape(-1, D)
            keys = self.router(h).argmax(-1)
            order = keys.argsort(stable=True)
            other = (keys + 1) % 3  # not the values the argsort sorted
            out = loop_grouped_mm(h[order], self.w, torch.bincount(other[order], minlength=3).cumsum(0, dtype=torch.int32))
            return x + out[order.argsort()].view(x.shape)

    assert "it counts values over the whole batch" in _reasons(OtherCounted("bincount").double(),
                                                               torch.randn(B, T, D, dtype=torch.float64))


class _SortedRowsLoss(nn.Module):
    """A loss over every sorted row inside the forward: their mean is the mean over the
    samples of each one's rows' mean (every sample has ``T`` of the ``B·T`` rows), their
    sum the sum of the samples' own (was refused: "it groups or reduces rows that a sort
    of the whole batch ordered")."""

    def __init__(self, reduction: str):
        super().__init__()
        self.lin = nn.Linear(D, 3)
        self.reduction = reduction

    def forward(self, x):
        h = x.reshape(-1, D)
        rows = self.lin(h[h[:, 0].argsort()]).pow(2)
        return rows.sum() if self.reduction == "sum" else rows.mean()


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_a_loss_over_every_sorted_row_is_the_samples_losses(reduction):
    torch.manual_seed(0)
    model = _SortedRowsLoss(reduction).double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    expected = reference(model, (x,), lambda loss, i: loss)  # a sample alone: its own rows
    dp = fxdp.transform(model, grad_sample=True, max_grad_norm=0.5, loss_reduction=reduction, compiler="eager")
    dp(x).backward()
    tol = tolerance(torch.float64)
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, expected.per_sample, tol, "grad_sample")
    assert_close_all({n: p.grad for n, p in model.named_parameters()}, expected.grad(reduction, 0.5), tol, "clipped")
