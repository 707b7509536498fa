"""Parameters used on the rows a boolean mask selected (``passes/masked_rows.py``).

``f(x[mask])`` with a parameter in ``f`` (a linear, a lookup, a norm over each row, an
elementwise op) and the result written back by the mask (torchtune's
``FusionEmbedding``, a masked-LM head run on the masked positions only): fxdp runs the
op on the rows put back in place, a use on the whole batch. Checked against the
microbatch loop (per-sample gradients, norms and the clipped gradient) at two batch
sizes on one transformed model, with a sample that selects nothing and a batch that
selects nothing.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdp
from reference import assert_close_all, reference, tolerance

T, D, V = 5, 4, 12


class SplitByToken(nn.Module):
    """Rows a mask picks through a linear and a LayerNorm, the others through an
    embedding; both written back by their masks (``out[m] = f(x[m])``)."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm, self.emb = nn.Linear(D, 3), nn.LayerNorm(3), nn.Embedding(V, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.head = nn.Linear(3, 2)

    def forward(self, x, tokens):
        m = tokens < V // 2
        out = torch.zeros(*tokens.shape, 3, dtype=x.dtype)
        out[m] = self.norm(self.lin(x[m])) * self.scale
        out[~m] = self.emb(tokens[~m])
        return self.head(torch.tanh(out))


class FusionEmbedding(nn.Module):
    """torchtune's ``FusionEmbedding`` as it is written: two tables, each looked up on
    the tokens it holds (``masked_select``), scattered back by the masks."""

    def __init__(self):
        super().__init__()
        self.embedding, self.fusion_embedding = nn.Embedding(V - 4, D), nn.Embedding(4, D)
        self.dim = D
        self.head = nn.Linear(D, 2)

    def forward(self, x, tokens):
        bs, seq_len = tokens.size()
        vocab_size = self.embedding.num_embeddings
        mask = tokens < vocab_size
        ids = torch.masked_select(tokens, mask)
        fusion_ids = torch.masked_select(tokens, ~mask) - vocab_size
        embeds = self.embedding(ids)
        fusion_embeds = self.fusion_embedding(fusion_ids)
        out = torch.empty(bs, seq_len, self.dim, dtype=self.embedding.weight.dtype)
        mask = mask.unsqueeze(-1).expand(bs, seq_len, self.dim)
        out = out.masked_scatter(mask, embeds)
        out = out.masked_scatter(~mask, fusion_embeds)
        return self.head(out + x)


class MaskedLMHead(nn.Module):
    """fairseq's RoBERTa head with ``masked_tokens``: the projection, GELU, LayerNorm and
    the output layer tied to the embedding run on the masked positions only."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.dense, self.norm = nn.Linear(D, D), nn.LayerNorm(D)
        self.bias = nn.Parameter(torch.randn(V))

    def forward(self, x, tokens):
        h = self.emb(tokens) + x
        masked = tokens % 3 == 0
        f = self.norm(F.gelu(self.dense(h[masked, :])))
        logits = F.linear(f, self.emb.weight) + self.bias
        full = logits.new_zeros(*tokens.shape, V)
        full[masked] = logits
        return full


class TableAtMaskedIds(nn.Module):
    """torchgeo's Panopticon channel embedding: a parameter table indexed at the ids a
    mask selected, ``embs[mask] = table[-(ids[mask] + 1)]``, written back by the mask
    (refused as mixing the selected rows before the fifty-ninth session)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(4, D))
        self.lin = nn.Linear(D, D)

    def forward(self, x, tokens):
        ids = tokens - 4  # negative: a row of the table, counted from its end
        mask = ids < 0
        embs = torch.zeros(*tokens.shape, D, dtype=x.dtype)
        embs[mask] = self.table[-(ids[mask] + 1)]
        return self.lin(x + embs)


class RealImages(nn.Module):
    """Idefics2's vision tower on the real images only: the all-zero padding images are
    dropped (a mask over the batch dim itself), the rest patchified by a convolution,
    flattened along their trailing dims, projected, and written back in place."""

    def __init__(self):
        super().__init__()
        self.patches = nn.Conv2d(2, 3, 2, 2)
        self.proj = nn.Linear(3, 2)

    def forward(self, x, tokens):
        images = x[:, :4].reshape(-1, 2, 2, 4)  # [B, 2, 2, 4] from [B, T, D]
        images = images * (tokens[:, :1, None, None] != 1)  # sample 0 (all ones): a padding image
        real = (images == 0.0).sum(dim=(-1, -2, -3)) != images.shape[1:].numel()
        h = self.patches(images[real].contiguous()).flatten(2).transpose(1, 2)  # [N, 2, 3]
        out = torch.zeros(x.shape[0], 2, 2, dtype=x.dtype)
        out[real] = self.proj(h)
        return out


class MaskCoordinates(nn.Module):
    """Rows picked by the coordinates of a mask's ``nonzero`` (``bi, ti = torch.where(mask)``,
    as detection and point-cloud code index), projected, and written back at those
    coordinates: indexing by the mask itself."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x, tokens):
        bi, ti = torch.where(tokens % 3 == 0)
        out = torch.zeros_like(x)
        out[bi, ti] = self.proj(x[bi, ti])
        return out + x


class MaskCoordinatesReadOtherwise(nn.Module):
    """The coordinates of a mask's ``nonzero`` read together (``x[bi, ti]``) and the sample
    coordinate alone (``h[nz[:, 0]]``, ``index_add(0, nz[:, 0], ...)``, a mixture of
    experts' dispatch): the rows a ``nonzero`` found, in both reads."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x, tokens):
        nz = (tokens % 3 == 0).nonzero()
        bi, ti = nz.unbind(1)
        h = self.b(x[:, 0])
        y = self.a(x[bi, ti]) * h[nz[:, 0]]
        return x[:, 0] + torch.zeros(x.shape[0], D, dtype=x.dtype).index_add(0, nz[:, 0], y)


MODELS = {"split by token": SplitByToken, "fusion embedding": FusionEmbedding, "masked LM head": MaskedLMHead,
          "real images": RealImages, "coordinates of a mask": MaskCoordinates,
          "coordinates of a mask, read otherwise too": MaskCoordinatesReadOtherwise,
          "a table at the ids a mask selected": TableAtMaskedIds}


def _inputs(size: int, dtype: torch.dtype, nothing: bool = False):
    g = torch.Generator().manual_seed(size)
    x = torch.randn(size, T, D, generator=g, dtype=dtype)
    tokens = torch.randint(0, V, (size, T), generator=g)
    tokens[0] = 1  # one sample whose tokens all fall on one side of each mask
    if nothing:  # no position of the batch selected by the masked-LM head's mask
        tokens = tokens // 3 * 3 + 1
    return x, tokens


def _loss(out):
    return out.pow(2).sum()


def _clip_norm(model) -> float:
    """The median per-sample norm of a first batch: about half the samples clip."""
    return float(reference(model, _inputs(3, torch.float64), lambda out, i: _loss(out)).norms.median())


def _check_step(model, call, clip: float, size: int, dtype: torch.dtype, nothing: bool = False) -> None:
    x, tokens = _inputs(size, dtype, nothing)
    ref = reference(model, (x, tokens), lambda out, i: _loss(out))
    out = call(x, tokens)
    torch.testing.assert_close(out, model(x, tokens))
    _loss(out).backward()
    tol = tolerance(dtype)
    params = dict(model.named_parameters())
    assert_close_all({n: p.grad_sample for n, p in params.items()}, ref.per_sample, tol, "grad_sample")
    assert_close_all({"norms": fxdp.per_sample_norms(model)}, {"norms": ref.norms}, tol, "norms")
    assert_close_all({n: p.grad for n, p in params.items()}, ref.grad("sum", clip), tol, "grad")
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("wrapped", ["transform", "backend"])
@pytest.mark.parametrize("name", list(MODELS))
def test_parameters_on_rows_a_mask_selected_are_exact(name, wrapped):
    torch.manual_seed(0)
    model = MODELS[name]().double()
    clip = _clip_norm(model)
    options = dict(grad_sample=True, max_grad_norm=clip, loss_reduction="sum", compiler="eager")
    call = (fxdp.transform(model, **options) if wrapped == "transform"
            else torch.compile(model, backend=fxdp.backend(**options)))
    # Under the backend Dynamo captures ``x[mask]`` where the user asks it to.
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=wrapped == "backend"):
        for size in (3, 4):
            _check_step(model, call, clip, size, torch.float64)
        if name in ("masked LM head", "a table at the ids a mask selected"):
            _check_step(model, call, clip, 4, torch.float64, nothing=True)


def test_parameters_on_rows_a_mask_selected_under_inductor():
    torch.manual_seed(0)
    model = MaskedLMHead()
    clip = _clip_norm(model.double())
    model.float()
    call = fxdp.transform(model, grad_sample=True, max_grad_norm=clip, loss_reduction="sum")
    for size in (3, 4):
        _check_step(model, call, clip, size, torch.float32)


def test_the_op_on_the_rows_runs_on_the_batch_in_the_canonical_graph():
    """The rewrite is visible where users look: ``explain`` shows the rows put back in
    place and the op's rule on a batched use."""
    text = str(fxdp.explain(SplitByToken().double(), *_inputs(3, torch.float64)))
    assert "fxdp.rows_to_batch" in text and "fxdp.batch_to_rows" in text
    assert "lin.weight" in text and "emb.weight" in text


class RowsBaggedTogether(nn.Module):
    """An embedding bag over the selected tokens with fixed offsets: bags of rows of
    several samples."""

    def __init__(self):
        super().__init__()
        self.bags = nn.EmbeddingBag(V, D, mode="sum")

    def forward(self, x, tokens):
        m = tokens < V // 2
        return x + self.bags(tokens[m], torch.tensor([0, 2])).sum(0)


def test_a_parameter_op_that_mixes_the_selected_rows_is_refused():
    problems = fxdp.validate(RowsBaggedTogether().double(), *_inputs(3, torch.float64))
    assert [p.op for p in problems] == ["aten.embedding_bag.padding_idx"], problems
    assert "boolean mask selected from the whole batch" in problems[0].reason


class TaggerLoss(nn.Module):
    """A token tagger's loss on the positions a padding mask keeps, summed over them
    (flair's ``SequenceTagger``: ``cross_entropy(scores[mask], tags[mask], reduction="sum")``):
    the sum over the samples of each sample's own tokens' losses. ``how`` names the forms
    that normalise by how many positions every sample's mask kept, refused."""

    def __init__(self, how: str = "sum"):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(D, 3)

    def forward(self, x, tokens):
        keep = tokens < V - 2  # padding at the end of some samples
        scores, tags = self.lin(x)[keep], tokens[keep] % 3
        if self.how == "sum":
            return F.cross_entropy(scores, tags, reduction="sum")
        if self.how == "squares":
            return scores.pow(2).sum()
        if self.how == "mean":
            return F.cross_entropy(scores, tags)
        if self.how == "over count":
            return F.cross_entropy(scores, tags, reduction="sum") / scores.shape[0]
        if self.how == "returned":
            return scores
        if self.how == "mean of squares":
            return scores.pow(2).mean()
        if self.how == "bce mean":  # ELECTRA's discriminator loss over the attended tokens
            return F.binary_cross_entropy_with_logits(scores[:, 0], (tags == 1).to(x.dtype))
        # the count carried by a tensor the forward makes of the selected rows' size
        counted = {"over ones_like": lambda: torch.ones_like(scores).sum(),
                   "over new_ones": lambda: x.new_ones(scores.shape).sum(),
                   "over ones of the count": lambda: torch.ones(scores.shape[0], dtype=x.dtype).sum(),
                   "over arange of the count": lambda: torch.arange(scores.numel()).max() + 1}
        if self.how in counted:
            return F.cross_entropy(scores, tags, reduction="sum") / counted[self.how]()
        out = torch.zeros(*tokens.shape, 3, dtype=x.dtype)  # "rows over count"
        out[keep] = scores / scores.shape[0]
        return out.pow(2).sum()


@pytest.mark.parametrize("how", ["sum", "squares"])
def test_a_loss_summed_over_the_rows_a_mask_selected_is_exact(how):
    """Refused before ("it works on the elements a boolean mask … selected")."""
    torch.manual_seed(0)
    _grad_samples_exact_at_two_sizes(TaggerLoss(how).double())


def _grad_samples_exact_at_two_sizes(model: nn.Module, loss=lambda out: out) -> None:
    """``model``'s grad samples under ``loss_reduction="sum"`` match the loop's at B = 3
    (static) and 4 (dynamic)."""
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    for size in (3, 4):
        x, tokens = _inputs(size, torch.float64)
        ref = reference(model, (x, tokens), lambda out, i: loss(out))
        loss(dp(x, tokens)).backward()
        params = dict(model.named_parameters())
        assert_close_all({n: p.grad_sample for n, p in params.items()}, ref.per_sample, tolerance(torch.float64),
                         f"grad_sample at B = {size}")


def _inputs_keeping_as_many(size: int, dtype: torch.dtype, padded: int = 2):
    """``_inputs`` whose samples each have ``padded`` positions the tagger's mask drops."""
    x, tokens = _inputs(size, dtype)
    g = torch.Generator().manual_seed(size + 1)
    tokens = tokens % (V - 2)
    for b in range(size):
        tokens[b, torch.randperm(T, generator=g)[:padded]] = V - 1
    return x, tokens


@pytest.mark.parametrize("how", ["mean of squares", "bce mean"])
def test_a_mean_over_the_rows_masks_that_select_as_many_is_exact(how):
    """A mean over every element of the rows a mask selected (ELECTRA's discriminator loss,
    ``bce_with_logits(logits[attended], labels[attended])``) is the mean of the samples'
    own means where every sample's mask selects as many: exact against the loop at two
    batch sizes; where they differ, the step fails (a run-time check in the graph). It
    was refused, found by a helper."""
    torch.manual_seed(0)
    model = TaggerLoss(how).double()
    dp = fxdp.transform(model, grad_sample=True, max_grad_norm=1.0, compiler="eager")
    for size in (3, 4):
        x, tokens = _inputs_keeping_as_many(size, torch.float64)
        ref = reference(model, (x, tokens), lambda out, i: out)
        model.zero_grad()
        dp(x, tokens).backward()
        params = dict(model.named_parameters())
        assert_close_all({n: p.grad_sample for n, p in params.items()}, ref.per_sample, tolerance(torch.float64),
                         f"grad_sample at B = {size}")
        assert_close_all({n: p.grad for n, p in params.items()}, ref.grad("mean", 1.0), tolerance(torch.float64),
                         f"p.grad at B = {size}")
    x, tokens = _inputs_keeping_as_many(4, torch.float64)
    tokens[1, :3] = V - 1
    with pytest.raises(fxdp.UnsupportedError, match="^the loss is a mean over the elements a boolean mask selected "
                       "over the batch .* select different numbers of elements"):
        dp(x, tokens)


class KeptSamples(nn.Module):
    """pytorch-metric-learning's NCA loss: each sample's probability of its class, those
    not zero kept by a mask over the batch alone (``[B]``), their negative log averaged."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        p = self.lin(x).softmax(-1)[:, 0]
        return -torch.log(p[p != 0]).mean()


def test_a_mean_over_the_samples_a_mask_of_the_batch_alone_kept():
    """A ``[B]`` mask selects one element or none per sample: where it keeps every
    sample the mean is over the samples, exact at two batch sizes. Its run-time count
    check crashed on a mask of one dim ("Dimension out of range", a helper's sweep);
    a sample dropped fails the step."""
    torch.manual_seed(0)
    model = KeptSamples().double()
    dp = fxdp.transform(model, grad_sample=True, compiler="eager")
    for size in (4, 3):
        x = torch.randn(size, 4, dtype=torch.float64)
        ref = reference(model, (x,), lambda out, i: out)
        model.zero_grad()
        dp(x).backward()
        assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                         tolerance(torch.float64), f"grad_sample at B = {size}")
    x = torch.randn(3, 4, dtype=torch.float64)
    x[0] = -1e4 * model.lin.weight[0].detach().sign()  # sample 0's probability underflows to zero
    with pytest.raises(fxdp.UnsupportedError, match="select different numbers of elements"):
        dp(x)


@pytest.mark.parametrize("how", ["mean", "over count", "rows over count", "over ones_like", "over new_ones",
                                 "over ones of the count", "over arange of the count"])
def test_a_count_of_the_rows_every_mask_selected_is_refused(how):
    """A mean over the selected rows, or their number used in arithmetic: each sample's
    share would depend on how many rows the other samples' masks selected. The count
    passed on as the size of a tensor the forward makes (``ones_like`` of the rows,
    ``ones(n)``, ``arange(n)``) and summed back was read as a shared constant, and the
    loss divided by it accepted under "sum" (a privacy hole, found by a helper)."""
    problems = fxdp.validate(TaggerLoss(how).double(), *_inputs(3, torch.float64), loss_reduction="sum")
    reasons = " ".join(p.reason for p in problems)
    assert problems and ("boolean mask selected from the whole batch" in reasons
                         or "one list of every sample's elements" in reasons
                         or "a normaliser from the whole batch's data" in reasons), problems


class CountAsSize(nn.Module):
    """The number of rows every sample's mask selected used as a size, an index or an
    offset: what sample 0's values are then depends on the other samples' masks. Every
    form but ``expand`` (which failed to compile) was accepted: under "slice", sample 0's
    per-sample gradient moved by 4.1 when only sample 2's tokens changed (a privacy
    hole, found by probing the count's uses after the forty-seventh session's fix).
    ``"rows as their own number"`` gives the rows only their own number: exact."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(D, D)

    def forward(self, x, tokens):
        h = self.lin(x)  # [B, T, D]
        rows = h[tokens < V // 2]
        n = rows.shape[0]
        forms = {
            "slice": lambda: h[..., : n % D + 1],
            "narrow": lambda: h.narrow(2, 0, n % D + 1),
            "pad": lambda: F.pad(h, (0, n % 3)),
            "topk": lambda: h.topk(n % D + 1, dim=2).values,
            "expand": lambda: h[..., :1].expand(-1, -1, n % 3 + 1),
            "roll": lambda: h.roll(n, 2) * h,
            "select": lambda: h.select(2, n % D),
            "tril": lambda: h.view(h.shape[0], T, 2, D // 2).tril(n % 2),
            "masked_select count": lambda: h[..., : x.masked_select(x > 0).numel() % D + 1],
            "rows' columns": lambda: rows[:, : n % D + 1],
        }
        def positions():  # transformers' mask builder: batch_arange over Idefics3's real images
            return torch.arange(n)

        forms.update({
            "positions flipped": lambda: rows[positions().flip(0)],
            "positions as values": lambda: rows * positions()[:, None],
            "positions halved": lambda: rows[positions() // 2],
            "positions into a table": lambda: rows * torch.linspace(0, 1, 4 * T)[positions()][:, None],
        })
        if self.how in forms:
            return forms[self.how]().pow(2).sum()
        if self.how == "positions index their own rows":
            return rows[positions()[:, None], torch.arange(D)[None, :]].tanh().pow(2).sum() + h.pow(2).sum()
        # "rows as their own number": views, a whole slice and an expand by the count
        return rows[:n].view(n, 2, D // 2).expand(n, 2, D // 2).pow(2).sum() + h.pow(2).sum()


@pytest.mark.parametrize("how", ["slice", "narrow", "pad", "topk", "expand", "roll", "select", "tril",
                                 "masked_select count", "rows' columns"])
def test_the_count_of_masked_rows_as_a_size_or_an_index_is_refused(how):
    problems = fxdp.validate(CountAsSize(how).double(), *_inputs(3, torch.float64), loss_reduction="sum")
    assert problems and all("as a size, an index or an offset of other values" in p.reason for p in problems), \
        problems


@pytest.mark.parametrize("how", ["rows as their own number", "positions index their own rows"])
def test_the_count_of_masked_rows_as_their_own_number_is_exact(how):
    """``rows[arange(n)[:, None], cols]`` with ``n`` the rows' count reads each row itself:
    it was refused as a computation with the count."""
    torch.manual_seed(0)
    _grad_samples_exact_at_two_sizes(CountAsSize(how).double())


@pytest.mark.parametrize("how", ["positions flipped", "positions as values", "positions halved",
                                 "positions into a table"])
def test_positions_in_the_masked_rows_read_otherwise_are_refused(how):
    """Row ``r``'s position in the list depends on the masks of the samples before it."""
    problems = fxdp.validate(CountAsSize(how).double(), *_inputs(3, torch.float64), loss_reduction="sum")
    assert problems and all("how many elements a boolean mask selected from the whole batch" in p.reason
                            for p in problems), problems


class NormalisedRows(nn.Module):
    """A parameter-free op with a rule on the selected rows: ``F.layer_norm`` without a
    weight normalises each row over its own features. It was refused ("it works on the
    elements a boolean mask … selected"), as the analysis looked rules up only for ops
    that use a parameter; ``nn.LayerNorm`` on the same rows worked (found by a helper)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, tokens):
        h = self.lin(x)
        m = tokens < V // 2
        out = h.clone()
        out[m] = F.layer_norm(h[m], (D,))
        return out


def test_a_parameter_free_op_with_a_rule_on_the_rows_is_exact():
    torch.manual_seed(0)
    _grad_samples_exact_at_two_sizes(NormalisedRows().double(), lambda out: out.pow(2).sum())


def test_the_rows_a_mask_selected_returned_by_the_forward_are_refused_with_where_to_put_the_loss():
    """Outside the forward no loss can be told apart by sample (torchaudio's HuBERT
    returns ``proj(x)[mask]``): the refusal says to compute the loss inside."""
    problems = fxdp.validate(TaggerLoss("returned").double(), *_inputs(3, torch.float64), loss_reduction="sum")
    assert [p.op for p in problems] == ["aten.index.Tensor"], problems
    assert "returned by the forward, the list leaves its loss outside" in problems[0].reason
    assert "compute the loss in the forward" in problems[0].reason


class WeightsByTheMaskUnflattened(nn.Module):
    """lightly's iBOT patch loss: per-token losses selected by ``mask.flatten(1)`` on the
    flattened patches, their weights (one over each sample's count) by the ``[B, H, W]``
    mask itself: the same elements in the same order, since one mask is a reshape of the
    other (refused before: "different boolean masks"). ``"transposed"`` selects the
    weights in another order: refused."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(D, 3)

    def forward(self, x, mask):  # x [B, H·W, D], mask [B, H, W]
        losses = self.lin(x).logsumexp(-1)[mask.flatten(1)]
        weights = (1.0 / mask.sum((1, 2), keepdim=True).clamp(min=1)).expand_as(mask)
        weights = weights.transpose(1, 2)[mask.transpose(1, 2)] if self.how == "transposed" else weights[mask]
        return (losses * weights).sum()


def test_one_mask_and_its_flattened_view_select_alike():
    torch.manual_seed(0)
    model = WeightsByTheMaskUnflattened("same").double()
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    for size in (3, 4):
        x = torch.randn(size, 6, D, dtype=torch.float64)
        mask = torch.rand(size, 2, 3) < 0.5
        mask[0] = False  # a sample that selects nothing
        mask[1, 0, 0] = True
        ref = reference(model, (x, mask), lambda out, i: out)
        dp(x, mask).backward()
        assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                         tolerance(torch.float64), f"grad_sample at B = {size}")


def test_a_mask_read_in_another_order_is_refused():
    mask = torch.rand(3, 2, 3) < 0.5
    problems = fxdp.validate(WeightsByTheMaskUnflattened("transposed"), torch.randn(3, 6, D), mask)
    assert any("different boolean masks" in p.reason for p in problems), problems


class MarginOnTarget(nn.Module):
    """One element per sample selected by a mask over the batch, changed, and combined
    with the batch again by broadcasting, element ``i`` with sample ``i``:
    pytorch-metric-learning's ArcFace margin (``losses/large_margin_softmax_loss.py``:
    a one-hot mask of the labels, ``cos[mask == 1]``, ``cos + mask * diff.unsqueeze(1)``)
    and the one end-of-sentence row of each sample (``h[tokens == eos]``) gated by the
    sample's first row."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.emb = nn.Linear(D, 6)
        if how == "the end of each sentence, gated":
            self.gate, self.head = nn.Linear(D, 6), nn.Linear(6, 2)
        else:
            self.w = nn.Parameter(torch.randn(6, 3))

    def forward(self, x, tokens):
        if self.how == "the end of each sentence, gated":
            rows = self.emb(x)[tokens == V - 1]
            return self.head(rows * torch.sigmoid(self.gate(x[:, 0])))
        cos = F.normalize(self.emb(x[:, 0]), dim=1) @ F.normalize(self.w, dim=0)  # [B, C]
        mask = torch.zeros(x.shape[0], 3, dtype=x.dtype)
        mask[torch.arange(x.shape[0]), tokens[:, 0] % 3] = 1
        target = cos[mask == 1]
        diff = torch.cos(torch.acos(target.clamp(-1 + 1e-7, 1 - 1e-7)) + 0.5) - target
        if self.how == "along the classes":  # [B, C] * [N]: the list runs along each sample's classes
            return 30 * cos * diff
        if self.how == "with a parameter":
            return torch.addcmul(cos, diff.unsqueeze(1), self.w[0])
        return 30 * (cos + mask * diff.unsqueeze(1))


def _one_eos(size: int):
    x, tokens = _inputs(size, torch.float64)
    tokens = tokens % (V - 1)
    tokens[torch.arange(size), torch.arange(size) % T] = V - 1  # one end of sentence per sample
    return x, tokens


@pytest.mark.parametrize("how", ["arcface", "the end of each sentence, gated"])
def test_one_element_per_sample_paired_with_the_batch_is_exact(how):
    """Exact against the loop at two batch sizes (the ArcFace margin was refused as work
    on a list of the whole batch's elements before the sixty-second session, a helper's
    sweep of pytorch-metric-learning); where a sample's mask selects two elements and
    another's none (the list still as long as the batch), the step fails."""
    torch.manual_seed(0)
    model = MarginOnTarget(how).double()
    dp = fxdp.transform(model, grad_sample=True, max_grad_norm=1.0, loss_reduction="sum", compiler="eager")
    for size in (3, 4):
        x, tokens = _one_eos(size)
        ref = reference(model, (x, tokens), lambda out, i: _loss(out))
        model.zero_grad()
        out = dp(x, tokens)
        torch.testing.assert_close(out, model(x, tokens))
        _loss(out).backward()
        params = dict(model.named_parameters())
        assert_close_all({n: p.grad_sample for n, p in params.items()}, ref.per_sample, tolerance(torch.float64),
                         f"grad_sample at B = {size}")
        assert_close_all({n: p.grad for n, p in params.items()}, ref.grad("sum", 1.0), tolerance(torch.float64),
                         f"p.grad at B = {size}")
    if how == "arcface":
        return  # (its mask selects one element of each row by construction)
    x, tokens = _one_eos(4)
    tokens[1, T - 1], tokens[2] = V - 1, tokens[2] % (V - 1)  # two ends in sample 1, none in sample 2
    with pytest.raises(fxdp.UnsupportedError, match="pairs element i with sample i, and some sample's mask selects "
                       "other than exactly one element"):
        dp(x, tokens)
    # One end in the whole batch: the plain model broadcasts that row to every sample. The
    # check runs before Dynamo's of the list's length (a raw "Runtime assertion failed
    # for expression u0 >= 4" before the red team's find), on a fresh model too.
    x, tokens = _one_eos(4)
    tokens = tokens % (V - 1)
    tokens[2, 1] = V - 1
    for call in (dp, fxdp.transform(MarginOnTarget(how).double(), grad_sample=True, compiler="eager")):
        with pytest.raises(fxdp.UnsupportedError, match="some sample's mask selects other than exactly one"):
            call(x, tokens)


@pytest.mark.parametrize("how", ["along the classes", "with a parameter"])
def test_a_list_of_one_element_per_sample_combined_otherwise_is_refused(how):
    """Broadcast along each sample's classes (``[B, C] * [N]``), the list's elements are
    no sample's own; a parameter in the op pairing them keeps the refusal of parameter
    uses on a list."""
    problems = fxdp.validate(MarginOnTarget(how).double(), *_one_eos(3))
    assert problems and "boolean mask" in problems[0].reason, problems


class ImageTokensWrittenThroughAMask(nn.Module):
    """transformers' Kosmos-2.5: each sample's image queries written into its token
    embeddings where a boolean mask marks the image's positions,
    ``inputs_embeds[image_embeds_position_mask == 1] = image_embeds.view(-1, d)``."""

    def __init__(self):
        super().__init__()
        self.embed, self.image = nn.Embedding(20, 6), nn.Linear(5, 6)
        self.queries, self.head = nn.Parameter(torch.randn(4, 6)), nn.Linear(6, 20)

    def forward(self, ids, pixels, image_mask):
        tokens = self.embed(ids)
        image = self.image(pixels).mean(1, keepdim=True) + self.queries  # [B, 4, d]
        tokens[image_mask] = image.reshape(-1, tokens.shape[-1])
        return self.head(torch.tanh(tokens))


def _image_batch(size: int, length: int) -> tuple[torch.Tensor, ...]:
    mask = torch.zeros(size, length, dtype=torch.bool)
    mask[:, 1:5] = True
    return torch.randint(0, 20, (size, length)), torch.randn(size, 7, 5, dtype=torch.float64), mask


def _exact_at(model: nn.Module, dp_model: fxdp.DPModule, inputs: tuple[torch.Tensor, ...]) -> None:
    ref = reference(model, list(inputs), lambda out, i: out.pow(2).sum())
    model.zero_grad(set_to_none=True)
    dp_model(*inputs).pow(2).sum().backward()
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                     tolerance(torch.float64), "grad_sample")


def test_a_size_bound_pytorch_fails_on_at_a_second_size_is_a_refusal_with_the_way_around():
    """At a second batch size and length the graph compiled for any size makes PyTorch's
    ShapeEnv fail an internal assertion ("tgt_bound=… not a subset of src_bound=…") in
    torch 2.13, as plain ``torch.compile(backend="aot_eager")`` does: a crash before the
    sixty-third session (a helper's sweep of Kosmos-2.5), now a refusal that says to
    compile for each size, which is exact."""
    torch.manual_seed(0)
    model = ImageTokensWrittenThroughAMask().double()
    dp_model = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    _exact_at(model, dp_model, _image_batch(3, 10))
    try:
        _exact_at(model, dp_model, _image_batch(2, 8))  # (exact, where PyTorch no longer fails)
    except fxdp.UnsupportedError as refused:
        assert "automatic_dynamic_shapes = False" in str(refused)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        dp_model = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
        for size, length in ((3, 10), (2, 8)):
            _exact_at(model, dp_model, _image_batch(size, length))
