"""Batches of different sizes per sample laid end to end (``Packed`` in
``fxdp/batching.py``): torchdiffeq packs a tuple state ``(z [B, D], logp [B, 1])`` into
one vector, ``torch.cat([z.reshape(-1), logp.reshape(-1)])``, steps it with a solver and
slices it back, ``flat[..., :B * D].view(B, D)``; FFJORD's continuous normalising flow
integrates its log-density so. Here: that solver, written as torchdiffeq writes it (the
solution ``torch.empty(len(t), *y0.shape)`` filled row by row), at ``len(t) == B`` (a
static compile's coincidence of sizes) and at other batch sizes on one transform, under
Inductor too; splits, stacks and several blocks; and the refusals of what reads across
the blocks.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxdp
from expect import refused
from reference import assert_close_all, reference, tolerance

D = 3


def _flat_to_shape(tensor, length, shapes):
    """torchdiffeq's ``misc._flat_to_shape``."""
    out, total = [], 0
    for shape in shapes:
        n = shape.numel()
        out.append(tensor[..., total:total + n].view((*length, *shape)))
        total += n
    return tuple(out)


def odeint(func, y0s: tuple, t: torch.Tensor, method: str = "euler") -> tuple:
    """torchdiffeq's ``odeint`` on a tuple state with a fixed-grid solver: the state
    packed into one vector, the solution written into ``empty(len(t), *y0.shape)``."""
    shapes = [y.shape for y in y0s]
    y0 = torch.cat([y.reshape(-1) for y in y0s])

    def f(s, y):
        return torch.cat([g.reshape(-1) for g in func(s, _flat_to_shape(y, (), shapes))])

    solution = torch.empty(len(t), *y0.shape, dtype=y0.dtype, device=y0.device)
    solution[0] = y0
    y = y0
    for j in range(1, len(t)):
        dt = t[j] - t[j - 1]
        if method == "euler":
            y = y + dt * f(t[j - 1], y)
        else:  # rk4, its stages stacked as torchdiffeq's rk_common stacks them
            k1 = f(t[j - 1], y)
            k2 = f(t[j - 1] + dt / 2, y + dt / 2 * k1)
            k3 = f(t[j - 1] + dt / 2, y + dt / 2 * k2)
            k4 = f(t[j], y + dt * k3)
            y = y + dt / 6 * (torch.stack([k1, k2, k3, k4]) * torch.tensor([1.0, 2.0, 2.0, 1.0])[:, None]).sum(0)
        solution[j] = y
    return _flat_to_shape(solution, (len(t),), shapes)


class CNF(nn.Module):
    """A continuous normalising flow with its log-density change in the state (FFJORD,
    with the exact trace of a one-layer field)."""

    def __init__(self, steps: int = 2, method: str = "euler"):
        super().__init__()
        self.field = nn.Linear(D, D)
        self.t = torch.linspace(0.0, 1.0, steps + 1)
        self.method = method

    def dynamics(self, t, state):
        z, _ = state
        dz = torch.tanh(self.field(z))
        trace = ((1 - dz ** 2) * self.field.weight.diagonal()).sum(-1, keepdim=True)
        return dz, -trace

    def forward(self, x):  # [B, D] -> log p(x) [B]
        zs, logps = odeint(self.dynamics, (x, x.new_zeros(x.shape[0], 1)), self.t, self.method)
        return -0.5 * (zs[-1] ** 2).sum(-1) - logps[-1, :, 0]


def _exact(model: nn.Module, x: torch.Tensor, dp: fxdp.DPModule | None = None, **options) -> fxdp.DPModule:
    """``grad_sample``, norms and the clipped sum of a ``loss_reduction="sum"`` step
    against the microbatch loop (each sample's loss: minus its log-density)."""
    ref = reference(model, (x,), lambda out, i: -out.sum())
    if dp is None:
        torch._dynamo.reset()
        options = {"compiler": "eager", **options}
        dp = fxdp.transform(model, grad_sample=True, max_grad_norm=float(ref.norms.median()), loss_reduction="sum",
                            **options)
    model.zero_grad(set_to_none=True)
    (-dp(x).sum()).backward()
    tol = tolerance(torch.float64)
    params = dict(model.named_parameters())
    assert_close_all({n: p.grad_sample for n, p in params.items()}, ref.per_sample, tol, "grad_sample")
    assert_close_all({"norms": dp.per_sample_norms}, {"norms": ref.norms}, tol, "norms")
    assert_close_all({n: p.grad for n, p in params.items()}, ref.grad("sum", dp.options.max_grad_norm), tol, "clipped")
    return dp


@pytest.mark.parametrize("method", ["euler", "rk4"])
@pytest.mark.parametrize("batch_size", [3, 4], ids=["B-equals-len-t", "B"])
def test_a_tuple_state_packed_by_the_solver(method: str, batch_size: int):
    """Refused before ("it concatenates along the batch dim (tensors not batched alike …)");
    at ``B == len(t) == 3`` the solution ``empty(3, 4 * B)`` was read batched along its
    first dim, and only read shared beside the batched ``zeros(B, 1)`` does it pass."""
    torch.manual_seed(0)
    model = CNF(method=method).double()
    dp = _exact(model, torch.randn(batch_size, D, dtype=torch.float64))
    _exact(model, torch.randn(batch_size + 2, D, dtype=torch.float64), dp=dp)


def test_a_tuple_state_packed_by_the_solver_under_inductor():
    torch.manual_seed(0)
    model = CNF().double()
    dp = _exact(model, torch.randn(3, D, dtype=torch.float64), compiler="inductor")
    _exact(model, torch.randn(5, D, dtype=torch.float64), dp=dp)


class Pieces(nn.Module):
    """Three blocks (``[B, T, D]``, ``[B]``, ``[B, D]``) packed along dim 0, stepped, and
    taken back by ``split``, by slices of two whole blocks, or through a stack."""

    def __init__(self, back: str):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.back = back

    def forward(self, x):  # [B, T, D]
        B, T = x.shape[:2]
        h = self.lin(x)
        flat = torch.cat([h.reshape(-1), h.sum((1, 2)), x[:, 0].reshape(-1)])
        flat = flat + 0.5 * torch.sin(flat)
        if self.back == "stack":
            both = torch.stack([flat, flat * 2], 1)  # [N, 2]: packed along dim 0 still
            flat = (both * torch.tensor([1.0, -0.25])).sum(1)
        if self.back == "split":
            seq, total, first = flat.split([B * T * D, B, B * D])
        else:
            pair = flat[B * T * D:]  # the last two blocks
            seq, total, first = flat[:B * T * D], pair[:B], pair[B:]
        return self.lin(seq.view(B, T, D)).sum((1, 2)) * total + first.view(B, D).pow(2).sum(1)


@pytest.mark.parametrize("back", ["split", "slices", "stack"])
def test_blocks_packed_then_split_or_sliced_back(back: str):
    torch.manual_seed(0)
    model = Pieces(back).double()
    dp = _exact(model, torch.randn(3, 2, D, dtype=torch.float64))
    _exact(model, torch.randn(4, 2, D, dtype=torch.float64), dp=dp)


class ReadsAcross(nn.Module):
    """A packed state read in a way that mixes its samples' elements."""

    def __init__(self, misuse: str):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.misuse = misuse

    def forward(self, x):  # [B, D]
        B = x.shape[0]
        flat = torch.cat([self.lin(x).reshape(-1), x[:, :1].reshape(-1)])
        if self.misuse == "part of a block":
            return flat[:B * D - 1].sum() + flat.sum()
        if self.misuse == "viewed by the batch":
            return flat.view(B, -1).sum(1)
        if self.misuse == "flipped":
            flat = flat.flip(0)
        if self.misuse == "cumulative":
            flat = flat.cumsum(0)
        if self.misuse == "positions":
            flat = flat * torch.arange(flat.shape[0], dtype=x.dtype)
        if self.misuse == "returned":
            return flat
        if self.misuse == "a parameter":
            flat = flat * self.scale
        if self.misuse == "a shared piece":
            flat = torch.cat([flat, torch.ones(2, dtype=x.dtype)])
        return (flat[:B * D].view(B, D) ** 2).sum(-1) + flat[B * D:B * D + B]


@pytest.mark.parametrize("misuse, match", [
    ("part of a block", "reads across batches of different sizes per sample laid end to end"),
    ("viewed by the batch", "reads across batches of different sizes"),
    ("flipped", "reads across batches of different sizes"),
    ("cumulative", "reads across batches of different sizes"),
    ("positions", "a shared tensor whose values vary along the batch dim"),
    ("returned", "returned by the forward, the pieces leave the loss outside"),
    ("a parameter", "use it on the pieces sliced back"),
    ("a shared piece", "concatenates a shared tensor along the batch dim"),
])
def test_reading_across_the_blocks_is_refused(misuse: str, match: str):
    model = ReadsAcross(misuse).double()
    with refused(match):
        fxdp.transform(model, max_grad_norm=1.0, compiler="eager")(torch.randn(3, D, dtype=torch.float64))
