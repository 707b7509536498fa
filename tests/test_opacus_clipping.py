"""A second opinion on clipping: Opacus's own DP-SGD step against fxdp's one backward.

Opacus computes per-sample gradients with module hooks (``GradSampleModule``) and clips
them in ``DPOptimizer.pre_step`` (with ``noise_multiplier=0`` the step's gradient is
exactly ``s · Σ_i min(1, C / (‖g_i‖ + 1e-6)) · g_i``); its ghost clipping
(``GradSampleModuleFastGradientClipping``) gets the norms from Gram matrices and the
clipped gradient from a second backward. fxdp must give the same ``p.grad`` and the same
per-sample norms from one backward, on models written only with layers Opacus supports.
The microbatch loop stays the ground truth everywhere else; this is an implementation
written by someone else, with its own bookkeeping of scaling and clip factors.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxdp
from reference import assert_close_all

pytest.importorskip("opacus", reason="the second opinion is Opacus itself (the test extra)")

from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping  # noqa: E402
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping  # noqa: E402
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping  # noqa: E402

B = 6
TOL = 1e-9


class ResidualCNN(nn.Module):
    """Conv + GroupNorm + ReLU, a residual block with a strided 1x1 shortcut, a Linear
    head; no in-place op (Opacus's backward hooks forbid them on a module's output:
    ``nn.ReLU(inplace=True)`` or ``out += identity`` after a hooked layer raises, which
    fxdp runs as written, ``tests/models.py: ResNetCNN``)."""

    def __init__(self, width: int = 4, classes: int = 3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.GroupNorm(2, width), nn.ReLU())
        self.conv1 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(2, 2 * width)
        self.conv2 = nn.Conv2d(2 * width, 2 * width, 3, padding=1, groups=2)
        self.shortcut = nn.Conv2d(width, 2 * width, 1, stride=2)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        out = self.conv2(torch.relu(self.gn1(self.conv1(h)))) + self.shortcut(h)
        return self.head(torch.relu(out).mean((2, 3)))


class TextClassifier(nn.Module):
    """Embedding, LayerNorm, a Linear over the sequence, mean pool. No ``padding_idx``:
    Opacus's embedding per-sample gradient gives the padding row a gradient (PyTorch's
    and fxdp's is zero, ``test_rules_embedding.py``), so its norms would differ."""

    def __init__(self, vocab: int = 11, d: int = 8, classes: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(self.norm(self.emb(ids))))
        return self.head(h.mean(1))


class AudioNet(nn.Module):
    """Conv1d + InstanceNorm (affine) + Conv1d + GroupNorm, a Linear head."""

    def __init__(self, c: int = 4, classes: int = 3):
        super().__init__()
        self.conv1 = nn.Conv1d(2, c, 3, padding=1)
        self.inorm = nn.InstanceNorm1d(c, affine=True)
        self.conv2 = nn.Conv1d(c, 2 * c, 3, stride=2, dilation=2)
        self.gnorm = nn.GroupNorm(2, 2 * c)
        self.head = nn.Linear(2 * c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inorm(self.conv1(x)))
        h = torch.relu(self.gnorm(self.conv2(h)))
        return self.head(h.mean(-1))


def _cases():
    g = torch.Generator().manual_seed(0)
    return {
        "residual_cnn": (ResidualCNN, torch.randn(B, 3, 8, 8, generator=g)),
        "text_embedding": (TextClassifier, torch.randint(0, 11, (B, 7), generator=g)),
        "audio_conv1d_instancenorm": (AudioNet, torch.randn(B, 2, 20, generator=g)),
    }


CASES = _cases()


def _models(name: str):
    make, x = CASES[name]
    torch.manual_seed(0)
    model = make().double()
    x = x.double() if x.is_floating_point() else x
    y = torch.arange(B) % 3
    return model, x, y


def _cudnn_flags_settable():
    """Opacus's embedding per-sample gradient sets ``torch.backends.cudnn.deterministic``,
    which ``torch.testing._internal`` (imported by ``test_torch_suites.py`` in the same
    run) forbids outside PyTorch's own bracket for it (``flags()`` sets its values only
    on entry)."""
    return getattr(torch.backends, "__allow_nonbracketed_mutation")()


def _opacus_norms(model: nn.Module, x, y, loss_reduction: str) -> torch.Tensor:
    """Per-sample norms over all parameters from Opacus's hooks."""
    gsm = GradSampleModule(copy.deepcopy(model), loss_reduction=loss_reduction)
    with _cudnn_flags_settable():
        nn.functional.cross_entropy(gsm(x), y, reduction=loss_reduction).backward()
    flat = torch.cat([p.grad_sample.reshape(B, -1) for p in gsm.parameters() if p.requires_grad], 1)
    return flat.norm(dim=1)


def _opacus_step(model: nn.Module, x, y, loss_reduction: str, max_grad_norm: float) -> dict[str, torch.Tensor]:
    gsm = GradSampleModule(copy.deepcopy(model), loss_reduction=loss_reduction)
    optimizer = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.0), noise_multiplier=0.0,
                            max_grad_norm=max_grad_norm, expected_batch_size=B, loss_reduction=loss_reduction)
    optimizer.zero_grad()
    with _cudnn_flags_settable():
        nn.functional.cross_entropy(gsm(x), y, reduction=loss_reduction).backward()
    optimizer.pre_step()  # clip, sum, add (zero) noise, scale by the batch size for "mean"
    return {n.removeprefix("_module."): p.grad for n, p in gsm.named_parameters()}


def _opacus_ghost_step(model: nn.Module, x, y, loss_reduction: str, max_grad_norm: float):
    gsm = GradSampleModuleFastGradientClipping(copy.deepcopy(model), max_grad_norm=max_grad_norm,
                                               use_ghost_clipping=True, loss_reduction=loss_reduction)
    optimizer = DPOptimizerFastGradientClipping(
        torch.optim.SGD(gsm.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=max_grad_norm,
        expected_batch_size=B, loss_reduction=loss_reduction)
    criterion = DPLossFastGradientClipping(gsm, optimizer, nn.CrossEntropyLoss(reduction=loss_reduction),
                                           loss_reduction=loss_reduction)
    optimizer.zero_grad()
    with _cudnn_flags_settable():
        criterion(gsm(x), y).backward()  # the norms' backward, then the clipped one
    norms = torch.stack([p._norm_sample for p in gsm.parameters() if p.requires_grad]).norm(dim=0)
    optimizer.pre_step()
    return {n.removeprefix("_module."): p.grad for n, p in gsm.named_parameters()}, norms


def _fxdp_step(model: nn.Module, x, y, loss_reduction: str, max_grad_norm: float):
    torch._dynamo.reset()
    model = copy.deepcopy(model)
    dp = fxdp.transform(model, max_grad_norm=max_grad_norm, loss_reduction=loss_reduction, compiler="eager")
    nn.functional.cross_entropy(dp(x), y, reduction=loss_reduction).backward()
    return {n: p.grad for n, p in model.named_parameters()}, dp.per_sample_norms


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(CASES))
def test_clipped_gradient_matches_opacus_dp_optimizer(name: str, loss_reduction: str):
    model, x, y = _models(name)
    norms = _opacus_norms(model, x, y, loss_reduction)
    max_grad_norm = float(norms.median())  # some samples clipped, some not
    assert (norms > max_grad_norm).any() and (norms < max_grad_norm).any()

    expected = _opacus_step(model, x, y, loss_reduction, max_grad_norm)
    got, got_norms = _fxdp_step(model, x, y, loss_reduction, max_grad_norm)
    assert_close_all(got, expected, TOL, f"{name}, {loss_reduction}: p.grad against DPOptimizer")
    assert_close_all({"norms": got_norms}, {"norms": norms}, TOL, f"{name}: per-sample norms")


@pytest.mark.parametrize("name", list(CASES))
def test_clipped_gradient_matches_opacus_ghost_clipping(name: str):
    """Ghost clipping (two backwards in Opacus, one in fxdp) on the layers Opacus's
    ghost clipping supports."""
    model, x, y = _models(name)
    norms = _opacus_norms(model, x, y, "mean")
    max_grad_norm = float(norms.median())
    expected, ghost_norms = _opacus_ghost_step(model, x, y, "mean", max_grad_norm)
    got, got_norms = _fxdp_step(model, x, y, "mean", max_grad_norm)
    assert_close_all({"norms": ghost_norms}, {"norms": norms}, TOL, f"{name}: Opacus's own two norms")
    assert_close_all(got, expected, TOL, f"{name}: p.grad against Opacus ghost clipping")
    assert_close_all({"norms": got_norms}, {"norms": ghost_norms}, TOL, f"{name}: per-sample norms")
