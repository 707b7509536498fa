"""Replace each op that consumes a trainable parameter by its tagged version.

Before::

    linear = torch.ops.aten.linear.default(x, w, b)

After (``meta["fxdp"]`` holds rules, parameters and use ids)::

    fxdp_linear = fxdp_linear(x, w, b)    # autograd.Function: aten.linear forward,
                                          # fxdp::param_grad markers in backward

A use through a parameter-only computation (``F.linear(x, W.t())``, a slice of a
packed weight, weight norm) also carries that computation as a small graph, so the
backward rewrite can map per-sample gradients back to the parameters.
"""
from __future__ import annotations

import collections
import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxdp.batching import RAW, SHARED, WHOLE, BatchDim, Groups, Rows
from fxdp.errors import UnsupportedError
from fxdp.functions import (FUNCTION_APPLY, FunctionInTransform, TaggedFunction, backward_rule, function_call,
                            function_param_rule, registered_operands)
from fxdp.markers import USES, TaggedOp, Transform, new_use
from fxdp.passes.batch_dims import BatchAnalysis, module_path_of, op_name, rule_layout
from fxdp.passes.writes import carries_no_gradient, computed_without_grad
from fxdp.registry import GRAD, OpRule, ParamRule, lookup, named_arg, schema_args
from fxdp.rules.generic import generic_rule

__all__ = ["tag_pass", "ISOMETRIC"]

aten = torch.ops.aten

# Parameter transforms that preserve every sample's gradient norm (bijective
# rearrangements): ghost norms stay valid through them.
ISOMETRIC = {
    aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default,
    aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims, aten.clone.default,
    aten.contiguous.default, aten.alias.default, aten.flatten.using_ints, aten.unflatten.int,
    aten.movedim.int,
    # A cast's vector-Jacobian product casts the gradient back: norms are kept (autocast's
    # parameter casts, ``passes/autocast.py``).
    aten._to_copy.default,
}


def _whole_parameter_rule(param_rule: ParamRule) -> OpRule:
    return OpRule(op=aten.alias.default, params={0: param_rule},
                  input_grad=lambda args, grad_out, index: None, batch_rule=lambda *args: None)


# A batch of one sample (``B == 1``): that sample's gradient is the ordinary gradient,
# whatever the ops. Each trainable parameter is read through one tagged alias, whose
# marker receives the parameter's whole gradient as a WHOLE operand (``[1, *p.shape]``);
# no op needs a rule.
_BATCH_OF_ONE = _whole_parameter_rule(ParamRule(
    name="batch-of-one", operands=(GRAD,), per_sample_grad=lambda g: g, sum_grad=lambda g: g.sum(0)))
# No sample (``B == 0``): no per-sample gradient, a zero gradient.
_EMPTY_BATCH = _whole_parameter_rule(ParamRule(
    name="empty-batch", operands=(GRAD,), per_sample_grad=lambda g: g[:0],
    sum_grad=lambda g: g.new_zeros(g.shape[1:])))


def _tag_whole_parameters(gm: fx.GraphModule, param_names: dict[fx.Node, str],
                          excluded: set[str], op_rule: OpRule) -> dict[str, int]:
    """``B`` is 1 or 0: every use of a trainable parameter reads ``fxdp_alias(p)``."""
    first_op = next(n for n in gm.graph.nodes if n.op != "placeholder")
    counts: collections.Counter = collections.Counter()
    rule = op_rule.params[0]
    for p, name in param_names.items():
        if name in excluded or not p.users:
            continue
        use = new_use(rule=rule, param=name, module_path="", operand_batch=[WHOLE], config={},
                      source_names=[name])
        use_id = use.use_id
        with gm.graph.inserting_before(first_op):
            new = gm.graph.call_function(TaggedOp(op_rule, {0: use_id}), (p,))
        new.meta.update(p.meta)
        new.meta["fxdp"] = {"rule": rule.name, "params": [name], "use_ids": [use_id]}
        p.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
        counts[rule.name] += 1
    return dict(counts)


def _generic_layout(b) -> BatchDim:
    """An argument's layout as the generic rule receives the argument."""
    b = rule_layout(b)
    return b if isinstance(b, BatchDim) else RAW


def _sort_indices(gm: fx.GraphModule, sort: fx.Node) -> fx.Node:
    """The indices output of a ``sort`` node (made where it was not read), or an
    ``argsort``."""
    if sort.target in (torch.ops.aten.argsort.default, torch.ops.aten.argsort.stable):
        return sort
    for user in sort.users:
        if user.target is operator.getitem and user.args[1] == 1:
            return user
    with gm.graph.inserting_after(sort):
        indices = gm.graph.call_function(operator.getitem, (sort, 1))
    indices.meta["val"] = sort.meta["val"][1]
    return indices


def _first_user(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return min(node.users, key=order.__getitem__)


# Ops tagged ``nondeterministic_seeded`` for an optional dropout: deterministic (and
# differentiable, so part of the transform) with their dropout probability at zero.
_DROPOUT_ARGUMENT = {torch.ops.aten.scaled_dot_product_attention.default: "dropout_p"}


def _draws_at_random(n: fx.Node) -> bool:
    """Whether ``n`` draws random numbers (a dropout mask's noise)."""
    if torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ()):
        return False
    if n.target in _DROPOUT_ARGUMENT:
        p = named_arg(n, _DROPOUT_ARGUMENT[n.target], 0.0)
        return not (isinstance(p, (int, float)) and p == 0)
    return True


def _slice_scatter_from_the_start(base: torch.Tensor, src: torch.Tensor, dim: int = 0, start: Any = None,
                                  end: Any = None, step: int = 1) -> torch.Tensor:
    """``slice_scatter`` with bounds counted from the end (``f[-T:] = w``) counted from the
    start, and an end past the last position (``f[a:]``'s ``2**63 - 1``) at it: its
    ``vmap`` batching rule reads the one wrong (PyTorch 2.13: "Expected index [B, …] to
    be no larger than src") and overflows on the other, and a transform runs under
    ``vmap``."""
    size = base.shape[dim]

    def from_the_start(bound: Any) -> Any:
        # (A symbolic bound of unknown sign stays as it is: no guard on it.)
        if bound is None:
            return bound
        if statically_known_true(bound >= size):
            return size
        if not statically_known_true(bound < 0):
            return bound
        return torch.sym_max(bound + size, 0) if not statically_known_true(bound + size >= 0) else bound + size

    return torch.ops.aten.slice_scatter.default(base, src, dim, from_the_start(start), from_the_start(end), step)


def _extract_transform(derived: fx.Node, param_only: dict, params: set) -> tuple[Transform, list[fx.Node]]:
    """The parameter-only computation of ``derived`` as a graph ``(*sources, *extras) -> derived``."""
    needed: list[fx.Node] = []
    sources: list[fx.Node] = []
    extras: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(n: fx.Node) -> None:
        if n in seen:
            return
        seen.add(n)
        if n in params:
            sources.append(n)
            return
        outside = n not in param_only or n.op != "call_function"
        # A random draw (a dropout mask's noise) is the forward's: run again per sample it
        # would draw anew, so it is an input of the transform.
        random = not outside and _draws_at_random(n)
        if outside or random or (n is not derived and carries_no_gradient(n, without_grad)):
            # Computed outside the transform: data, buffers, and values no gradient
            # flows through (spectral norm's power iteration, run under no_grad).
            extras.append(n)
            return
        # A Function call's bodies are its own (``FunctionInTransform``), not inputs.
        for a in (n.args[2:] if n.target is FUNCTION_APPLY else n.all_input_nodes):
            if isinstance(a, fx.Node):
                visit(a)
        needed.append(n)

    without_grad = computed_without_grad(derived.graph)
    visit(derived)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in sources + extras:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in needed:
        if n.target is FUNCTION_APPLY:
            env[n] = graph.call_function(FunctionInTransform(function_call(n)),
                                         tuple(env[a] if isinstance(a, fx.Node) else a for a in n.args[2:]))
            env[n].meta = dict(n.meta)
        elif n.target is torch.ops.aten.slice_scatter.default:
            env[n] = graph.call_function(_slice_scatter_from_the_start,
                                         tuple(env[a] if isinstance(a, fx.Node) else a for a in n.args),
                                         {k: env[a] if isinstance(a, fx.Node) else a for k, a in n.kwargs.items()})
            env[n].meta = dict(n.meta)
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(env[derived])
    module = fx.GraphModule(torch.nn.Module(), graph)
    isometric = len(sources) == 1 and not extras and all(n.target in ISOMETRIC for n in needed)
    block = _block_taken(needed, sources) if len(sources) == 1 and not extras else None
    return Transform(module=module, num_sources=len(sources), isometric=isometric, block=block), sources + extras


def _block_taken(needed: list[fx.Node], sources: list[fx.Node]) -> tuple | None:
    """``(how, dim, start, stop)`` where the transform, after rearrangements of the
    parameter (``how``, spelt out), takes a block of it along one dim with constant
    bounds (``w[e]``, ``w[:, d:2 * d]``, a piece of ``chunk``, ``split`` or ``unbind``) and
    then only rearranges that (see ``Transform.block``)."""
    at = _rearranged(needed, 0, sources[0])
    if at == len(needed) or needed[at].args[:1] != ((needed[at - 1] if at else sources[0]),):
        return None
    op, piece = needed[at], needed[at + 1] if at + 1 < len(needed) else None
    taken = _block_bounds(op, piece)
    if taken is None:
        return None
    block = piece if op.target in _PIECES else op
    end = needed.index(block) + 1
    if _rearranged(needed, end, block) != len(needed):
        return None
    return (tuple((str(n.target), repr(n.args[1:]), repr(n.kwargs)) for n in needed[:at]), *taken)


def _rearranged(needed: list[fx.Node], at: int, value: fx.Node) -> int:
    """Where the chain of rearrangements (``ISOMETRIC`` ops) of ``value`` that starts at
    ``needed[at]`` ends."""
    while at < len(needed) and needed[at].target in ISOMETRIC and needed[at].args[:1] == (value,):
        value, at = needed[at], at + 1
    return at


def block_parts(module: fx.GraphModule) -> tuple[fx.GraphModule | None, fx.GraphModule, fx.GraphModule | None]:
    """The transform of a block use (see ``_block_taken``) as three graphs,
    ``post(take(prefix(p)))``: the parameter's rearrangements, the block taken, the
    block's rearrangements; ``None`` for a part without ops."""
    (source,) = [n for n in module.graph.nodes if n.op == "placeholder"]
    ops = [n for n in module.graph.nodes if n.op == "call_function"]
    at = _rearranged(ops, 0, source)
    end = at + 2 if ops[at].target in _PIECES else at + 1  # a piece is read by a getitem

    def part(nodes: list[fx.Node], start: fx.Node) -> fx.GraphModule | None:
        if not nodes:
            return None
        graph = fx.Graph()
        env = {start: graph.placeholder("x")}
        for n in nodes:
            env[n] = graph.node_copy(n, env.__getitem__)
        graph.output(env[nodes[-1]])
        return fx.GraphModule(torch.nn.Module(), graph)

    return part(ops[:at], source), part(ops[at:end], ops[at - 1] if at else source), part(ops[end:], ops[end - 1])


# Ops that cut a tensor into pieces along one dim (read by ``getitem``).
_PIECES = {aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int}


def _block_bounds(op: fx.Node, piece: fx.Node | None) -> tuple[int, int, int] | None:
    """``(dim, start, stop)`` of the block ``op`` takes (with ``piece`` the ``getitem``
    that reads one piece of a cut into pieces), or ``None``."""
    if op.target not in (aten.select.int, aten.slice.Tensor, *_PIECES):
        return None
    shape = op.args[0].meta["val"].shape
    args = list(schema_args(op.target, op.args, op.kwargs))[1:]
    dim = args[0] if op.target in (aten.select.int, aten.slice.Tensor, aten.unbind.int) else args[1]
    if not isinstance(dim, int) or not -len(shape) <= dim < len(shape) or not isinstance(shape[dim], int):
        return None
    dim, size = dim % len(shape), shape[dim]
    if op.target is aten.select.int:
        index = args[1]
        return (dim, index % size, index % size + 1) if isinstance(index, int) and -size <= index < size else None
    if op.target is aten.slice.Tensor:
        start, stop, step = args[1:4]
        if step != 1 or not all(v is None or isinstance(v, int) for v in (start, stop)):
            return None
        start, stop, _ = slice(start, stop).indices(size)
        return (dim, start, stop) if start < stop else None
    if piece is None or piece.target is not operator.getitem or piece.args[0] is not op \
            or not isinstance(piece.args[1], int):
        return None
    # The pieces' sizes as the trace gave them (an unbind's pieces lose the dim: one each).
    sizes = [1 if op.target is aten.unbind.int else p.shape[dim] for p in op.meta["val"]]
    if not all(isinstance(n, int) for n in sizes):
        return None
    start = sum(sizes[:piece.args[1]])
    return dim, start, start + sizes[piece.args[1]]


def _explicit_dropout_masks(gm: fx.GraphModule, analysis: BatchAnalysis) -> None:
    """Draw the mask of a dropout of a parameter-only value as its own op.

    Such a dropout (timm's relative-position MLPs keep a ``Dropout(0.125)`` on their
    table) draws one mask for the whole batch. The backward runs the parameter
    transform again for each sample, which must see the forward's mask: drawn apart,
    the noise becomes an input of the transform (``_extract_transform``).

    Before::

        dropout = torch.ops.aten.dropout.default(table, 0.5, True)

    After::

        rand_like = torch.ops.aten.rand_like.default(table)
        ge = torch.ops.aten.ge.Scalar(rand_like, 0.5)
        mul = torch.ops.aten.mul.Tensor(table, ge)
        mul_1 = torch.ops.aten.mul.Tensor(mul, 2.0)
    """
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target is torch.ops.aten.dropout.default
                and node in analysis.param_only):
            continue
        x, p, train = (*node.args, *[None] * (3 - len(node.args)))[:3]
        if not train or not isinstance(p, (int, float)) or p == 0:
            continue
        with gm.graph.inserting_before(node):
            noise = gm.graph.call_function(torch.ops.aten.rand_like.default, (x,))
            keep = gm.graph.call_function(torch.ops.aten.ge.Scalar, (noise, p))
            kept = gm.graph.call_function(torch.ops.aten.mul.Tensor, (x, keep))
            out = gm.graph.call_function(torch.ops.aten.mul.Tensor, (kept, 1.0 / (1.0 - p) if p < 1 else 0.0))
        value = node.meta["val"]
        with value.fake_mode:
            mask = value.to(torch.bool)
        for new in (noise, keep, kept, out):
            new.meta.update(node.meta)
            analysis.param_only[new] = analysis.param_only[node]
            analysis.batch[new] = None
        keep.meta["val"] = mask
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)


def _config(rule, node: fx.Node, broadcast) -> dict:
    config = rule.config(node.args)
    if rule.op is aten.expand.default and broadcast is not None:
        config = {**config, "batch_dim": broadcast.batch_dim}
    return config


def _tag_function(gm: fx.GraphModule, node: fx.Node, sites: list, analysis: BatchAnalysis,
                  param_names: dict[fx.Node, str], counts: collections.Counter) -> None:
    """Tag a ``torch.autograd.Function`` call (``fxdp/functions.py``): its parameter
    operands get markers, fed by a registered rule's operands or, without one, by
    everything its backward receives (``backward_rule``)."""
    call = function_call(node)
    batch = analysis.batch
    operands = list(node.args[2:])
    out_batch = node.meta["fxdp_function_batch"][0]
    use_ids, specs, extra_args = {}, {}, {}
    held = []  # the uses, until the tagged call holds them
    for site in sites:
        i = site.index - 2
        if site.generic:
            param_rule, specs[i], operand_batch = backward_rule(node, site.index)
        else:
            param_rule = function_param_rule(node, site.index)
            specs[i] = registered_operands(param_rule, call)
            operand_batch = []
            for kind, j in specs[i]:
                b = out_batch[j] if kind == "grad" else batch.get(operands[j])
                is_param = kind == "operand" and (operands[j] in param_names or operands[j] in analysis.param_only)
                operand_batch.append(b if isinstance(b, BatchDim) else (RAW if is_param else WHOLE))
        if site.kind == "transform":
            transform, inputs = _extract_transform(node.args[site.index], analysis.param_only, set(param_names))
            extra_args[i] = inputs
            operand_batch = operand_batch + [RAW] * len(inputs)
            source_names = [param_names[n] for n in inputs[: transform.num_sources]]
        else:
            transform, source_names = None, [param_names[node.args[site.index]]]
        use = new_use(
            rule=param_rule, param=", ".join(source_names), module_path=module_path_of(node),
            operand_batch=operand_batch, config={}, transform=transform,
            strategy_hint="generic" if site.generic else None, source_names=source_names)
        held.append(use)
        use_ids[i] = use.use_id
        counts[param_rule.name] += 1
    tagged = TaggedFunction(call, use_ids, specs, {i: len(v) for i, v in extra_args.items()})
    flat_extras = [n for i in sorted(extra_args) for n in extra_args[i]]
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(tagged, (*operands, *flat_extras))
    new.meta.update(node.meta)
    new.meta["fxdp"] = {
        "rule": ", ".join(USES[u].rule.name for u in use_ids.values()),
        "params": [USES[u].param for u in use_ids.values()],
        "use_ids": list(use_ids.values()),
    }
    batch[new] = batch.get(node)
    bodies = node.args[:2]
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    for body in bodies:  # they now live in the tagged call
        if not body.users:
            gm.graph.erase_node(body)


def tag_pass(gm: fx.GraphModule, analysis: BatchAnalysis, param_names: dict[fx.Node, str],
             excluded: set[str]) -> tuple[fx.GraphModule, dict[str, int]]:
    """Tag every per-sample use of a trainable parameter; detach excluded parameters.

    Args:
        gm: Canonical graph, analysed by ``batch_dim_pass``.
        analysis: Its batch analysis.
        param_names: Trainable-parameter placeholders and their names.
        excluded: Parameters refused with ``strict=False``: their uses see a detached
            value, so they get no gradient at all.

    Returns:
        The graph (changed in place) and how many times each rule fired.
    """
    counts: collections.Counter = collections.Counter()
    sites_by_node: dict[fx.Node, list] = collections.defaultdict(list)
    for site in analysis.uses:
        if any(param_names[p] in excluded for p in site.sources):
            continue
        sites_by_node[site.node].append(site)

    for p, name in param_names.items():
        if name in excluded:
            with gm.graph.inserting_after(p):
                detached = gm.graph.call_function(torch.ops.aten.detach.default, (p,))
            p.replace_all_uses_with(detached, delete_user_cb=lambda u: u is not detached)

    if analysis.single:
        op_rule = _EMPTY_BATCH if analysis.empty else _BATCH_OF_ONE
        counts.update(_tag_whole_parameters(gm, param_names, excluded, op_rule))
        gm.graph.lint()
        gm.recompile()
        return gm, dict(counts)

    _explicit_dropout_masks(gm, analysis)
    batch = analysis.batch
    params = set(param_names)
    for node, sites in sites_by_node.items():
        if node.target is FUNCTION_APPLY:
            _tag_function(gm, node, sites, analysis, param_names, counts)
            continue
        if node.kwargs:
            # Keyword-only settings (alpha, value, beta) become positional in schema order,
            # so rules see them by index; the tagged op calls the ATen op by its schema.
            node.args, node.kwargs = schema_args(node.target, node.args, node.kwargs), {}
        broadcast = analysis.broadcasts.get(node)
        shared = SHARED if broadcast is not None else WHOLE
        if any(s.generic for s in sites):
            layouts = {i: _generic_layout(batch.get(a)) for i, a in enumerate(node.args) if isinstance(a, fx.Node)}
            rule = generic_rule(node.target, tuple(node.args), {s.index for s in sites}, layouts,
                                rule_layout(batch.get(node)))
        else:
            rule = lookup(node.target)
        use_ids, held = {}, []
        extra_args: dict[int, list[fx.Node]] = {}
        listed = [x for a in node.args if isinstance(a, (list, tuple)) for x in a if isinstance(x, fx.Node)]
        for site in sites:
            param_rule = rule.params[site.index]
            operand_batch = []
            trailing: list[fx.Node] = []
            substitutes = {}
            for position, s in enumerate(param_rule.operands):
                if s == GRAD:
                    value = node
                else:
                    value = node.args[s] if s < len(node.args) else (
                        listed[s - len(node.args)] if s - len(node.args) < len(listed) else None)
                b = batch.get(value)
                if s == GRAD and broadcast is not None:
                    b = BatchDim(broadcast.batch_dim)  # a merged batch's copies summed (see _Tagged)
                if s == GRAD and isinstance(b, (list, tuple)):
                    b = b[0]  # a multi-output op's first (differentiable) output
                if isinstance(b, Groups):  # the offsets of sorted rows: their keys instead
                    substitutes[position] = len(trailing)
                    trailing.append(b.keys)
                    b = batch.get(b.keys)
                if s != GRAD and (value in params or value in analysis.param_only) and not site.generic:
                    b = RAW if b is None else b
                if s != GRAD and s >= len(node.args):
                    # A tensor inside a list argument arrives as it is: the rule brings it to
                    # [B, …] (sorted rows are put back in batch order first).
                    b = dataclasses.replace(b, major=False) if isinstance(b, Rows) else None
                operand_batch.append(b if isinstance(b, (BatchDim, Rows))
                                     else (RAW if site.generic and s != GRAD else shared))
            for position, b in enumerate(operand_batch):
                if isinstance(b, Rows):  # put back in batch order by the sort's indices
                    operand_batch[position] = dataclasses.replace(b, order=len(trailing))
                    if b.column is None:
                        trailing.append(_sort_indices(gm, b.order))
                    else:  # the positions a nonzero found, and its mask (their shape)
                        trailing += [b.order, b.order.args[0]]
            transform = None
            if site.kind == "transform":
                transform, inputs = _extract_transform(node.args[site.index], analysis.param_only, params)
                extra_args[site.index] = inputs
                operand_batch += [RAW] * len(inputs)
                source_names = [param_names[n] for n in inputs[: transform.num_sources]]
            else:
                source_names = [param_names[node.args[site.index]]]
            if trailing:
                extra_args[site.index] = extra_args.get(site.index, []) + trailing
                operand_batch += [RAW] * len(trailing)
            if not source_names:
                raise UnsupportedError(
                    f"fxdp internal error: the parameter-only value {node.args[site.index]} that "
                    f"{op_name(node.target)} consumes reaches no trainable parameter through the ops fxdp "
                    "replays per sample, so its gradient would leave unclipped; please report the model.")
            use = new_use(
                rule=param_rule, param=", ".join(source_names),
                module_path=module_path_of(node), operand_batch=operand_batch,
                config=_config(rule, node, broadcast), transform=transform,
                strategy_hint="generic" if site.generic else None,
                source_names=source_names, num_trailing=len(trailing), substitutes=substitutes,
            )
            held.append(use)  # until the tagged op holds it
            use_ids[site.index] = use.use_id
            counts[param_rule.name] += 1
        tagged = TaggedOp(rule, use_ids, broadcast, extra_args={
            i: len(v) for i, v in extra_args.items()})
        flat_extras = [n for i in sorted(extra_args) for n in extra_args[i]]
        args = tuple(node.args) + tuple(flat_extras) + (broadcast.refs if broadcast is not None else ())
        # The batch-size reference is defined before the first user, maybe after the op.
        anchor = node if broadcast is None else _first_user(gm, node)
        with gm.graph.inserting_before(anchor):
            new = gm.graph.call_function(tagged, args, dict(node.kwargs))
        new.meta.update(node.meta)
        new.meta["fxdp"] = {
            "rule": ", ".join(rule.params[i].name for i in use_ids),
            "params": [USES[u].param for u in use_ids.values()],
            "use_ids": list(use_ids.values()),
        }
        # Later uses look their operands up by node: the new node inherits the analysis.
        batch[new] = batch.get(node)
        if node in analysis.param_only:
            analysis.param_only[new] = analysis.param_only[node]
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm, dict(counts)
