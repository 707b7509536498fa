"""The ground truth: the microbatch loop (DESIGN.md, "Correctness ground truth").

For each sample ``i`` run the original model on the batch of one ``x[i:i+1]`` with
the same loss, call backward, read ``.grad``. Slow and obviously right.

One known exception, a PyTorch bug (torch 2.13, CPU): the backward of an eval-mode
BatchNorm on a batch of one whose incoming gradient is strided channels-last while its
input is not (``bn(x).flatten(2).transpose(1, 2)`` followed by a slice, a ``cat`` or a
``bmm``: CvT's, XCiT's patch embedding and lambda-networks' projections; LeViT's linear
and ``BatchNorm1d`` on a flattened view) gives wrong weight and bias gradients. The loop
inherits them; the batched backward (B > 1) is right. Compare such models with the
batched gradient and the formula ``Σ g·x̂`` instead.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

__all__ = ["microbatch_grads", "reference", "assert_close_all", "tolerance", "Reference"]


class Reference:
    """Per-sample gradients of a model, and everything the contract derives from them.

    Attributes:
        names: Trainable parameter names, in ``named_parameters`` order.
        per_sample: name -> ``[B, *p.shape]``, the gradient of sample i's own loss.
        norms: ``[B]`` total L2 norm over all trainable parameters.
    """

    def __init__(self, names: list[str], per_sample: dict[str, torch.Tensor], batch_size: int):
        self.names = names
        self.per_sample = per_sample
        self.batch_size = batch_size
        if names and batch_size:
            flat = torch.cat([per_sample[n].reshape(batch_size, -1) for n in names], dim=1)
            self.norms = flat.norm(dim=1)
        else:
            self.norms = torch.zeros(batch_size)

    def clip_factors(self, max_grad_norm: float) -> torch.Tensor:
        return (max_grad_norm / (self.norms + 1e-6)).clamp(max=1.0)

    def grad(self, loss_reduction: str = "mean", max_grad_norm: float | None = None) -> dict[str, torch.Tensor]:
        """``p.grad`` as the contract defines it."""
        scale = 1.0 / self.batch_size if loss_reduction == "mean" and self.batch_size else 1.0
        out = {}
        for n in self.names:
            g = self.per_sample[n]
            if max_grad_norm is not None:
                c = self.clip_factors(max_grad_norm).to(g.dtype)
                g = g * c.reshape(-1, *([1] * (g.dim() - 1)))
            out[n] = g.sum(0) * scale
        return out


def _slice_batch(a: Any, i: int, batch_size: int, dim: int) -> Any:
    if isinstance(a, torch.Tensor) and a.dim() > dim and a.shape[dim] == batch_size:
        return a.narrow(dim, i, 1)
    if isinstance(a, (list, tuple)):
        return type(a)(_slice_batch(x, i, batch_size, dim) for x in a)
    if isinstance(a, dict):
        return {k: _slice_batch(v, i, batch_size, dim) for k, v in a.items()}
    return a


def _narrow(a: Any, i: int, dim: int | None) -> Any:
    """Sample ``i`` of an argument batched at ``dim`` (every tensor inside a tuple)."""
    if dim is None:
        return a
    if isinstance(a, (list, tuple)):
        return type(a)(_narrow(x, i, dim) for x in a)
    return a.narrow(dim, i, 1) if isinstance(a, torch.Tensor) else a


def reference(model: nn.Module, args: Sequence[Any], loss_fn: Callable[..., torch.Tensor],
              *, batch_dim: int = 0, kwargs: dict | None = None,
              in_dims: Sequence[int | None] | Mapping[int | str, int | None] | None = None) -> Reference:
    """Per-sample gradients by the microbatch loop.

    Args:
        model: The original model (not changed: a deep copy runs).
        args: The batched forward arguments.
        loss_fn: ``loss_fn(output, i) -> scalar`` for sample ``i`` (a batch of one);
            it must reduce like the batched loss does for one sample.
        batch_dim: Where the batch is in batched arguments.
        in_dims: Per argument, batch dim or ``None`` (shared), overriding the size rule:
            a sequence for positional arguments, or a dict keyed by position or keyword.
    """
    kwargs = kwargs or {}
    first = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
    batch_size = first.shape[batch_dim]
    # Every sample starts from the model's state, on a copy of its own: a forward that
    # updates buffers (spectral norm's power iteration) or a Python-side cache
    # (rotary-embedding-torch's ``cached_freqs`` and the length they hold) must not carry
    # one sample's update into the next.
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    grads: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    given = dict(enumerate(in_dims)) if isinstance(in_dims, Sequence) else dict(in_dims or {})
    for i in range(batch_size):
        m = copy.deepcopy(model)
        # (a deep copy of torchvision's feature extractor re-runs its __init__, which sets
        # train mode: each module keeps the original's mode)
        for copied, original in zip(m.modules(), model.modules()):
            if copied.training != original.training:
                copied.train(original.training)  # (its own train() switches its graph)
        m.zero_grad(set_to_none=True)
        params = dict(m.named_parameters())
        one = [_narrow(a, i, given[k]) if k in given else _slice_batch(a, i, batch_size, batch_dim)
               for k, a in enumerate(args)]
        kw = {k: _narrow(v, i, given[k]) if k in given else _slice_batch(v, i, batch_size, batch_dim)
              for k, v in kwargs.items()}
        loss = loss_fn(m(*one, **kw), i)
        loss.backward()
        for n in names:
            g = params[n].grad
            if g is not None and g.is_sparse:  # Embedding(sparse=True)
                g = g.to_dense()
            grads[n].append(torch.zeros_like(params[n]) if g is None else g.detach().clone())
    shapes = dict(model.named_parameters())
    per_sample = {
        n: torch.stack(v) if v else torch.zeros(0, *shapes[n].shape, dtype=shapes[n].dtype)
        for n, v in grads.items()
    }
    return Reference(names, per_sample, batch_size)


microbatch_grads = reference


def tolerance(dtype: torch.dtype, conv: bool = False) -> float:
    if dtype == torch.float64:
        return 1e-9
    return 1e-3 if conv else 1e-4


def assert_close_all(got: dict[str, torch.Tensor | None], ref: dict[str, torch.Tensor], tol: float,
                     what: str = "") -> None:
    """``max |got − ref| ≤ tol · max |ref|``, both maxima over all parameters (``ref``'s
    finite values). A NaN or infinity in ``got`` where ``ref`` has none (or another) is
    an error of its own: the maxima would skip it."""
    assert set(got) == set(ref), f"{what}: parameters differ: {sorted(got)} vs {sorted(ref)}"
    scale = max((r[torch.isfinite(r)].abs().max().item() for r in ref.values() if torch.isfinite(r).any()),
                default=0.0)
    worst, where = 0.0, ""
    for n, r in ref.items():
        g = got[n]
        assert g is not None, f"{what}: {n} has no result"
        assert g.shape == r.shape, f"{what}: {n} shape {tuple(g.shape)} != {tuple(r.shape)}"
        if r.numel():
            g = g.detach().to(r.dtype)
            finite = torch.isfinite(r)
            assert torch.equal(torch.isfinite(g), finite) and torch.equal(g[~finite].isnan(), r[~finite].isnan()) \
                and torch.equal(g[~finite & ~r.isnan()], r[~finite & ~r.isnan()]), (
                    f"{what}: {n} has non-finite values where the reference has none, or other ones")
            err = (g[finite] - r[finite]).abs().max().item() if finite.any() else 0.0
            if err > worst:
                worst, where = err, n
    assert worst <= tol * max(scale, 1e-30), (
        f"{what}: max error {worst:.3g} at {where} > {tol:g} x max|ref| {scale:.3g}")
