"""Data-parallel training: ``DistributedDataParallel`` around a transformed model.

Each rank clips its own samples' gradients in its fxdp backward; DDP then averages the
ranks' ``p.grad`` (its reducer hooks fire on the accumulated, already clipped
gradient). With ``loss_reduction="mean"`` and equal shards the average is the mean of
every sample's clipped gradient, which the microbatch loop over the whole batch gives.
Two processes on the CPU (gloo).
"""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fxdp
from reference import assert_close_all, reference

WORLD = 2
B, D = 8, 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 16), nn.Tanh(), nn.Linear(16, 16), nn.LayerNorm(16),
                         nn.Linear(16, 3)).double()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, D, generator=g, dtype=torch.float64), torch.randint(0, 3, (B,), generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y, reduction="none")


def _rank(rank: int, init_file: str, clip: float, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        model = _model()
        ddp = DistributedDataParallel(fxdp.transform(model, max_grad_norm=clip, compiler="eager"))
        x, y = _data()
        shard = slice(rank * B // WORLD, (rank + 1) * B // WORLD)
        _loss(ddp(x[shard]), y[shard]).mean().backward()
        torch.save({"grads": {n: p.grad for n, p in model.named_parameters()},
                    "norms": fxdp.per_sample_norms(model)}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ddp_averages_the_ranks_clipped_gradients():
    model = _model()
    x, y = _data()
    ref = reference(model, (x,), lambda out, i: _loss(out, y[i:i + 1]).sum())
    clip = float(ref.norms.median())
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(os.path.join(tmp, "init"), clip, tmp), nprocs=WORLD, join=True)
        results = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(WORLD)]
    for r in results:
        assert_close_all(r["grads"], ref.grad("mean", clip), 1e-9, "averaged clipped p.grad")
    norms = torch.cat([r["norms"] for r in results])
    torch.testing.assert_close(norms, ref.norms, rtol=1e-9, atol=0)
