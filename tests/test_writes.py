"""In-place writes: per-sample data written into a tensor the model made, and values
computed from parameters written in place (``passes/writes.py``).

A write through a view changes a tensor other nodes name; the batch analysis follows it
to the written base, or refuses. Checked against the microbatch loop, and against
reductions over the batch that the write would otherwise hide.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdp
from reference import assert_close_all, reference, tolerance

B = 4


class ShiftRight(nn.Module):
    """BART's ``shift_tokens_right`` on features: ``buf[:, 1:] = x[:, :-1]`` into zeros."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        buf = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        if self.how == "copy":
            buf[:, 1:].copy_(x[:, :-1])
        elif self.how == "setitem":
            buf[:, 1:] = x[:, :-1]
        elif self.how == "select":  # one position per write, through select views
            for t in range(1, x.shape[1]):
                buf[:, t] = x[:, t - 1]
        elif self.how == "transposed":  # the write goes through a transpose
            buf.transpose(0, 1)[1:].copy_(x.transpose(0, 1)[:-1])
        h = torch.where(x > 0, self.fc(buf), x)
        return self.head(h.mean(1))


class ShiftIds(nn.Module):
    """T5's ``_shift_right``: ids into ``new_zeros``, a start token, then an embedding."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, ids):
        shifted = ids.new_zeros(ids.shape)
        shifted[..., 1:] = ids[..., :-1].clone()
        shifted[..., 0] = 7
        return self.head(torch.tanh(self.embedding(shifted)).mean(1))


def _check(model, x, grad_sample: bool):
    y = torch.randint(0, 3, (B,), generator=torch.Generator().manual_seed(1))

    def loss_fn(out, i):
        return F.cross_entropy(out, y[i:i + 1], reduction="sum")

    ref = reference(model, (x,), loss_fn)
    max_grad_norm = float(ref.norms.median())
    dp = fxdp.transform(model, max_grad_norm=max_grad_norm, grad_sample=grad_sample,
                        loss_reduction="sum", compiler="eager")
    F.cross_entropy(dp(x), y, reduction="sum").backward()
    tol = tolerance(torch.float64)
    params = dict(model.named_parameters())
    assert_close_all({n: p.grad for n, p in params.items()}, ref.grad("sum", max_grad_norm), tol, "grad")
    assert_close_all({"norms": dp.per_sample_norms}, {"norms": ref.norms}, tol, "norms")
    if grad_sample:
        assert_close_all({n: p.grad_sample for n, p in params.items()}, ref.per_sample, tol, "grad_sample")


@pytest.mark.parametrize("grad_sample", [True, False], ids=["grad_sample", "clip"])
@pytest.mark.parametrize("how", ["copy", "setitem", "select", "transposed"])
def test_shift_right_into_a_fresh_buffer(how, grad_sample):
    torch.manual_seed(0)
    x = torch.randn(B, 5, 4, dtype=torch.float64)
    _check(ShiftRight(how).double(), x, grad_sample)


@pytest.mark.parametrize("grad_sample", [True, False], ids=["grad_sample", "clip"])
def test_shift_ids_then_embedding(grad_sample):
    torch.manual_seed(0)
    ids = torch.randint(0, 7, (B, 6), generator=torch.Generator().manual_seed(2))
    _check(ShiftIds().double(), ids, grad_sample)


def _problems(model, x):
    return [p.reason for p in fxdp.validate(model, x)]


class ReduceWrittenBuffer(nn.Module):
    """Per-sample data written into a buffer, then averaged over the batch: mixes samples."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        buf = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        if self.how == "copy":
            buf[:, 1:].copy_(x[:, :-1])
        elif self.how == "add":
            buf[:, 0].add_(x[:, 0])
        else:  # the whole buffer
            buf.copy_(x)
        return self.fc(buf.mean(0)) + x


@pytest.mark.parametrize("how", ["copy", "add", "whole"])
def test_reduction_over_the_batch_of_a_written_buffer_is_refused(how):
    x = torch.randn(B, 3, 4)
    with pytest.raises(fxdp.UnsupportedError, match="reduces over the batch dim"):
        fxdp.transform(ReduceWrittenBuffer(how), compiler="eager")(x)


class StaleView(nn.Module):
    """A view taken before per-sample data is written into its base, read after."""

    def __init__(self, how: str = "through the view's own positions"):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.how = how

    def forward(self, x):
        buf = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        head = buf[:, 0]
        if self.how == "through the view's own positions":
            buf[:, :2] = x[:, 1:]  # `head` now holds per-sample data
        else:  # "apart first": the write into other positions is data flow, `head` taken again from it
            buf[:, 1:] = x[:, :-1]
            buf[:, 0] = x[:, -1]  # through another view: `head` now holds per-sample data
        return self.fc(head.mean(0)) + x


class WrittenThenReadThroughAnEarlierResult(nn.Module):
    """A write into all of ``h`` stays a write (a view of ``h`` was taken before it); a
    later write into a column of ``h`` becomes a scatter, which the first write's result,
    the same memory, must show. (A red team's fuzzer found it wrong at the second batch
    size, through a first version of the sixtieth session's retaken views: under a
    symbolic batch size the full-width slice is dropped, and its write is into ``h``.)"""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = self.fc(x) * 1.0
        s = h[:, 2] + 1.0  # (a view taken before the writes)
        v = h[:, 0:4]
        v.mul_(2.0)
        h[:, 1] = x[:, 0]
        return self.head(v + s[:, None])


def test_a_write_read_through_an_earlier_writes_result():
    torch.manual_seed(0)
    model = WrittenThenReadThroughAnEarlierResult().double()
    plain = copy.deepcopy(model)
    dp = fxdp.transform(model, grad_sample=True, max_grad_norm=0.5, loss_reduction="sum", compiler="eager")
    for batch_size in (4, 3):
        x = torch.randn(batch_size, 4, dtype=torch.float64)
        ref = reference(copy.deepcopy(plain), (x,), lambda out, i: out.pow(2).sum())
        model.zero_grad(set_to_none=True)
        out = dp(x)
        torch.testing.assert_close(out, plain(x), rtol=0, atol=1e-12)
        out.pow(2).sum().backward()
        assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample, 1e-9,
                         f"grad_sample at B = {batch_size}")
        assert_close_all({n: p.grad for n, p in model.named_parameters()}, ref.grad("sum", 0.5), 1e-9,
                         f"clipped grad at B = {batch_size}")


@pytest.mark.parametrize("how", ["through the view's own positions", "apart first"])
def test_view_read_after_a_write_into_its_base_is_refused(how):
    """(Written apart first, the view holds the second write's per-sample data, which the
    analysis follows since the sixtieth session: refused as the mean over the batch.)"""
    problems = _problems(StaleView(how), torch.randn(B, 3, 4))
    reason = "read after the write" if how == "through the view's own positions" else "reduces over the batch dim"
    assert any(reason in p for p in problems), problems


class WrittenWeight(nn.Module):
    """Weight surgery written in place on a copy of the parameter."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        w = self.fc.weight.clone()
        if self.how == "slice":  # a lifted 0-d constant written: as good as a number
            w[:, :2] = 0.0
        elif self.how == "end-knots":  # pyro's rational-quadratic spline: knots[..., 0] = -B; [..., -1] = B
            w[:, 0] = -3.0
            w[:, -1] = 3.0
        elif self.how == "bias-into-a-column":  # a parameter's values written into a view
            w[:, 0] = self.fc.bias
        elif self.how == "through-an-earlier-view":  # read through a view taken before the write
            flat = w.view(-1)
            w[:, 0] = self.fc.bias
            w = flat.view(3, 4)
        elif self.how == "row-mul":
            w[0].mul_(3.0)
        elif self.how == "masked-fill":
            w.masked_fill_(w > 0, 0.0)
        elif self.how == "select-scatter":  # the out-of-place form of row-mul
            w = torch.select_scatter(w, w[0] * 3.0, 0, 0)
        else:
            w.mul_(2.0).add_(1.0)
        return F.linear(x, w, self.fc.bias).mean(1)


@pytest.mark.parametrize("how", ["through-an-earlier-view"])
def test_parameter_values_written_in_place_through_views_are_refused(how):
    """A write that a view taken before it shows: not data flow (``flat`` would read the
    values before the write), and fxdp maps per-sample gradients through data flow alone."""
    problems = fxdp.validate(WrittenWeight(how), torch.randn(B, 2, 4))
    assert any(p.parameter == "fc.weight" and "out of place" in p.reason for p in problems), problems
    with pytest.raises(fxdp.UnsupportedError, match="writes in place into a value computed from parameters"):
        fxdp.transform(WrittenWeight(how), compiler="eager")(torch.randn(B, 2, 4))


@pytest.mark.parametrize("grad_sample", [True, False], ids=["grad_sample", "clip"])
@pytest.mark.parametrize("how", ["masked-fill", "mul-add", "row-mul", "select-scatter", "slice", "end-knots",
                                 "bias-into-a-column"])
def test_whole_parameter_values_written_in_place_are_exact(how, grad_sample):
    """An in-place op on a whole tensor nothing aliases is its out-of-place twin
    (``in_place_as_out_of_place_pass``): a parameter transform like any other; so is one
    with no tensor operand, or constant ones, on a row of it (``w[0].mul_(3.0)``,
    ``w[:, :2] = 0.0``: the twin scattered back, as torchvision's Swin V2 zeroes a third
    of its qkv bias and pyro's spline sets its end knots; ``w[:, 0] = bias``, another
    tensor's values, scattered alike). ``select_scatter`` runs as
    a one-row ``slice_scatter``: under the per-sample VJP's ``vmap`` its backward gave
    the written row the gradient through the base too."""
    torch.manual_seed(0)
    _check(WrittenWeight(how).double(), torch.randn(B, 2, 4, dtype=torch.float64), grad_sample)


class ScaledPositionHeads(nn.Module):
    """DeBERTa (v1): a parameter's projection split into heads by a view and a permute,
    scaled in place (``pos_query /= scale``), then read through a transpose taken after
    the write; ``then_base``: the projection itself is read after the write too."""

    def __init__(self, then_base: bool = False):
        super().__init__()
        self.then_base = then_base
        self.rel = nn.Parameter(torch.randn(6, 4))
        self.proj = nn.Linear(4, 4)
        self.key = nn.Linear(4, 4)

    def forward(self, x):
        projected = self.proj(self.rel)
        heads = projected.view(6, 2, 2).permute(1, 0, 2)  # [heads, 6, d], a view
        heads /= 2.0 ** 0.5
        keys = self.key(x).view(x.shape[0], x.shape[1], 2, 2).permute(0, 2, 1, 3)
        scores = torch.matmul(keys, heads.transpose(-1, -2)).mean((1, 2))[:, :3]
        return scores + projected.sum() if self.then_base else scores


@pytest.mark.parametrize("grad_sample", [True, False], ids=["grad_sample", "clip"])
def test_parameter_values_written_in_place_through_their_only_view_are_exact(grad_sample):
    """An in-place op on a view that is its memory's only way (nothing reads the base
    or an earlier view of it) is its out-of-place twin, as for a whole tensor."""
    torch.manual_seed(0)
    _check(ScaledPositionHeads().double(), torch.randn(B, 5, 4, dtype=torch.float64), grad_sample)


def test_parameter_values_written_in_place_through_a_view_of_a_read_base_are_refused():
    with pytest.raises(fxdp.UnsupportedError, match="writes in place into a value computed from parameters"):
        fxdp.transform(ScaledPositionHeads(then_base=True), compiler="eager")(torch.randn(B, 5, 4))


class FilterBank(nn.Module):
    """speechbrain's ``GaborConv1d(use_legacy_complex=True)``: parameters written into
    slices of a fresh ``torch.zeros`` filter bank, scaled by a tensor the forward makes
    (``torch.tensor(2.0)``, a constant AOTAutograd lifts to the graph's first input),
    then convolved with the batch."""

    def __init__(self, writes: int):
        super().__init__()
        self.writes = writes
        self.k = nn.Parameter(torch.rand(4, 5) + 0.5)
        self.head = nn.Linear(8 * 8 if writes == 2 else 4 * 8, 3)

    def forward(self, x):  # x [B, 1, 12]
        w = torch.zeros(4, 5, 2, dtype=x.dtype)
        if self.writes == 2:
            w[:, :, 0] = self.k.exp()
        w[:, :, 1] = self.k * torch.sqrt(torch.tensor(2.0, dtype=x.dtype))
        bank = w.permute(0, 2, 1).reshape(8, 1, 5) if self.writes == 2 else w[:, :, 1].unsqueeze(1)
        return self.head(F.conv1d(x, bank).flatten(1))


@pytest.mark.parametrize("grad_sample", [True, False], ids=["grad_sample", "clip"])
@pytest.mark.parametrize("writes", [1, 2])
def test_parameters_written_into_a_fresh_filter_bank_are_exact(writes, grad_sample):
    """A ``copy_`` into a slice of a tensor made from sizes alone (or into the scatter an
    earlier such write became) is data flow: a parameter transform like any other.
    Before, the parameter reached the convolution through no rule; and with the lifted
    constant in front of the inputs, the check that catches that looked at the wrong
    gradient and let the unclipped one through."""
    torch.manual_seed(0)
    _check(FilterBank(writes).double(), torch.randn(B, 1, 12, dtype=torch.float64), grad_sample)


class BlocksThenIndices(nn.Module):
    """escnn's ``BlocksBasisExpansion._expand_filter``: a fresh ``torch.zeros`` filter,
    one block written through a slice and other entries through an ``index_put_`` at a
    buffer's indices (in either order), then convolved with the batch."""

    def __init__(self, block_first: bool):
        super().__init__()
        self.block_first = block_first
        self.a = nn.Parameter(torch.randn(9))
        self.b = nn.Parameter(torch.randn(4, 9))
        self.register_buffer("rows", torch.tensor([0, 1, 3, 4]))
        self.register_buffer("columns", torch.tensor([0, 0, 0, 0]))
        self.head = nn.Linear(5, 3)

    def forward(self, x):  # x [B, 1, 6, 6]
        f = torch.zeros(5, 1, 9, dtype=x.dtype)
        if self.block_first:
            f[2:3, 0:1, :] = self.a.reshape(1, 1, 9)
        f[self.rows, self.columns, :] = self.b
        if not self.block_first:
            f[2:3, 0:1, :] = self.a.reshape(1, 1, 9)
        return self.head(F.conv2d(x, f.reshape(5, 1, 3, 3), padding=1).mean((-1, -2)))


@pytest.mark.parametrize("grad_sample", [True, False], ids=["grad_sample", "clip"])
@pytest.mark.parametrize("block_first", [True, False], ids=["block_first", "indices_first"])
def test_a_fresh_filter_written_by_a_block_and_at_indices_is_exact(block_first, grad_sample):
    """The block's write read by no view after the ``index_put_`` into the whole filter
    is data flow, the ``index_put_`` then writing into its scattered result; it stayed
    in place before the sixty-fourth session, as if the block were read after the
    second write, and escnn's every convolution with such a basis was refused ("it
    writes values computed from parameters in place into a tensor made inside the
    model"; a helper's sweep)."""
    torch.manual_seed(0)
    _check(BlocksThenIndices(block_first).double(), torch.randn(B, 1, 6, 6, dtype=torch.float64), grad_sample)


class CopyOfAWrittenView(nn.Module):
    """``o = v * 1`` of a view's in-place result, then the base written again: ``o`` is a
    copy and keeps the values before that write (``unit_scale_pass`` made it the view
    itself, so it showed the later write: forward off by 5.8 before the sixty-fourth
    session; a red team's find)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.l = nn.Linear(4, 5)

    def forward(self, x):
        h = self.l(x) + 1
        v = h.view(-1, 5) if self.how == "view" else h.unsqueeze(1)
        v.add_(1)
        o = (v * 1).reshape(-1, 5)
        h.mul_(3)
        return torch.cat([o, h], 1)


@pytest.mark.parametrize("how", ["view", "unsqueeze"])
def test_a_copy_of_a_written_view_keeps_its_values_when_the_base_is_written_later(how):
    torch.manual_seed(0)
    model = CopyOfAWrittenView(how).double()
    x = torch.randn(B, 4, dtype=torch.float64)
    torch.testing.assert_close(fxdp.transform(copy.deepcopy(model), compiler="eager")(x), model(x))
    _check(model, x, grad_sample=True)


class WrittenAgainThroughAsStrided(nn.Module):
    """A column of a fresh tensor written with a parameter, then tripled by a write
    through ``as_strided`` of another column's slice, which reaches the first column: the
    first write, made data flow as if the later one could not reach it, lost the
    tripling (forward and gradients wrong before the sixty-fourth session; a red
    team's find)."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 5)
        self.p = nn.Parameter(torch.randn(5))

    def forward(self, x):
        f = torch.zeros(5, 5, dtype=x.dtype)
        v = f[:, 1]
        v.add_(self.p)
        f[:, 3:4].as_strided((5,), (5,), 1).mul_(3.0)  # column 1 again
        return self.l(x) * v


def test_a_later_write_through_as_strided_may_reach_any_earlier_write():
    with pytest.raises(fxdp.UnsupportedError, match="writes values computed from parameters in place"):
        fxdp.transform(WrittenAgainThroughAsStrided().double(), compiler="eager")(
            torch.randn(B, 4, dtype=torch.float64))


class ParameterWrittenAfterAView(nn.Module):
    """A parameter's values copied in place into a fresh tensor that a view taken before
    the write keeps from being rewritten as data flow, then used with the parameter by
    data flow too: the per-sample gradient mapped back through the ops would miss the
    write's part (it did, silently: 79 against the loop, with a wrong clipped gradient)."""

    def __init__(self, view_apart: bool = False):
        super().__init__()
        self.k = nn.Parameter(torch.rand(4, 2) + 0.5)
        self.view_apart = view_apart

    def forward(self, x):  # x [B, 1, 12]
        s = torch.zeros(4, 5, dtype=x.dtype)
        # (a view of columns the write does not reach keeps nothing from the rewrite)
        v = s[:, 1] if self.view_apart else s[:, :2][:, 1]
        s[:, 0] = self.k[:, 0]
        return F.conv1d(x, (s * self.k[:, 1:2] + v[:, None]).unsqueeze(1)).flatten(1)[:, :3]


class SlidingWeights(nn.Module):
    """spikingjelly's ``SlidingPSN.gen_gemm_weight``: each row of a fresh ``torch.zeros``
    matrix gets a window of the parameter through two views (``W[i][start:end] = w[...]``),
    then the matrix mixes the time steps of each sample (time-major input)."""

    def __init__(self, k: int = 2):
        super().__init__()
        self.k = k
        self.weight = nn.Parameter(torch.tensor([0.5, 1.0]))
        self.bias = nn.Parameter(torch.tensor(-0.3))
        self.head = nn.Linear(4, 3)

    def forward(self, x):  # x [T, B, 4]
        steps = x.shape[0]
        weight = torch.zeros([steps, steps], dtype=x.dtype)
        for i in range(steps):
            start = max(0, i + 1 - self.k)
            weight[i][start:i + 1] = self.weight[self.k - (i + 1 - start):self.k]
        h = torch.addmm(self.bias, weight, x.flatten(1)).view(x.shape)
        return self.head(torch.tanh(h)).sum(0)


@pytest.mark.parametrize("grad_sample", [True, False], ids=["grad_sample", "clip"])
def test_parameters_written_through_two_views_into_a_fresh_matrix_are_exact(grad_sample):
    """Refused before ("write into a tensor made from sizes alone ... before taking any
    other view of it", which this is): a write through a view of a view now becomes a
    write through the outer view."""
    torch.manual_seed(0)
    model = SlidingWeights().double()
    x = torch.randn(5, B, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (B,), generator=torch.Generator().manual_seed(1))
    ref = reference(model, (x,), lambda out, i: F.cross_entropy(out, y[i:i + 1], reduction="sum"), batch_dim=1)
    clip = float(ref.norms.median())
    dp = fxdp.transform(model, max_grad_norm=clip, grad_sample=grad_sample, loss_reduction="sum",
                        compiler="eager", batch_first=False)
    F.cross_entropy(dp(x), y, reduction="sum").backward()
    tol = tolerance(torch.float64)
    params = dict(model.named_parameters())
    assert_close_all({n: p.grad for n, p in params.items()}, ref.grad("sum", clip), tol, "grad")
    if grad_sample:
        assert_close_all({n: p.grad_sample for n, p in params.items()}, ref.per_sample, tol, "grad_sample")


def test_parameter_values_written_into_a_tensor_the_analysis_cannot_rewrite_are_refused():
    with pytest.raises(fxdp.UnsupportedError, match="writes values computed from parameters in place into a tensor"):
        fxdp.transform(ParameterWrittenAfterAView(), max_grad_norm=1.0, compiler="eager")(torch.randn(B, 1, 12))


def test_parameter_values_written_beside_a_view_they_do_not_reach_are_exact():
    """Refused before the fifty-ninth session: a view of other columns, taken before the
    write and read after it, kept the write in place."""
    torch.manual_seed(0)
    model = ParameterWrittenAfterAView(view_apart=True).double()
    dp = fxdp.transform(model, max_grad_norm=1.0, grad_sample=True, compiler="eager", loss_reduction="sum")
    for batch_size in (3, 5):
        x = torch.randn(batch_size, 1, 12, dtype=torch.float64)
        ref = reference(model, (x,), lambda out, i: out.pow(2).sum())
        model.zero_grad(set_to_none=True)
        dp(x).pow(2).sum().backward()
        assert_close_all({"k": model.k.grad_sample}, ref.per_sample, tolerance(torch.float64), "grad_sample")
        assert_close_all({"k": model.k.grad}, ref.grad("sum", 1.0), tolerance(torch.float64), "grad")


class AliasReadAfterASiblingWrite(nn.Module):
    """A column view read through an op that returns it itself, or copied by ``* 1.0``,
    then another view of the same memory written in place: eager's alias shows the
    write, the copy does not (red team: ``type_as`` to its own dtype was taken for a
    copy, ``* 1.0`` of a view for a no-op, each a wrong forward)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.fc, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        if self.how == "type_as":
            h = self.fc(x) * 1.0
            v = h[:, 1].type_as(x)  # the column itself
            h[:, 1].mul_(3)
            return self.head(h + v[:, None])
        h = self.fc(x)[:, None, :] + 0.0
        v = h[:, 0] * 1.0  # a copy (of the same layout as the row it copies)
        h[:, 0, :2].mul_(3)
        return self.head(v + h[:, 0])


@pytest.mark.parametrize("how", ["type_as", "a copy by one"])
def test_an_alias_or_a_copy_read_after_a_write_into_its_memory_is_exact(how):
    torch.manual_seed(0)
    model = AliasReadAfterASiblingWrite(how).double()
    plain = copy.deepcopy(model)
    x = torch.randn(B, 4, dtype=torch.float64)
    ref = reference(copy.deepcopy(plain), (x,), lambda out, i: out.pow(2).sum())
    dp = fxdp.transform(model, max_grad_norm=1.0, grad_sample=True, compiler="eager", loss_reduction="sum")
    out = dp(x)
    torch.testing.assert_close(out, plain(x), rtol=1e-12, atol=1e-12)  # (the forward itself)
    out.pow(2).sum().backward()
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                     tolerance(torch.float64), "grad_sample")


def test_out_of_place_weight_surgery_is_exact():
    """The refusal's advice, ``w = w * mask``, works."""

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.register_buffer("mask", (torch.arange(4) >= 2).double())

        def forward(self, x):
            return F.linear(x, self.fc.weight * self.mask, self.fc.bias).mean(1)

    torch.manual_seed(0)
    _check(Masked().double(), torch.randn(B, 2, 4, dtype=torch.float64), grad_sample=True)


class MaskedColumns(nn.Module):
    """``y[:, mask] = value``: a boolean mask over features, the value a number or the
    parameter's masked entries. On a batch of symbolic size (and, with the parameter's
    masked entries, of any size) Dynamo writes it into the whole slice ``y[0:]``."""

    def __init__(self, from_parameter: bool):
        super().__init__()
        self.from_parameter = from_parameter
        self.p = nn.Parameter(torch.randn(4), requires_grad=from_parameter)
        self.register_buffer("mask", torch.tensor([True, False, True, False]))
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        y = self.fc(x)
        y[:, self.mask] = self.p[self.mask] if self.from_parameter else 0.0
        return self.head(torch.tanh(y))


@pytest.mark.parametrize("from_parameter", [False, True], ids=["number", "parameter"])
def test_masked_columns_written_over_batch_sizes(from_parameter):
    torch.manual_seed(0)
    model = MaskedColumns(from_parameter).double()
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    for size in (B, B + 1, B + 3):
        x = torch.randn(size, 4, dtype=torch.float64)
        ref = reference(model, (x,), lambda out, i: out.pow(2).sum())
        for p in model.parameters():
            p.grad = None
        dp(x).pow(2).sum().backward()
        assert_close_all({n: p.grad_sample for n, p in model.named_parameters() if p.requires_grad},
                         ref.per_sample, tolerance(torch.float64), f"grad_sample at {size}")


class ClampedInTheForward(nn.Module):
    """A weight clamped in place under ``no_grad`` in the forward (a constraint applied
    where it should be applied after the optimizer step)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        with torch.no_grad():
            self.fc.weight.clamp_(-0.5, 0.5)
        return self.fc(x)


@pytest.mark.parametrize("batch_size", [B, 1])
def test_a_parameter_written_in_the_forward_is_refused_at_any_batch_size(batch_size):
    with pytest.raises(fxdp.UnsupportedError, match="change the parameter between steps"):
        fxdp.transform(ClampedInTheForward(), compiler="eager")(torch.randn(batch_size, 4)).sum().backward()


class MovedWhereItIs(nn.Module):
    """st-moe's ``Experts``: its submodules moved to the input's device in every forward
    (Dynamo traces each parameter's ``p.data = p.to(device)`` as ``set_(p, p)``)."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        self.fc.to(x.device)
        return self.head(torch.tanh(self.fc(x)))


class DataSetToItself(MovedWhereItIs):
    """pytorch-metric-learning's cast of a loss's class matrix, ``W.data =
    to_device(W.data, ...)``, which returns the same tensor: ``set_(W, detach(W))``."""

    def forward(self, x):
        self.head.weight.data = self.head.weight.data
        return self.head(torch.tanh(self.fc(x)))


@pytest.mark.parametrize("grad_sample", [True, False], ids=["grad_sample", "clip"])
@pytest.mark.parametrize("model", [MovedWhereItIs, DataSetToItself], ids=["moved", "data_set_to_itself"])
def test_a_module_moved_where_it_already_is_is_no_write(model, grad_sample):
    torch.manual_seed(0)
    _check(model().double(), torch.randn(B, 4, dtype=torch.float64), grad_sample)


class RepeatedThenWritten(nn.Module):
    """stanza's relative attention: copies of a size-1 dim (a ``repeat``, which
    canonicalisation reads as an expand) written into in place afterwards."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):  # [B, T, 4]
        q = self.fc(x).unsqueeze(3).repeat(1, 1, 1, 3)
        q[..., 1:] = q[..., 1:] * 0.5
        return q.sum((1, 2))  # [B, 3]


@pytest.mark.parametrize("grad_sample", [True, False], ids=["grad_sample", "clip"])
def test_copies_of_a_size_one_dim_written_in_place(grad_sample):
    """Crashed before ("more than one element of the written-to tensor refers to a
    single memory location"): the copy was moved above the expand."""
    torch.manual_seed(0)
    _check(RepeatedThenWritten().double(), torch.randn(B, 3, 4, dtype=torch.float64), grad_sample)


class CachedAngles(nn.Module):
    """rotary-embedding-torch's cache: the first call computes the angles and writes them
    into a buffer, remembering their length in a Python attribute; the second call reads
    them back. Each sample alone fills the cache afresh (the reference loop runs each on
    a fresh copy of the model)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("cache", torch.zeros(16, 3), persistent=False)
        self.cached = 0

    def angles(self, n: int) -> torch.Tensor:
        if n <= self.cached:
            return self.cache[:n].detach()
        angles = torch.arange(n, dtype=self.cache.dtype)[:, None] * torch.ones(3, dtype=self.cache.dtype) + 1.0
        self.cache[:n] = angles.detach()
        self.cached = n
        return angles

    def forward(self, x):  # [B, n, 4]
        h = self.fc(x)
        return h * self.angles(x.shape[1]).cos() + h.flip(-1) * self.angles(x.shape[1]).sin()


def test_a_cache_written_then_read_in_one_forward():
    torch.manual_seed(0)
    model = CachedAngles().double()
    x = torch.randn(B, 5, 4, dtype=torch.float64)
    ref = reference(model, (x,), lambda out, i: out.sin().pow(2).sum())
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    dp(x).sin().pow(2).sum().backward()
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                     tolerance(torch.float64), "grad_sample")


class BufferUpdatedTwice(nn.Module):
    """A buffer updated by successive in-place ops in one forward (an EMA written
    ``buf.mul_(d).add_(v)``, a step counter), read through a view taken before."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(4, 3)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x):
        s = self.scale.view(1, 3)
        with torch.no_grad():
            if self.how == "chained":
                self.scale.mul_(0.5).add_(1.0)
            elif self.how == "statements":
                self.scale.add_(1.0)
                self.scale.mul_(0.5)
            else:  # three
                for _ in range(3):
                    self.scale.mul_(0.5)
        return self.lin(x) * s


@pytest.mark.parametrize("how,after", [("chained", 1.5), ("statements", 1.0), ("three", 0.125)])
def test_every_in_place_update_of_a_buffer_is_kept(how, after):
    """Every write lands in the buffer, and the view read after them sees the last one
    (the second write was dropped: a wrong buffer, output and per-sample gradient)."""
    torch.manual_seed(0)
    model = BufferUpdatedTwice(how).double()
    x = torch.randn(B, 4, dtype=torch.float64)
    ref = reference(model, [x], lambda out, i: out.pow(2).sum())
    dp_model = fxdp.transform(model, grad_sample=True, compiler="eager")
    dp_model(x).pow(2).sum(1).mean().backward()
    assert model.scale.tolist() == [after] * 3
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                     tolerance(torch.float64), "grad_sample")


def test_a_batch_statistic_written_by_a_second_in_place_op_is_refused():
    """An EMA of a batch statistic (VQ-VAE's codebook) puts the other samples' data into
    every sample's next forward: refused however its writes are chained."""

    class EmaCount(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)
            self.register_buffer("count", torch.zeros(3))

        def forward(self, x):
            h = self.lin(x)
            with torch.no_grad():
                self.count.mul_(0.9).add_(h.softmax(-1).sum(0), alpha=0.1)
            return h

    x = torch.randn(B, 4, dtype=torch.float64)
    with pytest.raises(fxdp.UnsupportedError, match="reduces over the batch dim"):
        fxdp.transform(EmaCount().double(), max_grad_norm=1.0, compiler="eager")(x)


class WrittenUnderNoGrad(nn.Module):
    """An activation written in place under ``torch.no_grad()``: the values change, the
    gradient passes through the write to the layer that made it (as in eager)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 3)

    def forward(self, x):
        h = self.l1(x)
        with torch.no_grad():
            if self.how == "mul":
                h.mul_(0.5)
            elif self.how == "clamp":
                h.clamp_(-0.3, 0.3)
            elif self.how == "copy":
                h.copy_(torch.round(h * 4) / 4)
            else:  # a column, through a view
                h[:, 0].zero_()
        return self.l2(h)


@pytest.mark.parametrize("how", ["mul", "clamp", "copy", "column"])
def test_a_write_under_no_grad_keeps_the_gradient_path(how):
    """Made out of place, the write's result was computed without grad and cut the path:
    ``l1`` got no gradient and its share of the norms was missing (the clipped
    gradients of the others were wrong)."""
    torch.manual_seed(0)
    model = WrittenUnderNoGrad(how).double()
    x = torch.randn(B, 4, dtype=torch.float64)
    ref = reference(model, [x], lambda out, i: out.pow(2).sum())
    max_grad_norm = ref.norms.median().item()
    dp_model = fxdp.transform(model, grad_sample=True, max_grad_norm=max_grad_norm, compiler="eager")
    dp_model(x).pow(2).sum(1).mean().backward()
    tol = tolerance(torch.float64)
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample, tol, "grad_sample")
    assert_close_all({n: p.grad for n, p in model.named_parameters()}, ref.grad("mean", max_grad_norm), tol,
                     "p.grad")


class ViewWrittenThenBase(nn.Module):
    """A slice written in place, then the whole tensor: the slice read afterwards sees
    both writes."""

    def __init__(self, fresh: bool):
        super().__init__()
        self.fresh = fresh
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(3, 3)

    def forward(self, x):
        h = x.clone() if self.fresh else self.l1(x)
        s = h[:, 1:]
        s.mul_(2)
        h.add_(1)
        return self.l2(s * self.l1(x)[:, 1:])


@pytest.mark.parametrize("fresh", [False, True], ids=["activation", "clone_of_the_input"])
def test_a_view_written_then_its_base_written_reads_both_writes(fresh):
    torch.manual_seed(0)
    model = ViewWrittenThenBase(fresh).double()
    x = torch.randn(B, 4, dtype=torch.float64)
    ref = reference(model, [x], lambda out, i: out.pow(2).sum())
    dp_model = fxdp.transform(model, grad_sample=True, compiler="eager")
    out = dp_model(x)
    assert torch.allclose(out, model(x))
    out.pow(2).sum(1).mean().backward()
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                     tolerance(torch.float64), "grad_sample")


class WritesIntoItsInput(nn.Module):
    """``x[:, idx] = v`` or ``x[x > 1] = 0`` into the input itself (an in-place
    ``index_put_``, which keeps samples apart)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.l1 = nn.Linear(4, 3)
        self.register_buffer("idx", torch.tensor([2, 0]))

    def forward(self, x):
        if self.how == "index":
            x[:, self.idx] = 0.25
        else:
            x[x > 1.0] = 0.0
        return self.l1(x)


@pytest.mark.parametrize("how", ["index", "mask"])
def test_index_put_into_the_input_is_exact(how):
    torch.manual_seed(0)
    model = WritesIntoItsInput(how).double()
    x = torch.randn(B, 4, dtype=torch.float64) * 2
    ref = reference(model, [x.clone()], lambda out, i: out.pow(2).sum())
    dp_model = fxdp.transform(model, grad_sample=True, compiler="eager")
    given = x.clone()
    dp_model(given).pow(2).sum(1).mean().backward()
    expected = x.clone()
    model(expected)
    assert torch.equal(given, expected), "the write lands in the caller's tensor, as in eager"
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                     tolerance(torch.float64), "grad_sample")


class WrittenPiece(nn.Module):
    """An in-place write through a piece of ``split``/``chunk``/``unbind`` (an activation's
    under ``no_grad``, a clone of the input's, a buffer's)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.l1 = nn.Linear(6, 6)
        self.l2 = nn.Linear(6, 3)
        self.register_buffer("scale", torch.ones(4, 6))

    def forward(self, x):  # x [B, 4, 6]
        if self.how == "chunk_of_a_clone":
            h = x.clone()
            h.chunk(2, dim=1)[1].mul_(0.5)
            h = self.l1(h)
        else:
            h = self.l1(x)
            with torch.no_grad():
                if self.how == "split_under_no_grad":
                    h.split([1, 3], dim=1)[1][:, 1:].mul_(0.5)  # a view of a piece
                elif self.how == "unbind_under_no_grad":
                    h.unbind(1)[3].mul_(0.5)
                else:  # a buffer's piece, then read through the buffer
                    self.scale.chunk(2, dim=0)[0].mul_(0.5)
            h = h * self.scale
        return self.l2(h)


@pytest.mark.parametrize("how", ["chunk_of_a_clone", "split_under_no_grad", "unbind_under_no_grad", "buffer_chunk"])
def test_a_write_into_a_piece_of_split_chunk_or_unbind_is_kept(how):
    """The piece comes out through ``getitem``, which the in-place handling did not follow
    to its base: the write was dropped (forward output up to 0.49 off eager's, the
    per-sample gradients 2.3 off, a buffer never updated). Forward, buffer and gradients
    now as in eager and the microbatch loop."""
    torch.manual_seed(0)
    model = WrittenPiece(how).double()
    x = torch.randn(B, 4, 6, dtype=torch.float64)
    eager = WrittenPiece(how).double()
    eager.load_state_dict(model.state_dict())
    ref = reference(model, [x], lambda out, i: out.pow(2).sum())
    dp_model = fxdp.transform(model, grad_sample=True, compiler="eager")
    out = dp_model(x)
    torch.testing.assert_close(out, eager(x))
    torch.testing.assert_close(model.scale, eager.scale)
    out.pow(2).sum((1, 2)).mean().backward()
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                     tolerance(torch.float64), "grad_sample")


class FilledByOutArgument(nn.Module):
    """``torch.op(..., out=o)`` into a fresh tensor: ``view`` reads ``o`` through a view
    taken before the write."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.l1 = nn.Linear(6, 6)
        self.register_buffer("b", torch.randn(6))

    def forward(self, x):  # x [B, 6]
        if self.how == "stale_view":
            o = torch.zeros(x.shape[0], 6, dtype=x.dtype)
            v = o[:, :]
            torch.add(x, self.b, out=o)
            return self.l1(x * v.mean(0))  # the whole batch's mean: mixes samples
        o = torch.empty(x.shape[0], 12 if self.how == "cat" else 6, dtype=x.dtype)
        if self.how == "cat":
            torch.cat([x, x * 2], dim=1, out=o)
            o = o[:, :6] + o[:, 6:]
        elif self.how == "mm":
            torch.mm(x, self.b.expand(6, 6).contiguous(), out=o)
        else:
            torch.add(x, self.b, out=o)
        return self.l1(o)


@pytest.mark.parametrize("how", ["add", "cat", "mm"])
def test_an_out_argument_is_written_as_a_copy(how):
    """``cat.out``/``mm.out`` were refused for want of a batch propagation; as their
    functional form and a copy into ``out`` they are exact."""
    torch.manual_seed(0)
    model = FilledByOutArgument(how).double()
    x = torch.randn(B, 6, dtype=torch.float64)
    ref = reference(model, [x], lambda out, i: out.pow(2).sum())
    fxdp.transform(model, grad_sample=True, compiler="eager")(x).pow(2).sum(1).mean().backward()
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                     tolerance(torch.float64), "grad_sample")


def test_a_view_read_after_an_out_argument_filled_it_is_refused():
    """The view taken before ``torch.add(..., out=o)`` reads the batch's data after it:
    ``o.copy_`` was refused so, ``out=`` accepted, with gradients 20 off."""
    model = FilledByOutArgument("stale_view").double()
    with pytest.raises(fxdp.UnsupportedError, match="it is read after the write; take the view after the write"):
        fxdp.transform(model, grad_sample=True, compiler="eager")(torch.randn(B, 6, dtype=torch.float64))


class MaskedFillByAParameter(nn.Module):
    """``h[h > 0.5] = self.s``: a per-sample boolean mask, a trainable value."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor(0.3))
        self.l1 = nn.Linear(6, 3)

    def forward(self, x):
        h = x.clone()
        h[h > 0.5] = self.s
        return self.l1(h)


def test_a_masked_fill_by_a_parameter_is_exact():
    """As ``torch.where(mask, s, h)``: it failed with vmap's "cannot batch indexing with a
    boolean mask" from the per-sample VJP of ``s``."""
    torch.manual_seed(0)
    model = MaskedFillByAParameter().double()
    x = torch.randn(B, 6, dtype=torch.float64)
    ref = reference(model, [x], lambda out, i: out.pow(2).sum())
    fxdp.transform(model, grad_sample=True, compiler="eager")(x).pow(2).sum(1).mean().backward()
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                     tolerance(torch.float64), "grad_sample")
    assert ref.per_sample["s"].abs().min() > 0


class MaskTokenAtMaskedPositions(nn.Module):
    """BERT/MAE's ``x[mask] = self.mask_token``: a per-sample boolean mask of the
    leading dims ``[B, T]``, a trainable token for every position it selects (of the
    token's width, or one value broadcast over it, or the leading dims ``[B, T, H, w]``
    masked as ``[B, T]``)."""

    def __init__(self, token_shape: tuple[int, ...], heads: int = 0):
        super().__init__()
        self.heads = heads
        self.mask_token = nn.Parameter(torch.randn(token_shape))
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        h = x.clone() if not self.heads else x.unflatten(-1, (self.heads, -1)).clone()
        h[x.detach()[..., 0] > 0.3] = self.mask_token
        return self.lin(h.flatten(2)).mean(1)


@pytest.mark.parametrize("token_shape, heads", [((6,), 0), ((1,), 0), ((), 0), ((3,), 2), ((2, 1), 2)],
                         ids=["token", "one-value", "scalar", "per-head-token", "per-head-value"])
def test_a_mask_token_at_masked_positions_is_exact(token_shape, heads):
    """As ``torch.where(mask[..., None], token, h)``: the per-sample VJP of the token
    failed with vmap's "cannot batch indexing with a boolean mask"."""
    model = MaskTokenAtMaskedPositions(token_shape, heads).double()
    assert_exact_at_two_batch_sizes(model, fxdp.transform(model, grad_sample=True, compiler="eager"), 5, 6)


class FilledOverMergedRows(nn.Module):
    """A tensor made for the batch merged with the sequence, ``[B·T, n]``, filled column
    block by column block: by hand, or ``nn.AdaptiveLogSoftmaxWithLoss.log_prob`` on
    the flattened tokens (a language model's adaptive softmax)."""

    def __init__(self, adaptive: bool):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.adaptive = adaptive
        if adaptive:
            self.out = nn.AdaptiveLogSoftmaxWithLoss(6, 8, cutoffs=[3, 5], div_value=2.0)
        else:
            self.out = nn.Linear(6, 3)

    def forward(self, x):  # [B, T, 6]
        flat = self.lin(x).reshape(-1, 6)
        if self.adaptive:
            return self.out.log_prob(flat).reshape(x.shape[0], -1)
        out = flat.new_empty((flat.shape[0], 5))
        out[:, :3] = self.out(flat)
        out[:, 3:] = flat[:, :2]
        return out.reshape(x.shape[0], -1)


@pytest.mark.parametrize("adaptive", [False, True], ids=["by-hand", "adaptive-log-softmax"])
def test_a_tensor_of_merged_rows_filled_in_place_is_exact(adaptive):
    """The write gave the filled tensor a batch dim of ``B`` rows, dropping the merged
    sequence, and its next slice was refused ("its output's batch dim has 15 rows where
    the batch has 3")."""
    torch.manual_seed(0)
    model = FilledOverMergedRows(adaptive).double()
    assert_exact_at_two_batch_sizes(model, fxdp.transform(model, grad_sample=True, compiler="eager"), 5, 6)


def assert_exact_at_two_batch_sizes(model: nn.Module, call, *shape: int) -> None:
    """``call`` (``model`` made per-sample) gives ``model``'s output and, for the trainable
    parameters, the reference's per-sample gradients, at batch sizes ``B`` and ``B + 1``."""
    for size in (B, B + 1):
        x = torch.randn(size, *shape, dtype=torch.float64)
        ref = reference(model, [x], lambda out, i: out.pow(2).sum())
        out = call(x)
        torch.testing.assert_close(out, model(x))
        out.pow(2).sum(1).mean().backward()
        assert_close_all({n: p.grad_sample for n, p in model.named_parameters() if p.requires_grad},
                         ref.per_sample, tolerance(torch.float64), "grad_sample")
        model.zero_grad()


class IndexFilledByAParameter(nn.Module):
    """``h.index_fill_(1, idx, self.s)`` with the indices a buffer, one repeated."""

    def __init__(self, in_place: bool):
        super().__init__()
        torch.manual_seed(0)
        self.in_place = in_place
        self.l1, self.l2 = nn.Linear(6, 6), nn.Linear(6, 3)
        self.s = nn.Parameter(torch.tensor(0.3))
        self.register_buffer("idx", torch.tensor([2, 0, 4, 2]))

    def forward(self, x):
        h = self.l1(x)
        h = h.index_fill_(1, self.idx, self.s) if self.in_place else h.index_fill(1, self.idx, self.s)
        return self.l2(h)


@pytest.mark.parametrize("wrapped", ["transform", "backend"])
@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "out_of_place"])
def test_an_index_fill_by_a_parameter_is_exact(in_place, wrapped):
    """As ``torch.where`` over the filled positions: under the backend, where the indices
    are a graph input, the per-sample VJP of ``s`` failed on ATen's ``_unique`` of them
    (a size that depends on the data)."""
    model = IndexFilledByAParameter(in_place).double()
    call = (fxdp.transform(model, grad_sample=True, compiler="eager") if wrapped == "transform"
            else torch.compile(model, backend=fxdp.backend(grad_sample=True, compiler="eager")))
    assert_exact_at_two_batch_sizes(model, call, 6)


class WrittenAtSharedRows(nn.Module):
    """``h[arange(B)[:, None], idx.expand(B, 3)] = v``: each sample writes a trainable
    value at its own row, with a shared index tensor that has a row per sample."""

    def __init__(self, form: str):
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.v = nn.Parameter(torch.randn(3))
        self.l1, self.l2 = nn.Linear(6, 6), nn.Linear(6, 3)
        self.register_buffer("idx", torch.tensor([2, 0, 4]))

    def forward(self, x):
        size = x.shape[0]
        h, rows = self.l1(x), torch.arange(size)[:, None]
        if self.form == "expand":
            h[rows, self.idx.expand(size, 3)] = self.v
        elif self.form == "repeat":
            h[rows, self.idx.repeat(size, 1)] = self.v
        else:
            h.index_put_((rows.expand(size, 3), self.idx.expand(size, 3)), self.v.expand(size, 3), accumulate=True)
        return self.l2(torch.tanh(h))


@pytest.mark.parametrize("form", ["expand", "repeat", "accumulate"])
def test_a_write_at_rows_of_a_shared_index_with_a_row_per_sample_is_exact(form):
    """Sample ``b`` writes at row ``b`` of the shared index: the per-sample VJP ran each
    sample's op with every row, so each sample's gradient of ``v`` was the batch's sum
    (``B`` times its own where the samples agree), and the clipped gradient and the
    norms were wrong with it."""
    model = WrittenAtSharedRows(form).double()
    for options in ({"grad_sample": True}, {"max_grad_norm": 0.5}):
        dp = fxdp.transform(model, compiler="eager", **options)
        for size in (B, B + 1):
            x = torch.randn(size, 6, dtype=torch.float64)
            ref = reference(model, [x], lambda out, i: out.pow(2).sum())
            model.zero_grad()
            dp(x).pow(2).sum(1).mean().backward()
            got = ({n: p.grad_sample for n, p in model.named_parameters()} if "grad_sample" in options
                   else {n: p.grad for n, p in model.named_parameters()})
            want = ref.per_sample if "grad_sample" in options else ref.grad("mean", 0.5)
            assert_close_all(got, want, tolerance(torch.float64), str(options))
            if "max_grad_norm" in options:
                assert_close_all({"norms": dp.per_sample_norms}, {"norms": ref.norms}, tolerance(torch.float64),
                                 "per_sample_norms")


class ScatterMeanOfAParameter(nn.Module):
    """``h.scatter_reduce_(1, y, v.expand(B, 3), "mean", include_self=False)``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = nn.Linear(6, 6), nn.Linear(6, 3)
        self.v = nn.Parameter(torch.randn(3))

    def forward(self, x, y):
        h = self.l1(x)
        h.scatter_reduce_(1, y, self.v.expand(x.shape[0], 3), "mean", include_self=False)
        return self.l2(torch.tanh(h))


def test_a_write_in_a_per_sample_vjp_is_compiled_right_by_inductor():
    """The per-sample VJP of ``v`` traces ATen's backward of the mean, with its in-place
    ``masked_fill_`` of the counts, into the rewritten backward; Inductor, on one thread,
    compiled that write wrong (the counts one too large: ``v``'s per-sample gradients
    0.3 off). The rewritten backward is now functionalised where it writes in place."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = ScatterMeanOfAParameter().double()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 4, (3, 3), generator=g)
        ref = reference(model, [x, y], lambda out, i: out.pow(2).sum())
        fxdp.transform(model, grad_sample=True, compiler="inductor")(x, y).pow(2).sum(1).mean().backward()
        assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                         tolerance(torch.float64), "grad_sample")
    finally:
        torch.set_num_threads(threads)


class CopiedFromAParameter(nn.Module):
    """``h[:, 1:3].copy_(self.w)``: a trainable value broadcast into every sample's rows."""

    def __init__(self, value: str):
        super().__init__()
        torch.manual_seed(0)
        self.value = value
        self.l1, self.l2 = nn.Linear(6, 6), nn.Linear(6, 3)
        self.w, self.s = nn.Parameter(torch.randn(6)), nn.Parameter(torch.tensor(0.4))

    def forward(self, x):
        h = self.l1(x)  # [B, 4, 6]
        if self.value == "row":
            h[:, 1:3].copy_(self.w)
        else:
            h[:, ::2].copy_(self.s)
        return self.l2(h).mean(1)


@pytest.mark.parametrize("wrapped", ["transform", "backend"])
@pytest.mark.parametrize("value", ["row", "scalar"])
def test_a_copy_of_a_parameter_into_a_slice_of_the_batch_is_exact(value, wrapped):
    """The per-sample VJP ran ATen's ``aten.copy``, which has no derivative: a raw
    "derivative for aten::copy is not implemented". It runs ``copy_``'s values out of
    place instead."""
    model = CopiedFromAParameter(value).double()
    model.requires_grad_(True)
    (model.s if value == "row" else model.w).requires_grad_(False)
    call = (fxdp.transform(model, grad_sample=True, compiler="eager") if wrapped == "transform"
            else torch.compile(model, backend=fxdp.backend(grad_sample=True, compiler="eager")))
    assert_exact_at_two_batch_sizes(model, call, 4, 6)


class ChangedThroughAMask(nn.Module):
    """``h[x > 0] *= 2`` and ``h[h > 0] += self.s``: read-modify-writes through a
    per-sample boolean mask."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = nn.Linear(6, 6), nn.Linear(6, 3)
        self.s = nn.Parameter(torch.tensor(0.3))

    def forward(self, x):
        h = self.l1(x)
        h[x > 0] *= 2.0
        h[h > 0] += self.s
        return self.l2(torch.tanh(h))


def test_a_read_modify_write_through_a_mask_is_exact():
    """``where(mask, f(h), h)``: the read ``h[mask]`` flattens the samples' selections
    into one list, and was refused, though each sample's elements stay its own."""
    model = ChangedThroughAMask().double()
    assert_exact_at_two_batch_sizes(model, fxdp.transform(model, grad_sample=True, compiler="eager"), 6)


class PiecewiseThroughAMask(nn.Module):
    """``out[m] = f(h[m])``: elementwise functions of the elements a per-sample boolean
    mask selects, written back by the same mask (nflows' ``LogTanh`` and the tails of its
    spline flows). The read flattens every sample's elements into one list; written back
    by the same mask, each element returns to its own place. Ops along the selected rows
    (a spline's bins) keep them apart too, and so does a parameter's use, which runs on
    the rows put back in place (``test_masked_rows.py``); anything that moves the list's
    dim or meets other samples' elements does not."""

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.l1, self.l2 = nn.Linear(6, 6), nn.Linear(6, 3)
        self.s = nn.Parameter(torch.tensor(0.3))
        if kind == "end knots of a shared spline":  # its bins shared by all samples (nflows' unconditional ones)
            self.w = nn.Parameter(torch.randn(2, 3))

    def forward(self, x):  # x [B, 6]
        h = self.l1(x)
        out = torch.zeros_like(h)
        if self.kind == "both sides":  # ``~m`` written twice: two nodes computing one mask
            m = h > 0.2
            out[m] = torch.log(h[m]) + 0.5
            out[~m] = torch.tanh(h[~m])
        elif self.kind == "two tensors, one mask":  # spline parameters selected like the inputs
            m = x.abs() < 1.0
            widths = torch.sigmoid(self.l1(x.flip(-1)))
            out[m] = h[m] * widths[m] + torch.exp(-h[m].pow(2))
        elif self.kind == "rows":  # a mask over [B, 2] of h viewed as [B, 2, 3]; shared values along the rows
            h3, out3 = h.view(-1, 2, 3), out.view(-1, 2, 3)
            m = h3[..., 0] > 0
            out3[m] = torch.sigmoid(h3[m]) * torch.arange(3, dtype=h.dtype)
        elif self.kind in ("rows of bins", "cumulative bins", "cumulative product", "rows turned"):
            # a spline's bins per selected element (normflows' and nflows' rational-quadratic
            # splines inside their interval): ops along the bins keep each row its sample's
            m = x[:, :2].abs() < 1.0
            bins = h.view(-1, 2, 3)[m]  # [N, 3]
            widths = F.pad(torch.softmax(bins, -1), (1, 0))  # [N, 4]
            if self.kind == "cumulative bins":  # the spline's knots
                widths = widths.cumsum(-1)
            elif self.kind == "cumulative product":
                widths = widths.cumprod(-1)
            elif self.kind == "rows turned":  # the list's dim moved: rows no longer along dim 0
                widths = widths.t().contiguous().t()
            position = x[:, 2:4][m]
            k = (position[:, None] > widths).sum(-1, keepdim=True).clamp(max=3)
            inside = torch.zeros_like(x[:, :2])
            inside[m] = widths.gather(-1, k)[:, 0] * position + widths.amax(-1)
            out = out + F.pad(inside, (0, 4))
        elif self.kind == "a parameter on the list":
            m = h > 0.2
            out[m] = h[m] * self.s
        elif self.kind in ("end knots", "end knots of a parameter", "end knots of a shared spline", "a count as a knot",
                           "end knots of a parameter, then all in place",
                           "end knots of a parameter, then all in place, read through their view"):
            # normflows' rational-quadratic spline: its end knots written as Python numbers,
            # cumwidths[..., 0] = left, into the bins of the elements inside the interval
            m = x[:, :2].abs() < 1.0
            bins = (self.w[None].expand(x.shape[0], 2, 3) if self.kind == "end knots of a shared spline"
                    else h.view(-1, 2, 3))[m]
            knots = 2.0 * torch.softmax(bins, -1)  # [N, 3], a fresh tensor
            end = knots[..., 0]
            if self.kind.startswith("end knots of a parameter"):
                end.copy_(self.s * 3)  # knots[..., 0] = self.s * 3
            elif self.kind == "a count as a knot":
                knots[..., 0] = knots.shape[0]
            else:
                knots[..., 0] = -1.0
            knots[:, 2:] = 1.0
            if self.kind.startswith("end knots of a parameter, then all in place"):
                knots += 1.0
            if not self.kind.endswith("read through their view"):
                end = knots[:, 0]
            inside = torch.zeros_like(x[:, :2])
            inside[m] = knots[:, 1] * h[:, 2:4][m] + end + knots[:, 2]
            out = out + F.pad(inside, (0, 4))
        elif self.kind == "a sum of the list":
            m = h > 0.2
            out = h + h[m].sum()
        elif self.kind == "two masks":
            m = h > 0.2
            out[m] = h[m] + h[h > 0.1][:1]
        return self.l2(torch.tanh(out + self.s))


@pytest.mark.parametrize("kind", ["both sides", "two tensors, one mask", "rows", "rows of bins", "cumulative bins",
                                  "a parameter on the list", "end knots", "end knots of a parameter",
                                  "end knots of a shared spline", "end knots of a parameter, then all in place"])
def test_an_elementwise_function_of_masked_elements_written_back_by_the_mask(kind):
    """(The end knots, a number written into the selected rows, were refused before the
    sixty-third session: the write was canonicalised as an expand of the number to the
    rows' data-dependent count, "it takes how many elements a boolean mask selected
    … as a size"; a helper's sweep of normflows' neural spline flows. Their parameter
    written, then all the knots in place, was refused until the sixty-fourth session:
    the first write stayed in place because the base was written again, although no
    read of its view came after.)"""
    model = PiecewiseThroughAMask(kind).double()
    assert_exact_at_two_batch_sizes(model, fxdp.transform(model, grad_sample=True, compiler="eager"), 6)


def test_a_cumulative_product_over_masked_rows_is_a_limit_of_aot_autograd():
    """cumprod along the bins of the selected rows keeps samples apart, but PyTorch's
    cumprod backward guards on the list's data-dependent length, so AOTAutograd (plain
    ``torch.compile`` too) cannot trace the backward: a refusal that says so. (fxdp
    writes a cumsum there as sums over a triangle of ones, which it can.)"""
    model = PiecewiseThroughAMask("cumulative product").double()
    dp_model = fxdp.transform(model, grad_sample=True, compiler="eager")
    with pytest.raises(fxdp.UnsupportedError, match="AOTAutograd cannot trace this model's backward"):
        dp_model(torch.randn(B, 6, dtype=torch.float64)).pow(2).sum().backward()


@pytest.mark.parametrize("kind, reason", [
    ("a sum of the list", "a reduction over the batch (the loss, or a statistic of the batch) is used"),
    ("two masks", "a boolean mask over the batch dim selected"),
    ("rows turned", "a boolean mask over the batch dim selected"),
    ("a count as a knot", "it computes with how many elements a boolean mask selected"),
    # (accepted, and wrong, before the sixty-third session: the write of the parameter ran
    # on the rows put back in place, and never reached the list the later write changed)
    ("end knots of a parameter, then all in place, read through their view",
     "it writes in place with a parameter into the elements"),
])
def test_masked_elements_that_meet_other_samples_are_refused(kind, reason):
    problems = fxdp.validate(PiecewiseThroughAMask(kind).double(), torch.randn(B, 6, dtype=torch.float64))
    assert any(reason in p.reason for p in problems), problems


class UnusedInPlaceResults(nn.Module):
    """In-place calls whose results the forward drops (``h.add_(b)``, ``F.relu(h,
    inplace=True)``), after a block that fxdp's capture rewrites first: an activation
    checkpoint, or a recurrent layer or cell without an initial state."""

    def __init__(self, before: str):
        super().__init__()
        self.before = before
        self.layer = {"checkpoint": lambda: nn.Linear(4, 3), "gru": lambda: nn.GRU(4, 3, batch_first=True),
                      "lstm_cell": lambda: nn.LSTMCell(4, 3)}[before]()
        self.b = nn.Parameter(torch.randn(3))

    def forward(self, x):
        if self.before == "checkpoint":
            h = torch.utils.checkpoint.checkpoint(self.layer, x[:, -1], use_reentrant=False)
        elif self.before == "gru":
            h = self.layer(x)[0][:, -1]
        else:
            h = self.layer(x[:, -1])[0]
        h.add_(self.b)
        F.relu(h, inplace=True)
        return h


@pytest.mark.parametrize("before", ["checkpoint", "gru", "lstm_cell"])
def test_in_place_calls_whose_results_go_unused_are_kept(before):
    """FX's dead-code elimination takes an in-place call on a Dynamo graph whose result
    goes unused for dead: after a rewrite of the captured graph that cleaned up with it,
    the writes vanished, silently (another forward, ``b`` without a gradient, the other
    per-sample gradients off by up to 1.1)."""
    torch.manual_seed(0)
    _forward_and_grad_sample_as_the_loop(UnusedInPlaceResults(before).double(),
                                         torch.randn(B, 5, 4, dtype=torch.float64))


def _forward_and_grad_sample_as_the_loop(model: nn.Module, x: torch.Tensor) -> None:
    """The forward as eager's, and the per-sample gradients of ``Σ out²`` as the loop's."""
    with torch.no_grad():
        expected = model(x)
    ref = reference(model, [x], lambda out, i: out.pow(2).sum())
    dp_model = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    out = dp_model(x)
    assert_close_all({"out": out}, {"out": expected}, tolerance(torch.float64), "forward")
    out.pow(2).sum().backward()
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                     tolerance(torch.float64), "grad_sample")


class InPlaceViews(nn.Module):
    """In-place view ops (``transpose_``, ``swapdims_``, ``squeeze_``) on computed tensors,
    and ``torch.quantile``, whose ATen code ends in ``transpose_``/``squeeze_`` on its
    result; the quantiles a buffer or a parameter."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.fc = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)
        q = torch.tensor([0.2, 0.5, 0.9])
        if how == "quantile, learned quantiles":
            self.q = nn.Parameter(q)
        else:
            self.register_buffer("q", q)

    def forward(self, x):  # x [B, 6]
        h = self.fc(x)
        if self.how == "transpose_":
            h = (h.view(-1, 2, 3) * 2).transpose_(1, 2).flatten(1)
        elif self.how == "swapdims_ and squeeze_":
            g = (h.view(-1, 1, 2, 3) * 2).squeeze_(1)
            g.swapdims_(1, 2)
            h = g.flatten(1)
        else:  # quantiles of each sample's features, one column each
            h = torch.cat([h[:, :3], torch.quantile(h, self.q, dim=1).T], 1)
        return self.head(h)


@pytest.mark.parametrize("how", ["transpose_", "swapdims_ and squeeze_", "quantile", "quantile, learned quantiles"])
def test_in_place_view_ops_are_views(how):
    """``aten.transpose_.default``'s out-of-place twin is ``aten.transpose.int``: the
    overload names differ, the twin was not found, the op stayed in place and had no
    batch propagation, and the model was refused."""
    torch.manual_seed(0)
    _forward_and_grad_sample_as_the_loop(InPlaceViews(how).double(), torch.randn(B, 6, dtype=torch.float64))


class WritesAConstantLikeAnExpand(nn.Module):
    """``zeros_like`` of a parameter expanded to the batch, then written per sample: the
    write lands in the fresh tensor (an expand of one row of zeros would have nowhere
    to put it)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(1, 6))
        self.fc = nn.Linear(6, 6)

    def forward(self, x):  # x [B, 6]
        k = self.scale.expand(x.shape[0], 6)
        h = torch.zeros_like(k)
        h[:, :2] = self.fc(x)[:, :2]
        return h * k + x


def test_a_constant_like_an_expanded_parameter_written_in_place_stays_a_tensor():
    torch.manual_seed(0)
    _forward_and_grad_sample_as_the_loop(WritesAConstantLikeAnExpand().double(), torch.randn(B, 6, dtype=torch.float64))


class SlicedAtBufferBounds(nn.Module):
    """escnn's way: the bounds of each field's channels are held in index buffers, read
    with ``.item()`` under Dynamo (values the data decides, unbacked sizes): an
    activation written at them (``NormNonLinearity``), or a parameter block written into
    a filter at them (``R3Conv``'s basis expansion)."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what
        if what == "activation":
            self.lin = nn.Linear(5, 4)
        else:
            self.block = nn.Parameter(torch.randn(2, 5))
        self.register_buffer("bounds", torch.tensor([1, 3]))

    def forward(self, x):
        lo, hi = self.bounds[0], self.bounds[1]
        if self.what == "activation":
            h = self.lin(x)
            out = torch.zeros_like(h)
            out[:, lo:hi] = torch.tanh(h[:, lo:hi])
            return torch.cat([out, h], 1)
        weight = torch.zeros(4, 5, dtype=x.dtype)
        weight[lo:hi] = self.block
        return x @ weight.t()


@pytest.mark.parametrize("grad_sample", [True, False], ids=["grad_sample", "clip"])
def test_an_activation_sliced_at_bounds_a_buffer_holds(grad_sample):
    """It failed to canonicalise ("Pending unbacked symbols … not in returned outputs"):
    retraced with the sizes the data decides left unbound, as AOTAutograd does."""
    torch.manual_seed(0)
    _check(SlicedAtBufferBounds("activation").double(), torch.randn(B, 5, dtype=torch.float64), grad_sample)


@pytest.mark.parametrize("grad_sample", [True, False], ids=["grad_sample", "clip"])
def test_a_parameter_written_at_bounds_a_buffer_holds(grad_sample):
    """Mapping its per-sample gradients back runs the write under vmap, which needs the
    bounds as numbers: it runs at run time, where they are (it was refused: "Keep such
    positions as Python ints")."""
    torch.manual_seed(0)
    _check(SlicedAtBufferBounds("parameter").double(), torch.randn(B, 5, dtype=torch.float64), grad_sample)


class FilterFromBlocksAtHeldBounds(nn.Module):
    """escnn's basis expansion with several (in, out) field pairs: each parameter block
    is written into the filter at bounds the module holds as 0-d tensors
    (``indices.max() + 1``; or NumPy integers, which Dynamo hands over as 0-d tensors, or
    buffers). The bounds are data to the graph, and the per-sample VJP of the write
    (run under vmap, which needs them as numbers) refused the model, which the same
    model with Python ints is not."""

    def __init__(self, held: str = "tensor"):
        super().__init__()
        self.blocks = nn.ParameterList([nn.Parameter(torch.randn(2, 5)), nn.Parameter(torch.randn(1, 5))])
        self.held = held
        self.place([torch.arange(0, 2), torch.arange(2, 3)])

    def place(self, indices: list[torch.Tensor]) -> None:
        if self.held == "numpy":
            self.bounds = [(i.numpy().min(), i.numpy().max() + 1) for i in indices]
        elif self.held == "buffer":
            for k, i in enumerate(indices):
                self.register_buffer(f"lo{k}", i.min())
                self.register_buffer(f"hi{k}", i.max() + 1)
            self.bounds = None
        else:
            self.bounds = [(i.min(), i.max() + 1) for i in indices]

    def forward(self, x):
        bounds = self.bounds or [(self.lo0, self.hi0), (self.lo1, self.hi1)]
        weight = torch.zeros(4, 5, dtype=x.dtype)
        for block, (lo, hi) in zip(self.blocks, bounds):
            weight[lo:hi] = block
        return x @ weight.t()


@pytest.mark.parametrize("held", ["tensor", "numpy", "buffer"])
@pytest.mark.parametrize("grad_sample", [True, False], ids=["grad_sample", "clip"])
def test_parameter_blocks_written_at_bounds_the_module_holds(held, grad_sample):
    torch.manual_seed(0)
    _check(FilterFromBlocksAtHeldBounds(held).double(), torch.randn(B, 5, dtype=torch.float64), grad_sample)


@pytest.mark.parametrize("held", ["tensor", "numpy", "buffer"])
def test_bounds_the_module_holds_may_change_between_steps(held):
    """Dynamo compiles again for no new value of a tensor or NumPy scalar: the graphs
    take the bounds as data, and the per-sample VJP reads them at every step."""
    torch.manual_seed(0)
    model = FilterFromBlocksAtHeldBounds(held).double()
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    for indices in ([torch.arange(0, 2), torch.arange(2, 3)], [torch.arange(1, 3), torch.arange(3, 4)],
                    [torch.arange(2, 4), torch.arange(0, 1)]):
        model.place(indices)
        x = torch.randn(B, 5, dtype=torch.float64)
        ref = reference(model, (x,), lambda out, i: (out ** 2).sum())
        model.zero_grad()
        (dp(x) ** 2).sum().backward()
        assert_close_all({k: p.grad_sample for k, p in model.named_parameters()}, ref.per_sample,
                         tolerance(torch.float64), f"bounds at {indices[0][0]}")


class WrittenAtBoundsComputedFromAHeldOne(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Parameter(torch.randn(2, 5))
        self.start = torch.tensor(1)

    def forward(self, x):
        weight = torch.zeros(4, 5, dtype=x.dtype)
        weight[self.start:self.start + 2] = self.block
        return x @ weight.t()


@pytest.mark.parametrize("grad_sample", [True, False], ids=["grad_sample", "clip"])
def test_a_parameter_written_at_bounds_computed_from_a_held_one(grad_sample):
    torch.manual_seed(0)
    _check(WrittenAtBoundsComputedFromAHeldOne().double(), torch.randn(B, 5, dtype=torch.float64), grad_sample)


def test_bounds_the_module_holds_in_explain():
    """``explain`` shows the run-time VJP as one opaque op of the backward."""
    text = str(fxdp.explain(FilterFromBlocksAtHeldBounds("buffer").double(), torch.randn(B, 5, dtype=torch.float64),
                            grad_sample=True))
    assert "torch.ops.fxdp.per_sample.default" in text.split("--- backward")[1]


class CountedFromTheEnd(nn.Module):
    """A parameter sliced or written at bounds counted from the end: by the sequence
    length (``pos[-T:]``, ``f[-T:] = pos[:T]``) or by numbers the module holds
    (``f[-hi:-lo] = p``), and a parameter scaled by a float or bool it holds. They
    crashed: the transform's numbers were carried as ``[n]`` tensors (no negative sizes,
    no floats), and ``slice_scatter``'s vmap rule misreads bounds from the end; a
    scale read with ``float()`` was refused as an operand the parameter's op is
    broadcast with."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.pos = nn.Parameter(torch.randn(8, 5))
        self.lo, self.hi = torch.tensor(1), torch.tensor(3)
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("step", torch.tensor(2))

    def forward(self, x):  # x [B, T, 5]
        T = x.shape[1]
        if self.how == "sliced by the length":
            return (x * self.pos[-T:]).sum(1)
        if self.how == "written by the length":
            f = x.new_zeros(T + 3, 5)
            f[-T:] = self.pos[:T]
            return (x * f[:T]).sum(1)
        if self.how == "written at held bounds":
            f = torch.zeros(6, 5, dtype=x.dtype)
            f[-self.hi:-self.lo] = self.pos[:2]
            return (x @ f.t()).sum(1)
        if self.how == "scaled by a held float":
            return (x * (self.pos[:T] * float(self.scale))).sum(1)
        if self.how == "scaled by a held 0-d tensor":  # it was refused: the 0-d buffer read as spanning the batch
            return (x * (self.pos[:T] * self.scale)).sum(1)
        return (x * (self.pos[:T] * (self.step >= 1).item())).sum(1)  # "a held bool"


@pytest.mark.parametrize("how", ["sliced by the length", "written by the length", "written at held bounds",
                                 "scaled by a held float", "scaled by a held 0-d tensor", "a held bool"])
def test_parameter_transforms_at_numbers_counted_from_the_end_or_not_ints(how):
    torch.manual_seed(0)
    model = CountedFromTheEnd(how).double()
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    for batch, length in ((B, 5), (B + 1, 4), (B - 1, 6)):  # the second and third: dynamic shapes
        x = torch.randn(batch, length, 5, dtype=torch.float64)
        ref = reference(model, (x,), lambda out, i: out.pow(2).sum())
        model.zero_grad()
        dp(x).pow(2).sum().backward()
        assert_close_all({"pos": model.pos.grad_sample}, ref.per_sample, tolerance(torch.float64),
                         f"{how}, B={batch}, T={length}")


def test_a_float_a_parameter_transform_reads_keeps_float64_under_inductor():
    """Read back as a number in the backward, Inductor's C++ kernels took it as a C
    ``float``: per-sample gradients off by 3e-8 in a float64 model (1.7 is no float32)."""
    torch.manual_seed(0)
    model = CountedFromTheEnd("scaled by a held float").double()
    model.scale.fill_(1.7)
    x = torch.randn(B, 5, 5, dtype=torch.float64)
    ref = reference(model, (x,), lambda out, i: out.pow(2).sum())
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="inductor")
    dp(x).pow(2).sum().backward()
    assert_close_all({"pos": model.pos.grad_sample}, ref.per_sample, tolerance(torch.float64), "inductor")


class ScaledByANumpyArgument(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)

    def forward(self, x, n):
        return self.lin(x)[:, :int(n)].sum(1, keepdim=True) * int(n)


def test_a_numpy_scalar_passed_as_an_argument():
    torch.manual_seed(0)
    model = ScaledByANumpyArgument().double()
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    x = torch.randn(B, 5, dtype=torch.float64)
    for n in (np.int64(2), np.int64(3)):
        ref = reference(model, (x, n), lambda out, i: out.sum(), in_dims=(0, None))
        model.zero_grad()
        dp(x, n).sum().backward()
        assert_close_all({k: p.grad_sample for k, p in model.named_parameters()}, ref.per_sample,
                         tolerance(torch.float64), f"n={n}")


class MultiHotRows(nn.Module):
    """RecBole's BERT4Rec ``multi_hot_embed``: one row per (sample, k) of a fresh
    ``zeros(B * K, L)``, written at ``arange(B * K)`` and each row's own position, then
    viewed ``[B, K, L]``. Row ``r`` is written at ``idx[r]`` alone: it is that sample's.
    It was refused ("it writes batched values, or at batched positions, into a tensor
    shared by all samples")."""

    def __init__(self, how: str = "ones"):
        super().__init__()
        self.embedding = nn.Embedding(10, 3)
        self.how = how

    def forward(self, seq, idx):
        h = self.embedding(seq)  # [B, L, 3]
        flat = idx.reshape(-1)
        rows = torch.arange(flat.shape[0])
        if self.how == "accumulated values":
            multi_hot = torch.zeros(flat.shape[0], seq.shape[1], dtype=h.dtype)
            multi_hot.index_put_((rows, flat), h.sum(-1).gather(1, idx).reshape(-1), accumulate=True)
        elif self.how == "a shared table's rows":  # rows that differ: each sample would get its position's
            multi_hot = torch.arange(flat.shape[0] * seq.shape[1], dtype=h.dtype).view(flat.shape[0], -1) / 10
            multi_hot[rows, flat] = 1.0
        elif self.how == "shared values that differ by row":
            multi_hot = torch.zeros(flat.shape[0], seq.shape[1], dtype=h.dtype)
            multi_hot[rows, flat] = rows.to(h.dtype)
        else:
            multi_hot = torch.zeros(flat.shape[0], seq.shape[1], dtype=h.dtype)
            multi_hot[rows, flat] = 1.0
        return torch.bmm(multi_hot.view(idx.shape[0], idx.shape[1], -1), h).sum(1)


@pytest.mark.parametrize("how", ["ones", "accumulated values"])
def test_one_row_written_per_row_of_a_fresh_tensor(how):
    torch.manual_seed(0)
    model = MultiHotRows(how).double()
    seq, idx = torch.randint(0, 10, (B, 6)), torch.randint(0, 6, (B, 2))
    ref = reference(model, (seq, idx), lambda out, i: out.pow(2).sum())
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    dp(seq, idx).pow(2).sum().backward()
    assert_close_all({"embedding.weight": model.embedding.weight.grad_sample}, ref.per_sample,
                     tolerance(torch.float64), how)


class OneHotOfLearnedValue(nn.Module):
    """``zeros(B, C)[arange(B), y] = w`` with a parameter ``w``: read with the target
    batched (it crashed the generic per-sample VJP when read as one write per row), and
    ``t[:, arange(B), y] = v`` behind a leading slice, with values that differ by row
    (refused; it was accepted with the values read along the wrong dim)."""

    def __init__(self, how: str):
        super().__init__()
        self.lin, self.w = nn.Linear(6, 6), nn.Parameter(torch.randn(1))
        self.how = how

    def forward(self, x, y):
        if self.how == "learned value":
            one_hot = torch.zeros(x.shape[0], 6, dtype=x.dtype)
            one_hot[torch.arange(x.shape[0]), y] = self.w
            return self.lin(x) * one_hot
        t = torch.zeros(2, x.shape[0], 6, dtype=x.dtype)
        t[:, torch.arange(x.shape[0]), y] = torch.arange(x.shape[0], dtype=x.dtype) + 1
        return self.lin(x) * t.sum(0)


def test_a_one_hot_of_a_learned_value():
    torch.manual_seed(0)
    model = OneHotOfLearnedValue("learned value").double()
    x, y = torch.randn(B, 6, dtype=torch.float64), torch.randint(0, 6, (B,))
    ref = reference(model, (x, y), lambda out, i: out.pow(2).sum())
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    dp(x, y).pow(2).sum().backward()
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                     tolerance(torch.float64), "learned value")


def test_one_row_written_per_row_behind_a_leading_slice_with_values_by_row_is_refused():
    problems = fxdp.validate(OneHotOfLearnedValue("behind a slice").double(), torch.randn(B, 6, dtype=torch.float64),
                             torch.randint(0, 6, (B,)))
    assert problems and "index_put" in str(problems[0])


@pytest.mark.parametrize("how", ["a shared table's rows", "shared values that differ by row"])
def test_one_row_written_per_row_of_rows_that_differ_is_refused(how):
    problems = fxdp.validate(MultiHotRows(how).double(), torch.randint(0, 10, (B, 6)), torch.randint(0, 6, (B, 2)))
    assert problems and "index_put" in str(problems[0])


class SomeRowsWritten(nn.Module):
    """A buffer built from the batch size, only some of whose rows are written: each
    sample alone would write its own (its position is the last and the first), so in
    the batch only the samples at those positions get them. All were accepted, with
    per-sample gradients of the positions (the other samples' bias gradients zero):
    with a static ``B`` each write is a piece of that row's sample, and with a symbolic
    ``B`` the refused ``select`` of row -1 was taken for a value no gradient reaches,
    its write into the buffer unseen (found by a helper probing the fifty-second
    session's changes). Every row written, by each sample's own values, is exact."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(3, 3)

    def forward(self, x):  # [B, 3]
        h = self.lin(x)
        buf = torch.zeros(x.shape[0], 1, dtype=x.dtype)
        if self.how == "the last row":
            buf[-1] = 1.0
        elif self.how == "the first row":
            buf[0] = 1.0
        elif self.how == "the first sample's values":
            buf = torch.zeros_like(h)
            buf[0] = h[0]
            return buf.sum(1)
        elif self.how == "a column set to the positions":  # each sample's value its position (accepted before)
            buf = torch.zeros_like(h)
            buf[:, 1] = torch.arange(x.shape[0], dtype=x.dtype)
            return (h * buf).sum(1)
        elif self.how in ("the positions scattered", "the positions copied at an index"):  # (accepted before)
            positions = torch.arange(x.shape[0], dtype=x.dtype)[:, None]
            buf = torch.zeros_like(h).scatter(1, torch.zeros(x.shape[0], 1, dtype=torch.long), positions) \
                if self.how == "the positions scattered" else torch.zeros_like(h).index_copy(1, torch.tensor([2]),
                                                                                            positions)
            return (h * buf).sum(1)
        elif self.how in ("the positions put at arange(B)", "the positions added at arange(B)"):  # (accepted before)
            positions, rows = torch.arange(x.shape[0], dtype=x.dtype), torch.arange(x.shape[0])
            buf = torch.zeros_like(h)
            buf.index_put_((rows, torch.ones_like(rows)), positions,
                           accumulate=self.how == "the positions added at arange(B)")
            return (h * buf).sum(1)
        elif self.how == "each sample's column by its position":  # h[b, b % 3] (accepted before)
            rows = torch.arange(x.shape[0])
            return h[rows, rows % 3]
        elif self.how == "one-hot of each sample's own index":  # scatter of a constant at batched indices
            buf = torch.zeros_like(h).scatter(1, x.argmax(1, keepdim=True), 1.0)
            return (h * buf).sum(1)
        elif self.how == "the first sample's row of the batch, doubled":  # a computed batch, not a buffer
            h = h.sin()
            h[0] = h[0] * 2
            return h.sum(1)
        else:  # "every row, from its own sample"
            buf = torch.zeros_like(h)
            for i in range(x.shape[0]):
                buf[i] = h[i] * 2
            return buf.sum(1)
        return (h * buf).sum(1)


@pytest.mark.parametrize("how", ["the last row", "the first row", "the first sample's values",
                                 "the first sample's row of the batch, doubled", "a column set to the positions",
                                 "the positions scattered", "the positions copied at an index",
                                 "the positions put at arange(B)", "the positions added at arange(B)",
                                 "each sample's column by its position"])
def test_a_buffer_sized_by_the_batch_with_some_rows_written_is_refused(how):
    model = SomeRowsWritten(how).double()
    dp = fxdp.transform(model, grad_sample=True, compiler="eager", loss_reduction="sum")
    for batch_size in (3, 4):  # static, then symbolic
        with pytest.raises(fxdp.UnsupportedError, match="shared tensor whose values vary along the batch dim|"
                                                         "only some samples' rows were written|"
                                                         "it selects one row of the batch"):
            dp(torch.randn(batch_size, 3, dtype=torch.float64)).sum().backward()


@pytest.mark.parametrize("how", ["every row, from its own sample", "one-hot of each sample's own index"])
def test_a_buffer_sized_by_the_batch_with_every_row_written_is_exact(how):
    torch.manual_seed(0)
    model = SomeRowsWritten(how).double()
    x = torch.randn(3, 3, dtype=torch.float64)
    ref = reference(model, (x,), lambda out, i: out.pow(2).sum())
    dp = fxdp.transform(model, grad_sample=True, compiler="eager", loss_reduction="sum")
    dp(x).pow(2).sum().backward()
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                     tolerance(torch.float64), "grad_sample")


class PutAtEachPosition(nn.Module):
    """``buf[arange(B), …] = v`` with a shared ``v`` that has a dim in line with the batch:
    sample ``b`` gets ``v``'s row ``b``. A window of a parameter (``table[:B]``) is its
    row per position, and was accepted into the generic per-sample VJP, which crashed
    ("IndexPutBackward0 returned an invalid gradient"); one row of it, or one value
    expanded to the batch, is every sample's alike and exact."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(3, 3)
        self.table = nn.Parameter(torch.randn(6, 3))

    def forward(self, x):  # [B, 3]
        h, rows = self.lin(x), torch.arange(x.shape[0])
        buf = torch.zeros(x.shape[0], 2, 3, dtype=x.dtype)
        if self.how == "a row per position":
            buf[rows, 1] = self.table[:x.shape[0]] * 2
        elif self.how == "one row":
            buf[rows, 1] = self.table[2]
        else:  # "one row expanded to the batch"
            buf[rows] = self.table[:2].expand(x.shape[0], 2, 3)
        return (h * buf.sum(1)).sum(1)


def test_a_parameters_row_per_position_put_at_arange_is_refused():
    dp = fxdp.transform(PutAtEachPosition("a row per position").double(), grad_sample=True, compiler="eager",
                        loss_reduction="sum")
    with pytest.raises(fxdp.UnsupportedError, match="table"):
        dp(torch.randn(3, 3, dtype=torch.float64)).sum().backward()


@pytest.mark.parametrize("how", ["one row", "one row expanded to the batch"])
def test_a_parameters_row_put_at_arange_is_exact(how):
    torch.manual_seed(0)
    model = PutAtEachPosition(how).double()
    dp = fxdp.transform(model, grad_sample=True, compiler="eager", loss_reduction="sum")
    for batch_size in (3, 4):  # static, then symbolic
        x = torch.randn(batch_size, 3, dtype=torch.float64)
        ref = reference(model, (x,), lambda out, i: out.pow(2).sum())
        model.zero_grad(set_to_none=True)
        dp(x).pow(2).sum().backward()
        assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                         tolerance(torch.float64), "grad_sample")


class WrittenTwice(nn.Module):
    """A slice of a computed batch written in place twice, the second write through the
    first's result or the same view (``v = h[:, 1:]; v.mul_(2); v[:, 0] = g[:, 0]``): the
    later view is taken of the first write's result, which aliases ``h``. Made out of
    place, the first write left the second in a tensor nothing read (wrong gradients,
    ``g``'s parameters none; with a number, ``v[:, 0].add_(3)``, before the fifty-third
    session too), or the second write lost its position among the nodes (a crash). A view
    read after a later write into its base must show that write, and a copied value must
    not show a later write into its source (both silently wrong in a first version of
    the fifty-third session's scatters, found by a helper)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h, g = self.a(x), self.b(x)
        v = h[:, 1:]
        if self.how == "copy through the written view":
            v.mul_(2)
            v[:, 0] = g[:, 0]
        elif self.how == "a number added through the written view":
            v.mul_(2)
            v[:, 0].add_(3)
        elif self.how == "two writes into one view":
            v += g[:, 1:]
            v += g[:, :3]
        elif self.how == "a view read after a later write into its base":
            v = h[:, 1:3]
            v.add_(g[:, :2])
            h[:, 2] = g[:, 3]  # shows through v
            return torch.cat([v.sin(), g.tanh()], 1)
        else:  # "a chained write"
            h[:, 0].add_(g[:, 0]).mul_(2)
        return h.sin() + g.tanh()


@pytest.mark.parametrize("grad_sample", [True, False], ids=["grad_sample", "clip"])
@pytest.mark.parametrize("how", ["copy through the written view", "a number added through the written view",
                                 "two writes into one view", "a chained write",
                                 "a view read after a later write into its base"])
def test_a_slice_written_twice_is_exact(how, grad_sample):
    torch.manual_seed(0)
    _check(WrittenTwice(how).double(), torch.randn(B, 4, dtype=torch.float64), grad_sample)


class CopiedFromWrittenSource(nn.Module):
    """``v = h[:, 0]; v.copy_(t[:, 1]); t.mul_(2)``: ``v`` keeps the copied values, the
    later write into ``t`` does not show through it (as a scatter, ``v``'s later reads read
    the source's view itself: wrong gradients in a first version of the fifty-third
    session's scatters, found by a helper)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 5)

    def forward(self, x):
        h, t = self.a(x), self.b(x)
        v = h[:, 0]
        v.copy_(t[:, 1])
        t.mul_(2)
        return h.sin() + v[:, None] + t


def test_a_copy_keeps_its_values_when_its_source_is_written_later():
    torch.manual_seed(0)
    model = CopiedFromWrittenSource().double()
    x = torch.randn(4, 5, dtype=torch.float64)
    weights = torch.randn(4, 5, dtype=torch.float64)
    ref = reference(model, (x,), lambda out, i: (out * weights[i:i + 1]).sum())
    dp = fxdp.transform(model, grad_sample=True, compiler="eager", loss_reduction="sum")
    (dp(x) * weights).sum().backward()
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                     tolerance(torch.float64), "grad_sample")


class QuantizerDropout(nn.Module):
    """DAC's residual quantizer dropout: every sample uses ``n`` codebooks but the first
    ``int(B * rate)``, which draw their own count, ``n[:k] = drawn[:k]``; the mask
    ``arange(K) < n`` then zeroes the codebooks past it. At rate 0 nothing is written
    and the mask is alike for every sample (refused before: "a shared tensor whose
    values vary along the batch dim"); at a rate above 0 the first samples of the batch
    are treated unlike the others, which fxdp must refuse."""

    def __init__(self, rate: float):
        super().__init__()
        self.rate = rate
        self.lin = nn.Linear(5, 3)

    def forward(self, x):
        b = x.shape[0]
        n = torch.ones(b) * 2
        k = int(b * self.rate)
        n[:k] = torch.randint(1, 3, (b,))[:k].float()
        mask = torch.arange(3)[None, :] < n[:, None]
        return self.lin(x) * mask


def test_a_dropout_of_no_sample_writes_nothing():
    torch.manual_seed(0)
    model = QuantizerDropout(0.0).double()
    dp = fxdp.transform(model, grad_sample=True, max_grad_norm=0.1, compiler="eager")
    for batch_size in (B, B + 2):
        x = torch.randn(batch_size, 5, dtype=torch.float64)
        ref = reference(model, (x,), lambda out, i: out.pow(2).sum())
        model.zero_grad()
        dp(x).pow(2).sum(1).mean().backward()
        tol = tolerance(torch.float64)
        assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample, tol, "grad_sample")
        assert_close_all({n: p.grad for n, p in model.named_parameters()}, ref.grad("mean", 0.1), tol, "grad")


def test_a_dropout_of_the_first_samples_is_refused():
    problems = fxdp.validate(QuantizerDropout(0.5), torch.randn(B, 5))
    assert any("vary along the batch dim" in p.reason for p in problems), problems
