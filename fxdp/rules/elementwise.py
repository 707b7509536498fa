"""A parameter used directly by a broadcasting elementwise op.

``x * gamma`` (layer scale, the weight of a hand-written RMSNorm), ``x + b`` (a
learned bias), ``x + pos`` (a learned position table ``[T, d]`` on ``[B, T, d]``),
``x / s``, ``torch.addcmul(y, x, gamma)``: ``aten.mul.Tensor``, ``aten.add.Tensor``,
``aten.sub.Tensor``, ``aten.div.Tensor`` and ``aten.addcmul.default``, with the
parameter as any of the tensor arguments.

Index letters: ``n`` batch, ``…`` the output's dims of one sample.

The gradient of argument ``j`` is ``g ⊙ ∂out/∂arg_j`` summed over the dims the
argument was broadcast along; per sample: ``∂p_n = reduce_{p.shape}(g_n… ⊙ d_n…)``
where ``d`` is the partial derivative (``other`` for ``mul``, ``alpha`` for
``add``, ``-num/den²`` for the denominator of ``div`` …). The per-sample gradient
has the parameter's own size, so these rules always instantiate it.

These rules key the most common ops of any graph: ``batch_rule`` is the ordinary
broadcasting propagation (used for every ``add``/``mul`` of the model, with or
without a parameter) and ``input_grad`` is the ordinary broadcasting gradient.

Layouts. The marker operands arrive batch-major (``[n, …]``, or ``[n, outer·inner, …]``
for a merged batch, ``[1, …]`` for a shared tensor); ``config`` records where each
argument's batch was (``Layout``), and ``in_place`` puts each sample's rows back
where the batch was, so that one sample is ``t[n]`` with the op's own broadcasting.
``matmul.py`` uses the same helpers.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import guard_or_false

from fxdp.batching import BatchDim, broadcast_batch
from fxdp.registry import GRAD, OpRule, ParamRule, register_rule

__all__ = [
    "Layout",
    "layout_of",
    "node_layouts",
    "in_place",
    "right_align",
    "reduce_per_sample",
    "param_spans_batch",
    "ELEMENTWISE_RULES",
    "MODULE_OPS",
]

aten = torch.ops.aten


# ---------------------------------------------------------------------------
# Layout helpers (shared with matmul.py)
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one tensor argument's batch was, decided when the op was tagged.

    Attributes:
        ndim: The argument's number of dims.
        dim: Its batch dim, ``None`` for a shared tensor or a whole batch of one.
        merged: Whether the batch dim holds ``outer·B·inner`` rows, not just ``B``.
        sizes: The shape with ``None`` for each symbolic size (a position table sliced
            to a sequence length that changes between calls); ``None`` where unknown.
            Dynamo specialises sizes 0 and 1, so a symbolic size is never a broadcast
            dim: this is all that ``reduce_per_sample`` needs, and the sizes stay
            symbolic.
    """

    ndim: int
    dim: int | None
    merged: bool
    sizes: tuple[int | None, ...] | None

    @property
    def shape(self) -> tuple[int, ...] | None:
        """The static shape (parameters), ``None`` where some size is symbolic."""
        if self.sizes is None or any(s is None for s in self.sizes):
            return None
        return self.sizes


def _layout(ndim: int, batch: Any, sizes: tuple[int | None, ...] | None) -> Layout:
    if isinstance(batch, BatchDim) and isinstance(batch.dim, int):
        return Layout(ndim, batch.dim, not batch.plain, sizes)
    return Layout(ndim, None, False, sizes)


def layout_of(meta: Any, batch: Any) -> Layout | None:
    """The ``Layout`` of a tensor with example value ``meta`` and batch ``batch``."""
    if not isinstance(meta, torch.Tensor):
        return None
    return _layout(meta.dim(), batch, tuple(s if isinstance(s, int) else None for s in meta.shape))


def _node_of(args: Sequence[Any]) -> fx.Node | None:
    # ``config`` is called with ``node.args`` itself (the node's own tuple), so the node
    # is the user of an argument whose ``args`` is that very tuple.
    for a in args:
        if isinstance(a, fx.Node):
            for user in a.users:
                if user.args is args:
                    return user
    return None


def node_layouts(args: Sequence[Any], propagate: Callable[[list, list], tuple[Any, int]]) -> dict | None:
    """Layouts of a tagged node's tensor arguments and of its output, for ``config``.

    ``config`` runs on the canonical graph's nodes: after ``batch_dim_pass`` each node
    carries ``meta["fxdp_batch"]``, the output's included (which may be a batch the core
    gave it, e.g. a shared result expanded to the batch). Where the node cannot be
    found, ``propagate(batches, metas) -> (batch, ndim)`` (the op's own propagation)
    gives the output's. Before the analysis (which calls ``config`` too), or on
    anything but nodes, returns ``None``.

    Returns:
        ``{"layouts": per argument Layout | None, "out_layout": Layout, "out_ndim": int}``.
    """
    metas, batches = [], []
    for a in args:
        if isinstance(a, fx.Node):
            if "fxdp_batch" not in a.meta:
                return None
            metas.append(a.meta.get("val"))
            batches.append(a.meta["fxdp_batch"])
        elif isinstance(a, torch.Tensor):
            return None
        else:
            metas.append(a)
            batches.append(None)
    node = _node_of(args)
    if node is not None and "fxdp_batch" in node.meta and isinstance(node.meta.get("val"), torch.Tensor):
        batch, out_ndim = node.meta["fxdp_batch"], node.meta["val"].dim()
    else:
        batch, out_ndim = propagate(batches, metas)
    return {
        "layouts": tuple(layout_of(m, b) for m, b in zip(metas, batches)),
        "out_layout": _layout(out_ndim, batch, None),
        "out_ndim": out_ndim,
    }


def in_place(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Batch-major marker operand -> ``[n, *shape]``, each sample's rows at the batch dim.

    Sample ``n`` is then ``result[n]``: the argument's own shape with ``inner`` (or 1)
    rows where the batch was. A shared tensor stays ``[1, *shape]`` (or ``[n, *shape]``
    where the core expanded it); one passed as it is (a parameter) gains the leading 1.
    """
    if layout.dim is None:
        return t.unsqueeze(0) if t.dim() == layout.ndim else t
    if layout.merged:
        return t.movedim(1, 1 + layout.dim)
    return t.unsqueeze(1 + layout.dim)


def right_align(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """``[n, *s] -> [n, 1, …, 1, *s]`` with ``ndim`` dims after ``n`` (broadcasting's alignment)."""
    for _ in range(ndim - (t.dim() - 1)):
        t = t.unsqueeze(1)
    return t


def reduce_per_sample(t: torch.Tensor, shape: Sequence[int | None]) -> torch.Tensor:
    """``[n, *s] -> [n, *shape]``: each sample summed over the dims ``shape`` broadcasts along
    (``None``, a symbolic size, is never one of them). A dim whose size the data decides
    (``x[:, i:i + 1]`` with ``i = int(k)``) is summed as well: if it is 1, the sum is its
    one element."""
    lead = t.dim() - 1 - len(shape)
    if lead > 0:
        t = t.sum(tuple(range(1, 1 + lead)))
    dims = [i + 1 for i, want in enumerate(shape) if want == 1 and not guard_or_false(t.shape[i + 1] == 1)]
    if dims:
        t = t.sum(dims, keepdim=True)
    return t


def param_spans_batch(shape: Sequence[int], out_batch: BatchDim, out_ndim: int) -> bool:
    """Whether a parameter of ``shape``, right-aligned to the output, has a size other
    than 1 along the output's batch dim (each sample would use its own slice of it)."""
    if out_batch.dim is None:
        return False
    d = out_batch.dim - (out_ndim - len(shape))
    return d >= 0 and not bool(shape[d] == 1)


def _out_ndim(args_meta: Sequence[Any]) -> int:
    """Rank of a broadcast's result from its arguments' example values."""
    return max((m.dim() for m in args_meta if isinstance(m, torch.Tensor)), default=0)


# ---------------------------------------------------------------------------
# The ops: for each argument, the operands and the partial derivative
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Partial:
    """``∂out/∂arg`` of one argument from the op's arguments ``others`` (by index) and
    its scalar settings."""

    others: tuple[int, ...]
    fn: Callable[..., Any]


def _scalar(args: Sequence[Any], index: int, default: Any = 1) -> Any:
    # Keyword-only settings (alpha, value) arrive positionally once the tag pass
    # passes the op's full schema arguments; a missing one is its default.
    return args[index] if len(args) > index and args[index] is not None else default


_SPEC: dict[Any, tuple[dict[int, _Partial], Callable[[Sequence[Any]], dict]]] = {
    aten.mul.Tensor: (
        {0: _Partial((1,), lambda other, **c: other), 1: _Partial((0,), lambda other, **c: other)},
        lambda args: {},
    ),
    aten.add.Tensor: (
        {0: _Partial((), lambda **c: 1), 1: _Partial((), lambda alpha, **c: alpha)},
        lambda args: {"alpha": _scalar(args, 2)},
    ),
    aten.sub.Tensor: (
        {0: _Partial((), lambda **c: 1), 1: _Partial((), lambda alpha, **c: -alpha)},
        lambda args: {"alpha": _scalar(args, 2)},
    ),
    aten.div.Tensor: (
        {0: _Partial((1,), lambda den, **c: 1 / den),
         1: _Partial((0, 1), lambda num, den, **c: -num / (den * den))},
        lambda args: {},
    ),
    aten.addcmul.default: (
        {0: _Partial((), lambda **c: 1),
         1: _Partial((2,), lambda t2, value, **c: value * t2),
         2: _Partial((1,), lambda t1, value, **c: value * t1)},
        lambda args: {"value": _scalar(args, 3)},
    ),
}


def _make_param_rule(op: Any, index: int, partial: _Partial) -> ParamRule:
    name = f"{op.__name__.split('.')[0]}.{op._schema.arguments[index].name}"

    def product(operands, config):
        g, *others = operands
        g = in_place(g, config["out_layout"])
        values = [in_place(t, config["layouts"][i]) for t, i in zip(others, partial.others)]
        # The output may have more dims than the op's (the core expands a shared result).
        ndim = max([config["out_ndim"], g.dim() - 1, *(v.dim() - 1 for v in values)])
        values = [right_align(v, ndim) for v in values]
        return right_align(g, ndim) * partial.fn(*values, **config["scalars"])

    def per_sample_grad(*operands, **config):
        return reduce_per_sample(product(operands, config), config["layouts"][index].sizes)

    def sum_grad(*operands, **config):
        return per_sample_grad(*operands, **config).sum(0)

    return ParamRule(
        name=name,
        operands=(GRAD, *partial.others),
        per_sample_grad=per_sample_grad,
        sum_grad=sum_grad,
    )


def _make_config(op: Any, scalars: Callable[[Sequence[Any]], dict]) -> Callable[[Sequence[Any]], dict]:
    def propagate(batches, metas):
        out_ndim = _out_ndim(metas)
        return broadcast_batch(batches, metas, out_ndim), out_ndim

    def config(args: Sequence[Any]) -> dict:
        found = node_layouts(args, propagate) or {}
        return {**found, "scalars": scalars(args)}

    return config


def _make_input_grad(spec: dict[int, _Partial], scalars: Callable[[Sequence[Any]], dict]):
    def input_grad(args, grad_out, index):
        x = args[index]
        partial = spec[index]
        grad = grad_out * partial.fn(*[args[i] for i in partial.others], **scalars(args))
        return grad.sum_to_size(x.shape).to(x.dtype)

    return input_grad


def _batch_rule(args_batch, args_meta, out_meta, config):
    out_ndim = out_meta.dim() if isinstance(out_meta, torch.Tensor) else _out_ndim(args_meta)
    return broadcast_batch(args_batch, args_meta, out_ndim)


def _check(args_batch, args_meta, index):
    out_ndim = _out_ndim(args_meta)
    out_batch = broadcast_batch(args_batch, args_meta, out_ndim)
    if out_batch is None:
        return ("the parameter meets no batched value in this op, so its gradient here is "
                "shared by all samples; combine it with the batched input directly")
    if param_spans_batch(tuple(args_meta[index].shape), out_batch, out_ndim):
        return ("the parameter has a size other than 1 along the batch dim of the output, so each "
                "sample would use its own slice of it; values the model builds the size of the batch from "
                "no sample's data (torch.tensor of a Python list, a buffer sliced to B) are not the "
                "samples' own: pass per-sample values as a tensor batched with the input")
    return None


def _register(op: Any) -> OpRule:
    spec, scalars = _SPEC[op]
    return register_rule(OpRule(
        op=op,
        params={i: _make_param_rule(op, i, p) for i, p in spec.items()},
        input_grad=_make_input_grad(spec, scalars),
        batch_rule=_batch_rule,
        config=_make_config(op, scalars),
        check=_check,
    ))


ELEMENTWISE_RULES = {op: _register(op) for op in _SPEC}

MODULE_OPS: dict[type, tuple] = {}
