"""``aten.embedding`` and ``aten.embedding_bag`` against the microbatch reference.

One table of cases (module or functional, padding_idx, index rank 1-3, repeated ids,
small and large vocabularies, merged and batch-second layouts, a table used twice,
position tables indexed by ``arange``, EmbeddingBag sum/mean over 2-D input, several
bags per sample, offsets and per_sample_weights) runs in float64 and float32 with
both loss reductions and clipping, checking ``p.grad``, ``p.grad_sample``, the norms
and the clip factors against ``tests/reference.py``. Then the rule functions alone
(every norm route against an autograd loop), the cost choice, the refusals, one
Inductor case and hypothesis-drawn embeddings.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxdp
from fxdp.rules import embedding as rules
from reference import Reference, assert_close_all, reference, tolerance

B, CLASSES = 4, 3

# -- models ------------------------------------------------------------------------------

class EmbeddingHead(nn.Module):
    """ids -> embedding -> tanh -> mean over the id dims -> linear."""

    def __init__(self, num_embeddings: int, dim: int, padding_idx: int | None = None,
                 functional: bool = False, batch_dim: int = 0):
        super().__init__()
        self.functional = functional
        self.padding_idx = padding_idx
        self.batch_dim = batch_dim
        if functional:
            self.weight = nn.Parameter(torch.randn(num_embeddings, dim))
        else:
            self.embedding = nn.Embedding(num_embeddings, dim, padding_idx=padding_idx)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, ids):
        if self.functional:
            e = F.embedding(ids, self.weight, self.padding_idx)
        else:
            e = self.embedding(ids)
        h = torch.tanh(e).movedim(self.batch_dim, 0)
        if h.dim() > 2:
            h = h.flatten(1, -2).mean(1)
        return self.head(h)


class MergedEmbedding(nn.Module):
    """``[B, T]`` ids looked up as ``[B·T]``: the batch merged with the positions."""

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.embedding = nn.Embedding(num_embeddings, dim, padding_idx=1)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, ids):
        e = self.embedding(ids.reshape(-1)).view(*ids.shape, -1)
        return self.head(torch.tanh(e).mean(1))


class TwiceEmbedding(nn.Module):
    """One table looked up twice in one forward (its uses are concatenated)."""

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.embedding = nn.Embedding(num_embeddings, dim, padding_idx=0)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x, z):
        return self.head(torch.tanh(self.embedding(x).mean(1) * self.embedding(z).sum(1)))


class PositionEmbedding(nn.Module):
    """nanoGPT's ``wte(x) + wpe(arange(T))``: the position ids have no batch dim."""

    def __init__(self, num_embeddings: int, positions: int, dim: int, tokens_trainable: bool = True):
        super().__init__()
        self.wte = nn.Embedding(num_embeddings, dim)
        self.wpe = nn.Embedding(positions, dim)
        self.wte.weight.requires_grad_(tokens_trainable)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device)
        return self.head(torch.tanh(self.wte(x) + self.wpe(pos)).mean(1))


class PositionOnFeatures(nn.Module):
    """Float features ``[B, T, d]`` plus a position table indexed by ``arange(T)``."""

    def __init__(self, positions: int, dim: int):
        super().__init__()
        self.wpe = nn.Embedding(positions, dim)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device)
        return self.head(torch.tanh(x + self.wpe(pos)).mean(1))


class ExpandedIndices(nn.Module):
    """Shared ids expanded to the batch before the lookup: positions as
    ``arange(T).expand_as(x)`` (``expand``) or ``broadcast_to``, and Hugging Face BERT's
    token types, ``self.token_type_ids[:, :T].expand(B, T)`` from a ``[1, T]`` buffer."""

    def __init__(self, num_embeddings: int, positions: int, dim: int, how: str):
        super().__init__()
        self.how = how
        self.wte = nn.Embedding(num_embeddings, dim)
        self.wpe = nn.Embedding(positions, dim)
        self.token_type = nn.Embedding(2, dim)
        self.register_buffer("token_type_ids", torch.zeros(1, positions, dtype=torch.long))
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x):
        batch, length = x.shape
        pos = torch.arange(length, device=x.device)
        if self.how == "expand_as":
            pos = pos.expand_as(x)
        elif self.how == "broadcast_to":
            pos = pos.unsqueeze(0).broadcast_to(batch, length)
        token_types = self.token_type_ids[:, :length].expand(batch, length)
        h = self.wte(x) + self.token_type(token_types) + self.wpe(pos)
        return self.head(torch.tanh(h).mean(1))


class BagHead(nn.Module):
    """EmbeddingBag over ``[B, K]`` ids, ``[B, P, K]`` ids (P bags per sample) or
    flat ids with offsets (one bag per sample); optionally gated per_sample_weights."""

    def __init__(self, num_embeddings: int, dim: int, mode: str = "sum",
                 padding_idx: int | None = None, gated: bool = False):
        super().__init__()
        self.bag = nn.EmbeddingBag(num_embeddings, dim, mode=mode, padding_idx=padding_idx)
        self.gate = nn.Linear(2, 1) if gated else None
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, ids, offsets=None, weights=None):
        if self.gate is not None:
            weights = torch.sigmoid(self.gate(weights)).squeeze(-1)
        if ids.dim() == 3:
            k = ids.shape[-1]
            e = self.bag(ids.reshape(-1, k),
                         per_sample_weights=None if weights is None else weights.reshape(-1, k))
            e = e.view(ids.shape[0], ids.shape[1], -1).mean(1)
        else:
            e = self.bag(ids, offsets, per_sample_weights=weights)
        return self.head(torch.tanh(e))


class RawEmbeddingBag(nn.Module):
    """``torch.embedding_bag`` called directly: ``aten.embedding_bag.default`` (no padding_idx),
    its offsets an ``arange`` of the model's own."""

    def __init__(self, num_embeddings: int, dim: int, mode: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_embeddings, dim))
        self.mode = mode
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, ids):
        offsets = torch.arange(0, ids.numel(), ids.shape[1], device=ids.device)
        e = torch.embedding_bag(self.weight, ids.reshape(-1), offsets, False, self.mode)[0]
        return self.head(torch.tanh(e))


# -- inputs and the reference --------------------------------------------------------------

def _ids(shape, high: int, seed: int, padding_idx: int | None = None) -> torch.Tensor:
    """Ids below ``high`` (a small ``high`` repeats ids within a sample), padding included."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, high, shape, generator=g)
    if padding_idx is not None:
        ids.view(-1)[::3] = padding_idx
    return ids


def _floats(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g, dtype=torch.float64).to(dtype)


BAG_LENGTHS = [3, 0, 5, 2]  # bag 1 is empty


def offsets_reference(model: nn.Module, args: tuple, loss_fn: Callable) -> Reference:
    """The microbatch loop for the offsets layout: sample i is bag i, run alone."""
    text, offsets, weights = args
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    grads = {n: [] for n in names}
    for i in range(offsets.shape[0]):
        m = copy.deepcopy(model)
        start = int(offsets[i])
        stop = int(offsets[i + 1]) if i + 1 < offsets.shape[0] else text.shape[0]
        w = None if weights is None else weights[start:stop]
        loss_fn(m(text[start:stop], torch.zeros(1, dtype=offsets.dtype), w), i).backward()
        params = dict(m.named_parameters())
        for n in names:
            grads[n].append(params[n].grad.detach().clone())
    return Reference(names, {n: torch.stack(v) for n, v in grads.items()}, offsets.shape[0])


@dataclasses.dataclass
class Case:
    id: str
    model: Callable[[], nn.Module]
    args: Callable[[torch.dtype], tuple]
    batch_first: bool = True
    in_dims: tuple | None = None
    reference: Callable[..., Reference] | None = None
    marks: tuple = ()
    large_vocab: bool = False  # the embedding's norm must take the ghost route


def _bag_offsets_args(with_weights: bool):
    def args(dtype):
        text = _ids((sum(BAG_LENGTHS),), 6, seed=7, padding_idx=None)
        offsets = torch.tensor([0, 3, 3, 8])
        weights = _floats((text.shape[0],), dtype, seed=8) if with_weights else None
        return text, offsets, weights

    return args


CASES = [
    Case("module-rank1", lambda: EmbeddingHead(10, 4), lambda dt: (_ids((B,), 10, 1),)),
    Case("module-rank2-repeats", lambda: EmbeddingHead(10, 4), lambda dt: (_ids((B, 6), 3, 2),)),
    Case("module-rank2-pad0", lambda: EmbeddingHead(10, 4, padding_idx=0),
         lambda dt: (_ids((B, 6), 5, 3, padding_idx=0),)),
    Case("functional-rank3-pad3", lambda: EmbeddingHead(12, 5, padding_idx=3, functional=True),
         lambda dt: (_ids((B, 3, 4), 6, 4, padding_idx=3),)),
    Case("module-rank3-padlast", lambda: EmbeddingHead(7, 3, padding_idx=-1),
         lambda dt: (_ids((B, 2, 5), 7, 5, padding_idx=6),)),
    Case("functional-rank1-vocab1", lambda: EmbeddingHead(1, 3, functional=True),
         lambda dt: (_ids((B,), 1, 6),)),
    Case("module-batch-second", lambda: EmbeddingHead(9, 4, padding_idx=2, batch_dim=1),
         lambda dt: (_ids((5, B), 4, 9, padding_idx=2),), batch_first=False),
    Case("merged-batch", lambda: MergedEmbedding(8, 4), lambda dt: (_ids((B, 5), 4, 10, padding_idx=1),)),
    Case("large-vocab-pairs", lambda: EmbeddingHead(5000, 4, padding_idx=0),
         lambda dt: (_ids((B, 6), 20, 11, padding_idx=0),), large_vocab=True),
    Case("large-vocab-segments", lambda: EmbeddingHead(3000, 4, padding_idx=5),
         lambda dt: (_ids((B, 64), 40, 12, padding_idx=5),), large_vocab=True),
    Case("tied-twice", lambda: TwiceEmbedding(4000, 4),
         lambda dt: (_ids((B, 5), 6, 13, padding_idx=0), _ids((B, 3), 6, 14)), large_vocab=True),
    Case("position-arange-on-features", lambda: PositionOnFeatures(6, 4),
         lambda dt: (_floats((B, 6, 4), dt, 15),)),
    Case("position-arange-frozen-tokens", lambda: PositionEmbedding(30, 6, 4, tokens_trainable=False),
         lambda dt: (_ids((B, 6), 30, 16),)),
    Case("position-arange-trainable-tokens", lambda: PositionEmbedding(30, 6, 4),
         lambda dt: (_ids((B, 6), 30, 17),)),
    Case("position-expand-as-bert-token-types", lambda: ExpandedIndices(30, 6, 4, "expand_as"),
         lambda dt: (_ids((B, 6), 30, 27),)),
    Case("position-broadcast-to-bert-token-types", lambda: ExpandedIndices(30, 6, 4, "broadcast_to"),
         lambda dt: (_ids((B, 6), 30, 28),)),
    Case("bag-sum-2d", lambda: BagHead(10, 4, "sum"), lambda dt: (_ids((B, 6), 5, 18),)),
    Case("bag-mean-2d-pad0", lambda: BagHead(10, 4, "mean", padding_idx=0),
         lambda dt: (_ids((B, 6), 5, 19, padding_idx=0),)),
    Case("bag-mean-3d-multibag", lambda: BagHead(10, 4, "mean"), lambda dt: (_ids((B, 3, 2), 5, 20),)),
    Case("bag-sum-2d-weights-pad2", lambda: BagHead(10, 4, "sum", padding_idx=2),
         lambda dt: (_ids((B, 6), 5, 21, padding_idx=2), None, _floats((B, 6), dt, 22))),
    Case("bag-sum-2d-gated-weights", lambda: BagHead(10, 4, "sum", gated=True),
         lambda dt: (_ids((B, 6), 5, 23), None, _floats((B, 6, 2), dt, 24) - 0.5)),
    Case("bag-mean-large-vocab", lambda: BagHead(4000, 4, "mean", padding_idx=0),
         lambda dt: (_ids((B, 8), 12, 25, padding_idx=0),), large_vocab=True),
    Case("bag-default-overload-mean", lambda: RawEmbeddingBag(10, 4, mode=1), lambda dt: (_ids((B, 5), 6, 26),)),
    Case("bag-sum-offsets", lambda: BagHead(10, 4, "sum"), _bag_offsets_args(False),
         in_dims=(None, 0, None), reference=offsets_reference),
    Case("bag-mean-offsets-pad0", lambda: BagHead(10, 4, "mean", padding_idx=0), _bag_offsets_args(False),
         in_dims=(None, 0, None), reference=offsets_reference),
    Case("bag-sum-offsets-weights-large-vocab", lambda: BagHead(3000, 4, "sum"), _bag_offsets_args(True),
         in_dims=(None, 0, None), reference=offsets_reference, large_vocab=True),
]

# (loss_reduction, grad_sample): grad_sample=True instantiates every per-sample gradient;
# without it each parameter takes the cheaper route (ghost for the large vocabularies).
SETTINGS = [("mean", True), ("sum", False)]


def _labels(seed: int = 99) -> torch.Tensor:
    return torch.randint(0, CLASSES, (B,), generator=torch.Generator().manual_seed(seed))


def check_case(case: Case, dtype: torch.dtype, reduction: str, grad_sample: bool,
               compiler: str = "eager") -> fxdp.DPModule:
    """Run one case through ``fxdp.transform`` and compare every result to the loop."""
    torch.manual_seed(0)
    model = case.model().to(dtype)
    args = case.args(dtype)
    y = _labels()

    def loss_fn(out, i):
        return F.cross_entropy(out, y[i:i + 1], reduction=reduction)

    if case.reference is not None:
        ref = case.reference(model, args, loss_fn)
    else:
        ref = reference(model, args, loss_fn, batch_dim=0 if case.batch_first else 1)
    assert ref.norms.shape == (B,)
    # Clip about half of the samples.
    max_grad_norm = float(ref.norms.median())
    options = {} if case.in_dims is None else {"in_dims": case.in_dims}
    dp = fxdp.transform(model, max_grad_norm=max_grad_norm, grad_sample=grad_sample,
                        loss_reduction=reduction, batch_first=case.batch_first,
                        compiler=compiler, **options)
    F.cross_entropy(dp(*args), y, reduction=reduction).backward()
    tol = tolerance(dtype)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert_close_all({n: p.grad for n, p in params.items()}, ref.grad(reduction, max_grad_norm), tol, "grad")
    assert_close_all({"norms": dp.per_sample_norms}, {"norms": ref.norms}, tol, "norms")
    assert_close_all({"c": dp.clip_factors}, {"c": ref.clip_factors(max_grad_norm)}, tol, "clip factors")
    assert (ref.clip_factors(max_grad_norm) < 1).any(), "the case must clip some sample"
    if grad_sample:
        assert_close_all({n: p.grad_sample for n, p in params.items()}, ref.per_sample, tol, "grad_sample")
    return dp


def _embedding_plans(dp: fxdp.DPModule) -> list:
    return [p for p in dp.explain().plans if p.rule.startswith("embedding")]


@pytest.mark.parametrize("reduction,grad_sample", SETTINGS, ids=[f"{r}-gs{int(g)}" for r, g in SETTINGS])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_embedding_against_microbatch(case, dtype, reduction, grad_sample):
    dp = check_case(case, dtype, reduction, grad_sample)
    plans = _embedding_plans(dp)
    assert plans, "no embedding rule fired"
    if grad_sample:
        assert all(p.strategy.startswith("instantiate") for p in plans)
    elif case.large_vocab:
        assert all(p.strategy.startswith("ghost") for p in plans), [(p.name, p.strategy, p.costs) for p in plans]


def test_ghost_chosen_for_large_vocab():
    """A 50k vocabulary: instantiating [B, V, d] is far dearer than the ghost norm."""
    torch.manual_seed(0)
    model = EmbeddingHead(50_000, 8, padding_idx=0).double()
    x = _ids((B, 16), 50, 30, padding_idx=0)
    y = _labels()
    ref = reference(model, (x,), lambda out, i: F.cross_entropy(out, y[i:i + 1], reduction="sum"))
    dp = fxdp.transform(model, max_grad_norm=0.1, loss_reduction="sum", compiler="eager")
    F.cross_entropy(dp(x), y, reduction="sum").backward()
    (plan,) = _embedding_plans(dp)
    assert plan.strategy.startswith("ghost") and plan.costs["ghost"] * 100 < plan.costs["instantiate"]
    assert_close_all({"norms": dp.per_sample_norms}, {"norms": ref.norms}, 1e-9, "norms")
    assert_close_all({n: p.grad for n, p in model.named_parameters()}, ref.grad("sum", 0.1), 1e-9, "grad")


def test_tied_uses_concatenate():
    torch.manual_seed(0)
    model = TwiceEmbedding(4000, 4).double()
    x, z = _ids((B, 5), 6, 31, padding_idx=0), _ids((B, 3), 6, 32)
    y = _labels()
    ref = reference(model, (x, z), lambda out, i: F.cross_entropy(out, y[i:i + 1]))
    dp = fxdp.transform(model, max_grad_norm=0.05, compiler="eager")
    F.cross_entropy(dp(x, z), y).backward()
    (plan,) = _embedding_plans(dp)
    assert plan.uses == 2 and plan.strategy.startswith("ghost")
    assert_close_all({"norms": dp.per_sample_norms}, {"norms": ref.norms}, 1e-9, "norms")
    assert_close_all({n: p.grad for n, p in model.named_parameters()}, ref.grad("mean", 0.05), 1e-9, "grad")


def test_inductor_large_vocab():
    case = next(c for c in CASES if c.id == "large-vocab-pairs")
    dp = check_case(case, torch.float32, "mean", False, compiler="inductor")
    assert [p.strategy.split()[0] for p in _embedding_plans(dp)] == ["ghost"]


@pytest.mark.parametrize("vocab", [10, 3000])
def test_empty_batch(vocab):
    """``B == 0``: zero gradients, ``[0, V, d]`` grad samples, ``[0]`` norms."""
    class MeanOverIds(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(vocab, 4, padding_idx=0)
            self.head = nn.Linear(4, CLASSES)

        def forward(self, ids):
            return self.head(torch.tanh(self.embedding(ids)).mean(1))

    model = MeanOverIds().double()
    for grad_sample in (True, False):
        torch._dynamo.reset()
        model.zero_grad()
        dp = fxdp.transform(model, max_grad_norm=0.1, grad_sample=grad_sample, loss_reduction="sum",
                            compiler="eager")
        out = dp(torch.zeros(0, 5, dtype=torch.long))
        F.cross_entropy(out, torch.zeros(0, dtype=torch.long), reduction="sum").backward()
        assert dp.per_sample_norms.shape == (0,)
        assert not model.embedding.weight.grad.any()
        if grad_sample:
            assert model.embedding.weight.grad_sample.shape == (0, vocab, 4)


# -- the rule functions alone: every route against an autograd loop -------------------------

def _loop_per_sample(fn: Callable[[int, torch.Tensor], torch.Tensor], weight: torch.Tensor, n: int) -> torch.Tensor:
    """``[n, V, d]``: the gradient of ``fn(i, weight)`` for each sample ``i``."""
    out = []
    for i in range(n):
        w = weight.detach().clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(fn(i, w), w)
        out.append(grad)
    return torch.stack(out)


EMBEDDING_SHAPES = [(5,), (5, 1), (5, 7), (3, 4, 6), (2, 0)]


@pytest.mark.parametrize("padding_idx", [-1, 0, 4])
@pytest.mark.parametrize("shape", EMBEDDING_SHAPES, ids=str)
def test_embedding_norm_routes(shape, padding_idx):
    """pairs, segments, instantiate and the summed gradient agree with autograd."""
    v, d = 9, 3
    gen = torch.Generator().manual_seed(sum(shape) + padding_idx)
    ids = torch.randint(0, 5, shape, generator=gen)  # ids repeat within a sample
    g = torch.randn(*shape, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, d, dtype=torch.float64)
    config = {"num_embeddings": v, "padding_idx": padding_idx, "scale_grad_by_freq": False}

    expected = _loop_per_sample(
        lambda i, w: (F.embedding(ids[i], w, padding_idx=None if padding_idx < 0 else padding_idx) * g[i]).sum(),
        weight, shape[0])
    per_sample = rules.embedding_weight.per_sample_grad(g, ids, **config)
    torch.testing.assert_close(per_sample, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(rules.embedding_weight.sum_grad(g, ids, **config), expected.sum(0), rtol=0, atol=1e-12)

    sq = expected.flatten(1).pow(2).sum(1)
    torch.testing.assert_close(rules.embedding_weight.ghost_sq_norm(g, ids, **config), sq, rtol=1e-12, atol=1e-12)
    tokens_g, tokens_ids = rules._embedding_tokens(g, ids, config)
    torch.testing.assert_close(rules._pairs_sq_norm(tokens_g, tokens_ids), sq, rtol=1e-12, atol=1e-12)
    sample = rules._regular_sample(tokens_ids)
    segments = rules._segments_sq_norm(rules._keys(tokens_ids, sample, v).reshape(-1), sample.reshape(-1),
                                       tokens_g.reshape(-1, d), shape[0])
    torch.testing.assert_close(segments, sq, rtol=1e-12, atol=1e-12)


def test_embedding_concat_uses():
    v, d = 8, 2
    gen = torch.Generator().manual_seed(0)
    uses = [[torch.randn(3, 4, d, generator=gen, dtype=torch.float64), torch.randint(0, 4, (3, 4), generator=gen)],
            [torch.randn(3, d, generator=gen, dtype=torch.float64), torch.randint(0, 4, (3,), generator=gen)]]
    config = {"num_embeddings": v, "padding_idx": 1}
    merged = rules.embedding_weight.concat_uses(uses)
    summed = sum(rules.embedding_weight.per_sample_grad(*u, **config) for u in uses)
    torch.testing.assert_close(rules.embedding_weight.per_sample_grad(*merged, **config), summed)
    torch.testing.assert_close(rules.embedding_weight.ghost_sq_norm(*merged, **config),
                               summed.flatten(1).pow(2).sum(1))


# per_sample_weights need mode="sum".
BAG_MODES = [("sum", False), ("sum", True), ("mean", False)]


@pytest.mark.parametrize("padding_idx", [-1, 0])
@pytest.mark.parametrize("mode,weighted", BAG_MODES, ids=["sum", "sum-weighted", "mean"])
@pytest.mark.parametrize("layout", ["regular-1bag", "regular-3bags", "offsets"])
def test_embedding_bag_rule_functions(layout, mode, weighted, padding_idx):
    v, d, n = 9, 3, 4
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(v, d, dtype=torch.float64)
    pad = None if padding_idx < 0 else padding_idx
    config = {"num_embeddings": v, "mode": {"sum": 0, "mean": 1}[mode], "padding_idx": padding_idx,
              "include_last_offset": False, "scale_grad_by_freq": False,
              "bags": "offsets" if layout == "offsets" else "regular"}
    if layout == "offsets":
        lengths = [2, 0, 4, 3]
        ids = torch.randint(0, 4, (sum(lengths),), generator=gen)
        offsets = torch.tensor([0, 2, 2, 6])
        psw = torch.rand(ids.shape[0], generator=gen, dtype=torch.float64) if weighted else None
        g = torch.randn(n, d, generator=gen, dtype=torch.float64)
        operands = (g, ids.unsqueeze(0), offsets, None if psw is None else psw.unsqueeze(0))

        def sample_loss(i, w):
            s, e = int(offsets[i]), int(offsets[i]) + lengths[i]
            out = F.embedding_bag(ids[s:e], w, torch.tensor([0]), mode=mode, padding_idx=pad,
                                  per_sample_weights=None if psw is None else psw[s:e])
            return (out * g[i]).sum()
    else:
        bags = 1 if layout == "regular-1bag" else 3
        ids = torch.randint(0, 4, (n, bags, 2), generator=gen)
        psw = torch.rand(n, bags, 2, generator=gen, dtype=torch.float64) if weighted else None
        g = torch.randn(n, bags, d, generator=gen, dtype=torch.float64)
        # Batch-major operands as the core hands them over: [B, P, d] (or [B, d]), [B, P·K].
        operands = (g if bags > 1 else g[:, 0], ids.reshape(n, -1), None,
                    None if psw is None else psw.reshape(n, -1))

        def sample_loss(i, w):
            out = F.embedding_bag(ids[i], w, mode=mode, padding_idx=pad,
                                  per_sample_weights=None if psw is None else psw[i])
            return (out * g[i]).sum()

    expected = _loop_per_sample(sample_loss, weight, n)
    rule = rules.embedding_bag_weight
    torch.testing.assert_close(rule.per_sample_grad(*operands, **config), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(rule.sum_grad(*operands, **config), expected.sum(0), rtol=0, atol=1e-12)
    torch.testing.assert_close(rule.ghost_sq_norm(*operands, **config), expected.flatten(1).pow(2).sum(1),
                               rtol=1e-12, atol=1e-12)


def test_embedding_bag_weights_input_grad():
    """The gradient of per_sample_weights against autograd, padding and an empty bag included."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(7, 3, dtype=torch.float64)
    ids = torch.randint(0, 4, (9,), generator=gen)
    offsets = torch.tensor([0, 4, 4, 6])
    psw = torch.rand(9, generator=gen, dtype=torch.float64, requires_grad=True)
    args = (weight, ids, offsets, False, 0, False, psw, False, 2)
    out = torch.ops.aten.embedding_bag.padding_idx(*args)[0]
    grad_out = torch.randn_like(out)
    (expected,) = torch.autograd.grad(out, psw, grad_out)
    torch.testing.assert_close(rules.EMBEDDING_BAG.input_grad(args, grad_out, 6), expected)


def test_no_input_grad_for_indices():
    weight, ids = torch.randn(5, 2), torch.tensor([[1, 2]])
    with pytest.raises(NotImplementedError, match="indices are integers"):
        rules.EMBEDDING.input_grad((weight, ids), torch.randn(1, 2, 2), 1)
    with pytest.raises(NotImplementedError, match="argument 2"):
        rules.EMBEDDING_BAG.input_grad((weight, ids.view(-1), torch.tensor([0])), torch.randn(1, 2), 2)


def test_costs_choose_by_vocabulary():
    small = rules.embedding_weight.costs([(8, 6, 4), (8, 6)], num_embeddings=10)
    large = rules.embedding_weight.costs([(8, 6, 4), (8, 6)], num_embeddings=50_000)
    assert small["instantiate"] < small["ghost"]
    assert large["ghost"] < large["instantiate"]
    # Long sequences: the segment route keeps the ghost cost linear in T.
    long = rules.embedding_weight.costs([(8, 4096, 16), (8, 4096)], num_embeddings=50_000)
    assert long["ghost"] < 8 * 4096 * 4096
    assert rules._segments_cost(8 * 4096, 16) < rules._pairs_cost(8, 4096, 16)


# -- refusals and the registry ----------------------------------------------------------------

def _problems(model, *args, **options):
    return [str(p) for p in fxdp.validate(model, *args, compiler="eager", **options)]


@pytest.mark.parametrize("batch_size", [B, 1, 0])
def test_refuses_max_norm_with_what_to_do_instead(batch_size):
    """``max_norm`` rewrites the weight in place in the forward (under ``no_grad``):
    refused at any batch size, one sample included, never a step whose per-sample
    results miss the parameter."""
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Flatten(1), nn.Linear(12, 2))
    problems = _problems(model, _ids((batch_size, 3), 10, 40))
    assert any("max_norm" in p and "0.weight" in p and "torch.renorm" in p for p in problems), problems
    with pytest.raises(fxdp.UnsupportedError, match="max_norm"):
        fxdp.transform(model, grad_sample=True, compiler="eager")(_ids((batch_size, 3), 10, 40)).sum().backward()


def test_refuses_scale_grad_by_freq():
    model = nn.Sequential(nn.Embedding(10, 4, scale_grad_by_freq=True), nn.Flatten(1), nn.Linear(12, 2))
    problems = _problems(model, _ids((B, 3), 10, 40))
    assert any("scale_grad_by_freq" in p and "0.weight" in p for p in problems), problems


def test_refuses_scale_grad_by_freq_on_shared_indices():
    model = PositionOnFeatures(6, 4)
    model.wpe.scale_grad_by_freq = True
    problems = _problems(model, _floats((B, 6, 4), torch.float32, 42))
    assert any("scale_grad_by_freq" in p for p in problems), problems


def test_scale_grad_by_freq_on_shared_indices_never_runs_unscaled():
    """Whatever validate says, the backward must raise rather than ignore the scaling."""
    model = PositionOnFeatures(6, 4)
    model.wpe.scale_grad_by_freq = True
    dp = fxdp.transform(model, max_grad_norm=1.0, compiler="eager", strict=True)
    with pytest.raises(Exception, match="scale_grad_by_freq"):
        dp(_floats((B, 6, 4), torch.float32, 43)).sum().backward()


def test_refuses_bag_max():
    problems = _problems(BagHead(10, 4, "max"), _ids((B, 5), 10, 41))
    assert any("mode='max'" in p for p in problems), problems


def test_refuses_shared_offsets_over_batched_ids():
    """Without in_dims the flat ids are the batch: a bag would hold several samples."""
    text, offsets, _ = _bag_offsets_args(False)(torch.float32)
    problems = _problems(BagHead(10, 4, "sum"), text, offsets)
    assert any("several samples" in p for p in problems), problems


def test_registry():
    assert fxdp.is_supported(nn.Embedding) and fxdp.is_supported(nn.EmbeddingBag(5, 2))
    assert fxdp.is_supported(torch.ops.aten.embedding.default)
    assert fxdp.is_supported(torch.ops.aten.embedding_bag.padding_idx)


# -- hypothesis -------------------------------------------------------------------------------

@st.composite
def embedding_configs(draw):
    vocab = draw(st.sampled_from([1, 2, 5, 13, 2000]))
    rank = draw(st.integers(1, 3))
    shape = (draw(st.integers(1, 4)), *draw(st.lists(st.integers(1, 4), min_size=rank - 1, max_size=rank - 1)))
    high = draw(st.integers(1, min(vocab, 6)))
    padding_idx = draw(st.one_of(st.none(), st.integers(0, vocab - 1)))
    return {
        "vocab": vocab, "dim": draw(st.integers(1, 5)), "shape": shape, "high": high,
        "padding_idx": padding_idx, "functional": draw(st.booleans()),
        "reduction": draw(st.sampled_from(["mean", "sum"])), "grad_sample": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=20, deadline=None)
@given(embedding_configs())
def test_hypothesis_embeddings(config):
    torch._dynamo.reset()
    torch.manual_seed(config["seed"])
    model = EmbeddingHead(config["vocab"], config["dim"], config["padding_idx"], config["functional"]).double()
    ids = _ids(config["shape"], config["high"], config["seed"])
    n = config["shape"][0]
    y = torch.randint(0, CLASSES, (n,))
    reduction = config["reduction"]

    def loss_fn(out, i):
        return F.cross_entropy(out, y[i:i + 1], reduction=reduction)

    ref = reference(model, (ids,), loss_fn)
    max_grad_norm = float(ref.norms.median()) + 1e-3
    dp = fxdp.transform(model, max_grad_norm=max_grad_norm, grad_sample=config["grad_sample"],
                        loss_reduction=reduction, compiler="eager")
    F.cross_entropy(dp(ids), y, reduction=reduction).backward()
    assert_close_all({n_: p.grad for n_, p in model.named_parameters()}, ref.grad(reduction, max_grad_norm),
                     1e-9, "grad")
    assert_close_all({"norms": dp.per_sample_norms}, {"norms": ref.norms}, 1e-9, "norms")
    if config["grad_sample"]:
        assert_close_all({n_: p.grad_sample for n_, p in model.named_parameters()}, ref.per_sample, 1e-9,
                         "grad_sample")


@pytest.mark.parametrize("how", ["expand_as", "broadcast_to"])
def test_expanded_indices_new_batch_and_sequence_sizes(how):
    """The expand's sizes become symbols on the second size (``expand_as`` reads them
    from the ids); every size stays exact."""
    torch.manual_seed(0)
    _check_over_sizes(ExpandedIndices(30, 9, 4, how).double(), [(4, 6), (5, 6), (7, 9)])


def _check_over_sizes(model: nn.Module, sizes: list[tuple[int, int]]) -> None:
    """One ``fxdp.transform`` called on ids of each ``(batch, length)``, every call's
    ``grad_sample`` against the loop."""
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    for batch, length in sizes:
        x = _ids((batch, length), 30, seed=batch + length)
        y = torch.randint(0, CLASSES, (batch,), generator=torch.Generator().manual_seed(length))
        for p in model.parameters():
            p.grad = p.grad_sample = None
        F.cross_entropy(dp(x), y, reduction="sum").backward()
        ref = reference(model, (x,), lambda out, i: F.cross_entropy(out, y[i:i + 1], reduction="sum"))
        assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                         tolerance(torch.float64), f"grad_sample {batch}x{length}")


class WeightedBags(nn.Module):
    """EmbeddingBag over ``[B, K]`` ids, whose offsets ``arange(0, B·K, K)`` are symbolic
    on a graph compiled for any batch size; ``weighted``: per_sample_weights from a
    buffer expanded to the batch (each row the same weights)."""

    def __init__(self, weighted: bool, k: int = 6):
        super().__init__()
        self.weighted = weighted
        self.bag = nn.EmbeddingBag(30, 4, mode="sum")
        self.register_buffer("w", torch.linspace(0.5, 1.5, k))
        self.head = nn.Linear(4, CLASSES)

    def forward(self, ids):
        w = self.w.expand(ids.shape[0], -1) if self.weighted else None
        return self.head(torch.tanh(self.bag(ids, per_sample_weights=w)))


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weights-expanded"])
def test_bags_of_2d_ids_over_batch_sizes(weighted: bool):
    torch.manual_seed(0)
    _check_over_sizes(WeightedBags(weighted).double(), [(B, 6), (B + 1, 6), (B + 3, 6)])


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weights-expanded"])
def test_bags_of_one_id_over_batch_sizes(weighted: bool):
    """``[B, 1]`` ids: the offsets ``arange(0, B, 1)`` come with their step left out, which
    the bag layout's reading of them took for a third argument ("mixes samples: not
    enough values to unpack", on the symbolic graph, before the sixty-fourth session; a
    red team's find)."""
    torch.manual_seed(0)
    _check_over_sizes(WeightedBags(weighted, k=1).double(), [(B, 1), (B + 1, 1), (B + 3, 1)])


class FlatBagsOfTheModel(nn.Module):
    """DLRM's sparse features: ``[B, K]`` ids flattened, with offsets the model makes,
    ``arange(0, B·K, K)`` or ``arange(B) * K``."""

    def __init__(self, how: str, k: int = 5):
        super().__init__()
        self.how, self.k = how, k
        self.table = nn.Parameter(torch.randn(30, 4))
        self.head = nn.Linear(4, CLASSES)

    def forward(self, ids):
        n = ids.shape[0]
        if self.how == "step":
            offsets = torch.arange(0, n * self.k, self.k, device=ids.device)
        else:
            offsets = torch.arange(n, device=ids.device) * self.k
        return self.head(F.embedding_bag(ids.reshape(-1), self.table, offsets, mode="sum"))


@pytest.mark.parametrize("how", ["step", "times_k"])
def test_flat_bags_with_offsets_of_the_model(how: str):
    """``arange(B) * K`` was refused ("its bags (offsets shared by all samples) may hold
    the ids of several samples"): it is ``arange(0, B·K, K)``, bags of ``K`` ids."""
    torch.manual_seed(0)
    _check_over_sizes(FlatBagsOfTheModel(how).double(), [(B, 5), (B + 1, 5), (B + 3, 5)])


@pytest.mark.parametrize("to_device", [False, True])
def test_gpt2_position_rows_over_many_sequence_lengths(to_device: bool):
    """Hugging Face GPT-2 looks positions up as ``wpe(arange(T)[None])``: a ``[1, T, d]``
    lookup, expanded to the batch as a broadcast. Twelve lengths stay within Dynamo's
    recompile limit (a per-sample VJP through the lookup specialised every length) and
    stay exact. Its ``.to(inputs_embeds.device)`` after the lookup changes nothing and
    is dropped: the table keeps the embedding rule and its ghost norm."""

    class GPT2Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(30, 4)
            self.wpe = nn.Embedding(16, 4)
            self.head = nn.Linear(4, CLASSES)

        def forward(self, x):
            h = self.wte(x)
            positions = self.wpe(torch.arange(x.shape[1], device=x.device)[None])
            if to_device:
                positions = positions.to(h.device)
            return self.head(torch.tanh(h + positions).mean(1))

    torch.manual_seed(0)
    model = GPT2Positions().double()
    plans = {plan.name: plan for plan in fxdp.explain(model, _ids((B, 5), 30, seed=0), max_grad_norm=1.0).plans}
    assert plans["wpe.weight"].rule == "embedding.weight"
    _check_over_sizes(model, [(B, length) for length in range(3, 15)])


class DistinctRowsGatheredBack(nn.Module):
    """pykeen's representations: each distinct index looked up once (``u, inv =
    idx.unique(return_inverse=True)``), the rows gathered back with ``rows[inv]``."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, CLASSES)
        self.register_buffer("tokens", torch.randint(0, 10, (10, 3), generator=torch.Generator().manual_seed(0)))

    def forward(self, ids):
        if self.kind == "consecutive":
            u, inv = torch.unique_consecutive(ids, return_inverse=True)
        else:
            u, inv = ids.unique(return_inverse=True)
        if self.kind == "tokens of each entity":  # NodePiece: tokens[u], their embeddings, pooled
            rows = self.proj(self.emb(self.tokens[u]).mean(1)).relu()
        elif self.kind == "a view of each lookup":  # pykeen's Embedding: x.view(*u.shape, *shape)
            rows = self.proj(self.emb(u).view(*u.shape, 2, 2).flatten(1)).relu()
        elif self.kind == "tokens of each entity viewed":  # NodePiece through pykeen's Embedding
            tokens = self.tokens[u]
            rows = self.proj(self.emb(tokens).view(*tokens.shape, 4).mean(1)).relu()
        elif self.kind == "a lookup of the next id":  # ids computed from the distinct values
            rows = self.proj(self.emb((u + 1) % 10) * self.emb(u))
        elif self.kind == "each row normalised":  # pykeen's normalizers: F.normalize, then a log-softmax
            rows = self.proj(F.normalize(self.emb(u), dim=1).log_softmax(1))
        elif self.kind == "over the count of distinct values":
            rows = self.emb(u) / u.shape[0]
        elif self.kind == "beside the sum over the distinct values":
            rows = self.emb(u) + self.emb(u).sum(0).expand(u.shape[0], 4)
        elif self.kind == "halves of the rows":  # [2U, 2]: inv picks half rows of other distinct values
            rows = self.emb(u).reshape(-1, 2).repeat(1, 2)
        elif self.kind == "rows of the table":
            rows = self.emb.weight[u] * 2
        elif self.kind == "centred over the distinct values":  # a mean over them mixes the samples
            rows = self.emb(u) - self.emb(u).mean(0)
        elif self.kind == "rows moved off dim 0":  # [U, 4] + [1, 1, 4]: [1, U, 4], inv indexes the 1
            rows = self.emb(u) + torch.zeros(1, 1, 4, dtype=self.emb.weight.dtype)
        else:
            rows = self.proj(self.emb(u).tanh())
        return self.head(rows[inv])


@pytest.mark.parametrize("kind, ids", [
    ("lookup", [3, 7, 3, 1]),
    ("lookup", [[3, 7], [3, 1], [1, 1]]),
    ("consecutive", [3, 3, 7, 1]),
    ("tokens of each entity", [3, 7, 3, 1]),
    ("a view of each lookup", [3, 7, 3, 1]),
    ("tokens of each entity viewed", [3, 7, 3, 1]),
    ("each row normalised", [3, 7, 3, 1]),
    ("a lookup of the next id", [3, 7, 3, 1]),
    ("a lookup of the next id", [[3, 7], [3, 1], [9, 9]]),
    ("rows of the table", [3, 7, 3, 1]),
])
def test_rows_of_distinct_indices_gathered_back_are_each_samples_lookup(kind, ids):
    """``f(u)[inv]`` is ``f(ids)`` (``unique_rows_gathered_back_pass``); it was refused
    ("no batch-dim propagation for aten._unique2"), through a view that keeps the rows
    (pykeen's every representation but an ``Embedding``, a helper's sweep) until the
    sixty-fourth session, and so was a row combined with its own norm or normalised by a
    ``softmax.int``, or a lookup at ids computed from the distinct values (red teams'
    finds)."""
    torch.manual_seed(0)
    model = DistinctRowsGatheredBack(kind).double()
    ids = torch.tensor(ids)
    used = ["emb.weight", "head.weight", "head.bias"]
    if kind in ("lookup", "tokens of each entity", "a view of each lookup", "tokens of each entity viewed",
                "each row normalised", "a lookup of the next id"):
        used += ["proj.weight", "proj.bias"]
    ref = reference(model, (ids,), lambda out, i: out.pow(2).sum())
    dp = fxdp.transform(model, grad_sample=True, max_grad_norm=0.3, loss_reduction="sum", compiler="eager")
    dp(ids).pow(2).sum().backward()
    tol = tolerance(torch.float64)
    params = dict(model.named_parameters())
    assert_close_all({n: params[n].grad_sample for n in used}, {n: ref.per_sample[n] for n in used}, tol,
                     "grad_sample")
    clipped = ref.grad("sum", 0.3)
    assert_close_all({n: params[n].grad for n in used}, {n: clipped[n] for n in used}, tol, "clipped grad")


@pytest.mark.parametrize("kind, ids", [("centred over the distinct values", [3, 7, 3, 1]),
                                       ("rows moved off dim 0", [3, 3, 3, 3]),
                                       ("halves of the rows", [3, 7, 3, 1]),
                                       ("over the count of distinct values", [3, 7, 3, 1]),
                                       ("beside the sum over the distinct values", [3, 7, 3, 1])])
def test_rows_of_distinct_indices_mixed_before_the_gather_are_refused(kind, ids):
    problems = fxdp.validate(DistinctRowsGatheredBack(kind).double(), torch.tensor(ids))
    assert problems and any("aten._unique2" in p.op for p in problems), problems


class _CodebooksLookedUp(nn.Module):
    """Residual-VQ style codebooks ``[Q, K, d]`` looked up at each sample's codes ``[B,
    Q]`` with the codebook index a shared tensor alike for every sample
    (``arange(Q).expand(B, Q)`` or ``.repeat(B, 1)``, Hugging Face's way of building
    position ids): exact (crashed in the per-sample VJP before the fifty-fifth session:
    "Mismatch in shape"); a table read at ``arange(B)`` beside the codes hands sample
    ``b`` row ``b``, refused for a parameter and a buffer alike (the buffer's was accepted
    with wrong gradients)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.codebooks = nn.Parameter(torch.randn(3, 6, 4))
        self.register_buffer("table", torch.randn(5, 6))
        self.lin = nn.Linear(4, 2)

    def forward(self, codes):  # [B, 3] integer codes
        batch = codes.shape[0]
        if self.how == "expanded":
            return self.lin(self.codebooks[torch.arange(3)[None].expand(batch, 3), codes].sum(1))
        if self.how == "repeated":
            return self.lin(self.codebooks[torch.arange(3).unsqueeze(0).repeat(batch, 1), codes].sum(1))
        scale = self.table[torch.arange(batch)[:, None], codes]  # "a buffer's row per position"
        return self.lin(self.codebooks[0, codes] * scale[..., None]).sum(1)


@pytest.mark.parametrize("how", ["expanded", "repeated", "a buffer's row per position"])
def test_codebooks_looked_up_with_a_shared_index_beside_the_codes(how):
    torch.manual_seed(0)
    model = _CodebooksLookedUp(how).double()
    codes = torch.randint(0, 6, (3, 3))
    dp = fxdp.transform(model, grad_sample=True, compiler="eager", loss_reduction="sum")
    if how == "a buffer's row per position":
        with pytest.raises(fxdp.UnsupportedError, match="shared tensor whose values vary along the batch dim"):
            dp(codes).pow(2).sum().backward()
        return
    ref = reference(model, (codes,), lambda out, i: out.pow(2).sum())
    dp(codes).pow(2).sum().backward()
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                     tolerance(torch.float64), "grad_sample")


class FrequencyOfAList(nn.Module):
    """Hugging Face's TimesFM: the frequency of each series passed as a Python list and
    looked up by ``torch.tensor(freq[:B]).reshape(-1, 1)``, a constant of the graph (or
    scaling the features, ``kind="scale"``)."""

    def __init__(self, kind: str = "lookup"):
        super().__init__()
        self.lin, self.freq, self.kind = nn.Linear(4, 4), nn.Embedding(3, 4), kind

    def forward(self, x, freq):  # x [B, T, 4]
        if self.kind == "scale":
            scale = torch.tensor(freq[: x.shape[0]], dtype=x.dtype)[:, None, None]
            return self.lin(x) * scale + self.freq.weight[0]
        if self.kind == "a longer list sliced":
            return self.lin(x) + self.freq(torch.tensor(freq)[: x.shape[0]].reshape(-1, 1))
        return self.lin(x) + self.freq(torch.tensor(freq[: x.shape[0]], dtype=torch.int32).reshape(-1, 1))


@pytest.mark.parametrize("kind", ["lookup", "scale", "a longer list sliced"])
def test_a_list_of_one_frequency_is_one_row_broadcast_to_the_batch(kind):
    """``freq = [0] * B``: every sample reads the same row, its per-sample gradient each
    sample's alone (the lookup was refused before the sixty-first session as "the
    parameter has a size other than 1 along the batch dim of the output"). The constant is the size of the
    batch, so the loop gives each sample the first entries of the list: equal to its own
    where they are all one number."""
    torch.manual_seed(0)
    model = FrequencyOfAList(kind).double()
    for batch, number in ((3, 0), (4, 2)):
        dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
        x, freq = torch.randn(batch, 5, 4, dtype=torch.float64), [number] * (batch + 2 * (kind != "lookup"))
        for p in model.parameters():
            p.grad = p.grad_sample = None
        (dp(x, freq) ** 2).sum().backward()
        ref = reference(model, (x, freq), lambda out, i: (out ** 2).sum(), in_dims=(0, None))
        assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                         tolerance(torch.float64), f"grad_sample B={batch}")


def test_a_list_of_each_samples_frequency_is_refused_with_what_to_pass():
    """``freq = [0, 1, 2]``: each sample's own number, built inside the model into a
    constant the size of the batch, is refused; the message says to pass it batched."""
    problems = fxdp.validate(FrequencyOfAList().double(), torch.randn(3, 5, 4, dtype=torch.float64), [0, 1, 2])
    assert [(p.op, p.parameter) for p in problems] == [("aten.add.Tensor", "freq.weight")], problems
    assert "torch.tensor of a Python list" in problems[0].reason
    assert "pass per-sample values as a tensor batched with the input" in problems[0].reason


class MagnitudeOfThePadding(nn.Module):
    """A lookup with a padding row, normalised by its magnitude (Gemma3n's AltUp,
    ``mean(h ** 2) ** 0.5``), whose gradient at the zero padding row is NaN: PyTorch's
    backward skips padding positions, so the loop's gradients are finite."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        if how == "embedding_bag":
            self.emb = nn.EmbeddingBag(10, 4, mode="sum", padding_idx=0)
        else:
            self.emb = nn.Embedding(10, 4, padding_idx=0)
        self.head = nn.Linear(4, 10 if how == "tied, ghost norms" else 1, bias=False)
        if how == "tied, ghost norms":
            self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(h * (h ** 2).mean(-1, keepdim=True) ** 0.5 + h)


@pytest.mark.parametrize("how", ["embedding", "embedding_bag", "tied, ghost norms"])
def test_a_nan_gradient_at_padding_positions_stays_out(how):
    """NaN before the sixty-second session, the padding zeroed by a product (0 · NaN), in
    each rule that zeroes it (a helper's sweep of Hugging Face's Gemma3n)."""
    torch.manual_seed(0)
    model = MagnitudeOfThePadding(how).double()
    ids = torch.tensor([[0, 0, 3], [2, 4, 5], [6, 0, 8]]) if how != "embedding_bag" else \
        torch.tensor([[0, 0], [2, 0], [6, 7]])  # (sample 0's bag is padding alone)
    ref = reference(copy.deepcopy(model), (ids,), lambda out, i: out.sum())
    dp = fxdp.transform(model, grad_sample=how != "tied, ghost norms", max_grad_norm=1.0, loss_reduction="sum",
                        compiler="eager")
    dp(ids).sum().backward()
    params = dict(model.named_parameters())
    if how != "tied, ghost norms":
        assert_close_all({n: p.grad_sample for n, p in params.items()}, ref.per_sample, tolerance(torch.float64),
                         "grad_sample")
    assert_close_all({n: p.grad for n, p in params.items()}, ref.grad("sum", 1.0), tolerance(torch.float64), "grad")
