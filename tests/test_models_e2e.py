"""Real models, written as ordinary PyTorch, against the microbatch reference.

One table of cases (``CASES``): each model with its inputs, batch layout and which
dtypes it runs in. Every case runs in two modes, each its own compile:

* ``grad_sample``: ``grad_sample=True``; ``p.grad_sample`` against each sample's own
  gradient and ``p.grad`` against the ordinary (unclipped) gradient;
* ``clip``: ``max_grad_norm`` = the median per-sample norm (about half of the samples
  are clipped); ``p.grad`` against ``ref.grad("mean", C)`` and ``clip_factors``.

In both, ``dp_model.per_sample_norms`` is checked on its own, frozen parameters must
get nothing, and ``explain()`` must list exactly the trainable parameters. The truth
is always ``tests/reference.py``'s loop, run in float64 on the model's own values
(for float32 runs: a float64 copy of the float32 model). Then the cases the table
cannot express: the nanoGPT ``wte``/``lm_head`` tie taken by a ghost norm without a
``[B, V, d]`` tensor, the loss inside the graph, packed sequences, and a few
Inductor runs.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

import fxdp
import fxdp.compiler
import models
from reference import Reference, assert_close_all, reference, tolerance

# The batch; model sizes avoid it so that a batch/feature mix-up shows.
B = 5
GPT_SIZES = dict(vocab=11, block_size=6, d=8)


def _randn(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _tokens(*shape: int, high: int = GPT_SIZES["vocab"], seed: int = 2) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


@dataclasses.dataclass(frozen=True)
class Case:
    """One model of the table.

    Attributes:
        id: Test id.
        model: Builds the model (float64; the seed is set before).
        inputs: The batched forward arguments (floating ones in float64).
        batch_dim: Batch dim of the inputs (``batch_first=False`` when 1).
        output_batch_dim: Batch dim of the model's output (the loss reduces over it).
        float32: Also run in float32.
        conv: Has convolutions (float32 tolerance 1e-3).
    """

    id: str
    model: Callable[[], nn.Module]
    inputs: Callable[[], tuple]
    batch_dim: int = 0
    output_batch_dim: int = 0
    float32: bool = False
    conv: bool = False


CASES = [
    # 1. ResNet-style CNN: conv3x3 + GroupNorm + in-place ReLU + residual adds + pool + head.
    Case("resnet_groupnorm", models.ResNetCNN, lambda: (_randn(B, 3, 8, 8),), float32=True, conv=True),
    # 2. nanoGPT: wte + wpe(arange(T)), causal SDPA, LayerNorm, GELU MLP, lm_head tied to wte.
    Case("nanogpt_tied", lambda: models.GPT(**GPT_SIZES), lambda: (_tokens(B, 6),), float32=True),
    # 3. Recurrent networks.
    Case("lstm", lambda: models.RNNClassifier("lstm"), lambda: (_randn(B, 6, 4),), float32=True),
    Case("lstm_2layer_bidirectional", lambda: models.RNNClassifier("lstm", num_layers=2, bidirectional=True),
         lambda: (_randn(B, 3, 4),)),
    Case("gru_2layer", lambda: models.RNNClassifier("gru", num_layers=2), lambda: (_randn(B, 6, 4),)),
    Case("rnn_seq_first", lambda: models.RNNClassifier("rnn", num_layers=2, batch_first=False),
         lambda: (_randn(6, B, 4),), batch_dim=1),
    Case("lstm_cells", lambda: models.CellDecoder("lstm"), lambda: (_randn(B, 4, 4),), float32=True),
    Case("gru_cells", lambda: models.CellDecoder("gru"), lambda: (_randn(B, 4, 4),)),
    Case("rnn_cells", lambda: models.CellDecoder("rnn"), lambda: (_randn(B, 4, 4),)),
    # Learned initial states broadcast to the batch (expand + contiguous, repeat).
    Case("lstm_learned_state", lambda: models.RNNClassifier("lstm", num_layers=2, learned_state=True),
         lambda: (_randn(B, 3, 4),), float32=True),
    Case("gru_learned_state_seq_first",
         lambda: models.RNNClassifier("gru", bidirectional=True, batch_first=False, learned_state=True),
         lambda: (_randn(3, B, 4),), batch_dim=1),
    Case("lstm_cells_learned_state", lambda: models.CellDecoder("lstm", learned_state=True),
         lambda: (_randn(B, 4, 4),)),
    Case("gru_cells_learned_state", lambda: models.CellDecoder("gru", learned_state=True),
         lambda: (_randn(B, 4, 4),), float32=True),
    Case("bilinear", models.BilinearHead, lambda: (_randn(B, 2, 4),), float32=True),
    # 4. ViT and nn.MultiheadAttention variants.
    Case("vit_conv_patches", lambda: models.ViT("conv"), lambda: (_randn(B, 3, 12, 12),), float32=True, conv=True),
    Case("vit_linear_patches", lambda: models.ViT("linear"), lambda: (_randn(B, 3, 12, 12),)),
    Case("mha_seq_first", lambda: models.Attention(batch_first=False), lambda: (_randn(6, B, 8),),
         batch_dim=1, output_batch_dim=1),
    Case("mha_kdim_vdim", lambda: models.Attention(kdim=3, vdim=7, batch_first=True),
         lambda: (_randn(B, 6, 8), _randn(B, 4, 3, seed=3), _randn(B, 4, 7, seed=4))),
    Case("mha_add_bias_kv", lambda: models.Attention(add_bias_kv=True, batch_first=True),
         lambda: (_randn(B, 6, 8),)),
    Case("mha_no_bias", lambda: models.Attention(bias=False, batch_first=True), lambda: (_randn(B, 6, 8),)),
    # 5. LoRA as peft writes it: frozen base, only the adapters train.
    Case("lora_gpt", lambda: models.add_lora(models.GPT(**GPT_SIZES), ("c_attn", "c_proj")),
         lambda: (_tokens(B, 6),), float32=True),
    # 6. Activation checkpointing around every block.
    Case("checkpointed_gpt", lambda: models.GPT(**GPT_SIZES, checkpoint=True), lambda: (_tokens(B, 6),)),
    Case("checkpointed_collected", models.CheckpointedCollected, lambda: (_randn(B, 3, 4),)),
    # 7. Parameters transformed before use.
    Case("linear_of_transposed_weight", models.TransposedWeight, lambda: (_randn(B, 3, 4),)),
    Case("packed_weight_chunk", models.PackedChunk, lambda: (_randn(B, 3, 4),), float32=True),
    Case("packed_weight_slices", models.PackedSlice, lambda: (_randn(B, 3, 4),)),
    Case("weight_norm", models.WeightNormLinear, lambda: (_randn(B, 3, 4),), float32=True),
    Case("custom_parametrization", models.CustomParametrized, lambda: (_randn(B, 3, 6),)),
    Case("diffusion_unet", models.DiffusionUNet,
         lambda: (_randn(B, 1, 8, 8), torch.randint(0, 1000, (B,), generator=torch.Generator().manual_seed(5))),
         float32=True, conv=True),
    Case("spectral_norm_discriminator", models.SpectralNormDiscriminator, lambda: (_randn(B, 3, 8, 8),),
         float32=True, conv=True),
    Case("tied_with_transpose", models.TiedTranspose, lambda: (_randn(B, 3, 4),), float32=True),
    Case("layer_scale_and_bias", models.LayerScaleBias, lambda: (_randn(B, 3, 4),)),
    # 8. torch.func.vmap inside the forward.
    Case("vmap_per_sample", models.VmapPerSample, lambda: (_randn(B, 3, 4),), float32=True),
    Case("vmap_over_positions", models.VmapOverPositions, lambda: (_randn(B, 3, 4),)),
    Case("vmap_mask", models.VmapMask, lambda: (_randn(B, 3, 4),)),
    Case("vmap_segment_mask", models.VmapSegmentMask,
         lambda: (_randn(B, 4, 4), torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0], [0, 1, 2, 3]]))),
    Case("scan_recurrence", models.ScanRecurrence, lambda: (_randn(B, 6, 4),), float32=True),
    Case("vmap_ensemble", models.VmapEnsemble, lambda: (_randn(B, 3, 4),)),
    Case("energy_forces", models.EnergyForces, lambda: (_randn(B, 3, 4),), float32=True),
    Case("vmap_jacobian", models.VmapJacobian, lambda: (_randn(B, 4),)),
    Case("checkpointed_vmap", models.CheckpointedVmap, lambda: (_randn(B, 3, 4),)),
    # 9. Loops over the samples (each piece of one sample, concatenated again in order).
    Case("loop_over_samples_slices", lambda: models.PerSampleLoop("slice"), lambda: (_randn(B, 3, 4),), float32=True),
    Case("loop_over_samples_rows", lambda: models.PerSampleLoop("select"), lambda: (_randn(B, 3, 4),)),
    Case("loop_over_samples_unbind", lambda: models.PerSampleLoop("unbind"), lambda: (_randn(B, 3, 4),)),
    Case("loop_over_samples_split", lambda: models.PerSampleLoop("split"), lambda: (_randn(B, 3, 4),)),
    Case("loop_over_samples_written", lambda: models.PerSampleLoop("write"), lambda: (_randn(B, 3, 4),)),
    Case("experts_sorted_by_expert", models.SortedExperts, lambda: (_randn(B, 3, 8),), float32=True),
    Case("experts_sorted_added_back", lambda: models.SortedExperts(combine="index_add"), lambda: (_randn(B, 3, 8),)),
    Case("experts_argsort_dispatch", lambda: models.SortedExperts(combine="index_add", dispatch="argsort"),
         lambda: (_randn(B, 3, 8),)),
    Case("experts_sorted_with_biases", lambda: models.SortedExperts(biases=True), lambda: (_randn(B, 3, 8),),
         float32=True),
    Case("experts_looped_where", models.LoopedExperts, lambda: (_randn(B, 3, 8),), float32=True),
    Case("experts_looped_where_eq", lambda: models.LoopedExperts(dispatch="where_eq"), lambda: (_randn(B, 3, 8),)),
    Case("experts_looped_flat", lambda: models.LoopedExperts(dispatch="flat"), lambda: (_randn(B, 3, 8),)),
]
CASE_BY_ID = {c.id: c for c in CASES}


# -- helpers ------------------------------------------------------------------------------

def per_sample_loss(out: torch.Tensor, batch_dim: int) -> torch.Tensor:
    """``[B]``: each sample's sum of squares of its outputs."""
    out = out.movedim(batch_dim, 0)
    return out.pow(2).reshape(out.shape[0], -1).sum(1)


def build(case: Case, dtype: torch.dtype) -> tuple[nn.Module, tuple, Reference]:
    """The model and inputs in ``dtype``, and the float64 loop on exactly those values."""
    torch.manual_seed(0)
    model = case.model().to(dtype)
    args = tuple(a.to(dtype) if a.is_floating_point() else a for a in case.inputs())
    args64 = tuple(a.double() if a.is_floating_point() else a for a in args)
    ref = reference(copy.deepcopy(model).double(), args64,
                    lambda out, i: per_sample_loss(out, case.output_batch_dim).sum(),
                    batch_dim=case.batch_dim)
    return model, args, ref


def check_step(model: nn.Module, dp_model: fxdp.DPModule, ref: Reference, *, grad_sample: bool,
               clip: float | None, tol: float, reduction: str = "mean") -> None:
    """Every result of one backward, each checked on its own."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}

    assert_close_all({n: p.grad for n, p in trainable.items()}, ref.grad(reduction, clip), tol, "p.grad")
    if grad_sample:
        assert_close_all({n: getattr(p, "grad_sample", None) for n, p in trainable.items()},
                         ref.per_sample, tol, "p.grad_sample")
    else:
        unasked = [n for n, p in trainable.items() if getattr(p, "grad_sample", None) is not None]
        assert not unasked, f"grad_sample without grad_sample=True: {unasked}"

    norms = dp_model.per_sample_norms
    assert norms is not None and norms.shape == (ref.batch_size,), f"per_sample_norms: {norms}"
    assert_close_all({"norms": norms}, {"norms": ref.norms}, tol, "per_sample_norms")

    factors = dp_model.clip_factors
    if clip is None:
        assert factors is None
    else:
        assert_close_all({"clip_factors": factors}, {"clip_factors": ref.clip_factors(clip)}, tol, "clip_factors")

    # Frozen parameters get nothing and stay out of the norms (checked above: the
    # reference's norms cover the trainable parameters only).
    for n, p in frozen.items():
        assert p.grad is None, f"frozen {n} got a gradient"
        assert getattr(p, "grad_sample", None) is None, f"frozen {n} got a grad_sample"
    planned = sorted(p.name for p in dp_model.explain().plans)
    assert planned == sorted(trainable), f"explain() plans {planned}, trainable {sorted(trainable)}"


def run(case: Case, mode: str, dtype: torch.dtype, compiler: str = "eager") -> fxdp.DPModule:
    model, args, ref = build(case, dtype)
    grad_sample = mode == "grad_sample"
    clip = float(ref.norms.median()) if mode == "clip" else None
    dp_model = fxdp.transform(model, max_grad_norm=clip, grad_sample=grad_sample,
                              batch_first=case.batch_dim == 0, compiler=compiler)
    per_sample_loss(dp_model(*args), case.output_batch_dim).mean().backward()
    check_step(model, dp_model, ref, grad_sample=grad_sample, clip=clip, tol=tolerance(dtype, case.conv))
    return dp_model


def _against_the_loop_at(model: nn.Module, call: Callable, batch_sizes: tuple, *shape: int,
                         max_grad_norm: float | None = None) -> None:
    """``call`` (``model`` made per-sample) against the microbatch loop at each batch size
    on inputs ``[B, *shape]``: ``grad_sample``, and with ``max_grad_norm`` the clipped
    gradient of the mean loss."""
    tol = tolerance(torch.float64)
    for batch_size in batch_sizes:
        x = _randn(batch_size, *shape, seed=batch_size)
        ref = reference(copy.deepcopy(model), (x,), lambda out, i: per_sample_loss(out, 0).sum())
        model.zero_grad(set_to_none=True)
        per_sample_loss(call(x), 0).mean().backward()
        assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample, tol,
                         f"grad_sample at B = {batch_size}")
        if max_grad_norm is not None:
            assert_close_all({n: p.grad for n, p in model.named_parameters()}, ref.grad("mean", max_grad_norm),
                             tol, f"clipped grad at B = {batch_size}")


def _params(cases: list[Case], dtype: torch.dtype, modes=("grad_sample", "clip")):
    params = []
    for case in cases:
        params += [pytest.param(case, mode, id=f"{case.id}-{mode}") for mode in modes]
    return params


# -- the table ------------------------------------------------------------------------------

@pytest.mark.parametrize("case, mode", _params(CASES, torch.float64))
def test_float64(case: Case, mode: str):
    run(case, mode, torch.float64)


@pytest.mark.parametrize("case, mode", _params([c for c in CASES if c.float32], torch.float32))
def test_float32(case: Case, mode: str):
    run(case, mode, torch.float32)


# -- nanoGPT: the tied embedding -------------------------------------------------------------

@pytest.fixture
def rewritten_backwards(monkeypatch) -> list:
    """Every rewritten backward graph compiled during the test."""
    graphs = []
    original = fxdp.compiler.backward_rewrite_pass

    def spy(*args, **kwargs):
        gm, plan = original(*args, **kwargs)
        graphs.append(gm)
        return gm, plan

    monkeypatch.setattr(fxdp.compiler, "backward_rewrite_pass", spy)
    return graphs


def _has_shape(graphs: list, shape: tuple) -> bool:
    for gm in graphs:
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and tuple(val.shape) == shape:
                return True
    return False


def test_nanogpt_tied_wte_is_a_ghost_norm_without_per_sample_table(rewritten_backwards):
    """The wte/lm_head tie is one parameter with two rules; its norm comes from ghost
    norms and their cross term, never from a ``[B, V, d]`` per-sample gradient."""
    dp_model = run(CASE_BY_ID["nanogpt_tied"], "clip", torch.float64)
    plans = {p.name: p for p in dp_model.explain().plans}
    assert "lm_head.weight" not in plans  # the same Parameter: one plan
    wte = plans["wte.weight"]
    assert wte.uses == 2 and wte.rule == "embedding.weight, linear.weight", wte
    assert wte.strategy.startswith("ghost"), wte
    per_sample_table = (B, GPT_SIZES["vocab"], GPT_SIZES["d"])
    assert rewritten_backwards and not _has_shape(rewritten_backwards, per_sample_table)

    # The same search finds the table when it is asked for: the check above can fail.
    rewritten_backwards.clear()
    torch._dynamo.reset()
    run(CASE_BY_ID["nanogpt_tied"], "grad_sample", torch.float64)
    assert _has_shape(rewritten_backwards, per_sample_table)


# -- the loss inside the graph -----------------------------------------------------------------

@pytest.mark.parametrize("reduction, mode", [("mean", "clip"), ("mean", "grad_sample"), ("sum", "clip")])
def test_nanogpt_loss_inside_the_graph(reduction: str, mode: str):
    """``forward(idx, targets)`` returns ``F.cross_entropy(logits.view(-1, V), targets.view(-1))``."""
    torch.manual_seed(0)
    model = models.GPTWithLoss(models.GPT(**GPT_SIZES), reduction=reduction).double()
    idx, targets = _tokens(B, 6), _tokens(B, 6, seed=3)
    # Sample i's own loss is the same reduction over its own T tokens; for "mean" every
    # sample has T tokens, so the batch mean is the mean of the samples' losses.
    ref = reference(model, (idx, targets), lambda loss, i: loss)
    clip = float(ref.norms.median()) if mode == "clip" else None
    dp_model = fxdp.transform(model, max_grad_norm=clip, grad_sample=mode == "grad_sample",
                              loss_reduction=reduction, compiler="eager")
    loss = dp_model(idx, targets)
    assert loss.dim() == 0
    loss.backward()
    check_step(model, dp_model, ref, grad_sample=mode == "grad_sample", clip=clip,
               tol=tolerance(torch.float64), reduction=reduction)


def test_loss_inside_the_graph_must_match_loss_reduction():
    torch.manual_seed(0)
    model = models.GPTWithLoss(models.GPT(**GPT_SIZES), reduction="sum").double()
    dp_model = fxdp.transform(model, max_grad_norm=1.0, loss_reduction="mean", compiler="eager")
    with pytest.raises(fxdp.UnsupportedError, match="loss_reduction='sum'"):
        dp_model(_tokens(B, 6), _tokens(B, 6, seed=3))


class Distill(torch.nn.Module):
    """A distillation loss inside the graph, written several ways."""

    def __init__(self, how: str):
        super().__init__()
        self.student = torch.nn.Linear(4, 5)
        self.how = how

    def forward(self, x, teacher_logits):
        log_p, q = self.student(x).log_softmax(-1), teacher_logits.softmax(-1)
        if self.how == "batchmean":
            return F.kl_div(log_p, q, reduction="batchmean")
        if self.how == "sum_over_rows":
            return F.kl_div(log_p, q, reduction="sum") / x.shape[0]
        if self.how == "with_cross_entropy":  # vit-pytorch's DistillWrapper
            return F.cross_entropy(log_p, q.argmax(-1)) + F.kl_div(log_p, q, reduction="batchmean")
        if self.how == "sum_over_features":  # a constant that is not the batch size
            return F.kl_div(log_p, q, reduction="sum") / x.shape[1]
        if self.how == "mean_times_batch":  # a mean times the batch size: the sum
            return F.kl_div(log_p, q, reduction="none").sum(-1).mean() * x.shape[0]
        return F.kl_div(log_p, q, reduction="none").sum(-1).mean()


@pytest.mark.parametrize("how", ["batchmean", "sum_over_rows", "with_cross_entropy", "mean"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_sum_divided_by_the_batch_size_is_a_mean_and_a_sum_of_shares(how: str, reduction: str):
    """``kl_div(reduction="batchmean")`` is a sum over the batch divided by ``B``: under
    ``loss_reduction="mean"`` the mean of the samples' losses ``l_i``, under ``"sum"``
    the sum of their shares ``l_i / B``, whose gradients are clipped. On the first
    compile ``B`` is a literal that Dynamo guards; a second batch size is symbolic.
    Beside a mean (a cross entropy) it is a mean."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Distill(how).double()
    if how in ("mean", "with_cross_entropy") and reduction == "sum":
        dp_model = fxdp.transform(model, max_grad_norm=1.0, loss_reduction=reduction, compiler="eager")
        with pytest.raises(fxdp.UnsupportedError, match="is a mean over the batch but loss_reduction='sum'"):
            dp_model(_randn(B, 4), _randn(B, 5, seed=3))
        return
    dp_model = None
    for size in (B, B + 2):
        x, teacher = _randn(size, 4), _randn(size, 5, seed=3)
        share = (lambda loss, i: loss) if reduction == "mean" else (lambda loss, i, n=size: loss / n)
        ref = reference(model, (x, teacher), share)
        clip = float(ref.norms.median())
        if dp_model is None:
            dp_model = fxdp.transform(model, max_grad_norm=clip, loss_reduction=reduction, compiler="eager")
        dp_model.max_grad_norm = clip
        model.zero_grad(set_to_none=True)
        dp_model(x, teacher).backward()
        if size == B:
            check_step(model, dp_model, ref, grad_sample=False, clip=clip, tol=tolerance(torch.float64),
                       reduction=reduction)
        else:  # explain() now lists both graphs' plans
            assert_close_all({n: p.grad for n, p in model.named_parameters()}, ref.grad(reduction, clip),
                             tolerance(torch.float64), "p.grad")
            assert_close_all({"norms": dp_model.per_sample_norms}, {"norms": ref.norms},
                             tolerance(torch.float64), "per_sample_norms")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_mean_times_the_batch_size_is_a_sum(reduction: str):
    """``l.mean() * B`` is ``l.sum()`` (PyG's pooling losses scaled back): a sum, at the
    first batch size (a literal ``B``) and at a second one (symbolic)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Distill("mean_times_batch").double()
    dp_model = fxdp.transform(model, max_grad_norm=1.0, loss_reduction=reduction, compiler="eager")
    if reduction == "mean":
        with pytest.raises(fxdp.UnsupportedError, match="is a sum over the batch but loss_reduction='mean'"):
            dp_model(_randn(B, 4), _randn(B, 5, seed=3))
        return
    for size in (B, B + 2):
        x, teacher = _randn(size, 4), _randn(size, 5, seed=3)
        ref = reference(model, (x, teacher), lambda loss, i: loss)
        model.zero_grad(set_to_none=True)
        dp_model(x, teacher).backward()
        assert_close_all({n: p.grad for n, p in model.named_parameters()}, ref.grad("sum", 1.0),
                         tolerance(torch.float64), "p.grad")


class StagedLosses(torch.nn.Module):
    """A residual quantizer's auxiliary losses, one mean per stage, gathered in a vector
    (``torch.stack``, or ``cat`` of ``l[None]``), returned or summed inside the graph."""

    def __init__(self, how: str):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.how = how

    def forward(self, x):
        y1 = self.a(x)
        y2 = self.b(y1)
        l1, l2 = F.mse_loss(y1, x), F.mse_loss(y2, x)
        aux = torch.stack([l1, l2]) if self.how != "cat" else torch.cat([l1[None], l2[None]])
        if self.how == "summed":
            return y2.pow(2).sum(-1).mean() + aux.sum()
        return y2, aux


@pytest.mark.parametrize("how", ["stack", "cat", "summed"])
def test_losses_gathered_in_a_vector_stay_losses(how: str):
    """Each entry of ``torch.stack([l1, l2])`` is a mean of per-sample terms: summed
    (inside the graph or out of it) the loss is the mean of ``y_i² + l1_i + l2_i``. It
    was refused as a loss "used by an op other than a sum"."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = StagedLosses(how).double()
    x = _randn(B, 4)

    def total(out, i=None):
        if how == "summed":
            return out
        y2, aux = out
        return y2.pow(2).sum(-1).mean() + aux.sum()

    ref = reference(model, (x,), total)
    clip = float(ref.norms.median())
    dp_model = fxdp.transform(model, max_grad_norm=clip, grad_sample=True, loss_reduction="mean", compiler="eager")
    total(dp_model(x)).backward()
    check_step(model, dp_model, ref, grad_sample=True, clip=clip, tol=tolerance(torch.float64), reduction="mean")


def test_a_sum_divided_by_another_number_is_a_sum():
    """A sum divided by a number that is not the batch size is a sum of scaled terms."""
    torch._dynamo.reset()
    dp_model = fxdp.transform(Distill("sum_over_features").double(), max_grad_norm=1.0, compiler="eager")
    with pytest.raises(fxdp.UnsupportedError, match="is a sum over the batch but loss_reduction='mean'"):
        dp_model(_randn(B, 4), _randn(B, 5, seed=3))


class SpeechCTC(torch.nn.Module):
    """Conv1d front end, a GRU, per-frame log-probabilities for a CTC loss."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 6, 3, padding=1)
        self.rnn = torch.nn.GRU(6, 6, batch_first=True)
        self.out = torch.nn.Linear(6, classes)

    def forward(self, x):
        h = F.gelu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        h, _ = self.rnn(h)
        return self.out(h).log_softmax(-1)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ctc_loss_outside_the_graph(reduction: str):
    """Speech recognition: Dynamo cannot capture ``F.ctc_loss`` (no meta kernel for its
    data-dependent output in torch 2.13), so the model returns log-probabilities and the
    loss is taken outside. Its "mean" divides each sample's loss by its own target length,
    then averages over the samples: each sample's share is its own."""
    torch.manual_seed(0)
    model = SpeechCTC().double()
    x = _randn(B, 12, 4)
    targets, frames, lengths = torch.randint(1, 5, (B, 4)), torch.full((B,), 12), torch.tensor([4, 3, 2, 4, 1])[:B]

    def ctc(log_probs, rows):
        return F.ctc_loss(log_probs.transpose(0, 1), targets[rows], frames[rows], lengths[rows], reduction=reduction)

    ref = reference(model, (x,), lambda out, i: ctc(out, slice(i, i + 1)))
    clip = float(ref.norms.median())
    dp_model = fxdp.transform(model, max_grad_norm=clip, loss_reduction=reduction, compiler="eager")
    ctc(dp_model(x), slice(None)).backward()
    check_step(model, dp_model, ref, grad_sample=False, clip=clip, tol=tolerance(torch.float64),
               reduction=reduction)


# -- packed sequences ----------------------------------------------------------------------------

def _packed_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([6, 3, 5, 2, 4])
    x = _randn(B, 6, 4)
    x = x * (torch.arange(6) < lengths[:, None]).unsqueeze(-1)  # zero padding
    last_step = torch.nn.functional.one_hot(lengths - 1, 6).double()
    return x, lengths, last_step


def test_packed_sequence_is_refused_not_silently_wrong():
    torch.manual_seed(0)
    model = models.PackedLSTM().double()
    x, lengths, _ = _packed_inputs()
    dp_model = fxdp.transform(model, max_grad_norm=1.0, compiler="eager")
    with pytest.raises(Exception, match="pack_padded_sequence"):
        dp_model(x, lengths)
    assert all(p.grad is None for p in model.parameters())


def test_packed_sequence_error_tells_the_user_to_pad():
    torch.manual_seed(0)
    model = models.PackedLSTM().double()
    x, lengths, _ = _packed_inputs()
    dp_model = fxdp.transform(model, max_grad_norm=1.0, compiler="eager")
    with pytest.raises(fxdp.UnsupportedError, match="(?i)pad"):
        dp_model(x, lengths)


def test_packed_sequence_argument_is_refused():
    """A ``PackedSequence`` passed in (Opacus's ``DPLSTM`` takes one) has no batch dim."""
    torch.manual_seed(0)
    rnn = torch.nn.LSTM(4, 4, batch_first=True).double()
    x, lengths, _ = _packed_inputs()
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    dp_model = fxdp.transform(rnn, max_grad_norm=1.0, compiler="eager")
    with pytest.raises(fxdp.UnsupportedError, match="PackedSequence argument.*(?s:.*)padded batch"):
        dp_model(packed)
    assert all(p.grad is None for p in rnn.parameters())


class RequiresGradMidForward(torch.nn.Module):
    """``x.requires_grad_()`` on the forward's own argument (the caller's tensor), which
    Dynamo cannot put in a graph. (On a value the forward computes, as wav2vec2's feature
    encoder sets it, fxdp's capture drops it.)"""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(1, 4, 3)
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        if self.training:
            x.requires_grad_()
        return self.fc(self.conv(x[:, None]).transpose(1, 2))


def test_code_dynamo_cannot_capture_in_one_graph_is_an_fxdp_error_quoting_dynamo():
    model = RequiresGradMidForward().double()
    dp_model = fxdp.transform(model, max_grad_norm=1.0, compiler="eager")
    with pytest.raises(fxdp.UnsupportedError, match="(?s)one graph.*requires_grad"):
        dp_model(torch.randn(3, 10, dtype=torch.float64))
    assert all(p.grad is None for p in model.parameters())


def test_vmap_per_sample_meets_the_ordinary_rules():
    """The ATen code of a ``vmap``'d Linear is ``mm`` and a bias scaled by ``beta = 1``
    (``addmm``'s decomposition): each parameter meets its own rule, none a per-sample VJP."""
    model = models.VmapPerSample().double()
    plans = {p.name: p for p in fxdp.explain(model, _randn(B, 3, 4), max_grad_norm=1.0).plans}
    assert {name: plan.rule for name, plan in plans.items()} == {
        "fc.weight": "mm.mat2", "fc.bias": "add.self", "mix": "mm.mat2", "scale": "mul.other"}
    assert not [p for p in plans.values() if "VJP" in p.strategy], plans


class JvpInside(torch.nn.Module):
    """A directional derivative of a layer by ``torch.func.jvp`` (forward-mode AD)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.func.jvp(lambda v: torch.tanh(self.fc(v)), (x,), (torch.ones_like(x),))[1]


def test_a_loop_over_the_samples_under_the_backend_at_two_batch_sizes():
    """The loop's count is the batch size, so Dynamo specialises ``B``: each size is its
    own graph, each exact."""
    torch.manual_seed(0)
    model = models.PerSampleLoop("slice").double()
    compiled = torch.compile(model, backend=fxdp.backend(grad_sample=True, compiler="eager"))
    _against_the_loop_at(model, compiled, (3, 5), 3, 4)


class EmptyContext(torch.nn.Module):
    """Keys from a context that may have no rows, unflattened into heads (diffusers'
    Wan image-to-video model slices its text beyond 512 tokens: ``[B, 0, d]``)."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(4, 4)
        self.k = torch.nn.Linear(4, 4)

    def forward(self, x, context):
        keys = torch.cat([self.k(context).unflatten(2, (2, 2)), self.k(x).unflatten(2, (2, 2))], 1)
        return (self.q(x).unflatten(2, (2, 2)) * keys.sum(1, keepdim=True)).flatten(2)


@pytest.mark.parametrize("rows", [0, 2])
def test_a_view_of_an_empty_batched_tensor(rows):
    """``unflatten`` of the ``[B, 0, d]`` keys crashed the analysis (a modulo by zero)."""
    torch.manual_seed(0)
    model = EmptyContext().double()
    x, context = _randn(B, 3, 4), _randn(B, rows, 4, seed=2)
    ref = reference(copy.deepcopy(model), (x, context), lambda out, i: per_sample_loss(out, 0).sum())
    dp_model = fxdp.transform(model, grad_sample=True, compiler="eager")
    per_sample_loss(dp_model(x, context), 0).mean().backward()
    check_step(model, dp_model, ref, grad_sample=True, clip=None, tol=tolerance(torch.float64))


class LoopOverChunks(torch.nn.Module):
    """Attention run on chunks of two samples and concatenated again."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(4, 12)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return torch.cat([F.scaled_dot_product_attention(q[i:i + 2], k[i:i + 2], v[i:i + 2])
                          for i in range(0, x.shape[0], 2)])


def test_attention_run_on_chunks_of_two_samples_is_per_sample():
    """Once refused ("it slices the batch dim"), the loop now runs as one attention on
    the whole batch (``passes/chunk_loops.py``)."""
    torch.manual_seed(0)
    model = LoopOverChunks().double()
    _against_the_loop_at(model, fxdp.transform(model, grad_sample=True, compiler="eager"), (4, 6), 2, 4)


class OnePiece(torch.nn.Module):
    """The batch split into a single piece, each piece through a layer and concatenated
    again: TabNet's ghost BatchNorm when its virtual batch is at least the batch
    (``x.chunk(1, 0)``), reformer's ``process_inputs_chunk`` with one chunk."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        pieces = x.chunk(1, 0) if self.how == "chunk" else x.split(x.shape[0], 0)
        return torch.cat([self.fc(piece) for piece in pieces])


@pytest.mark.parametrize("how", ["chunk", "split"])
def test_the_batch_split_into_one_piece_is_the_batch(how):
    torch.manual_seed(0)
    model = OnePiece(how).double()
    dp_model = fxdp.transform(model, grad_sample=True, max_grad_norm=0.5, compiler="eager")
    _against_the_loop_at(model, dp_model, (B, B + 2), 2, 4, max_grad_norm=0.5)


class PiecesMixed(torch.nn.Module):
    """Per-sample loops that mix the samples' pieces, or use a parameter on one."""

    def __init__(self, kind: str):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.kind = kind
        self.register_buffer("buffer", torch.zeros(4, 2, 4))  # a row more than the batch: not all written

    def forward(self, x):
        h = self.fc(x)
        if self.kind == "reversed":
            return torch.cat([h[i:i + 1] for i in reversed(range(x.shape[0]))])
        if self.kind == "first-added":
            return torch.cat([h[i:i + 1] + h[0:1] for i in range(x.shape[0])])
        if self.kind == "expanded":
            return h + h[0:1].expand(x.shape[0], -1, -1)
        if self.kind == "returned":  # a loss of the first sample alone (accepted before, a helper found)
            return h[0].pow(2).sum()
        if self.kind == "returned-slice":
            return h[1:2]
        if self.kind == "padded-reversed":
            return pad_sequence(list(reversed(h.unbind(0))), batch_first=True)
        if self.kind == "written-into-a-buffer":
            out = self.buffer.clone()
            for i in range(x.shape[0]):
                out[i] = h[i]
            return self.fc(out[:x.shape[0]]) + h
        if self.kind in ("written-swapped", "accumulated"):
            out = torch.zeros_like(h)
            for i in range(x.shape[0]):
                if self.kind == "accumulated":
                    out[0] += h[i]
                else:
                    out[i] = h[x.shape[0] - 1 - i]
            return out
        # the layer on every other sample: the copies differ, so this is no map over the batch
        # (the same layer on every sample runs as one call: test_chunk_loops.py)
        return torch.stack([self.fc(h[i]) if i % 2 else h[i] for i in range(x.shape[0])])


@pytest.mark.parametrize("kind, reason", [
    ("reversed", "combines the values of one sample taken out of the batch"),
    ("first-added", "combines the values of one sample taken out of the batch"),
    ("written-swapped", "combines the values of one sample taken out of the batch"),
    ("accumulated", "combines the values of one sample taken out of the batch"),
    ("expanded", "combines the values of one sample taken out of the batch"),
    ("padded-reversed", "combines the values of one sample taken out of the batch"),
    ("returned", "returns values of one sample taken out of the batch"),
    ("returned-slice", "returns values of one sample taken out of the batch"),
    # Read as shared, the buffer's rows would have been constants to every sample.
    ("written-into-a-buffer", "writes one sample's values, taken out of the batch .* shared by all samples"),
    ("parameter", "uses a parameter on the values of one sample taken out of the batch"),
])
def test_a_loop_over_the_samples_that_mixes_their_pieces_is_refused(kind, reason):
    """The pieces of every sample are a batch again only when concatenated in their order
    (each of one size along that dim), and no parameter may be used on one (fxdp's rules work on
    whole batches)."""
    model = PiecesMixed(kind).double()
    with pytest.raises(fxdp.UnsupportedError, match=reason):
        fxdp.transform(model, max_grad_norm=1.0, compiler="eager")(torch.randn(3, 2, 4, dtype=torch.float64))
    assert all(p.grad is None for p in model.parameters())


class JoinedPieces(torch.nn.Module):
    """Every sample's rows taken out of the batch and concatenated in order, as a packed
    ``[B * n, d]`` (vit-pytorch's NaViT on a tensor batch): ``cat([h[i] for i in
    range(B)])`` and ``cat(h.unbind(0))`` are ``h.flatten(0, 1)``; ``unequal`` pieces
    (each sample's first ``i + 1`` rows) have no batch layout."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc1 = torch.nn.Linear(4, 4)
        self.fc2 = torch.nn.Linear(4, 3)

    def forward(self, x, lengths=None):
        h = self.fc1(x).tanh()
        if self.kind == "unbind":
            packed = torch.cat(h.unbind(0))
        elif self.kind == "unequal":
            packed = torch.cat([h[i, :i + 1] for i in range(x.shape[0])])
        elif self.kind == "lengths":  # flair's SequenceTagger without a CRF: each sentence's real tokens
            return self.fc2(torch.cat([feat[:length] for feat, length in zip(h, lengths)]))
        else:
            packed = torch.cat([h[i] for i in range(x.shape[0])], 0)
        return self.fc2(packed).view(x.shape[0], -1, 3) if self.kind != "unequal" else self.fc2(packed)


@pytest.mark.parametrize("kind", ["select", "unbind"])
def test_every_samples_rows_concatenated_in_order_are_the_batch_flattened(kind):
    torch.manual_seed(0)
    model = JoinedPieces(kind).double()
    dp_model = fxdp.transform(model, grad_sample=True, max_grad_norm=0.5, compiler="eager")
    _against_the_loop_at(model, dp_model, (B, B + 2), 3, 4, max_grad_norm=0.5)


@pytest.mark.parametrize("kind", ["unequal", "lengths"])
def test_pieces_of_different_sizes_concatenated_are_refused(kind):
    """A ragged list of every sample's rows, at sizes of their positions or read from the
    data (flair's token scores): refused with what to do instead (before the sixty-second
    session as combining one sample's values with the others')."""
    x = torch.randn(3, 3, 4, dtype=torch.float64)
    args = (x,) if kind == "unequal" else (x, torch.tensor([3, 1, 2]))
    with pytest.raises(fxdp.UnsupportedError, match="it concatenates every sample's piece taken out of the batch in "
                       r"their order, but the pieces' sizes along the joined dim differ, or may .*\(loss \* mask\)"):
        fxdp.transform(JoinedPieces(kind).double(), compiler="eager")(*args)


class PaddedPieces(torch.nn.Module):
    """Each sample's first ``lengths[i]`` positions (a list fixed per batch, as a data
    loader's lengths would be), padded together again: by ``pad_sequence`` (its ATen code
    writes piece ``i`` into row ``i`` of a buffer sized by the batch, ``slice_scatter``),
    ``pad_sequence`` of ``unbind(0)`` (``select_scatter``), or a loop that writes each
    into its row of ``new_zeros(B, T, d)``. ``Masked`` computes the same from the lengths
    as a tensor, a model whose samples are independent by construction: the reference."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.lengths = kind, []
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        h = self.fc(x)
        if self.kind == "unbind":
            return pad_sequence(list(h.unbind(0)), batch_first=True)
        pieces = [h[i, :self.lengths[i]].tanh() for i in range(x.shape[0])]
        if self.kind == "pad_sequence":
            return pad_sequence(pieces, batch_first=True, padding_value=0.5)
        out = h.new_full((x.shape[0], max(self.lengths), 3), 0.5)
        for i, piece in enumerate(pieces):
            out[i, :piece.shape[0]] = piece
        return out


class Masked(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, lengths):
        h = self.fc(x)
        if self.kind == "unbind":
            return h
        kept = (torch.arange(x.shape[1]) < lengths[:, None])[..., None]
        return torch.where(kept, h.tanh(), 0.5)


@pytest.mark.parametrize("kind", ["pad_sequence", "unbind", "written"])
def test_pieces_written_into_their_own_rows_are_the_batch(kind):
    torch.manual_seed(0)
    model = PaddedPieces(kind).double()
    same = Masked(kind).double()
    same.load_state_dict(model.state_dict())
    dp_model = fxdp.transform(model, grad_sample=True, max_grad_norm=0.3, loss_reduction="sum", compiler="eager")
    for batch_size in (3, 5):
        x = _randn(batch_size, 4, 4, seed=batch_size)
        model.lengths = [4] + [1 + i % 4 for i in range(1, batch_size)]
        ref = reference(same, (x, torch.tensor(model.lengths)), lambda out, i: out.sin().pow(2).sum())
        model.zero_grad(set_to_none=True)
        dp_model(x).sin().pow(2).sum().backward()
        tol = tolerance(torch.float64)
        assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample, tol,
                         f"grad_sample at B = {batch_size}")
        assert_close_all({n: p.grad for n, p in model.named_parameters()}, ref.grad("sum", 0.3), tol,
                         f"clipped grad at B = {batch_size}")


class VmapMixingSamples(torch.nn.Module):
    """``vmap`` over the positions whose function normalises over the batch it sees."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.func.vmap(lambda h: h - h.mean(0), in_dims=1, out_dims=1)(self.fc(x))


@pytest.mark.parametrize("model_class, op, match", [
    # The ops vmap runs are analysed as any others: a mean over the batch inside the
    # mapped function is refused at that op, with the line of the vmap call.
    ("VmapMixingSamples", "aten.mean.dim", r"(?s)aten\.mean\.dim.*torch\.func\.vmap.*reduces over the batch"),
    # Traced below functorch, jvp's tangent formulas carry zero tensors and meta-device
    # copies the analysis does not follow: refused by name, at the line of the jvp.
    ("JvpInside", "torch.func.jvp",
     r"(?s)test_models_e2e.py:\d+: return torch.func.jvp.*forward-mode AD.*does not support"),
])
def test_refused_inside_a_torch_func_transform(model_class, op, match):
    model = globals()[model_class]().double()
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    assert [p.op for p in fxdp.validate(model, x)] == [op]
    with pytest.raises(fxdp.UnsupportedError, match=match):
        fxdp.transform(model, max_grad_norm=1.0, compiler="eager")(x)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("mode", ["grad_sample", "clip"])
def test_padded_lstm_matches_the_packed_model(mode: str):
    """What the refusal asks for: the same LSTM run over the padded batch, each sample's
    last real step read through a mask, is exact against the *packed* model's loop."""
    torch.manual_seed(0)
    packed = models.PackedLSTM().double()
    padded = models.PaddedLSTM().double()
    padded.load_state_dict(packed.state_dict())
    x, lengths, last_step = _packed_inputs()
    ref = reference(packed, (x, lengths), lambda out, i: per_sample_loss(out, 0).sum())
    clip = float(ref.norms.median()) if mode == "clip" else None
    dp_model = fxdp.transform(padded, max_grad_norm=clip, grad_sample=mode == "grad_sample", compiler="eager")
    per_sample_loss(dp_model(x, last_step), 0).mean().backward()
    check_step(padded, dp_model, ref, grad_sample=mode == "grad_sample", clip=clip, tol=tolerance(torch.float64))


# -- Inductor ------------------------------------------------------------------------------------

@pytest.mark.parametrize("case_id, mode, blocks", [
    ("nanogpt_tied", "clip", 1),
    ("weight_norm", "clip", None),
    # a conv weight: Inductor's layout optimisation must not hide it from grad_sample
    ("vit_conv_patches", "grad_sample", 0),
    ("vmap_per_sample", "clip", None),
    ("loop_over_samples_slices", "clip", None),
    ("experts_sorted_with_biases", "grad_sample", None),
    ("experts_looped_where", "clip", None),
])
def test_inductor_float32(case_id: str, mode: str, blocks: int | None):
    case = CASE_BY_ID[case_id]
    if blocks is not None:  # Inductor's compile time grows with the graph
        case = dataclasses.replace(case, model=_with_blocks(case.model, blocks))
    run(case, mode, torch.float32, compiler="inductor")


def _with_blocks(make: Callable[[], nn.Module], count: int) -> Callable[[], nn.Module]:
    """The same model keeping only its first ``count`` blocks."""

    def build_smaller() -> nn.Module:
        model = make()
        for name in ("h", "blocks"):
            blocks: Any = getattr(model, name, None)
            if isinstance(blocks, nn.ModuleList):
                setattr(model, name, blocks[:count])
        return model

    return build_smaller


# -- recurrent cells as canonicalisation writes them ----------------------------------------

@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_cells_written_out_are_atens(cell, bias):
    """The LSTM and GRU cells canonicalisation writes as linears and gates (on CUDA, ATen's
    own implementation is a fused kernel no rule knows, ``_thnn_fused_lstm_cell``) compute
    what ATen's cells compute, bit for bit in float64 on the CPU."""
    from fxdp.passes.canonicalize import _gru_cell, _lstm_cell

    torch.manual_seed(0)
    layer = (nn.LSTMCell if cell == "lstm" else nn.GRUCell)(3, 4, bias=bias).double()
    x, h, c = _randn(5, 3), _randn(5, 4, seed=2), _randn(5, 4, seed=3)
    weights = (layer.weight_ih, layer.weight_hh, layer.bias_ih, layer.bias_hh)
    if cell == "lstm":
        got, want = _lstm_cell(x, (h, c), *weights), torch.lstm_cell(x, (h, c), *weights)
    else:
        got, want = (_gru_cell(x, h, *weights),), (torch.gru_cell(x, h, *weights),)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
