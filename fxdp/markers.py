"""The marker op and the tagged forward ops that put it into the backward graph.

The tag pass replaces ``aten.linear(x, W, b)`` (W, b trainable) by a
``TaggedOp``: an ``autograd.Function`` whose forward is the very same ATen op and
whose backward computes the input gradient normally but the parameter gradients
through the opaque marker ``fxdp::param_grad(operands, param, use_id)``. After
AOTAutograd partitions the joint graph, the forward is the non-private ATen code
and each marker sits in the backward with exactly the operands its rule needs::

    param_grad = torch.ops.fxdp.param_grad.default([tangents_1, relu], primals_4, 3)

The backward rewrite replaces every marker. The marker's kernel only runs when autograd
runs the backward graph AOTAutograd saved in place of the rewritten one (compiled
autograd does), and it raises there.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import weakref
from typing import Any, Optional

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxdp.batching import BatchDim
from fxdp.errors import UnsupportedError
from fxdp.registry import GRAD, OpRule, ParamRule, call_with_schema_args, out_of_place

__all__ = ["UseInfo", "Transform", "TaggedOp", "USES", "new_use", "param_grad"]


@dataclasses.dataclass
class Transform:
    """A parameter-only computation ``(*sources, *extras) -> derived`` before a use.

    Attributes:
        module: The computation as a graph module.
        num_sources: How many leading inputs are trainable parameters.
        isometric: A bijective rearrangement of one parameter: norms are unchanged.
        block: ``(how, dim, start, stop)``: after rearranging the parameter (``how``,
            spelt out), the transform takes positions ``start … stop - 1`` along ``dim``
            (a ``select``, a ``slice`` of constant bounds, a piece of a ``chunk``,
            ``split`` or ``unbind``), then only rearranges them, so its gradient lands
            there and nowhere else, with its norm (``None`` for other transforms).
    """

    module: Any
    num_sources: int
    isometric: bool
    block: tuple | None = None

    def __post_init__(self):
        # A size input (``pos[:, :T]`` with a symbolic ``T``) reaches the backward as a
        # ``[T]`` marker operand (``_as_operand``): the module reads the size back.
        placeholders = [n for n in getattr(getattr(self.module, "graph", None), "nodes", ())
                        if n.op == "placeholder"]
        sizes = {i for i, n in enumerate(placeholders)
                 if "val" in n.meta and not isinstance(n.meta["val"], torch.Tensor)}
        # A float only multiplied, divided, added or subtracted stays a 0-d tensor: read
        # back as a number, Inductor's C++ kernels take it as a C ``float`` (float32 in a
        # float64 model).
        tensors = {i for i in sizes if isinstance(placeholders[i].meta["val"], (float, torch.SymFloat))
                   and all(_takes_a_tensor(u, placeholders[i]) for u in placeholders[i].users)}
        if sizes and not isinstance(self.module, _SizesFromOperands):
            self.module = _SizesFromOperands(self.module, sizes, tensors)


# Binary ops whose operands may be a 0-d tensor where a number was traced.
_TAKE_A_TENSOR = {torch.ops.aten.mul.Tensor, torch.ops.aten.div.Tensor, torch.ops.aten.add.Tensor,
                  torch.ops.aten.sub.Tensor}


def _takes_a_tensor(user: Any, number: Any) -> bool:
    """Whether ``user`` computes the same with ``number`` as a 0-d float64 tensor: one of
    ``_TAKE_A_TENSOR`` with it as an operand beside a floating tensor (which a 0-d
    tensor of its category does not promote)."""
    if user.target not in _TAKE_A_TENSOR or number in user.kwargs.values() or len(user.args) != 2 \
            or number not in user.args:
        return False
    other = user.args[1] if user.args[0] is number else user.args[0]
    value = other.meta.get("val") if hasattr(other, "meta") else None
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _read_back(carrier: torch.Tensor) -> Any:
    """The number ``_as_operand`` carried."""
    if carrier.dim() == 0:
        return carrier.item()
    return carrier.shape[0] if carrier.dim() == 1 else -carrier.shape[1]


class _SizesFromOperands:
    """A transform's graph module called with each size input as a ``[size]`` tensor (a
    float in ``tensors``, one its binary ops take as it is, as a 0-d tensor)."""

    def __init__(self, module: Any, sizes: set[int], tensors: set[int] = frozenset()):
        self.module = module
        self.sizes = sizes
        self.tensors = tensors

    def __call__(self, *args):
        return self.module(*[a if i in self.tensors and isinstance(a, torch.Tensor) and a.dim() == 0
                             and a.is_floating_point() else
                             _read_back(a) if i in self.sizes and isinstance(a, torch.Tensor) else a
                             for i, a in enumerate(args)])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["module"], name)


@dataclasses.dataclass
class UseInfo:
    """One use of a trainable parameter by a rule'd op.

    Attributes:
        use_id: Key of this use (the marker's last argument).
        rule: The ``ParamRule`` of the argument.
        param: The parameter's name.
        module_path: Module that made the call.
        operand_batch: Batch dim of each marker operand, in the rule's order.
        config: The op's static settings for the rule functions.
        transform: The parameter-only computation between the parameters and the
            op's argument, if any; its inputs follow the rule's operands.
        strategy_hint: "generic" for the per-sample VJP fallback.
        num_trailing: Marker operands after the transform's inputs that put operands
            in batch order: a ``Rows`` operand's layout names by ``order`` the one
            holding its sort's indices, and ``substitutes`` maps a rule operand to the
            one that replaces it (the sorted keys of a ``Groups`` operand).
    """

    use_id: int
    rule: ParamRule
    param: str
    module_path: str
    operand_batch: list[BatchDim]
    config: dict
    transform: Transform | None = None
    strategy_hint: str | None = None
    source_names: list[str] = dataclasses.field(default_factory=list)
    num_trailing: int = 0
    substitutes: dict = dataclasses.field(default_factory=dict)

    @property
    def num_rule_operands(self) -> int:
        return len(self.rule.operands)


_ids = itertools.count()
_lock = threading.Lock()
# Use id -> its use, while something holds it: the tagged op that makes the use (its
# graph is traced for AOTAutograd; an unrewritten marker reads the use when it runs)
# and the compiled graph's record (the backward is rewritten when it is first
# compiled, maybe long after the tagged graph is gone). A weak map: what one capture
# tagged goes with its graphs (every Dynamo recompile and every transform tags anew).
USES: "weakref.WeakValueDictionary[int, UseInfo]" = weakref.WeakValueDictionary()


def new_use(**fields: Any) -> UseInfo:
    """A parameter use with a fresh id, entered in ``USES``; the caller holds it until
    a tagged op does (``TaggedOp``, ``TaggedFunction``)."""
    with _lock:
        use_id = next(_ids)
    use = UseInfo(use_id=use_id, **fields)
    USES[use_id] = use
    return use


@torch.library.custom_op("fxdp::param_grad", mutates_args=())
def param_grad(operands: list[Optional[torch.Tensor]], param: torch.Tensor, use_id: int) -> torch.Tensor:
    """Where a trainable parameter's gradient leaves the backward graph (an operand is
    ``None`` where the op's optional argument was not given: embedding_bag's
    per_sample_weights). The backward rewrite replaces every marker, so running one means
    that autograd runs the graph AOTAutograd saved instead of the one fxdp compiled, and
    its gradients would be the unclipped batch sums: that is refused."""
    raise UnsupportedError(
        f"fxdp's backward ran without fxdp's rewrite (parameter {USES[use_id].param!r}), which would "
        "leave the unclipped, batch-summed gradient. Compiled autograd does that: it runs the "
        "backward graph AOTAutograd saved, not the one fxdp compiled. Turn it off for steps of fxdp "
        "models (torch._dynamo.config.compiled_autograd = False, no "
        "torch._dynamo.compiled_autograd._enable around backward()).")


@param_grad.register_fake
def _param_grad_fake(operands, param, use_id):
    return torch.empty_like(param)


_TENSOR = object()  # placeholder for a saved tensor argument


def _split(args) -> tuple[list[torch.Tensor], list]:
    """Tensors to save (those inside list arguments too: ``aten.index``'s indices) and
    the template that puts them back; everything else (SymInts included) stays in it."""
    tensors: list[torch.Tensor] = []

    def template(a):
        if isinstance(a, torch.Tensor):
            tensors.append(a)
            return _TENSOR
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            return type(a)(template(x) for x in a)
        return a

    return tensors, [template(a) for a in args]


def _join(template: list, tensors) -> list:
    it = iter(tensors)

    def fill(a):
        if a is _TENSOR:
            return next(it)
        if isinstance(a, (list, tuple)) and any(x is _TENSOR or isinstance(x, (list, tuple)) for x in a):
            return type(a)(fill(x) for x in a)
        return a

    return [fill(a) for a in template]


def _operand(args: list, index: int) -> Any:
    """Marker operand ``index`` of a call (see ``ParamRule.operands``): an argument, or
    past the arguments the tensors inside list arguments in order, or ``None``."""
    if index < len(args):
        return args[index]
    listed = [x for a in args if isinstance(a, (list, tuple)) for x in a if isinstance(x, torch.Tensor)]
    k = index - len(args)
    return listed[k] if k < len(listed) else None


def _as_operand(value: Any, like: torch.Tensor) -> torch.Tensor:
    """A marker operand for an input of a parameter transform: a tensor as it is, a size
    (``pos[:, :T]`` with a symbolic ``T``) as an empty ``[T]`` view that carries it, since
    the marker takes only tensors, a negative one (``pos[-T:]``) as an empty ``[1, T]``
    view, and another number (a float or bool read from a tensor, ``p * float(scale)``)
    as a 0-d tensor holding it; ``_SizesFromOperands`` reads each back."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (float, bool, torch.SymFloat, torch.SymBool)):
        kind = torch.float64 if isinstance(value, (float, torch.SymFloat)) else torch.bool
        return torch.scalar_tensor(value, dtype=kind, device=like.device)
    if not statically_known_true(value >= 0):
        if statically_known_true(value <= 0):
            return like.new_zeros(()).expand(1, -value)
        return torch.scalar_tensor(value, dtype=torch.int64, device=like.device)  # a sign the data decides
    return like.new_zeros(()).expand(value)


def _own(out: Any, inputs: list[torch.Tensor]) -> Any:
    """``out`` as a tensor of its own where the op returned a view of a tensor it made
    (``aten.linear`` of a 3-d input views its ``addmm``): autograd forbids in-place
    writes (``h.mul_(gamma)``, ``h[:, 0] += tok``) to a view made inside a custom
    Function, and nothing else sees that base. A view of an input stays a view."""
    if not isinstance(out, torch.Tensor) or not out._is_view():
        return out
    base = out._base
    if any(base is a or base is a._base for a in inputs):
        return out
    return out.detach()


def _copies_summed(grad: torch.Tensor, batch_size: Any, broadcast: Any) -> torch.Tensor:
    """The gradient of an output expanded to a batch dim that holds several rows per
    sample (``[B·n, …]``, ``[n·B, …]``, ``[k·B·n, …]``), each sample's rows summed:
    ``[B, …]``, as if the output had been expanded to ``B`` and each sample's row copied
    after."""
    d, shape = broadcast.batch_dim, grad.shape
    split, copies = {"inner": ((batch_size, -1), (d + 1,)), "outer": ((-1, batch_size), (d,)),
                     "both": ((-1, batch_size, broadcast.inner), (d, d + 2))}[broadcast.merged]
    return grad.reshape(*shape[:d], *split, *shape[d + 1:]).sum(copies)


class _Tagged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tagged: "TaggedOp", *args):
        broadcast = tagged.broadcast
        if broadcast is not None:
            refs = len(broadcast.refs)
            (ref, *sample_ref), args = args[-refs:], args[:-refs]
            ctx.batch_size = sample_ref[0].shape[broadcast.sample_ref_dim] if sample_ref else None
        num_extras = sum(tagged.extra_args.values())
        if num_extras:
            extras, args = args[len(args) - num_extras:], args[: len(args) - num_extras]
        else:
            extras = ()
        ctx.num_extras = num_extras
        op = tagged.rule.op
        target = None
        twin = out_of_place(op)
        if twin is not None and broadcast is None and isinstance(args[0], torch.Tensor):
            # An in-place op (h.mul_(gamma), h[:, 0] += tok): compute out of place from a
            # copy of the old value (the backward needs it; the op overwrites it), write the
            # result back and tell autograd, which then also handles views of a batch.
            target, op = args[0], twin
            args = (target.clone(), *args[1:])
        tensors, ctx.template = _split(args)
        extra_tensors, ctx.extras_template = _split(extras)
        ctx.num_saved_extras = len(extra_tensors)
        ctx.save_for_backward(*tensors, *extra_tensors)
        ctx.tagged = tagged
        out = call_with_schema_args(op, args)
        if target is not None:
            target.copy_(out)
            ctx.mark_dirty(target)
            return target
        if isinstance(out, (tuple, list)):
            # A multi-output op (embedding_bag): only its first output is differentiable.
            ctx.mark_non_differentiable(*out[1:])
        if broadcast is None:
            return _own(out, tensors)
        # Expand the shared output to the batch (a view): its gradient stays per-sample.
        ctx.added = broadcast.ndim - out.dim()
        out = out.reshape(*([1] * ctx.added), *out.shape)
        batch_size = ref.shape[broadcast.ref_dim]
        return out.expand(*[batch_size if d == broadcast.batch_dim else -1 for d in range(broadcast.ndim)])

    @staticmethod
    def backward(ctx, grad_out, *_non_differentiable):
        saved = ctx.saved_tensors
        split = len(saved) - ctx.num_saved_extras
        args = _join(ctx.template, saved[:split])
        extras = [_as_operand(e, grad_out) for e in _join(ctx.extras_template, saved[split:])]
        tagged: TaggedOp = ctx.tagged
        grads: list[Any] = [None] * (len(args) + ctx.num_extras)
        input_grad_out = grad_out
        if tagged.broadcast is not None:
            # the references the sizes were read from
            grads += [None] * len(tagged.broadcast.refs)
            if tagged.broadcast.merged:
                grad_out = _copies_summed(grad_out, ctx.batch_size, tagged.broadcast)
            input_grad_out = grad_out.sum(tuple(range(ctx.added)))
        offsets, start = {}, 0
        for i in sorted(tagged.extra_args):
            offsets[i] = start
            start += tagged.extra_args[i]
        for i, needs in enumerate(ctx.needs_input_grad[1:1 + len(args)]):
            if not needs:
                continue
            if i in tagged.uses:
                use = USES[tagged.uses[i]]
                operands = [grad_out if s == GRAD else _operand(args, s) for s in use.rule.operands]
                if i in tagged.extra_args:
                    operands += list(extras[offsets[i]: offsets[i] + tagged.extra_args[i]])
                grads[i] = torch.ops.fxdp.param_grad(operands, args[i], use.use_id)
            else:
                grads[i] = tagged.rule.input_grad(args, input_grad_out, i)
        return (None, *grads)


class TaggedOp:
    """Call target of a tagged node in the canonical graph.

    Args:
        rule: The op's rule.
        uses: Argument index -> use id, for the arguments that are trainable parameters.
        broadcast: A ``Broadcast`` plan when the op's inputs are shared and its output is
            expanded to the batch; the call then takes a batched reference as last argument.
        extra_args: Argument index -> how many inputs of its parameter transform follow
            the op's own arguments (saved for the backward rewrite, no gradient).
    """

    def __init__(self, rule: OpRule, uses: dict[int, int], broadcast: Any = None,
                 extra_args: dict[int, int] | None = None):
        self.rule = rule
        self.uses = dict(uses)
        self.use_infos = [USES[u] for u in self.uses.values()]  # keeps them in USES
        self.broadcast = broadcast
        self.extra_args = dict(extra_args or {})
        self.__name__ = f"fxdp_{rule.op.__name__.split('.')[0]}"
        self.__qualname__ = self.__name__

    def __call__(self, *args):
        return _Tagged.apply(self, *args)

    def __repr__(self) -> str:
        return f"{self.__name__}[uses={self.uses}]"
