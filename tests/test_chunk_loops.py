"""Loops over chunks of the batch, concatenated again, and loops over the samples,
stacked again (``passes/chunk_loops.py``).

Each accepted model is checked against the microbatch loop (float64, ``grad_sample``
and the clipped gradient) at two batch sizes on one transform: ``B = 5`` splits into
unequal chunks (3 + 2, the sizes that count the chunk's rows differ between the
copies), ``B = 4`` into equal ones (a loop over the samples has 5, then 4 copies).
The forward's output must equal the plain model's.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import fxdp
import fxdp.compiler
from fxdp.errors import UnsupportedError
from reference import assert_close_all, reference, tolerance

DTYPE = torch.float64

# An op without a vmap batching rule (nor an fxdp rule: the loop is all that sees it).
_LIB = torch.library.Library("fxdp_test_chunk_loops", "DEF")
_LIB.define("twice(Tensor x) -> Tensor")
_LIB.impl("twice", lambda x: x * 2, "CPU")
_LIB.impl("twice", lambda x: torch.empty_like(x), "Meta")


class ChunkLoops(nn.Module):
    """A Linear, then one kind of loop over chunks of its output."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(4, 4)
        # only the layers the loop uses: a parameter no loss reaches gets no grad_sample
        if kind == "ghost batch norm (eval)":
            self.norm = nn.BatchNorm1d(4)
        elif kind == "attention over heads merged into the batch":
            self.query = nn.Linear(4, 8)
        elif kind not in ("mixes the chunk's rows", "reads the whole batch"):
            self.head = nn.Linear(4, 3)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, mask=None):
        h = self.fc(x)
        kind = self.kind
        if kind == "chunk":
            return torch.cat([self.head(c).relu() for c in h.chunk(2)])
        if kind == "ghost batch norm (eval)":  # pytorch-tabnet's GBN with a virtual batch of 2
            chunks = h.chunk(int(math.ceil(h.shape[0] / 2)), 0)
            return torch.cat([self.norm(c.transpose(1, 2)).transpose(1, 2) for c in chunks])
        if kind == "two loops, one after the other":  # TabNet's ghost BatchNorm in every layer
            h = torch.cat([self.head(c).tanh() for c in h.chunk(2)])
            return torch.cat([c * 2 + 1 for c in h.split(2)])
        if kind == "rows":
            return torch.cat([self.head(h[i:i + 1]) for i in range(h.shape[0])])
        if kind == "sizes of the chunk":
            return torch.cat([self.head(c.reshape(-1, 4)).reshape(c.shape[0], 6, 3) for c in h.split(3)])
        if kind == "two tensors chunked alike":
            return torch.cat([self.head(c) * m for c, m in zip(h.chunk(2), mask.chunk(2))])
        if kind == "batch second":
            t = h.transpose(0, 1)
            return torch.cat([self.head(c) for c in t.chunk(2, 1)], 1).transpose(0, 1)
        if kind == "attention over heads merged into the batch":  # reformer's attn_chunks
            b, t, _ = h.shape
            q = self.query(h).view(b, t, 2, 4).transpose(1, 2).reshape(b * 2, t, 4)
            out = torch.cat([torch.softmax(c @ c.transpose(1, 2), -1) @ c for c in q.chunk(2, 0)])
            return out.view(b, 2, t, 4)
        if kind == "vmap with chunk_size":
            return torch.func.vmap(lambda row: self.head(row).tanh(), chunk_size=2)(h)
        if kind == "rows of the samples merged":  # reformer's chunked_sum
            flat = self.head(h).reshape(-1, 3)
            return torch.cat([c.sum(-1) for c in flat.chunk(2, 0)]).reshape(h.shape[:2])
        if kind == "two results of each chunk":  # reformer's attention with attn_chunks > 1: output and buckets
            outs, buckets = [], []
            for c in h.chunk(2):
                q = self.head(c)
                outs.append(q.tanh())
                buckets.append(q.argmax(-1))
            return torch.cat(outs) * torch.cat(buckets)[..., None]
        if kind == "positions expanded to the chunk's rows":  # reformer's LSH ticker.expand_as(buckets)
            outs = []
            for c in h.chunk(2):
                q = self.head(c)
                positions = torch.arange(c.shape[1]).expand(c.shape[0], -1)  # gathered: the expand stays
                outs.append(q * positions.gather(1, q.sum(-1).argsort(-1))[..., None].to(q.dtype))
            return torch.cat(outs)
        if kind == "mixes the chunk's rows":
            return torch.cat([c - c.mean(0, keepdim=True) for c in h.chunk(2)])
        if kind == "random draw":
            return torch.cat([self.drop(self.head(c)) for c in h.chunk(2)])
        if kind == "reads the whole batch":
            return torch.cat([c + h.sum(0, keepdim=True) for c in h.chunk(2)])
        if kind == "a chunk's result read elsewhere":
            outs = [self.head(c) for c in h.chunk(2)]
            return torch.cat(outs) + outs[0].sum()
        # loops over the samples: each copy sees one sample without the batch dim
        if kind == "a function of each sample, stacked":
            return torch.stack([self.head(row).tanh().sum(0) for row in h])
        if kind == "attention within each sample, unbound":
            outs = []
            for q in map(self.head, h.unbind(0)):
                outs.append(torch.softmax(q @ q.T, -1) @ q)
            return torch.stack(outs)
        if kind == "samples stacked along dim 1":
            return torch.stack([self.head(h[i]) for i in range(h.shape[0])], 1).transpose(0, 1)
        if kind == "two tensors indexed alike":
            return torch.stack([self.head(h[i]) * mask[i] for i in range(h.shape[0])])
        if kind == "samples unsqueezed and concatenated":
            return torch.cat([self.head(h[i])[None] for i in range(h.shape[0])])
        if kind == "two results of each sample":  # mapped once for each stack
            queries, keys = [], []
            for row in h:
                q = self.head(row)
                queries.append(q.tanh())
                keys.append(q.sin())
            return torch.stack(queries) * torch.stack(keys)
        if kind == "a sample's result read elsewhere":
            outs = [self.head(row) for row in h]
            return torch.stack(outs) + outs[0].sum()
        if kind == "random draw in each sample":
            return torch.stack([self.drop(self.head(row)) for row in h])
        if kind == "each sample reads the whole batch":
            return torch.stack([self.head(row + h.sum(0)) for row in h])
        if kind == "a linear solve in each sample":  # a shared [3, 3] against each sample's [6, 3, 1]
            a = 2 * torch.eye(3, dtype=h.dtype) + 0.1
            return torch.stack([torch.linalg.solve(a, self.head(row)[..., None]) for row in h])
        if kind == "an op without a batching rule":
            return torch.stack([self.head(torch.ops.fxdp_test_chunk_loops.twice(row)) for row in h])
        if kind == "a row with its dim beside one without":  # segment-anything's Sam.forward: image x[i], prompts [i:i + 1]
            return torch.cat([self.head(h[i]).unsqueeze(0) * mask[i:i + 1] for i in range(h.shape[0])])
        if kind == "rows with their dim, taken out again":
            return torch.stack([(self.head(h[i:i + 1]) - self.head(h[i:i + 1]).mean(1, keepdim=True))[0]
                                for i in range(h.shape[0])])
        if kind == "a write in place in each sample":  # segment-anything's coordinates: clone, a column scaled (canonicalised)
            outs = []
            for i in range(h.shape[0]):
                row = h[i].clone()
                row[:, 0] = row[:, 0] / 7
                outs.append(self.head(row))
            return torch.stack(outs)
        if kind == "a write in place in each sample, seen through an earlier view":
            outs = []
            for i in range(h.shape[0]):
                row = h[i].clone()
                flat = row.view(-1)  # shows the write below: no data flow
                row[:, 0] = row[:, 0] / 7
                outs.append(self.head(flat.view(row.shape)))
            return torch.stack(outs)
        if kind == "a column scaled in place by a number in each sample":  # a functional write (canonicalised)
            outs = []
            for i in range(h.shape[0]):
                row = h[i].clone()
                row[:, 0].div_(7)
                outs.append(self.head(row).sum(0))
            return torch.stack(outs)
        if kind == "rows written into a preallocated output":  # out = zeros(B, ...); out[i] = f(x[i])
            out = torch.zeros(h.shape[0], 6, 3, dtype=h.dtype)
            for i in range(h.shape[0]):
                out[i] = self.head(h[i]).tanh()
            return out
        if kind == "a number of each sample written into its row":  # out[i] = t of a 0-d t: fill_
            out = torch.zeros(h.shape[0], 3, dtype=h.dtype)
            for i in range(h.shape[0]):
                out[i] = self.head(h[i]).pow(2).sum()
            return out
        if kind == "rows written into an empty output, last first":
            out = h.new_empty(h.shape[0], 3)
            for i in reversed(range(h.shape[0])):
                out[i] = self.head(h[i]).sum(0)
            return out
        if kind == "a masked add of a parameter in each sample":  # segment-anything's point embedding, per image
            outs = []
            for i in range(h.shape[0]):
                row = self.head(h[i:i + 1])
                row[h[i:i + 1, :, 1] > 0] = 0.0  # a constant each copy lifts on its own
                row[h[i:i + 1, :, 0] > 0] += self.head.bias.view(1, -1)
                outs.append(row)
            return torch.cat(outs)
        if kind == "samples stacked out of order":
            return torch.stack([self.head(h[i]) for i in reversed(range(h.shape[0]))])
        raise ValueError(kind)


def _inputs(kind: str, batch_size: int) -> tuple:
    g = torch.Generator().manual_seed(batch_size)
    x = torch.randn(batch_size, 6, 4, generator=g, dtype=DTYPE)
    if kind in ("two tensors chunked alike", "two tensors indexed alike", "a row with its dim beside one without"):
        return x, torch.rand(batch_size, 6, 1, generator=g, dtype=DTYPE)
    return (x,)


def _per_sample_loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).flatten(1).sum(1)


@pytest.mark.parametrize("kind", [
    "chunk", "ghost batch norm (eval)", "two loops, one after the other", "rows", "sizes of the chunk", "two tensors chunked alike", "batch second",
    "attention over heads merged into the batch", "rows of the samples merged", "vmap with chunk_size",
    "a function of each sample, stacked", "attention within each sample, unbound", "samples stacked along dim 1",
    "two tensors indexed alike", "samples unsqueezed and concatenated", "two results of each sample",
    "two results of each chunk", "positions expanded to the chunk's rows", "a linear solve in each sample",
    "a row with its dim beside one without", "rows with their dim, taken out again",
    "a column scaled in place by a number in each sample", "a write in place in each sample",
    "rows written into a preallocated output", "rows written into an empty output, last first",
    "a number of each sample written into its row",
    "a masked add of a parameter in each sample",
])
def test_a_loop_over_chunks_of_the_batch_is_per_sample(kind):
    torch.manual_seed(0)
    model = ChunkLoops(kind).to(DTYPE).train(kind != "ghost batch norm (eval)")
    plain = copy.deepcopy(model)
    dp_model = fxdp.transform(model, grad_sample=True, max_grad_norm=0.5, compiler="eager")
    tol = tolerance(DTYPE)
    for batch_size in (5, 4):
        args = _inputs(kind, batch_size)
        ref = reference(copy.deepcopy(plain), args, lambda out, i: _per_sample_loss(out).sum())
        model.zero_grad(set_to_none=True)
        out = dp_model(*args)
        torch.testing.assert_close(out, plain(*args), rtol=tol, atol=tol)
        _per_sample_loss(out).mean().backward()
        assert_close_all({n: p.grad_sample for n, p in model.named_parameters()},
                         ref.per_sample, tol, f"grad_sample at B = {batch_size}")
        assert_close_all({n: p.grad for n, p in model.named_parameters()},
                         ref.grad("mean", 0.5), tol, f"clipped grad at B = {batch_size}")


@pytest.mark.parametrize("kind", [
    "mixes the chunk's rows",  # each chunk's mean: the samples of a chunk share it
    "random draw",  # one draw on the whole batch is not the chunks' draws
    "reads the whole batch",
    "a chunk's result read elsewhere",
])
def test_a_loop_over_chunks_that_is_not_the_loop_over_the_whole_batch_is_refused(kind):
    """A body that mixes a chunk's rows is named with the op that does (since the
    sixty-second session: TabNet's ghost BatchNorm in training was refused at its chunk
    alone)."""
    torch.manual_seed(0)
    model = ChunkLoops(kind).to(DTYPE)
    dp_model = fxdp.transform(model, grad_sample=True, compiler="eager")
    with pytest.raises(UnsupportedError, match=r"it splits the batch dim \(a loop over chunks .* keeps each "
                                               r"chunk's rows apart, draws no random numbers.*torch\.func\.vmap\(f\)") as info:
        dp_model(*_inputs(kind, 4))
    named = "could not run as f on the whole batch: f must keep the rows of its chunk apart, and in f, aten.mean"
    assert (named in str(info.value)) == (kind == "mixes the chunk's rows"), str(info.value)


@pytest.mark.parametrize("kind, reason", [
    ("random draw in each sample", "uses a parameter on the values of one sample"),
    ("each sample reads the whole batch", "it reduces over the batch dim"),
    ("samples stacked out of order", "uses a parameter on the values of one sample"),
    # (its row of the mapped stack since the sixty-first session: one sample's piece beside the batch)
    ("a sample's result read elsewhere", "combines the values of one sample taken out of the batch"),
    ("an op without a batching rule", "uses a parameter on the values of one sample"),  # vmap's loop turned off
    # the write is no input of the ops after it: mapped, the copy would leave it out (wrong before)
    ("a write in place in each sample, seen through an earlier view", "uses a parameter on the values of one sample"),
])
def test_a_loop_over_the_samples_that_is_not_a_map_over_the_batch_is_refused(kind, reason):
    torch.manual_seed(0)
    model = ChunkLoops(kind).to(DTYPE)
    dp_model = fxdp.transform(model, grad_sample=True, compiler="eager")
    with pytest.raises(UnsupportedError, match=reason + r".*runs as torch\.func\.vmap\(f\) where f draws no random"
                       if "parameter" in reason else reason):
        dp_model(*_inputs(kind, 4))


class TilePositions(nn.Module):
    """torchtune's tile position embedding: a table sliced by each image's tile grid
    (``aspect_ratio[i]``, read from the data) in a loop over the samples."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.table = nn.Parameter(torch.randn(2, 2, 1, d))
        self.lin = nn.Linear(d, d)

    def forward(self, x, aspect_ratio):  # x [B, tiles, tokens, d], aspect_ratio [B, 2]
        x = self.lin(x)
        out = []
        for i, (h, w) in enumerate(aspect_ratio):
            n = int(h * w)
            out.append(torch.cat([x[i, :n] + self.table[:h, :w].reshape(n, 1, x.shape[-1]), x[i, n:]]))
        return torch.stack(out)


def test_a_parameter_sliced_by_one_samples_values_is_refused_with_what_to_do():
    problems = fxdp.validate(TilePositions().to(DTYPE), torch.randn(3, 4, 2, 4, dtype=DTYPE),
                             torch.tensor([[1, 2], [2, 2], [1, 1]]))
    assert problems and all("slices a parameter by sizes or positions read from one sample's values" in p.reason
                            and "table[rows, cols] * valid" in p.reason for p in problems), problems


def test_the_loop_becomes_one_call_on_the_whole_batch(monkeypatch):
    """The canonical graph after the pass: the copies of the loop's body are gone and
    the body runs once on the Linear's output (pinned as code)."""
    seen = {}
    tag_pass = fxdp.compiler.tag_pass

    def tag(gm, *args, **kwargs):
        seen["code"] = gm.code
        return tag_pass(gm, *args, **kwargs)

    monkeypatch.setattr(fxdp.compiler, "tag_pass", tag)
    model = ChunkLoops("chunk").to(DTYPE)
    dp_model = fxdp.transform(model, grad_sample=True, compiler="eager")
    _per_sample_loss(dp_model(*_inputs("chunk", 4))).mean().backward()
    body = [line.split("=", 1)[1].split(";")[0].strip() for line in seen["code"].splitlines()
            if "torch.ops.aten" in line]
    assert body == [
        "torch.ops.aten.linear.default(arg2_1, arg0_1, arg1_1)",
        "torch.ops.aten.linear.default(linear, arg3_1, arg4_1)",
        "torch.ops.aten.relu.default(linear_3)",
    ], seen["code"]


class PositionedPieces(nn.Module):
    """A Linear, parameter-free code on each sample's piece of its output, the pieces
    put back together as a batch, and a second Linear: a batch again only where every
    sample's piece is computed by the same code (alone, every sample is the first)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h, kind, rows = self.fc(x), self.kind, range(x.shape[0])
        if kind == "scaled by the position":
            h = torch.stack([h[i] * (i + 1) for i in rows])
        elif kind == "the first sample's own code":
            h = torch.cat([h[:1].tanh()] + [h[i:i + 1].exp() for i in rows if i])
        elif kind == "another tensor's rows at some positions":
            g = h.sin()
            h = torch.cat([h[i:i + 1] if i % 2 else g[i:i + 1] for i in rows])
        elif kind == "rows of a shared table at each position":
            table = torch.arange(4.0 * x.shape[0], dtype=x.dtype).view(x.shape[0], 4)
            h = torch.stack([h[i] * table[i] for i in rows])
        elif kind in ("written by the position", "written by the same code"):
            out = torch.zeros_like(h)
            for i in rows:
                out[i] = h[i] * (i + 2 if kind == "written by the position" else 2)
            h = out
        elif kind in ("rewritten in place by the position", "rewritten in place by the same code"):
            h = h.clone()
            for i in rows:
                h[i] *= i + 2 if kind == "rewritten in place by the position" else 2
        elif kind == "the last row rewritten":
            h = h.clone()
            for i in rows:
                h[i] = h[i].sin()
            h[-1] = h[-1].cos()
        elif kind == "the same code, a shared row":
            table = torch.arange(4.0, dtype=x.dtype)
            h = torch.stack([h[i] * table for i in rows])
        elif kind == "part of each row written":
            out = torch.zeros_like(h)
            for i in rows:
                out[i, :2] = h[i, :2].tanh()
            h = out
        elif kind == "two loops over the rows":
            out = torch.zeros_like(h)
            for i in rows:
                out[i] = h[i].sin()
            for i in rows:
                out[i] = out[i].tanh()
            h = out
        elif kind in ("two writes into each row", "a third write into the first row"):
            out = torch.zeros_like(h)
            for i in rows:
                out[i] = h[i].tanh()
                out[i] += h[i].sin()  # reads the row just written (refused before)
                if i == 0 and kind == "a third write into the first row":
                    out[i] += 1
            h = out
        elif kind == "an autograd.Function on every sample":
            h = torch.stack([_Square.apply(h[i]) for i in rows])
        elif kind == "a count of ones by the position":
            h = torch.stack([h[i] * torch.ones(i + 1, dtype=x.dtype).sum() for i in rows])
        elif kind == "narrowed at the position":
            h = torch.stack([h[i].narrow(0, i % 2, 2).repeat(2) for i in rows])
        elif kind == "written at a column by the position":
            out = torch.zeros_like(h)
            for i in rows:
                out[i, i % 2] = h[i].sum()
            h = out
        elif kind == "a strided slice at the first position":
            h = torch.stack([(h[i][::2] if i == 0 else h[i][:2]).repeat(2) for i in rows])
        elif kind == "viewed by the position":
            h = torch.stack([h[i].view((2, 2) if i else (1, 4)).t().reshape(4) for i in rows])
        elif kind == "a signed zero by the position":
            h = torch.stack([torch.copysign(h[i], 0.0 if i == 0 else -0.0) for i in rows])
        elif kind == "each row copied, then written":
            h, pieces = h * 1.0, []
            for i in rows:
                pieces.append(h[i] * 1.0)  # before the row's own write: every row read unwritten
                h[i].mul_(2)
            h = torch.stack(pieces)
        elif kind in ("each row written in place, then read as a view", "one-row slices written, then read",
                      "each row written, then read", "the first row read after its write, the others before"):
            # (refused before the fifty-ninth session: row 0's view of the first write's
            # result kept the later rows' writes in place, and rows were read before and after)
            h, pieces = h * 1.0, []
            for i in rows:
                if kind == "each row written in place, then read as a view":
                    h[i].mul_(2)
                    pieces.append(h[i])
                elif kind == "one-row slices written, then read":
                    h[i:i + 1].mul_(2)
                    pieces.append(h[i:i + 1][0])
                elif kind == "each row written, then read":
                    h[i] = h[i] * 2
                    pieces.append(h[i] + 1)
                elif i == 0:  # "the first row read after its write, the others before"
                    h[i] = h[i] * 2
                    pieces.append(h[i] * 1.0)
                else:
                    pieces.append(h[i] * 1.0)
                    h[i] = h[i] * 2
            h = torch.stack(pieces)
        elif kind in ("part of each row written, read, then the rest written",
                      "part of each row scaled by the position, then read", "a column set to the position, then read"):
            h, pieces = h * 1.0, []
            for i in rows:
                if kind == "part of each row written, read, then the rest written":
                    h[i, :2] = h[i, :2] * 2
                elif kind == "part of each row scaled by the position, then read":
                    h[i, :2].mul_(i + 1)
                else:
                    h[i, 0] = float(i)
                pieces.append(h[i] * 1.0)  # a copy of the row as written so far
            for i in rows if kind == "part of each row written, read, then the rest written" else ():
                h[i, 2:] = h[i, 2:] * 3  # (no copy above shows it)
            h = torch.stack(pieces) + h
        elif kind == "row views taken before the first row is written":
            h = h * 1.0
            views = [h[i] for i in rows]  # views: row 0's sees the write below
            h[0].mul_(2)
            h = torch.stack(views)
        elif kind in ("row views taken first, each written in place, then read",
                      "row views taken first, each written in place, the whole read",
                      "row views taken first, each scaled by the position"):
            # (refused before the sixtieth session: a view taken before another row's write,
            # and written after it, was read as a view of the memory the write had changed)
            h, pieces = h * 1.0, []
            views = [h[i] for i in rows]
            for i in rows:
                views[i].mul_(i + 2 if kind == "row views taken first, each scaled by the position" else 2)
                pieces.append(views[i] + 1)
            h = torch.stack(pieces) if kind.endswith("then read") else h
        elif kind in ("the first row written before the loop", "every row written before the loop"):
            h = h * 1.0
            for i in rows if kind == "every row written before the loop" else rows[:1]:
                h[i, 0].mul_(2)
            h = torch.stack([h[i] for i in rows])
        elif kind in ("two pieces of each sample in turn", "two pieces swapped at the last position"):
            # TimesFM's decomposition: each series' trend and residual stacked in turn,
            # [a0, b0, a1, b1, …], recombined as out[0::2] + out[1::2] (refused before).
            pieces = []
            for i in rows:
                trend, residual = h[i].cumsum(0) / 4, h[i] * 2
                swapped = kind == "two pieces swapped at the last position" and i == len(rows) - 1
                pieces.extend([residual, trend] if swapped else [trend, residual])
            both = torch.tanh(torch.stack(pieces))
            h = both[0::2] + both[1::2].sin()
        return self.head(h)


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


@pytest.mark.parametrize("kind", ["written by the same code", "rewritten in place by the same code",
                                  "the same code, a shared row", "part of each row written", "two loops over the rows",
                                  "an autograd.Function on every sample", "two writes into each row",
                                  "two pieces of each sample in turn", "every row written before the loop",
                                  "each row copied, then written", "each row written in place, then read as a view",
                                  "one-row slices written, then read", "each row written, then read",
                                  "part of each row written, read, then the rest written",
                                  "row views taken first, each written in place, then read",
                                  "row views taken first, each written in place, the whole read"])
def test_samples_pieces_computed_by_the_same_code_are_a_batch_again(kind):
    torch.manual_seed(0)
    model = PositionedPieces(kind).to(DTYPE)
    plain = copy.deepcopy(model)
    dp_model = fxdp.transform(model, grad_sample=True, max_grad_norm=0.5, loss_reduction="sum", compiler="eager")
    tol = tolerance(DTYPE)
    for batch_size in (4, 3):
        x = torch.randn(batch_size, 4, dtype=DTYPE)
        ref = reference(copy.deepcopy(plain), (x,), lambda out, i: out.sum())
        model.zero_grad(set_to_none=True)
        dp_model(x).sum().backward()
        assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample, tol,
                         f"grad_sample at B = {batch_size}")
        assert_close_all({n: p.grad for n, p in model.named_parameters()}, ref.grad("sum", 0.5), tol,
                         f"clipped grad at B = {batch_size}")


@pytest.mark.parametrize("kind", ["the first row written before the loop",
                                  "row views taken before the first row is written",
                                  "part of each row scaled by the position, then read",
                                  "a column set to the position, then read"])
def test_a_row_written_before_a_loop_that_reads_every_row_is_refused(kind):
    """``h[0, 0].mul_(2)``, then every sample's row stacked (or the rows taken as views
    first): row 0 read written, the others not (alone, every sample is the first).
    Accepted, with wrong gradients, until red teams found them: the rows a loop reads
    were taken for the steps of one that writes every row, and views taken before the
    write were not seen to hold it. A loop that reads each row right after writing part
    of it by the position (``h[i, :2].mul_(i + 1)``, ``h[i, 0] = float(i)``) reads the
    rows after their writes alike in number, not in code (a first version of the
    fifty-ninth session's rule accepted them)."""
    problems = fxdp.validate(PositionedPieces(kind).to(DTYPE), torch.randn(4, 4, dtype=DTYPE))
    assert problems and any("into which only some samples' rows were written" in p.reason for p in problems), problems


@pytest.mark.parametrize("kind", ["scaled by the position", "the first sample's own code",
                                  "another tensor's rows at some positions", "rows of a shared table at each position",
                                  "written by the position", "rewritten in place by the position",
                                  "the last row rewritten", "a count of ones by the position",
                                  "narrowed at the position", "written at a column by the position",
                                  "a strided slice at the first position", "viewed by the position",
                                  "a third write into the first row", "two pieces swapped at the last position",
                                  "a signed zero by the position",
                                  "the first row read after its write, the others before",
                                  "row views taken first, each scaled by the position"])
def test_samples_pieces_computed_by_code_that_depends_on_the_position_are_refused(kind):
    """Each sample's values depend on where it stands in the batch: the microbatch loop
    gives every sample the first position's (or cannot run), and under add/remove
    adjacency one sample more or less moves the others (they were accepted before)."""
    problems = fxdp.validate(PositionedPieces(kind).to(DTYPE), torch.randn(4, 4, dtype=DTYPE))
    assert problems and any("computes them with different code at different positions" in p.reason
                            and "run the same code on every sample" in p.reason for p in problems), problems


class TilesOfEachImage(nn.Module):
    """Llava-OneVision's anyres features: every image's ``n`` tiles through the tower as
    one batch ``[B·n, …]``, split back per image (``torch.split(h, [n] * B)``), each image's
    base tile plus the mean of the others, stacked."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.tower, self.head = how, nn.Linear(4, 4), nn.Linear(4, 3)
        if how.startswith("a newline"):
            self.newline = nn.Parameter(torch.randn(4))

    def forward(self, x):  # [B, n, 4]
        batch, n = x.shape[:2]
        tiles = torch.cat([image[:n] for image in x]) if self.how.startswith("a loop") else x.reshape(batch * n, 4)
        h = self.tower(tiles)
        if self.how.endswith("sliced per image"):
            chunks = [h[i * n:(i + 1) * n] for i in range(batch)]
        elif self.how.endswith("split across images"):
            chunks = torch.split(h, [n + 1] + [n] * (batch - 2) + [n - 1])
        elif self.how.endswith("two images per chunk"):
            chunks = torch.split(h, 2 * n)
        else:
            chunks = torch.split(h, [n] * batch)
        if self.how.startswith("a newline"):
            # (modeling_llava_onevision.py's pack_image_features: a learned row after each image's features)
            rows = [torch.cat((c.tanh(), self.newline[None].expand(1, 4))) for c in chunks]
            out = self.head(torch.stack(rows) if "stacked" in self.how else torch.cat(rows))
            return (out, rows) if "returned" in self.how else out
        return self.head(torch.stack([c[0] + c[1:].mean(0) for c in chunks]))


@pytest.mark.parametrize("how", ["reshaped, split per image", "a loop over the images, split per image",
                                 "reshaped, sliced per image", "a newline after each image, stacked, split per image",
                                 "a newline after each image, concatenated, split per image"])
def test_each_samples_rows_of_a_merged_batch_split_apart_are_its_own(how):
    """Each piece holds one sample's ``n`` rows of ``[B·n, …]``: that sample's values
    (refused before the sixty-first session as "it splits the batch dim"; the loop over
    the images' tensors also as "it selects one row of the batch" at the second batch
    size, whose ``B`` is symbolic). A split stays exact when the rows per sample change
    (``n`` symbolic: a red team's find); slices at ``i * n`` of a symbolic ``n`` are
    refused as starts that move. A parameter used on each sample's piece (Llava's image
    newline) is mapped over the samples by ``vmap``, each result stacked or concatenated."""
    torch.manual_seed(0)
    model = TilesOfEachImage(how).to(DTYPE)
    plain = copy.deepcopy(model)
    dp_model = fxdp.transform(model, grad_sample=True, max_grad_norm=0.5, loss_reduction="sum", compiler="eager")
    for batch_size, n in ((4, 3), (3, 3)) + (((3, 2),) if "split" in how else ()):
        x = torch.randn(batch_size, n, 4, dtype=DTYPE)
        ref = reference(copy.deepcopy(plain), (x,), lambda out, i: out.pow(2).sum())
        model.zero_grad(set_to_none=True)
        dp_model(x).pow(2).sum().backward()
        assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample, tolerance(DTYPE),
                         f"grad_sample at B = {batch_size}")
        assert_close_all({n: p.grad for n, p in model.named_parameters()}, ref.grad("sum", 0.5), tolerance(DTYPE),
                         f"clipped grad at B = {batch_size}")


@pytest.mark.parametrize("how", ["reshaped, split across images", "reshaped, two images per chunk"])
def test_pieces_of_a_merged_batch_across_its_samples_are_refused(how):
    """Two images' tiles per chunk, read apart: the loop is named too, with the first op
    in its body that mixes a chunk's rows (since the sixty-second session)."""
    problems = fxdp.validate(TilesOfEachImage(how).to(DTYPE), torch.randn(4, 3, 4, dtype=DTYPE))
    assert [p.op for p in problems] == (["aten.split_with_sizes.default"] if "across" in how
                                        else ["aten.split.Tensor", "aten.cat.default"]), problems
    assert "it splits the batch dim" in problems[0].reason
    assert "across" in how or "could not run as f on the whole batch: f must keep the rows of its chunk apart, " \
        "and in f, aten.slice.Tensor" in problems[1].reason, problems


@pytest.mark.parametrize("how", ["a newline after each image, concatenated, returned, split per image",
                                 "a newline after each image, stacked, returned, split per image"])
def test_each_samples_result_of_a_mapped_loop_returned_apart_is_its_own(how):
    """Llava-OneVision returns every image's features as a list beside the model's output
    (``image_hidden_states``): each copy's result, read after the loop, is its rows of
    the mapped result (refused before the sixty-first session, the copies kept for the
    list), and a loss of the list is each sample's own."""
    torch.manual_seed(0)
    model = TilesOfEachImage(how).to(DTYPE)
    plain = copy.deepcopy(model)
    dp_model = fxdp.transform(model, grad_sample=True, max_grad_norm=0.5, loss_reduction="sum", compiler="eager")

    def loss(out):
        return out[0].pow(2).sum() + sum(r.sin().sum() for r in out[1])

    for batch_size in (4, 3):
        x = torch.randn(batch_size, 3, 4, dtype=DTYPE)
        ref = reference(copy.deepcopy(plain), (x,), lambda out, i: loss(out))
        model.zero_grad(set_to_none=True)
        loss(dp_model(x)).backward()
        assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample, tolerance(DTYPE),
                         f"grad_sample at B = {batch_size}")


class RowsReturned(nn.Module):
    """A loop over one-row slices concatenated (fused as the layer on the whole batch),
    each row's result also returned."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        rows = [self.lin(x[i:i + 1]).tanh() for i in range(x.shape[0])]
        return self.head(torch.cat(rows)), rows


def test_each_rows_result_of_a_fused_loop_returned_apart_is_its_own():
    """As for a mapped loop: each copy's result read after the loop is its rows of the
    fused result (refused before the sixty-first session, a red team's find)."""
    torch.manual_seed(0)
    model = RowsReturned().to(DTYPE)
    plain = copy.deepcopy(model)
    dp_model = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")

    def loss(out):
        return out[0].pow(2).sum() + sum(r.sin().sum() for r in out[1])

    for batch_size in (4, 3):
        x = torch.randn(batch_size, 4, dtype=DTYPE)
        ref = reference(copy.deepcopy(plain), (x,), lambda out, i: loss(out))
        model.zero_grad(set_to_none=True)
        loss(dp_model(x)).backward()
        assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample, tolerance(DTYPE),
                         f"grad_sample at B = {batch_size}")


@pytest.mark.parametrize("kind", ["random draw in each sample", "samples stacked out of order",
                                  "an op without a batching rule"])
def test_a_loop_vmap_could_not_trace_says_why_once(kind):
    """Where vmap cannot trace a loop over the samples (an op without a batching rule),
    the refusal says so and names the op, once for the loop; before the sixty-second
    session it only repeated, once per copy, that such loops run as vmap(f) "where f
    draws no random numbers, writes nothing in place...", all true of that loop. Loops
    refused for other reasons get no such line; the copies' alike problems are listed
    once, with how many there are."""
    torch.manual_seed(0)
    dp_model = fxdp.transform(ChunkLoops(kind).to(DTYPE), grad_sample=True, compiler="eager")
    with pytest.raises(UnsupportedError) as info:
        dp_model(*_inputs(kind, 4))
    message = str(info.value)
    untraced = ("could not run as torch.func.vmap(f): torch.func.vmap has no batching rule for "
                "fxdp_test_chunk_loops::twice, so the loop's parameter uses on one sample's values are refused")
    assert (message.count(untraced) == 1) == (kind == "an op without a batching rule"), message
    assert message.count("uses a parameter on the values of one sample") == 1, message
    assert "(4 times)" in message, message


class UntracedLoopBeside(nn.Module):
    """A loop over the samples without parameter uses vmap cannot trace (``pdist``,
    kept as a loop: the analysis follows each sample's piece), beside a layer refused
    for its own reason (BatchNorm in training)."""

    def __init__(self):
        super().__init__()
        self.fc, self.norm, self.head = nn.Linear(4, 4), nn.BatchNorm1d(15), nn.Linear(15, 2)

    def forward(self, x):
        h = self.fc(x)
        return self.head(self.norm(torch.stack([torch.pdist(row) for row in h])))


def test_a_loop_vmap_could_not_trace_but_the_analysis_follows_is_not_blamed():
    dp_model = fxdp.transform(UntracedLoopBeside().to(DTYPE), compiler="eager")
    with pytest.raises(UnsupportedError, match="batch_norm") as info:
        dp_model(torch.randn(4, 6, 4, dtype=DTYPE))
    assert "torch.func.vmap(f):" not in str(info.value) and len(info.value.problems) == 1, str(info.value)
    eval_model = UntracedLoopBeside().to(DTYPE).eval()
    plain = copy.deepcopy(eval_model)
    dp_model = fxdp.transform(eval_model, grad_sample=True, compiler="eager")
    x = torch.randn(4, 6, 4, dtype=DTYPE)
    ref = reference(copy.deepcopy(plain), (x,), lambda out, i: _per_sample_loss(out).sum())
    _per_sample_loss(dp_model(x)).mean().backward()
    assert_close_all({n: p.grad_sample for n, p in eval_model.named_parameters()},
                     ref.per_sample, tolerance(DTYPE), "grad_sample")


class RandomMaskBeforeChunks(nn.Module):
    """pytorch-tabnet's pretraining in training: a random mask per sample,
    ``bernoulli(p * ones(B, G))`` through a shared group matrix (``RandomObfuscator``),
    then a ghost batch norm's loop over chunks (eval). ``drawn`` replays the batch's draw
    for the loop's samples."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 3)
        self.register_buffer("groups", torch.rand(4, 4))

    def forward(self, x, drawn=None):
        g = torch.bernoulli(0.3 * torch.ones(x.shape[0], 4, dtype=x.dtype)) if drawn is None else drawn
        h = self.lin((1 - g @ self.groups) * x)
        return torch.cat([self.head(c).tanh() for c in h.chunk(2)])


def test_a_loop_over_chunks_after_a_random_mask_of_the_batch_s_size_is_fused():
    """The mask is read as batched only once the loop is fused, and the loop was read
    only with the mask shared: refused (at the mask's multiply, "a shared tensor whose
    values vary along the batch dim") before the sixty-second session, a helper's sweep
    of pytorch-tabnet. Checked against the loop run on each sample's row of the draw."""
    torch.manual_seed(0)
    model = RandomMaskBeforeChunks().to(DTYPE)
    plain = copy.deepcopy(model)
    dp_model = fxdp.transform(model, grad_sample=True, max_grad_norm=0.5, compiler="eager")
    for batch_size in (5, 4):
        x = torch.randn(batch_size, 4, dtype=DTYPE)
        torch.manual_seed(batch_size)
        out = dp_model(x)
        torch.manual_seed(batch_size)
        drawn = torch.bernoulli(0.3 * torch.ones(batch_size, 4, dtype=DTYPE))
        torch.testing.assert_close(out, plain(x, drawn))
        ref = reference(copy.deepcopy(plain), (x,), lambda out, i: _per_sample_loss(out).sum(),
                        kwargs={"drawn": drawn})
        model.zero_grad(set_to_none=True)
        _per_sample_loss(out).mean().backward()
        assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample,
                         tolerance(DTYPE), f"grad_sample at B = {batch_size}")
        assert_close_all({n: p.grad for n, p in model.named_parameters()}, ref.grad("mean", 0.5),
                         tolerance(DTYPE), f"clipped grad at B = {batch_size}")


class LoopOverABuiltTensor(nn.Module):
    """A loop over chunks of ``ones(B, B)``, whose ``sum(1)`` counts the batch: every
    sample gets ``B``, a batch of one ``1``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("groups", torch.rand(4, 4))

    def forward(self, x):
        g = torch.bernoulli(0.3 * torch.ones(x.shape[0], 4, dtype=x.dtype))
        s = torch.cat([c.sum(1, keepdim=True) for c in torch.ones(x.shape[0], x.shape[0], dtype=x.dtype).chunk(2)])
        return self.lin((1 - g @ self.groups) * x * s)


def test_a_loop_over_chunks_of_a_tensor_built_from_the_batch_size_stays_refused():
    """The reading with tensors built from ``B`` batched fuses only loops over values of
    the batch's data: over ``ones(B, B)`` itself it fused the loop, and the count was
    accepted (a wrong result the red team found in the change's first form)."""
    dp_model = fxdp.transform(LoopOverABuiltTensor().to(DTYPE), grad_sample=True, compiler="eager")
    with pytest.raises(UnsupportedError):
        dp_model(torch.randn(5, 4, dtype=DTYPE))


class RandomMaskBeforeMixingChunks(RandomMaskBeforeChunks):
    """``RandomMaskBeforeChunks`` whose loop centres each chunk on its mean: its rows mix."""

    def forward(self, x):
        g = torch.bernoulli(0.3 * torch.ones(x.shape[0], 4, dtype=x.dtype))
        h = self.lin((1 - g @ self.groups) * x)
        return torch.cat([self.head(c - c.mean(0, keepdim=True)) for c in h.chunk(2)])


def test_a_loop_mixing_rows_after_a_random_mask_is_named_not_the_mask():
    """The refusal names the loop that mixes the rows, not the mask's multiply ("a shared
    tensor whose values vary along the batch dim"), an op that is per-sample once the
    mask is read batched (a red team's find in the sixty-second session)."""
    with pytest.raises(UnsupportedError) as refused:
        fxdp.transform(RandomMaskBeforeMixingChunks().to(DTYPE), grad_sample=True,
                       compiler="eager")(torch.randn(5, 4, dtype=DTYPE))
    reasons = [p.reason for p in refused.value.problems]
    assert any("it splits the batch dim" in r for r in reasons), reasons
    assert not any("vary along the batch dim" in r for r in reasons), reasons
