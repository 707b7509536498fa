"""Rewrite the partitioned backward graph: markers out, per-sample maths in.

For every trainable parameter of the graph the pass gathers the markers of its
uses, computes each sample's squared gradient norm as soon as their operands exist
(Gram-matrix ghost norm or instantiation, whichever the rule's cost model finds
cheaper for these sizes; an instantiated gradient smaller than its operands is kept,
see ``_Budget``), the per-sample norms and, with ``max_grad_norm``, the clip factors
once; then each marker becomes its rule's summed gradient of the *clipped* output
gradient (Book-Keeping: ``Σ_n c_n g_n aₙᵀ`` is one einsum of ``c ⊙ g`` and ``a``). Nothing
downstream of a marker runs before the factors are known, so the graph is rebuilt
by a two-phase interpreter traced with ``make_fx``. Extra outputs (norms, clip
factors, grad samples) are appended after the gradients::

    # before
    param_grad = torch.ops.fxdp.param_grad.default([tangents_1, relu], primals_4, 3)
    return (None, ..., param_grad, ...)
    # after (ghost strategy, T = 1)
    pow_1 = torch.ops.aten.pow.Tensor_Scalar(tangents_1, 2)   # fxdp: linear.weight ghost
    ...
    clamp = ...                                                # fxdp: clip factors
    mul_3 = torch.ops.aten.mul.Tensor(tangents_1, view_2)      # fxdp: linear.weight clipped
    mm = torch.ops.aten.mm.default(permute, relu)
    return (None, ..., mm, ..., norms, clamp)
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Any, Callable, Collection, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from fxdp._torch_internals import annotate, fake_mode_of, make_fx_traced, size_hint, views_as_reshapes, vmap_safe_solves
from fxdp.batching import RAW, Rows, batch_major_all, retrack, scale_batch, unpermute
from fxdp.clip_norm import max_grad_norm
from fxdp.errors import UnsupportedError
from fxdp.markers import USES, UseInfo
from fxdp.opaque import holding, run_opaque, symbolic_batch
from fxdp.options import Options
from fxdp.passes.batch_dims import reached
from fxdp.passes.tag import block_parts
from fxdp.passes.writes import writes_in_place
from fxdp.registry import GRAD, ghost_inner

__all__ = ["BackwardPlan", "backward_rewrite_pass", "unmarked_gradients", "gradient_outputs", "constant_gradients", "MARKER",
           "STABILITY_EPS"]

MARKER = torch.ops.fxdp.param_grad.default
# The clip factor is min(1, C / (‖g‖ + eps)), as in Opacus.
STABILITY_EPS = 1e-6


@dataclasses.dataclass
class ParamPlan:
    """How one parameter's norm is computed; what ``explain()`` prints."""

    name: str
    rule: str
    uses: int
    strategy: str
    costs: dict[str, float]
    placeholder_index: int


@dataclasses.dataclass
class BackwardPlan:
    """What the rewritten backward returns beyond the gradients.

    Attributes:
        num_grads: Outputs the original backward had (the gradients).
        params: One plan per trainable parameter, in output order of grad samples.
        has_clip_factors: Whether clip factors follow the norms.
        grad_sample_params: Placeholder indices (saved parameters) whose grad samples
            follow, in order.
        rule_counts: How often each rule fired in this graph.
        opaque_calls: The run-time VJPs the graph calls (``fxdp/opaque.py``): whoever
            runs the graph keeps the plan.
    """

    num_grads: int
    params: list[ParamPlan]
    has_clip_factors: bool
    grad_sample_params: list[int]
    rule_counts: dict[str, int]
    opaque_calls: list = dataclasses.field(default_factory=list)


def _descendants(gm: fx.GraphModule, roots: Sequence[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set(roots)
    for node in gm.graph.nodes:
        if node.op != "output" and any(a in seen for a in node.all_input_nodes):
            seen.add(node)
    return seen


def _run(node: fx.Node, env: dict, gm: fx.GraphModule) -> Any:
    args = fx.node.map_arg(node.args, lambda n: env[n])
    kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
    if node.op == "call_function":
        if node.target is torch.ops.aten.view.default:
            # A gradient fxdp computed (a marker's) may be laid out unlike the one the
            # backward was traced with; a reshape is the same view where one exists.
            return torch.ops.aten.reshape.default(*args, **kwargs)
        return node.target(*args, **kwargs)
    if node.op == "get_attr":
        obj = gm
        for part in node.target.split("."):
            obj = getattr(obj, part)
        return obj
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    raise NotImplementedError(f"fxdp cannot re-trace backward node {node.format_node()}")


def param_names_of(p: fx.Node, markers: list[fx.Node]) -> str:
    """The name of parameter placeholder ``p`` as its uses recorded it."""
    for m in markers:
        use = USES[m.args[2]]
        srcs = marker_sources(m)
        if p in srcs and len(use.source_names) == len(srcs):
            return use.source_names[srcs.index(p)]
    return USES[markers[0].args[2]].param


class _Budget:
    """Which instantiated per-sample gradients stay alive until the clip factors exist.

    Keeping ``P_n`` makes the clipped gradient ``Σ_n c_n P_n`` (no second contraction)
    and frees the marker operands at once, instead of holding them to the end of the
    backward. With ``memory_budget_bytes=None`` a gradient is kept where that saves
    memory: it is smaller than the operands it replaces (small weights over large
    activations: convolutions over big feature maps, norms' and biases' parameters).
    A number caps the bytes kept in all, however large each operand; ``grad_sample``
    keeps them all, as they exist anyway.
    """

    def __init__(self, options: Options):
        self.auto = options.memory_budget_bytes is None and not options.grad_sample
        if options.grad_sample:
            self.left = float("inf")
        else:
            self.left = options.memory_budget_bytes or 0

    @staticmethod
    def _bytes(t: torch.Tensor) -> int:
        return size_hint(t.numel()) * t.element_size()

    def fits(self, shape_numel: int, element_size: int, operands: Sequence[torch.Tensor]) -> bool:
        """Whether a per-sample gradient of this many elements would be kept."""
        size = size_hint(shape_numel) * element_size
        if self.auto:
            return size < sum(self._bytes(t) for t in operands)
        return size <= self.left

    def take(self, t: torch.Tensor) -> None:
        """Count ``t`` as kept (it ``fits``)."""
        if not self.auto:
            self.left -= self._bytes(t)


def _rule_groups(uses: list[UseInfo], ops: list[list[torch.Tensor]]):
    """Uses of one parameter by several rules, merged per rule, if every rule has a ghost
    norm and every pair a registered cross term; else ``None``."""
    groups: list[tuple[UseInfo, list[torch.Tensor]]] = []
    for use, o in zip(uses, ops):
        for i, (g_use, members) in enumerate(groups):
            if g_use.rule is use.rule and g_use.config == use.config:
                members.append(o)
                break
        else:
            groups.append((use, [o]))
    merged = []
    for use, members in groups:
        if use.rule.ghost_sq_norm is None:
            return None
        if len(members) > 1:
            if use.rule.concat_uses is None:
                return None
            members = [use.rule.concat_uses(members)]
        merged.append((use, members[0]))
    for i in range(len(merged)):
        for j in range(i + 1, len(merged)):
            if ghost_inner(merged[i][0].rule.name, merged[j][0].rule.name) is None:
                return None
    return merged


_HALF = (torch.float16, torch.bfloat16)


def _for_norms(operands: list) -> list:
    """A squared norm's operands, half-precision ones in float32: squares and Gram
    products of float16 values overflow at 65504 (a sample's gradient of norm 256) and
    underflow below 6e-8 (a mean's ``1/B`` squared), silently zeroing or dropping that
    sample's clip factor; bfloat16 keeps 8 bits of each product of a sum."""
    return [t.float() if isinstance(t, torch.Tensor) and t.dtype in _HALF else t for t in operands]


def _tied_sq_norm(groups) -> torch.Tensor:
    """``‖Σ_r ∂p_r‖² = Σ_r ‖∂p_r‖² + 2 Σ_{r<q} <∂p_r, ∂p_q>``, all by ghost norms."""
    total = None
    groups = [(use, _for_norms(ops)) for use, ops in groups]
    for i, (use, ops) in enumerate(groups):
        term = use.rule.ghost_sq_norm(*ops, **use.config)
        total = term if total is None else total + term
        for other, other_ops in groups[i + 1:]:
            fn = ghost_inner(use.rule.name, other.rule.name)
            total = total + 2 * fn(ops, use.config, other_ops, other.config)
    return total


def _choose(use: UseInfo, operands: list[torch.Tensor], keep: bool) -> tuple[str, dict]:
    """Ghost or instantiate, by the rule's cost model; ``keep``: the per-sample
    gradient would be kept, which saves the deferred contraction (``Σ_n c_n P_n``
    instead of a second pass over the operands), so instantiation wins."""
    rule = use.rule
    if rule.ghost_sq_norm is None or rule.costs is None:
        return "instantiate", {}
    costs = rule.costs([None if t is None else tuple(t.shape) for t in operands], **use.config)
    if keep:
        return "instantiate", costs
    return min(costs, key=costs.get), costs


def _per_sample_vjp(transform: Callable, sources: list[torch.Tensor], others: list,
                    cotangents: torch.Tensor) -> tuple:
    """``vjp(lambda *s: transform(*s, *others), sources)`` at each sample's cotangent
    (``cotangents`` ``[B, ...]``).

    The transform runs once per sample under ``vmap`` on copies of its sources, and one
    ordinary backward maps every cotangent. ``vmap`` over the VJP function instead would
    run the backward formulas under ``vmap``, where ``slice_backward`` reads its input's
    sizes as ints: a symbolic sequence length would be specialised, and every new length
    would recompile. Some forward batching rules read the batch size so (``embedding`` of
    a batched table): with a symbolic batch size the work is an opaque op
    (``fxdp/opaque.py``) that runs on the real tensors. So it is where the transform
    slices or writes at positions read from a tensor's values (escnn's basis blocks
    written into a filter at bounds the module holds as 0-d tensors), which ``vmap``
    needs as numbers: at run time they are.
    """
    batch_size = cotangents.shape[0]
    if not symbolic_batch(batch_size):
        # Expanded views of the sources: one per sample, nothing copied.
        copies = [s.detach().expand(batch_size, *s.shape).requires_grad_(True) for s in sources]
        try:
            with torch.enable_grad(), vmap_safe_solves():
                out = torch.func.vmap(lambda *c: transform(*c, *others))(*copies)
                grads = torch.autograd.grad(out, copies, cotangents, allow_unused=True)
            return tuple(torch.zeros_like(c) if g is None else g for c, g in zip(copies, grads))
        except GuardOnDataDependentSymNode:
            pass  # what the traced ops left behind is dead code
    return _per_sample_vjp_at_run_time(transform, sources, others, cotangents)


def _per_sample_vjp_at_run_time(transform: Callable, sources: list[torch.Tensor], others: list,
                                cotangents: torch.Tensor) -> tuple:
    """``_per_sample_vjp`` as one opaque op. The numbers among ``others`` (sizes, and
    positions read from tensors' values) go in as 0-d tensors, read at run time."""
    number_types = {torch.SymInt: torch.int64, torch.SymFloat: torch.float64, torch.SymBool: torch.bool}
    passed = [torch.scalar_tensor(o, dtype=number_types[type(o)]) if type(o) in number_types else o
              for o in others]
    tensors = [t for t in passed if isinstance(t, torch.Tensor)]
    read = [type(o) in number_types for o in others]

    def vjps(cotangents, *inputs):
        # Run below autograd, where only torch.func's own autograd records.
        sources_now, tensors_now = inputs[:len(sources)], iter(inputs[len(sources):])
        others_now = [(next(tensors_now).item() if number else next(tensors_now)) if isinstance(t, torch.Tensor)
                      else t for t, number in zip(passed, read)]
        copies = [s.detach().expand(cotangents.shape[0], *s.shape) for s in sources_now]
        with vmap_safe_solves():
            _, vjp_fn = torch.func.vjp(
                lambda *cs: torch.func.vmap(lambda *c: transform(*c, *others_now))(*cs), *copies)
        return vjp_fn(cotangents)

    def shapes(cotangents, *inputs):
        return [cotangents.new_empty((cotangents.shape[0], *s.shape), dtype=s.dtype) for s in inputs[:len(sources)]]

    return tuple(run_opaque(lambda *ts: list(vjps(*ts)), shapes, (cotangents, *sources, *tensors)))


def _blocks_in_place(param: torch.Tensor, blocks: list[tuple[tuple, fx.GraphModule, torch.Tensor]]) -> torch.Tensor:
    """``[B, *param.shape]`` from the per-sample gradients of disjoint blocks of
    ``param`` (``(Transform.block, Transform.module, [B, *derived])`` each, one rearranged
    space and dim, see ``in_blocks``): each block's own rearrangements undone, the blocks
    and zeros between them joined by one ``cat`` along their dim, the parameter's
    rearrangements undone once (a per-sample VJP of each use's whole transform would
    write a ``[B, *param.shape]`` tensor per block)."""
    prefix = block_parts(blocks[0][1])[0]
    rearranged = param if prefix is None else prefix(param)
    dim, batch = blocks[0][0][1], blocks[0][2].shape[0]
    pieces, at = [], 0

    def along(size: int) -> list:
        """``[B, *rearranged.shape]`` with ``size`` positions along ``dim``."""
        shape = list(rearranged.shape)
        shape[dim] = size
        return [batch, *shape]

    for (_, _, start, stop), module, grad in sorted(blocks, key=lambda b: b[0][2:]):
        _, take, post = block_parts(module)
        if post is not None:
            (grad,) = _per_sample_vjp(post, [take(rearranged)], [], grad)
        if start > at:
            pieces.append(grad.new_zeros(along(start - at)))
        pieces.append(grad.reshape(along(stop - start)))  # a select's block gets its dim back
        at = stop
    if at < rearranged.shape[dim]:
        pieces.append(pieces[-1].new_zeros(along(rearranged.shape[dim] - at)))
    whole = torch.cat(pieces, dim + 1)
    return whole if prefix is None else _per_sample_vjp(prefix, [param], [], whole)[0]


def _sq_norms(per_sample: torch.Tensor, numel: int) -> torch.Tensor:
    """``[B]`` squared norms of per-sample gradients ``[B, ...]`` of ``numel`` entries
    each: ``Σ |g|²``, complex values included (a batch of one; larger batches refuse
    them, see batch_dims.py)."""
    if per_sample.is_complex():
        per_sample, numel = torch.view_as_real(per_sample), 2 * numel
    (flat,) = _for_norms([per_sample.reshape(per_sample.shape[0], numel)])
    return flat.pow(2).sum(1)


def _per_sample_shaped(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A rule's per-sample gradient as ``[B, *shape]``; a parameter without elements
    leaves no size for ``-1`` to infer."""
    return grad.reshape(-1, *shape) if shape.numel() else grad.reshape(grad.shape[0], *shape)


def unmarked_gradients(bw_gm: fx.GraphModule, params: dict[int, str],
                       checked: Collection[fx.Node] = ()) -> list[str]:
    """The parameters whose gradient has a part that no marker made per-sample.

    Every part of a trainable parameter's gradient must reach it through a marker (its
    rule's summed gradient, replaced by the clipped one). A path from an output gradient
    (``tangents_*``) to the parameter's gradient output that passes no marker would be
    the ordinary, unclipped gradient: a hole in the analysis or the tagging, caught
    here so that it raises instead of leaking.

    Args:
        bw_gm: The partitioned backward graph, before the rewrite.
        params: Output index of each trainable parameter's gradient (the index of its
            forward input) and its name.
        checked: Output gradients that are checked to be zero at run time (see
            ``stored_gradients``): their paths add nothing.
    """
    return [name for _, name, grad in _parameter_gradients(bw_gm, params)
            if any(n.op == "placeholder" and n.name.startswith("tangents") and n not in checked
                   for n in _upstream(grad))]


def stored_gradients(bw_gm: fx.GraphModule, params: dict[int, str]) -> dict[fx.Node, list[str]]:
    """The output gradients (``tangents_*``) that reach parameters' gradients through no
    marker at all, and those parameters' names.

    They are the gradients of forward outputs computed from parameters alone, as a value
    the forward stores (``torch.nn.utils.prune``'s ``module.weight``, see
    ``BatchAnalysis.stored``): a loss that does not use the value sends zeros, which the
    backward runner checks before it runs. An output gradient that reaches any marker is
    an output computed with the batch, never one of these.
    """
    grads = {grad: name for _, name, grad in _parameter_gradients(bw_gm, params)}
    found: dict[fx.Node, list[str]] = {}
    for tangent in (n for n in bw_gm.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")):
        seen = reached([tangent], lambda n: n.users)
        if not any(n.op == "call_function" and n.target is MARKER for n in seen):
            names = sorted(grads[n] for n in seen if n in grads)
            if names:
                found[tangent] = names
    return found


def constant_gradients(bw_gm: fx.GraphModule, params: dict[int, str]) -> list[int]:
    """The parameters whose gradient reaches them through no marker: a constant.

    With ``unmarked_gradients`` empty, such a gradient does not depend on the output
    gradients, and being linear in them it is zero: an op of zero derivative
    (``torch.round``) whose backward Inductor folded into a constant, taking the marker
    with it, or a marker the partitioner moved into the forward. These parameters
    still need their (zero) grad samples.

    Args:
        bw_gm: The partitioned backward graph, before the rewrite.
        params: Output index of each trainable parameter's gradient and its name.

    Returns:
        Their output indices.
    """
    return [index for index, _, grad in _parameter_gradients(bw_gm, params)
            if not any(n.op == "call_function" and n.target is MARKER for n in _upstream(grad))]


def _parameter_gradients(bw_gm: fx.GraphModule, params: dict[int, str]):
    """``(output index, name, node)`` of each parameter gradient the backward computes."""
    grads = next(n for n in bw_gm.graph.nodes if n.op == "output").args[0]
    for index, name in params.items():
        grad = grads[index] if index < len(grads) else None
        if isinstance(grad, fx.Node):
            yield index, name, grad


def marker_sources(m: fx.Node) -> list[fx.Node]:
    """The parameter placeholders whose gradient marker ``m`` carries (the sources of its
    use's transform, or its one parameter)."""
    use = USES[m.args[2]]
    if use.transform is None:
        return [m.args[1]]
    k = use.num_rule_operands
    return list(m.args[0][k: k + use.transform.num_sources])


def gradient_outputs(bw_gm: fx.GraphModule, params: dict[int, str]) -> dict[int, int]:
    """Where each parameter's gradient leaves the backward: its placeholder's index (the
    parameter, saved for the backward) → the output index of its gradient. The markers
    name their sources (``USES``), and ``params`` names the outputs."""
    placeholders = [n for n in bw_gm.graph.nodes if n.op == "placeholder"]
    output_of = {name: index for index, name, _ in _parameter_gradients(bw_gm, params)}
    found: dict[int, int] = {}
    for m in (n for n in bw_gm.graph.nodes if n.op == "call_function" and n.target is MARKER):
        sources, names = marker_sources(m), USES[m.args[2]].source_names
        if len(sources) == len(names):
            found.update((placeholders.index(p), output_of[name]) for p, name in zip(sources, names)
                         if name in output_of)
    return found


def _upstream(grad: fx.Node):
    """The nodes ``grad`` is computed from, itself included; a marker is one of them,
    but what it reads is not (the rewrite replaces it)."""
    stack, seen = [grad], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        if not (node.op == "call_function" and node.target is MARKER):
            stack.extend(node.all_input_nodes)


def backward_rewrite_pass(bw_gm: fx.GraphModule, options: Options, *,
                          decompositions: dict | None = None,
                          clip_norm_key: int | None = None) -> tuple[fx.GraphModule, BackwardPlan]:
    """Rewrite ``bw_gm`` so it emits clipped gradients, norms and grad samples.

    Args:
        bw_gm: The backward graph from AOTAutograd's partitioner, with markers.
        options: The transform's options.
        decompositions: Decomposition table for the re-trace (Inductor's).
        clip_norm_key: The ``ClipNorm`` the clip factors read ``C`` from at run time;
            ``None``: ``options.max_grad_norm`` as a constant.

    Returns:
        The new backward graph and the plan of its extra outputs.
    """
    nodes = list(bw_gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output_node = nodes[-1]
    markers = [n for n in nodes if n.op == "call_function" and n.target is MARKER]
    deferred = _descendants(bw_gm, markers)

    keep = options.grad_sample
    by_param: dict[fx.Node, list[fx.Node]] = collections.OrderedDict()
    for m in markers:
        for p in marker_sources(m):
            by_param.setdefault(p, []).append(m)

    def is_simple(p: fx.Node) -> bool:
        """Norms can be taken in the rule's own space (ghost norms possible)."""
        ms = by_param[p]
        for m in ms:
            use = USES[m.args[2]]
            if use.strategy_hint == "generic":
                return False
            if use.transform is not None and (keep or not use.transform.isometric or len(ms) > 1):
                return False
        return True

    def in_blocks(p: fx.Node) -> bool:
        """Each use takes a block of ``p`` of its own (``Transform.block``: ``w[e]`` for
        expert ``e``, ``w[:d]`` and ``w[d:]``): the gradients land in disjoint places, so
        the per-sample squared norms add over the uses, each taken in its rule's space
        (ghost norms possible), no ``[B, *p.shape]`` gradient per use; with ``grad_sample``
        each block's is put in its place of one (``_blocks_in_place``)."""
        uses = [USES[m.args[2]] for m in by_param[p]]
        if any(u.strategy_hint == "generic" or u.transform is None or u.transform.block is None for u in uses):
            return False
        blocks = sorted(u.transform.block for u in uses)
        return len({b[:2] for b in blocks}) == 1 and all(a[3] <= b[2] for a, b in itertools.pairwise(blocks))

    plans: list[ParamPlan] = []
    rule_counts: collections.Counter = collections.Counter()
    for m in markers:
        rule_counts[USES[m.args[2]].rule.name] += 1
    clip = options.max_grad_norm is not None

    # Each parameter's norm is taken as soon as its markers' operands exist: before the
    # input gradients that follow them, so per-sample work never overlaps their buffers,
    # and the operands of a layer whose per-sample gradient is kept die there, not at
    # the end of the backward.
    position = {n: i for i, n in enumerate(nodes)}
    params_at: dict[fx.Node, list[fx.Node]] = collections.defaultdict(list)
    for p, ms in by_param.items():
        needed = [n for m in ms for n in (*m.args[0], m.args[1]) if isinstance(n, fx.Node)]
        ready = max(needed, key=position.__getitem__, default=nodes[0])
        # An operand computed from another marker's gradient waits for the markers.
        params_at[ms[-1] if any(n in deferred for n in needed) else ready].append(p)

    def rewritten(*args):
        env: dict[fx.Node, Any] = dict(zip(placeholders, args))
        pool = list(args)  # the sizes the trace knows, to rebuild symbolic batch layouts

        def major_operands(m: fx.Node) -> list[torch.Tensor]:
            use = USES[m.args[2]]
            k = use.num_rule_operands
            values = [None if o is None else env[o] for o in m.args[0][:k]]
            layouts = list(use.operand_batch[:k])
            if use.num_trailing:
                # Rows sorted across the batch, put back in batch order (``Rows``).
                trailing = [env[o] for o in m.args[0][len(m.args[0]) - use.num_trailing:]]
                for i, j in use.substitutes.items():
                    values[i] = trailing[j]
                for i, b in enumerate(layouts):
                    if isinstance(b, Rows):
                        mask = None if b.found is None else trailing[b.order + 1]
                        values[i] = unpermute(values[i], trailing[b.order], b, mask)
                        layouts[i] = b.in_batch_order if b.major else RAW
            return batch_major_all(values, [retrack(b, pool) for b in layouts])

        def per_sample_in_param_space(m: fx.Node) -> dict[fx.Node, torch.Tensor]:
            use = USES[m.args[2]]
            derived = env[m.args[1]]
            psg = use.rule.per_sample_grad(*major_operands(m), **use.config)
            psg = psg.reshape(psg.shape[0], *derived.shape).to(derived.dtype)
            if use.transform is None:
                return {m.args[1]: psg}
            k, n = use.num_rule_operands, use.transform.num_sources
            inputs = [env[o] for o in m.args[0][k: len(m.args[0]) - use.num_trailing]]
            sources, others = inputs[:n], inputs[n:]

            try:
                mapped = _per_sample_vjp(use.transform.module, sources, others, psg)
            except RuntimeError as e:
                if "called random operation while in randomness error mode" in str(e):
                    raise UnsupportedError(
                        f"fxdp cannot map the per-sample gradients of "
                        f"{', '.join(use.source_names or [use.param])} back through the computation that makes "
                        f"the value {use.module_path or 'the model'} uses from them: it draws random numbers (a "
                        "reparameterised draw of parameters with no batch dim, "
                        "torch.distributions.Dirichlet(softplus(a)).rsample(), one draw shared by the batch), "
                        "which fxdp would have to draw again for each sample. Draw one for each sample instead, "
                        "with the batch's shape (rsample((B,)))") from None
                if "Batching rule not implemented" not in str(e):
                    raise
                raise UnsupportedError(
                    f"fxdp cannot map the per-sample gradients of {', '.join(use.source_names or [use.param])} "
                    f"back through the computation that makes the value {use.module_path or 'the model'} uses "
                    "from them: it runs it for each sample with torch.func.vmap, and an op there has no "
                    "batching rule (a fused observer of quantisation-aware training on a weight). Compute "
                    f"that value with other ops. PyTorch's error: {str(e).splitlines()[0]}") from None
            return dict(zip(m.args[0][k: k + n], mapped))

        batch_size = None
        sq_norms = []
        grad_samples: dict[fx.Node, torch.Tensor] = {}
        # Per-sample gradients kept until the clip factors are known (strategy 3 of
        # DESIGN.md): the clipped gradient is then Σ_n c_n P_n, no second contraction.
        kept: dict[fx.Node, torch.Tensor] = {}
        # With grad_sample, each block use's per-sample gradient, for its clipped sum.
        kept_blocks: dict[fx.Node, torch.Tensor] = {}
        budget = _Budget(options)
        mapped_cache: dict[fx.Node, dict] = {}
        plan_of: dict[fx.Node, ParamPlan] = {}

        def norm_of(p: fx.Node) -> None:
            nonlocal batch_size
            ms = by_param[p]
            uses = [USES[m.args[2]] for m in ms]
            param = env[p]
            first = uses[0]
            if is_simple(p):
                ops = [major_operands(m) for m in ms]
                if batch_size is None:
                    batch_size = ops[0][0].shape[0]
                same_rule = all(u.rule is first.rule and u.config == first.config for u in uses)
                if same_rule and len(ms) > 1 and first.rule.concat_uses is not None:
                    merged = first.rule.concat_uses(ops)
                elif len(ms) == 1:
                    merged = ops[0]
                else:
                    merged = None
                # Here every marker's argument is ``p`` or an isometric transform of it (an
                # autocast cast, a transpose): kept per-sample gradients sum to that
                # argument's gradient, which the backward maps to ``p`` as usual.
                derived = env[ms[0].args[1]]
                operands = [t for o in ops for t in o if isinstance(t, torch.Tensor)]
                fits = budget.fits(batch_size * param.numel(), derived.element_size(), operands)
                # Uses by several rules (a tied embedding and head) go by ghost cross terms.
                keepable = keep or (same_rule and fits)
                groups = None if (merged is not None or keepable) else _rule_groups(uses, ops)
                if groups is not None:
                    strategy, costs = "ghost (tied across rules)", {}
                else:
                    strategy, costs = ("instantiate", {}) if merged is None else _choose(first, merged, keepable)
                info = {"rule": ", ".join(sorted({u.rule.name for u in uses})), "param": first.param,
                        "strategy": strategy, "module": first.module_path}
                with annotate({"fxdp": info}):
                    if groups is not None:
                        sq = _tied_sq_norm(groups)
                    elif strategy == "ghost":
                        sq = first.rule.ghost_sq_norm(*_for_norms(merged), **first.config)
                    else:
                        psg = None
                        for use, o in zip(uses, ops):
                            g = _per_sample_shaped(use.rule.per_sample_grad(*o, **use.config), param.shape)
                            psg = g if psg is None else psg + g
                        sq = _sq_norms(psg, param.numel())
                        if keep:
                            grad_samples[p] = psg
                        if fits:
                            budget.take(psg)
                            kept[p] = psg
                            strategy = "instantiate + keep"
            elif in_blocks(p):
                sq, strategies, costs = None, set(), collections.Counter()
                blocks = []  # with grad_sample: (block, transform, [B, *derived]) of each use
                for m, use in zip(ms, uses):
                    ops = major_operands(m)
                    if batch_size is None:
                        batch_size = ops[0].shape[0]
                    strategy, use_costs = _choose(use, ops, keep)
                    strategies.add(strategy)
                    costs.update(use_costs)
                    info = {"rule": use.rule.name, "param": use.param, "strategy": f"{strategy} (a block)",
                            "module": use.module_path}
                    with annotate({"fxdp": info}):
                        if strategy == "ghost":
                            block = use.rule.ghost_sq_norm(*_for_norms(ops), **use.config)
                        else:
                            derived = env[m.args[1]]
                            grad = _per_sample_shaped(use.rule.per_sample_grad(*ops, **use.config), derived.shape)
                            block = _sq_norms(grad, derived.numel())
                            if keep:
                                # Kept for the clipped sum, as a kept whole parameter's: the
                                # operands die here (under Inductor the cat writes these in place).
                                kept_blocks[m] = grad.to(derived.dtype)
                                blocks.append((use.transform.block, use.transform.module, kept_blocks[m]))
                    sq = block if sq is None else sq + block
                strategy = f"{' / '.join(sorted(strategies))} per block"
                if keep:
                    info = {"rule": ", ".join(sorted({u.rule.name for u in uses})), "param": param_names_of(p, ms),
                            "strategy": "per-sample gradients of the blocks in place", "module": first.module_path}
                    with annotate({"fxdp": info}):
                        grad_samples[p] = _blocks_in_place(param, blocks)
            else:
                strategy, costs = "instantiate (per-sample VJP)", {}
                info = {"rule": ", ".join(sorted({u.rule.name for u in uses})), "param": param_names_of(p, ms),
                        "strategy": strategy, "module": first.module_path}
                with annotate({"fxdp": info}):
                    psg = None
                    for m in ms:
                        if m not in mapped_cache:
                            mapped_cache[m] = per_sample_in_param_space(m)
                        g = _per_sample_shaped(mapped_cache[m][p], param.shape)
                        psg = g if psg is None else psg + g
                    if batch_size is None:
                        batch_size = psg.shape[0]
                    sq = _sq_norms(psg, param.numel())
                    if keep:
                        grad_samples[p] = psg
            sq_norms.append(sq)
            plan_of[p] = ParamPlan(
                name=param_names_of(p, ms), rule=", ".join(sorted({u.rule.name for u in uses})),
                uses=len(ms), strategy=strategy,
                costs={k: float(v) for k, v in costs.items()},
                placeholder_index=placeholders.index(p),
            )

        for node in nodes:
            if node.op == "output":
                continue
            if node.op != "placeholder" and node not in deferred:
                env[node] = _run(node, env, bw_gm)
            for p in params_at.get(node, ()):
                norm_of(p)
        plans.extend(plan_of[p] for p in by_param)

        extras: list[torch.Tensor] = []
        factors = None
        with annotate({"fxdp": {"rule": "clip", "strategy": "norms and clip factors"}}):
            if sq_norms:
                total = torch.stack([s.float() if s.dtype in _HALF else s for s in sq_norms]).sum(0)
            else:
                total = torch.zeros(0)
            scale = batch_size if (options.loss_reduction == "mean" and batch_size is not None) else 1
            # A Gram-matrix sum cancels: where a norm is tiny against its terms it can come
            # out a rounding error below zero, whose root would be NaN.
            norms = total.clamp_min(0).sqrt() * scale
            extras.append(norms)
            if clip:
                # C read at run time (fxdp/clip_norm.py) where the backend holds one
                c = options.max_grad_norm if clip_norm_key is None else max_grad_norm(clip_norm_key, norms)
                factors = (c / (norms + STABILITY_EPS)).clamp(max=1.0)
                extras.append(factors)

        # A kept parameter's clipped sum goes to its first marker (the others get zeros), a
        # kept block's to its own.
        kept_sums = [(by_param[p][0], by_param[p][1:], psg) for p, psg in kept.items()]
        kept_sums += [(m, [], psg) for m, psg in kept_blocks.items()]
        for first, rest, psg in kept_sums:
            use = USES[first.args[2]]
            info = {"rule": use.rule.name, "param": use.param,
                    "strategy": "clipped sum of kept per-sample gradients" if clip else "summed kept gradients",
                    "module": use.module_path}
            with annotate({"fxdp": info}):
                weights = factors.to(psg.dtype) if clip else psg.new_ones(psg.shape[0])
                derived = env[first.args[1]]
                env[first] = torch.tensordot(weights, psg, dims=1).reshape(derived.shape).to(derived.dtype)
                for m in rest:
                    env[m] = torch.zeros_like(env[m.args[1]])
        for m in markers:
            if m not in env:
                use = USES[m.args[2]]
                info = {"rule": use.rule.name, "param": use.param,
                        "strategy": "clipped sum" if clip else "summed gradient", "module": use.module_path}
                with annotate({"fxdp": info}):
                    ops = major_operands(m)
                    derived = env[m.args[1]]
                    if clip and use.rule.weighted_sum_grad is not None:
                        grad = use.rule.weighted_sum_grad(factors, *ops, **use.config)
                    else:
                        if clip:
                            ops = [scale_batch(t, factors) if s == GRAD else t
                                   for t, s in zip(ops, use.rule.operands)]
                        grad = use.rule.sum_grad(*ops, **use.config)
                    env[m] = grad.reshape(derived.shape).to(derived.dtype)
        for node in nodes:
            if node in deferred and node not in env:
                env[node] = _run(node, env, bw_gm)
        outs = fx.node.map_arg(output_node.args[0], lambda n: env[n])
        for p in by_param:
            if p in grad_samples:
                extras.append(grad_samples[p] * scale)
        return (*outs, *extras)

    fake_args = [p.meta["val"] for p in placeholders]
    # AOTAutograd's backward placeholders may live in a fake mode of their own.
    fake_mode = fake_mode_of([a for a in fake_args if isinstance(a, torch.Tensor)])
    with holding() as opaque_calls:
        new_gm = make_fx_traced(rewritten, fake_args, fake_mode=fake_mode, decompositions=decompositions)
        if any(writes_in_place(n.target) for n in new_gm.graph.nodes):
            # A derivative formula that writes in place, traced into a per-sample VJP
            # (householder_product's writes into views of its intermediates: Inductor's
            # scheduler cannot order them; scatter_reduce's mean ``masked_fill_`` of its
            # counts: Inductor on one thread compiled it wrong). Written out of place, as
            # AOTAutograd hands Inductor every other graph.
            # (A ``view`` the first trace took of a strided gradient may not be one of the
            # functionalised value's layout: a ``reshape``, the same view where one exists.)
            new_gm = make_fx_traced(torch.func.functionalize(fx.Interpreter(views_as_reshapes(new_gm)).run,
                                                             remove="mutations"),
                                    fake_args, fake_mode=fake_mode)
    new_gm.graph.eliminate_dead_code()
    out = next(n for n in reversed(new_gm.graph.nodes) if n.op == "output")
    num_grads = len(output_node.args[0])
    visible = output_node.meta.get("user_visible_output_idxs")
    if visible is not None:
        out.meta["user_visible_output_idxs"] = list(visible) + list(range(num_grads, len(out.args[0])))
    for node in new_gm.graph.nodes:
        if "custom" in node.meta and "fxdp" in node.meta["custom"]:
            node.meta["fxdp"] = node.meta["custom"]["fxdp"]
    new_gm.graph.lint()
    new_gm.recompile()
    plan = BackwardPlan(
        num_grads=num_grads,
        params=plans,
        has_clip_factors=clip,
        grad_sample_params=[placeholders.index(p) for p in by_param] if keep else [],
        rule_counts=dict(rule_counts),
        opaque_calls=opaque_calls,
    )
    return new_gm, plan
