"""Parameters used directly by elementwise ops and matrix products
(``fxdp/rules/elementwise.py``, ``fxdp/rules/matmul.py``) against the microbatch reference.

One table of cases: layer scale ``x * gamma`` and ``gamma * x``, a hand-written Llama
RMSNorm, learned biases and a learned position table ``[T, d]`` (also batch second),
``sub``/``div``/``addcmul`` with the parameter in every position, a merged batch, one
parameter used twice, a shared table scaled by a parameter (broadcast), ``x @ W``,
``W @ x``, ``x @ w`` (vector), per-head weights ``[H, k, m]``, Hugging Face's
``Conv1D`` (``addmm`` on ``x.view(-1, d)``), ``mm`` with the batch in the columns,
``bmm``, ``baddbmm``. Every parameter sits after a trainable layer, so the input
gradients run too. Each case runs in float64 with a sum loss and in float32 with a
mean loss, with grad samples and clipping; matrix products also without grad
samples, where the cost model picks ghost or instantiate. Then the propagation
rules alone and the refusals.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune

import fxdp
from fxdp.batching import WHOLE, BatchDim, broadcast_batch
from fxdp.rules.elementwise import Layout
from fxdp.rules.matmul import matmul_batch
from expect import refused
from models import SequenceFirstBias
from reference import Reference, assert_close_all, reference, tolerance

aten = torch.ops.aten
B, T, D, H = 3, 5, 4, 2

KWARGS_REASON = (
    "core: the tag pass calls TaggedOp(*args, **node.kwargs) but TaggedOp.__call__ takes no "
    "keyword arguments, and OpRule.config/input_grad only see node.args, so keyword-only "
    "alpha/value/beta are lost (patch: pass them positionally in schema order)"
)


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


class Around(nn.Module):
    """``Linear -> body -> Tanh -> Linear``: ``body(h)`` holds the parameters under test."""

    def __init__(self, body: Callable, params: dict[str, torch.Tensor], d_in: int = D, d_out: int = D):
        super().__init__()
        self.inp, self.out = nn.Linear(D, d_in), nn.Linear(d_out, 3)
        for name, value in params.items():
            self.register_parameter(name, nn.Parameter(value))
        self.body = body

    def forward(self, x):
        return self.out(torch.tanh(self.body(self, self.inp(x))))


def around(body: Callable, d_in: int = D, d_out: int = D, **shapes) -> Callable[[], nn.Module]:
    """A maker for ``Around`` with parameters of the given shapes, values near 1."""
    def make():
        params = {n: 1 + 0.5 * torch.randn(s) for n, s in shapes.items()}
        return Around(body, params, d_in, d_out)

    return make


class LlamaRMSNorm(nn.Module):
    """Hugging Face's ``LlamaRMSNorm``: an elementwise weight, no ``aten.rms_norm``."""

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


class Conv1D(nn.Module):
    """Hugging Face's ``Conv1D`` (GPT-2): ``W`` is ``[in, out]``."""

    def __init__(self, nf: int, nx: int, beta_alpha: tuple | None = None):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.5)
        self.bias = nn.Parameter(torch.randn(nf) * 0.5)
        self.beta_alpha = beta_alpha

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        if self.beta_alpha is None:
            x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        else:
            beta, alpha = self.beta_alpha
            x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight, beta=beta, alpha=alpha)
        return x.view(size_out)


def llama() -> nn.Module:
    model = nn.Sequential(nn.Linear(D, D), LlamaRMSNorm(D), nn.Linear(D, 3))
    return model


def gpt2_mlp(beta_alpha: tuple | None = None) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(Conv1D(6, D, beta_alpha), nn.Tanh(), Conv1D(3, 6))


class SharedTable(nn.Module):
    """``x + table * gamma``: the product has only shared inputs, its result is broadcast."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(D, D), nn.Linear(D, 3)
        self.gamma = nn.Parameter(1 + 0.5 * torch.randn(D))
        self.register_buffer("table", torch.randn(T, D))

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x) + self.table * self.gamma))


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm scales by ``1 + w``: a parameter transform before the ``mul``."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(0.3 * torch.randn(d))

    def forward(self, x):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return normed * (1.0 + self.weight)


class ClsToken(nn.Module):
    """ViT's class token: ``cat([cls.expand(B, -1, -1), x], dim=1)``."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(D, D), nn.Linear(D, 3)
        self.cls_token = nn.Parameter(torch.randn(1, 1, D))

    def forward(self, x):
        h = self.inp(x)
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], dim=1)
        return self.out(torch.tanh(h))


class ClsTokenBroadcast(nn.Module):
    """torchtune's ``CLSEmbedding``: a 1-D class embedding ``broadcast_to`` every tile of
    every sample, ``cat([cls.broadcast_to(B, tiles, 1, d), x], dim=2)``."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(D, D), nn.Linear(D, 3)
        self.cls = nn.Parameter(torch.randn(D))

    def forward(self, x):  # [B, tiles, T, D]
        h = self.inp(x)
        b, tiles, _, d = h.shape
        h = torch.cat([self.cls.broadcast_to(b, tiles, 1, d), h], dim=2)
        return self.out(torch.tanh(h))


class EinsumWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(D, D), nn.Linear(D, 3)
        self.W = nn.Parameter(torch.randn(D, D) * 0.5)

    def forward(self, x):
        return self.out(torch.tanh(torch.einsum("btd,de->bte", self.inp(x), self.W)))


class EinsumWeightFirst(nn.Module):
    """The parameter as the first operand, contracted with the features."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(D, D), nn.Linear(4, 3)
        self.W = nn.Parameter(torch.randn(4, D) * 0.5)

    def forward(self, x):
        return self.out(torch.tanh(torch.einsum("ed,btd->bte", self.W, self.inp(x))))


class EinsumPerHead(nn.Module):
    """A per-head projection ``[H, D/H, E]``: the head index is shared by the batched
    operand and the parameter (a batch dim of the products, not contracted)."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(D, D), nn.Linear(2 * 3, 3)
        self.W = nn.Parameter(torch.randn(2, D // 2, 3) * 0.5)

    def forward(self, x):
        h = self.inp(x).unflatten(-1, (2, D // 2))
        return self.out(torch.tanh(torch.einsum("bthd,hde->bthe", h, self.W)).flatten(-2))


class EinsumAttention(nn.Module):
    """Attention scores by einsum: no parameter in the einsum, only its batch propagation."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.out = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(T, 3)

    def forward(self, x):
        return self.out(torch.einsum("btd,bsd->bts", self.q(x), self.k(x)).softmax(-1))


# ---------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    id: str
    make: Callable[[], nn.Module]
    shape: tuple
    batch_first: bool = True
    rules: tuple = ()  # rules that must fire
    product: bool = False  # a matrix-product weight: also run through the cost model


CASES = [
    # elementwise
    Case("layer-scale", around(lambda m, h: h * m.gamma, gamma=(D,)), (B, T, D), rules=("mul.other",)),
    Case("layer-scale-left", around(lambda m, h: m.gamma * h, gamma=(D,)), (B, T, D), rules=("mul.self",)),
    Case("llama-rmsnorm", llama, (B, T, D), rules=("mul.self",)),
    Case("learned-bias", around(lambda m, h: h + m.b, b=(D,)), (B, T, D), rules=("add.other",)),
    Case("learned-bias-left", around(lambda m, h: m.b + h, b=(D,)), (B, D), rules=("add.self",)),
    Case("position-table", around(lambda m, h: h + m.pos, pos=(T, D)), (B, T, D), rules=("add.other",)),
    Case("position-table-batch-second", around(lambda m, h: h + m.pos, pos=(T, 1, D)), (T, B, D),
         batch_first=False, rules=("add.other",)),
    Case("sub-param-second", around(lambda m, h: h - m.b, b=(T, D)), (B, T, D), rules=("sub.other",)),
    Case("sub-param-first", around(lambda m, h: m.b - h, b=(D,)), (B, T, D), rules=("sub.self",)),
    Case("div-denominator", around(lambda m, h: h / m.s, s=(D,)), (B, T, D), rules=("div.other",)),
    Case("div-numerator", around(lambda m, h: m.s / (h * h + 1), s=(T, 1)), (B, T, D), rules=("div.self",)),
    Case("addcmul-tensor2", around(lambda m, h: torch.addcmul(h, h, m.gamma), gamma=(D,)), (B, T, D),
         rules=("addcmul.tensor2",)),
    Case("addcmul-self-tensor1", around(lambda m, h: torch.addcmul(m.b, m.gamma, h), b=(D,), gamma=(1, D)),
         (B, T, D), rules=("addcmul.self", "addcmul.tensor1")),
    Case("merged-batch", around(lambda m, h: (h.reshape(-1, D) * m.gamma).view(h.shape), gamma=(D,)), (B, T, D),
         rules=("mul.other",)),
    Case("used-twice", around(lambda m, h: h * m.g + m.g, g=(D,)), (B, T, D), rules=("mul.other", "add.other")),
    # A product by 1 is dropped (the bias of addmm's decomposition, beta = 1), unless it
    # copies a strided value into the contiguous one a later view needs.
    Case("times-one", around(lambda m, h: h * (m.g * 1), g=(D,)), (B, T, D), rules=("mul.other",)),
    Case("strided-times-one", around(lambda m, h: (h[:, ::2] * 1).view(h.shape[0], -1) * m.g, g=(3 * D,),
                                     d_out=3 * D), (B, T, D), rules=("mul.other",)),
    # One parameter as two arguments of one op: both uses are per-sample (the second was
    # once taken as an ordinary gradient, leaving the norms short).
    Case("twice-in-one-addcmul", around(lambda m, h: torch.addcmul(m.g, h, m.g), g=(D,)), (B, T, D),
         rules=("addcmul.self", "addcmul.tensor2")),
    Case("layer-norm-weight-as-bias", around(lambda m, h: F.layer_norm(h, (D,), m.g, m.g), g=(D,)), (B, T, D),
         rules=("layer_norm.weight", "layer_norm.bias")),
    Case("shared-table-broadcast", SharedTable, (B, T, D), rules=("mul.other",)),
    # 0-d parameters (a learned temperature, ReZero's alpha): per-sample gradients [B]
    Case("scalar-scale", around(lambda m, h: h * m.s, s=()), (B, T, D), rules=("mul.other",)),
    Case("scalar-scale-and-shift", around(lambda m, h: m.s * h + m.t, s=(), t=()), (B, D),
         rules=("mul.self", "add.other")),
    Case("layer-scale-batch-of-one", around(lambda m, h: h * m.gamma, gamma=(D,)), (1, T, D), rules=("batch-of-one",)),
    # matrix products
    Case("matmul-weight", around(lambda m, h: h @ m.W, d_out=6, W=(D, 6)), (B, T, D), rules=("matmul.other",),
         product=True),
    Case("matmul-weight-merged", around(lambda m, h: (h.reshape(-1, D) @ m.W).view(*h.shape[:-1], 6), d_out=6,
                                        W=(D, 6)),
         (B, T, D), rules=("matmul.other",), product=True),
    Case("matmul-vector", around(lambda m, h: (h @ m.w).unsqueeze(-1).expand(*h.shape[:-1], D), w=(D,)), (B, T, D),
         rules=("matmul.other",)),
    Case("matmul-weight-left", around(lambda m, h: (m.W @ h.transpose(-1, -2)).transpose(-1, -2), d_out=6, W=(6, D)),
         (B, T, D), rules=("matmul.self",), product=True),
    Case("matmul-vector-left", around(lambda m, h: (m.w @ h.unsqueeze(-1)), d_out=1, w=(D,)), (B, T, D),
         rules=("matmul.self",)),
    Case("matmul-per-head", around(lambda m, h: (h.view(*h.shape[:-1], H, D // H).transpose(1, 2) @ m.W)
                                   .transpose(1, 2).reshape(*h.shape[:-1], H * 3), d_out=H * 3, W=(H, D // H, 3)),
         (B, T, D), rules=("matmul.other",), product=True),
    Case("hf-conv1d", gpt2_mlp(), (B, T, D), rules=("addmm.mat2", "addmm.self"), product=True),
    Case("mm-batch-in-columns", around(lambda m, h: torch.mm(m.W, h.t()).t(), d_out=6, W=(6, D)), (B, D),
         rules=("mm.self",), product=True),
    Case("bmm-per-head", around(lambda m, h: torch.bmm(h.view(-1, H, D // H).transpose(0, 1), m.W)
                                .transpose(0, 1).reshape(-1, H * 3), d_out=H * 3, W=(H, D // H, 3)), (B, D),
         rules=("bmm.mat2",)),
    Case("baddbmm-per-head", around(lambda m, h: torch.baddbmm(m.c, h.view(-1, H, D // H).transpose(0, 1), m.W)
                                    .transpose(0, 1).reshape(-1, H * 3), d_out=H * 3, W=(H, D // H, 3), c=(H, 1, 3)),
         (B, D), rules=("baddbmm.batch2", "baddbmm.self")),
    Case("matmul-ghost-sized", around(lambda m, h: h @ m.W, d_out=16, W=(D, 16)), (B, 1, D), rules=("matmul.other",),
         product=True),
]

TABLE = [pytest.param(c, id=c.id) for c in CASES] + [
    pytest.param(Case("add-alpha", around(lambda m, h: torch.add(h, m.pos, alpha=2.0), pos=(T, D)), (B, T, D),
                      rules=("add.other",)), id="add-alpha"),
    pytest.param(Case("addcmul-value", around(lambda m, h: torch.addcmul(h, h, m.gamma, value=0.5), gamma=(D,)),
                      (B, T, D), rules=("addcmul.tensor2",)), id="addcmul-value"),
    pytest.param(Case("hf-conv1d-beta-alpha", gpt2_mlp((0.5, 2.0)), (B, T, D), rules=("addmm.mat2",)),
                 id="hf-conv1d-beta-alpha"),
    pytest.param(Case("einsum-weight", EinsumWeight, (B, T, D), rules=("bmm.mat2",)), id="einsum-weight"),
    pytest.param(Case("einsum-weight-first", EinsumWeightFirst, (B, T, D)), id="einsum-weight-first"),
    pytest.param(Case("einsum-per-head", EinsumPerHead, (B, T, D)), id="einsum-per-head"),
    pytest.param(Case("einsum-attention", EinsumAttention, (B, T, D)), id="einsum-attention"),
]

RUNS = [
    pytest.param(torch.float64, "sum", id="f64-sum"),
    pytest.param(torch.float32, "mean", id="f32-mean"),
]


def _per_sample_loss(out: torch.Tensor, target: torch.Tensor, batch_dim: int) -> torch.Tensor:
    return (out - target).pow(2).movedim(batch_dim, 0).flatten(1).sum(1)


def _params(model: nn.Module, attr: str) -> dict:
    return {n: getattr(p, attr, None) for n, p in model.named_parameters() if p.requires_grad}


def _clip_between(norms: torch.Tensor) -> float:
    """A clip norm that clips the largest sample and leaves the smallest."""
    return 0.5 * (norms.min() + norms.max()).item()


def _setup(case: Case, dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    model = case.make().to(dtype)
    x = torch.randn(case.shape, dtype=dtype)
    batch_dim = 0 if case.batch_first else 1
    with torch.no_grad():
        target = torch.randn_like(model(x))
    ref = reference(model, (x,), lambda out, i: _per_sample_loss(out, target.narrow(batch_dim, i, 1), batch_dim).sum(),
                    batch_dim=batch_dim)
    return model, x, target, batch_dim, ref


def _step(case: Case, model, x, target, batch_dim, reduction, **options) -> fxdp.DPModule:
    dp = fxdp.transform(model, loss_reduction=reduction, batch_first=case.batch_first,
                        compiler=options.pop("compiler", "eager"), **options)
    loss = _per_sample_loss(dp(x), target, batch_dim)
    (loss.mean() if reduction == "mean" else loss.sum()).backward()
    return dp


def _check(case, dp, model, ref, reduction, max_grad_norm, tol):
    assert_close_all({"norms": dp.per_sample_norms}, {"norms": ref.norms}, tol, f"{case.id}: norms")
    factors = ref.clip_factors(max_grad_norm)
    assert len(factors) == 1 or 0 < int((factors < 1).sum()) < len(factors), "clipping must bind for some samples only"
    assert_close_all({"clip": dp.clip_factors}, {"clip": factors}, tol, f"{case.id}: clip factors")
    assert_close_all(_params(model, "grad"), ref.grad(reduction, max_grad_norm), tol, f"{case.id}: clipped grad")
    fired = dp.explain().rule_counts
    for rule in case.rules:
        assert fired.get(rule), f"{case.id}: rule {rule} did not fire ({fired})"


@pytest.mark.parametrize("dtype,reduction", RUNS)
@pytest.mark.parametrize("case", TABLE)
def test_grad_sample_and_clipping(case: Case, dtype: torch.dtype, reduction: str):
    model, x, target, batch_dim, ref = _setup(case, dtype)
    max_grad_norm = _clip_between(ref.norms)
    tol = tolerance(dtype)
    dp = _step(case, model, x, target, batch_dim, reduction, max_grad_norm=max_grad_norm, grad_sample=True)
    assert_close_all(_params(model, "grad_sample"), ref.per_sample, tol, f"{case.id}: grad_sample")
    _check(case, dp, model, ref, reduction, max_grad_norm, tol)


PRODUCTS = [c for c in CASES if c.product]


@pytest.mark.parametrize("case", PRODUCTS, ids=[c.id for c in PRODUCTS])
def test_norm_strategy(case: Case):
    """Without grad samples each product weight takes the cheaper route; both are exact."""
    model, x, target, batch_dim, ref = _setup(case, torch.float64, seed=1)
    max_grad_norm = _clip_between(ref.norms)
    dp = _step(case, model, x, target, batch_dim, "mean", max_grad_norm=max_grad_norm)
    _check(case, dp, model, ref, "mean", max_grad_norm, tolerance(torch.float64))
    for plan in dp.explain().plans:
        # A kept per-sample gradient (smaller than its operands) saves the deferred
        # contraction, so it instantiates whatever the norm alone would cost.
        if plan.costs and plan.strategy != "instantiate + keep":
            assert plan.strategy == min(plan.costs, key=plan.costs.get), plan


def test_both_strategies_are_reached():
    chosen = set()
    for case in PRODUCTS:
        if case.id in ("matmul-weight", "matmul-ghost-sized"):
            model, x, target, batch_dim, ref = _setup(case, torch.float64, seed=1)
            dp = _step(case, model, x, target, batch_dim, "sum", max_grad_norm=_clip_between(ref.norms))
            chosen |= {p.strategy.removesuffix(" + keep") for p in dp.explain().plans if p.name == "W"}
            torch._dynamo.reset()
    assert chosen == {"ghost", "instantiate"}, chosen


def test_inductor_conv1d_and_layer_scale():
    """One case through Inductor: HF Conv1D then a layer scale, float32, clipped."""
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc, self.c_proj = Conv1D(6, D), Conv1D(D, 6)
            self.gamma = nn.Parameter(1 + 0.5 * torch.randn(D))

        def forward(self, x):
            return x + self.c_proj(torch.tanh(self.c_fc(x))) * self.gamma

    case = Case("inductor", Block, (B, T, D))
    model, x, target, batch_dim, ref = _setup(case, torch.float32)
    max_grad_norm = _clip_between(ref.norms)
    dp = _step(case, model, x, target, batch_dim, "mean", max_grad_norm=max_grad_norm, grad_sample=True,
               compiler="inductor")
    tol = tolerance(torch.float32)
    assert_close_all(_params(model, "grad_sample"), ref.per_sample, tol, "inductor: grad_sample")
    _check(case, dp, model, ref, "mean", max_grad_norm, tol)


# ---------------------------------------------------------------------------
# Parameter transforms (the core maps per-sample gradients back through them)
# ---------------------------------------------------------------------------

TRANSFORMS = [
    Case("gemma-rmsnorm-one-plus-w", lambda: nn.Sequential(nn.Linear(D, D), GemmaRMSNorm(D), nn.Linear(D, 3)),
         (B, T, D), rules=("mul.other",)),
    Case("vit-cls-token-expand-cat", ClsToken, (B, T, D)),
    Case("cls-token-broadcast-to-tiles", ClsTokenBroadcast, (B, 2, T, D)),
    Case("clip-logit-scale-exp", around(lambda m, h: h * m.s.exp(), s=()), (B, T, D)),
]


@pytest.mark.parametrize("case", TRANSFORMS, ids=[c.id for c in TRANSFORMS])
def test_parameter_transforms(case: Case):
    model, x, target, batch_dim, ref = _setup(case, torch.float64)
    max_grad_norm = _clip_between(ref.norms)
    dp = _step(case, model, x, target, batch_dim, "sum", max_grad_norm=max_grad_norm, grad_sample=True)
    assert_close_all(_params(model, "grad_sample"), ref.per_sample, 1e-9, f"{case.id}: grad_sample")
    _check(case, dp, model, ref, "sum", max_grad_norm, 1e-9)


class _Blocks(nn.Module):
    """One parameter used by several ops, each on a block of it: ``w[e]`` of a stacked
    weight (a negative index among them, one transposed after the select, one block
    unused), the slices of a packed one, the pieces of a ``chunk`` and of an ``unbind``
    after a ``view``; with ``overlap`` two slices share a row."""

    def __init__(self, overlap: bool = False):
        super().__init__()
        self.stacked = nn.Parameter(torch.randn(4, D, D) / D ** 0.5)
        self.packed = nn.Parameter(torch.randn(2 * D, D) / D ** 0.5)
        self.chunked = nn.Parameter(torch.randn(2 * D, D) / D ** 0.5)
        self.flat = nn.Parameter(torch.randn(2 * D * D) / D ** 0.5)
        self.overlap = overlap

    def forward(self, x):
        h = torch.tanh(F.linear(x, self.stacked[0]) + x @ self.stacked[1].t()) * F.linear(x, self.stacked[-1])
        cut = D + 1 if self.overlap else D
        h = torch.tanh(F.linear(h, self.packed[:cut])).sum(-1, keepdim=True) * F.linear(h, self.packed[D:])
        first, second = self.chunked.chunk(2)
        h = torch.tanh(F.linear(h, first)) + F.linear(h, second)
        first, second = self.flat.view(2, D, D).unbind(0)
        return torch.tanh(F.linear(h, first)) * F.linear(h, second)


@pytest.mark.parametrize("grad_sample", [False, True], ids=["clip", "grad_sample"])
@pytest.mark.parametrize("overlap", [False, True], ids=["disjoint", "overlapping"])
def test_uses_of_blocks_of_one_parameter(overlap, grad_sample):
    """Disjoint blocks' per-sample norms add up, each taken in its use's own space: no
    ``[B, *p.shape]`` gradient per use (which a loop of experts over a stacked weight made
    for every expert before the forty-ninth session); with ``grad_sample`` each block's
    per-sample gradient is put in its place of one (before the fiftieth session: one per
    use). Overlapping ones keep the per-sample VJP into the parameter."""
    torch.manual_seed(0)
    model = _Blocks(overlap).double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    ref = reference(model, (x,), lambda out, i: out.pow(2).sum())
    clip = float(ref.norms.median())
    dp = fxdp.transform(model, max_grad_norm=clip, grad_sample=grad_sample, loss_reduction="sum", compiler="eager")
    dp(x).pow(2).sum().backward()
    torch.testing.assert_close(dp.per_sample_norms, ref.norms)
    assert_close_all(_params(model, "grad"), ref.grad("sum", clip), 1e-9, "clipped")
    if grad_sample:
        assert_close_all(_params(model, "grad_sample"), ref.per_sample, 1e-9, "grad_sample")
    plan = {line.split(":")[0].strip(): line for line in str(dp.explain()).splitlines() if " uses=" in line}
    assert all("per block" in plan[name] for name in ("stacked", "chunked", "flat")), plan
    assert ("instantiate (per-sample VJP)" if overlap else "per block") in plan["packed"], plan
    if grad_sample:
        assert "instantiate per block" in plan["stacked"], plan  # the gradients exist anyway


# ---------------------------------------------------------------------------
# The propagation rules alone
# ---------------------------------------------------------------------------


def _meta(*shape):
    return torch.empty(shape, device="meta")


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a.same_as(b)


@pytest.mark.parametrize("a,b,a_batch,b_batch,want", [
    ((B, T, D), (D, 6), BatchDim(0), None, BatchDim(0)),
    ((B * T, D), (D, 6), BatchDim(0, T), None, BatchDim(0, T)),
    ((T, B, D), (D,), BatchDim(1), None, BatchDim(1)),          # vector: the output loses a dim
    ((B, T, D), (D,), BatchDim(0), None, BatchDim(0)),
    ((D,), (B, D, 6), None, BatchDim(0), BatchDim(0)),
    ((6, D), (D, B), None, BatchDim(1), BatchDim(1)),
    ((H, 6, D), (B, 1, D, T), None, BatchDim(0), BatchDim(0)),
    ((B, H, T, D), (H, D, 6), BatchDim(0), None, BatchDim(0)),
    ((B, T, D), (B, D, T), BatchDim(0), BatchDim(0), BatchDim(0)),
    ((B, T, D), (D, 6), WHOLE, None, WHOLE),
])
def test_matmul_batch(a, b, a_batch, b_batch, want):
    assert _same(matmul_batch(a_batch, b_batch, len(a), len(b)), want)
    # The registered rule is the same propagation, for every matmul of a graph.
    rule = fxdp.registry.lookup(aten.matmul.default)
    assert _same(rule.batch_rule([a_batch, b_batch], [_meta(*a), _meta(*b)], None, {}), want)


@pytest.mark.parametrize("a,b,a_batch,b_batch,match", [
    ((T, D), (D, B), None, BatchDim(0), "contracted"),
    ((D, B), (B, 6), BatchDim(1), None, "contracted"),
    ((B,), (B, 6), BatchDim(0), None, "vector"),
    ((B, T, D), (D, B), BatchDim(0), BatchDim(1), "different dims"),
])
def test_matmul_batch_mixes_samples(a, b, a_batch, b_batch, match):
    with pytest.raises(ValueError, match=match):
        matmul_batch(a_batch, b_batch, len(a), len(b))


def test_broadcast_batch_and_the_mul_rule():
    """One broadcasting propagation (``fxdp.batching.broadcast_batch``) serves the core's
    untagged elementwise ops and the elementwise rules, which replace it for mul/add/..."""
    rule = fxdp.registry.lookup(aten.mul.Tensor)
    cases = [
        ([BatchDim(0), None], [_meta(B, T, D), _meta(D)], BatchDim(0)),
        ([None, BatchDim(1)], [_meta(T, 1, D), _meta(T, B, D)], BatchDim(1)),
        ([BatchDim(0, T), None], [_meta(B * T, D), 2.0], BatchDim(0, T)),
        ([BatchDim(0), BatchDim(1)], [_meta(B, D), _meta(T, B, D)], BatchDim(1)),
        ([None, None], [_meta(D), _meta(D)], None),
    ]
    for batches, metas, want in cases:
        assert _same(broadcast_batch(batches, metas, max(m.dim() for m in metas if isinstance(m, torch.Tensor))), want)
        out = torch.empty(torch.broadcast_shapes(*[m.shape for m in metas if isinstance(m, torch.Tensor)]),
                          device="meta")
        assert _same(rule.batch_rule(batches, metas, out, {}), want)
    with pytest.raises(ValueError, match="different dims"):
        rule.batch_rule([BatchDim(0), BatchDim(0)], [_meta(B, T, D), _meta(T, D)], _meta(B, T, D), {})


@pytest.mark.parametrize("equation,reason", [
    ("btd,btd->td", "the batch dim is contracted"),
    ("bd,cd->bc", "samples are multiplied together"),
], ids=["contracts-batch", "cross-sample"])
def test_einsum_mixing_samples_is_refused(equation, reason):
    """An einsum that contracts the batch, or pairs every sample with every other, mixes
    samples: the matrix products it is made of are refused, with the op named."""

    class Mix(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            h = self.lin(x)
            return torch.einsum(equation, h, h).sum()

    shape = (B, T, D) if equation.startswith("btd") else (B, D)
    problems = fxdp.validate(Mix(), torch.randn(shape))
    assert [(p.op, reason in p.reason) for p in problems] == [("aten.bmm.default", True)], problems


def test_rule_functions_on_layouts():
    """A ParamRule alone, on batch-major operands of a batch-second ``[T, B, d] * gamma``
    and of a merged ``[B·T, d] @ W``, against per-sample autograd."""
    torch.manual_seed(4)
    mul = fxdp.registry.lookup(aten.mul.Tensor).params[1]
    x = torch.randn(T, B, D, dtype=torch.float64)  # gamma [1, D] is not an operand of its rule
    g = torch.randn(T, B, D, dtype=torch.float64)
    config = {"layouts": (Layout(3, 1, False, None), Layout(2, None, False, (1, D))),
              "out_layout": Layout(3, 1, False, None), "out_ndim": 3, "scalars": {}}
    got = mul.per_sample_grad(g.movedim(1, 0), x.movedim(1, 0), **config)
    want = torch.stack([(g[:, i] * x[:, i]).sum(0, keepdim=True) for i in range(B)])
    torch.testing.assert_close(got, want)

    mm = fxdp.registry.lookup(aten.mm.default).params[1]
    a = torch.randn(B * T, D, dtype=torch.float64)  # W [D, 6] is not an operand of its rule
    g = torch.randn(B * T, 6, dtype=torch.float64)
    config = {"layouts": (Layout(2, 0, True, None), Layout(2, None, False, (D, 6))),
              "out_layout": Layout(2, 0, True, None), "out_ndim": 2, "alpha": 1}
    major = lambda t: t.reshape(B, T, -1)  # noqa: E731  (batch_major of BatchDim(0, inner=T))
    want = torch.stack([a[i * T:(i + 1) * T].t() @ g[i * T:(i + 1) * T] for i in range(B)])
    torch.testing.assert_close(mm.per_sample_grad(major(g), major(a), **config), want)
    torch.testing.assert_close(mm.ghost_sq_norm(major(g), major(a), **config), want.flatten(1).pow(2).sum(1))
    torch.testing.assert_close(mm.sum_grad(major(g), major(a), **config), want.sum(0))


# ---------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------


def _reasons(model: nn.Module, x: torch.Tensor, **options) -> str:
    return "\n".join(str(p) for p in fxdp.validate(model, x, **options))


def test_parameter_along_the_batch_dim_is_refused():
    """``x [B, d] * p [B, d]``: each sample would use its own row of the parameter."""
    model = around(lambda m, h: h * m.p, p=(B, D))()
    assert "along the batch dim" in _reasons(model, torch.randn(B, D))


def test_bmm_weight_along_the_batch_dim_is_refused():
    model = around(lambda m, h: torch.bmm(h.view(B, 1, D), m.W).view(B, D), W=(B, D, D))()
    assert "along the batch dim" in _reasons(model, torch.randn(B, D))


class ExpandedWeight(nn.Module):
    """A weight expanded to the batch for a batched product: ``bmm(h, W.expand(B, k, m))``
    (also by ``repeat``), and ``baddbmm`` with ``beta``/``alpha``."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(D, D)
        self.W = nn.Parameter(torch.randn(D, D) / D ** 0.5)
        self.c = nn.Parameter(torch.randn(T + 1, D), requires_grad=kind == "baddbmm_shared_c")

    def forward(self, x):
        h, n = self.inp(x), x.shape[0]
        if self.kind == "expand":
            return torch.bmm(h, self.W.expand(n, D, D))
        if self.kind == "repeat":
            return torch.bmm(h, self.W.unsqueeze(0).repeat(n, 1, 1))
        if self.kind == "baddbmm_shared_c":  # a trainable c [T, D] broadcast over the batch
            return torch.baddbmm(self.c[:h.shape[1]], h, self.W[None].expand(n, -1, -1), beta=1.3, alpha=0.7)
        return torch.baddbmm(h, h, self.W[None].expand(n, -1, -1), beta=0.5, alpha=2.0)


@pytest.mark.parametrize("kind", ["expand", "repeat", "baddbmm", "baddbmm_shared_c"])
def test_weight_expanded_to_the_batch_in_a_batched_product(kind: str):
    """Exact, as the matmul rule (ghost norms available), not the generic fallback;
    a second batch size runs through the same transform."""
    torch.manual_seed(0)
    model = ExpandedWeight(kind).double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    dp = _against_the_loop(model, x)
    assert {p.name: p.rule for p in dp.explain().plans}["W"] == "matmul.other"
    _against_the_loop(model, torch.randn(B + 2, T + 1, D, dtype=torch.float64), dp=dp)


class TiledPerHead(nn.Module):
    """DeBERTa's relative-position attention: a parameter's projection split into heads
    ``[H, R, d]`` and tiled over the batch to ``[B·H, R, d]`` (``repeat(B, 1, 1)``, or
    ``expand`` + ``reshape``), in a batched product with queries ``[B·H, T, d]`` (the
    batch merged with the heads); ``left``: the tile is the first operand, transposed
    and scaled."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.q = nn.Linear(D, D)
        self.rel = nn.Parameter(torch.randn(6, D))
        self.pos = nn.Linear(D, D)

    def forward(self, x):
        n, t, _ = x.shape
        q = self.q(x).view(n, t, H, D // H).permute(0, 2, 1, 3).reshape(n * H, t, D // H)
        heads = self.pos(self.rel).view(6, H, D // H).permute(1, 0, 2)  # [H, 6, d]
        if self.kind == "expand":
            tiled = heads[None].expand(n, -1, -1, -1).reshape(n * H, 6, D // H)
        else:
            tiled = heads.repeat(n, 1, 1)
        if self.kind == "left":
            return torch.bmm(tiled.transpose(1, 2).transpose(-1, -2) / 2.0, q.transpose(1, 2)).view(n, H, 6, t)
        return torch.bmm(q, tiled.transpose(-1, -2)).view(n, H, t, 6)


@pytest.mark.parametrize("kind", ["repeat", "expand", "left"])
def test_shared_value_tiled_over_a_batch_merged_with_heads(kind: str):
    """Exact (the tile becomes a broadcast operand of ``matmul``); a second batch size
    runs through the same transform."""
    torch.manual_seed(0)
    model = TiledPerHead(kind).double()
    dp = _against_the_loop(model, torch.randn(B, T, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 2, T + 1, D, dtype=torch.float64), dp=dp)


class LearnedQueries(nn.Module):
    """``nn.MultiheadAttention`` with learned queries shared by the batch: SigLIP's
    pooling head (``probe.repeat(B, 1, 1)``, batch first) and DETR's object queries
    (``queries.unsqueeze(1).repeat(1, B, 1)``, sequence first, several of them)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(D, D)
        self.queries = nn.Parameter(torch.randn(1 if kind == "probe" else 3, D))
        self.mha = nn.MultiheadAttention(D, H, batch_first=kind == "probe")

    def forward(self, x):
        h, n = self.inp(x), x.shape[0]
        if self.kind == "probe":
            return self.mha(self.queries[None].repeat(n, 1, 1), h, h)[0]
        h = h.transpose(0, 1)
        return self.mha(self.queries.unsqueeze(1).repeat(1, n, 1), h, h)[0]


@pytest.mark.parametrize("kind", ["probe", "queries"])
def test_learned_queries_of_multihead_attention(kind: str):
    """Exact (each head's query tile becomes a broadcast operand of ``matmul``), and on
    a second batch size."""
    torch.manual_seed(0)
    model = LearnedQueries(kind).double()
    dp = _against_the_loop(model, torch.randn(B, T, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 2, T + 1, D, dtype=torch.float64), dp=dp)


class RelativePositionsSequenceFirst(nn.Module):
    """XLNet's relative attention, sequence first (``[T, B, d]``): a position table
    expanded to the batch (then a zero-probability dropout and a cast) is projected by an
    ``einsum`` with a parameter, then meets the queries in a second ``einsum`` with the
    batch merged with the heads. ``projected``: the queries are projected by
    ``einsum("ibh,hnd->ibnd")`` too, whose product merges positions with the batch
    (``[T·B]`` rows)."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(T + 3, 1, D))
        self.r = nn.Parameter(torch.randn(D, H, D // H))
        self.q = nn.Parameter(torch.randn(D, H, D // H))

    def forward(self, x):
        t, n = x.shape[:2]
        # As XLNet: computed in float32, expanded, dropped out, cast to the model's dtype.
        table = F.dropout(self.pos[:t].float().expand(-1, n, -1), 0.0, self.training).to(x.dtype)
        keys = torch.einsum("ibh,hnd->ibnd", table, self.r)
        queries = torch.einsum("ibh,hnd->ibnd", x, self.q)
        return torch.einsum("ibnd,jbnd->bnij", queries, keys).permute(2, 0, 1, 3)


def test_einsum_of_an_operand_expanded_to_the_batch():
    """Exact (the einsum runs on the unexpanded table and its result is expanded; the
    second einsum's tile becomes a broadcast matmul operand), and on a second batch
    size and length."""
    torch.manual_seed(0)
    model = RelativePositionsSequenceFirst().double()
    torch._dynamo.reset()
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", batch_first=False, compiler="eager")
    for shape in ((T, B, D), (T + 1, B + 2, D)):
        x = torch.randn(*shape, dtype=torch.float64)
        ref = reference(model, (x,), lambda out, i: out.pow(2).sum(), batch_dim=1)
        for p in model.parameters():
            p.grad_sample = None
        dp(x).pow(2).sum().backward()
        assert_close_all(_params(model, "grad_sample"), ref.per_sample, tolerance(torch.float64), "grad_sample")


class DtypeDonors(nn.Module):
    """``y.type_as(x)`` and ``y.to(x)`` take only ``x``'s dtype: a mask of ones the size
    of the batch (Funnel's default attention mask) and a parameter cast like the
    activations (``w.type_as(h)``) hold no samples of ``x``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x):
        h = self.fc(x)
        mask = torch.ones(x.shape[:2]).type_as(h)[:, :, None]
        return h * self.w.type_as(h) * mask + self.w.to(h)


def test_arguments_that_only_give_a_dtype():
    torch.manual_seed(0)
    dp = _against_the_loop(DtypeDonors().double(), torch.randn(B, T, D, dtype=torch.float64))
    assert {p.name: p.rule for p in dp.explain().plans}["w"] == "add.other, mul.other"


class OwnDtypeDonors(nn.Module):
    """A tensor cast to its own dtype, ``t.type_as(t)`` (ESM's attention casts its
    probabilities so; a weight cast so): the argument that lends the dtype is the
    value read too. ``mask`` multiplies by the samples' own mask (ESM's contact head)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.out = nn.Linear(D, D)
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        h = h.type_as(h) * self.w.type_as(self.w)
        y = F.linear(h, self.out.weight.type_as(self.out.weight), self.out.bias)
        return y * (x[..., :1] > 0).to(y)


def test_a_tensor_cast_to_its_own_dtype_is_read():
    torch.manual_seed(0)
    _against_the_loop(OwnDtypeDonors().double(), torch.randn(B, T, D, dtype=torch.float64))


class ZeroStateCell(nn.Module):
    """Opacus's ``DPLSTM`` as written: the state starts from ``torch.zeros(layers, B, H)``
    built inside the forward, read per layer by ``h0[layer]``, then a linear of it
    (``linear(h0[0], W_hh, b_hh)``: the bias broadcast to the batch) and an elementwise
    gate (``f * c0[0]``)."""

    def __init__(self):
        super().__init__()
        self.ih = nn.Linear(D, 2 * D)
        self.hh = nn.Linear(D, 2 * D)

    def forward(self, x):
        n = x.shape[0]
        h0 = torch.zeros(2, n, D, dtype=x.dtype)
        c0 = torch.zeros(2, n, D, dtype=x.dtype)
        h, c = h0[0], c0[0]
        for t in range(x.shape[1]):
            gates = self.ih(x[:, t]) + self.hh(h)
            f, g = gates.chunk(2, 1)
            c = torch.sigmoid(f) * c + torch.tanh(g)
            h = torch.tanh(c)
        return h


@pytest.mark.parametrize("kind", ["zero_state", "sequence_bias"])
def test_opacus_style_layers_as_written(kind: str):
    torch.manual_seed(0)
    if kind == "zero_state":
        model, x, batch_dim = ZeroStateCell().double(), torch.randn(B, T, D, dtype=torch.float64), 0
    else:
        model, x, batch_dim = SequenceFirstBias(D).double(), torch.randn(T, B, D, dtype=torch.float64), 1
    torch._dynamo.reset()
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", batch_first=batch_dim == 0, compiler="eager")
    ref = reference(model, (x,), lambda out, i: out.pow(2).sum(), batch_dim=batch_dim)
    dp(x).pow(2).sum().backward()
    assert_close_all(_params(model, "grad_sample"), ref.per_sample, tolerance(torch.float64), "grad_sample")


class SizesOnlyGrid(nn.Module):
    """timm's EdgeNeXt ``PositionalEncodingFourier``: a grid built from the input's sizes
    alone, ``torch.ones(B, 2, H, W).cumsum(2)``, through a 1x1 convolution (the
    parameter), added to the data. Row ``b`` of the grid is what sample ``b`` gets alone."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.proj = nn.Conv2d(2, 4, 1)

    def forward(self, x):
        n, _, h, w = x.shape
        grid = torch.ones(n, 2, h, w, dtype=x.dtype).cumsum(2)
        return self.conv(x) + self.proj(x.new_zeros(n, 2, h, w) + grid)


class FeatureSizeIsB(nn.Module):
    """``torch.ones(D)`` with ``D == B`` (a literal size on the first, static compile):
    a shared scale, not a batch dim."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(B, B)

    def forward(self, x):
        return self.lin(x) * torch.ones(B, dtype=x.dtype).cumsum(0)


def test_a_tensor_built_from_the_batch_size_is_per_sample():
    torch.manual_seed(0)
    model = SizesOnlyGrid().double()
    dp = _against_the_loop(model, torch.randn(B, 3, 6, 5, dtype=torch.float64))
    # a new batch size: Dynamo's dynamic recompile, where B is a symbol
    _against_the_loop(model, torch.randn(B + 2, 3, 6, 5, dtype=torch.float64), dp=dp)
    _against_the_loop(model, torch.randn(B + 3, 3, 6, 5, dtype=torch.float64), dp=dp)
    dp = _against_the_loop(FeatureSizeIsB().double(), torch.randn(B, T, B, dtype=torch.float64))
    _against_the_loop(dp.module, torch.randn(B + 1, T, B, dtype=torch.float64), dp=dp)


class FramesTiledOverTheBatch(nn.Module):
    """diffusers' video UNet (``UNetSpatioTemporalConditionModel``) with the frames folded
    into the batch, ``[B·F, T, d]``: frame positions ``arange(F).repeat(B, 1)`` (an
    expand after canonicalisation) through a Linear, and ``AlphaBlender``'s mix of a
    learned factor by an indicator ``zeros(B, F)``, both reshaped to ``[B·F]``."""

    frames = 2

    def __init__(self):
        super().__init__()
        self.proj, self.pos = nn.Linear(D, D), nn.Linear(2, D)
        self.mix = nn.Parameter(torch.tensor([0.3]))

    def forward(self, x):  # [B, F, T, D]
        n = x.shape[0]
        h = self.proj(x.flatten(0, 1))
        frame = torch.arange(self.frames).repeat(n, 1).reshape(-1).to(x.dtype)
        h = h + self.pos(torch.stack([frame.sin(), frame], -1))[:, None, :]
        image_only = torch.zeros(n, self.frames)
        alpha = torch.where(image_only.bool(), torch.ones(1, 1, dtype=x.dtype), torch.sigmoid(self.mix)[..., None])
        return (alpha.reshape(-1)[:, None, None] * h).view(n, -1)


@pytest.mark.parametrize("batch_size", [FramesTiledOverTheBatch.frames, B], ids=["B-equals-frames", "B"])
def test_values_tiled_over_the_batch_by_an_expand(batch_size):
    """Each sample's rows hold the same values, so either dim of ``zeros(B, F)`` may be
    read as the batch when ``B == F`` (a static compile cannot tell them apart)."""
    torch.manual_seed(0)
    model = FramesTiledOverTheBatch().double()
    frames = FramesTiledOverTheBatch.frames
    dp = _against_the_loop(model, torch.randn(batch_size, frames, T, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(batch_size + 2, frames, T, D, dtype=torch.float64), dp=dp)


class NormGateOfFieldsAtBufferBounds(nn.Module):
    """escnn's ``NormNonLinearity``: the channels of a field type sliced at bounds read
    from a buffer (``x[:, idx[0]:idx[1]]``: an unbacked size), the norm of each field,
    and the gate expanded back over the field's channels and reshaped."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)
        self.register_buffer("bounds", torch.tensor([0, 4]))

    def forward(self, x):
        h = self.conv(x)
        n = h.shape[0]
        fields = h[:, self.bounds[0]:self.bounds[1]]
        norm = fields.reshape(n, -1, 2, *h.shape[2:]).norm(dim=2, keepdim=True)
        gate = torch.relu(norm - 0.1) / norm.clamp(min=1e-6)
        return self.head((h * gate.expand(n, -1, 2, *h.shape[2:]).reshape(n, -1, *h.shape[2:])).mean((-1, -2)))


def test_a_gate_expanded_over_fields_sliced_at_a_buffers_bounds():
    """Sinking the expand below the reshape compared sizes that the slice made unbacked:
    a data-dependent guard, refused as "AOTAutograd cannot trace this model's backward"
    before the sixty-fourth session (escnn's every NormNonLinearity; a helper's sweep)."""
    torch.manual_seed(0)
    model = NormGateOfFieldsAtBufferBounds().double()
    dp = _against_the_loop(model, torch.randn(B, 1, 6, 6, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 2, 1, 6, 6, dtype=torch.float64), dp=dp)


class StartTokenAfterCausalAttention(nn.Module):
    """A causal mask built from the length, ``full((T, T), -inf).triu(1)``, then a learned
    start token prepended as ``x.new_zeros(B, 1, d) + start`` (a decoder's shifted
    input): with a static ``B == T`` both are built from sizes equal to ``B``; the mask
    must stay shared and the token be per-sample (its batch is where ``x`` has it, also
    when the width is ``B`` too)."""

    def __init__(self, width: int):
        super().__init__()
        self.start = nn.Parameter(torch.randn(width))
        self.lin = nn.Linear(width, 3)

    def forward(self, x):  # [B, T, D]
        causal = torch.full((x.shape[1], x.shape[1]), float("-inf"), dtype=x.dtype).triu(1)
        h = (x @ x.transpose(1, 2) + causal).softmax(-1) @ x
        start = x.new_zeros(x.shape[0], 1, x.shape[2]) + self.start
        return self.lin(torch.cat([start, h], 1))


@pytest.mark.parametrize("batch_size, width", [(T, D), (T, T), (B, D)],
                         ids=["B-equals-T", "B-equals-T-equals-width", "B"])
def test_a_shared_mask_and_a_per_sample_token_both_sized_like_the_batch(batch_size, width):
    """Refused when ``B == T`` before: either both were read as shared (the token's
    ``cat`` with the data then has no rule) or both as batched (the mask's rows then
    meet the scores' query dim)."""
    torch.manual_seed(0)
    model = StartTokenAfterCausalAttention(width).double()
    dp = _against_the_loop(model, torch.randn(batch_size, T, width, dtype=torch.float64))
    _against_the_loop(model, torch.randn(batch_size + 2, T, width, dtype=torch.float64), dp=dp)


class HalvesOfTheBatchAfterACausalMask(nn.Module):
    """Doge's router in transformers (``router_logits.view(2, B * T, -1)``): the first half
    of the batch's rows meets the second half, after an attention whose causal mask is
    built as transformers builds it, from positions expanded to ``B`` rows and read at
    ``arange(B)``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 2 * D)

    def forward(self, x):  # [B, T, D]
        b, t = x.shape[0], x.shape[1]
        positions = torch.arange(t).unsqueeze(0).expand(b, -1)
        rows, steps = torch.arange(b)[:, None, None], torch.arange(t)
        causal = positions[rows, steps[None, :, None]] >= positions[rows, steps[None, None, :]]
        h = self.lin((x @ x.transpose(1, 2)).masked_fill(~causal, -1e9).softmax(-1) @ x)
        first, second = h.view(2, b * t, -1)
        return first.softmax(-1) * second


def test_a_reshape_mixing_halves_of_the_batch_is_named_not_the_mask_before_it():
    """The refusal names the reshape that mixes samples, not the mask's ``masked_fill``
    ("a shared tensor whose values vary along the batch dim"): that is per-sample once
    the mask is read batched, and with the mask shared the analysis stopped there and never
    saw the reshape (a helper's sweep of transformers' Doge)."""
    reasons = _reasons(HalvesOfTheBatchAfterACausalMask(), torch.randn(B, T, D))
    assert "it reshapes the batch dim into several dims" in reasons, reasons
    assert "vary along the batch dim" not in reasons, reasons


class StatesStackedBeforeTheBatch(nn.Module):
    """xLSTM's sLSTM: its states ``zeros(4, B, H)`` (four stacked before the batch), every
    step's written into ``zeros(4, T + 1, B, H)``, ``states[0] @ R`` meeting the samples.
    At ``B == 4 == H`` their dims of the batch's size are several, and the first read as
    the batch refuses the model ("the parameter has a size other than 1 along the batch
    dim"); each read alone along its own batch dim refuses the write of one into the
    other, so the two are read together."""

    states = 4

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.R = nn.Parameter(torch.randn(D, D))

    def forward(self, x):  # [B, T, D]
        states = torch.zeros(self.states, x.shape[0], D, dtype=x.dtype)
        every = torch.zeros(self.states, x.shape[1] + 1, x.shape[0], D, dtype=x.dtype)
        every[:, 0] = states
        for t in range(x.shape[1]):
            h = torch.tanh(self.lin(x[:, t]) + states[0] @ self.R)
            states = torch.stack([h, states[1] + h, states[2], states[3]])
            every[:, t + 1] = states
        return every[0, 1:].transpose(0, 1) + every[1, -1, :, None]


@pytest.mark.parametrize("batch_size", [StatesStackedBeforeTheBatch.states, B], ids=["B-equals-states", "B"])
def test_states_with_the_batch_second_sized_like_the_batch_twice(batch_size):
    torch.manual_seed(0)
    model = StatesStackedBeforeTheBatch().double()
    dp = _against_the_loop(model, torch.randn(batch_size, T, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(batch_size + 2, T, D, dtype=torch.float64), dp=dp)


class RefusedBesideACellState(nn.Module):
    """An ``LSTMCell`` loop from a zero state ``x.new_zeros(B, H)`` with ``H == B`` (the
    shared reading mixes its rows into the weights' uses), then a BatchNorm in training
    mode, which fxdp refuses in every reading."""

    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(D, B)
        self.norm = nn.BatchNorm1d(B)

    def forward(self, x):  # [B, T, D]
        h = c = x.new_zeros(x.shape[0], self.cell.hidden_size)
        steps = []
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
            steps.append(h)
        return self.norm(torch.stack(steps, 2))


class DrawnFromOneSamplesShape(nn.Module):
    """SpeechT5's consistent dropout: one mask for the batch drawn from the shape of the
    first sample (``torch.bernoulli(h[0], p)``); also ``rand_like``/``zeros_like`` of it."""

    def __init__(self, draw: str):
        super().__init__()
        self.draw = draw
        self.lin = nn.Linear(D, D)

    def forward(self, x):  # [B, T, D]
        h = self.lin(x)
        first = h[0]
        mask = {"bernoulli": lambda: torch.bernoulli(first, p=0.0) == 0,
                "rand_like": lambda: torch.rand_like(first) >= 0,
                "zeros_like": lambda: torch.zeros_like(first) == 0}[self.draw]()
        return torch.where(mask.unsqueeze(0).repeat(h.shape[0], 1, 1), h, 0.0)


@pytest.mark.parametrize("draw", ["bernoulli", "rand_like", "zeros_like"])
def test_a_draw_shaped_like_one_sample_is_shared(draw):
    """These read only the piece's shape; they were taken for sample 0's values and
    refused ("combines the values of one sample taken out of the batch")."""
    torch.manual_seed(0)
    _against_the_loop(DrawnFromOneSamplesShape(draw).double(), torch.randn(B, T, D, dtype=torch.float64))


class StateFromAParametersDtype(nn.Module):
    """An initial state sized by the batch, made from a parameter's dtype and device
    (fastai's AWD-LSTM: ``one_param(self).new_zeros(n_dir, B, H)``), or grown to the
    batch from a state of one row (its ``_change_one_hidden`` after ``reset()``)."""

    def __init__(self, make: str):
        super().__init__()
        self.make = make
        self.rnn = nn.GRU(D, D, batch_first=True)

    def forward(self, x):  # [B, T, D]
        weight = self.rnn.weight_hh_l0
        h0 = {"new_zeros": lambda: weight.new_zeros(1, x.shape[0], D),
              "new_full": lambda: weight.new_full((1, x.shape[0], D), 0.5),
              "zeros_like": lambda: torch.zeros_like(weight)[:1].expand(x.shape[0], D)[None],
              "grown": lambda: torch.cat([torch.zeros(1, 1, D, dtype=x.dtype),
                                          weight.new_zeros(1, x.shape[0] - 1, D)], 1),
              "grown with ones": lambda: torch.cat([torch.zeros(1, 1, D, dtype=x.dtype),
                                                    weight.new_ones(1, x.shape[0] - 1, D)], 1)}[self.make]()
        return self.rnn(x, h0)[0]


@pytest.mark.parametrize("make", ["new_zeros", "new_full", "zeros_like", "grown"])
def test_a_state_made_from_a_parameters_dtype_is_no_use_of_it(make):
    """``new_zeros`` of a parameter reads its dtype, not its values: no use of the
    parameter to make per-sample (it crashed fxdp, "'NoneType' object has no attribute
    'params'", where the size held the batch). Zeros grown to the batch by ``cat`` are
    zeros sized by the batch (``filled_pieces_as_one_fill_pass``; refused before)."""
    torch.manual_seed(0)
    model = StateFromAParametersDtype(make).double()
    dp = _against_the_loop(model, torch.randn(B, T, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 2, T, D, dtype=torch.float64), dp=dp)


def test_integer_fills_joined_keep_their_value():
    """The one fill ``filled_pieces_as_one_fill_pass`` makes keeps an int64 value past
    2**53 (it went through a float)."""
    big = 2**53 + 1

    class Offsets(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, 3)

        def forward(self, x):
            fill = torch.cat([torch.full((1, 3), big), x.new_full((x.shape[0] - 1, 3), big, dtype=torch.long)])
            return self.lin(x) * (fill - big + 2).to(x.dtype)

    torch.manual_seed(0)
    model = Offsets().double()
    x = torch.randn(B, D, dtype=torch.float64)
    dp = _against_the_loop(model, x)
    torch.testing.assert_close(dp(x), model(x))


def test_a_state_grown_with_other_values_after_the_first_row_is_refused():
    """Sample 0 starts from zeros, the others from ones: values placed by position."""
    problems = fxdp.validate(StateFromAParametersDtype("grown with ones").double(),
                             torch.randn(B, T, D, dtype=torch.float64))
    assert problems and any("a shared tensor whose values vary along the batch dim" in p.reason
                            for p in problems), problems


def test_a_refusal_names_only_what_no_reading_explains():
    """The cell's weights were listed too ("a size other than 1 along the batch dim"):
    the reading with the zero state shared named them, though reading it per-sample
    leaves only the BatchNorm."""
    with pytest.raises(fxdp.UnsupportedError) as refused:
        dp = fxdp.transform(RefusedBesideACellState().double(), compiler="eager")
        dp(torch.randn(B, T, D, dtype=torch.float64))
    message = str(refused.value)
    assert "BatchNorm in training mode" in message and "cell" not in message, message


class BiasPlusAConstant(nn.Module):
    """A per-head bias table plus a shared constant of fewer dims, ``rel[None] +
    ones(T, T)`` (T5's position bias plus a causal or padding term), added to the
    scores: the sum is broadcast over the batch."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(D, D)
        self.rel = nn.Parameter(torch.randn(H, T, T))

    def forward(self, x):  # [B, T, D]
        q = self.q(x)
        bias = self.rel[None] + torch.ones(x.shape[1], x.shape[1], dtype=x.dtype).triu(1)
        return ((q @ q.transpose(1, 2))[:, None] + bias).softmax(-1).sum(1) @ q


@pytest.mark.parametrize("batch_size", [B, T], ids=["B", "B-equals-T"])
def test_a_bias_plus_a_constant_of_fewer_dims(batch_size):
    """It was refused ("the parameter has a size other than 1 along the batch dim"): the
    check of the sum's broadcast took the constant's dim 0 for the batch."""
    torch.manual_seed(0)
    model = BiasPlusAConstant().double()
    dp = _against_the_loop(model, torch.randn(batch_size, T, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(batch_size + 2, T, D, dtype=torch.float64), dp=dp)


class LatentsCopiedToTheBatch(nn.Module):
    """Perceiver's latent array copied to every sample: ``expand``, ``repeat`` or
    ``repeat_interleave`` of a size-1 dim, then mixed with the data."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.latents = nn.Parameter(torch.randn(2, D))
        self.lin = nn.Linear(D, D)

    def forward(self, x):  # [B, T, D]
        n = x.shape[0]
        if self.how == "expand":
            latents = self.latents[None].expand(n, -1, -1)
        elif self.how == "repeat":
            latents = self.latents.repeat(n, 1, 1)
        elif self.how == "cat of copies":  # TVP's frame prompter: torch.cat(B * [prompt])
            latents = torch.cat(n * [self.latents[None]])
        else:
            latents = self.latents[None].repeat_interleave(n, 0)
        return latents + latents * self.lin(x).mean(1, keepdim=True)


@pytest.mark.parametrize("how", ["expand", "repeat", "repeat_interleave", "cat of copies"])
def test_latents_copied_to_the_batch(how):
    """``repeat_interleave`` was refused ("the parameter has a size other than 1 along
    the batch dim"); it is now the expand it amounts to, as ``repeat`` is, and so is a
    ``cat`` of ``B`` copies (refused so until the fifty-ninth session)."""
    torch.manual_seed(0)
    model = LatentsCopiedToTheBatch(how).double()
    dp = _against_the_loop(model, torch.randn(B, T, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 2, T, D, dtype=torch.float64), dp=dp)


class CopiesForMergedRows(nn.Module):
    """A parameter copied to a batch dim that holds several rows of each sample: the
    sequence folded into windows ``[B·n, m, D]`` with memory tokens
    ``mem.expand(B·n, -1, -1)`` in front of each (x-transformers'
    ``memory_tokens_interspersed_every``, vit-pytorch's SepViT window tokens); two views
    of each sample stacked ``cat((v1, v2), 0)`` with one class token expanded to all
    ``2·B`` rows (LeJEPA); both (the views of the windows); a position table looked up
    and added to every window."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(D, D)
        if kind == "positions":
            self.pos = nn.Embedding(2, D)
        else:
            self.mem = nn.Parameter(torch.randn(2, D))

    def forward(self, x):  # [B, 2·2, D]
        n, t, d = x.shape
        h = self.lin(x)
        if self.kind == "windows":
            h = h.reshape(n * (t // 2), 2, d)
            h = torch.cat([self.mem.unsqueeze(0).expand(h.shape[0], -1, -1), h], dim=1)
            return self.lin(torch.tanh(h)).reshape(n, -1, d)
        if self.kind == "views of windows":  # [2·B·2, 2, D]: the batch merged both ways
            h = h.reshape(n * (t // 2), 2, d)
            h = torch.cat((h, h.flip(1) * 0.5), 0)
            h = torch.cat([self.mem.unsqueeze(0).expand(h.shape[0], -1, -1), h], dim=1)
            first, second = self.lin(torch.tanh(h)).chunk(2, 0)
            return (first * second).reshape(n, -1, d)
        if self.kind == "views":
            h = torch.cat((h, h.flip(1) * 0.5), 0)
            h = torch.cat([self.mem[:1].unsqueeze(0).expand(h.shape[0], -1, -1), h], dim=1)
            first, second = self.lin(torch.tanh(h)).chunk(2, 0)
            return first * second
        h = h.reshape(n * (t // 2), 2, d) + self.pos(torch.arange(2))  # "positions"
        return self.lin(torch.tanh(h)).reshape(n, t, d)


@pytest.mark.parametrize("kind", ["windows", "views", "views of windows", "positions"])
def test_parameter_copied_to_a_batch_of_merged_rows(kind):
    """Each sample's gradient is the sum over its rows' copies; before, the copy was
    read as shared and its ``cat`` refused ("no per-sample rule")."""
    torch.manual_seed(0)
    model = CopiesForMergedRows(kind).double()
    dp = _against_the_loop(model, torch.randn(B, 4, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 2, 4, D, dtype=torch.float64), dp=dp)
    assert dp.explain().rule_counts.get("embedding.weight" if kind == "positions" else "expand.self")
    _against_the_loop(model, torch.randn(1, 4, D, dtype=torch.float64), dp=dp)


class ClassRowOfTheFirstFrames(nn.Module):
    """TimeSformer's embeddings: frames merged into the batch ``[B·T, 1 + N, D]``, each
    with the class token in front and positions added, then ``e[:B, 0, :]`` read as the
    class tokens of the ``B`` videos: the first ``B`` rows of the merged batch (sample
    0's frames, mostly), but at the class row, alike in every frame. ``"patch row"``
    reads a patch of those frames instead and ``"scaled per frame"`` the class row
    scaled by each frame's own data: both mix samples. ``"buffer written after"`` adds a
    buffer that is written before the class row is read, ``"float32 class token"``
    concatenates it to float64 patches (the ``cat`` promotes it): taking the select down
    to the pieces gave wrong values there (a red team's finding), so those are left as
    they are (refused)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.proj, self.head = nn.Linear(D, D), nn.Linear(D, 3)
        self.cls = nn.Parameter(torch.randn(1, 1, D))
        self.pos = nn.Parameter(torch.randn(1, 3, D))
        self.register_buffer("shift", torch.zeros(1, 3, D))

    def forward(self, x):  # [B, T, 2, D]
        b, t = x.shape[:2]
        e = self.proj(x.reshape(b * t, 2, D))
        cls = self.cls.float() if self.kind == "float32 class token" else self.cls
        e = torch.cat((cls.expand(e.shape[0], -1, -1), e), dim=1) + self.pos
        if self.kind == "buffer written after":
            e = e + self.shift
            self.shift[:, 0].add_(1.0)
        if self.kind == "scaled per frame":
            e = e * x.reshape(b * t, 2, D)[:, :1, :1]
        cls = e[:b, 1 if self.kind == "patch row" else 0, :].unsqueeze(1)
        e = e[:, 1:].reshape(b, t * 2, D)
        return self.head(torch.tanh(torch.cat((cls, e), dim=1)))


def test_the_class_row_of_the_first_frames():
    """Every frame's class row holds ``cls + pos[0]``, so the first ``B`` of them are
    ``B`` copies of it: exact at two batch sizes and frame counts. Before, the slice of
    the merged batch was refused ("it slices the batch dim")."""
    torch.manual_seed(0)
    model = ClassRowOfTheFirstFrames("class row").double()
    dp = _against_the_loop(model, torch.randn(B, 2, 2, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 2, 3, 2, D, dtype=torch.float64), dp=dp)


@pytest.mark.parametrize("kind", ["patch row", "scaled per frame", "buffer written after", "float32 class token"])
def test_another_row_of_the_first_frames_is_refused(kind):
    model, x = ClassRowOfTheFirstFrames(kind).double(), torch.randn(B, 2, 2, D, dtype=torch.float64)
    assert "it slices the batch dim" in _reasons(model, x)


class WindowsRoundedUp(nn.Module):
    """Granite Speech's projector: the sequence padded to ``math.ceil(T / w)`` windows
    merged into the batch, ``[B·n, w, d]``, attended by learned queries. On a batch of
    another length the window count is ``CeilToInt(IntTrueDiv(T, w))``, which the
    backward could not rebuild (a crash, ``NotImplementedError``)."""

    def __init__(self, rounded: str = "up"):
        super().__init__()
        self.rounded = rounded
        self.queries = nn.Parameter(torch.randn(1, 2, D))
        self.keys = nn.Linear(D, D)

    def forward(self, x):  # [B, T, D]
        b, t, d = x.shape
        if self.rounded == "down":  # the windows that fit, int(T / w): TruncToInt
            n = int(t / 4)
            x = x[:, :n * 4].reshape(b * n, 4, d)
        else:
            n = math.ceil(t / 4)
            x = F.pad(x, (0, 0, 0, n * 4 - t)).view(b * n, 4, d)
        attention = (self.queries @ self.keys(x).transpose(1, 2)).softmax(-1)
        return (attention @ x).view(b, n * 2, d)


@pytest.mark.parametrize("rounded", ["up", "down"])
def test_windows_rounded_up_over_two_lengths(rounded):
    torch.manual_seed(0)
    model = WindowsRoundedUp(rounded).double()
    dp = _against_the_loop(model, torch.randn(B, 8, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 1, 10, D, dtype=torch.float64), dp=dp)


class LastWindowOfEachSample(nn.Module):
    """Granite Speech's conformer attention over windows merged into the batch,
    ``[B·n, w, w]``, masks each sample's last window as ``a[n - 1::n].masked_fill_(…)``:
    row ``n - 1`` of every sample's ``n`` (refused before: "it slices the batch dim"; with
    ``n`` a symbol, a second length, until the fifty-eighth session).
    ``step`` other than ``n`` reads rows of other samples: refused. ``"parameter
    written"`` writes a parameter's values there instead (of a copy): its per-sample VJP
    got every sample's rows at once (a crash a red team found in the first version).
    ``"first row"`` masks row 0 instead, ``a[0::n]`` (at a symbolic ``n`` refused until a
    red team found it: the row count the fake tensor gives did not reduce to ``B``)."""

    def __init__(self, step: int | None = None, how: str = "masked"):
        super().__init__()
        self.step, self.how = step, how
        self.q, self.k = nn.Linear(D, D), nn.Linear(D, D)
        if how == "parameter written":
            self.p = nn.Parameter(torch.randn(3))

    def forward(self, x):  # [B, n·3, D]; "padded": [B, t, D] padded to n = ⌈t / 3⌉ windows
        b, t, d = x.shape
        n = t // 3
        if self.how == "padded":
            n = math.ceil(t / 3)
            x = F.pad(x, (0, 0, 0, n * 3 - t))
        a = self.q(x).reshape(b * n, 3, d) @ self.k(x).reshape(b * n, 3, d).transpose(1, 2)
        mask = torch.ones(3, 3, dtype=torch.bool)
        mask[:2, :2] = False
        step = self.step or n
        start = 0 if self.how == "first row" else step - 1
        if self.how == "parameter written":
            a = a.clone()
            a[start::step] = self.p
        else:
            a[start::step].masked_fill_(mask, -1e4)
        return a.softmax(-1).reshape(b, -1)


@pytest.mark.parametrize("how", ["masked", "parameter written", "padded", "first row"])
def test_the_last_window_of_each_sample(how):
    torch.manual_seed(0)
    model = LastWindowOfEachSample(how=how).double()
    dp = _against_the_loop(model, torch.randn(B, 9, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 1, 9, D, dtype=torch.float64), dp=dp)
    # Other lengths: a symbolic n, down to n = 1 (the whole batch); refused before.
    for length in (12, 6, 3) if how != "padded" else (8, 7, 5):
        _against_the_loop(model, torch.randn(B, length, D, dtype=torch.float64), dp=dp)


def test_windows_of_other_samples_are_refused():
    assert "it slices the batch dim" in _reasons(LastWindowOfEachSample(step=2), torch.randn(B, 9, D))


def test_parameter_copied_to_a_batch_of_merged_rows_under_inductor():
    torch.manual_seed(0)
    model = CopiesForMergedRows("views")
    dp = _against_the_loop_under_inductor(model, torch.randn(B, 4, D))
    x = torch.randn(B + 2, 4, D)  # a new batch size: the graph compiled for a dynamic B
    ref = reference(model, (x,), lambda out, i: out.pow(2).sum())
    for p in model.parameters():
        p.grad = None
    dp(x).pow(2).sum().backward()
    assert_close_all(_params(model, "grad_sample"), ref.per_sample, 1e-4, "grad_sample")


class MaskTokensWrittenOver(nn.Module):
    """MONAI's masked autoencoder: a mask token ``repeat``ed to every position of every
    sample, then the kept tokens written over it in place at per-sample positions. The
    repeat is read as an expand of the parameter; the write goes into a copy."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.token = nn.Parameter(torch.randn(1, 1, D))
        self.lin = nn.Linear(D, D)

    def forward(self, x, kept):  # x [B, 2, D], kept [B, 2]: positions among 4
        h = self.lin(x)
        if self.how == "repeat":
            full = self.token.repeat(h.shape[0], 4, 1)
        else:
            full = self.token.repeat_interleave(h.shape[0], 0).repeat(1, 4, 1)
        full[torch.arange(h.shape[0]).unsqueeze(-1), kept] = h
        full[:, 0] += 1.0  # and through a view
        return self.lin(torch.tanh(full))


@pytest.mark.parametrize("how", ["repeat", "repeat_interleave"])
def test_a_copy_of_a_parameter_written_in_place(how):
    """Read as a view of the parameter, the write was refused ("it writes in place into
    a trainable parameter") or crashed Inductor's trace."""
    torch.manual_seed(0)
    model = MaskTokensWrittenOver(how).double()
    kept = torch.stack([torch.randperm(4)[:2] for _ in range(B)])
    _against_the_loop(model, torch.randn(B, 2, D, dtype=torch.float64), kept)


class ExpandedThenBroadcast(nn.Module):
    """A shared table expanded to the batch, then divided by a shared operand that
    broadcasts one of the table's size-1 dims (timm XCiT's Fourier positions, Funnel's
    token-type matrix): the division runs on the unexpanded table and its result is
    expanded to the sizes the division gave it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 2)
        self.scale = nn.Parameter(torch.randn(D))

    def forward(self, x):
        n, t = x.shape[:2]
        table = torch.arange(1, t + 1, dtype=x.dtype).view(1, t, 1).expand(n, t, 1)
        pos = table / torch.arange(1, D + 1, dtype=x.dtype).view(1, 1, D)
        return self.lin(x * self.scale + pos.cumsum(-1))


def test_expanded_value_meets_a_broadcasting_shared_operand():
    torch.manual_seed(0)
    _against_the_loop(ExpandedThenBroadcast().double(), torch.randn(B, T, D, dtype=torch.float64))


class SpectralNormed(nn.Module):
    """A Linear under spectral norm, in train mode: each forward runs one power
    iteration (``u``, ``v`` buffers updated under ``no_grad``), then divides the weight
    by ``uᵀ W v``. ``kind``: the parametrization or the old hook-based function."""

    def __init__(self, kind: str):
        super().__init__()
        wrap = nn.utils.parametrizations.spectral_norm if kind == "parametrization" else nn.utils.spectral_norm
        self.fc = wrap(nn.Linear(D, D))
        self.out = nn.Linear(D, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(x)))


def test_spectral_norm_in_train_mode():
    """Exact against samples run one by one, each on the model as the batch found it
    (the power iteration updates the model at every call, so the loop of one model
    would give sample ``i`` a weight the batch never used); the buffers end as after
    one ordinary forward."""
    import copy

    torch.manual_seed(0)
    model = SpectralNormed("parametrization").double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    refs = [reference(copy.deepcopy(model), (x[i:i + 1],), lambda out, i: out.pow(2).sum()) for i in range(B)]
    per_sample = {n: torch.cat([r.per_sample[n] for r in refs]) for n in refs[0].names}
    after_one_forward = copy.deepcopy(model)
    after_one_forward(x)
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    dp(x).pow(2).sum().backward()
    tol = tolerance(torch.float64)
    assert_close_all(_params(model, "grad_sample"), per_sample, tol, "grad_sample")
    assert_close_all(dict(model.named_buffers()), dict(after_one_forward.named_buffers()), tol, "buffers")


class FakeQuantized(nn.Module):
    """Quantisation-aware training with its observers off: the activations fake-quantised
    with a given scale and zero point (per tensor, as floats or tensors, with the
    ``fake_quant_enabled`` flag, or per channel), or, with ``observe``, a fused observer
    that takes the batch's min and max first (``FusedMovingAvgObsFakeQuantize``)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.conv, self.out = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4 * 16, 3)
        for name, value in {"scale": torch.tensor([0.05]), "zero_point": torch.tensor([128], dtype=torch.int32),
                            "enabled": torch.tensor([1]), "channel_scales": torch.tensor([0.02, 0.05, 0.03, 0.08]),
                            "channel_zeros": torch.zeros(4, dtype=torch.int32), "low": torch.tensor([-1.0]),
                            "high": torch.tensor([1.0])}.items():
            self.register_buffer(name, value)

    def forward(self, x):
        h = self.conv(x)
        if self.kind == "per tensor":
            h = torch.fake_quantize_per_tensor_affine(h, 0.05, 128, 0, 255)
        elif self.kind == "tensor qparams":
            h = torch.ops.aten._fake_quantize_per_tensor_affine_cachemask_tensor_qparams(
                h, self.scale, self.zero_point, self.enabled, 0, 255)[0]
        elif self.kind == "per channel":
            h = torch.fake_quantize_per_channel_affine(h, self.channel_scales, self.channel_zeros, 1, -128, 127)
        else:
            h = torch.ops.aten._fused_moving_avg_obs_fq_helper(
                h, self.enabled, self.enabled, self.low, self.high, self.scale, self.zero_point, 0.01, 0, 255, -1)[0]
        return self.out(torch.relu(h).flatten(1))


@pytest.mark.parametrize("kind", ["per tensor", "tensor qparams", "per channel"])
def test_fake_quantised_activations_with_given_qparams_are_exact(kind):
    """Each element is quantised on its own (float32: PyTorch's fake quantisation takes no
    float64). At one batch size only: PyTorch gives these ops no shapes for a symbolic
    batch, so a second size fails in Dynamo, as under plain ``torch.compile``."""
    torch.manual_seed(0)
    model = FakeQuantized(kind)
    x = torch.randn(5, 3, 4, 4)
    expected = reference(model, (x,), lambda out, i: out.pow(2).sum())
    dp = fxdp.transform(model, grad_sample=True, max_grad_norm=1.0, loss_reduction="sum", compiler="eager")
    dp(x).pow(2).sum().backward()
    tol = tolerance(torch.float32)
    assert_close_all(_params(model, "grad_sample"), expected.per_sample, tol, "grad_sample")
    assert_close_all(_params(model, "grad"), expected.grad("sum", 1.0), tol, "clipped")


def test_a_fused_observer_that_takes_the_batch_s_min_and_max_is_refused():
    assert "_fused_moving_avg_obs_fq_helper" in _reasons(FakeQuantized("observed"), torch.randn(5, 3, 4, 4))


class ScaledBySamples(nn.Module):
    """A weight fake-quantised per channel with one scale per sample: channel ``j`` of
    the weight by sample ``j``'s value."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, x):
        scales = (x[:, 0].detach().abs() + 0.01) / 50
        w = torch.fake_quantize_per_channel_affine(self.lin.weight, scales, torch.zeros(5, dtype=torch.int32),
                                                   1, -128, 127)
        return nn.functional.linear(x, w, self.lin.bias)


def test_per_channel_scales_computed_from_the_samples_are_refused():
    """Read as an elementwise op, the scales lined up with the weight's last dim and
    made it batched: the Linear rule then crashed ("no differentiable non-parameter
    argument")."""
    assert "its per-channel scale or zero point is computed from the samples" in _reasons(
        ScaledBySamples(), torch.randn(5, 5))


class ObservedWeight(nn.Module):
    """A weight fake-quantised by the fused observer (``ao.nn.qat.Linear``'s weight, the
    observer over the weight alone): an op with no ``vmap`` batching rule."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 3)
        for name, value in {"on": torch.tensor([1]), "low": torch.tensor([-1.0]), "high": torch.tensor([1.0]),
                            "scale": torch.tensor([0.05]), "zero_point": torch.tensor([0], dtype=torch.int32)}.items():
            self.register_buffer(name, value)

    def forward(self, x):
        w = torch.ops.aten._fused_moving_avg_obs_fq_helper(
            self.lin.weight, self.on, self.on, self.low, self.high, self.scale, self.zero_point, 0.01, -128, 127, -1)[0]
        return nn.functional.linear(x, w, self.lin.bias)


def test_a_weight_computed_by_an_op_vmap_cannot_batch_is_refused_before_anything_is_written():
    """The per-sample gradients of the weight are mapped back through its computation by
    ``vmap``, which has no rule for the op: refused in the first ``backward()`` (it
    crashed with PyTorch's "Batching rule not implemented"), no gradient written."""
    model = ObservedWeight()
    dp = fxdp.transform(model, max_grad_norm=1.0, compiler="eager")
    with refused("cannot map the per-sample gradients of lin.weight back .* has no batching rule"):
        dp(torch.randn(B, D)).sum().backward()
    assert all(p.grad is None for p in model.parameters())


def _stores_its_weight(kind: str) -> Callable[[], nn.Module]:
    """A model whose forward pre-hooks compute a weight from parameters and store it on
    the module (``module.weight = ...``): ``torch.nn.utils.prune`` (stacked methods, a
    structured one, a pruned bias) or the old hook-based ``spectral_norm`` (in train
    mode: a power iteration per call) and ``weight_norm``."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        if kind == "old spectral_norm":
            return SpectralNormed("hook").double()
        model = nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, 2)).double()
        if kind == "old weight_norm":
            nn.utils.weight_norm(model[0])
        else:
            prune.l1_unstructured(model[0], "weight", 0.5)
            prune.random_unstructured(model[0], "weight", 0.3)
            prune.ln_structured(model[2], "weight", 0.5, n=2, dim=0)
            prune.l1_unstructured(model[2], "bias", 0.5)
        return model

    return make


def _loop_on_fresh_models(make: Callable[[], nn.Module], x: torch.Tensor):
    """The microbatch loop, each sample on a model of its own from ``make`` (such a
    model cannot be deep-copied once a forward stored a weight with a history)."""
    rows = []
    for i in range(x.shape[0]):
        model = make()
        model(x[i:i + 1]).pow(2).sum().backward()
        rows.append({n: p.grad for n, p in model.named_parameters()})
    names = list(rows[0])
    return Reference(names, {n: torch.stack([r[n] for r in rows]) for n in names}, len(rows))


@pytest.mark.parametrize("kind", ["prune", "old spectral_norm", "old weight_norm"])
def test_a_weight_the_forward_computes_from_parameters_and_stores_is_exact(kind):
    """Dynamo returns a stored value from the graph: the stored weight's gradient is zero
    when the loss does not use it (checked at run time), and the per-sample gradients of
    ``weight_orig`` (pruned entries zero), the norms and the clipped sum are the loop's,
    over two steps."""
    make = _stores_its_weight(kind)
    model = make()
    dp = fxdp.transform(model, grad_sample=True, max_grad_norm=0.5, loss_reduction="sum", compiler="eager")
    tol = tolerance(torch.float64)
    for seed in (1, 2):
        torch.manual_seed(seed)
        x = torch.randn(B, T, D, dtype=torch.float64)
        expected = _loop_on_fresh_models(lambda: _with_state_of(make(), model), x)
        dp.zero_grad()
        dp(x).pow(2).sum().backward()
        assert_close_all(_params(model, "grad_sample"), expected.per_sample, tol, "grad_sample")
        assert_close_all(_params(model, "grad"), expected.grad("sum", 0.5), tol, "clipped")
        assert_close_all({"norms": dp.per_sample_norms}, {"norms": expected.norms}, tol, "norms")
    if kind == "prune":
        pruned = model[0].weight_mask == 0
        assert pruned.any() and not model[0].weight_orig.grad_sample[:, pruned].any()


def _with_state_of(model: nn.Module, trained: nn.Module) -> nn.Module:
    """``model`` with ``trained``'s parameters and buffers (no step runs here, but the
    power iteration moves spectral norm's vectors at every call)."""
    with torch.no_grad():
        for mine, theirs in zip([*model.parameters(), *model.buffers()], [*trained.parameters(), *trained.buffers()]):
            mine.copy_(theirs)
    return model


def test_a_loss_that_uses_a_stored_weight_is_refused_before_anything_is_written():
    """A loss that uses the stored weight outside the forward (a penalty on the pruned
    weight) sends it a gradient fxdp could not make per-sample: refused in
    ``backward()``, with no gradient written."""
    model = _stores_its_weight("prune")()
    dp = fxdp.transform(model, grad_sample=True, max_grad_norm=1.0, loss_reduction="sum", compiler="eager")
    x = torch.randn(B, T, D, dtype=torch.float64)
    dp(x).pow(2).sum().backward()  # not used: fine
    dp.zero_grad()
    loss = dp(x).pow(2).sum() + model[0].weight.pow(2).sum()
    with refused("the loss used a value the forward computed from the parameter\\(s\\) 0.weight_orig alone and "
                 "stored .*torch.nn.utils.prune"):
        loss.backward()
    assert all(p.grad is None and getattr(p, "grad_sample", None) is None for p in model.parameters())


class CachesABias(nn.Module):
    """timm's LeViT in eval mode: the forward stores a value of a parameter alone on the
    module (``attention_bias_cache``) and uses it."""

    def __init__(self):
        super().__init__()
        self.biases = nn.Parameter(torch.randn(2, D))
        self.register_buffer("idx", torch.tensor([1, 0]))
        self.cache = {}

    def forward(self, x):
        self.cache["bias"] = self.biases[self.idx].sum(0)
        return x + self.cache["bias"]


def test_a_value_of_parameters_stored_by_the_forward_and_used_there_is_exact():
    """A cache the forward computes afresh and stores (``self.cache["bias"]``, a dict
    entry): exact; a value of parameters alone it *returns* stays refused."""
    torch.manual_seed(0)
    model = CachesABias().double()
    assert fxdp.validate(model, torch.randn(B, D, dtype=torch.float64)) == []
    x = torch.randn(B, D, dtype=torch.float64)
    expected = reference(model, (x,), lambda out, i: out.pow(2).sum())
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    dp(x).pow(2).sum().backward()
    assert_close_all(_params(model, "grad_sample"), expected.per_sample, tolerance(torch.float64), "grad_sample")
    message = _reasons(ReturnsAWeightsNorm(), torch.randn(B, D))
    assert "a value computed from parameters alone) is returned; fxdp cannot see" in message


class StoresAView(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.how = how

    def forward(self, x):
        weight = self.fc.weight
        # kept for a tied head; fastai's WeightDropout stores F.dropout(raw, p) (no copy at p = 0)
        self.kept = weight.t() if self.how == "t" else F.dropout(weight, 0.0, self.training) \
            if self.how == "dropout" else weight.view(-1)
        return torch.tanh(self.fc(x))


@pytest.mark.parametrize("how", ["t", "dropout", "view"])
def test_a_view_of_a_parameter_the_forward_stores_is_the_parameter_stored(how):
    """A view of a parameter the forward stores (``self.wt = self.weight.t()``, a
    dropout with ``p = 0``) is rebuilt by AOTAutograd outside the graph: as with
    ``self.w = self.weight``, a loss that does not use it is exact, and a loss that uses
    it sends a gradient to the parameter past fxdp's backward, which the check after the
    backward finds (it was refused before, view or not)."""
    torch.manual_seed(0)
    model = StoresAView(how).double()
    x = torch.randn(B, D, dtype=torch.float64)
    expected = reference(model, (x,), lambda out, i: out.pow(2).sum())
    dp = fxdp.transform(model, max_grad_norm=0.5, grad_sample=True, loss_reduction="sum", compiler="eager")
    dp(x).pow(2).sum().backward()
    assert_close_all(_params(model, "grad_sample"), expected.per_sample, tolerance(torch.float64), "grad_sample")
    assert_close_all(_params(model, "grad"), expected.grad("sum", 0.5), tolerance(torch.float64), "grad")
    model.zero_grad(set_to_none=True)
    with pytest.raises(fxdp.UnsupportedError, match="is not the clipped gradient fxdp's backward computed"):
        (dp(x).pow(2).sum() + model.kept.sum()).backward()


class ReturnsAWeightsNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return self.fc(x), self.fc.weight.norm()


class ActNormFlow(nn.Module):
    """Glow's actnorm: ``z = (x + bias) * exp(log_scale)`` and the log-determinant of the
    weights alone, returned as one number or given a batch dim."""

    def __init__(self, per_sample: bool):
        super().__init__()
        self.per_sample = per_sample
        self.bias = nn.Parameter(torch.randn(D))
        self.log_scale = nn.Parameter(torch.randn(D) * 0.1)

    def forward(self, x):
        logdet = self.log_scale.sum()
        if self.per_sample:
            logdet = logdet.expand(x.shape[0])
        return (x + self.bias) * self.log_scale.exp(), logdet


def test_a_returned_log_determinant_of_the_weights_is_refused_with_the_fix():
    """A log-determinant of the weights alone, returned: fxdp cannot see how each sample's
    loss uses it. The message says to give it a batch dim; done so, it is exact."""
    message = _reasons(ActNormFlow(per_sample=False), torch.randn(B, D))
    assert "is returned" in message and "logdet.expand(x.shape[0])" in message
    torch.manual_seed(0)
    model = ActNormFlow(per_sample=True).double()
    x = torch.randn(B, D, dtype=torch.float64)

    def nll(out, i):  # each sample's loss: its Gaussian energy minus the log-determinant
        z, logdet = out
        return 0.5 * z.pow(2).sum() - logdet.sum()

    ref = reference(model, [x], nll)
    dp = fxdp.transform(model, grad_sample=True, compiler="eager")
    z, logdet = dp(x)
    (0.5 * z.pow(2).sum(1) - logdet).mean().backward()
    assert_close_all(_params(model, "grad_sample"), ref.per_sample, tolerance(torch.float64), "grad_sample")


class _TokenTypesByPosition(nn.Module):
    """RoBERTa without ``token_type_ids``: per-sample position ids (a cumsum over the
    non-padding tokens) gather a ``[1, P]`` buffer expanded to the batch; or the same
    with ``torch.take_along_dim``, which broadcasts the buffer itself."""

    def __init__(self, kind: str = "gather"):
        super().__init__()
        self.kind = kind
        self.tokens = nn.Embedding(10, D)
        self.token_types = nn.Embedding(2, D)
        self.register_buffer("token_type_ids", torch.randint(0, 2, (1, 12)))

    def forward(self, ids):
        positions = (ids != 1).long().cumsum(1)
        if self.kind == "take_along_dim":
            types = torch.take_along_dim(self.token_type_ids, positions, 1)
        else:
            types = torch.gather(self.token_type_ids.expand(ids.shape[0], -1), 1, positions)
        return self.tokens(ids) + self.token_types(types)


@pytest.mark.parametrize("kind", ["gather", "take_along_dim"])
def test_gather_of_an_expanded_buffer_by_per_sample_positions(kind: str):
    """Exact at every batch size. The ``gather`` takes two graphs: it used to become a
    ``take_along_dim``, whose kernel reads sizes as ints and fixed the dynamic
    recompile's batch size (a new graph for every batch size, as for HF RoBERTa).
    ``take_along_dim`` written in the forward still compiles once per batch size:
    Dynamo's own trace of it adds the guard (plain ``torch.compile`` does the same)."""
    torch.manual_seed(0)
    model = _TokenTypesByPosition(kind).double()
    torch._dynamo.utils.counters.clear()
    dp = _against_the_loop(model, torch.randint(0, 10, (B, T)))
    for batch in (B + 2, B - 1, B + 1):
        _against_the_loop(model, torch.randint(0, 10, (batch, T)), dp=dp)
    if kind == "gather":
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


class _TakeAlongNegative(nn.Module):
    """``take_along_dim`` of a scaled input by indices counted from the end."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, D))
        self.register_buffer("idx", torch.tensor([[-1, -D, 2, -2]]))

    def forward(self, x):
        return torch.take_along_dim(x * self.s, self.idx.expand(x.shape[0], -1), 1)


def test_take_along_dim_with_negative_indices():
    """``torch.take_along_dim`` counts negative indices from the end, as PyTorch does;
    its canonical form, ``gather``, refused them ("index -1 is out of bounds")."""
    torch.manual_seed(0)
    _against_the_loop(_TakeAlongNegative().double(), torch.randn(B, D, dtype=torch.float64))


class _BatchSizedShared(nn.Module):
    """Shared values the size of the batch, as transformers builds them:
    ``zeros(input_ids.shape)`` token types (LayoutLM, MobileBERT, SqueezeBERT),
    ``arange(T).expand(B, -1) + offset`` positions (BART), a table indexed by positions
    repeated to the batch (Whisper), latents expanded to the batch, normalised and
    projected into queries (Perceiver), a gated parameter ``p.expand_as(h)``, and a
    parameter expanded to the batch, projected and softmaxed (ConViT's positional scores
    ``pos_proj(rel_indices.expand(B, ...)).softmax(-1)``), and learned queries expanded to
    the batch and run through parameter-only attention before they meet the data (DETR's
    decoder queries: self-attention over ``query.expand(B, ...)``, written with
    ``scaled_dot_product_attention`` on one expanded value, with ``bmm``s, or with
    ``nn.MultiheadAttention``, whose heads merge with the batch, and a
    ``nn.TransformerDecoderLayer`` over them and the data)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        if kind in ("latents", "expand_as", "softmax", "queries_sdpa", "queries_bmm", "queries_mha",
                    "queries_decoder"):
            self.latents = nn.Parameter(torch.randn(2, D))
            self.k = nn.Linear(D, D)
            if kind == "queries_mha":
                self.attention = nn.MultiheadAttention(D, 2, batch_first=True)
            if kind == "queries_decoder":  # DETR: the queries attend to each other, then to x
                self.decoder = nn.TransformerDecoderLayer(D, 2, 2 * D, dropout=0.0, batch_first=True)
            if kind in ("latents", "softmax"):
                self.q = nn.Linear(D, D)
            if kind == "latents":
                self.norm = nn.LayerNorm(D)
        else:
            self.tokens = nn.Embedding(10, D)
            self.table = nn.Embedding(T + 2, D)

    def forward(self, x):
        if self.kind == "latents":  # x [B, T, D]
            queries = self.q(self.norm(self.latents.expand(x.shape[0], -1, -1)))
            return torch.matmul(queries, self.k(x).transpose(-1, -2))
        if self.kind == "expand_as":  # a gated parameter expanded to the batched value
            h = self.k(x)
            return h + torch.sigmoid(self.latents[0]) * self.latents[1:].expand_as(h)
        if self.kind == "softmax":  # ConViT: a projected buffer expanded to the batch, softmaxed
            scores = self.k(self.latents.expand(x.shape[0], -1, -1)).permute(0, 2, 1).softmax(-1)
            return self.q(x) + scores.cumsum(1).transpose(1, 2).sum(1, keepdim=True)
        if self.kind.startswith("queries"):  # x [B, 2, D]
            q = self.latents.unsqueeze(0).expand(x.shape[0], -1, -1)
            if self.kind == "queries_sdpa":
                q = q + F.scaled_dot_product_attention(q, q, q)
            elif self.kind == "queries_bmm":
                q = q + (q @ q.transpose(1, 2)).softmax(-1) @ q
            elif self.kind == "queries_decoder":
                return self.k(self.decoder(q, x))
            else:
                q = q + self.attention(q, q, q, need_weights=False)[0]
            return self.k(q + x)
        n, t = x.shape  # token ids
        if self.kind == "zeros":
            ids = torch.zeros(x.shape, dtype=torch.long, device=x.device)
        elif self.kind == "indexed":  # Whisper: weight[arange(T)[None].repeat(B, 1)]
            return self.tokens(x) + self.table.weight[torch.arange(t, device=x.device).unsqueeze(0).repeat(n, 1)]
        else:
            ids = torch.arange(t, device=x.device).expand(n, -1) + 2
        return self.tokens(x) + self.table(ids)


@pytest.mark.parametrize("kind", ["zeros", "positions", "indexed", "latents", "expand_as", "softmax",
                                  "queries_sdpa", "queries_bmm", "queries_mha", "queries_decoder"])
def test_shared_values_the_size_of_the_batch(kind: str):
    torch.manual_seed(0)
    model = _BatchSizedShared(kind).double()
    if kind.startswith("queries"):
        x = torch.randn(B, 2, D, dtype=torch.float64)
    elif kind in ("latents", "expand_as", "softmax"):
        x = torch.randn(B, T, D, dtype=torch.float64)
    else:
        x = torch.randint(0, 10, (B, T))
    dp = _against_the_loop(model, x)
    if kind.startswith("queries"):  # and on a new batch size, compiled for any
        _against_the_loop(model, torch.randn(B + 2, 2, D, dtype=torch.float64), dp=dp)


class _QueriesThroughAttention(nn.Module):
    """Learned queries expanded to the batch (and to the heads) that attend to each other
    with ``scaled_dot_product_attention`` before cross-attending the data; the second
    form is ``nn.MultiheadAttention`` sequence-first with ``need_weights=False``, which
    runs the same op; the third splits the heads of expanded queries plus positions with
    a ``view``, which needs their sum dense. SDPA is tagged random (its optional dropout): with ``dropout_p``
    zero it is part of the queries' per-sample transform."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.queries = nn.Parameter(torch.randn(4, D))
        self.kv = nn.Linear(D, 2 * D)
        if kind == "mha":
            self.attention = nn.MultiheadAttention(D, 2)
            self.cross = nn.MultiheadAttention(D, 2)

    def forward(self, x):  # [B, T, D]
        n = x.shape[0]
        if self.kind == "seq_first_heads":  # as F.multi_head_attention_forward splits heads
            q = self.queries.unsqueeze(1).expand(-1, n, -1) + self.queries.flip(0).unsqueeze(1)
            qh = q.contiguous().view(4, n * 2, D // 2).transpose(0, 1)  # [B·H, Q, D/H]
            qh = torch.bmm((qh @ qh.transpose(1, 2)).softmax(-1), qh)
            kh = self.kv(x)[..., :D].transpose(0, 1).contiguous().view(x.shape[1], n * 2, D // 2).transpose(0, 1)
            return torch.bmm(qh, kh.transpose(1, 2))
        if self.kind == "mha":
            q = self.queries.unsqueeze(1).expand(-1, n, -1)  # [Q, B, D]
            h = self.attention(q, q, q, need_weights=False)[0]
            memory = self.kv(x)[..., :D].transpose(0, 1)
            return self.cross(h + q, memory, memory, need_weights=False)[0].transpose(0, 1)
        q = self.queries[None, None].expand(n, 2, -1, -1)
        q = F.scaled_dot_product_attention(q, q, q, is_causal=self.kind == "sdpa_causal")
        k, v = self.kv(x).chunk(2, -1)
        return F.scaled_dot_product_attention(q, k[:, None], v[:, None])


@pytest.mark.parametrize("kind", ["sdpa", "sdpa_causal", "mha", "seq_first_heads"])
def test_queries_through_attention_before_the_data(kind: str):
    torch.manual_seed(0)
    _against_the_loop(_QueriesThroughAttention(kind).double(), torch.randn(B, T, D, dtype=torch.float64))


def test_a_transform_that_reaches_no_parameter_is_refused(monkeypatch):
    """Should the per-sample replay of a parameter-only value lose its way to the
    parameters (here: SDPA taken for a random draw, computed once in the forward), the
    parameter's gradient would flow through ordinary autograd, unclipped: refused."""
    monkeypatch.setattr(fxdp.passes.tag, "_DROPOUT_ARGUMENT", {})
    torch._dynamo.reset()
    model = _QueriesThroughAttention("sdpa").double()
    dp = fxdp.transform(model, max_grad_norm=1.0, compiler="eager")
    with pytest.raises(fxdp.UnsupportedError, match="reaches no trainable parameter"):
        dp(torch.randn(B, T, D, dtype=torch.float64)).sum().backward()
    assert model.queries.grad is None


class _ShiftedWindows(nn.Module):
    """Swin's shifted-window attention: a relative position bias parameter ``[1, H, N, N]``
    plus the shift mask ``[nW, N, N]`` tiled over the batch merged with the windows
    (``mask[None].expand(B, …).reshape(-1, 1, N, N)``), added to the scores or passed
    to ``scaled_dot_product_attention`` as its mask."""

    windows, tokens, heads, width = 3, 4, 2, 4

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.bias = nn.Parameter(torch.randn(1, self.heads, self.tokens, self.tokens))
        self.register_buffer("mask", torch.randn(self.windows, self.tokens, self.tokens))
        self.qkv = nn.Linear(self.width, 3 * self.heads * self.width)

    def forward(self, x):  # [B, nW, N, C]
        n, w, t, c, h = x.shape[0], self.windows, self.tokens, self.width, self.heads
        q, k, v = self.qkv(x.reshape(n * w, t, c)).view(n * w, t, 3, h, c).permute(2, 0, 3, 1, 4)
        tiled = self.mask.unsqueeze(1).unsqueeze(0).expand(n, -1, -1, -1, -1).reshape(-1, 1, t, t)
        if self.kind == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias + tiled)
        else:
            out = (q @ k.transpose(-1, -2) + (self.bias + tiled)).softmax(-1) @ v
        return out.reshape(n, -1)


@pytest.mark.parametrize("kind", ["scores", "sdpa"])
def test_a_mask_tiled_over_windows_merged_with_the_batch(kind: str):
    """Each sample reads one copy of the tile: the scores' version used to be refused
    (the bias's sum with the tile has the merged batch's rows) and the ``sdpa`` one
    crashed in the backward; HF Swin does both."""
    torch.manual_seed(0)
    model = _ShiftedWindows(kind).double()
    dp = _against_the_loop(model, torch.randn(B, 3, 4, 4, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 2, 3, 4, 4, dtype=torch.float64), dp=dp)


class _LearnedAttentionMask(nn.Module):
    """A relative-position table's rows (T5, Swin V1, BEiT) passed straight to
    ``scaled_dot_product_attention`` as its float mask, broadcast over the batch or
    expanded to it; the grouped-query form shares keys and values between heads."""

    tokens, heads, width = 5, 2, 4

    def __init__(self, kind: str, dropout: float = 0.0):
        super().__init__()
        self.kind, self.dropout = kind, dropout
        t, h, c = self.tokens, self.heads, self.width
        self.table = nn.Parameter(torch.randn(2 * t - 1, h))
        self.q = nn.Linear(c, h * c)
        self.kv = nn.Linear(c, (1 if kind == "gqa" else h) * 2 * c)

    def forward(self, x):  # [B, T, C]
        n, t, c, h = x.shape[0], x.shape[1], self.width, self.heads
        q = self.q(x).view(n, t, h, c).transpose(1, 2)
        k, v = self.kv(x).view(n, t, -1, 2 * c).transpose(1, 2).chunk(2, -1)
        rel = torch.arange(t)[:, None] - torch.arange(t)[None, :] + t - 1
        mask = self.table[rel].permute(2, 0, 1)  # [h, T, T]
        if self.kind == "expanded":
            mask = mask.unsqueeze(0).expand(n, -1, -1, -1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout,
                                              enable_gqa=self.kind == "gqa").flatten(1)


@pytest.mark.parametrize("kind", ["broadcast", "expanded", "gqa"])
def test_a_learned_attention_mask(kind: str):
    """The mask expanded to the batch used to crash in the backward: the fused CPU kernel
    has no derivative for ``attn_mask``, so the per-sample gradient is taken through the
    math kernel."""
    torch.manual_seed(0)
    model = _LearnedAttentionMask(kind).double()
    dp = _against_the_loop(model, torch.randn(B, 5, 4, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 2, 5, 4, dtype=torch.float64), dp=dp)


@pytest.mark.parametrize("kind", ["broadcast", "expanded"])
def test_a_learned_attention_mask_with_dropout(kind: str):
    """With dropout the mask's per-sample gradient goes through the forward's own draw
    (vmap refused the fused kernel's). The reference is autograd on the eager model's
    batched graph, sample by sample, with the same seed: PyTorch runs the same math
    kernel for a mask that needs a gradient, so it draws the same dropout."""
    torch.manual_seed(0)
    model = _LearnedAttentionMask(kind, dropout=0.5).double()
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    x = torch.randn(B, 5, 4, dtype=torch.float64)
    torch.manual_seed(5)
    out = dp(x)
    torch.manual_seed(5)
    expected_out = eager(x)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-12)
    out.pow(2).sum().backward()
    names = [n for n, _ in eager.named_parameters()]
    per_sample = [torch.autograd.grad(expected_out[i].pow(2).sum(), list(eager.parameters()),
                                      retain_graph=True) for i in range(B)]
    expected = {n: torch.stack([g[j] for g in per_sample]) for j, n in enumerate(names)}
    assert_close_all(_params(model, "grad_sample"), expected, tolerance(torch.float64), "grad_sample")


class _LazyRelativePositions(nn.Module):
    """ConViT's GPSA: a buffer of relative positions computed on the first call (it
    replaces a placeholder of another shape, written in place into zeros), expanded to
    the batch, projected, softmaxed and mixed with the scores by a gate."""

    def __init__(self):
        super().__init__()
        self.register_buffer("rel", torch.zeros(1, 1, 1, 3), persistent=False)
        self.pos = nn.Linear(3, H)
        self.gate = nn.Parameter(torch.randn(H))
        self.qk = nn.Linear(D, 2 * D)

    def positions(self, side: int) -> torch.Tensor:
        rel = torch.zeros(1, side * side, side * side, 3)
        ind = torch.arange(side).view(1, -1) - torch.arange(side).view(-1, 1)
        rel[:, :, :, 0] = ind.repeat(side, side)
        rel[:, :, :, 1] = ind.repeat_interleave(side, 0).repeat_interleave(side, 1)
        rel[:, :, :, 2] = rel[:, :, :, 0] ** 2 + rel[:, :, :, 1] ** 2
        return rel.to(self.gate.dtype)

    def forward(self, x):  # [B, 4, D]: a 2 x 2 grid
        n, t, _ = x.shape
        if self.rel.shape[1] != t:
            self.rel = self.positions(2)
        q, k = self.qk(x).view(n, t, 2, H, D // H).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)).softmax(-1)
        positional = self.pos(self.rel.expand(n, -1, -1, -1)).permute(0, 3, 1, 2).softmax(-1)
        gate = torch.sigmoid(self.gate.view(1, -1, 1, 1))
        attn = (1 - gate) * scores + gate * positional
        attn /= attn.sum(-1).unsqueeze(-1)
        return (attn @ q).flatten(1)


def test_a_buffer_computed_on_the_first_call():
    """The buffer is computed inside the first graph, then read. (The microbatch loop
    used to put each sample's buffers back by copying into them, which broadcast the
    zero placeholder into the computed buffer from the second sample on.)"""
    torch.manual_seed(0)
    _against_the_loop(_LazyRelativePositions().double(), torch.randn(B, 4, D, dtype=torch.float64))


class _ReassignedBuffer(nn.Module):
    """speechbrain's ``LiGRU_Layer`` in eval: ``self.drop_mask_te = self.drop_mask_te.to(w.device)``
    reassigns one buffer each call, beside another the forward never reads."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.register_buffer("scale", torch.full((D,), 0.5))
        self.register_buffer("unread", torch.ones(2))

    def forward(self, x):
        self.scale = self.scale.to(x.device)
        return self.fc(x) * self.scale


def test_a_buffer_reassigned_beside_one_never_read():
    """Dynamo's record of the reassignment lists the module's buffers unread; finding
    the tensors the forward stores must not read them (the compiled graph would be
    called with an input more than it takes)."""
    torch.manual_seed(0)
    model = _ReassignedBuffer().double()
    dp = _against_the_loop(model, torch.randn(B, T, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 1, T, D, dtype=torch.float64), dp=dp)


class _SubsampledLengths(nn.Module):
    """Speech2Text: each sample's length after a stride-2 subsampling, ``(len - 1) // 2 + 1``
    (``aten.floor_divide``), masks its frames."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x, mask):  # x [B, T, D], mask [B, T]
        lengths = (mask.sum(-1) - 1) // 2 + 1
        kept = torch.arange((x.shape[1] + 1) // 2)[None] < lengths[:, None]
        return self.fc(x[:, ::2]) * kept[..., None]


def test_lengths_floor_divided_per_sample():
    torch.manual_seed(0)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 3:] = 0
    _against_the_loop(_SubsampledLengths().double(), torch.randn(B, T, D, dtype=torch.float64), mask)


class _LengthsMask(nn.Module):
    """A padding mask from per-sample lengths whose max over the batch only reaches a
    run-time check. ``"longest"``: torchaudio's ``_lengths_to_padding_mask`` (Conformer,
    Emformer) takes the mask's width from ``int(lengths.max())``, which broadcasting
    against ``x`` pins to ``T`` (Dynamo asserts ``Eq(u0, T)``); ``"checked"``: the model
    asserts ``torch._check(max <= T)``; ``"width"``: the mask as wide as ``x``."""

    def __init__(self, width: str):
        super().__init__()
        self.width = width
        self.fc = nn.Linear(D, D)

    def forward(self, x, lengths):  # x [B, T, D], lengths [B]
        if self.width == "longest":
            width = int(lengths.max().item())
        else:
            width = x.shape[1]
            if self.width == "checked":
                torch._check(int(lengths.max().item()) <= width)
        padded = torch.arange(width)[None, :] >= lengths[:, None]
        return self.fc(x).masked_fill(padded[..., None], 0.0)


@pytest.mark.parametrize("width", ["longest", "checked"])
def test_a_max_over_the_batch_that_reaches_only_a_check(width):
    """Not refused: no value depends on the max, so no sample's gradient depends on the
    others' lengths. Checked on a static and a symbolic batch size against the loop on
    the model whose mask is as wide as ``x`` (alone, a shorter sample's ``"longest"``
    mask would be narrower than its input)."""
    torch.manual_seed(0)
    model = _LengthsMask(width).double()
    same = _LengthsMask("width").double()
    same.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    dp = fxdp.transform(model, grad_sample=True, max_grad_norm=0.05, loss_reduction="sum", compiler="eager")
    for batch_size in (B, B + 2):
        x = torch.randn(batch_size, T, D, dtype=torch.float64)
        lengths = torch.randint(1, T + 1, (batch_size,))
        lengths[0] = T
        ref = reference(same, [x, lengths], lambda out, i: out.pow(2).sum())
        model.zero_grad()
        dp(x, lengths).pow(2).sum().backward()
        tol = tolerance(torch.float64)
        assert_close_all(_params(model, "grad_sample"), ref.per_sample, tol, "grad_sample")
        assert_close_all(_params(model, "grad"), ref.grad("sum", 0.05), tol, "clipped grad")


class _WindowReadFromATensor(nn.Module):
    """A window of the sequence whose start is read from a tensor (``x[:, i:i + w]``
    with ``i = int(k)``): its length is a size only the data decides. Crashed: the
    partitioner was made to save a size the backward read off the output's gradient
    ("Node sym_size_int_1 was invalid, but is output"), then the gain's per-sample
    reduction guarded on whether that length is 1."""

    def __init__(self, width: int | None):
        super().__init__()
        self.width = width
        self.gain = nn.Parameter(torch.randn(1, D))
        self.fc = nn.Linear(D, D)

    def forward(self, x, k):
        i = int(k.item())
        h = x[:, i:] if self.width is None else x[:, i:i + self.width]
        return self.fc(h * self.gain).tanh()


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("width", [1, 2, None])
def test_a_window_whose_start_is_read_from_a_tensor(width, compiler):
    """Exact at two starts and two batch sizes, one of them leaving a window of one row."""
    torch.manual_seed(0)
    model = _WindowReadFromATensor(width).double()
    torch._dynamo.reset()
    dp = fxdp.transform(model, grad_sample=True, max_grad_norm=0.05, compiler=compiler, in_dims=(0, None))
    for batch_size, start in ((B, 1), (B + 1, T - 1)):
        x, k = torch.randn(batch_size, T, D, dtype=torch.float64), torch.tensor(start)
        ref = reference(model, [x, k], lambda out, i: out.pow(2).sum(), in_dims=(0, None))
        model.zero_grad()
        for p in model.parameters():
            p.grad_sample = None
        dp(x, k).pow(2).sum((1, 2)).mean().backward()
        tol = tolerance(torch.float64)
        assert_close_all(_params(model, "grad_sample"), ref.per_sample, tol, f"grad_sample at {start}")
        assert_close_all(_params(model, "grad"), ref.grad("mean", 0.05), tol, f"clipped grad at {start}")


class _WindowsBesideOutputsWithoutGradient(nn.Module):
    """Windows read from tensors returned beside detached outputs of the same dtype and
    static sizes: only some outputs have a tangent, so which tangent is whose cannot be
    told by position or kind. Crashed ("Node sym_size_int_2 was invalid, but is output"),
    and a pairing by kind reshaped one window's gradient with the other's length."""

    def __init__(self, layout: str):
        super().__init__()
        self.layout = layout
        self.gain = nn.Parameter(torch.randn(1, D))
        self.g2 = nn.Parameter(torch.randn(D))
        self.fc = nn.Linear(D, D)

    def forward(self, x, k, j):
        i, m = int(k.item()), int(j.item())
        y = self.fc(x[:, i:] * self.gain * self.g2).tanh()
        z = self.fc(x[:, :m] * self.g2).tanh()
        if self.layout == "detached first":
            return z.detach(), y
        if self.layout == "detached between":
            return y, x[:, :m].detach() * 3, z
        if self.layout == "detached twin":
            return z.detach(), y, z
        return x[:, :m].detach(), y, z


@pytest.mark.parametrize("layout, compiler", [
    ("detached first", "eager"), ("detached between", "eager"), ("input first", "eager"),
    ("detached twin", "eager"),
    # Under Inductor every output was copied (its strides, 4·Max(1, s), hid that it is
    # dense), the copies dropped again by Inductor, and the detached twin came back as
    # the very tensor of ``z``: no gradient for ``z``, a crash (red team).
    ("detached twin", "inductor")])
def test_windows_read_from_tensors_beside_outputs_without_gradient(layout, compiler):
    torch.manual_seed(0)
    model = _WindowsBesideOutputsWithoutGradient(layout).double()
    torch._dynamo.reset()
    dp = fxdp.transform(model, grad_sample=True, max_grad_norm=0.05, compiler=compiler, in_dims=(0, None, None))

    def loss(outs):
        return sum(o.pow(2).sum() for o in outs if o.requires_grad)

    for batch_size, start, length in ((B, 1, 3), (B + 1, T - 1, 1)):
        x, k, j = torch.randn(batch_size, T, D, dtype=torch.float64), torch.tensor(start), torch.tensor(length)
        ref = reference(model, [x, k, j], lambda outs, i: loss(outs), in_dims=(0, None, None))
        model.zero_grad()
        for p in model.parameters():
            p.grad_sample = None
        (loss(dp(x, k, j)) / batch_size).backward()
        tol = tolerance(torch.float64)
        assert_close_all(_params(model, "grad_sample"), ref.per_sample, tol, f"grad_sample at {start}")
        assert_close_all(_params(model, "grad"), ref.grad("mean", 0.05), tol, f"clipped grad at {start}")


def test_an_unused_batch_norm_in_training_is_still_refused():
    """Its output reaches nothing, but it writes the batch's statistics into its running
    buffers: not a value that only reaches a check."""
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.norm = nn.Linear(D, D), nn.BatchNorm1d(D, affine=False)

        def forward(self, x):
            h = self.fc(x)
            self.norm(h)
            return h

    assert "BatchNorm in training mode" in _reasons(Unused(), torch.randn(B, D))


def test_batch_norm_without_running_statistics_in_eval_mode_is_refused_as_such():
    """``track_running_stats=False`` normalises over the batch in eval mode too: the
    message must not tell the user to call ``.eval()``, which it already is in."""
    model = nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D, track_running_stats=False), nn.Linear(D, 2)).eval()
    reasons = _reasons(model, torch.randn(B, D))
    assert "without running statistics (track_running_stats=False) in eval mode" in reasons, reasons
    assert ".eval()" not in reasons, reasons


class _SortedByBucket(nn.Module):
    """reformer's LSH attention: positions ``arange(L)`` expanded to the rows of the
    batch merged with the heads (``[(B·H), L]``), and expanded again, gathered in the
    order each row's keys sort to; the rows gathered in that order."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):  # [B, L, D]
        n, length, _ = x.shape
        h = self.lin(x).reshape(n, length, 2, D // 2).transpose(1, 2).reshape(n * 2, length, D // 2)
        keys = h.detach().sum(-1)
        ticker = torch.arange(length).unsqueeze(0).expand_as(keys).expand_as(keys)
        order = ticker.gather(-1, keys.sort(-1).indices)
        return h.gather(1, order.unsqueeze(-1).expand(-1, -1, h.shape[-1])).reshape(n, 2, length, -1)


def test_positions_expanded_twice_gathered_in_each_row_s_order():
    """Refused before ("it gathers shared data along another dim than the batch of its
    indices"): the broadcast was looked for through one expand only."""
    torch.manual_seed(0)
    model = _SortedByBucket().double()
    dp = _against_the_loop(model, torch.randn(B, T, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 2, T, D, dtype=torch.float64), dp=dp)


def test_gather_of_shared_rows_by_position_in_the_batch_is_refused():
    """``gather(table, 1, ids)`` with ``table [B, V]`` shared: sample ``i`` would read row
    ``i``, its position in the batch, which it does not have alone."""
    model = around(lambda m, h: h + torch.gather(m.table, 1, (h.detach() > 1).long()), table=(B, D))()
    assert "another dim than the batch of its indices" in _reasons(model, torch.randn(B, D))


def test_gather_by_an_index_of_the_first_samples_only_is_refused():
    """``gather``'s output has its index's shape: a shared ``[1, k]`` index reads sample
    0's row only, which broadcasting then hands to every sample."""
    model = around(lambda m, h: h + (h * m.s).gather(1, torch.zeros(1, 1, dtype=torch.long)), s=(D,))()
    assert "its index covers only part of the batch dim" in _reasons(model, torch.randn(B, D))


# ---------------------------------------------------------------------------
# Ops over batched data without parameters: in-place twins, triangles, index by arange(B)
# ---------------------------------------------------------------------------


def _against_the_loop(model: nn.Module, *args: torch.Tensor, dp: fxdp.DPModule | None = None) -> fxdp.DPModule:
    """Per-sample gradients and the clipped gradient of ``Σ out²`` against the microbatch loop
    (with ``dp``: that transform, called again, e.g. on a new batch size)."""
    tol = tolerance(torch.float64)
    ref = reference(model, args, lambda out, i: out.pow(2).sum())
    if dp is None:
        torch._dynamo.reset()
        dp = fxdp.transform(model, grad_sample=True, max_grad_norm=_clip_between(ref.norms),
                            loss_reduction="sum", compiler="eager")
    max_grad_norm = dp.options.max_grad_norm
    for p in model.parameters():
        p.grad = None
    dp(*args).pow(2).sum().backward()
    assert_close_all(_params(model, "grad_sample"), ref.per_sample, tol, "grad_sample")
    assert_close_all({"norms": dp.per_sample_norms}, {"norms": ref.norms}, tol, "norms")
    assert_close_all(_params(model, "grad"), ref.grad("sum", max_grad_norm), tol, "clipped grad")
    return dp


def _against_the_loop_under_inductor(model: nn.Module, *args: torch.Tensor) -> fxdp.DPModule:
    """``_against_the_loop`` in float32, compiled by Inductor (fxdp's default compiler)."""
    ref = reference(model, args, lambda out, i: out.pow(2).sum())
    max_grad_norm = _clip_between(ref.norms)
    dp = fxdp.transform(model, grad_sample=True, max_grad_norm=max_grad_norm, loss_reduction="sum")
    dp(*args).pow(2).sum().backward()
    assert_close_all(_params(model, "grad_sample"), ref.per_sample, 1e-4, "grad_sample")
    assert_close_all(_params(model, "grad"), ref.grad("sum", max_grad_norm), 1e-4, "clipped grad")
    return dp


class VectorNorms(nn.Module):
    """``F.normalize`` (``linalg_vector_norm(h, 2.0, [-1], True)``) and an integer ``ord``
    with the reduced dims after it, ``linalg_vector_norm(h, 2, dim=0)``: the op's
    arguments are ``(self, ord, dim, keepdim)``, not a reduction's ``(self, dim, keepdim)``."""

    def __init__(self, d: int):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.out = nn.Linear(1, 2)

    def forward(self, x):  # x [T, B, d], sequence first
        h = F.normalize(self.inp(x), dim=-1) * 3 + self.inp(x)
        return self.out(torch.linalg.vector_norm(h, 2, dim=0).unsqueeze(-1))  # [B, d, 2]


@pytest.mark.parametrize("d", [B, B + 1], ids=["d equals B", "d differs"])
def test_vector_norm_reduces_the_dims_it_names(d: int):
    """With ``ord`` read as the reduced dim, the batch landed on the wrong output dim:
    wrong per-sample gradients when ``d == B``, a crash otherwise."""
    torch.manual_seed(0)
    model = VectorNorms(d).double()
    x = torch.randn(T, B, d, dtype=torch.float64)
    ref = reference(model, (x,), lambda out, i: out.pow(2).sum(), batch_dim=1)
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", batch_first=False, compiler="eager")
    dp(x).pow(2).sum().backward()
    assert_close_all(_params(model, "grad_sample"), ref.per_sample, tolerance(torch.float64), "grad_sample")
    assert_close_all({"norms": dp.per_sample_norms}, {"norms": ref.norms}, tolerance(torch.float64), "norms")


class PatchOps(nn.Module):
    """``nn.Unfold`` into a linear (timm's TNT), unfold then ``nn.Fold`` around a conv
    (VOLO's outlook attention), ``repeat_interleave`` along a feature dim and along the
    batch dim (GCViT's global query, once per window of each sample), ``Tensor.unfold``
    windows (HaloNet's keys and values), bicubic and antialiased resizing."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "unfold":
            self.fc = nn.Linear(4 * 9, 5)
        else:
            self.conv = nn.Conv2d(4, 4, 1)

    def forward(self, x):  # [B, 4, 6, 6]
        if self.kind == "unfold":
            return self.fc(F.unfold(x, 3, padding=1).transpose(1, 2))
        if self.kind == "fold":
            return F.fold(F.unfold(self.conv(x), 3, padding=1), (6, 6), 3, padding=1)
        if self.kind == "repeat_interleave_batch":
            n = x.shape[0]
            query = self.conv(x).mean((2, 3)).repeat_interleave(4, dim=0)  # [B·4, 4]: sample-major
            windows = x.reshape(n, 4, 3, 2, 6).permute(0, 2, 1, 3, 4).reshape(n * 3, 4, 12)[:, :, :4]
            keys = windows.reshape(n, 3, 4, 4).reshape(n * 4 * 3 // 3, 3, 4)[:, 0]  # [B·4, 4]
            return (query * keys).reshape(n, 4, 4)
        if self.kind == "sliding_windows":
            return self.conv(x).unfold(2, 4, 2).unfold(3, 4, 2).pow(2).sum((-1, -2))
        if self.kind == "bicubic":
            return F.interpolate(self.conv(x), scale_factor=1.5, mode="bicubic", antialias=False)
        if self.kind == "antialiased":
            return F.interpolate(self.conv(x), size=(4, 4), mode="bilinear", antialias=True)
        return self.conv(x).flatten(2).repeat_interleave(2, dim=1)


@pytest.mark.parametrize("kind", ["unfold", "fold", "repeat_interleave", "repeat_interleave_batch",
                                  "sliding_windows", "bicubic", "antialiased"])
def test_patch_and_repeat_ops_keep_samples_apart(kind: str):
    torch.manual_seed(0)
    _against_the_loop(PatchOps(kind).double(), torch.randn(B, 4, 6, 6, dtype=torch.float64))


class GridResizedToTheImage(nn.Module):
    """Dinov2's position embeddings: a learned grid resized to each image size with an
    antialiased bicubic (or bilinear) resize, added to the image's features; the image
    resized the same way too. At a second image size (symbolic sizes) PyTorch's fake
    kernel of the bicubic backward failed ("Expected IntList but got GenericList")."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.grid = nn.Parameter(torch.randn(1, 4, 5, 5))
        self.conv = nn.Conv2d(4, 4, 1)

    def forward(self, x):  # [B, 4, H, W]
        grid = F.interpolate(self.grid, size=x.shape[-2:], mode=self.mode, antialias=True)
        h = self.conv(x) + grid
        return F.interpolate(h, scale_factor=0.75, mode=self.mode, antialias=True)


@pytest.mark.parametrize("mode", ["bicubic", "bilinear"])
def test_a_grid_resized_to_each_image_size(mode):
    torch.manual_seed(0)
    model = GridResizedToTheImage(mode).double()
    dp = _against_the_loop(model, torch.randn(B, 4, 4, 4, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 1, 4, 8, 6, dtype=torch.float64), dp=dp)


class TiledByTheFrames(nn.Module):
    """Each sample's row tiled once per frame, ``h.repeat(t, 1)`` (``[t·B, D]``, frame
    major), with ``t`` a size of the input: symbolic once the batch changes. Crashed on
    the second batch ("unsupported operand type(s) for *: 'int' and 'Node'")."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):  # [B, t, D]
        b, t = x.shape[:2]
        h = self.lin(x.mean(1))
        return (h + h.repeat(t, 1).reshape(t, b, D).sum(0)).tanh()


def test_a_tiling_of_the_batch_a_symbolic_number_of_times():
    torch.manual_seed(0)
    model = TiledByTheFrames().double()
    dp = _against_the_loop(model, torch.randn(B, 2, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 1, 3, D, dtype=torch.float64), dp=dp)


class SignalOps(nn.Module):
    """A spatial transformer (``theta = loc(x)``, ``affine_grid``, ``grid_sample``), a
    spectrogram (``torch.stft`` pads the signal as ``[1, B, L]``, the batch at dim 1) and
    pools and pads run with the batch at the channel dim."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.conv = nn.Conv2d(2, 3, 3)
        if kind != "pools_over_channels":
            self.loc = nn.Linear(2 * 6 * 6, 6)
        if kind == "stft":
            del self.conv
            self.fc = nn.Linear(9, 3)

    def forward(self, x):  # [B, 2, 6, 6]
        if self.kind == "spatial_transformer":
            theta = self.loc(x.flatten(1)).view(-1, 2, 3)
            return self.conv(F.grid_sample(x, F.affine_grid(theta, list(x.shape), align_corners=False),
                                           align_corners=False))
        if self.kind == "stft":
            tiled = self.loc(x.flatten(1)).repeat(2, 8)  # [2·B, 48]: the whole batch twice
            signal = tiled.view(2, x.shape[0], 48).sum(0)
            window = torch.hann_window(16, dtype=x.dtype)
            spec = torch.stft(signal, 16, hop_length=4, window=window, return_complex=True).abs()
            return self.fc(spec.transpose(1, 2))
        channels_first = self.conv(x).flatten(2).transpose(0, 1)  # [3, B, 16]: samples as channels
        pooled = F.avg_pool1d(F.pad(channels_first, (1, 1), mode="reflect"), 2)
        padded = F.pad(pooled, (1, 0), value=0.5)
        return (F.max_pool1d(padded, 3, 1) + F.adaptive_max_pool1d(padded, 8)).transpose(0, 1)


@pytest.mark.parametrize("kind", ["spatial_transformer", "stft", "pools_over_channels"])
def test_sampling_spectrogram_and_pools_keep_samples_apart(kind: str):
    torch.manual_seed(0)
    _against_the_loop(SignalOps(kind).double(), torch.randn(B, 2, 6, 6, dtype=torch.float64))


class Prototypes(nn.Module):
    """A prototype network, ``-cdist(encoder(x), prototypes)`` with trainable prototypes
    (no rule: the per-sample VJP of ``cdist``), and distances within each sample."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(D, 3)
        self.protos = nn.Parameter(torch.randn(5, 3))

    def forward(self, x):  # [B, T, D]
        h = self.enc(x)
        return -torch.cdist(h.mean(1), self.protos) + torch.cdist(h, h).sum((1, 2))[:, None]


def test_distances_to_prototypes_and_within_samples():
    torch.manual_seed(0)
    _against_the_loop(Prototypes().double(), torch.randn(B, T, D, dtype=torch.float64))


def test_distances_across_the_batch_are_refused():
    model = around(lambda m, h: torch.cdist(h.t(), h.t() * m.s[:, None])[:, :1].t(), s=(D,))()
    assert "mixes samples: the batch dim is contracted" in _reasons(model, torch.randn(B, D))


def _native_layer_norm(h):
    """``aten.native_layer_norm`` called directly: the output and its statistics."""
    out, mean, rstd = torch.ops.aten.native_layer_norm(h, [D], None, None, 1e-5)
    return out + mean * rstd


def _spd(h):
    """A symmetric positive definite ``[B, D, D]`` per sample from ``h [B, T, D]``."""
    return h.mT @ h + D * torch.eye(D, dtype=h.dtype)


def _copied(m, h):
    z = torch.zeros_like(h)
    z.copy_(h * m.s)  # into a fresh tensor: ATen's functional copy has no derivative
    return z


# Ops found without a batch propagation by running op_db's samples through a parameter
# (each op where PyTorch writes it in other ATen ops is decomposed by canonicalisation).
BATCHED_OPS = {
    "movedim": lambda m, h: h.movedim(1, 2).movedim(2, 1) * m.s,
    "tile": lambda m, h: h.tile(1, 2, 1)[:, :T] * m.s,
    "fliplr": lambda m, h: torch.fliplr(h) * m.s,
    "diff": lambda m, h: torch.diff(h * m.s, dim=1, prepend=h[:, :1]),
    "rot90": lambda m, h: torch.rot90(h[:, :D] * m.s, 1, (1, 2)),
    "cummax_cummin": lambda m, h: torch.cummax(h * m.s, 1).values - torch.cummin(h, 1).values,
    "logcumsumexp": lambda m, h: torch.logcumsumexp(h * m.s, 1),
    "kthvalue_median": lambda m, h: h * (torch.kthvalue(h * m.s, 2, dim=1, keepdim=True).values
                                         + torch.median(h, dim=1, keepdim=True).values),
    "aminmax": lambda m, h: h * torch.aminmax(h * m.s, dim=1, keepdim=True).max,
    "var_mean": lambda m, h: (h - torch.var_mean(h * m.s, dim=1, keepdim=True)[1]),
    "rsub": lambda m, h: torch.rsub(h, m.s),
    "diag_embed": lambda m, h: torch.diag_embed(h[:, 0] * m.s),
    "mv": lambda m, h: torch.mv(h[:, 0], m.s)[:, None] * h[:, 0],
    "fft": lambda m, h: torch.fft.irfft(torch.fft.rfft(h * m.s, dim=1), n=T, dim=1),
    "linalg": lambda m, h: (torch.linalg.inv(_spd(h * m.s)) + torch.linalg.qr(h[:, :D]).Q
                            + torch.linalg.eigvalsh(_spd(h))[:, None] + torch.linalg.svdvals(h)[:, None]
                            + torch.linalg.slogdet(_spd(h)).logabsdet[:, None, None]),
    "safe_softmax": lambda m, h: torch.ops.aten._safe_softmax(h * m.s, -1),
    "logsigmoid": lambda m, h: F.logsigmoid(h * m.s),
    "copy_": _copied,
    "diagonal": lambda m, h: h * torch.diagonal(_spd(h * m.s), dim1=1, dim2=2)[:, None, :],
    "diagonal_copy": lambda m, h: h * torch.diagonal_copy(h[:, :D] * m.s, 1, 2, 1)[:, None, :1],
    "nansum": lambda m, h: h * torch.nansum(h * m.s, dim=2, keepdim=True),
    "cholesky": lambda m, h: torch.cholesky(_spd(h * m.s)) + torch.cholesky_inverse(torch.linalg.cholesky(_spd(h))),
    "native_layer_norm": lambda m, h: _native_layer_norm(h * m.s),
    "batch_norm_eval_kernel": lambda m, h: torch.ops.aten._native_batch_norm_legit_no_training(
        (h.mT * m.s[:, None]).contiguous(), None, None, torch.zeros(D, dtype=h.dtype), torch.ones(D, dtype=h.dtype), 0.1, 1e-5)[0].mT,
    "squeeze_copy": lambda m, h: torch.squeeze_copy((h * m.s).unsqueeze(1)),
    "split_with_sizes_copy": lambda m, h: torch.split_with_sizes_copy(h * m.s, [1, T - 1], dim=1)[1],
    # MobileBERT, Funnel: the pad list names the batch dim, with (0, 0)
    "pad_listing_the_batch": lambda m, h: F.pad(h * m.s, (0, 0, 0, 1, 0, 0))[:, 1:],
    "constant_pad_nd_listing_the_batch": lambda m, h: torch.constant_pad_nd(h * m.s, (0, 0, 1, 0, 0, 0), 0.5)[:, 1:],
    # binning by value (distance bins), a max-norm per sample
    "bucketize": lambda m, h: h * m.s * torch.bucketize(h.detach(), torch.linspace(-1, 1, 5, dtype=h.dtype)),
    "searchsorted": lambda m, h: h * m.s * torch.searchsorted(torch.sort(h.detach(), dim=-1).values,
                                                              h.detach().flip(-1).contiguous()),
    "renorm": lambda m, h: torch.renorm(h * m.s, 2, 0, 1.0),
    # Grounding DINO's mask of special tokens: each value looked up in a shared set
    "isin": lambda m, h: h * m.s * torch.isin((h.detach() * 4).round(), torch.tensor([0.0, 1.0, -2.0], dtype=h.dtype)),
    "isin_inverted": lambda m, h: h * m.s * torch.isin((h.detach() * 4).round(), torch.tensor([0.0, 1.0]),
                                                       invert=True),
    # a count per sample repeated without a dim (a 1-D tensor: flattened, it is itself)
    "repeat_interleave_1d_without_dim": lambda m, h: h * m.s * (h.detach()[:, 0, 0] > 0).double().repeat_interleave(
        T * D).view(-1, T, D),
    # a count per sample (of the positive features), not over the batch
    "count_nonzero": lambda m, h: h * m.s * torch.count_nonzero(h.detach() > 0, dim=2).unsqueeze(-1),
    # FNet's Fourier mixing (``.real`` is ``view_as_real``), complex rotary embeddings
    "fft_real": lambda m, h: torch.fft.fftn(h * m.s, dim=(1, 2)).real,
    "fft_imag": lambda m, h: torch.fft.fft(h * m.s, dim=1).imag,
    "view_as_complex": lambda m, h: torch.view_as_real(
        torch.view_as_complex((h * m.s).unflatten(-1, (-1, 2)).contiguous())
        * torch.polar(torch.ones(D // 2, dtype=h.dtype), torch.arange(D // 2, dtype=h.dtype))).flatten(-2),
}


@pytest.mark.parametrize("op", BATCHED_OPS)
def test_ops_decomposed_or_propagated(op: str):
    torch.manual_seed(0)
    _against_the_loop(around(BATCHED_OPS[op], s=(D,))().double(), torch.randn(B, T, D, dtype=torch.float64))


class DropsSamples(nn.Module):
    """torchvision's ``stochastic_depth`` (row mode): each sample's branch kept with
    probability 1/2 by an in-place ``bernoulli_(0.5)``, or by the ``kept`` mask given."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, kept=None):
        h = self.lin(x)
        noise = torch.empty([h.shape[0], 1], dtype=h.dtype).bernoulli_(0.5) if kept is None else kept.clone()
        return h * noise.div_(0.5)


def test_an_in_place_bernoulli_at_its_default_probability_is_exact_for_the_mask_it_drew():
    """``bernoulli_(0.5)`` is traced without its default ``p``, which the out-of-place
    ``bernoulli.p`` requires: the twin got no ``p`` and the compile failed."""
    torch.manual_seed(3)
    model = DropsSamples().double()
    x = torch.randn(6, D, dtype=torch.float64)
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    out = dp(x)
    out.pow(2).sum().backward()
    kept = (out.abs().sum(1, keepdim=True) > 0).to(x.dtype)
    assert 0 < kept.sum() < 6
    expected = reference(model, (x, kept), lambda out, i: out.pow(2).sum())
    assert_close_all(_params(model, "grad_sample"), expected.per_sample, tolerance(torch.float64), "grad_sample")


class SplitByTensor(nn.Module):
    """``torch.tensor_split`` at positions held in a tensor: sizes the trace cannot know."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.inp = nn.Linear(D, D)
        self.register_buffer("at", torch.tensor([1, 2]))

    def forward(self, x):
        return torch.tensor_split(self.inp(x), self.at, dim=self.dim)[1]


def test_split_at_positions_held_in_a_tensor():
    torch.manual_seed(0)
    x = torch.randn(B, T, D, dtype=torch.float64)
    _against_the_loop(SplitByTensor(1).double(), x)
    torch._dynamo.reset()
    dp = fxdp.transform(SplitByTensor(0).double(), grad_sample=True, compiler="eager")
    with pytest.raises(fxdp.UnsupportedError, match="its sizes depend on the data"):
        dp(x)


def test_diagonal_and_layer_norm_across_the_batch_dim_are_refused():
    x = torch.randn(B, D)
    model = around(lambda m, h: h + torch.diagonal(h * m.s, 0, 0, 1)[:, None], s=(D,))()
    assert "mixes samples: it takes a diagonal across the batch dim" in _reasons(model, x)
    model = around(lambda m, h: torch.ops.aten.native_layer_norm(h * m.s, [B, D], None, None, 1e-5)[0], s=(D,))()
    assert "mixes samples: the batch is one of the dims it normalises over" in _reasons(model, x)


class Rolled(nn.Module):
    def __init__(self, shifts, dims):
        super().__init__()
        self.shifts, self.dims = shifts, dims
        self.inp = nn.Linear(D, D)

    def forward(self, x):
        return torch.roll(self.inp(x), self.shifts, self.dims)


@pytest.mark.parametrize("shifts,dims", [(0, 0), ((0, 2), (0, 1)), (1, 1), (0, None)],
                         ids=["zero-along-batch", "zero-along-batch-and-one-along-time", "along-time", "flat-zero"])
def test_a_roll_by_zero_along_the_batch_dim_moves_nothing(shifts, dims):
    """``roll`` by 0 (a shift a config sets to 0) moves no element, also along the batch
    dim, where any other shift mixes samples."""
    torch.manual_seed(0)
    x = torch.randn(B, T, D, dtype=torch.float64)
    _against_the_loop(Rolled(shifts, dims if dims is not None else ()).double(), x)


@pytest.mark.parametrize("shifts,dims", [(1, 0), ((0, 1), (1, 0)), (2, ())], ids=["batch", "batch-second", "flat"])
def test_a_roll_that_moves_samples_is_refused(shifts, dims):
    assert "mixes samples" in _reasons(Rolled(shifts, dims), torch.randn(B, T, D))


class FractionalPool(nn.Module):
    """A conv, then a fractional max pool with its random offsets given per sample."""

    def __init__(self, spatial: int):
        super().__init__()
        self.spatial = spatial
        self.conv = (nn.Conv2d if spatial == 2 else nn.Conv3d)(2, 3, 3, padding=1)

    def forward(self, x, offsets):
        pool = F.fractional_max_pool2d if self.spatial == 2 else F.fractional_max_pool3d
        return pool(self.conv(x), 2, output_size=3, _random_samples=offsets)


@pytest.mark.parametrize("spatial", [2, 3])
def test_fractional_max_pool(spatial: int):
    torch.manual_seed(0)
    x = torch.randn(B, 2, *([6] * spatial), dtype=torch.float64)
    offsets = torch.rand(B, 3, spatial, dtype=torch.float64)
    _against_the_loop(FractionalPool(spatial).double(), x, offsets)


class TakeFromTable(nn.Module):
    """``torch.take`` of a shared parameter table by each sample's own ids."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(5, 3))
        self.out = nn.Linear(4, 2)

    def forward(self, ids):
        return self.out(torch.take(self.table, ids))


def test_take_of_a_shared_table_by_per_sample_ids():
    torch.manual_seed(0)
    _against_the_loop(TakeFromTable().double(), torch.randint(0, 15, (B, 4)))


def test_ops_that_flatten_the_batch_are_refused_with_their_reason():
    x = torch.randn(B, D)
    flattens = "mixes samples: it flattens the batch into one list of what it finds"
    # (A mask of the tensor's own shape and batch selects a list of rows, x[mask], which
    # only a sum over the whole list mixes: see test_masked_rows.py.)
    model = around(lambda m, h: h + torch.masked_select(h * m.s, m.s > 0).sum(), s=(D,))()
    assert flattens in _reasons(model, x)
    # A sum over the whole list is a sum over the samples (a loss); added to every sample
    # it is a statistic of the batch.
    model = around(lambda m, h: h + torch.masked_select(h * m.s, h > 0).sum(), s=(D,))()
    assert "a reduction over the batch (the loss, or a statistic of the batch) is used by an op other than a sum" \
        in _reasons(model, x)
    # The positions a nonzero finds name rows of the batch (see test_found_rows.py): their
    # sum is one too, a statistic of the batch when added to every sample.
    model = around(lambda m, h: h[torch.nonzero(h * m.s > 0, as_tuple=True)].sum() + h, s=(D,))()
    assert "a reduction over the batch (the loss, or a statistic of the batch) is used by an op other than a sum" \
        in _reasons(model, x)
    # nonzero_static pads its list (with -1) to a size: no rows of the batch to follow
    model = around(lambda m, h: h[torch.nonzero_static(h * m.s > 0, size=3).unbind(1)].sum() + h, s=(D,))()
    assert flattens in _reasons(model, x)
    model = around(lambda m, h: h + torch.take(h * m.s, torch.tensor([0, 5])).sum(), s=(D,))()
    assert "it indexes the flattened tensor, across the samples' rows" in _reasons(model, x)
    model = around(lambda m, h: h.masked_scatter(h > 0, h * m.s), s=(D,))()
    assert "mixes samples: it fills the masked positions from one flat list over the whole batch" \
        in _reasons(model, x)


def test_pad_and_complex_pairs_of_the_batch_dim_are_refused():
    x = torch.randn(B, D)
    model = around(lambda m, h: F.pad(h * m.s, (0, 0, 1, 0))[1:], s=(D,))()
    assert "mixes samples: the batch is one of the 2 last dims it works over" in _reasons(model, x)
    # two samples: [D, 2] with the batch last read as D complex numbers
    model = around(lambda m, h: torch.view_as_real(torch.view_as_complex((h * m.s).t().contiguous())).t(),
                   s=(D,))()
    assert "it pairs the batch dim's entries into complex numbers" in _reasons(model, torch.randn(2, D))


def test_renorm_and_searchsorted_across_the_batch_are_refused():
    x = torch.randn(B, D)
    model = around(lambda m, h: torch.renorm(h * m.s, 2, 1, 1.0), s=(D,))()
    assert "its norms run over the batch dim" in _reasons(model, x)
    # validate traces on fake tensors: the sequence's order does not matter here
    model = around(lambda m, h: h * torch.searchsorted(h.t().detach().contiguous(),
                                                       torch.zeros(D, 1, dtype=h.dtype)).t() * m.s, s=(D,))()
    assert "the batch is the dim of the sorted sequence it searches" in _reasons(model, x)


def test_pad_over_the_batch_dim_is_refused():
    model = around(lambda m, h: F.pad(h.t(), (1, 1), mode="replicate").t() * m.s, s=(D,))()
    assert "mixes samples: the batch is one of the 1 last dims it works over" in _reasons(model, torch.randn(B, D))


def test_repeat_interleave_along_the_batch_dim_by_a_tensor_of_counts_is_refused():
    def body(m, h):
        counts = torch.arange(h.shape[0]) % 2 + 1  # shared: 1, 2, 1, 2, ...
        return h.repeat_interleave(counts, dim=0, output_size=h.shape[0] * 3 // 2)[:h.shape[0]] * m.p

    model = around(body, p=(D,))()
    assert "it repeats along the batch dim by counts per row" in _reasons(model, torch.randn(B, D))


class GatedPositions(nn.Module):
    """timm's ConViT attention: relative positions (a buffer) expanded to the batch,
    projected by a linear, permuted, gated by a parameter, then added to batched scores."""

    def __init__(self):
        super().__init__()
        self.register_buffer("rel", torch.randn(1, T, T, 3))
        self.pos_proj = nn.Linear(3, 2)
        self.qk = nn.Linear(D, 4)
        self.gate = nn.Parameter(torch.ones(2))

    def forward(self, x):  # [B, T, D]
        n = x.shape[0]
        q, k = self.qk(x).reshape(n, T, 2, 2, 1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2)
        pos = self.pos_proj(self.rel.expand(n, -1, -1, -1)).permute(0, 3, 1, 2)
        g = torch.sigmoid(self.gate.view(1, -1, 1, 1))
        return (g * pos + (1 - g) * scores).softmax(-1)


class LatentAttentionPool(nn.Module):
    """timm's ``AttentionPoolLatent`` (``global_pool="map"``, SigLIP heads): a learned
    latent query expanded to the batch and projected, attending over the tokens."""

    def __init__(self, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.latent = nn.Parameter(torch.randn(1, 1, D))
        self.q = nn.Linear(D, D)
        self.kv = nn.Linear(D, 2 * D)

    def forward(self, x):  # [B, T, D]
        n, t, _ = x.shape
        q = self.q(self.latent.expand(n, -1, -1)).reshape(n, 1, self.heads, D // self.heads).transpose(1, 2)
        k, v = self.kv(x).reshape(n, t, 2, self.heads, D // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v).reshape(n, -1)


def test_latent_query_expanded_to_the_batch():
    torch.manual_seed(0)
    model = LatentAttentionPool().double()
    dp = _against_the_loop(model, torch.randn(B, T, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 1, T + 2, D, dtype=torch.float64), dp=dp)


class AttentionalPooler(nn.Module):
    """open_clip's ``AttentionalPooler`` (CoCa's poolers): learned queries expanded to the
    batch attend over the tokens through ``nn.MultiheadAttention`` (keys wider than the
    queries). Its query projection runs before the expand, and the attention's
    ``view`` of the projected queries, merging the batch with the heads, cannot view the
    expand: it once crashed fxdp's graph ("Cannot view a tensor ... strides (.., 0, ..)")."""

    def __init__(self):
        super().__init__()
        self.query = nn.Parameter(torch.randn(3, D))
        self.attn = nn.MultiheadAttention(D, 2, kdim=6, vdim=6, batch_first=True)

    def forward(self, x):  # [B, T, 6]
        q = self.query.unsqueeze(0).expand(x.shape[0], -1, -1)
        return self.attn(q, x, x, need_weights=False)[0]


def test_attention_of_learned_queries_expanded_to_the_batch():
    torch.manual_seed(0)
    model = AttentionalPooler().double()
    dp = _against_the_loop(model, torch.randn(B, T, 6, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 1, T + 2, 6, dtype=torch.float64), dp=dp)


def test_projection_of_a_buffer_expanded_to_the_batch():
    torch.manual_seed(0)
    _against_the_loop(GatedPositions().double(), torch.randn(B, T, D, dtype=torch.float64))


class ScaledByShared(nn.Module):
    """A parameter combined with a shared tensor of its own shape (a buffer, a shared
    input, ``torch.ones``), then broadcast against the batch: ``x + buf * q``."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.q = nn.Parameter(torch.randn(D))
        self.register_buffer("buf", torch.rand(D) + 0.5)
        self.lin = nn.Linear(D, 3)

    def forward(self, x, shared):  # [B, T, D], [D]
        if self.kind == "buffer":
            h = x + self.buf * self.q
        elif self.kind == "shared-input":
            h = x * (shared * self.q)
        else:
            h = torch.ones(D, dtype=x.dtype) * self.q + x
        return self.lin(h)


@pytest.mark.parametrize("kind", ["buffer", "shared-input", "ones"])
def test_parameter_times_a_shared_tensor_broadcast_to_the_batch(kind):
    """Shared, the product is computed once and its output expanded to the batch: the
    parameter ``[D]`` does not span the batch dim, which the expand adds in front."""
    torch.manual_seed(0)
    model = ScaledByShared(kind).double()
    shared = torch.rand(D, dtype=torch.float64) + 0.5
    dp = _against_the_loop(model, torch.randn(B, T, D, dtype=torch.float64), shared)
    _against_the_loop(model, torch.randn(B + 2, T, D, dtype=torch.float64), shared, dp=dp)


class StackedWithParameter(nn.Module):
    """A parameter expanded to the batch and stacked: with batched data
    (``stack([x, p.expand_as(x)], 1)``), or with a function of itself before meeting
    the data (``stack([p.expand_as(x), (p ** 2).expand_as(x)], 1) * x[:, None]``)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.p = nn.Parameter(torch.randn(D))
        self.lin = nn.Linear(2 * D, 3)

    def forward(self, x):  # [B, D]
        if self.kind == "with-data":
            h = torch.stack([x, self.p.expand_as(x)], 1)
        else:
            h = torch.stack([self.p.expand_as(x), (self.p ** 2).expand_as(x)], -2) * x[:, None]
        return self.lin(torch.tanh(h).flatten(1))


@pytest.mark.parametrize("kind", ["with-data", "with-itself"])
def test_parameter_expanded_and_stacked(kind):
    """``stack`` is the ``cat`` of its inputs unsqueezed; a ``cat`` of expands of the
    parameter is the expand of the ``cat`` of their sources."""
    torch.manual_seed(0)
    model = StackedWithParameter(kind).double()
    dp = _against_the_loop(model, torch.randn(B, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 2, D, dtype=torch.float64), dp=dp)


class ComplexValues(nn.Module):
    """Complex values on a parameter's path: a complex parameter (a Fourier layer's
    spectral weights), or a real one scaling the complex spectrum of the input; the
    magnitude then goes into a real head."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.w = nn.Parameter(torch.randn(3, D, dtype=torch.complex128) * 0.5, requires_grad=kind == "parameter")
        self.r = nn.Parameter(torch.randn(D, dtype=torch.float64), requires_grad=kind == "activation")
        self.head = nn.Linear(3, 2).double()

    def forward(self, x):  # [B, T, D], real
        spectrum = torch.fft.fft(x, dim=-1) * self.r
        return self.head((spectrum @ self.w.T).abs().mean(1))


@pytest.mark.parametrize("kind", ["parameter", "activation"])
def test_complex_values_on_a_parameters_path_are_per_sample(kind):
    """PyTorch's gradient of a complex product takes conjugates that the per-sample rules
    (written for real values) do not: an op that computes with complex values takes the
    generic per-sample VJP, autograd's own, whatever rule it has. The norm is
    ``sqrt(Σ |g|²)``."""
    torch.manual_seed(0)
    model = ComplexValues(kind)
    dp = _against_the_loop(model, torch.randn(B, T, D, dtype=torch.float64))
    assert dp.explain().rule_counts.get("generic.matmul[1]" if kind == "parameter" else "generic.mul[1]") == 1
    _against_the_loop(model, torch.randn(B + 2, T, D, dtype=torch.float64), dp=dp)
    _against_the_loop(model, torch.randn(1, T, D, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=["real", "complex"])
def test_a_parameter_with_a_row_per_sample_is_refused_complex_or_real(dtype):
    """The rules' checks judge a complex op too, though the generic per-sample VJP takes
    its gradients: a parameter with ``B`` rows along the batch dim gives each sample its
    own row (the model means something else on a batch of one)."""
    model = around(lambda m, h: (torch.fft.fft(h) * m.w).abs() if m.w.is_complex() else h * m.w,
                   d_in=3, d_out=3)().double()
    model.w = nn.Parameter(torch.randn(B, 3, dtype=dtype))
    assert "a size other than 1 along the batch dim" in _reasons(model, torch.randn(B, D, dtype=torch.float64))


class SpectralConv2d(nn.Module):
    """The Fourier layer of the FNO paper's code (Li et al., ``fourier_2d.py``): complex
    weights multiply the lowest modes of the input's ``rfft2``, written into a zero
    spectrum of the batch's size, transformed back."""

    def __init__(self, channels: int, modes: int, dtype: torch.dtype):
        super().__init__()
        self.modes = modes
        scale = 1 / channels ** 2
        self.weights1 = nn.Parameter(scale * torch.rand(channels, channels, modes, modes, dtype=dtype))
        self.weights2 = nn.Parameter(scale * torch.rand(channels, channels, modes, modes, dtype=dtype))

    def forward(self, x):  # [B, C, H, W]
        m = self.modes
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(x.shape[0], x.shape[1], x.size(-2), x.size(-1) // 2 + 1, dtype=x_ft.dtype)
        out_ft[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m, :m], self.weights1)
        out_ft[:, :, -m:, :m] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -m:, :m], self.weights2)
        return torch.fft.irfft2(out_ft, s=(x.size(-2), x.size(-1)))


class FourierNeuralOperator(nn.Module):
    """Two Fourier layers beside 1×1 convolutions, between a lifting and a projection."""

    def __init__(self, dtype: torch.dtype, width: int = 6):
        super().__init__()
        self.lift = nn.Linear(3, width)
        self.spectral = nn.ModuleList(SpectralConv2d(width, 3, dtype) for _ in range(2))
        self.pointwise = nn.ModuleList(nn.Conv2d(width, width, 1) for _ in range(2))
        self.project = nn.Linear(width, 1)

    def forward(self, x):  # [B, H, W, 3]
        h = self.lift(x).permute(0, 3, 1, 2)
        h = F.gelu(self.spectral[0](h) + self.pointwise[0](h))
        h = self.spectral[1](h) + self.pointwise[1](h)
        return self.project(h.permute(0, 2, 3, 1))


def test_a_fourier_neural_operator_is_per_sample():
    torch.manual_seed(0)
    model = FourierNeuralOperator(torch.complex128).double()
    dp = _against_the_loop(model, torch.randn(B, 8, 8, 3, dtype=torch.float64))
    assert dp.explain().rule_counts.get("generic.bmm[1]") == 4
    _against_the_loop(model, torch.randn(B + 2, 8, 8, 3, dtype=torch.float64), dp=dp)


class SpectralConv1d(nn.Module):
    """The 1-D Fourier layer (``fourier_1d.py``): the write into the zero spectrum is one
    slice, a ``slice_scatter`` once canonical, which autograd cannot differentiate for
    complex values (torch 2.13); fxdp scatters their real views."""

    def __init__(self):
        super().__init__()
        self.lift = nn.Linear(2, 4)
        self.weights = nn.Parameter(0.1 * torch.randn(4, 4, 3, dtype=torch.complex128))

    def forward(self, x):  # [B, N, 2]
        h = self.lift(x).transpose(1, 2)
        x_ft = torch.fft.rfft(h)
        out_ft = torch.zeros(h.shape[0], 4, h.size(-1) // 2 + 1, dtype=x_ft.dtype)
        out_ft[:, :, :3] = torch.einsum("bix,iox->box", x_ft[:, :, :3], self.weights)
        return torch.fft.irfft(out_ft, n=h.size(-1)) + h


def test_a_one_dimensional_fourier_layer_writes_its_modes_as_a_real_scatter():
    torch.manual_seed(0)
    dp = _against_the_loop(SpectralConv1d().double(), torch.randn(B, 8, 2, dtype=torch.float64))
    assert "view_as_complex" in dp.explain().graphs[0].stages["canonical"]


def test_a_fourier_neural_operator_under_inductor():
    torch.manual_seed(0)
    _against_the_loop_under_inductor(FourierNeuralOperator(torch.complex64), torch.randn(B, 8, 8, 3))


@pytest.mark.parametrize("alias", [torch.multiply, torch.subtract, torch.divide, torch.true_divide])
def test_numpy_style_aliases_are_their_ops(alias):
    """``torch.multiply`` and friends (ConvBERT) reach ``mul``'s rule and propagation."""
    torch.manual_seed(0)
    model = around(lambda m, h: alias(h, m.p) * torch.square(h).clip(max=4.0), p=(D,))().double()
    _against_the_loop(model, torch.randn(B, T, D, dtype=torch.float64))


class _KeyPaddingMask(nn.Module):
    """``nn.MultiheadAttention`` with a per-sample ``key_padding_mask``: ``masked_fill_``."""

    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(D, H, batch_first=True)

    def forward(self, x, key_padding_mask):
        return self.attention(x, x, x, key_padding_mask=key_padding_mask)[0]


def test_in_place_masked_fill_of_a_key_padding_mask():
    torch.manual_seed(0)
    model = _KeyPaddingMask().double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    key_padding_mask = torch.zeros(B, T, dtype=torch.bool)
    key_padding_mask[0, 3:] = True
    key_padding_mask[2, 1:] = True
    _against_the_loop(model, x, key_padding_mask)


def test_in_place_twins_of_pointwise_ops_are_pointwise():
    from fxdp.passes.batch_dims import _is_pointwise

    for op in (aten.masked_fill_.Scalar, aten.masked_fill_.Tensor, aten.gelu_.default,
               aten.threshold_.default, aten.hardswish_.default, aten.mish_.default, aten.dropout_.default):
        assert _is_pointwise(op), op
    for op in (aten.index_put_.default, aten.scatter_.src, aten.tril_.default, aten.baddbmm_.default):
        assert not _is_pointwise(op), op


class _Triangle(nn.Module):
    """A causal triangle of batched scores ``[B, T, T]``."""

    def __init__(self, upper: bool = False):
        super().__init__()
        self.fc = nn.Linear(T, 2)
        self.upper = upper

    def forward(self, x):
        scores = x @ x.transpose(1, 2)
        return self.fc(torch.triu(scores, 1) if self.upper else torch.tril(scores))


@pytest.mark.parametrize("upper", [False, True], ids=["tril", "triu"])
def test_triangle_of_batched_scores(upper):
    torch.manual_seed(0)
    _against_the_loop(_Triangle(upper).double(), torch.randn(B, T, D, dtype=torch.float64))


def test_triangle_over_the_batch_dim_is_refused():
    """``tril`` of ``[B, d]`` keeps row ``b``'s first ``b + 1`` entries: it depends on the sample's index."""
    model = around(lambda m, h: torch.tril(h) * m.s, s=(D,))()
    assert "mixes samples: it works along the batch dim" in _reasons(model, torch.randn(B, D))


def test_op_without_propagation_does_not_claim_to_mix_samples():
    """``F.multilabel_margin_loss`` per row keeps samples apart, but fxdp leaves it without
    a propagation (torch.compile's own gradient of it is wrong in torch 2.13)."""
    targets = torch.zeros(B, D, dtype=torch.long)
    model = around(lambda m, h: h * F.multilabel_margin_loss(h * m.s, targets, reduction="none")[:, None],
                   s=(D,))()
    reasons = _reasons(model, torch.randn(B, D))
    assert "no batch-dim propagation for aten.multilabel_margin_loss_forward.default" in reasons, reasons
    assert "mixes samples" not in reasons, reasons


class _PaddingMaskIndex(nn.Module):
    """transformers' ``masking_utils``: ``padding_mask[arange(B)[:, None, None, None], kv]``."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x, attention_mask):
        batch, length, _ = x.shape
        rows = torch.arange(batch)[:, None, None, None]
        kv = torch.arange(length)[None, None, None, :]
        mask = attention_mask.bool()[rows, kv]  # [B, 1, 1, T]
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, -1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class _LastTokenPool(nn.Module):
    """HF ``*ForSequenceClassification``: ``h[arange(B), last]``."""

    def __init__(self, rows: Callable = lambda h: torch.arange(h.shape[0])):
        super().__init__()
        self.fc = nn.Linear(D, 2)
        self.rows = rows

    def forward(self, x, last):
        h = self.fc(x)
        return h[self.rows(h), last]


def test_padding_mask_indexed_by_arange_of_the_batch():
    """Also on a second batch size and length, where ``B`` is symbolic and the index
    keeps a whole-range slice (``arange(B)[:, None]``)."""
    torch.manual_seed(0)
    model = _PaddingMaskIndex().double()
    dp = None
    for batch, length in [(B, T), (B + 2, T + 1)]:
        x = torch.randn(batch, length, D, dtype=torch.float64)
        attention_mask = torch.ones(batch, length, dtype=torch.long)
        attention_mask[0, 3:] = 0
        attention_mask[2, 2:] = 0
        dp = _against_the_loop(model, x, attention_mask, dp=dp)


class _MultipleChoice(nn.Module):
    """HF ``*ForMultipleChoice``: ``[B, C, T, d]`` merged to ``[B·C, T, d]`` before the
    encoder, whose padding mask is indexed by ``arange(B·C)``."""

    def __init__(self):
        super().__init__()
        self.attention = _PaddingMaskIndex()
        self.score = nn.Linear(D, 1)

    def forward(self, x, attention_mask):
        choices = x.shape[1]
        h = self.attention(x.flatten(0, 1), attention_mask.flatten(0, 1))  # [B·C, 1, T, D]
        return self.score(h[:, 0, 0]).view(-1, choices)  # [B, C]


def test_padding_mask_of_a_merged_batch_indexed_by_arange():
    torch.manual_seed(0)
    x = torch.randn(B, 2, T, D, dtype=torch.float64)
    attention_mask = torch.ones(B, 2, T, dtype=torch.long)
    attention_mask[0, 1, 3:] = 0
    attention_mask[2, :, 2:] = 0
    _against_the_loop(_MultipleChoice().double(), x, attention_mask)


def test_last_token_pooling_indexed_by_arange_of_the_batch():
    torch.manual_seed(0)
    model = _LastTokenPool().double()
    dp = _against_the_loop(model, torch.randn(B, T, D, dtype=torch.float64), torch.tensor([4, 2, 3]))
    # a new batch size: B is symbolic in the recompiled graph
    _against_the_loop(model, torch.randn(B + 2, T, D, dtype=torch.float64), torch.tensor([4, 0, 1, 3, 2]), dp=dp)


@pytest.mark.parametrize("rows,why", [
    (lambda h: torch.arange(h.shape[0]).flip(0), "other than torch.arange"),
    (lambda h: torch.arange(h.shape[0]) // 2, "other than torch.arange"),
    (lambda h: torch.zeros(h.shape[0], dtype=torch.long), "other than torch.arange"),
    (lambda h: torch.arange(1, h.shape[0] + 1) % h.shape[0], "other than torch.arange"),
    (lambda h: torch.arange(h.shape[0])[:, None], "do not line up"),  # out[b, c] = h[b, last[c]]
], ids=["flipped", "halved", "zeros", "shifted", "misaligned"])
def test_batch_indexed_by_anything_but_arange_is_refused(rows, why):
    model = _LastTokenPool(rows).double()
    reasons = "\n".join(str(p) for p in fxdp.validate(
        model, torch.randn(B, T, D, dtype=torch.float64), torch.tensor([4, 2, 3])))
    assert "mixes samples" in reasons and why in reasons, reasons


class _FlatRows(nn.Module):
    """``fc``, then rows of the flattened batch picked or written as ``how`` says, then
    ``head``."""

    SEGMENTS = 3

    def __init__(self, how: str):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.head = nn.Linear(D, 2)
        self.how = how


class _FlatGather(_FlatRows):
    """Rows picked from the flattened batch by per-sample offsets: ``h.reshape(B * T, d)``
    at ``arange(B)[:, None] * T + pos`` (a batched gather written by hand, as
    ``torch_gather``-style helpers, span pooling and pointer heads do)."""

    def forward(self, x, pos):
        batch, length, d = x.shape
        flat = self.fc(x).reshape(batch * length, d)
        index = torch.arange(batch)[:, None] * length + pos  # [B, k]
        if self.how == "index_select":
            picked = flat.index_select(0, index.reshape(-1)).view(batch, -1, d)
        elif self.how == "index":
            picked = flat[index]  # [B, k, d]
        elif self.how == "gather":
            picked = flat.gather(0, index.reshape(-1, 1).expand(-1, d)).view(batch, -1, d)
        else:  # from the end: negative indices count from the last row of the whole batch
            picked = flat[index - batch * length]
        return torch.tanh(self.head(picked)).sum(1)


@pytest.mark.parametrize("how", ["index_select", "index", "gather", "negative"])
def test_rows_of_the_flattened_batch_picked_by_per_sample_offsets(how):
    """Each index lies among its own sample's rows, which the graph checks at run time:
    exact, also at a new batch size (``B`` symbolic) and with a row read twice."""
    torch.manual_seed(0)
    model = _FlatGather(how).double()
    dp = _against_the_loop(model, torch.randn(B, T, D, dtype=torch.float64), torch.tensor([[4, 0], [2, 2], [0, 3]]))
    dp = _against_the_loop(model, torch.randn(B + 1, T + 2, D, dtype=torch.float64),
                           torch.randint(0, T + 2, (B + 1, 3)), dp=dp)
    crossing = torch.tensor([[4, 0], [2, T + 1], [0, 3]])  # sample 1 would read sample 2's row 1
    with pytest.raises(fxdp.UnsupportedError, match="falls outside its own sample's rows"):
        dp(torch.randn(B, T, D, dtype=torch.float64), crossing).sum().backward()


class _PositionsOfEverySample(_FlatRows):
    """Each sample's own positions used as a list of positions for the whole batch, along
    a dim other than its batch dim: ``index_select(h, 1, pos)`` is ``[B, B, d]``, sample
    ``b`` reading the positions every sample chose (alone it reads its own only)."""

    def forward(self, x, pos):
        h = torch.tanh(self.fc(x))
        if self.how == "index_select":
            picked = h.index_select(1, pos)  # [B, B, d]
        elif self.how == "take_along_dim":  # the indices' batch broadcast along dim 1
            picked = h.take_along_dim(pos[None, :, None], 1)  # [B, B, d]
        else:  # the batch moved to dim 1, gathered along dim 0 by indices batched along dim 0
            batch, _, d = x.shape
            picked = h.transpose(0, 1).gather(0, pos[:, None, None].expand(batch, batch, d))
        return self.head(picked).sum(1)


@pytest.mark.parametrize("how", ["index_select", "take_along_dim", "gather"])
def test_positions_picked_by_the_whole_batchs_indices_along_another_dim_are_refused(how):
    """``index_select``'s and ``take_along_dim``'s results were read as batched along the
    data's batch dim alone: silently another function than the loop's, every sample's
    gradient holding the positions the other samples chose. ``gather``'s was read as
    batched along dim 1, where the transposed data has its batch, and refused only at the
    sum over it, which named no cause."""
    torch.manual_seed(0)
    dp = fxdp.transform(_PositionsOfEverySample(how).double(), max_grad_norm=1.0, compiler="eager")
    with pytest.raises(fxdp.UnsupportedError, match="every other sample chose"):
        dp(torch.randn(B, T, D, dtype=torch.float64), torch.tensor([4, 0, 2])).sum().backward()


class _SegmentPool(_FlatRows):
    """Segment pooling over a flattened batch (TAPAS's ``segment_reduce``, graph pooling):
    each sample's positions pooled into its own ``S`` rows of ``zeros(B * S, d)``, at
    ``arange(B)[:, None] * S + segment``."""

    def forward(self, x, segment):
        batch, length, d = x.shape
        h = torch.tanh(self.fc(x)).reshape(batch * length, d)
        if self.how == "fixed_segments":
            # Segments built from sizes alone (TAPAS's range of columns per cell): the same
            # positions every call, offset by arange(B); the source says whose row is whose.
            segment = (torch.arange(length) % self.SEGMENTS).repeat(batch, 1)
        elif self.how == "segments_by_position":
            # Built from sizes alone too, but sample b's are at its row b (accepted before)
            segment = torch.arange(batch)[:, None].expand(batch, length) % self.SEGMENTS
        index = (torch.arange(batch)[:, None] * self.SEGMENTS + segment).reshape(-1)
        rows = torch.zeros(batch * self.SEGMENTS, d, dtype=x.dtype)
        if self.how in ("index_add", "fixed_segments", "segments_by_position"):
            pooled = rows.index_add(0, index, h)
        elif self.how == "scatter_add":
            pooled = rows.scatter_add(0, index[:, None].expand(-1, d), h)
        else:
            pooled = rows.scatter_reduce(0, index[:, None].expand(-1, d), h, reduce=self.how, include_self=False)
        return self.head(pooled.view(batch, self.SEGMENTS, d)).flatten(1)


@pytest.mark.parametrize("how", ["index_add", "scatter_add", "mean", "amax", "fixed_segments"])
def test_segments_pooled_into_each_samples_own_rows_of_a_flattened_batch(how):
    """Each sample writes into its own rows only, which the graph checks at run time:
    exact, also at a new batch size, and a segment past the sample's own is refused."""
    torch.manual_seed(0)
    model = _SegmentPool(how).double()
    segments = _SegmentPool.SEGMENTS
    dp = _against_the_loop(model, torch.randn(B, T, D, dtype=torch.float64), torch.randint(0, segments, (B, T)))
    dp = _against_the_loop(model, torch.randn(B + 1, T + 1, D, dtype=torch.float64),
                           torch.randint(0, segments, (B + 1, T + 1)), dp=dp)
    if how == "fixed_segments":
        return  # its segments are always in range
    crossing = torch.randint(0, segments, (B, T))
    crossing[1, 0] = segments  # sample 1 would write into sample 2's first row
    with pytest.raises(fxdp.UnsupportedError, match="falls outside its own sample's rows"):
        dp(torch.randn(B, T, D, dtype=torch.float64), crossing).sum().backward()


def test_segments_by_each_samples_position_are_refused_at_run_time():
    """Shared segments that put each sample's rows at other places among its own rows
    (sample ``b``'s at its row ``b``): each in range, so the run-time check of own rows
    passed, with the gradients of each position's segment."""
    model = _SegmentPool("segments_by_position").double()
    dp = fxdp.transform(model, grad_sample=True, compiler="eager", loss_reduction="sum")
    with pytest.raises(fxdp.UnsupportedError, match="puts each sample's values at other places among its own rows"):
        dp(torch.randn(B, T, D, dtype=torch.float64), torch.zeros(B, T, dtype=torch.long)).sum().backward()


class _FlatWrite(_FlatRows):
    """``x[i] = v`` at per-sample offsets: into a flattened batch (``flat[arange(B)[:, None]
    * T + pos] = v``), or accumulated into ``S`` rows per sample of shared zeros."""

    def forward(self, x, pos):
        batch, length, d = x.shape
        h = torch.tanh(self.fc(x))
        if self.how == "into_the_batch":
            flat = h.reshape(batch * length, d).clone()
            index = torch.arange(batch)[:, None] * length + pos
            flat[index] = flat[index] * 2 + 1
            out = flat.view(batch, length, d)
        else:
            index = torch.arange(batch)[:, None] * self.SEGMENTS + pos
            rows = torch.zeros(batch * self.SEGMENTS, d, dtype=x.dtype)
            out = rows.index_put((index,), h, accumulate=True).view(batch, self.SEGMENTS, d)
        return self.head(out).flatten(1)


@pytest.mark.parametrize("how", ["into_the_batch", "accumulated"])
def test_rows_of_the_flattened_batch_written_at_per_sample_offsets(how):
    torch.manual_seed(0)
    model = _FlatWrite(how).double()
    span = T if how == "into_the_batch" else _FlatWrite.SEGMENTS
    positions = (B, 2) if how == "into_the_batch" else (B, T)
    dp = _against_the_loop(model, torch.randn(B, T, D, dtype=torch.float64),
                           torch.stack([torch.randperm(span)[:positions[1]] for _ in range(B)])
                           if how == "into_the_batch" else torch.randint(0, span, positions))
    crossing = torch.zeros(positions, dtype=torch.long)
    crossing[1, 0] = span  # sample 1 would write into sample 2's first row
    with pytest.raises(fxdp.UnsupportedError, match="falls outside its own sample's rows"):
        dp(torch.randn(B, T, D, dtype=torch.float64), crossing).sum().backward()


@pytest.mark.parametrize("pool", [_FlatGather("index"), _SegmentPool("mean")], ids=["gather", "segment_mean"])
def test_rows_of_the_flattened_batch_under_inductor(pool):
    """The run-time check and the merged rows compiled by Inductor (float32)."""
    torch.manual_seed(0)
    x = torch.randn(B, T, D)
    positions = torch.tensor([[4, 0], [2, 2], [0, 3]]) if isinstance(pool, _FlatGather) else torch.randint(0, 3, (B, T))
    dp = _against_the_loop_under_inductor(pool, x, positions)
    crossing = positions.clone()
    crossing[0, 0] = 99 if isinstance(pool, _FlatGather) else 3
    with pytest.raises(fxdp.UnsupportedError, match="falls outside its own sample's rows"):
        dp(x, crossing).sum().backward()


class _PositionInIds(_FlatRows):
    """Each sample's integer positions combined with ``arange(B)``, its position in the
    batch (``pos + arange(B)``), then used as a value, an embedding id, a gather's index
    or the offset among a sample's own rows of the flattened batch: each sample's result
    would depend on where it is in the batch (accepted before the fifty-fifth session,
    wrong gradients: integer results were left to the layouts of indices). The first rows
    of the samples' blocks added to their own positions stay exact."""

    def __init__(self, how: str):
        super().__init__(how)
        self.emb = nn.Embedding(8, D) if how == "an embedding id" else None

    def forward(self, x, pos):  # pos [B, k], each in 0 … T - 1
        batch, length, d = x.shape
        h = torch.tanh(self.fc(x))
        rows = torch.arange(batch)[:, None]
        if self.how == "own rows":
            index = rows * length + pos
        elif self.how == "own rows from a stepped arange":
            index = torch.arange(0, batch * length, length)[:, None] + pos
        elif self.how == "own rows, a span from each start":  # moved by values alike for every sample
            index = (rows * length + pos[:, :1]) + torch.arange(2)[None, :]
        elif self.how == "own rows, start and end pieces":  # unbind, then stack
            start, end = (rows * length + pos).unbind(-1)
            index = torch.stack([end, start], -1)
        elif self.how == "own rows of blocks, as Big Bird's":  # (arange(B * k) // k) * S, flat
            index = pos.reshape(-1) + (torch.arange(batch * 2) // 2) * length
        elif self.how == "own rows, offsets along another dim":  # Reformer's per-hash offsets
            index = rows * length + (pos % 2 + (torch.arange(2) * 2)[None, :])
        elif self.how == "a flattened index written at itself":
            index = rows * length + pos
            return self.head(torch.zeros(batch * length, d, dtype=h.dtype).index_add(
                0, index.view(-1), index.view(-1, 1).expand(-1, d).to(h.dtype)).view(batch, length, d)).flatten(1)
        elif self.how == "a value":
            return self.head(h * (pos + rows)[:, :1, None].to(h.dtype)).flatten(1)
        elif self.how == "an embedding id":
            return self.head(h + self.emb(pos + rows)[:, :1]).flatten(1)
        elif self.how == "a gather's index":
            return self.head(h.gather(1, ((pos + rows) % length)[..., None].expand(-1, -1, d))).flatten(1)
        elif self.how == "pieces of other block sizes joined":  # b·T + pos beside b·(T + 1) + pos
            index = torch.cat([rows * length + pos[:, :1], rows * (length + 1) + pos[:, 1:] % 2], 1)
        elif self.how == "a shared table's row per position":  # tab[b, ·] = b moves sample b's positions
            table = torch.arange(batch)[:, None].expand(batch, length)
            index = rows * length + (pos + table[rows, pos]) % length
        elif self.how == "a flattened index as a value":
            return self.head(h * (rows * length + pos)[:, :1, None].to(h.dtype)).flatten(1)
        elif self.how == "blocks of another size":  # sample b's rows moved by b among its own
            index = rows * (length + 1) + pos % 2
        else:  # "an offset among its own rows"
            index = rows * length + (pos + rows) % length
        return self.head(h.reshape(batch * length, d)[index]).flatten(1)


@pytest.mark.parametrize("how", ["own rows", "own rows from a stepped arange", "own rows, a span from each start",
                                 "own rows, start and end pieces", "own rows of blocks, as Big Bird's",
                                 "own rows, offsets along another dim", "a value", "an embedding id",
                                 "a gather's index", "an offset among its own rows", "a flattened index as a value",
                                 "blocks of another size", "a flattened index written at itself",
                                 "pieces of other block sizes joined", "a shared table's row per position"])
def test_integer_positions_combined_with_the_samples_positions(how):
    torch.manual_seed(0)
    model = _PositionInIds(how).double()
    x, pos = torch.randn(B, T, D, dtype=torch.float64), torch.tensor([[3, 0], [2, 2], [0, 1]])
    if how.startswith("own rows"):
        _against_the_loop(model, x, pos)
        return
    dp = fxdp.transform(model, grad_sample=True, compiler="eager", loss_reduction="sum")
    reason = {"a flattened index as a value": "it computes with an index into the samples' rows of a flattened batch",
              "a flattened index written at itself": "it computes with an index into the samples' rows of a flattened",
              "pieces of other block sizes joined": "it computes with an index into the samples' rows of a flattened",
              "blocks of another size": "is arange.B. . S . pos with S other than the rows each sample has"}
    with pytest.raises(fxdp.UnsupportedError, match=reason.get(how, "shared tensor whose values vary along the batch")):
        dp(x, pos).sum().backward()


class _TopKByRepeatedBatchIndex(nn.Module):
    """Each sample's top-k positions gathered with a flat batch index, each sample's
    index ``k`` times in a row (RT-DETR's ``features[batch_ind, topk_ind]`` with
    ``batch_ind = arange(B).unsqueeze(-1).repeat(1, k).view(-1)``, ultralytics'
    ``RTDETRDecoder``; refused before the fifty-fifth session: "it indexes the batch dim
    with a tensor other than torch.arange(B)"), or written there. Tiled (``arange(B)
    .repeat(k)``: samples in turn) it pairs sample ``b``'s positions with others' rows."""

    K = 2

    def __init__(self, how: str):
        super().__init__()
        self.fc, self.head = nn.Linear(D, D), nn.Linear(D, 3)
        self.how = how

    def forward(self, x):  # [B, T, D]
        h, batch = torch.tanh(self.fc(x)), x.shape[0]
        top = h.max(-1).values.topk(self.K, dim=1).indices.view(-1)
        if self.how == "repeated":
            rows = torch.arange(end=batch).unsqueeze(-1).repeat(1, self.K).view(-1)
        elif self.how == "expanded":
            rows = torch.arange(batch)[:, None].expand(batch, self.K).reshape(-1)
        elif self.how == "tiled":
            rows = torch.arange(batch).repeat(self.K)
        else:  # "written", "a shared value written"
            rows = torch.arange(batch).repeat_interleave(self.K)
            out = torch.zeros_like(h)
            out[rows, top] = h[rows, top] * 2 if self.how == "written" else self.fc.bias[0]
            return self.head(out).flatten(1)
        return self.head(h[rows, top].view(batch, self.K, -1)).flatten(1)


@pytest.mark.parametrize("how", ["repeated", "expanded", "written", "tiled", "a shared value written"])
def test_a_batch_index_repeated_for_each_samples_top_k(how):
    """(A parameter's value written there crashed the per-sample VJP: refused.)"""
    torch.manual_seed(0)
    model = _TopKByRepeatedBatchIndex(how).double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    reason = {"tiled": "it indexes the batch dim with a tensor other than",
              "a shared value written": "it writes a tensor of values shared by all samples at a batch index repeated"}
    if how in reason:
        with pytest.raises(fxdp.UnsupportedError, match=reason[how]):
            fxdp.transform(model, grad_sample=True, compiler="eager")(x).sum().backward()
        return
    dp = _against_the_loop(model, x)
    _against_the_loop(model, torch.randn(B + 1, T, D, dtype=torch.float64), dp=dp)


def test_rows_of_the_flattened_batch_picked_by_shared_indices_are_refused():
    """The same rows of the flattened batch for every call (``flat[[0, 5]]``) belong to
    whichever samples hold them: refused, as before."""
    class SharedRows(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, 2)

        def forward(self, x):
            return self.fc(x).flatten(0, 1)[torch.tensor([0, 5])]

    reasons = "\n".join(str(p) for p in fxdp.validate(SharedRows().double(), torch.randn(B, T, D, dtype=torch.float64)))
    assert "mixes samples" in reasons, reasons


class _OneHot(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, 3)

    def forward(self, x, labels):
        return self.fc(x) * torch.nn.functional.one_hot(labels, 3).to(x.dtype)


class _Cosine(nn.Module):
    """A siamese head: ``cosine_similarity`` of two encodings of each sample."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.encode = nn.Linear(D, 3)
        self.dim = dim

    def forward(self, x):
        return torch.nn.functional.cosine_similarity(self.encode(x[:, 0]), self.encode(x[:, 1]), dim=self.dim)


class _Scatter(nn.Module):
    """Dense top-k gating: ``zeros_like(logits).scatter(dim, top, weights)``."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.gate = nn.Linear(D, 3)
        self.dim = dim

    def forward(self, x):
        logits = self.gate(x)
        weights, top = logits.topk(2, -1)
        if self.dim != -1:
            return torch.zeros_like(logits).scatter(self.dim, top, weights)
        return torch.zeros_like(logits).scatter(-1, top, weights) + torch.zeros_like(logits).scatter_add(-1, top, weights)


def test_one_hot_cosine_similarity_and_scatter_of_batched_data():
    torch.manual_seed(0)
    x = torch.randn(B, T, D, dtype=torch.float64)
    _against_the_loop(_OneHot().double(), x[:, 0], torch.tensor([0, 2, 1]))
    _against_the_loop(_Cosine().double(), x)
    _against_the_loop(_Scatter().double(), x)


@pytest.mark.parametrize("model", [_Cosine(dim=0), _Scatter(dim=0)], ids=["cosine", "scatter"])
def test_cosine_similarity_and_scatter_along_the_batch_dim_are_refused(model):
    reasons = _reasons(model.double(), torch.randn(B, T, D, dtype=torch.float64))
    assert "mixes samples" in reasons, reasons


# ---------------------------------------------------------------------------
# A sequence length that changes between calls (Dynamo recompiles with a symbolic T)
# ---------------------------------------------------------------------------


class PositionTable(nn.Module):
    """A learned position table read at the call's length ``T``: sliced (``pos[:, :T]``,
    ViT/nanoGPT style), looked up with shared ids ``[1, T]`` (HF GPT-2's
    ``wpe(arange(T)[None])``), a per-position scale ``x * scale[:T]`` and token mixing
    by a table cut to ``[T, T]`` on either side of a matrix product (``mix``)."""

    def __init__(self, kind: str, max_len: int = 16, d: int = D):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(d, d)
        if kind == "embedding":
            self.wpe = nn.Embedding(max_len, d)
        elif kind == "mix":
            self.left = nn.Parameter(torch.randn(max_len, max_len) / max_len)
            self.right = nn.Parameter(torch.randn(max_len, max_len) / max_len)
        else:
            self.pos = nn.Parameter(torch.randn(1, max_len, d))
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, t = self.fc(x), x.shape[1]
        if self.kind == "slice":
            h = h + self.pos[:, :t]
        elif self.kind == "embedding":
            h = h + self.wpe(torch.arange(t, device=x.device).unsqueeze(0))
        elif self.kind == "mix":
            h = h + self.left[:t, :t] @ h + (h.mT @ self.right[:t, :t]).mT
        else:
            h = h * self.pos[0, :t]
        return self.head(h)


@pytest.mark.parametrize("kind", ["slice", "embedding", "scale", "mix"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_position_table_over_changing_sequence_lengths(kind: str, dtype: torch.dtype):
    """Four calls, ``(B, T)`` = (3, 6), (3, 5), (4, 7), (4, 3): Dynamo recompiles with a
    symbolic ``T``, then ``B``; every call matches the loop."""
    import copy

    torch.manual_seed(0)
    model = PositionTable(kind).to(dtype)
    tol = tolerance(dtype)
    calls = []
    for batch_size, length in [(3, 6), (3, 5), (4, 7), (4, 3)]:
        x = torch.randn(batch_size, length, D, generator=torch.Generator().manual_seed(length), dtype=dtype)
        calls.append((x, reference(copy.deepcopy(model).double(), (x.double(),), lambda out, i: out.pow(2).sum())))
    max_grad_norm = float(torch.cat([ref.norms for _, ref in calls]).median())
    dp = fxdp.transform(model, grad_sample=True, max_grad_norm=max_grad_norm, loss_reduction="sum",
                        compiler="eager")
    for x, ref in calls:
        size = tuple(x.shape[:2])
        for p in model.parameters():
            p.grad = None
        dp(x).pow(2).sum().backward()
        assert_close_all(_params(model, "grad_sample"), ref.per_sample, tol, f"grad_sample {size}")
        assert_close_all({"norms": dp.per_sample_norms}, {"norms": ref.norms}, tol, f"norms {size}")
        assert_close_all(_params(model, "grad"), ref.grad("sum", max_grad_norm), tol, f"clipped grad {size}")


@pytest.mark.parametrize("kind", ["slice", "scale", "mix"])
def test_position_table_over_many_sequence_lengths(kind: str):
    """Twelve lengths through a sliced table (minGPT's ``pos_emb[:, :T]``): the per-sample
    VJP of the slice keeps ``T`` symbolic, so Dynamo does not compile once per length
    (which would hit its recompile limit at the ninth), and every length is exact."""
    torch.manual_seed(0)
    model = PositionTable(kind).double()
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    for length in range(3, 15):
        x = torch.randn(3, length, D, generator=torch.Generator().manual_seed(length), dtype=torch.float64)
        for p in model.parameters():
            p.grad = p.grad_sample = None
        dp(x).pow(2).sum().backward()
        ref = reference(model, (x,), lambda out, i: out.pow(2).sum())
        assert_close_all(_params(model, "grad_sample"), ref.per_sample, tolerance(torch.float64),
                         f"grad_sample T={length}")


class DroppedTable(nn.Module):
    """A learned table dropped out on its own, one mask for the whole batch, as timm's
    relative-position MLPs keep a ``Dropout`` after their table (``mask`` given: that
    mask instead of a random one, the deterministic twin the loop runs)."""

    def __init__(self, mask: torch.Tensor | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(D, D)
        self.table = nn.Parameter(torch.randn(T, D))
        self.mask = mask

    def forward(self, x):
        table = F.dropout(self.table, 0.5, training=True) if self.mask is None else self.table * self.mask
        return torch.tanh(self.lin(x) + table)


@pytest.mark.parametrize("mode", ["grad_sample", "clip"])
def test_dropout_of_a_parameter_only_value_keeps_the_forward_mask(mode: str):
    """The backward re-runs the parameter transform per sample: it must see the mask the
    forward drew (``_explicit_dropout_masks``), not draw another (vmap refuses a random
    op). Checked against the loop over a twin with the forward's mask made a constant."""
    model = DroppedTable().to(torch.float64)
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    dp = fxdp.transform(model, grad_sample=mode == "grad_sample", max_grad_norm=0.1 if mode == "clip" else None,
                        compiler="eager")
    out = dp(x)
    with torch.no_grad():
        mask = (torch.atanh(out[0]) - model.lin(x[0])) / model.table  # 0 or 2 where the table is kept
    assert set(mask.round().unique().tolist()) <= {0.0, 2.0}
    twin = DroppedTable(mask.round()).to(torch.float64)
    twin.load_state_dict(model.state_dict())
    ref = reference(twin, (x,), lambda out, i: out.pow(2).sum())
    out.pow(2).flatten(1).sum(1).mean().backward()
    params = dict(model.named_parameters())
    if mode == "grad_sample":
        assert_close_all({n: p.grad_sample for n, p in params.items()}, ref.per_sample, 1e-9, "p.grad_sample")
    else:
        assert_close_all({n: p.grad for n, p in params.items()}, ref.grad("mean", 0.1), 1e-9, "p.grad")


class ReadsData(nn.Module):
    """``p.data`` in a forward: peft's HRA multiplies its frozen base weight's ``.data``
    by a trainable matrix; a trainable weight's ``.data`` passes no gradient."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(4, 4).requires_grad_(False)
        self.u = nn.Parameter(torch.randn(4, 4))
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = F.linear(x, torch.mm(self.base.weight.data, self.u), self.base.bias)
        return self.fc(h) * self.fc.weight.data.sum()


def test_data_of_a_parameter_in_the_forward():
    torch.manual_seed(0)
    _against_the_loop(ReadsData().double(), torch.randn(B, 4, dtype=torch.float64))


class PrefixKeys(nn.Module):
    """Prefix tuning as Hugging Face's cache writes it: the learned prefix, expanded to
    the batch, concatenated to ``torch.tensor([])`` (which ``cat`` skips), or alone in a
    ``cat`` of one tensor, then concatenated to the keys."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.prefix = nn.Parameter(torch.randn(2, 4))
        self.proj = nn.Linear(4, 4)

    def forward(self, x):  # [B, T, 4]
        prefix = self.prefix.expand(x.shape[0], -1, -1)
        if self.kind == "legacy_empty":
            prefix = torch.cat([torch.tensor([], dtype=x.dtype), prefix], dim=-2)
        else:
            prefix = torch.cat([prefix], dim=1)
        keys = torch.cat([prefix, self.proj(x)], dim=1)
        return (x @ keys.transpose(1, 2)).softmax(-1) @ keys


@pytest.mark.parametrize("kind", ["legacy_empty", "one_operand"])
def test_cat_of_a_prefix_with_an_empty_tensor_or_alone(kind: str):
    torch.manual_seed(0)
    _against_the_loop(PrefixKeys(kind).double(), torch.randn(B, 3, 4, dtype=torch.float64))


class Writes(nn.Module):
    """Indexed writes (``aten.index_put``) that keep each sample in its own rows."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(4, 4)
        if kind in ("unshuffle", "accumulate"):
            self.mask_token = nn.Parameter(torch.randn(4))

    def forward(self, x, ids):  # x [B, T, 4], ids [B, T] a permutation per sample
        h = self.fc(x)
        batch = torch.arange(x.shape[0])
        if self.kind == "unshuffle":  # MAE: kept tokens back in place, the mask token elsewhere
            out = torch.zeros_like(h)
            out[batch[:, None], ids[:, :3]] = h[:, :3]
            out[batch[:, None], ids[:, 3:]] = self.mask_token.expand(x.shape[0], 2, 4)
            return out
        if self.kind == "mask":  # a per-sample boolean mask and a shared value
            h[ids < 2] = 0.5
            return h
        if self.kind == "columns":  # shared positions, batched values
            h[:, [0, 2]] = self.fc(h[:, [1, 3]]).tanh()
            return h
        if self.kind == "accumulate":  # h[arange(B), ids[:, 0]] += mask_token
            return h.index_put((batch, ids[:, 0]), self.mask_token.expand(x.shape[0], 4), accumulate=True)
        raise AssertionError(self.kind)


def _permutations(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(5, generator=g) for _ in range(B)])


@pytest.mark.parametrize("kind", ["unshuffle", "mask", "columns", "accumulate"])
def test_indexed_writes_that_keep_samples_apart(kind: str):
    torch.manual_seed(0)
    _against_the_loop(Writes(kind).double(), torch.randn(B, 5, 4, dtype=torch.float64), _permutations())


class MaskedMeanPool(nn.Module):
    """Hugging Face's audio classification pooling (wav2vec2, HuBERT, WavLM, …): the
    padded frames set to zero in place, then a mean over each sample's frames."""

    def __init__(self):
        super().__init__()
        self.proj, self.classifier = nn.Linear(8, 4), nn.Linear(4, 3)

    def forward(self, x, keep):  # x [B, T, 8], keep [B, T] bool
        h = self.proj(x)
        h[~keep.unsqueeze(-1).repeat(1, 1, h.shape[2])] = 0.0
        return self.classifier(h.sum(1) / keep.sum(1).view(-1, 1))


def test_a_padding_mask_written_before_a_sum_under_inductor():
    """The backward writes zeros into the sum's broadcast gradient (``index_put`` of an
    ``expand``). Inductor (torch 2.13) made that write in place into the shared rows,
    and every sample with padding got a zero gradient; fxdp clones such targets."""
    torch.manual_seed(0)
    model = MaskedMeanPool()
    x, keep = torch.randn(4, 6, 8), torch.arange(6)[None] < torch.tensor([6, 3, 5, 2])[:, None]
    _against_the_loop_under_inductor(model, x, keep)


class WritesAcross(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(4, 4)
        self.register_buffer("memory", torch.zeros(8, 4))

    def forward(self, x, ids):  # x [B, T, 4], ids [B, T]
        h = self.fc(x)
        if self.kind == "into_shared":  # each sample writes into one table
            memory = self.memory.clone()
            memory[ids[:, 0]] = h[:, 0]
            return h + memory.sum()
        if self.kind == "mask_list":  # the kept values of the whole batch, as one list
            h[ids < 2] = h[ids >= 3].flip(0)[: int((ids < 2).sum())]
            return h
        raise AssertionError(self.kind)


@pytest.mark.parametrize("kind,reason", [
    ("into_shared", "writes batched values, or at batched positions, into a tensor shared by all samples"),
    ("mask_list", "a boolean mask over the batch dim selected (x[mask]), one list of every sample's elements"),
])
def test_indexed_writes_across_samples_are_refused(kind: str, reason: str):
    model = WritesAcross(kind).double()
    problems = fxdp.validate(model, torch.randn(B, 5, 4, dtype=torch.float64), _permutations())
    assert any(reason in p.reason for p in problems), problems


class PeftPrefix(nn.Module):
    """peft's prefix tuning as it reaches a Hugging Face attention: a table looked up by
    shared ids expanded to the batch, cast, viewed as ``[B, P, 2·layers, heads, d]``,
    permuted to ``[2·layers, B, heads, P, d]`` and split per layer; the cache starts each
    layer's keys and values from ``torch.tensor([])``."""

    def __init__(self, layers: int = 2, heads: int = 2, d: int = 4, prefix: int = 3):
        super().__init__()
        self.layers, self.heads, self.d = layers, heads, d
        self.embedding = nn.Embedding(prefix, 2 * layers * heads * d)
        self.register_buffer("prefix_ids", torch.arange(prefix))
        self.qkv = nn.ModuleList(nn.Linear(heads * d, 3 * heads * d) for _ in range(layers))

    def forward(self, x):  # [B, T, heads·d]
        b, t, _ = x.shape
        ids = self.prefix_ids.unsqueeze(0).expand(b, -1).to(x.device)  # an alias of the expand
        past = self.embedding(ids).to(x.dtype)
        past = past.view(b, -1, 2 * self.layers, self.heads, self.d).permute(2, 0, 3, 1, 4).split(2)
        empty = torch.tensor([], dtype=x.dtype)
        for layer, (keys_values, qkv) in enumerate(zip(past, self.qkv)):
            q, k, v = qkv(x).view(b, t, 3, self.heads, self.d).permute(2, 0, 3, 1, 4)
            k = torch.cat([torch.cat([empty, keys_values[0]], dim=-2), k], dim=-2)
            v = torch.cat([torch.cat([empty, keys_values[1]], dim=-2), v], dim=-2)
            x = x + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1)
        return x


def test_peft_prefix_tuning_through_the_cache():
    torch.manual_seed(0)
    model = PeftPrefix().double()
    model.qkv.requires_grad_(False)  # prefix tuning trains the prefix table only
    _against_the_loop(model, torch.randn(B, 5, 8, dtype=torch.float64))


class NonzeroSplitCoupling(nn.Module):
    """zuko's NICE / RealNVP coupling: features split by ``mask.nonzero()`` of a constant
    buffer (a size known only at run time), a per-sample log-scale expanded to the
    split's shape and summed by torch.distributions' ``_sum_rightmost``, a
    ``reshape(B, -1)`` of that data-dependent size."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.arange(3) % 2 == 0)
        self.fc = nn.Linear(2, 1)

    def forward(self, x):  # [B, 3]
        x_a, x_b = x[..., self.mask.nonzero().squeeze(-1)], x[..., (~self.mask).nonzero().squeeze(-1)]
        log_scale = torch.tanh(self.fc(x_a))
        shifted = x_b * log_scale.exp()
        ladj = log_scale.expand(x_b.shape)
        return shifted.sum(-1) + ladj.reshape(ladj.shape[:-1] + (-1,)).sum(-1)


def test_a_reshape_after_the_batch_dim_of_a_data_dependent_size():
    torch.manual_seed(0)
    _against_the_loop(NonzeroSplitCoupling().double(), torch.randn(B, 3, dtype=torch.float64))


class TriangleFill(nn.Module):
    """zuko's full-covariance mixture: each sample's scale matrix has its strict lower
    triangle filled from the sample's own vector by ``masked_scatter``, the mask
    ``tril(ones_like(scale))`` (or one the data chose, which may select other numbers)."""

    def __init__(self, mask: str, d: int = 3):
        super().__init__()
        self.mask, self.d = mask, d
        self.fc = nn.Linear(2, d + d * (d - 1) // 2)

    def forward(self, c):  # [B, 2]
        h = self.fc(c)
        scale = torch.diag_embed(h[:, :self.d].exp())
        if self.mask == "triangle":
            mask = torch.tril(torch.ones_like(scale, dtype=torch.bool), diagonal=-1)
        else:  # the data's: three positions of each sample's matrix, wherever it says
            mask = (c[:, :1, None] * torch.arange(self.d * self.d, dtype=c.dtype).view(1, self.d, self.d)).sin() > 0
        return torch.masked_scatter(scale, mask, h[:, self.d:]).pow(2).sum((1, 2))


def test_masked_scatter_of_each_samples_own_source_row():
    torch.manual_seed(0)
    _against_the_loop(TriangleFill("triangle").double(), torch.randn(B, 2, dtype=torch.float64))


def test_masked_scatter_checks_that_each_sample_fills_a_whole_source_row():
    torch.manual_seed(0)
    c = torch.tensor([[0.3, 0.1], [1.7, 0.2], [2.9, -0.4]], dtype=torch.float64)
    dp = fxdp.transform(TriangleFill("data").double(), grad_sample=True, compiler="eager")
    with pytest.raises(fxdp.UnsupportedError, match="masked_scatter fills every sample's masked positions"):
        dp(c).sum().backward()


class ImageTokens(nn.Module):
    """A vision-language model's merge (Hugging Face's LLaVA, PaliGemma, Gemma 3,
    InternVL, BLIP-2 …): each sample's image features fill its image-token positions,
    ``embeds.masked_scatter((ids == k)[..., None], features)``, after a check over the
    whole batch that the counts match (``torch_compilable_check`` in
    ``get_placeholder_mask``). The features come batched (``[B, n, d]``) or flat
    (``[B * n, d]``, ``torch.cat(list(features))``); the mask broadcasts over ``d``
    or is expanded to it."""

    def __init__(self, source: str, expand: bool, tokens: int = 7, n: int = 3, d: int = 4):
        super().__init__()
        self.source, self.expand, self.tokens, self.d = source, expand, tokens, d
        self.emb, self.proj, self.head = nn.Embedding(tokens + 1, d), nn.Linear(5, d), nn.Linear(d, 3)

    def forward(self, ids, image):  # ids [B, L] with n image tokens each, image [B, n, 5]
        features = self.proj(image)
        if self.source == "cat":
            features = torch.cat(list(features), dim=0)
        elif self.source == "reshape":
            features = features.reshape(-1, self.d)
        mask = ids == self.tokens
        torch._check_tensor_all(mask.sum() * self.d == features.numel())
        mask = mask.unsqueeze(-1)
        if self.expand:
            mask = mask.expand(-1, -1, self.d)
        return self.head(torch.tanh(self.emb(ids).masked_scatter(mask, features)))


def _image_token_ids(size: int, first: int = 2, n: int = 3, length: int = 8) -> torch.Tensor:
    ids = torch.randint(0, 7, (size, length), generator=torch.Generator().manual_seed(size))
    ids[:, first:first + n] = 7
    return ids


@pytest.mark.parametrize("expand", [False, True], ids=["broadcast", "expanded"])
@pytest.mark.parametrize("source", ["batched", "cat", "reshape"])
def test_image_features_scattered_into_each_samples_image_tokens(source, expand):
    """Refused before: the batch-wide count check ("a reduction over the batch ... is used
    by an op other than a sum"), a flat source ("fills the masked positions from one flat
    list"), and a mask broadcast over ``d`` (the run-time check counted its positions,
    not the elements it selects)."""
    torch.manual_seed(0)
    model = ImageTokens(source, expand).double()
    ids = _image_token_ids(B)
    dp = _against_the_loop(model, ids, torch.randn(B, 3, 5, dtype=torch.float64))
    _against_the_loop(model, _image_token_ids(B + 1, first=4), torch.randn(B + 1, 3, 5, dtype=torch.float64), dp=dp)
    # Another length and count of image tokens: sizes only run time knows (refused
    # before the fifty-eighth session: "fills the masked positions from one flat list").
    _against_the_loop(model, _image_token_ids(B, first=1, n=4, length=11), torch.randn(B, 4, 5, dtype=torch.float64),
                      dp=dp)


@pytest.mark.parametrize("sizes", ["static", "symbolic"])
def test_image_tokens_of_other_counts_per_sample_are_refused_at_run_time(sizes):
    """Every sample must hold as many image tokens as its features fill; the model's own
    check sees only the batch's total. At symbolic sizes (a graph for other lengths and
    counts) the check is all that decides."""
    torch.manual_seed(0)
    model = ImageTokens("cat", False).double()
    dp = fxdp.transform(model, grad_sample=True, compiler="eager")
    n, length = 3, 8
    if sizes == "symbolic":
        dp(_image_token_ids(B), torch.randn(B, 3, 5, dtype=torch.float64)).sum().backward()
        dp(_image_token_ids(B + 1, first=4), torch.randn(B + 1, 3, 5, dtype=torch.float64)).sum().backward()
        n, length = 4, 11
    ids = _image_token_ids(B, n=n, length=length)
    ids[0, 7], ids[1, 2] = 7, 0  # sample 0 has one too many, sample 1 one too few
    with pytest.raises(fxdp.UnsupportedError, match="masked_scatter fills every sample's masked positions"):
        dp(ids, torch.randn(B, n, 5, dtype=torch.float64)).sum().backward()


class ImageRowsWritten(nn.Module):
    """Kosmos-2's merge: ``embeds[image_mask] = image_embeds.view(-1, d)``, each sample's
    image rows in order written at its image-token positions."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.d = d
        self.emb, self.proj, self.head = nn.Embedding(8, d), nn.Linear(5, d), nn.Linear(d, 3)

    def forward(self, ids, image):  # ids [B, L], image [B, n, 5]
        h = self.emb(ids)
        h[ids == 7] = self.proj(image).view(-1, self.d)
        return self.head(torch.tanh(h))


def test_image_rows_written_at_each_samples_image_tokens():
    torch.manual_seed(0)
    model = ImageRowsWritten().double()
    dp = _against_the_loop(model, _image_token_ids(B), torch.randn(B, 3, 5, dtype=torch.float64))
    _against_the_loop(model, _image_token_ids(B + 1, first=4), torch.randn(B + 1, 3, 5, dtype=torch.float64), dp=dp)
    ids = _image_token_ids(B)
    ids[0, 6], ids[1, 2] = 7, 0
    with pytest.raises(fxdp.UnsupportedError, match=r"x\[mask\] = rows fills every sample's masked positions"):
        dp(ids, torch.randn(B, 3, 5, dtype=torch.float64)).sum().backward()


class SeparatedIndices(nn.Module):
    """Advanced indices separated by a slice: PyTorch puts their broadcast dims in front
    (``x[:, i, :, j]`` of ``[B, 5, 4, 6]`` is ``[3, B, 4]``)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(4, 2)
        self.register_buffer("table", torch.randn(3, 5, 4, 6))
        self.register_buffer("rows", torch.tensor([[0], [2], [4]]))
        self.register_buffer("keep", torch.tensor([True, False, True, True, False]))
        self.table_p = nn.Parameter(torch.randn(3, 5, 4, 6), requires_grad=kind == "parameter_table")

    def forward(self, x, i, j):  # x [B, 5, 4, 6], i and j [B] ids
        if self.kind == "batched_data":  # shared ids: the samples move to dim 1
            return self.fc(x[:, torch.tensor([0, 2, 4]), :, torch.tensor([1, 1, 5])]).transpose(0, 1)
        if self.kind == "batched_ids":  # the ids' batch leads the result
            return self.fc(self.table[:, i, :, j])
        if self.kind == "broadcast_ids":  # [3, 1] shared against [B] batched: [3, B]
            return self.fc(self.table[1][self.rows, :, j].transpose(0, 1))
        if self.kind == "index_before_the_batch":  # [5, B, 4][ids]: every sample keeps its column
            return self.fc(x[..., 0].transpose(0, 1)[torch.tensor([2, 0])].transpose(0, 1))
        if self.kind == "parameter_table":  # a trainable table looked up by separated ids
            return self.fc(self.table_p[:, i, :, j])
        if self.kind == "shared_mask":  # [B, nnz, 4]: a size that depends on the data, no hint
            return self.fc(x[:, self.keep][..., 0])
        if self.kind == "separated_write":  # region [2, B, 4]: each sample writes its own values
            h = x.clone()
            h[:, torch.tensor([0, 1]), :, torch.tensor([1, 2])] = self.fc(x[:, 0, :, 0]).repeat(1, 2)
            return self.fc(h[..., 1])
        raise AssertionError(self.kind)


@pytest.mark.parametrize("kind", ["batched_data", "batched_ids", "broadcast_ids", "index_before_the_batch",
                                  "parameter_table", "shared_mask", "separated_write"])
def test_separated_and_broadcast_advanced_indices_keep_the_samples(kind: str):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    _against_the_loop(SeparatedIndices(kind).double(), torch.randn(B, 5, 4, 6, dtype=torch.float64),
                      torch.randint(0, 5, (B,), generator=g), torch.randint(0, 6, (B,), generator=g))


class SeparatedWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x):  # x [B, 2, 1, 2]
        z = self.fc(x[:, 0, 0, :])
        h = x.clone()
        i = torch.zeros(x.shape[0], dtype=torch.long)
        # The written region is [B (ids), B (samples), 1]: sample p's values land in every sample.
        h[:, i, :, i] = z[:, :1].unsqueeze(1).expand(x.shape[0], x.shape[0], 1)
        return h


def test_a_write_at_separated_indices_across_samples_is_refused():
    reasons = _reasons(SeparatedWrite().double(), torch.randn(B, 2, 1, 2, dtype=torch.float64))
    assert "batched values do not line up with the batch dim of the rows" in reasons, reasons


class OverlappingWindows(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):  # [B, 1, 3] -> [B, 1, 2, 2]: the windows share elements
        return self.fc(x).unfold(-1, 2, 1)


def test_an_output_of_overlapping_windows_gets_every_overlap_gradient():
    """AOTAutograd replays an output view of an intermediate outside the graph, and the
    replay's backward drops the overlaps' sum under a broadcast output gradient (plain
    ``torch.compile`` too, torch 2.13): fxdp returns a copy of such an output."""
    torch.manual_seed(0)
    model = OverlappingWindows().double()
    x, c = torch.randn(B, 1, 3, dtype=torch.float64), torch.randn(1, 2, 2, dtype=torch.float64)
    ref = reference(model, [x], lambda out, i: (out * c).sum())
    dp = fxdp.transform(model, grad_sample=True, compiler="eager")
    (dp(x) * c).sum((1, 2, 3)).mean().backward()
    assert_close_all(_params(model, "grad_sample"), ref.per_sample, tolerance(torch.float64), "grad_sample")
    assert_close_all(_params(model, "grad"), ref.grad("mean"), tolerance(torch.float64), "grad")


class UntaggedElementwise(nn.Module):
    """Ops that keep samples apart but carry no ``pointwise`` tag, or work on a small
    trailing block: complex numbers from parts, cross products, linear solves."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(3, 3)

    def forward(self, x):  # x [B, 3, 3]
        h = self.fc(x)
        if self.kind == "complex":
            return torch.complex(h, x).abs()
        if self.kind == "polar":
            return torch.view_as_real(torch.polar(h.abs() + 0.1, x)).flatten(-2)
        if self.kind == "cross":
            return torch.linalg.cross(h, x)
        a = h @ h.mT + 3 * torch.eye(3, dtype=x.dtype)
        if self.kind == "solve":
            return torch.linalg.solve(a, x)
        if self.kind == "solve_vector":  # [B, 3, 3] against [B, 3]: one vector per sample
            return torch.linalg.solve(a, x[:, 0])
        if self.kind == "solve_shared":  # each sample's matrix against one shared right-hand side
            return torch.linalg.solve(a, torch.ones(3, 2, dtype=x.dtype))
        if self.kind == "solve_triangular":
            return torch.linalg.solve_triangular(a.tril(), x, upper=False)
        if self.kind == "cholesky_solve":
            return torch.cholesky_solve(x, torch.linalg.cholesky(a))
        if self.kind == "lu_solve":
            return torch.linalg.lu_solve(*torch.linalg.lu_factor(a), x)
        raise AssertionError(self.kind)


@pytest.mark.parametrize("kind", ["complex", "polar", "cross", "solve", "solve_vector", "solve_shared",
                                  "solve_triangular", "cholesky_solve", "lu_solve"])
def test_untagged_elementwise_and_solves_keep_the_samples(kind: str):
    torch.manual_seed(0)
    _against_the_loop(UntaggedElementwise(kind).double(), torch.randn(B, 3, 3, dtype=torch.float64))


class SharedMatrixSolve(nn.Module):
    """A matrix built from parameters alone, solved against the samples as the columns
    of the right-hand side (or its rows, ``left=False``), each solved on its own, or
    broadcast against the samples' own right-hand sides. ``linalg.solve``
    (``_linalg_solve_ex``) returns the matrix's LU factors beside the solution: shared."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(3, 3)
        self.raw = nn.Parameter(0.3 * torch.randn(3, 3))

    def forward(self, x):  # x [B, 3]
        h = self.fc(x)
        tril = torch.tril(self.raw, -1) + torch.diag(self.raw.diagonal().exp())
        if self.kind == "MultivariateNormal":  # torch.distributions: solve_triangular(L, (x - loc).T)
            return torch.distributions.MultivariateNormal(self.fc.bias, scale_tril=tril).log_prob(h).unsqueeze(-1)
        if self.kind == "solve_triangular, rows":
            return torch.linalg.solve_triangular(tril, h, upper=False, left=False)
        if self.kind == "cholesky_solve":
            return torch.cholesky_solve(h.T, tril).T
        if self.kind == "lu_solve":
            return torch.linalg.lu_solve(*torch.linalg.lu_factor(tril + tril.T), h.T).T
        a = self.raw + 2 * torch.eye(3, dtype=h.dtype)
        if self.kind == "linalg.solve, broadcast":  # [3, 3] against [B, 3, 1]
            return torch.linalg.solve(a, h[..., None]).squeeze(-1)
        if self.kind == "linalg.solve, columns":
            return torch.linalg.solve(a, h.T).T
        if self.kind == "linalg.solve, rows":
            return torch.linalg.solve(a, h, left=False)
        if self.kind == "linalg.solve, per head":  # [2, 3, 3] against [B, 1, 3, 1]
            return torch.linalg.solve(torch.stack([a, a.T @ a]), h[:, None, :, None]).flatten(1)
        if self.kind == "parameters solved against a constant":  # a transform: [3, 3] against [2, 3, 3]
            weights = torch.linalg.solve(3 * torch.eye(3, dtype=h.dtype) + 0.5, torch.stack([tril, tril.T]))
            return torch.einsum("bi,kij->bkj", h, weights).flatten(1)
        raise AssertionError(self.kind)


@pytest.mark.parametrize("kind", ["MultivariateNormal", "solve_triangular, rows", "cholesky_solve", "lu_solve",
                                  "linalg.solve, broadcast", "linalg.solve, columns", "linalg.solve, rows",
                                  "linalg.solve, per head", "parameters solved against a constant"])
def test_a_shared_matrix_solved_against_the_samples_as_columns(kind: str):
    torch.manual_seed(0)
    model = SharedMatrixSolve(kind).double()
    dp = _against_the_loop(model, torch.randn(B, 3, dtype=torch.float64))
    if kind.startswith("linalg.solve"):  # the generic rule, through the LU factorisation (see fxdp/rules/generic.py)
        assert dp.explain().rule_counts.get("generic._linalg_solve_ex[0]") == 1
    _against_the_loop(model, torch.randn(B + 2, 3, dtype=torch.float64), dp=dp)


def test_a_shared_matrix_solved_against_the_samples_under_inductor():
    torch.manual_seed(0)
    _against_the_loop_under_inductor(SharedMatrixSolve("linalg.solve, broadcast"), torch.randn(B, 3))


def test_solves_and_cross_products_across_the_batch_are_refused():
    x = torch.randn(3, D, dtype=torch.float64)  # three samples: the batch is a matrix dim
    # (Not ``+ 3 * eye(3)``: a shared matrix whose rows line up with the three samples is
    # refused at the addition, each sample getting its own row of it.)
    model = around(lambda m, h: torch.linalg.solve(h * m.s + 3, h), d_in=3, d_out=3, s=(3,))().double()
    assert "the batch is a row or column of the matrices it works on" in _reasons(model, x)
    model = around(lambda m, h: torch.linalg.solve(h * m.s + 3 * torch.eye(3, dtype=h.dtype), h), d_in=3, d_out=3,
                   s=(3,))().double()
    assert "a shared tensor whose values vary along the batch dim" in _reasons(model, x)
    model = around(lambda m, h: torch.linalg.cross(h * m.s, h, dim=0), d_in=3, d_out=3, s=(3,))().double()
    assert "it takes cross products along the batch dim" in _reasons(model, x)


def _one_row_per_sample(h: torch.Tensor, numbers) -> torch.Tensor:
    """A shared ``[B, d]`` built in a Python loop over the batch, one constant row each."""
    return torch.stack([torch.full((h.shape[1],), float(numbers(i)), dtype=h.dtype) for i in range(h.shape[0])])


def test_a_stack_of_one_constant_per_sample_is_alike_along_the_batch():
    """TimesFM's padding mask, ``torch.stack([torch.zeros(L) for ts in inputs])``: every
    row is the same constant. The where beside it was refused ("a shared tensor whose
    values vary along the batch dim")."""
    torch.manual_seed(0)
    x = torch.randn(B, D, dtype=torch.float64)
    model = around(lambda m, h: torch.where(
        torch.stack([torch.zeros(h.shape[1], dtype=h.dtype) for _ in h]) > 0.5, 0.0, h * m.s), s=(D,))()
    _against_the_loop(model.double(), x)
    _against_the_loop(around(lambda m, h: h * m.s * _one_row_per_sample(h, lambda i: 2.5), s=(D,))().double(), x)
    # One row of a range joined once per sample: alike along the batch too.
    _against_the_loop(around(lambda m, h: h * m.s * torch.cat(
        [torch.linspace(0, 1, h.shape[1], dtype=h.dtype)[None]] * h.shape[0]), s=(D,))().double(), x)


def _first_row_written_through_a_view(h: torch.Tensor) -> torch.Tensor:
    rows = [torch.zeros(h.shape[1], dtype=h.dtype) for _ in h]
    rows[0].view(1, -1)[0, 1] = 4.0
    return torch.stack(rows)


def _zero_beside_negative_zeros(h: torch.Tensor) -> torch.Tensor:
    rows = [torch.zeros(h.shape[1], dtype=h.dtype)] + [torch.full((h.shape[1],), -0.0, dtype=h.dtype)
                                                       for _ in range(h.shape[0] - 1)]
    return torch.copysign(torch.ones((), dtype=h.dtype), torch.stack(rows))


def _normalised_by_its_padding(m, h: torch.Tensor) -> torch.Tensor:
    """TimesFM's ``_preprocess`` and masked mean: the padding built per series in a loop,
    each series' mean over its positions not padded."""
    padding = torch.stack([torch.zeros(h.shape[1], dtype=h.dtype) for _ in h])
    kept = (1 - padding).sum(1, keepdim=True)
    mean = (h * (1 - padding)).sum(1, keepdim=True) / kept
    return (h - mean) * m.s


def _front_padding(h: torch.Tensor, numbers=lambda i: 0.0, written: bool = False) -> torch.Tensor:
    """TimesFM's padding of a short series: ones in front of zeros, built once per sample."""
    rows = []
    for i in range(h.shape[0]):
        row = torch.cat([torch.ones(2, dtype=h.dtype), torch.full((h.shape[1] - 2,), numbers(i), dtype=h.dtype)])
        if written and i == 1:
            row[0] = 3.0
        rows.append(row)
    return torch.stack(rows)


def _rows_of_a_source_written_between(h: torch.Tensor) -> torch.Tensor:
    source, rows = torch.zeros(h.shape[1], dtype=h.dtype), []
    for _ in range(h.shape[0]):
        rows.append(source * 2 + 1)
        source.view(-1).add_(1)  # in place, through a view: each row reads a later value
    return torch.stack(rows)


def _signed_zeros(h: torch.Tensor) -> torch.Tensor:
    rows = [torch.tensor([0.0 if i % 2 else -0.0] * h.shape[1], dtype=h.dtype) for i in range(h.shape[0])]
    return torch.copysign(torch.ones((), dtype=h.dtype), torch.stack(rows))


_TWO_ROWS = torch.randn(2, D, dtype=torch.float64)


def test_a_stack_of_one_computation_per_sample_is_alike_along_the_batch():
    """(The last three of the refused were accepted, with wrong gradients, by this
    session's first form of the rule; the tiled table before it too.)"""
    torch.manual_seed(0)
    _against_the_loop(around(lambda m, h: h * m.s * _front_padding(h), s=(D,))().double(),
                      torch.randn(B, D, dtype=torch.float64))
    for rows in (lambda h: _front_padding(h, lambda i: float(i % 2)), lambda h: _front_padding(h, written=True),
                 _rows_of_a_source_written_between, _signed_zeros,
                 lambda h: torch.cat([_TWO_ROWS] * (h.shape[0] // 2))):  # (at an even batch size)
        model = around(lambda m, h, rows=rows: h * m.s * rows(h), s=(D,))().double()
        assert "a shared tensor whose values vary along the batch dim" in _reasons(
            model, torch.randn(4, D, dtype=torch.float64))


class _TiledTable(nn.Module):
    """A table of two rows tiled to the batch, sample ``b`` given row ``b % 2`` by its
    position (or one row repeated, alike for every sample)."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.fc = how, nn.Linear(D, D)
        self.register_buffer("table", torch.randn(2, D))
        if how.startswith("a parameter"):
            self.queries = nn.Parameter(torch.randn(2, D))

    def forward(self, x):
        h, copies = self.fc(x), x.shape[0] // 2
        if self.how == "repeat":
            return h * self.table.repeat(copies, 1)
        if self.how == "tile":
            return h * self.table.tile(copies, 1)
        if self.how == "repeat of a product":
            return h * (self.table * 2).repeat(copies, 1)
        if self.how == "repeat of a constant":
            return h * _TWO_ROWS.to(h.dtype).repeat(copies, 1)
        if self.how == "repeat flat, then viewed as rows":
            return h * self.table.view(-1).repeat(copies).view(-1, D)
        if self.how == "a parameter repeated, then viewed as copies":  # (refused before)
            return (h[:, None] * self.queries.repeat(x.shape[0], 1).view(x.shape[0], 2, D)).flatten(1)
        if self.how == "a parameter repeated, then unflattened":
            return (h[:, None] * self.queries.repeat(x.shape[0], 1).unflatten(0, (x.shape[0], 2))).flatten(1)
        if self.how == "a parameter repeated, through two views":  # (refused before the sixty-first session)
            tiles = self.queries.repeat(x.shape[0], 1).view(2 * x.shape[0], D)
            return (h[:, None] * tiles.view(x.shape[0], 2, D)).flatten(1)
        if self.how == "a parameter repeated with its columns twice":  # (as the last)
            tiles = self.queries.repeat(x.shape[0], 2).view(x.shape[0], 2, 2 * D)
            return (h.repeat(1, 2)[:, None] * tiles).flatten(1)
        if self.how == "a parameter repeated, read twice":  # (as the last)
            tiles, rows = self.queries.repeat(x.shape[0], 1), (x.shape[0], 2, D)
            return (h[:, None] * tiles.view(rows)).flatten(1) + tiles.unflatten(0, rows[:2]).sum(1).repeat(1, 2)
        if self.how == "the whole table in each sample's row":  # (refused by a first version)
            return h.repeat(1, 2) * self.table.repeat(x.shape[0], 1).view(x.shape[0], -1)
        if self.how == "the whole table in each sample's row, through two views":
            return h.repeat(1, 2) * self.table.repeat(x.shape[0], 1).view(2 * x.shape[0], D).view(x.shape[0], -1)
        if self.how == "two copies per sample, read twice":
            tiles, rows = self.table.repeat(2 * x.shape[0], 1), (x.shape[0], 4, D)
            return (h[:, None] * tiles.view(rows)).flatten(1) + tiles.view(rows).sum(1).repeat(1, 4)
        return h * self.table[:1].repeat(x.shape[0], 1)  # "one row repeated"


@pytest.mark.parametrize("how", ["repeat", "tile", "repeat of a product", "repeat of a constant",
                                 "repeat flat, then viewed as rows"])
def test_a_table_tiled_to_the_batch_is_refused(how: str):
    """(Accepted before the sixtieth session, with the batched model's gradients: a buffer
    was taken for one alike along every dim, its tiles too; the size rule reads a buffer
    only where its size is the batch's.)"""
    model = _TiledTable(how).double()
    assert "a shared tensor whose values vary along the batch dim" in _reasons(model, torch.randn(
        4, D, dtype=torch.float64))


@pytest.mark.parametrize("how", ["one row repeated", "a parameter repeated, then viewed as copies",
                                 "a parameter repeated, then unflattened", "the whole table in each sample's row",
                                 "the whole table in each sample's row, through two views",
                                 "two copies per sample, read twice", "a parameter repeated, through two views",
                                 "a parameter repeated with its columns twice", "a parameter repeated, read twice"])
def test_whole_copies_of_a_table_repeated_over_the_batch(how: str):
    torch.manual_seed(0)
    model = _TiledTable(how).double()
    dp = _against_the_loop(model, torch.randn(4, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(3, D, dtype=torch.float64), dp=dp)


class _ShuffledMask(nn.Module):
    """PatchTST's forecast masking: the last positions of ``zeros(B, T)`` set, in every
    row or in some, then the rows shuffled, ``mask[torch.randperm(B)]``."""

    def __init__(self, rows: str):
        super().__init__()
        self.rows, self.fc = rows, nn.Linear(D, D)

    def forward(self, x):  # [B, T, D]
        mask = torch.zeros(x.shape[:2], dtype=x.dtype)
        mask[slice(None) if self.rows == "every row" else slice(0, 1), -1:] = 1
        mask = mask[torch.randperm(x.shape[0])]
        return self.fc(x.masked_fill(mask.bool()[..., None], 0.0))


def test_rows_alike_shuffled_are_alike():
    """(Refused before the sixtieth session: rows picked by a permutation were taken to
    differ, whatever the rows held; a scatter into another dim was not followed.) One
    row marked, then shuffled, masks one sample at random: its position decides."""
    torch.manual_seed(0)
    model = _ShuffledMask("every row").double()
    dp = _against_the_loop(model, torch.randn(4, 3, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(3, 3, D, dtype=torch.float64), dp=dp)
    assert "a shared tensor whose values vary along the batch dim" in _reasons(
        _ShuffledMask("the first row").double(), torch.randn(4, 3, D, dtype=torch.float64))


class _ConstantOfTheBatchSize(nn.Module):
    """A constant of one number per sample made in the forward from Python values
    (TimesFM's ``torch.tensor(freq)`` of a list of series' frequencies)."""

    def __init__(self, values: str):
        super().__init__()
        self.values, self.fc = values, nn.Linear(D, D)

    def forward(self, x):
        numbers = [2.0] * x.shape[0] if self.values == "alike" else [float(i) for i in range(x.shape[0])]
        return self.fc(x) * torch.tensor(numbers, dtype=x.dtype)[:, None]


def test_a_constant_alike_along_the_batch_is_alike():
    """(Refused before the sixtieth session: the graph's constants were taken to differ
    along every dim, whatever they held.)"""
    torch.manual_seed(0)
    model = _ConstantOfTheBatchSize("alike").double()
    dp = _against_the_loop(model, torch.randn(4, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(3, D, dtype=torch.float64), dp=dp)
    assert "a shared tensor whose values vary along the batch dim" in _reasons(
        _ConstantOfTheBatchSize("by position").double(), torch.randn(4, D, dtype=torch.float64))


class _PickedByARange(nn.Module):
    """Each sample's score at its own position, picked with a Python ``range(B)`` along
    the batch dim, which Dynamo passes as a constant tensor: supar's Eisner CRF,
    ``s[lens, range(B)]`` of scores laid out ``[L, B]`` (``"batch second"``), and
    ``h[range(B), labels]`` (``"batch first"``); ``"as values"`` multiplies by the range,
    ``"written"`` sets its last position to 0 first (an arange so: ``"an arange written"``)."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.fc = how, nn.Linear(D, 1)

    def forward(self, x, positions):  # [B, L, D], [B]
        scores = self.fc(x).squeeze(-1)
        if self.how == "batch second":
            return scores.movedim(0, 1)[positions, range(x.shape[0])]
        if self.how == "batch first":
            return scores[range(x.shape[0]), positions]
        if self.how in ("written", "an arange written"):  # the last sample reads the first's row
            rows = torch.tensor(list(range(x.shape[0]))) if self.how == "written" else torch.arange(x.shape[0]).detach()
            rows[-1] = 0
            return scores[rows, positions]
        return scores * torch.tensor(range(x.shape[0]), dtype=x.dtype)[:, None]


@pytest.mark.parametrize("how", ["batch second", "batch first"])
def test_a_python_range_over_the_batch_picks_each_sample_s_row(how):
    """(Refused before the sixty-third session, "it indexes the batch dim with a tensor
    other than torch.arange(B)", where ``torch.arange(B)`` was accepted; a helper's sweep
    of supar.) Dynamo compiles again for another batch size, as its range is a constant."""
    torch.manual_seed(0)
    model = _PickedByARange(how).double()
    dp = _against_the_loop(model, torch.randn(4, 5, D, dtype=torch.float64), torch.tensor([4, 2, 3, 0]))
    _against_the_loop(model, torch.randn(3, 5, D, dtype=torch.float64), torch.tensor([1, 4, 2]), dp=dp)
    assert "a shared tensor whose values vary along the batch dim" in "\n".join(str(p) for p in fxdp.validate(
        _PickedByARange("as values").double(), torch.randn(4, 5, D, dtype=torch.float64), torch.tensor([4, 2, 3, 0])))


class _ForcesThroughAWriteIntoAView(nn.Module):
    """An energy whose forward writes into a view of a fresh tensor (e3nn's ``Extract``
    and ``Gate``), and its forces ``-dE/dx`` by ``torch.func.vjp`` in the forward: the
    write's backward reads the gradient through ``new_empty_strided`` and ``as_strided``.
    ``window`` instead takes ``h.as_strided`` itself (``(size, stride, offset)``)."""

    def __init__(self, window=None):
        super().__init__()
        self.window = window
        self.lin = nn.Linear(3, 4)

    def energy(self, x):
        h = self.lin(x)
        out = h.new_zeros(h.shape[:-1] + (2,))
        out.narrow(-1, 0, 2).copy_(h.narrow(-1, 2, 2))
        return (out.tanh() * h[..., :2]).sum(-1)

    def forward(self, x):
        if self.window is not None:
            size, stride, offset = self.window
            h = self.lin(x).tanh()
            return h.as_strided((x.shape[0], *size), stride, offset) * 2
        e, vjp = torch.func.vjp(self.energy, x)
        return torch.cat([e[:, None], -vjp(torch.ones_like(e))[0]], 1)


def test_as_strided_windows_of_each_sample_s_row():
    """``as_strided`` with a tensor's own strides and ``B`` rows, each row's window
    inside its own sample's memory, is batched as the tensor (refused before the
    sixty-fifth session, as ``new_empty_strided``, with no rule: forces by
    ``torch.func.vjp`` through a write into a view, a helper's sweep of e3nn). Windows
    that reach into the next row, or with strides of their own, stay refused."""
    torch.manual_seed(0)
    model = _ForcesThroughAWriteIntoAView().double()
    dp = _against_the_loop(model, torch.randn(4, 3, dtype=torch.float64))
    _against_the_loop(model, torch.randn(6, 3, dtype=torch.float64), dp=dp)
    _against_the_loop(_ForcesThroughAWriteIntoAView(((3,), (4, 1), 1)).double(), torch.randn(4, 3, dtype=torch.float64))
    for window in (((4,), (4, 1), 1), ((2,), (2, 1), 0), ((2,), (4, 2), 0)):
        torch._dynamo.reset()
        problems = fxdp.validate(_ForcesThroughAWriteIntoAView(window).double(), torch.randn(4, 3, dtype=torch.float64))
        assert [p.op for p in problems] == ["aten.as_strided.default"], (window, problems)


@pytest.mark.parametrize("how", ["written", "an arange written"])
def test_a_range_over_the_batch_written_in_place_is_no_range(how):
    """``rows[-1] = 0`` before ``scores[rows, positions]``: the last sample reads the
    first's row. Accepted with each sample's own row's gradients when the sixty-third
    session first read ``range(B)`` as ``arange(B)`` (a red team's find), and for an
    ``arange(B).detach()`` so written before that."""
    assert "it indexes the batch dim with a tensor other than torch.arange(B)" in "\n".join(
        str(p) for p in fxdp.validate(_PickedByARange(how).double(), torch.randn(4, 5, D, dtype=torch.float64),
                                      torch.tensor([4, 2, 3, 0])))


def test_a_mean_over_a_padding_built_in_a_loop():
    """(Refused: a reduction of the stacked padding along another dim was not known to
    hold the same values along the batch.)"""
    torch.manual_seed(0)
    _against_the_loop(around(_normalised_by_its_padding, s=(D,))().double(), torch.randn(B, D, dtype=torch.float64))
    model = around(lambda m, h: h * m.s * _one_row_per_sample(h, lambda i: i).sum(1, keepdim=True), s=(D,))()
    assert "a shared tensor whose values vary along the batch dim" in _reasons(model.double(), torch.randn(
        B, D, dtype=torch.float64))


def _positions_after_the_padding(h: torch.Tensor, written: bool = False) -> torch.Tensor:
    """TimesFM 2.5's positions: its padding built per series in a loop, its padded
    patches counted off a view, ``pad.view(B, n, p)[..., 0]``, and subtracted from a
    range (``written``: sample 0's patches marked through views of that view)."""
    b, t = h.shape
    padding = torch.stack([torch.zeros(t, dtype=h.dtype) for _ in h])
    if written:
        padding.view(b, 2, -1)[0, :, 0] = 1.0
    padded = (padding.view(b, 2, -1)[..., 0] >= 0.5).sum(-1, keepdim=True)
    return torch.arange(t, dtype=h.dtype) - padded


def test_positions_counted_off_a_view_of_a_padding_built_in_a_loop():
    """(Refused: any view of a view of the stacked padding was taken for a write into it,
    "a shared tensor whose values vary along the batch dim", in TimesFM 2.5 on every input.)"""
    torch.manual_seed(0)
    model = around(lambda m, h: h * m.s * torch.cos(_positions_after_the_padding(h)), s=(D,))().double()
    _against_the_loop(model, torch.randn(B, D, dtype=torch.float64))
    model = around(lambda m, h: h * m.s * torch.cos(_positions_after_the_padding(h, written=True)), s=(D,))()
    assert "a shared tensor whose values vary along the batch dim" in _reasons(model.double(), torch.randn(
        B, D, dtype=torch.float64))


@pytest.mark.parametrize("rows", [lambda h: _one_row_per_sample(h, lambda i: i),
                                  lambda h: _one_row_per_sample(h, lambda i: i % 2),
                                  _first_row_written_through_a_view, _zero_beside_negative_zeros],
                         ids=["position", "alternating", "a row written through a view", "-0.0 beside 0.0"])
def test_a_stack_of_different_constants_per_sample_is_refused(rows):
    """(The last two were taken for fills of one number, with wrong gradients.)"""
    model = around(lambda m, h: h * m.s * rows(h), s=(D,))().double()
    assert "a shared tensor whose values vary along the batch dim" in _reasons(model, torch.randn(B, D,
                                                                                                   dtype=torch.float64))


def test_a_gather_at_a_shared_index_that_varies_along_the_batch_is_refused():
    """Each sample would read at its own position's indices (all sample alone read the
    first row's): it was accepted, with wrong gradients."""
    model = around(lambda m, h: torch.gather(h * m.s, 1, (torch.arange(h.shape[0]) % h.shape[1])[:, None]
                                             .expand(h.shape[0], 2)), d_out=2, s=(D,))().double()
    assert "it gathers with a shared index whose values vary along the batch dim" in _reasons(
        model, torch.randn(B, D, dtype=torch.float64))
    alike = around(lambda m, h: torch.gather(h * m.s, 1, torch.tensor([[2, 0]]).expand(h.shape[0], 2)), d_out=2,
                   s=(D,))().double()
    _against_the_loop(alike, torch.randn(B, D, dtype=torch.float64))


def test_gumbel_softmax_draws_per_element():
    """``F.gumbel_softmax`` draws ``exponential_`` noise elementwise: each sample its own."""
    model = around(lambda m, h: F.gumbel_softmax(h * m.s, tau=0.5), s=(D,))()
    assert fxdp.validate(model, torch.randn(B, D)) == []


def test_an_argsort_along_the_features_keeps_the_batch():
    """``h.argsort(-1)`` orders each sample's own values (a gather of its features by
    rank); along the batch of a 2-D tensor it is refused, as ``sort`` is."""
    model = around(lambda m, h: torch.gather(h * m.s, -1, h.argsort(-1)), s=(D,))().double()
    x = torch.randn(B, D, dtype=torch.float64)
    ref = reference(model, [x], lambda out, i: out.pow(2).sum())
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    dp(x).pow(2).sum().backward()
    assert_close_all(_params(model, "grad_sample"), ref.per_sample, tolerance(torch.float64), "grad_sample")
    across = around(lambda m, h: torch.gather(h * m.s, 0, h.argsort(0)), s=(D,))().double()
    assert "it sorts along the batch dim" in _reasons(across, x)


def test_a_uniform_draw_of_a_fresh_tensor_draws_per_element():
    """``torch.rand_like(h).uniform_()`` (PhiMoE's router jitter) becomes the functional
    ``aten.uniform``, elementwise: each sample its own."""
    model = around(lambda m, h: h * m.s * (torch.rand_like(h).uniform_() > 0.25), s=(D,))()
    assert fxdp.validate(model, torch.randn(B, D)) == []


class LearnedKeepMask(nn.Module):
    """A dropout mask drawn with a trainable keep-probability, ``bernoulli(keep)``: the
    draw has derivative zero, so ``keep`` gets no gradient (its values 0 and 1 make the
    draws the same in the batch and in the loop)."""

    def __init__(self, in_place: bool):
        super().__init__()
        self.in_place = in_place
        self.fc = nn.Linear(D, D)
        self.keep = nn.Parameter(torch.tensor([1.0, 0.0] * (D // 2) + [1.0] * (D % 2)))

    def forward(self, x):
        h = self.fc(x)
        probability = self.keep.expand_as(h)
        mask = torch.empty_like(h).bernoulli_(probability) if self.in_place else torch.bernoulli(probability)
        return h * mask


@pytest.mark.parametrize("in_place", [False, True], ids=["bernoulli", "bernoulli_"])
def test_a_bernoulli_probability_parameter_gets_no_gradient(in_place: bool):
    torch.manual_seed(0)
    model = LearnedKeepMask(in_place).double()
    x = torch.randn(B, D, dtype=torch.float64)
    assert fxdp.validate(model, x) == []
    ref = reference(model, (x,), lambda out, i: out.pow(2).sum())
    assert ref.per_sample["keep"].abs().max() == 0  # eager autograd: a zero gradient
    dp = fxdp.transform(model, grad_sample=True, max_grad_norm=_clip_between(ref.norms), loss_reduction="sum",
                        compiler="eager")
    dp(x).pow(2).sum().backward()
    tol = tolerance(torch.float64)
    trained = [n for n in ref.names if n != "keep"]
    assert_close_all({n: _params(model, "grad_sample")[n] for n in trained},
                     {n: ref.per_sample[n] for n in trained}, tol, "grad_sample")
    assert_close_all({"norms": dp.per_sample_norms}, {"norms": ref.norms}, tol, "norms")
    clipped = ref.grad("sum", dp.options.max_grad_norm)
    assert_close_all({n: _params(model, "grad")[n] for n in trained}, {n: clipped[n] for n in trained}, tol, "grad")
    assert model.keep.grad is None or model.keep.grad.abs().max() == 0


class OuterMerged(nn.Module):
    """The batch merged as the outer factor of a dim (``[T, B, d] -> [T·B, d]``: the
    samples strided inside each time block) through ops with elementwise rules."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(D, 2)
        self.p = nn.Parameter(1 + 0.5 * torch.randn(D), requires_grad=kind != "add")

    def forward(self, x):  # [B, T, D]
        h = x.transpose(0, 1).reshape(-1, D)
        if self.kind == "add":
            return self.fc(h + 0.5)
        if self.kind == "mul_param":  # and back to [B, T, D]
            return self.fc((h * self.p).reshape(T, x.shape[0], D).transpose(0, 1))
        if self.kind == "generic_prelu":  # the generic per-sample VJP
            return self.fc(F.prelu(h, self.p))
        raise AssertionError(self.kind)


@pytest.mark.parametrize("kind", ["add", "mul_param", "generic_prelu"])
def test_elementwise_rules_keep_a_batch_merged_as_the_outer_factor(kind: str):
    torch.manual_seed(0)
    _against_the_loop(OuterMerged(kind).double(), torch.randn(B, T, D, dtype=torch.float64))


class BroadcastAndUnpool(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(4, 4)
        self.s = nn.Parameter(torch.randn(4))

    def forward(self, x):  # [B, 2, 4, 4]
        h = self.fc(x)
        if self.kind == "broadcast_tensors":  # as torch.distributions do with a learned scale
            loc, scale = torch.broadcast_tensors(h, F.softplus(self.s))
            return loc * scale
        pooled, indices = F.max_pool2d(h * self.s, 2, return_indices=True)
        return self.fc(F.max_unpool2d(pooled, indices, 2))


@pytest.mark.parametrize("kind", ["broadcast_tensors", "max_unpool"])
def test_broadcast_parameters_and_unpooling_keep_the_samples(kind: str):
    torch.manual_seed(0)
    _against_the_loop(BroadcastAndUnpool(kind).double(), torch.randn(B, 2, 4, 4, dtype=torch.float64))


def test_random_draws_per_row_keep_the_samples():
    """``torch.normal`` around a batched mean, ``torch.multinomial`` from each sample's
    row of probabilities, and a ``torch.distributions`` sample with a learned scale."""
    x = torch.randn(B, D)
    model = around(lambda m, h: torch.normal(h * m.s, 0.1), s=(D,))()
    assert fxdp.validate(model, x) == []
    model = around(lambda m, h: h * m.s + torch.multinomial(torch.softmax(h, -1), D, replacement=True), s=(D,))()
    assert fxdp.validate(model, x) == []
    model = around(lambda m, h: torch.distributions.Normal(h, F.softplus(m.s)).rsample(), s=(D,))()
    assert fxdp.validate(model, x) == []
    model = around(lambda m, h: h * m.s + torch.multinomial(torch.softmax(h, -1).t(), h.shape[0], replacement=True).t(),
                   s=(D,))()
    assert "the batch is the dim of the categories it draws from" in _reasons(model, x)


class ExpandedToMergedRows(nn.Module):
    """A parameter expanded to the rows of a merged batch, into an op without a rule:
    the generic VJP runs the op on the whole batch (sample ``b`` meets its own rows)."""

    def __init__(self, merge: str):
        super().__init__()
        self.merge = merge
        self.p = nn.Parameter(torch.tensor([0.3, -0.7, 1.1]))
        self.fc = nn.Linear(3, 2)

    def forward(self, x):  # [B, T, 3]
        h = x.reshape(-1, 3) if self.merge == "inner" else x.transpose(0, 1).reshape(-1, 3)
        return self.fc(torch.linalg.cross(h, self.p.expand_as(h), dim=1))


@pytest.mark.parametrize("merge", ["inner", "outer"])
def test_a_parameter_expanded_to_merged_rows_in_the_generic_rule(merge: str):
    torch.manual_seed(0)
    model = ExpandedToMergedRows(merge).double()
    dp = _against_the_loop(model, torch.randn(B, T, 3, dtype=torch.float64))
    assert {p.name: p.rule for p in dp.explain().plans}["p"].startswith("generic.")
    _against_the_loop(model, torch.randn(B + 1, T, 3, dtype=torch.float64), dp=dp)


class Siamese(nn.Module):
    """Two views of each sample through one encoder as one batch (``cat`` along the batch
    dim), split back and compared per sample."""

    def __init__(self, split: str):
        super().__init__()
        self.split = split
        self.encode = nn.Linear(D, 3)

    def forward(self, x1, x2):
        z = torch.tanh(self.encode(torch.cat([x1, x2])))  # [2B, 3]: sample b at rows b and B + b
        n = x1.shape[0]
        if self.split == "slice":
            z1, z2 = z[:n], z[n:]
        elif self.split == "chunk":
            z1, z2 = z.chunk(2)
        else:  # "view": [2, B, 3]
            z1, z2 = z.view(2, n, 3).unbind(0)
        return (z1 - z2).pow(2).sum(-1) + z1.sum(-1)


@pytest.mark.parametrize("split", ["slice", "chunk", "view"])
def test_siamese_views_concatenated_along_the_batch(split: str):
    torch.manual_seed(0)
    model = Siamese(split).double()
    dp = _against_the_loop(model, torch.randn(B, D, dtype=torch.float64), torch.randn(B, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 2, D, dtype=torch.float64), torch.randn(B + 2, D, dtype=torch.float64),
                      dp=dp)


def test_a_concatenation_or_slice_that_mixes_the_batch_is_refused():
    x = torch.randn(B, D)
    model = around(lambda m, h: torch.cat([h * m.s, torch.zeros(1, D)])[1:], s=(D,))()
    assert "it concatenates a shared tensor along the batch dim" in _reasons(model, x)
    model = around(lambda m, h: torch.cat([h, h * m.s])[1:1 + h.shape[0]], s=(D,))()
    assert "it slices the batch dim" in _reasons(model, x)


class TimeMajorPReLU(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.act = nn.PReLU(channels)

    def forward(self, x):  # [T, B, D] with batch_first=False
        return self.act(self.fc(x))


def test_prelu_with_the_batch_not_first():
    """One slope is elementwise: the batch may be any dim; per-channel slopes run along
    dim 1, which then must not be the batch."""
    torch.manual_seed(0)
    model = TimeMajorPReLU(1).double()
    x = torch.randn(T, B, D, dtype=torch.float64)
    ref = reference(model, [x], lambda out, i: out.pow(2).sum(), batch_dim=1)
    dp = fxdp.transform(model, grad_sample=True, batch_first=False, loss_reduction="sum", compiler="eager")
    dp(x).pow(2).sum().backward()
    assert_close_all(_params(model, "grad_sample"), ref.per_sample, tolerance(torch.float64), "grad_sample")
    per_channel = TimeMajorPReLU(B).double()  # B slopes along dim 1, the batch
    assert "the batch is the channel dim its slopes run along" in _reasons(per_channel, x, batch_first=False)


class _SortedDispatch(nn.Module):
    """A mixture of experts as Hugging Face's ``grouped_mm`` writes it: the batch's
    tokens, flattened, grouped by expert with a sort, each run through its expert."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, 2)
        self.w = nn.Parameter(torch.randn(2, D, D))

    def forward(self, x):
        h = x.reshape(-1, D)
        expert = self.router(h).argmax(-1)
        _, order = torch.sort(expert)
        out = torch.einsum("nd,nde->ne", h[order], self.w[expert[order]])
        return torch.empty_like(out).index_copy(0, order, out).reshape(x.shape)


def test_an_expert_weight_gathered_for_sorted_tokens_matches_the_microbatch_loop():
    """Tokens of the whole batch sorted by expert are followed (``Rows``): an expert's
    weight gathered per sorted token (``w[expert[order]]``) takes the per-sample VJP on
    the rows put back in batch order, and the rows written back by the sort's indices
    are a batch again. A sort along the batch of a tensor with more dims stays refused."""
    model = _SortedDispatch().double()
    model.router.requires_grad_(False)  # it only picks the experts (argmax): no gradient
    x = torch.randn(B, T, D, dtype=torch.float64)
    assert _reasons(model, x) == ""
    ref = reference(model, [x], lambda out, i: out.pow(2).sum())
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    dp(x).pow(2).sum().backward()
    assert_close_all(_params(model, "grad_sample"), ref.per_sample, tolerance(torch.float64), "grad_sample")

    class SortRowsOfMatrix(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            return self.lin(x).sort(0).values

    assert "it sorts along the batch dim" in _reasons(SortRowsOfMatrix().double(), torch.randn(B, D, dtype=torch.float64))


class ForeachArithmetic(nn.Module):
    """tensordict's arithmetic on a dict of batched tensors runs ``torch._foreach_*``:
    each output is the op on the tensors at its position (titans' neural memory scales
    its per-sample gradients so)."""

    def __init__(self, op: str):
        super().__init__()
        self.op = op
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, 2)

    def forward(self, x):
        ha, hb = self.a(x), self.b(x)
        if self.op == "mul":
            ha, hb = torch._foreach_mul([ha, hb], 0.5)
        elif self.op == "add lists":
            ha, hb = torch._foreach_add([ha, hb], [hb.sum(-1, keepdim=True), ha[..., :2]], alpha=2.0)
        elif self.op == "addcmul":
            ha, hb = torch._foreach_addcmul([ha, hb], [ha, hb], [ha.tanh(), hb.tanh()], 0.3)
        else:
            ha, hb = torch._foreach_exp([ha, hb])
        return torch.cat([ha, hb], -1)


@pytest.mark.parametrize("op", ["mul", "add lists", "addcmul", "exp"])
def test_foreach_arithmetic_keeps_each_tensor_s_batch(op):
    """Refused before: "no batch-dim propagation for aten._foreach_mul.Scalar"."""
    torch.manual_seed(0)
    model = ForeachArithmetic(op).double()
    dp = _against_the_loop(model, torch.randn(B, T, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 2, T, D, dtype=torch.float64), dp=dp)


def test_a_foreach_norm_over_batched_tensors_is_refused():
    model = around(lambda m, h: h * torch._foreach_norm([h * m.s])[0], s=(D,))()
    assert "no batch-dim propagation for aten._foreach_norm" in _reasons(model, torch.randn(B, D))


class ControlFlowOp(nn.Module):
    """A Linear applied three times by ``while_loop``, or one of two branches by ``cond``."""

    def __init__(self, op: str):
        super().__init__()
        self.op, self.lin = op, nn.Linear(D, D)

    def forward(self, x):
        from torch._higher_order_ops import while_loop

        if self.op == "while_loop":
            return while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, torch.tanh(self.lin(h))),
                              (torch.zeros((), dtype=torch.int64), x))[1]
        return torch.cond(self.lin.weight.sum() > 0, lambda h: self.lin(h), lambda h: -self.lin(h), (x,))


@pytest.mark.parametrize("op", ["while_loop", "cond"])
def test_a_control_flow_op_is_refused_with_how_to_write_it(op):
    """A higher-order op fxdp does not look into is refused with how to write it instead
    (the message suggested fxdp.register_rule, which takes no such op, before the
    sixty-second session; found by a helper's sweep of ODE solvers)."""
    reasons = _reasons(ControlFlowOp(op), torch.randn(B, D))
    assert f"no batch-dim propagation for {op}, a higher-order op" in reasons and "Python loop" in reasons \
        and "register_rule" not in reasons.replace("nor can fxdp.register_rule", ""), reasons


class InnerGradientStep(nn.Module):
    """A gradient step the forward takes itself, per sample (titans' neural memory,
    test-time training): ``vmap(grad(inner))`` of a loss through a layer norm puts
    ``native_layer_norm_backward`` into the forward's graph."""

    def __init__(self):
        super().__init__()
        self.to_k, self.to_v = nn.Linear(D, D), nn.Linear(D, D)
        self.w0 = nn.Parameter(torch.randn(D, D) * 0.3)

    def forward(self, x):  # [B, T, D]
        def inner_loss(w, k, v):
            return (F.layer_norm(k @ w, (D,)) - v).pow(2).mean()

        k, v = self.to_k(x), self.to_v(x)
        g = torch.func.vmap(torch.func.grad(inner_loss), in_dims=(None, 0, 0))(self.w0, k, v)
        return k @ (self.w0 - 0.1 * g)


def test_an_inner_gradient_through_a_layer_norm_per_sample():
    """The ``vmap(grad)`` is the model's own forward; the reference is the microbatch loop."""
    torch.manual_seed(0)
    model = InnerGradientStep().double()
    dp = _against_the_loop(model, torch.randn(B, T, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 2, T, D, dtype=torch.float64), dp=dp)


class ForcesOf(nn.Module):
    """Forces ``-vmap(grad(energy))(positions)`` of energies that differentiate through a
    view or straight into a linear (found in schnetpack's and deepxde's potentials):

    * ``linear``: ``linear(r).sum()``, whose gradient's ``[B, atoms, o]`` expand the
      batching rule views as ``[B·atoms, o]`` (``_unsafe_view``, viewable one sample at a
      time only);
    * ``select``: a pair of columns ``r[:, 0] * r[:, 1]`` (``select_backward``);
    * ``slice``: the first atom ``r[:1]`` (``slice_backward``);
    * ``hessian``: the curvature ``vmap(jacrev(grad(u)))`` of ``u(p) = net(p)[0]``
      (``select_backward`` of a ``ones_like``), reduced to its trace."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        # Only parameters the forces depend on (a bias under a plain sum does not reach them).
        self.lin = nn.Linear(3 if kind in ("linear", "hessian") else 1, 4, bias=kind != "linear")
        if kind == "hessian":
            self.out = nn.Linear(4, 1, bias=False)

    def energy(self, r: torch.Tensor) -> torch.Tensor:  # [atoms, 3] -> []
        if self.kind == "linear":
            return self.lin(r).sum()
        if self.kind == "select":
            return torch.tanh(self.lin(r[:, 0, None] * r[:, 1, None])).pow(2).sum()
        return torch.tanh(self.lin(r[:1, :1])).pow(2).sum()

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        if self.kind == "hessian":
            def u(p):  # [3] -> []
                return self.out(torch.tanh(self.lin(p)))[0]

            hessians = torch.func.vmap(torch.func.vmap(torch.func.jacrev(torch.func.grad(u))))(positions)
            return hessians.diagonal(dim1=-2, dim2=-1).sum(-1)
        return -torch.func.vmap(torch.func.grad(self.energy))(positions)


@pytest.mark.parametrize("kind", ["linear", "select", "slice", "hessian"])
def test_forces_through_views_and_linears_per_sample(kind):
    """Each was refused or failed before: no propagation for ``select_backward`` and
    ``slice_backward``; the ``_unsafe_view`` of a transform region ran on a tensor it
    cannot view (canonicalisation now writes it as the ``reshape`` it stands for)."""
    torch.manual_seed(0)
    model = ForcesOf(kind).double()
    dp = _against_the_loop(model, torch.randn(B, 5, 3, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 2, 5, 3, dtype=torch.float64), dp=dp)


class InputGradientOfTheBatch(nn.Module):
    """The input gradient of a whole batch at once, with the backward run after the
    transform's level is exited: ``vjp``'s function (the gradient penalty's way), or
    ``jacrev``'s vmap of it, whose ``[B, o, B, i]`` Jacobian's diagonal is each sample's."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "vjp":
            out, pullback = torch.func.vjp(self.net, x)
            return x * pullback(out)[0]  # out as the cotangent: every parameter counts
        jacobian = torch.func.jacrev(self.net)(x)
        return torch.diagonal(jacobian, dim1=0, dim2=2).flatten(0, 1).T


def test_a_vjp_of_the_whole_batch_is_exact():
    """The region of the transform ends where its values are last used, its function's
    backward included (before, fxdp cut it at the level's exit and failed to trace the
    rest: "attempted to apply meta conversion to view functorch tensor")."""
    torch.manual_seed(0)
    model = InputGradientOfTheBatch("vjp").double()
    dp = _against_the_loop(model, torch.randn(B, 3, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 2, 3, dtype=torch.float64), dp=dp)
    # grad's disabling of saved-tensor hooks ends with the region (it stayed in effect,
    # and activation checkpointing failed everywhere after)
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()


class SecondDerivativeOfTheBatch(nn.Module):
    """A physics-informed residual's ``u_xx``: the ``vjp`` of a slice (``[:, 0]``) of the
    whole batch's input gradient."""

    def __init__(self):
        super().__init__()
        self.u = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def u_x(x):
            u, pullback = torch.func.vjp(self.u, x)
            return pullback(torch.ones_like(u))[0]

        u_x0, pullback = torch.func.vjp(lambda x: u_x(x)[:, 0], x)
        return pullback(torch.ones_like(u_x0))[0][:, 0] - u_x0 + self.u(x)[:, 0]


def test_a_second_derivative_of_the_whole_batch_is_exact_at_a_second_batch_size():
    """With a symbolic ``B`` (the second size) the slice's derivative is traced as a
    ``slice_backward`` over the whole batch dim, the identity (it was refused, "it writes
    into part of the batch dim", where the first size had run). The nested levels leave
    saved-tensor hooks as they found them."""
    torch.manual_seed(0)
    model = SecondDerivativeOfTheBatch().double()
    dp = _against_the_loop(model, torch.rand(B, 2, dtype=torch.float64))
    _against_the_loop(model, torch.rand(B + 2, 2, dtype=torch.float64), dp=dp)
    # the nested levels' disabling of saved-tensor hooks ends with the outer one (it
    # stayed in effect, and activation checkpointing failed everywhere after)
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()


class GradOfTheBatchSum(nn.Module):
    """``torch.func.grad`` of the whole batch's sum: each sample's input gradient (the
    samples are independent); the sum seeds the backward, read for its shape only."""

    def __init__(self):
        super().__init__()
        self.u = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u_x = torch.func.grad(lambda x: self.u(x).sum())(x)
        return u_x[:, 0] + self.u(x)[:, 0]


@pytest.mark.parametrize("loss_reduction", ["sum", "mean"])
def test_grad_of_the_whole_batch_s_sum_is_no_loss_and_is_exact(loss_reduction):
    """The sum is no loss of the graph: with a mean loss it was refused ("the loss inside
    the graph is a sum over the batch but loss_reduction='mean'")."""
    torch.manual_seed(0)
    model = GradOfTheBatchSum().double()
    x = torch.rand(B + 2, 2, dtype=torch.float64)
    assert fxdp.validate(model, x, loss_reduction=loss_reduction) == []
    expected = reference(model, (x,), lambda out, i: out.pow(2).sum())
    dp = fxdp.transform(model, grad_sample=True, max_grad_norm=0.1, loss_reduction=loss_reduction, compiler="eager")
    out = dp(x).pow(2)
    (out.sum() if loss_reduction == "sum" else out.mean()).backward()
    tol = tolerance(torch.float64)
    assert_close_all(_params(model, "grad"), expected.grad(loss_reduction, 0.1), tol, "clipped")
    assert_close_all({"norms": dp.per_sample_norms}, {"norms": expected.norms}, tol, "norms")


class AutogradGradInTheForward(nn.Module):
    """A physics-informed residual written with ``torch.autograd.grad`` in the forward."""

    def __init__(self):
        super().__init__()
        self.u = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        u = self.u(x)
        u_x = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
        return u_x[:, 0] + u[:, 0]


def test_autograd_grad_in_the_forward_is_refused_with_the_torch_func_forms():
    """Dynamo's own hint (``trace_autograd_ops=True``) leads to another refusal: the
    message names the ``torch.func`` forms fxdp follows instead."""
    dp = fxdp.transform(AutogradGradInTheForward().double(), max_grad_norm=1.0, compiler="eager")
    with refused("does not capture torch.autograd.grad .* torch.func.vmap\\(torch.func.grad\\("):
        dp(torch.rand(B, 2, dtype=torch.float64, requires_grad=True))


def test_the_diagonal_of_a_jacobian_of_the_whole_batch_is_refused():
    """The diagonal is each sample's Jacobian only because the samples are independent,
    which the diagonal itself cannot tell: refused by name (it crashed before, with a
    fake tensor of the level's saved values left in the graph)."""
    model = InputGradientOfTheBatch("jacrev").double()
    assert "takes a diagonal across the batch dim" in _reasons(model, torch.randn(B, 3, dtype=torch.float64))


def test_a_layer_norm_weight_gradient_over_the_batch_in_the_forward_is_refused():
    """``native_layer_norm_backward`` asked for its weight's gradient sums it over every
    row, the batch's included."""
    def body(m, h):
        _, mean, rstd = torch.ops.aten.native_layer_norm(h, [D], m.s, None, 1e-5)
        grads = torch.ops.aten.native_layer_norm_backward(h.tanh(), h, [D], mean, rstd, m.s, None,
                                                          [True, True, False])
        return h * grads[1]

    assert "the gradient of its weight or bias sums over the batch" in _reasons(around(body, s=(D,))(),
                                                                                 torch.randn(B, D))


class ScaleLikeTheMean(nn.Module):
    """stable-baselines3's ``DiagGaussianDistribution``: ``ones_like(mean) * log_std.exp()``,
    a parameter multiplied by constants shaped like a batched tensor."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.lin = nn.Linear(5, 2)
        self.log_std = nn.Parameter(torch.tensor([0.3, -0.2]))

    def forward(self, x):
        mean = self.lin(x)
        std = {"ones_like": lambda: torch.ones_like(mean) * self.log_std.exp(),
               "zeros_like": lambda: torch.zeros_like(mean) + self.log_std.exp(),
               "full_like": lambda: torch.full_like(mean, 2.0) * self.log_std.exp()}[self.form]()
        return ((x[:, :2] - mean) / std).pow(2).sum(1) + std.log().sum(1)


@pytest.mark.parametrize("form", ["ones_like", "zeros_like", "full_like"])
def test_a_parameter_times_constants_shaped_like_the_batch_is_exact(form):
    """``ones_like(mean) * p`` was refused ("the parameter has a size other than 1 along
    the batch dim"): the constants were read as shared, so the product was a value of the
    parameter spanning the batch. Read batched like ``mean``, the product is an ordinary
    per-sample use of ``p``."""
    torch.manual_seed(0)
    model = ScaleLikeTheMean(form).double()
    x = torch.randn(4, 5, dtype=torch.float64)
    ref = reference(model, (x,), lambda out, i: out.sum())
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    dp(x).sum().backward()
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                     tolerance(torch.float64), "grad_sample")


class InPlaceTwins(nn.Module):
    """In-place ops whose out-of-place twin of the same overload name takes other
    arguments: ``pow_.Scalar(Tensor self, Scalar exponent)`` is ``pow.Tensor_Scalar``,
    not ``pow.Scalar(Scalar self, Tensor exponent)`` (PyG's ``gcn_norm``:
    ``deg.pow_(-0.5)``); likewise ``float_power_`` and ``ldexp_``."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(3, 4)
        self.scale = nn.Parameter(torch.tensor([0.5, 1.0, 1.5, 2.0]))

    def forward(self, x):
        h = self.lin(x).abs().add(1)
        if self.kind == "pow_":
            h.pow_(-0.5)
        elif self.kind == "float_power_":
            h.float_power_(2.0)
        else:
            h.ldexp_(torch.tensor([1.0, 2.0, 0.0, 1.0], dtype=h.dtype))
        return h * self.scale


@pytest.mark.parametrize("kind", ["pow_", "float_power_", "ldexp_"])
def test_in_place_ops_whose_twin_is_another_overload_are_exact(kind: str):
    """They crashed ("aten::pow() Expected a value of type 'number' for argument 'self'")."""
    torch.manual_seed(0)
    _against_the_loop(InPlaceTwins(kind).double(), torch.randn(B, 3, dtype=torch.float64))


class KeptWeights(nn.Module):
    """A 1-D ``cat`` of shared values whose size the data sets (PyG's
    ``add_remaining_self_loops``: the edge weights a mask keeps, then the loops')."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("w", torch.tensor([0.9, 0.1, 0.7, 0.6, 0.2], dtype=torch.float64))

    def forward(self, x):
        kept = torch.cat([self.w[self.w > 0.5], torch.ones(2, dtype=x.dtype)])
        return self.lin(x) * kept.sum()


def test_a_cat_with_an_operand_of_a_data_dependent_size_is_exact():
    """Such an operand was taken for a legacy empty tensor (``torch.tensor([])``) by a
    test that guards on its size, and the model refused as AOTAutograd's limit."""
    torch.manual_seed(0)
    _against_the_loop(KeptWeights().double(), torch.randn(B, 3, dtype=torch.float64))


class DroppedMean(nn.Module):
    """A mean over the batch computed and dropped (PyG's ``dense_diff_pool`` returns its
    entropy term, which the caller ignores)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        h = self.lin(x)
        aux = h.mean()  # noqa: F841
        return h


def test_a_loss_the_outputs_do_not_depend_on_is_no_loss():
    """It was taken for the in-graph loss, a mean, and refused under ``loss_reduction='sum'``."""
    torch.manual_seed(0)
    _against_the_loop(DroppedMean().double(), torch.randn(B, 3, dtype=torch.float64))


class MaskWrittenAtOtherDims(nn.Module):
    """sinkhorn-transformer's causal sort net: a mask made from the scores' sizes (the
    batch merged with the heads), one value put at positions of the other dims."""

    def __init__(self, rows: str):
        super().__init__()
        self.rows = rows
        self.lin = nn.Linear(D, 2 * D)

    def forward(self, x):  # [B, T, D]
        b, t, _ = x.shape
        q = self.lin(x).reshape(b, t, 2, D).transpose(1, 2).reshape(b * 2, t, D)
        scores = q @ q.transpose(1, 2)
        mask = torch.zeros(scores.shape).bool()
        i, j = torch.triu_indices(t, t, 1)
        if self.rows == "every row":
            mask[:, i, j] = True
        elif self.rows == "a triangle of the batch":  # a boolean mask spans dims 0 and 1
            bias = torch.zeros(t, b * 2, t, dtype=scores.dtype)  # the batch at dim 1, where the mask reaches
            bias.index_put_((torch.ones(t, b * 2).tril().bool(),), torch.tensor(3.0, dtype=scores.dtype),
                            accumulate=True)
            return (scores + bias.transpose(0, 1)).softmax(-1)
        else:
            mask[0, i, j] = True  # the first sample's first head only: placed by position
        return scores.masked_fill(mask, -1e9).softmax(-1)


def test_one_value_put_at_positions_of_other_dims_is_alike_for_every_sample():
    """It was refused ("a shared tensor whose values vary along the batch dim")."""
    torch.manual_seed(0)
    model = MaskWrittenAtOtherDims("every row").double()
    dp = _against_the_loop(model, torch.randn(B, T, D, dtype=torch.float64))
    _against_the_loop(model, torch.randn(B + 1, T, D, dtype=torch.float64), dp=dp)
    for rows in ("the first row", "a triangle of the batch"):
        assert "a shared tensor whose values vary along the batch dim" in _reasons(
            MaskWrittenAtOtherDims(rows).double(), torch.randn(B, T, D, dtype=torch.float64))
