"""Parameters used on the rows a boolean mask selected: run on the rows put back in place.

``h[mask]`` (``mask`` batched as ``h``) is one list of every sample's selected rows,
its length set by the data (``Masked`` in the batch analysis). A parameter used on
such a list has no batch to be made per-sample on: torchtune's ``FusionEmbedding``
looks its two tables up on the tokens each one holds, fairseq's RoBERTa head projects
the masked positions only::

    tokens = input.masked_select(mask)          # [N], N counted over the whole batch
    out = out.masked_scatter(mask[..., None], self.embedding(tokens))

Where the op keeps rows apart (each output row computed from its own input row: a
``linear``, a lookup, a norm over each row's trailing dims, elementwise ops), it gives
every selected row the same value when run on the whole batch with the rows in their
places. ``rows_in_place_pass`` rewrites it so::

    rows_to_batch = fxdp.rows_to_batch(tokens, mask, False)     # [B, T], rows in place
    embedding = aten.embedding(weight, rows_to_batch)            # a use on the batch
    batch_to_rows = fxdp.batch_to_rows(embedding, mask, sym_size) # the same [N, d] rows

The use is then an ordinary per-sample one, with its rules, ghost norms and strategies.
The positions the mask did not select hold a copy of a selected row (zeros where none
is), so that the op computes finite values there; the gradient reaching them is zero,
since ``batch_to_rows`` reads the selected positions alone. The cost: the op runs on
every position of the batch, not on the selected rows only.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

__all__ = ["ROWS_TO_BATCH", "BATCH_TO_ROWS", "rows_in_place_pass"]


@torch.library.custom_op("fxdp::rows_to_batch", mutates_args=())
def _rows_to_batch(rows: torch.Tensor, mask: torch.Tensor, zeros: bool) -> torch.Tensor:
    """``rows`` (``x[mask]``) put back where ``mask`` selected them, in a tensor of shape
    ``mask.shape + rows.shape[1:]``; the other positions hold zeros (``zeros``) or a
    copy of the selected row before them (of the first where none is before)."""
    flat = mask.reshape(-1)
    count = int(flat.sum())
    if count != rows.shape[0]:
        raise RuntimeError(f"fxdp: the mask selects {count} positions but {rows.shape[0]} rows were given")
    shape = (*mask.shape, *rows.shape[1:])
    if zeros or count == 0:
        out = rows.new_zeros((flat.numel(), *rows.shape[1:]))
        out[flat] = rows
        return out.view(shape)
    # (Contiguous, as the fake kernel says: indexing keeps the rows' own stride order.)
    return rows[(flat.cumsum(0) - 1).clamp_(min=0)].contiguous().view(shape)


@_rows_to_batch.register_fake
def _(rows, mask, zeros):
    return rows.new_empty((*mask.shape, *rows.shape[1:]))


@torch.library.custom_op("fxdp::batch_to_rows", mutates_args=())
def _batch_to_rows(dense: torch.Tensor, mask: torch.Tensor, count: int) -> torch.Tensor:
    """``dense[mask]``, known to hold ``count`` rows (the list ``dense`` was made from)."""
    rows = dense.reshape(-1, *dense.shape[mask.dim():])[mask.reshape(-1)]
    if rows.shape[0] != count:
        raise RuntimeError(f"fxdp: the mask selects {rows.shape[0]} positions, not {count}")
    return rows.contiguous()


@_batch_to_rows.register_fake
def _(dense, mask, count):
    return dense.new_empty((count, *dense.shape[mask.dim():]))


def _rows_to_batch_context(ctx, inputs, output):
    rows, mask, _ = inputs
    ctx.save_for_backward(mask)
    ctx.count = rows.shape[0]


def _rows_to_batch_backward(ctx, grad):
    # The positions the mask did not select read no gradient back (see the module's
    # docstring: what reads them gets a zero gradient there).
    (mask,) = ctx.saved_tensors
    return _batch_to_rows(grad, mask, ctx.count), None, None


def _batch_to_rows_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _batch_to_rows_backward(ctx, grad):
    (mask,) = ctx.saved_tensors
    return _rows_to_batch(grad, mask, True), None, None


_rows_to_batch.register_autograd(_rows_to_batch_backward, setup_context=_rows_to_batch_context)
_batch_to_rows.register_autograd(_batch_to_rows_backward, setup_context=_batch_to_rows_context)

ROWS_TO_BATCH = torch.ops.fxdp.rows_to_batch.default
BATCH_TO_ROWS = torch.ops.fxdp.batch_to_rows.default


def rows_in_place_pass(gm: fx.GraphModule, uses: list[tuple[fx.Node, dict[fx.Node, fx.Node]]],
                       batch: dict[fx.Node, Any]) -> fx.GraphModule:
    """Run each op in ``uses`` on its mask-selected operands put back in place, and take
    its outputs' selected rows (see the module's docstring).

    Args:
        gm: The canonical graph.
        uses: ``(op, {selected operand: its mask})`` for each op that uses a parameter on
            rows a mask selected and keeps those rows apart (the batch analysis's
            ``rows_in_place``).
        batch: The batch analysis's layouts: which of the op's outputs are selected rows.
    """
    from fxdp.batching import Masked
    from fxdp.passes.canonicalize import _call  # (canonicalize imports batch_dims, which imports this)

    replaced: dict[fx.Node, fx.Node] = {}  # an op rewritten before: its outputs' rows now
    for node, masks in uses:
        masks = {replaced.get(a, a): m for a, m in masks.items()}
        operand, mask = next(iter(masks.items()))
        with gm.graph.inserting_before(node):
            count = _call(gm, torch.ops.aten.sym_size.int, (operand, 0), node)
            placed = {a: _call(gm, ROWS_TO_BATCH, (a, m, False), node) for a, m in masks.items()}
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: placed.get(a, a))
            whole = _call(gm, node.target, tuple(args), node, dict(kwargs))

        def rows_of(value: fx.Node, like: fx.Node) -> fx.Node:
            with gm.graph.inserting_after(value):
                return _call(gm, BATCH_TO_ROWS, (value, mask, count), like)

        if isinstance(node.meta["val"], torch.Tensor):
            replaced[node] = rows_of(whole, node)
            node.replace_all_uses_with(replaced[node])
        else:
            for user in list(node.users):
                if user.target is not operator.getitem:
                    raise AssertionError(f"fxdp internal error: {user} reads the outputs of {node} as a tuple")
                with gm.graph.inserting_after(user):
                    item = _call(gm, operator.getitem, (whole, user.args[1]), user)
                replaced[user] = rows_of(item, user) if isinstance(batch.get(user), Masked) else item
                user.replace_all_uses_with(replaced[user])
                gm.graph.erase_node(user)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm
