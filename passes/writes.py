"""In-place writes, for the batch analysis: where per-sample data lands in memory.

The batch analysis follows values from node to node, but an in-place op changes a
tensor that other nodes name. T5's ``_shift_right`` and BART's ``shift_tokens_right``
write the ids into a fresh buffer through a view::

    shifted = input_ids.new_zeros(input_ids.shape)      # shared: made inside the model
    shifted[:, 1:] = input_ids[:, :-1]                  # slice + copy_: now per-sample

Every later read of ``shifted`` must see it batched, or a reduction over its batch dim
would pass as a reduction over shared data (and silently mix samples). ``follow_write``
runs after an in-place op: when it writes per-sample data into a tensor the analysis
holds as shared, the batch dim is carried back through the views to the written base,
so later reads see it. A value computed from parameters alone that is written in place
(``w = W.clone(); w[:, :2] = 0``) is refused: its per-sample gradient is mapped back
through the ops that computed it, and a write through a view is not one of them.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from fxdp.batching import BatchDim, Packed, Piece

__all__ = ["PIECE_INTO_SHARED", "carries_no_gradient", "computed_without_grad", "follow_write", "is_detach",
           "is_view", "parameter_write", "views_read_after", "written_chain", "written_through", "writes_in_place"]

aten = torch.ops.aten


PIECE_INTO_SHARED = (
    "it writes one sample's values, taken out of the batch (x[i], x[i:i + 1]), into a tensor made inside the "
    "model that the analysis holds as shared by all samples: start from a tensor of the batch's shape "
    "(torch.zeros_like(x)), or concatenate the samples' results (torch.cat, torch.stack)")


def writes_in_place(target: Any) -> bool:
    """Whether ``target`` writes its first argument in place (``copy_``, ``add_``, ...)."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    args = target._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def is_view(node: fx.Node) -> bool:
    """``node`` returns a view of its first argument."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    schema = node.target._schema
    return (bool(schema.arguments) and schema.arguments[0].alias_info is not None
            and not schema.arguments[0].alias_info.is_write and len(schema.returns) == 1
            and schema.returns[0].alias_info is not None)


def written_through(node: fx.Node) -> bool:
    """Whether an in-place op writes ``node`` or a view of it (views only read change
    nothing: TimesFM's padding counted off ``pad.view(B, n, p)[..., 0]``)."""
    return any(writes_in_place(u.target) or (is_view(u) and written_through(u)) for u in node.users
               if u.op == "call_function")


def _dim_in_base(view: fx.Node, dim: int) -> int | None:
    """The dim of ``view``'s base that ``view``'s ``dim`` is, or ``None`` where the
    view does not keep dims apart (a reshape, ``as_strided``)."""
    base_rank = view.args[0].meta["val"].dim()
    target = view.target
    if target in (aten.slice.Tensor, aten.narrow.default, aten.alias.default):
        return dim
    if target is aten.select.int:
        removed = view.args[1] % base_rank
        return dim if dim < removed else dim + 1
    if target is aten.unsqueeze.default:
        added = view.args[1] % (base_rank + 1)
        return None if dim == added else (dim if dim < added else dim - 1)
    if target is aten.transpose.int:
        a, b = (d % base_rank for d in view.args[1:3])
        return b if dim == a else a if dim == b else dim
    if target is aten.permute.default:
        return list(view.args[1])[dim] % base_rank
    if target is aten.t.default:
        return (1 - dim) if base_rank == 2 else dim
    return None


def computed_without_grad(graph: fx.Graph) -> set[fx.Node]:
    """The nodes ``graph`` runs with gradients disabled (between the
    ``_set_grad_enabled(False)`` and ``_set_grad_enabled(True)`` a ``torch.no_grad()``
    block traces to): no gradient flows through their values."""
    enabled, found = True, set()
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            enabled = bool(node.args[0])
        elif not enabled:
            found.add(node)
    return found


def is_detach(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.aten.detach.default


def carries_no_gradient(node: fx.Node, without_grad: set[fx.Node], _memo: dict | None = None) -> bool:
    """Whether no gradient can flow back through ``node``'s value: it is detached,
    computed under ``no_grad`` (``without_grad``, from ``computed_without_grad``), or
    computed from such values alone."""
    memo = {} if _memo is None else _memo
    if node not in memo:
        if node.op != "call_function":
            memo[node] = False
        elif is_detach(node) or node in without_grad:
            memo[node] = True
        else:
            inputs = node.all_input_nodes
            memo[node] = bool(inputs) and all(carries_no_gradient(a, without_grad, memo) for a in inputs)
    return memo[node]


def written_chain(node: fx.Node) -> list | None:
    """The view an in-place op writes, its base, ... up to a tensor no view of another
    (``None`` if ``node`` writes nothing in place)."""
    if node.op != "call_function" or not writes_in_place(node.target):
        return None
    chain = [node.args[0]]
    while isinstance(chain[-1], fx.Node) and is_view(chain[-1]):
        chain.append(chain[-1].args[0])
    return chain


def parameter_write(node: fx.Node, sources: dict) -> str | None:
    """Why an in-place write into a trainable parameter is refused; at any batch size,
    one sample included: besides leaving the parameter's per-sample results nowhere to
    go, the forward changes the parameter (``nn.Embedding(max_norm=...)`` renormalises
    the rows the batch looks up) outside the private gradient.

    Args:
        node: An op of the graph.
        sources: Parameter-only values (computed from trainable parameters alone).
    """
    chain = written_chain(node)
    base = chain[-1] if chain else None
    if not (isinstance(base, fx.Node) and base in sources and base.op == "placeholder"):
        return None
    # The backward would receive the parameter's new value, a copy, not the
    # parameter its per-sample results belong on.
    if node.target is torch.ops.aten.embedding_renorm_.default:
        return ("it writes in place into a trainable parameter during the forward (nn.Embedding("
                "max_norm=...) renormalises the rows it looks up); fxdp cannot attach per-sample "
                "results to a parameter the forward rewrites: drop max_norm, or renormalise the "
                "weight yourself between steps (with torch.no_grad(): weight.copy_(torch.renorm("
                "weight, 2, 0, max_norm)))")
    return ("it writes in place into a trainable parameter during the forward; fxdp cannot attach "
            "per-sample results to a parameter the forward rewrites: change the parameter between "
            "steps instead (under torch.no_grad(), after optimizer.step())")


def follow_write(node: fx.Node, batch: dict, sources: dict) -> str | None:
    """Carry an in-place write's batch dim to the tensor it writes.

    Args:
        node: An op of the graph, after the analysis gave it its batch.
        batch: The analysis' node -> batch map; updated for the written base and the
            views the write went through.
        sources: Parameter-only values (computed from trainable parameters alone).

    Returns:
        Why the write cannot be followed, or ``None``.
    """
    chain = written_chain(node)
    if chain is None or not isinstance(chain[-1], fx.Node):
        return None
    base = chain[-1]
    if base in sources:
        return parameter_write(node, sources) or (
            "it writes in place into a value computed from parameters alone; fxdp maps "
            "per-sample gradients back through the ops that compute a parameter's value, "
            "and an in-place write is not one: compute it out of place "
            "(w = w * mask, torch.where(mask, 0.0, w), torch.cat)")
    from_parameters = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, fx.Node) and a in sources]
    without_grad = computed_without_grad(node.graph) if from_parameters else set()
    if from_parameters and not isinstance(batch.get(base), BatchDim) and node not in without_grad \
            and not all(carries_no_gradient(a, without_grad) for a in from_parameters):
        # The tensor holds the parameter's values from here on, but no op computes them
        # from it: the per-sample gradients mapped back through the ops that compute the
        # values read later would miss what goes through the write. (A value without a
        # gradient, spectral norm's power iteration into its buffers, passes none.)
        return ("it writes values computed from parameters in place into a tensor made inside the "
                "model; fxdp maps per-sample gradients back through the ops that compute a value, and "
                "an in-place write is not one: build the tensor out of place (torch.cat, torch.stack, "
                "torch.where), or write into a tensor made from sizes alone (torch.zeros(n, m)) before "
                "taking any other view of it")
    written = batch.get(node)
    if isinstance(written, Piece) and batch.get(base) is None:
        # Rows of one sample (a loop's x[i]) in a tensor that every sample reads.
        return PIECE_INTO_SHARED
    held = batch.get(base)
    if not (isinstance(written, (BatchDim, Packed)) and written.dim is not None):
        return None  # nothing per-sample is written (a sample's own row: see batch_dims.py's rows_written)
    if isinstance(held, (BatchDim, Packed)) and held.dim is not None:
        return None  # already per-sample: the op's own batch rule checked the layouts
    if held is not None:
        return None  # the loss or a refused value: judged where it is computed
    # Per-sample data written into a shared tensor: find its batch dim in the base.
    dim, dims = written.dim, {chain[0]: written.dim}
    for view in chain[:-1]:
        dim = _dim_in_base(view, dim)
        if dim is None:
            return (f"it writes per-sample data in place through a {view.target} view of a tensor "
                    "made inside the model, which fxdp cannot follow; build the tensor out of place "
                    "(torch.cat, F.pad, torch.where)")
        dims[view.args[0]] = dim
    if not bool(base.meta["val"].shape[dim] == node.meta["val"].shape[written.dim]):
        return "it writes per-sample data into part of the batch dim of a tensor made inside the model"
    stale = views_read_after(base, node, set(chain))
    if stale:
        return (f"{stale.name} is a view of a tensor that this op later fills with per-sample data in "
                "place, and it is read after the write; take the view after the write")
    for alias, d in dims.items():
        batch[alias] = written.at(d)  # merged rows stay merged (``[B·T, n]``)
    return None


def views_read_after(base: fx.Node, write: fx.Node, chain: set) -> fx.Node | None:
    """A view of ``base`` made before ``write`` (not one of the ``chain`` it wrote
    through) that is read after it."""
    order = {n: i for i, n in enumerate(write.graph.nodes)}
    stack = [u for u in base.users if is_view(u) and u.args[0] is base]
    while stack:
        view = stack.pop()
        if view in chain or order[view] > order[write]:
            continue
        for user in view.users:
            if order[user] > order[write]:
                return view
            if is_view(user) and user.args[0] is view:
                stack.append(user)
    return None
