"""The rule table: one entry per canonical ATen op that can consume a trainable parameter.

An ``OpRule`` says how the op's non-parameter inputs get their gradient and, for
each argument that may be a parameter, which ``ParamRule`` computes that
parameter's per-sample quantities from the *marker operands* (the output
gradient and the op's saved inputs, brought to batch-major layout).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

__all__ = [
    "ParamRule",
    "OpRule",
    "RULES",
    "register_rule",
    "register_ghost_inner",
    "ghost_inner",
    "GHOST_INNER",
    "lookup",
    "register_rule_factory",
    "named_arg",
    "is_supported",
    "GRAD",
    "schema_args",
    "call_with_schema_args",
    "out_of_place",
]

# In ``ParamRule.operands``: the gradient of the op's output.
GRAD = "grad"


@dataclasses.dataclass(frozen=True)
class ParamRule:
    """Per-sample maths of one parameter argument of one op.

    Every function takes the marker operands in batch-major layout ``[B, ...]``
    (in the order of ``operands``) plus the op's static ``config`` as keywords.

    Attributes:
        name: "<op family>.<argument>", e.g. "linear.weight".
        operands: What the marker needs: ``GRAD`` or the index of an op argument; an
            index ``len(args) + k`` is the ``k``-th tensor inside the op's list
            arguments (``aten.index``'s indices), passed as it is (not batch-major).
            Rows a sort of the whole batch ordered (``Rows``) arrive put back in batch
            order; an argument that counts sorted keys (``Groups``, a grouped matmul's
            offsets) arrives as those keys, one per row.
        per_sample_grad: ``-> [B, *p.shape]``, each sample's gradient.
        sum_grad: ``-> p.shape``, the gradient summed over the batch. It is linear in
            the output gradient, so ``sum_grad`` of a per-sample-scaled gradient is
            the clipped gradient.
        ghost_sq_norm: Optional ``-> [B]``, ``‖per_sample_grad‖²`` without
            materialising it.
        costs: Optional ``(shapes, **config) -> {strategy: flops}`` for "ghost" and
            "instantiate": ``shapes`` holds each marker operand's shape (a tuple, or
            ``None`` for an absent optional one); without it the rule instantiates.
        concat_uses: Optional: merge the operand lists of several uses of one
            parameter into one list (e.g. along a sequence axis) so that their sum is
            one use; needed for ghost norms of tied parameters.
        weighted_sum_grad: Optional ``(weights [B], *operands) -> p.shape``,
            ``Σ_n weights_n · per_sample_grad_n`` done cheaply (the clipped gradient);
            without it the rewrite scales the output gradient and calls ``sum_grad``.
    """

    name: str
    operands: tuple
    per_sample_grad: Callable[..., torch.Tensor]
    sum_grad: Callable[..., torch.Tensor]
    ghost_sq_norm: Callable[..., torch.Tensor] | None = None
    costs: Callable[..., dict[str, float]] | None = None
    concat_uses: Callable[[list[list[torch.Tensor]]], list[torch.Tensor]] | None = None
    weighted_sum_grad: Callable[..., torch.Tensor] | None = None


def _no_config(args: Sequence[Any]) -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class OpRule:
    """How one canonical op is made per-sample.

    Attributes:
        op: The ATen overload, as it appears after canonicalisation, or a
            ``torch.autograd.Function`` class. For a Function, ``params`` are keyed by
            the position of the parameter among ``apply``'s arguments, ``GRAD`` in
            ``ParamRule.operands`` is the gradient of its first output and an index is
            an ``apply`` argument; fxdp reads the batch dims from its forward and
            gets the other inputs' gradients from its backward, so ``input_grad``,
            ``batch_rule``, ``config`` and ``check`` stay unset.
        params: Argument index -> ``ParamRule`` for arguments that may be parameters.
        input_grad: ``(args, grad_out, index) -> Tensor``: gradient of a
            non-parameter argument (only called when it requires grad). Required
            for an op.
        batch_rule: ``(args_batch, args_meta, out_meta, config) -> BatchDim | None``
            where the output's batch goes, or raises ``MixesSamples``. Required for
            an op.
        config: ``args -> dict`` of the op's static settings passed to the
            ``ParamRule`` functions (e.g. stride, padding).
        check: Optional ``(args_batch, args_meta, index) -> str | None``: why this
            use cannot be made per-sample.
    """

    op: Any
    params: dict[int, ParamRule]
    input_grad: Callable[..., torch.Tensor | None] | None = None
    batch_rule: Callable[..., Any] | None = None
    config: Callable[[Sequence[Any]], dict] = _no_config
    check: Callable[..., str | None] | None = None

    @property
    def for_function(self) -> bool:
        """The op is a ``torch.autograd.Function`` class."""
        return isinstance(self.op, type) and issubclass(self.op, torch.autograd.Function)


RULES: dict[Any, OpRule] = {}

# Cross terms between uses of one (tied) parameter by two different rules:
# (name_a, name_b) -> fn(operands_a, config_a, operands_b, config_b) -> [B], the
# per-sample inner product <∂p_a, ∂p_b> without materialising either gradient.
GHOST_INNER: dict[tuple[str, str], Callable[..., torch.Tensor]] = {}


def register_ghost_inner(name_a: str, name_b: str, fn: Callable[..., torch.Tensor], *,
                         override: bool = False) -> None:
    """Register the per-sample inner product of two rules' gradients of one parameter."""
    key = (name_a, name_b)
    if key in GHOST_INNER and not override:
        raise ValueError(f"a ghost inner product for {key} is already registered; pass override=True")
    GHOST_INNER[key] = fn


def ghost_inner(name_a: str, name_b: str):
    """``fn(ops_a, cfg_a, ops_b, cfg_b)`` for the pair in either order, or ``None``."""
    if (name_a, name_b) in GHOST_INNER:
        return GHOST_INNER[(name_a, name_b)]
    if (name_b, name_a) in GHOST_INNER:
        fn = GHOST_INNER[(name_b, name_a)]
        return lambda ops_a, cfg_a, ops_b, cfg_b: fn(ops_b, cfg_b, ops_a, cfg_a)
    return None


def register_rule(rule: OpRule, *, override: bool = False) -> OpRule:
    """Add ``rule`` to the table keyed by its op.

    Args:
        rule: The rule (for an op or a ``torch.autograd.Function`` class, see ``OpRule``).
        override: Replace an existing rule for the same op; without it a
            duplicate registration raises.

    A Function's rule is found where ``fxdp.transform`` (or ``fxdp.validate``,
    ``fxdp.explain``) captured the model; through ``torch.compile(backend="fxdp")``,
    which fxdp does not capture, its parameters take the generic path (its backward
    per sample).
    """
    if rule.for_function:
        settings = [name for name, value in (("input_grad", rule.input_grad), ("batch_rule", rule.batch_rule),
                                             ("check", rule.check)) if value is not None]
        if rule.config is not _no_config:
            settings.append("config")
        if settings:
            raise ValueError(
                f"a rule for the torch.autograd.Function {rule.op.__name__} takes no "
                f"{', '.join(settings)}: fxdp reads the batch dims from its forward and the other "
                "inputs' gradients from its backward")
    elif rule.input_grad is None or rule.batch_rule is None:
        raise ValueError(f"a rule for {rule.op} needs input_grad and batch_rule")
    if rule.op in RULES and not override:
        raise ValueError(
            f"a rule for {rule.op} is already registered; pass override=True to replace it"
        )
    RULES[rule.op] = rule
    return rule


# Qualified op name -> ``op -> OpRule``: rules for ops a third-party library defines
# when it is imported (Hugging Face's ``transformers::grouped_mm_fallback``), made on
# first lookup.
RULE_FACTORIES: dict[str, Callable[[Any], OpRule]] = {}


def register_rule_factory(name: str, factory: Callable[[Any], OpRule]) -> None:
    """Make ``factory(op)`` the rule of the op named ``name`` ("namespace::op", its
    default overload) once it exists."""
    RULE_FACTORIES[name] = factory


def lookup(op: Any) -> OpRule | None:
    rule = RULES.get(op)
    if rule is None and isinstance(op, torch._ops.OpOverload) and op._overloadname == "default" \
            and op._schema.name in RULE_FACTORIES:
        rule = register_rule(RULE_FACTORIES[op._schema.name](op))
    return rule


def is_supported(op_or_module: Any) -> bool:
    """Whether fxdp has a per-sample rule for an op, a module, a module class or a
    ``torch.autograd.Function`` class (without one, a Function's parameters take its
    backward per sample). A function of ``torch`` (``F.linear``, ``F.conv2d``,
    ``torch.bmm``) answers for the ATen op of its name, an overload packet for any
    of its overloads.

    A module is supported when every op its parameters feed into has a rule; for a
    module class this answers from the canonical ops its kind is known to lower to,
    see ``MODULE_OPS``. A module instance of a class listed there without ops (a
    container) or not listed at all (a model of one's own) is supported when it holds
    no parameter itself and all its submodules are; its forward is not read, so
    ``fxdp.validate`` is the reliable check. A BatchNorm instance is supported in eval
    mode with running statistics (an affine map per sample), not in training mode
    (it mixes samples); its class, whose instances start in training mode, is not. An
    InstanceNorm with running statistics is not in training mode (it updates them from
    the batch), nor are the lazy InstanceNorm classes, which keep them by default.
    """
    from fxdp.rules import (  # the module→op map lives with the rules
        MODULE_OPS,
        REFUSED_MODULES,
    )
    from fxdp.rules.normalization import (
        BATCH_NORM_EVAL_OPS,
        BATCH_NORMS,
        INSTANCE_NORMS,
    )

    if isinstance(op_or_module, REFUSED_MODULES) or (
            isinstance(op_or_module, type) and issubclass(op_or_module, REFUSED_MODULES)):
        return False
    if isinstance(op_or_module, BATCH_NORMS):
        norm = op_or_module
        return (not norm.training and norm.running_mean is not None
                and all(op in RULES for op in BATCH_NORM_EVAL_OPS))
    if isinstance(op_or_module, INSTANCE_NORMS) and op_or_module.training and op_or_module.track_running_stats:
        return False
    if isinstance(op_or_module, torch.nn.Module):
        module = op_or_module
        ops = next((MODULE_OPS[cls] for cls in type(module).__mro__ if cls in MODULE_OPS), ())
        if not ops:
            return (next(module.parameters(recurse=False), None) is None
                    and all(is_supported(child) for child in module.children()))
        op_or_module = type(module)
    if isinstance(op_or_module, type) and issubclass(op_or_module, torch.autograd.Function):
        return op_or_module in RULES
    if isinstance(op_or_module, type):
        if not any(True for _ in op_or_module.__mro__ if _ is torch.nn.Module):
            return False
        for cls in op_or_module.__mro__:
            if cls in MODULE_OPS:
                return all(op in RULES for op in MODULE_OPS[cls])
        return False
    if isinstance(op_or_module, torch._ops.OpOverloadPacket):
        return any(getattr(op_or_module, name) in RULES for name in op_or_module.overloads())
    if not isinstance(op_or_module, torch._ops.OpOverload) and callable(op_or_module) \
            and getattr(op_or_module, "__module__", "").startswith("torch"):
        # ``F.linear``, ``F.conv2d``, ``torch.bmm``: the ATen op of the same name
        packet = getattr(torch.ops.aten, getattr(op_or_module, "__name__", ""), None)
        return isinstance(packet, torch._ops.OpOverloadPacket) and is_supported(packet)
    return op_or_module in RULES


def named_arg(node: Any, name: str, default: Any) -> Any:
    """The argument ``name`` of ``node``'s op by its schema (``linalg_vector_norm`` takes
    ``(self, ord, dim, keepdim)``, ``sum`` takes ``(self, dim, keepdim)``)."""
    if name in node.kwargs:
        return node.kwargs[name]
    for i, argument in enumerate(node.target._schema.arguments):
        if argument.name == name:
            return node.args[i] if i < len(node.args) and not argument.kwarg_only else default
    return default


def schema_args(op: Any, args: Sequence[Any], kwargs: dict) -> tuple:
    """``op``'s arguments positionally in schema order, keyword-only ones included
    (``alpha`` of ``aten.add.Tensor`` becomes ``args[2]``); missing ones take their default."""
    out = list(args)
    for arg in op._schema.arguments[len(out):]:
        if arg.name in kwargs:
            out.append(kwargs[arg.name])
        elif arg.has_default_value():
            out.append(arg.default_value)
        else:
            raise TypeError(f"{op}: missing argument {arg.name!r}")
    return tuple(out)


def call_with_schema_args(op: Any, args: Sequence[Any]) -> Any:
    """Call ``op`` on ``schema_args`` output: keyword-only arguments go by keyword."""
    positional, keywords = [], {}
    for arg, value in zip(op._schema.arguments, args):
        if arg.kwarg_only:
            keywords[arg.name] = value
        else:
            positional.append(value)
    return op(*positional, **keywords)


def out_of_place(op: Any) -> Any:
    """The out-of-place twin of an in-place ATen op (``aten.mul_.Tensor`` ->
    ``aten.mul.Tensor``), or ``None`` when ``op`` does not write to its first argument.

    Rules compute with the twin: ``vjp``/``vmap`` cannot write into a captured tensor,
    and the tagged op writes the result back itself (``_Tagged`` in ``markers.py``).
    """
    arguments = getattr(getattr(op, "_schema", None), "arguments", None)
    if not arguments or arguments[0].alias_info is None or not arguments[0].alias_info.is_write:
        return None
    name = op._schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    if packet is None:
        return None

    def signature(o: Any) -> list:  # (the first argument is ``self`` or ``input``: ``dropout_``, ``dropout``)
        return [str(a.type) for a in o._schema.arguments]

    twin = getattr(packet, op._overloadname, None)
    if twin is None or signature(twin) != signature(op):
        # Named otherwise (``transpose_.default`` and ``transpose.int``), or the name's twin
        # takes other arguments (``pow_.Scalar(Tensor self, Scalar exponent)`` and
        # ``pow.Scalar(Scalar self, Tensor exponent)``): the overload with the same arguments.
        twin = next((getattr(packet, o) for o in packet.overloads() if signature(getattr(packet, o)) == signature(op)),
                    None)
    return twin
