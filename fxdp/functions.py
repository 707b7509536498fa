"""``torch.autograd.Function`` calls, kept with their hand-written backward.

Dynamo captures ``MyFn.apply(x, w)`` as the higher-order op
``autograd_function_apply(fwd_body, bwd_body, *operands)``, whose two bodies are
``forward`` and ``backward`` as graphs. ``make_fx`` (canonicalisation) would inline
the forward and lose the backward, so the call crosses canonicalisation as the
opaque op ``fxdp::function_apply`` and comes back as the higher-order op after it::

    autograd_function_apply = autograd_function_apply(fwd_body_0, bwd_body_0, linear, ...)

AOTAutograd then traces both bodies, as it does under ``torch.compile``.

- **Batch analysis** (``function_batch``): the forward body is canonicalised and
  analysed with the operands' batch dims, which gives the outputs' batch dims; the
  backward body is analysed for the gradients of the batched operands. Either one
  mixing samples refuses the call, naming the Function.
- **Parameters** consumed by the call get per-sample gradients from a rule registered
  for the Function class (``fxdp.register_rule(OpRule(op=MyFn, params=...))``), or
  else from its own backward run on each sample as a batch of one under ``vmap``
  (``_backward_per_sample``). The tagged call (``TaggedFunction``) runs the bodies
  and puts ``fxdp::param_grad`` markers where the backward returned the parameters'
  gradients.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import weakref
from typing import Any

import torch
import torch.fx as fx

from fxdp._torch_internals import vmap_safe_solves
from fxdp.batching import RAW, BatchDim, retrack, scale_batch
from fxdp.registry import GRAD, ParamRule, lookup
from fxdp.rules.generic import _one_sample

__all__ = [
    "FUNCTION_APPLY", "FunctionCall", "FunctionInTransform", "TaggedFunction", "function_batch", "function_param_rule",
    "functions_as_ops", "ops_as_functions", "function_call",
]

FUNCTION_APPLY = torch.ops.higher_order.autograd_function_apply


@dataclasses.dataclass
class FunctionCall:
    """One captured ``Function.apply`` call.

    Attributes:
        fwd: Dynamo's forward body: ``(*operands) -> ((*outputs), (*saved))``.
        bwd: Dynamo's backward body: ``(*output grads, *saved) -> (*operand grads)``.
        kwargs: The higher-order op's settings (``non_differentiable_idx``, ...).
        cls: The Function class (``None`` where it was captured outside ``fxdp.transform``).
        positions: Index of an ``apply`` argument -> index of its operand.
        kinds: "t" (tensor) or "s" (size) for each operand.
    """

    fwd: fx.GraphModule
    bwd: fx.GraphModule
    kwargs: dict
    cls: type | None
    positions: dict[int, int]
    kinds: list[str]

    @property
    def num_outputs(self) -> int:
        return len(self._returned()[0])

    @property
    def saved_examples(self) -> list:
        """The forward body's saved values as example values (to tell sizes from tensors)."""
        return [_meta(s) for s in self._returned()[1]]

    def _returned(self) -> tuple:
        """The forward body's ``((*outputs), (*saved))`` as nodes."""
        return next(n for n in self.fwd.graph.nodes if n.op == "output").args[0]

    @property
    def name(self) -> str:
        return self.cls.__name__ if self.cls is not None else "Function"


_keys = itertools.count()
# The opaque op's key -> its call, while some graph holds the call: the Dynamo graph
# (``gm.meta["fxdp_function_calls"]``) and, after canonicalisation, the node's meta.
_CALLS: "weakref.WeakValueDictionary[int, FunctionCall]" = weakref.WeakValueDictionary()


def _run_forward(key: int, tensors: list, sizes: list) -> list[torch.Tensor]:
    call = _CALLS[key]
    operands = _merge(call, tensors, sizes)
    with torch.no_grad():
        outputs, _saved = _run(call.fwd, *operands)
    # An opaque op's outputs are its own (a Function may return an input).
    return [o.clone() for o in outputs]


@torch.library.custom_op("fxdp::function_apply", mutates_args=())
def _function_apply(tensors: list[torch.Tensor], sizes: list[int], key: int) -> list[torch.Tensor]:
    """Stands for an ``autograd_function_apply`` call during canonicalisation only."""
    return _run_forward(key, tensors, sizes)


@_function_apply.register_fake
def _(tensors, sizes, key):
    return _run_forward(key, tensors, sizes)


_OPAQUE = torch.ops.fxdp.function_apply.default


def _run(body: fx.GraphModule, *args) -> Any:
    """Run a body; it switches grad mode off and back on: the caller's mode is restored."""
    with torch.set_grad_enabled(torch.is_grad_enabled()):
        return torch.fx.Interpreter(body).run(*args)


def _merge(call: FunctionCall, tensors: list, sizes: list) -> list:
    """The operands in order from the opaque op's tensors and sizes."""
    tensors, sizes = iter(tensors), iter(sizes)
    return [next(tensors) if kind == "t" else next(sizes) for kind in call.kinds]


def _operand_kind(node: Any) -> str:
    value = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else node
    if isinstance(value, torch.Tensor):
        return "t"
    if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
        return "s"
    from fxdp.errors import UnsupportedError

    raise UnsupportedError(
        f"fxdp cannot pass a {type(value).__name__} ({node}) into a torch.autograd.Function call: "
        "only tensors and integer sizes can cross it; compute that value inside the Function")


def functions_as_ops(gm: fx.GraphModule) -> fx.GraphModule:
    """Each ``autograd_function_apply`` of a Dynamo graph (and of the checkpointed
    regions it inlines) as the opaque ``fxdp::function_apply``, which ``make_fx`` keeps."""
    from fxdp._torch_internals import _call_body

    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is _call_body:
            functions_as_ops(node.args[0])  # an inlined checkpointed region
        if node.op != "call_function" or node.target is not FUNCTION_APPLY:
            continue
        cls, positions = node.meta.get("fxdp_function", (None, {}))
        operands = list(node.args[2:])
        call = FunctionCall(fwd=getattr(gm, node.args[0].target), bwd=getattr(gm, node.args[1].target),
                            kwargs=dict(node.kwargs), cls=cls, positions=dict(positions),
                            kinds=[_operand_kind(a) for a in operands])
        key = next(_keys)
        _CALLS[key] = call
        gm.meta.setdefault("fxdp_function_calls", []).append(call)
        tensors = [a for a, k in zip(operands, call.kinds) if k == "t"]
        sizes = [a for a, k in zip(operands, call.kinds) if k == "s"]
        with gm.graph.inserting_before(node):
            opaque = gm.graph.call_function(_OPAQUE, (tensors, sizes, key))
        _replace(gm, node, opaque)
        changed = True
    return _finished(gm, changed)


def _replace(gm: fx.GraphModule, node: fx.Node, new: fx.Node) -> fx.Node:
    """``new`` in ``node``'s place, with its meta (``nn_module_stack``, stack trace)."""
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return new


def _finished(gm: fx.GraphModule, changed: bool) -> fx.GraphModule:
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def ops_as_functions(gm: fx.GraphModule) -> fx.GraphModule:
    """Undo ``functions_as_ops`` on a canonical graph: the higher-order op again, with
    its bodies as submodules; ``meta["fxdp_function"]`` holds its ``FunctionCall``."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _OPAQUE:
            continue
        tensors, sizes, key = node.args
        call = _CALLS[key]
        names = []
        for part in ("fwd", "bwd"):
            names.append(f"fxdp_function_{key}_{part}")
            gm.add_submodule(names[-1], getattr(call, part))
        with gm.graph.inserting_before(node):
            bodies = [gm.graph.get_attr(n) for n in names]
            new = gm.graph.call_function(FUNCTION_APPLY, (*bodies, *_merge(call, tensors, sizes)), dict(call.kwargs))
        _replace(gm, node, new).meta["fxdp_function"] = call
        changed = True
    return _finished(gm, changed)


def function_call(node: fx.Node) -> FunctionCall:
    return node.meta["fxdp_function"]


def _meta(node: Any) -> Any:
    """A node's value under fake tensors: ``val`` after ``make_fx``, ``example_value``
    in Dynamo's graphs (the bodies)."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta["val"] if "val" in node.meta else node.meta.get("example_value")


def _body_analysis(body: fx.GraphModule, args: list, batches: list, batch_size: Any):
    """Canonicalise a body on ``args`` (fake values) and analyse it with ``batches``."""
    from fxdp._torch_internals import fake_mode_of
    from fxdp.passes.batch_dims import batch_dim_pass
    from fxdp.passes.canonicalize import canonicalize_pass

    # Canonicalisation rewrites a graph in place; AOTAutograd runs the body as captured.
    body = fx.GraphModule(body, copy.deepcopy(body.graph))
    canon = canonicalize_pass(body, args, fake_mode=fake_mode_of([a for a in args if isinstance(a, torch.Tensor)]))
    placeholders = [n for n in canon.graph.nodes if n.op == "placeholder"]
    analysis = batch_dim_pass(canon, dict(zip(placeholders, batches)), {}, batch_size=batch_size,
                              function_body=True)
    output = next(n for n in canon.graph.nodes if n.op == "output")
    return canon, analysis, output


def _batch_of(value: Any, analysis) -> Any:
    if isinstance(value, (list, tuple)):
        return [_batch_of(v, analysis) for v in value]
    return analysis.batch.get(value) if isinstance(value, fx.Node) else None


def _refusal(call: FunctionCall, where: str, problems: list) -> Exception:
    """``MixesSamples`` naming the body and its ops; where none of them mixes samples
    (an op without a batch propagation), the error the analysis prints as it is."""
    from fxdp.passes.batch_dims import MixesSamples, _NoPropagation

    mixes = any(p.reason.startswith("mixes samples: ") for p in problems)
    return (MixesSamples if mixes else _NoPropagation)(f"in {call.name}.{where}, " + "; ".join(
        f"{p.op}: {p.reason.removeprefix('mixes samples: ')}" for p in problems))


def function_batch(node: fx.Node, arg_batch: list, batch_size: Any) -> list:
    """The batch dims of a Function call's outputs, from its forward body; raises
    ``MixesSamples`` where its forward, or its backward for the batched operands,
    mixes samples. Records ``meta["fxdp_function_batch"] = (outputs, saved)``."""
    call = function_call(node)
    operands, operand_batch = list(node.args[2:]), list(arg_batch[2:])
    canon, fwd, output = _body_analysis(call.fwd, [_meta(a) for a in operands], operand_batch, batch_size)
    if fwd.problems:
        raise _refusal(call, "forward", fwd.problems)
    _refuse_unchecked_rows(call, "forward", fwd)
    out_nodes, saved_nodes = output.args[0]
    out_batch, saved_batch = _batch_of(list(out_nodes), fwd), _batch_of(list(saved_nodes), fwd)
    node.meta["fxdp_function_losses"] = _mean_class_losses(call, canon, fwd)

    # The backward, cut down to the gradients of the batched operands (a parameter's
    # gradient sums over the batch, which is what the markers replace).
    keep = {i for i, b in enumerate(operand_batch) if isinstance(b, BatchDim)}
    bwd = _pruned_backward(call.bwd, keep)
    bwd_args = [_meta(o) for o in out_nodes] + [_meta(s) for s in saved_nodes]
    grad_batch = [b if isinstance(b, BatchDim) else None for b in out_batch]
    _, back, back_output = _body_analysis(bwd, bwd_args, grad_batch + saved_batch, batch_size)
    if back.problems:
        raise _refusal(call, "backward", back.problems)
    _refuse_unchecked_rows(call, "backward", back)
    for i, g in enumerate(back_output.args[0]):
        if i in keep and isinstance(g, fx.Node) and not isinstance(back.batch.get(g), BatchDim):
            from fxdp.passes.batch_dims import MixesSamples
            raise MixesSamples(f"in {call.name}.backward, the gradient of its batched input {i} "
                               "is not computed per sample")
    node.meta["fxdp_function_batch"] = (out_batch, saved_batch)
    return out_batch


def _refuse_unchecked_rows(call: FunctionCall, where: str, analysis) -> None:
    """Rows of a flattened batch picked (or written) by per-sample offsets keep samples
    apart only under a run-time check (``own_rows_pass``), which fxdp inserts in the
    model's graph but not in a Function's body."""
    if analysis.own_rows:
        from fxdp.passes.batch_dims import MixesSamples

        raise MixesSamples(
            f"in {call.name}.{where}, {analysis.own_rows[0].node.target} picks or writes rows of several "
            "samples merged into one dim by per-sample indices, which fxdp checks at run time outside a "
            "torch.autograd.Function only (do that indexing outside it)")


_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
          torch.ops.aten.flatten.using_ints, torch.ops.aten.clone.default, torch.ops.aten.alias.default}


def _mean_class_losses(call: FunctionCall, canon: fx.GraphModule, analysis) -> list[tuple[int, int]]:
    """``(operand index, ignore_index)`` of each mean cross entropy / NLL over the batch
    in the forward body, for ``loss_normaliser_pass``'s check of the kept targets.
    Raises ``MixesSamples`` where the targets are computed inside the Function."""
    from fxdp.compiler import CLASS_LOSSES
    from fxdp.passes.batch_dims import Loss, MixesSamples

    placeholders = [n for n in canon.graph.nodes if n.op == "placeholder"]
    losses = []
    for n in canon.graph.nodes:
        if not (n.op == "call_function" and n.target in CLASS_LOSSES and isinstance(analysis.batch.get(n), Loss)
                and analysis.batch[n].reduction == "mean"):
            continue
        target = n.args[1]
        while isinstance(target, fx.Node) and target.op == "call_function" and target.target in _VIEWS:
            target = target.args[0]
        if target not in placeholders:
            raise MixesSamples(
                f"in {call.name}.forward, a mean {n.target.__name__.split('.')[0]} divides by the number of "
                "kept targets (not ignore_index) of the whole batch, and its targets are computed inside the "
                "Function, where fxdp cannot check that every sample keeps as many; use reduction='sum' "
                "(loss_reduction='sum') and divide by a fixed number")
        ignore_index = n.args[4] if len(n.args) > 4 else n.kwargs.get("ignore_index", -100)
        losses.append((placeholders.index(target), ignore_index))
    return losses


def _pruned_backward(bwd: fx.GraphModule, keep: set[int]) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict = {}
    for n in bwd.graph.nodes:
        if n.op == "output":
            grads = n.args[0]
            graph.output(tuple(env[g] if (i in keep and isinstance(g, fx.Node)) else None
                               for i, g in enumerate(grads)))
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
    pruned = fx.GraphModule(bwd, graph)
    pruned.graph.eliminate_dead_code()
    pruned.recompile()
    return pruned


def function_param_rule(node: fx.Node, index: int) -> ParamRule | None:
    """The registered rule's ``ParamRule`` for operand ``index`` of a Function call
    (its ``apply`` argument ``k``), or ``None``."""
    call = function_call(node)
    rule = lookup(call.cls) if call.cls is not None else None
    if rule is None:
        return None
    for k, position in call.positions.items():
        if position == index - 2 and k in rule.params:
            return rule.params[k]
    return None


class TaggedFunction:
    """Call target of a tagged Function call in the canonical graph.

    Args:
        call: The captured call.
        uses: Operand index -> use id, for operands that are trainable parameters.
        operands: Operand index -> what its marker receives, as ``("grad", j)``,
            ``("operand", i)`` or ``("saved", j)``.
        extra_args: Operand index -> how many inputs of its parameter transform follow
            the operands.
    """

    def __init__(self, call: FunctionCall, uses: dict[int, int], operands: dict[int, list],
                 extra_args: dict[int, int]):
        self.call = call
        self.uses = dict(uses)
        from fxdp.markers import USES

        self.use_infos = [USES[u] for u in self.uses.values()]  # keeps them in USES
        self.operands = operands
        self.extra_args = dict(extra_args)
        # The operands the backward reads: the parameters and what their markers name.
        self.kept = set(uses) | {j for specs in operands.values() for kind, j in specs if kind == "operand"}
        self.__name__ = f"fxdp_function_{call.cls.__name__ if call.cls else 'apply'}"
        self.__qualname__ = self.__name__

    def __call__(self, *args):
        return _TaggedFunction.apply(self, *args)

    def __repr__(self) -> str:
        return f"{self.__name__}[uses={self.uses}]"


def _is_size(value: Any) -> bool:
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


class _TaggedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tagged: TaggedFunction, *args):
        from fxdp.markers import _split

        num_extras = sum(tagged.extra_args.values())
        operands, extras = args[:len(args) - num_extras], args[len(args) - num_extras:]
        outputs, saved = _run(tagged.call.fwd, *operands)
        saved_tensors, ctx.saved_template = _split(list(saved))
        operand_tensors, ctx.operand_template = _split(
            [o if i in tagged.kept else None for i, o in enumerate(operands)])
        extra_tensors, ctx.extras_template = _split(list(extras))
        ctx.counts = (len(saved_tensors), len(operand_tensors))
        ctx.save_for_backward(*saved_tensors, *operand_tensors, *extra_tensors)
        ctx.tagged = tagged
        ctx.num_extras = num_extras
        outputs = tuple(outputs)
        non_differentiable = tagged.call.kwargs.get("non_differentiable_idx", [])
        if non_differentiable:
            ctx.mark_non_differentiable(*[outputs[i] for i in non_differentiable])
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        from fxdp.markers import USES, _as_operand, _join

        tensors = ctx.saved_tensors
        num_saved, num_operands = ctx.counts
        saved = _join(ctx.saved_template, tensors[:num_saved])
        operands = _join(ctx.operand_template, tensors[num_saved:num_saved + num_operands])
        extras = _join(ctx.extras_template, tensors[num_saved + num_operands:])
        tagged: TaggedFunction = ctx.tagged
        input_grads = list(_run(tagged.call.bwd, *grads, *saved))
        offsets, start = {}, 0
        for i in sorted(tagged.extra_args):
            offsets[i] = start
            start += tagged.extra_args[i]
        like = next(g for g in grads if isinstance(g, torch.Tensor))
        values = {"grad": list(grads), "operand": list(operands), "saved": list(saved)}
        for i, use_id in tagged.uses.items():
            if not ctx.needs_input_grad[1 + i]:
                continue
            marker_operands = [_as_operand(values[kind][j], like) for kind, j in tagged.operands[i]]
            if i in tagged.extra_args:
                marker_operands += [_as_operand(e, like)
                                    for e in extras[offsets[i]: offsets[i] + tagged.extra_args[i]]]
            input_grads[i] = torch.ops.fxdp.param_grad(marker_operands, operands[i], USES[use_id].use_id)
        return (None, *input_grads, *[None] * ctx.num_extras)


class _Bodies(torch.autograd.Function):
    """A Function call as its two bodies, usable under ``vmap`` (``generate_vmap_rule``):
    inside a parameter transform (``F.linear(x, RoundSTE.apply(w))``), which the backward
    rewrite runs under ``vmap`` once per sample. The forward returns the saved values
    after the outputs, so that ``setup_context`` can save them."""

    generate_vmap_rule = True

    @staticmethod
    def forward(call: FunctionCall, *operands):
        outputs, saved = _run(call.fwd, *operands)
        # Views: autograd refuses an input returned as it is and saved by setup_context.
        return (*outputs, *[s.view_as(s) for s in saved if isinstance(s, torch.Tensor)])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.call = call = inputs[0]
        ctx.save_for_backward(*output[call.num_outputs:])
        ctx.mark_non_differentiable(*output[call.num_outputs:])

    @staticmethod
    def backward(ctx, *grads):
        # A size saved on ``ctx`` is a constant of the graph: a parameter's.
        tensors = iter(ctx.saved_tensors)
        saved = [next(tensors) if isinstance(s, torch.Tensor) else s for s in ctx.call.saved_examples]
        return (None, *_run(ctx.call.bwd, *grads[:ctx.call.num_outputs], *saved))


class FunctionInTransform:
    """Call target standing for a Function call inside a parameter transform's graph."""

    def __init__(self, call: FunctionCall):
        self.call = call
        self.__name__ = f"fxdp_function_{call.cls.__name__ if call.cls else 'apply'}"

    def __call__(self, *operands):
        return _Bodies.apply(self.call, *operands)[:self.call.num_outputs]


def backward_rule(node: fx.Node, index: int) -> tuple[ParamRule, list, list]:
    """A ``ParamRule`` for operand ``index`` of a Function call without a registered
    rule: the Function's backward on each sample as a batch of one, under ``vmap``.

    Returns:
        The rule, its marker operands (``("grad", j)``/``("saved", j)``) and their
        batch layouts.
    """
    call = function_call(node)
    out_batch, saved_batch = node.meta["fxdp_function_batch"]
    saved_values = call.saved_examples
    specs = [("grad", j) for j in range(len(out_batch))] + [("saved", j) for j in range(len(saved_batch))]
    layouts = [b if isinstance(b, BatchDim) else RAW for b in [*out_batch, *saved_batch]]
    sizes = {k for k, v in enumerate(saved_values) if _is_size(v)}
    num_grads = len(out_batch)
    position = index - 2
    bwd = call.bwd
    param = _meta(node.args[index])

    def per_sample_grad(*tensors):
        layouts_now = [retrack(b, tensors) for b in layouts]
        in_dims = tuple(None if b.dim in ("raw", "shared", None) else 0 for b in layouts_now)

        def one(*ts):
            values = [_one_sample(t, b) for t, b in zip(ts, layouts_now)]
            grads = values[:num_grads]
            saved = [v.shape[0] if k in sizes else v for k, v in enumerate(values[num_grads:])]
            g = _run(bwd, *grads, *saved)[position]
            # A backward that returns no gradient for it: zero.
            if g is None:
                return ts[0].new_zeros(param.shape)
            # One broadcast over the sample's positions (g * x for a weight of shape [d]):
            # autograd sums a gradient to its input's shape, and so does each sample's here.
            return g.sum_to_size(param.shape)

        with vmap_safe_solves():
            return torch.func.vmap(one, in_dims=in_dims)(*tensors)

    argument = next((k for k, i in call.positions.items() if i == position), position)
    rule = ParamRule(
        name=f"function.{call.cls.__name__ if call.cls else 'apply'}[{argument}]",
        operands=tuple(specs),
        per_sample_grad=per_sample_grad,
        sum_grad=lambda *tensors: per_sample_grad(*tensors).sum(0),
        weighted_sum_grad=lambda weights, *tensors: scale_batch(per_sample_grad(*tensors), weights).sum(0),
    )
    return rule, specs, layouts


def registered_operands(rule: ParamRule, call: FunctionCall) -> list:
    """A registered rule's operands as ``("grad", 0)`` / ``("operand", i)``."""
    specs = []
    for s in rule.operands:
        if s == GRAD:
            specs.append(("grad", 0))
        elif s in call.positions:
            specs.append(("operand", call.positions[s]))
        else:
            raise ValueError(f"the rule {rule.name} names argument {s} of {call.name}.apply, "
                             "which is not a tensor argument of this call")
    return specs

