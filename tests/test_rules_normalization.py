"""Normalisation rules (``fxdp/rules/normalization.py``) against the microbatch reference.

One table of cases: ``nn.LayerNorm`` (trailing, multi-dim, no bias, merged batch,
batch second), ``F.layer_norm`` with an eps, ``nn.RMSNorm`` (default and explicit
eps), ``nn.GroupNorm`` over ``[B, C]``, ``[B, C, L]`` and ``[B, C, H, W]`` (one
group, several, one per channel), ``nn.InstanceNorm1d/2d(affine=True)``, both over a
batch merged with other rows of dim 0 (``[B·F, C, …]``, ``[F·B, C, …]``), in eval mode
with running statistics, ``nn.BatchNorm1d/2d`` in eval mode (the elementwise rules of
its affine map), and a batch of one. Every norm sits after a trainable
layer, so its input gradient is exercised too. Each case runs once in float64 with
a sum loss and once in float32 with a mean loss, with grad samples and clipping;
then the refusals.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdp
from reference import assert_close_all, reference, tolerance

B, T, D, C = 3, 5, 4, 4


class Sandwich(nn.Module):
    """``Linear -> norm -> Tanh -> Linear`` over the last dim (the norm's input needs a gradient)."""

    def __init__(self, norm: nn.Module, d: int = D):
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(d, d), norm, nn.Linear(d, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.inp(x))))


class ChannelSandwich(nn.Module):
    """``1x1 conv -> norm -> Tanh -> 1x1 conv`` over ``[B, C, *spatial]`` (``[B, C]`` too)."""

    def __init__(self, norm: nn.Module, spatial: int):
        super().__init__()
        self.spatial = spatial
        self.inp, self.norm, self.out = nn.Linear(2, C), norm, nn.Linear(C, 3)

    def forward(self, x):
        h = self.inp(x.movedim(1, -1)).movedim(-1, 1)  # [B, C, *spatial]
        return self.out(torch.tanh(self.norm(h)).movedim(1, -1))


class MergedLayerNorm(nn.Module):
    """``[B, T, d] -> [B·T, d]``: the norm sees a merged batch dim."""

    def __init__(self):
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(D, 3)

    def forward(self, x):
        h = self.norm(self.inp(x).reshape(-1, D))
        return self.out(torch.tanh(h)).view(x.shape[0], x.shape[1], 3)


class MergedRowsSandwich(nn.Module):
    """``[B, F, 2, *spatial]`` with frames folded into the batch before a channel norm:
    ``[B·F, C, *spatial]`` (video UNets), or ``[F·B, C, *spatial]`` with ``outer``
    (HDemucs's frequency branch folds the batch inside another dim)."""

    def __init__(self, norm: nn.Module, outer: bool = False):
        super().__init__()
        self.outer = outer
        self.inp, self.norm, self.out = nn.Linear(2, C), norm, nn.Linear(C, 3)

    def forward(self, x):
        rows = x.transpose(0, 1) if self.outer else x
        h = self.inp(rows.flatten(0, 1).movedim(1, -1)).movedim(-1, 1)  # [rows, C, *spatial]
        y = self.out(torch.tanh(self.norm(h)).movedim(1, -1))
        y = y.view(x.shape[1], x.shape[0], *y.shape[1:]).transpose(0, 1) if self.outer else y.view(
            *x.shape[:2], *y.shape[1:])
        return y


class FunctionalLayerNorm(nn.Module):
    """``F.layer_norm`` with a weight only and an explicit eps."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(D, D), nn.Linear(D, 3)
        self.gain = nn.Parameter(torch.randn(D))

    def forward(self, x):
        return self.out(F.layer_norm(self.inp(x), (D,), self.gain, None, 1e-3))


class SharedTable(nn.Module):
    """A norm of a shared ``[T, d]`` table added to the batch: its output is broadcast."""

    def __init__(self):
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(D, 3)
        self.register_buffer("table", torch.randn(T, D))

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x) + self.norm(self.table)))


def _eval_instance_norm(spatial: int = 1) -> nn.Module:
    norm = (nn.InstanceNorm2d if spatial == 2 else nn.InstanceNorm1d)(C, affine=True, track_running_stats=True)
    model = ChannelSandwich(norm, spatial=spatial)
    with torch.no_grad():
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
    norm.eval()
    return model


def _eval_batch_norm(spatial: int, **options) -> nn.Module:
    norm = (nn.BatchNorm2d if spatial == 2 else nn.BatchNorm1d)(C, **options)
    model = ChannelSandwich(norm, spatial)
    with torch.no_grad():
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
    norm.eval()
    return model


@dataclasses.dataclass
class Case:
    id: str
    make: Callable[[], nn.Module]
    shape: tuple
    batch_first: bool = True
    rules: tuple = ()  # rules that must fire


CASES = [
    Case("layernorm", lambda: Sandwich(nn.LayerNorm(D)), (B, T, D), rules=("layer_norm.weight", "layer_norm.bias")),
    Case("layernorm-2d", lambda: Sandwich(nn.LayerNorm([T, D])), (B, T, D), rules=("layer_norm.weight",)),
    Case("layernorm-nobias", lambda: Sandwich(nn.LayerNorm(D, bias=False)), (B, T, D), rules=("layer_norm.weight",)),
    Case("layernorm-no-affine", lambda: Sandwich(nn.LayerNorm(D, elementwise_affine=False)), (B, T, D)),
    Case("layernorm-flat", lambda: Sandwich(nn.LayerNorm(D)), (B, D), rules=("layer_norm.weight",)),
    Case("layernorm-merged-batch", MergedLayerNorm, (B, T, D), rules=("layer_norm.weight",)),
    Case("layernorm-batch-second", lambda: Sandwich(nn.LayerNorm(D)), (T, B, D), batch_first=False,
         rules=("layer_norm.weight",)),
    Case("layernorm-functional-eps", FunctionalLayerNorm, (B, T, D), rules=("layer_norm.weight",)),
    Case("rmsnorm", lambda: Sandwich(nn.RMSNorm(D)), (B, T, D), rules=("rms_norm.weight",)),
    Case("rmsnorm-eps-2d", lambda: Sandwich(nn.RMSNorm([T, D], eps=1e-3)), (B, T, D), rules=("rms_norm.weight",)),
    Case("groupnorm-2x2d", lambda: ChannelSandwich(nn.GroupNorm(2, C), 2), (B, 2, 3, 3),
         rules=("group_norm.weight", "group_norm.bias")),
    Case("groupnorm-1group-1d", lambda: ChannelSandwich(nn.GroupNorm(1, C), 1), (B, 2, 5), rules=("group_norm.weight",)),
    Case("groupnorm-per-channel-eps", lambda: ChannelSandwich(nn.GroupNorm(C, C, eps=1e-3), 2), (B, 2, 3, 2),
         rules=("group_norm.weight",)),
    Case("groupnorm-no-spatial", lambda: ChannelSandwich(nn.GroupNorm(2, C), 0), (B, 2), rules=("group_norm.weight",)),
    Case("instancenorm2d", lambda: ChannelSandwich(nn.InstanceNorm2d(C, affine=True), 2), (B, 2, 3, 3),
         rules=("instance_norm.weight", "instance_norm.bias")),
    Case("instancenorm1d", lambda: ChannelSandwich(nn.InstanceNorm1d(C, affine=True), 1), (B, 2, 6),
         rules=("instance_norm.weight",)),
    Case("groupnorm-frames-merged-into-batch", lambda: MergedRowsSandwich(nn.GroupNorm(2, C)), (B, 2, 2, 3, 3),
         rules=("group_norm.weight", "group_norm.bias")),
    Case("groupnorm-positions-merged-into-batch", lambda: MergedRowsSandwich(nn.GroupNorm(2, C)), (B, T, 2),
         rules=("group_norm.weight",)),
    Case("instancenorm-batch-merged-inside", lambda: MergedRowsSandwich(nn.InstanceNorm1d(C, affine=True), outer=True),
         (B, 3, 2, 5), rules=("instance_norm.weight", "instance_norm.bias")),
    # BatchNorm and InstanceNorm with running statistics are the per-channel affine map
    # they are: the elementwise rules, not the generic per-sample VJP.
    Case("instancenorm1d-eval-running-stats", _eval_instance_norm, (B, 2, 6), rules=("mul.other", "add.other")),
    Case("instancenorm2d-eval-running-stats", lambda: _eval_instance_norm(2), (B, 2, 3, 3),
         rules=("mul.other", "add.other")),
    Case("batchnorm2d-eval", lambda: _eval_batch_norm(2), (B, 2, 3, 3), rules=("mul.other", "add.other")),
    Case("batchnorm1d-eval-sequence", lambda: _eval_batch_norm(1, eps=1e-3), (B, 2, 5), rules=("mul.other",)),
    Case("batchnorm1d-eval-flat", lambda: _eval_batch_norm(0), (B, 2), rules=("mul.other", "add.other")),
    Case("batchnorm2d-eval-no-affine", lambda: _eval_batch_norm(2, affine=False), (B, 2, 3, 3)),
    Case("layernorm-of-shared-table", SharedTable, (B, T, D), rules=("layer_norm.weight",)),
    Case("layernorm-batch-of-one", lambda: Sandwich(nn.LayerNorm(D)), (1, T, D), rules=("batch-of-one",)),
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


def _perturb(model: nn.Module, seed: int) -> None:
    """Norm weights start at 1 and biases at 0: move them so that a mix-up shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


@pytest.mark.parametrize("dtype,reduction", RUNS)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_grad_sample_and_clipping(case: Case, dtype: torch.dtype, reduction: str):
    torch.manual_seed(0)
    model = case.make().to(dtype)
    _perturb(model, 1)
    x = torch.randn(case.shape, dtype=dtype)
    batch_dim = 0 if case.batch_first else 1
    with torch.no_grad():
        target = torch.randn_like(model(x))
    ref = reference(model, (x,), lambda out, i: _per_sample_loss(out, target.narrow(batch_dim, i, 1), batch_dim).sum(),
                    batch_dim=batch_dim)
    max_grad_norm = _clip_between(ref.norms)
    tol = tolerance(dtype)

    dp = fxdp.transform(model, max_grad_norm=max_grad_norm, grad_sample=True, loss_reduction=reduction,
                        batch_first=case.batch_first, compiler="eager")
    loss = _per_sample_loss(dp(x), target, batch_dim)
    (loss.mean() if reduction == "mean" else loss.sum()).backward()

    assert_close_all(_params(model, "grad_sample"), ref.per_sample, tol, f"{case.id}: grad_sample")
    assert_close_all({"norms": dp.per_sample_norms}, {"norms": ref.norms}, tol, f"{case.id}: norms")
    factors = ref.clip_factors(max_grad_norm)
    assert len(factors) == 1 or 0 < int((factors < 1).sum()) < len(factors), "clipping must bind for some samples only"
    assert_close_all({"clip": dp.clip_factors}, {"clip": factors}, tol, f"{case.id}: clip factors")
    assert_close_all(_params(model, "grad"), ref.grad(reduction, max_grad_norm), tol, f"{case.id}: clipped grad")
    fired = dp.explain().rule_counts
    for rule in case.rules:
        assert fired.get(rule), f"{case.id}: rule {rule} did not fire ({fired})"


def test_inductor_groupnorm():
    """One case through Inductor: the recomputed x̂ and the native backward ops lower."""
    torch.manual_seed(0)
    model = ChannelSandwich(nn.GroupNorm(2, C), 2)
    _perturb(model, 2)
    x = torch.randn(B, 2, 3, 3)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    ref = reference(model, (x,), lambda out, i: _per_sample_loss(out, target[i:i + 1], 0).sum())
    max_grad_norm = _clip_between(ref.norms)
    dp = fxdp.transform(model, max_grad_norm=max_grad_norm, grad_sample=True, compiler="inductor")
    _per_sample_loss(dp(x), target, 0).mean().backward()
    tol = tolerance(torch.float32)
    assert_close_all(_params(model, "grad_sample"), ref.per_sample, tol, "inductor: grad_sample")
    assert_close_all(_params(model, "grad"), ref.grad("mean", max_grad_norm), tol, "inductor: clipped grad")


# ---------------------------------------------------------------------------
# The rule functions alone
# ---------------------------------------------------------------------------


def test_rule_functions_match_autograd():
    """Each rule's per-sample and summed gradients, and the input gradient, on one call."""
    from fxdp.rules import normalization as norms

    torch.manual_seed(3)
    aten = torch.ops.aten
    x = torch.randn(3, 4, 2, 3, dtype=torch.float64)
    w, b = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    cases = [
        (aten.layer_norm.default, (x, [2, 3], torch.randn(2, 3, dtype=torch.float64),
                                   torch.randn(2, 3, dtype=torch.float64), 1e-3), norms.LAYER_NORM),
        (aten.rms_norm.default, (x, [3], torch.randn(3, dtype=torch.float64), 1e-4), norms.RMS_NORM),
        (aten.rms_norm.default, (x, [3], torch.randn(3, dtype=torch.float64)), norms.RMS_NORM),
        (aten.group_norm.default, (x, 2, w, b, 1e-3), norms.GROUP_NORM),
        (aten.instance_norm.default, (x, w, b, None, None, True, 0.1, 1e-4, False), norms.INSTANCE_NORM),
    ]
    for op, args, rule in cases:
        config = rule.config(args)
        out = op(*args)
        g = torch.randn_like(out)
        for index, param_rule in rule.params.items():
            per_sample = []
            for i in range(3):
                one = list(args)
                one[0] = x[i:i + 1]
                one[index] = args[index].clone().requires_grad_()
                op(*one).backward(g[i:i + 1])
                per_sample.append(one[index].grad)
            want = torch.stack(per_sample)
            operands = [g if s == "grad" else args[s] for s in param_rule.operands]
            got = param_rule.per_sample_grad(*operands, **config)
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=f"{op} {param_rule.name}")
            torch.testing.assert_close(param_rule.sum_grad(*operands, **config), want.sum(0), rtol=1e-9, atol=1e-9)
        for index in [0] + list(rule.params):
            leaves = list(args)
            leaves[index] = args[index].clone().requires_grad_()
            op(*leaves).backward(g)
            got = rule.input_grad(list(args), g, index)
            torch.testing.assert_close(got, leaves[index].grad, rtol=1e-9, atol=1e-9, msg=f"{op} input {index}")


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_group_norm_float32_far_from_zero(layout):
    """Group statistics combined from per-channel moments, and ``Σ g·x̂`` from sums
    centred on each channel's mean, stay accurate in float32 for activations whose
    mean is large against their spread (here 1000 against 1: 8e-5 of the largest
    gradient, where uncentred sums are off by 3e-4): checked against float64 autograd
    on the same float32 values, in both memory layouts."""
    from fxdp.rules import normalization as norms

    torch.manual_seed(5)
    x64 = (1000 + torch.randn(4, 6, 5, 7) * torch.linspace(0.5, 2, 6).reshape(1, 6, 1, 1)).double()
    w64, b64 = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    g64 = torch.randn(4, 6, 5, 7, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x64, w64)]
    F.group_norm(leaves[0], 3, leaves[1], b64, 1e-5).backward(g64)
    per_sample_w = torch.stack([_weight_grad_one(x64[i:i + 1], w64, b64, g64[i:i + 1]) for i in range(4)])
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x, g = (t.float().contiguous(memory_format=memory_format) for t in (x64, g64))
    got_input = norms._group_norm_input_gradient(x, g, w64.float(), 3, 1e-5)
    got_w = norms._group_weight_per_sample_grad(g, x, groups=3, eps=1e-5, rank=4)
    torch.testing.assert_close(got_input.double(), leaves[0].grad, rtol=0, atol=1.5e-4 * leaves[0].grad.abs().max().item())
    torch.testing.assert_close(got_w.double(), per_sample_w, rtol=0, atol=1.5e-4 * per_sample_w.abs().max().item())


def _weight_grad_one(x, w, b, g):
    w = w.clone().requires_grad_()
    F.group_norm(x, 3, w, b, 1e-5).backward(g)
    return w.grad


def test_is_supported():
    for cls in (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d):
        assert fxdp.is_supported(cls), cls
    assert fxdp.is_supported(torch.ops.aten.layer_norm.default)


# ---------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------


def _reasons(model: nn.Module, x: torch.Tensor, **options) -> str:
    return "\n".join(str(p) for p in fxdp.validate(model, x, **options))


def test_instance_norm_tracking_running_stats_is_refused():
    model = ChannelSandwich(nn.InstanceNorm2d(C, affine=True, track_running_stats=True), 2)
    assert "running buffers" in _reasons(model, torch.randn(B, 2, 3, 3))


def test_layer_norm_over_the_batch_is_refused():
    """``[T, B, d]`` read batch-second, normalised over ``[B, d]``: samples share statistics."""
    model = Sandwich(nn.LayerNorm([B, D]))
    assert "normalises over the batch dim" in _reasons(model, torch.randn(T, B, D), batch_first=False)


class EvalNormThenTokens(nn.Module):
    """LeViT's, XCiT's and EfficientFormer's stems: a convolution and an eval-mode
    BatchNorm, the map read as tokens (``flatten(2).transpose(1, 2)``), then a residual
    block. ``by_hand`` computes the same BatchNorm elementwise."""

    def __init__(self, by_hand: bool = False):
        super().__init__()
        self.by_hand = by_hand
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.lin = nn.Linear(4, 4)
        self.fc = nn.Linear(4, 5)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        h = self.conv(x)
        if self.by_hand:
            bn = self.bn
            shape = (-1, 1, 1)
            h = (h - bn.running_mean.view(shape)) * torch.rsqrt(bn.running_var.view(shape) + bn.eps) \
                * bn.weight.view(shape) + bn.bias.view(shape)
        else:
            h = self.bn(h)
        tokens = h.flatten(2).transpose(1, 2)
        tokens = tokens + self.lin(tokens)
        return self.fc(tokens.mean(1))


def test_an_eval_batch_norm_read_as_tokens_against_the_loop_of_the_same_maths():
    """PyTorch's CPU kernel of an eval-mode BatchNorm's backward is wrong for a batch of
    one whose output gradient has channels-last strides, as the transpose of the tokens
    gives it (torch 2.13): the microbatch loop of the model as written is then wrong (by
    more than the gradients themselves), fxdp's batched backward is not. The reference
    here is the loop of the same maths written elementwise."""
    torch.manual_seed(0)
    model = EvalNormThenTokens().double().train()
    model.bn.eval()
    by_hand = EvalNormThenTokens(by_hand=True).double()
    by_hand.load_state_dict(model.state_dict())
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    for batch in (3, 5):
        x = torch.randn(batch, 3, 4, 4, dtype=torch.float64)
        ref = reference(by_hand, [x], lambda out, i: out.pow(2).sum())
        for p in model.parameters():
            p.grad_sample = None
        dp(x).pow(2).sum().backward()
        assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                         tolerance(torch.float64), "grad_sample")
