"""Replace each op that consumes a trainable parameter by its tagged version.

Before::

    linear = torch.ops.aten.linear.default(x, w, b)

After (``meta["fxdp"]`` holds rule, parameter and use id)::

    fxdp_linear = fxdp_linear(x, w, b)    # autograd.Function: aten.linear forward,
                                          # fxdp::param_grad markers in backward
"""
from __future__ import annotations

import collections

import torch
import torch.fx as fx

from fxdp.batching import SHARED, WHOLE
from fxdp.markers import USES, TaggedOp, UseInfo, new_use_id
from fxdp.passes.batch_dims import BatchAnalysis, module_path_of
from fxdp.registry import GRAD, lookup

__all__ = ["tag_pass"]


def _first_user(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return min(node.users, key=order.__getitem__)


def tag_pass(gm: fx.GraphModule, analysis: BatchAnalysis, param_names: dict[fx.Node, str],
             excluded: set[str]) -> tuple[fx.GraphModule, dict[str, int]]:
    """Tag every rule'd use of a trainable parameter; detach excluded parameters.

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
    uses_by_node: dict[fx.Node, dict[int, fx.Node]] = collections.defaultdict(dict)
    for p, uses in analysis.param_uses.items():
        if param_names[p] in excluded:
            continue
        for node, index in uses:
            uses_by_node[node][index] = p

    for p, name in param_names.items():
        if name in excluded:
            with gm.graph.inserting_after(p):
                detached = gm.graph.call_function(torch.ops.aten.detach.default, (p,))
            p.replace_all_uses_with(detached, delete_user_cb=lambda u: u is not detached)

    for node, params in uses_by_node.items():
        rule = lookup(node.target)
        use_ids = {}
        for index, p in params.items():
            param_rule = rule.params[index]
            batch = analysis.batch
            shared = SHARED if node in analysis.broadcasts else WHOLE
            operand_batch = [
                (batch.get(node) if s == GRAD else batch.get(node.args[s])) or shared
                for s in param_rule.operands
            ]
            use_id = new_use_id()
            USES[use_id] = UseInfo(
                use_id=use_id, rule=param_rule, param=param_names[p],
                module_path=module_path_of(node), operand_batch=operand_batch,
                config=rule.config(node.args),
            )
            use_ids[index] = use_id
            counts[param_rule.name] += 1
        broadcast = analysis.broadcasts.get(node)
        tagged = TaggedOp(rule, use_ids, broadcast)
        args = tuple(node.args) + ((broadcast.ref,) if broadcast is not None else ())
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
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm, dict(counts)
