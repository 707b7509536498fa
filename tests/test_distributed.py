"""Data-parallel training: ``DistributedDataParallel`` around a transformed model.

Each rank clips its own samples' gradients in its fxdp backward; DDP then averages the
ranks' ``p.grad`` (its reducer hooks fire on the accumulated, already clipped
gradient). With ``loss_reduction="mean"`` and equal shards the average is the mean of
every sample's clipped gradient, which the microbatch loop over the whole batch gives.
Two processes on the CPU (gloo), for both ways of combining them: DDP around
``fxdp.transform(model)``, and ``torch.compile(DDP(model), backend=fxdp.backend(...))``.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fxdp
from reference import assert_close_all, reference

WORLD = 2
B, D = 8, 6
WIDE = {"width": 256, "depth": 5}  # float64 Linear(256, 256)s of 0.5 MB: DDP's 1 MB buckets split it


class _Net(nn.Module):
    """A model class of the user's own: Dynamo compiles its forward under DDP's, which it
    skips. ``_library_model`` gives the same layers as one ``nn.Sequential``, whose
    ``forward`` is ``torch.nn``'s own code."""

    def __init__(self, width: int = 16, depth: int = 1):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D, width), nn.Tanh(),
                                  *[nn.Linear(width, width) for _ in range(depth)], nn.LayerNorm(width))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _model(**sizes: int) -> nn.Module:
    torch.manual_seed(0)
    return _Net(**sizes).double()


def _library_model(model: _Net) -> nn.Sequential:
    """``model``'s layers (the same parameters) as one ``torch.nn`` module."""
    return nn.Sequential(*model.body, model.head)


def _wrap(model: nn.Module, clip: float, how: str, bucket_view: bool = False) -> nn.Module:
    if how == "transform":
        return DistributedDataParallel(fxdp.transform(model, max_grad_norm=clip, compiler="eager"),
                                       gradient_as_bucket_view=bucket_view)
    if how == "backend-torch.nn":
        # Dynamo skips DDP's forward and torch.nn's: without fxdp's hook this compiled
        # nothing and trained unclipped.
        model = _library_model(model)
    return torch.compile(DistributedDataParallel(model, gradient_as_bucket_view=bucket_view),
                         backend=fxdp.backend(max_grad_norm=clip, compiler="eager"))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, D, generator=g, dtype=torch.float64), torch.randint(0, 3, (B,), generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y, reduction="none")


def _step(rank: int, ddp: nn.Module) -> None:
    x, y = _data()
    shard = slice(rank * B // WORLD, (rank + 1) * B // WORLD)
    _loss(ddp(x[shard]), y[shard]).mean().backward()


def _save(model: nn.Module, path: str, **extra) -> None:
    torch.save({"grads": {n: p.grad for n, p in model.named_parameters()},
                "norms": fxdp.per_sample_norms(model), **extra}, path)


def _rank(rank: int, init_file: str, clip: float, out_dir: str, how: str, sizes: dict,
          bucket_view: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        model = _model(**sizes)
        _step(rank, _wrap(model, clip, how, bucket_view))
        _save(model, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _rank_buckets(rank: int, init_file: str, clip: float, out_dir: str) -> None:
    """A model larger than DDP's buckets: Dynamo's DDPOptimizer splits the graph at bucket
    boundaries, which fxdp refuses under clipping; without it, one graph."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        model = _model(**WIDE)
        backend = fxdp.backend(max_grad_norm=clip, compiler="eager")
        try:
            _step(rank, torch.compile(DistributedDataParallel(model, bucket_cap_mb=1), backend=backend))
            error = None
        except Exception as e:  # noqa: BLE001 (the message is what the test checks)
            error = f"{type(e).__name__}: {e}"
        untouched = all(p.grad is None for p in model.parameters())
        torch._dynamo.reset()
        with torch._dynamo.config.patch(optimize_ddp=False):
            _step(rank, torch.compile(DistributedDataParallel(model, bucket_cap_mb=1), backend=backend))
        _save(model, os.path.join(out_dir, f"{rank}.pt"), error=error, untouched=untouched)
    finally:
        dist.destroy_process_group()


# transform on a model DDP's buckets would split (it compiles with optimize_ddp off); the
# backend on one that fits DDP's first bucket (the split is the next test's). With
# gradient_as_bucket_view DDP replaces each p.grad by a view of its bucket as it arrives:
# fxdp's check of the gradients it handed takes such a p.grad as DDP's.
@pytest.mark.parametrize("how,sizes,bucket_view", [
    ("transform", WIDE, False), ("backend", {}, False), ("backend-torch.nn", {}, False),
    ("transform", WIDE, True), ("backend", {}, True),
], ids=["transform", "backend", "backend-torch.nn", "transform-bucket-view", "backend-bucket-view"])
def test_ddp_averages_the_ranks_clipped_gradients(how, sizes, bucket_view):
    model = _model(**sizes)
    x, y = _data()
    ref = reference(model, (x,), lambda out, i: _loss(out, y[i:i + 1]).sum())
    clip = float(ref.norms.median())
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(os.path.join(tmp, "init"), clip, tmp, how, sizes, bucket_view), nprocs=WORLD,
                 join=True)
        results = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(WORLD)]
    for r in results:
        assert_close_all(r["grads"], ref.grad("mean", clip), 1e-9, "averaged clipped p.grad")
    norms = torch.cat([r["norms"] for r in results])
    torch.testing.assert_close(norms, ref.norms, rtol=1e-9, atol=0)


def test_ddp_optimizer_graph_split_raises_and_one_graph_clips():
    model = _model(**WIDE)
    x, y = _data()
    ref = reference(model, (x,), lambda out, i: _loss(out, y[i:i + 1]).sum())
    clip = float(ref.norms.median())
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_buckets, args=(os.path.join(tmp, "init"), clip, tmp), nprocs=WORLD, join=True)
        results = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(WORLD)]
    for r in results:
        assert r["error"] is not None and "cannot clip globally across the graphs" in r["error"]
        assert "optimize_ddp = False" in r["error"], r["error"]
        assert r["untouched"], "no unclipped gradient left behind"
        assert_close_all(r["grads"], ref.grad("mean", clip), 1e-9, "averaged clipped p.grad")
    torch.testing.assert_close(torch.cat([r["norms"] for r in results]), ref.norms, rtol=1e-9, atol=0)


class _WithTemperature(_Net):
    """A temperature the forward does not use, for the loss to divide by."""

    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(2.0))


def _rank_temperature(rank: int, init_file: str, out_dir: str, bucket_view: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _WithTemperature().double()
    ddp = DistributedDataParallel(fxdp.transform(model, max_grad_norm=1.0, compiler="eager"),
                                  gradient_as_bucket_view=bucket_view)
    x, y = _data()
    shard = slice(rank * B // WORLD, (rank + 1) * B // WORLD)
    out = ddp(x[shard])
    try:
        _loss(out / model.temperature, y[shard]).mean().backward()
        error = None
    except Exception as e:  # noqa: BLE001 (the message is what the test checks)
        error = f"{type(e).__name__}: {e}"
    torch.save({"error": error}, os.path.join(out_dir, f"{rank}.pt"))
    # Freed, DDP's reducer would wait for the all-reduce the raising backward left unfinished
    os._exit(0)


@pytest.mark.parametrize("bucket_view", [False, True], ids=["grad", "bucket-view"])
def test_ddp_a_temperature_in_the_loss_raises_on_every_rank(bucket_view):
    """The check that a parameter the forward gives no gradient gets none runs before
    DDP's finalisation: with ``gradient_as_bucket_view`` the temperature's ``p.grad`` is by
    then a view of DDP's bucket holding this rank's unclipped gradient, which raises too."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_temperature, args=(os.path.join(tmp, "init"), tmp, bucket_view), nprocs=WORLD, join=True)
        results = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(WORLD)]
    for r in results:
        assert r["error"] is not None and "p.grad of 'temperature' got a gradient" in r["error"], r["error"]

