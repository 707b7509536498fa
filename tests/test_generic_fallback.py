"""The generic per-sample VJP fallback (``fxdp/rules/generic.py``).

A parameter consumed by an op that keeps samples independent but has no per-sample
rule of its own (``torch.pow(x, p)``, ``torch.maximum(x, p)``, ``torch.where(m, x, p)``
…) gets each sample's gradient as the VJP of the op on that sample alone, through
``vmap``. DESIGN.md requires float32 checks of anything built on ``vmap`` against the
microbatch loop: every op runs in float64 and float32, and a larger float32 case
(``B = 64``) combines them. ``explain()`` must name the fallback.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdp
from reference import assert_close_all, reference, tolerance

aten = torch.ops.aten
B, T, D = 5, 3, 4
STRATEGY = "instantiate (per-sample VJP)"


@dataclasses.dataclass(frozen=True)
class Op:
    """One way of using a parameter ``p`` ``[D]`` (or ``p_shape``) on a batched ``x``.

    Attributes:
        id: Test id.
        fn: ``(x, p) -> y`` with ``y`` shaped like ``x``.
        canonical: The ATen op it canonicalises to (the rule the fallback stands in for).
        argument: Which argument of that op is the parameter.
        p_shape: The parameter's shape.
    """

    id: str
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    canonical: object
    argument: int
    p_shape: tuple = (D,)


OPS = [
    Op("pow_exponent", lambda x, p: torch.pow(x.abs() + 1, p), aten.pow.Tensor_Tensor, 1),
    Op("pow_base", lambda x, p: torch.pow(p, torch.tanh(x)), aten.pow.Tensor_Tensor, 0),
    Op("maximum", lambda x, p: torch.maximum(x, p), aten.maximum.default, 1),
    Op("minimum", lambda x, p: torch.minimum(p, x), aten.minimum.default, 0),
    Op("where", lambda x, p: torch.where(x > 0, x, p), aten.where.self, 2),
    Op("lerp_weight", lambda x, p: torch.lerp(x, torch.tanh(x), p), aten.lerp.Tensor, 2),
    Op("clamp_min", lambda x, p: torch.clamp(x, min=p), aten.clamp.Tensor, 1),
    Op("clamp_max", lambda x, p: torch.clamp(x, max=p), aten.clamp.Tensor, 2),
    Op("atan2", lambda x, p: torch.atan2(x, p), aten.atan2.default, 1),
    Op("hypot", lambda x, p: torch.hypot(x, p), aten.hypot.default, 1),
    Op("prelu", lambda x, p: F.prelu(x, p), aten.prelu.default, 1, p_shape=(1,)),
    # Writes along a sequence dim at shared positions; a parameter-only operand expanded
    # to the batch: sample b meets its row b (whole-batch VJPs, as index_add's meta
    # kernel takes one sample's slice beside all B rows without complaint).
    Op("index_add_source", lambda x, p: x.index_add(1, torch.tensor([0, 2, 2]), p.expand(x.shape[0], T, D),
                                                    alpha=2.0), aten.index_add.default, 3, p_shape=(T, D)),
    Op("index_copy_self", lambda x, p: p.expand(x.shape[0], T + 1, D).index_copy(1, torch.tensor([3, 0, 2]), x),
       aten.index_copy.default, 0, p_shape=(T + 1, D)),
    # index_fill by a tensor value canonicalises to where over the filled positions.
    Op("index_fill_value", lambda x, p: x.index_fill(1, torch.tensor([1]), p.sum()), aten.where.self,
       1, p_shape=(1,)),
    Op("index_reduce_self", lambda x, p: p.expand(x.shape[0], T, D).index_reduce(1, torch.tensor([1, 0, 1]), x,
                                                                                  "amax"),
       aten.index_reduce.default, 0, p_shape=(T, D)),
]


class Model(nn.Module):
    """``Linear -> op(·, p) -> Linear``: the parameter meets data that already depends on
    other parameters, and its output feeds another rule."""

    def __init__(self, fn: Callable, p_shape: tuple, d: int = D):
        super().__init__()
        self.fc = nn.Linear(d, d)
        # Positive, away from 0: pow's base, atan2's and hypot's second argument.
        self.p = nn.Parameter(torch.rand(*p_shape) + 0.5)
        self.head = nn.Linear(d, 3)
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fn(self.fc(x), self.p))


class Combined(nn.Module):
    """Several fallback ops in one model, for the larger float32 case."""

    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.exponent = nn.Parameter(torch.rand(d) + 0.5)
        self.floor = nn.Parameter(torch.randn(d) * 0.1)
        self.fill = nn.Parameter(torch.randn(d))
        self.weight = nn.Parameter(torch.rand(d))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = torch.pow(h.abs() + 1, self.exponent) + torch.maximum(h, self.floor)
        h = torch.where(h > 1, h, self.fill)
        return self.head(torch.lerp(h, torch.tanh(h), self.weight))


def _loss(out: torch.Tensor) -> torch.Tensor:
    """``[B]``: each sample's sum of squares."""
    return out.pow(2).reshape(out.shape[0], -1).sum(1)


def run(model: nn.Module, x: torch.Tensor, mode: str, dtype: torch.dtype) -> fxdp.DPModule:
    """One compile in ``mode``, checked against the float64 loop on the same values."""
    model = model.to(dtype)
    x = x.to(dtype)
    ref = reference(copy.deepcopy(model).double(), (x.double(),), lambda out, i: _loss(out).sum())
    clip = float(ref.norms.median()) if mode == "clip" else None
    dp_model = fxdp.transform(model, max_grad_norm=clip, grad_sample=mode == "grad_sample", compiler="eager")
    _loss(dp_model(x)).mean().backward()
    tol = tolerance(dtype)
    params = dict(model.named_parameters())
    assert_close_all({n: p.grad for n, p in params.items()}, ref.grad("mean", clip), tol, "p.grad")
    if mode == "grad_sample":
        assert_close_all({n: getattr(p, "grad_sample", None) for n, p in params.items()}, ref.per_sample, tol,
                         "p.grad_sample")
    assert_close_all({"norms": dp_model.per_sample_norms}, {"norms": ref.norms}, tol, "per_sample_norms")
    return dp_model


def _params():
    return [
        pytest.param(op, dtype, mode, id=f"{op.id}-{str(dtype)[6:]}-{mode}")
        for op in OPS for dtype in (torch.float64, torch.float32) for mode in ("grad_sample", "clip")
    ]


@pytest.mark.parametrize("op, dtype, mode", _params())
def test_fallback_op(op: Op, dtype: torch.dtype, mode: str):
    torch.manual_seed(0)
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    dp_model = run(Model(op.fn, op.p_shape), x, mode, dtype)
    plans = {p.name: p for p in dp_model.explain().plans}
    generic = plans["p"]
    assert generic.strategy == STRATEGY, generic
    assert generic.rule == f"generic.{op.canonical.__name__.split('.')[0]}[{op.argument}]", generic
    # The parameters around it keep their own rules.
    assert plans["fc.weight"].rule == "linear.weight" and plans["fc.weight"].strategy != STRATEGY


def test_explain_names_the_fallback():
    """``fxdp.explain`` (fake tensors, no run) shows the fallback per node and per parameter."""
    torch.manual_seed(0)
    model = Model(OPS[0].fn, (D,)).double()
    text = str(fxdp.explain(model, torch.randn(B, T, D, dtype=torch.float64), max_grad_norm=1.0))
    assert f"  p: rule=generic.pow[1] uses=1 strategy={STRATEGY} costs: -" in text
    assert f"# fxdp: rule=generic.pow[1], param=p, strategy={STRATEGY}" in text


@pytest.mark.parametrize("mode", ["grad_sample", "clip"])
def test_larger_float32_batch(mode: str):
    """``B = 64`` in float32: where DESIGN.md saw vmap'd gradients go wrong."""
    torch.manual_seed(0)
    model = Combined(32)
    x = torch.randn(64, 16, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    dp_model = run(model, x, mode, torch.float32)
    strategies = {p.name: p.strategy for p in dp_model.explain().plans}
    assert all(strategies[n] == STRATEGY for n in ("exponent", "floor", "fill", "weight")), strategies


class InPlace(nn.Module):
    """A parameter as an operand of an in-place op on an activation: timm's
    ``LayerScale(inplace=True)`` (``h.mul_(gamma)``), ``h += bias``, a class-token row
    ``h[:, 0] += tok`` (a write through a view; the base ``h`` is read afterwards), the
    same seen through a view taken before the write (``flat``, which stays a write)."""

    def __init__(self, kind: str, d: int = D):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(d, d)
        self.p = nn.Parameter(torch.rand(d) + 0.5)
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.kind == "mul_":
            h.mul_(self.p)
        elif self.kind == "add_":
            h += self.p
        elif self.kind == "view_add_":
            h[:, 0] += self.p
        else:
            flat = h.view(-1)
            h[:, 0] += self.p
            h = flat.view(h.shape)
        return self.head(x + h)


@pytest.mark.parametrize("kind", ["mul_", "add_", "view_add_", "view_add_seen_before"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("mode", ["grad_sample", "clip"])
def test_in_place_op_on_parameter(kind: str, dtype: torch.dtype, mode: str):
    torch.manual_seed(0)
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    dp_model = run(InPlace(kind), x, mode, dtype)
    plans = {p.name: p for p in dp_model.explain().plans}
    # On a whole tensor nothing aliases, canonicalisation makes the op out of place (and
    # the elementwise rule takes it), and on a slice of one, scattered back; a write
    # that a view taken before it shows stays in place.
    expected = {"mul_": "mul.other", "add_": "add.other", "view_add_": "add.other",
                "view_add_seen_before": "generic.add_[1]"}[kind]
    assert plans["p"].rule == expected, plans["p"]


class Lookup(nn.Module):
    """A bare parameter indexed by batched integer ids: center loss ``x - centers[y]``
    with ``y`` ``[B]`` (``aten.index.Tensor``, the ids inside its list argument), a table
    ``table[ids]`` with ``ids`` ``[B, T]``, and the same center lookup written as
    ``index_select``, ``gather`` and ``take_along_dim``."""

    def __init__(self, kind: str, rows: int = 6, d: int = D):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(d, d)
        self.table = nn.Parameter(torch.randn(rows, d))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.kind == "sequence":
            return h * self.table[ids]
        if self.kind == "index_select":
            return h - self.table.index_select(0, ids)
        if self.kind == "gather":
            return h - torch.gather(self.table, 0, ids[:, None].expand(-1, h.shape[-1]))
        if self.kind == "take_along_dim":
            return h - torch.take_along_dim(self.table, ids[:, None], 0)
        return h - self.table[ids]


LOOKUP_RULES = {"center": "generic.index[0]", "sequence": "generic.index[0]",
                "index_select": "generic.index_select[0]", "gather": "generic.gather[0]",
                "take_along_dim": "generic.gather[0]"}


@pytest.mark.parametrize("kind", list(LOOKUP_RULES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("mode", ["grad_sample", "clip"])
def test_parameter_indexed_by_batched_ids(kind: str, dtype: torch.dtype, mode: str):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    shape = (B, T, D) if kind == "sequence" else (B, D)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    ids = torch.randint(0, 6, shape[:-1], generator=gen)
    ids[1] = ids[0]  # rows shared by two samples
    model = Lookup(kind).to(dtype)
    ref = reference(copy.deepcopy(model).double(), (x.double(), ids), lambda out, i: _loss(out).sum())
    clip = float(ref.norms.median()) if mode == "clip" else None
    dp_model = fxdp.transform(model, max_grad_norm=clip, grad_sample=mode == "grad_sample", compiler="eager")
    _loss(dp_model(x, ids)).mean().backward()
    tol = tolerance(dtype)
    params = dict(model.named_parameters())
    assert_close_all({n: p.grad for n, p in params.items()}, ref.grad("mean", clip), tol, "p.grad")
    if mode == "grad_sample":
        assert_close_all({n: p.grad_sample for n, p in params.items()}, ref.per_sample, tol, "p.grad_sample")
    assert_close_all({"norms": dp_model.per_sample_norms}, {"norms": ref.norms}, tol, "per_sample_norms")
    assert {p.name: p.rule for p in dp_model.explain().plans}["table"] == LOOKUP_RULES[kind]


def test_run_time_vjps_live_as_long_as_their_graph():
    """On a graph compiled for any batch size the fallback's VJP runs at run time, as an
    opaque op that finds it in a registry (``fxdp/opaque.py``). The registry holds it only
    while the graph can run: after ``torch._dynamo.reset()`` nothing of it is left."""
    import gc

    from fxdp import opaque

    before = len(opaque._CALLS)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.PReLU())
    m = copy.deepcopy(model)
    dp = fxdp.transform(m, grad_sample=True, loss_reduction="sum", compiler="eager")
    for size in (3, 4, 6):  # the second compiles for any size, the third reuses it
        x = torch.randn(size, D)
        dp(x).pow(2).sum().backward()
        ref = reference(model, [x], lambda out, i: out.pow(2).sum())
        assert_close_all({n: p.grad_sample for n, p in m.named_parameters()}, ref.per_sample, tolerance(torch.float32),
                         "p.grad_sample")
    assert len(opaque._CALLS) > before
    del dp, m
    torch._dynamo.reset()
    gc.collect()
    assert len(opaque._CALLS) == before


class Warp(nn.Module):
    """A warp of the input by ``grid_sample``: a learned affine ``theta`` shared by all
    samples (``affine_grid(theta.expand(B, 2, 3), [B, ...])``), a learned sampling grid
    expanded to the batch, or a spatial transformer's ``theta = loc(x)``. The shared
    ones reach the batch only through ``B`` in sizes and expands: no argument of
    ``grid_sample`` can be cut to one sample, so each sample's gradient is a VJP of the
    whole batch's op."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "shared_theta":
            self.theta = nn.Parameter(torch.tensor([[1.0, 0.1, 0.0], [0.05, 0.9, 0.1]]))
        elif kind == "shared_grid":
            self.grid = nn.Parameter(torch.rand(4, 4, 2) * 2 - 1)
        else:
            self.loc = nn.Linear(2 * 6 * 6, 6)
        self.head = nn.Linear(2 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 2, 6, 6]
        b = x.shape[0]
        if self.kind == "shared_theta":
            grid = F.affine_grid(self.theta.expand(b, 2, 3), [b, 2, 4, 4], align_corners=False)
        elif self.kind == "shared_grid":
            grid = self.grid.expand(b, 4, 4, 2)
        else:
            grid = F.affine_grid(self.loc(x.flatten(1)).view(-1, 2, 3), [b, 2, 4, 4], align_corners=False)
        return self.head(F.grid_sample(torch.tanh(x), grid, align_corners=False).flatten(1))


@pytest.mark.parametrize("kind", ["shared_theta", "shared_grid", "localised_theta"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_warps_by_shared_parameters_over_batch_sizes(kind: str, dtype: torch.dtype):
    """Exact at the first batch size and at the next ones, compiled for any size
    (``affine_grid``'s own derivative cannot take a symbolic size: it is decomposed)."""
    torch.manual_seed(0)
    model = Warp(kind).to(dtype)
    twin = copy.deepcopy(model).double()
    dp_model = fxdp.transform(model, max_grad_norm=0.05, grad_sample=True, loss_reduction="sum",
                              compiler="eager")
    gen = torch.Generator().manual_seed(1)
    for size in (5, 3, 4):
        x = torch.randn(size, 2, 6, 6, generator=gen, dtype=torch.float64)
        model.zero_grad(set_to_none=True)
        _loss(dp_model(x.to(dtype))).sum().backward()
        ref = reference(twin, (x,), lambda out, i: _loss(out).sum())
        params = dict(model.named_parameters())
        tol = tolerance(dtype)
        assert_close_all({n: p.grad_sample for n, p in params.items()}, ref.per_sample, tol, "p.grad_sample")
        assert_close_all({n: p.grad for n, p in params.items()}, ref.grad("sum", 0.05), tol, "p.grad")
    shared = {"shared_theta": "theta", "shared_grid": "grid"}.get(kind)
    if shared is not None:
        assert {p.name: p.strategy for p in dp_model.explain().plans}[shared] == STRATEGY


@pytest.mark.parametrize("case", ["along_the_batch", "positions_from_the_batch", "samples_pooled"])
def test_writes_at_shared_positions_only(case: str):
    """``index_add``/``index_copy``/``index_fill``/``index_reduce`` keep samples apart
    along any other dim than the batch's, at positions every sample shares. Samples
    pooled into fewer rows than there are samples (a graph network's ``index_add`` of
    nodes into graphs, each node a sample) write their own positions into one tensor."""
    class Writes(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, D)

        def forward(self, x, ids):
            h = self.fc(x)
            if case == "along_the_batch":
                return torch.zeros_like(h).index_add(0, torch.arange(h.shape[0]).flip(0), h)
            if case == "samples_pooled":
                return torch.zeros(4, T, D, dtype=h.dtype).index_add(0, ids, h)
            return torch.zeros_like(h).index_add(2, ids, h[..., :1].expand(-1, -1, ids.shape[0]))

    x = torch.randn(B, T, D, dtype=torch.float64)
    ids = torch.tensor([3, 0, 1, 2, 2])  # B == D: read as each sample's own
    problems = fxdp.validate(Writes().double(), x, ids)
    reason = {"along_the_batch": "it writes along the batch dim",
              "positions_from_the_batch": "its index vector comes from the batch",
              "samples_pooled": "its index vector comes from the batch"}[case]
    assert [p.op for p in problems] == ["aten.index_add.default"] and reason in problems[0].reason, problems



class Orthogonal(nn.Module):
    """``parametrizations.orthogonal``: a parameter transform whose derivative formulas
    write in place (``householder_product``'s into views of its intermediates)."""

    def __init__(self, orthogonal_map: str):
        super().__init__()
        self.lin = nn.utils.parametrizations.orthogonal(nn.Linear(D, D), orthogonal_map=orthogonal_map)
        self.head = nn.Linear(D, 2)

    def forward(self, x):
        return self.head(self.lin(x).mean(1))


@pytest.mark.parametrize("orthogonal_map", ["householder", "cayley", "matrix_exp"])
def test_inductor_transform_whose_derivative_writes_in_place(orthogonal_map: str):
    """The per-sample VJP of the transform traced those writes into the backward graph,
    and Inductor's scheduler failed on them (``KeyError: 'op15'``); the rewritten
    backward is now functionalised where it writes in place."""
    torch.manual_seed(0)
    model = Orthogonal(orthogonal_map).double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    ref = reference(model, (x,), lambda out, i: _loss(out).sum())
    dp_model = fxdp.transform(model, grad_sample=True, loss_reduction="sum")
    _loss(dp_model(x)).sum().backward()
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                     tolerance(torch.float64), "p.grad_sample")


class NormedThroughItsTranspose(nn.Module):
    """geoopt's ``Distance2StereographicHyperplanes``: ``p = w.permute(1, 0)`` used in a
    product and normed along the transposed dim, ``x @ p / p.norm(dim=0)``. The
    functionalised backward (the norm's derivative writes in place) re-ran a ``view``
    the first trace took of the transposed per-sample gradient, which is not one of the
    functionalised value's layout: "Cannot view a tensor with shape [B, 6, 4] and
    strides (24, 1, 6) as a tensor with shape (B, 24)"."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, D))

    def forward(self, x):
        p = self.w.permute(1, 0)
        return x @ p / p.norm(dim=0)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_parameter_normed_through_its_transpose(compiler: str):
    torch.manual_seed(0)
    model = NormedThroughItsTranspose().double()
    x = torch.randn(B, D, dtype=torch.float64)
    ref = reference(model, (x,), lambda out, i: _loss(out).sum())
    dp_model = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler=compiler)
    _loss(dp_model(x)).sum().backward()
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                     tolerance(torch.float64), "p.grad_sample")


class DualPathPReLU(nn.Module):
    """asteroid's DPTNet between its dual-path blocks: chunks of the sequence merged into
    the batch (``[B·K, C, S]``, ``S`` chunks from the length), a recurrence over the ``S``
    chunks, unrolled by the capture under the guard ``S == s // 16``, the batch split
    back, then ``PReLU``, which runs through the fallback."""

    chunk = 4

    def __init__(self):
        super().__init__()
        self.rnn, self.lin, self.act = nn.LSTM(4, 3, batch_first=True), nn.Linear(3, 4), nn.PReLU()

    def forward(self, x):  # [B, T]
        b = x.shape[0]
        u = x.view(b, 4, self.chunk, -1)  # [B, C, K, S]
        s = u.shape[-1]
        y = u.transpose(1, 2).reshape(b * self.chunk, 4, s)
        y = self.lin(self.rnn(y.transpose(1, -1))[0])  # [B·K, S, C]
        return self.act(y.transpose(1, -1).reshape(b, self.chunk, 4, s).transpose(1, 2))


def test_rows_per_sample_the_guards_decide_after_a_new_length():
    """At a new batch size and length the input of ``PReLU`` holds ``5 // (s // 16)`` rows
    per sample, which the recurrence's guard makes 1 but which the backward's sizes
    cannot rebuild: refused before the sixty-third session ("fxdp cannot follow the
    symbolic size s50 of a merged batch dim into the backward"; a helper's sweep of
    asteroid)."""
    torch.manual_seed(0)
    model = DualPathPReLU().double()
    twin = copy.deepcopy(model)
    dp_model = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    gen = torch.Generator().manual_seed(1)
    for size, length in ((3, 64), (2, 80)):
        x = torch.randn(size, length, generator=gen, dtype=torch.float64)
        model.zero_grad(set_to_none=True)
        dp_model(x).pow(2).sum().backward()
        ref = reference(twin, (x,), lambda out, i: out.pow(2).sum())
        assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                         tolerance(torch.float64), f"p.grad_sample at B = {size}, T = {length}")
