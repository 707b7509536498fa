"""A parameter as an operand of a matrix product: ``aten.matmul``, ``aten.mm``,
``aten.bmm``, ``aten.addmm``, ``aten.baddbmm``.

``x @ W`` with ``W`` a parameter, Hugging Face's ``Conv1D`` (``addmm(b, x.view(-1, d),
W)`` with ``W`` ``[in, out]``: the batch is merged into the rows, ``[B·T, d]``),
``W @ x``, per-head weights ``[H, k, m]`` against ``[B, H, T, k]``.

Index letters: ``n`` batch, ``t``/``s`` the rows of one sample (every position that
meets the parameter, flattened), ``k`` the contracted dim, ``m`` the parameter's
other dim.

For ``out = a @ b`` (after promoting 1-D operands to matrices, as matmul does):
``∂b_n = reduce_{b.shape}(a_nᵀ g_n)`` and ``∂a_n = reduce_{a.shape}(g_n b_nᵀ)``, each
sample's rows kept where its batch dim was (``elementwise.in_place``). For a 2-D
parameter every row of a sample meets the same matrix: ``∂W_n = Σ_t a_nt g_ntᵀ`` and
the ghost norm is linear's, ``‖∂W_n‖² = Σ_{t,s} (a_nt·a_ns)(g_nt·g_ns)`` (Gram route,
``O(T²(k+m))``), against ``O(T·k·m)`` for instantiating; the cost model picks.

``addmm(bias, a, b, beta, alpha) = beta·bias + alpha·(a @ b)``: the bias is an
elementwise use (``∂bias_n = beta · reduce(g_n)``), the factors scale the rest.

Like the elementwise rules, these key ops that appear everywhere (attention's
``q @ kᵀ``): ``batch_rule`` is the full matmul propagation for every call.

``torch.einsum`` reaches these rules as the matrix products it is made of:
canonicalisation decomposes ``aten.einsum`` (its tensors come as one list argument).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from fxdp.batching import WHOLE, BatchDim, broadcast_batch
from fxdp.registry import GRAD, OpRule, ParamRule, register_rule
from fxdp.rules._common import contract, contraction_cost, gram_cost, gram_inner, hint
from fxdp.rules.elementwise import (
    in_place,
    node_layouts,
    param_spans_batch,
    reduce_per_sample,
    right_align,
)

__all__ = ["MATMUL", "MM", "BMM", "ADDMM", "BADDBMM", "matmul_batch", "MODULE_OPS"]

aten = torch.ops.aten


def _arg(args: Sequence[Any], index: int, default: Any = 1) -> Any:
    # Keyword-only beta/alpha arrive positionally once the tag pass passes the op's
    # full schema arguments; a missing one is its default.
    return args[index] if len(args) > index and args[index] is not None else default


# ---------------------------------------------------------------------------
# Batch propagation
# ---------------------------------------------------------------------------


def _product_ndim(a_ndim: int, b_ndim: int) -> int:
    if a_ndim == 1 and b_ndim == 1:
        return 0
    if a_ndim == 1:
        return b_ndim - 1
    if b_ndim == 1:
        return a_ndim - 1
    return max(a_ndim, b_ndim)


def matmul_batch(a_batch: Any, b_batch: Any, a_ndim: int, b_ndim: int) -> BatchDim | None:
    """Where ``a @ b`` puts the batch: a broadcast dim stays one (right-aligned), ``a``'s
    rows and ``b``'s columns become the output's; a contracted batch mixes samples."""
    out_ndim = _product_ndim(a_ndim, b_ndim)
    # Output dims that come from the operands' matrix dims.
    tail = (1 if a_ndim > 1 else 0) + (1 if b_ndim > 1 else 0)
    result = None
    for which, (bd, ndim) in enumerate(((a_batch, a_ndim), (b_batch, b_ndim))):
        if not isinstance(bd, BatchDim):
            continue
        if bd.dim is None:
            candidate = WHOLE
        else:
            if ndim == 1:
                raise ValueError("a batched vector is contracted")
            pos = bd.dim - ndim  # from the right
            if (which == 0 and pos == -1) or (which == 1 and pos == -2):
                raise ValueError("the batch dim is contracted")
            # The dim keeps its layout (rows merged before or after the batch) whole.
            if which == 0 and pos == -2:
                candidate = bd.at(out_ndim - (2 if b_ndim > 1 else 1))
            elif which == 1 and pos == -1:
                candidate = bd.at(out_ndim - 1)
            else:
                candidate = bd.at(out_ndim - tail + pos + 2)
        if result is None:
            result = candidate
        elif not result.same_as(candidate):
            raise ValueError("both operands are batched at different dims (samples are multiplied together)")
    return result


def _positions(op: Any) -> tuple[int, int, int | None]:
    """Argument indices of ``a``, ``b`` and the added term (``None`` without one)."""
    if op in (aten.addmm.default, aten.baddbmm.default):
        return 1, 2, 0
    return 0, 1, None


def _make_batch_rule(op: Any):
    a_pos, b_pos, c_pos = _positions(op)

    def out_batch(batches: Sequence[Any], metas: Sequence[Any]) -> BatchDim | None:
        a, b = metas[a_pos], metas[b_pos]
        product = matmul_batch(batches[a_pos], batches[b_pos], a.dim(), b.dim())
        if c_pos is None or not isinstance(batches[c_pos], BatchDim):
            return product
        out_ndim = _product_ndim(a.dim(), b.dim())
        added = broadcast_batch([batches[c_pos]], [metas[c_pos]], out_ndim)
        if product is not None and not product.same_as(added):
            raise ValueError("its operands have their batch at different dims")
        return added

    def batch_rule(args_batch, args_meta, out_meta, config):
        return out_batch(args_batch, args_meta)

    return out_batch, batch_rule


# ---------------------------------------------------------------------------
# Per-sample gradients
# ---------------------------------------------------------------------------


def _promote(other: torch.Tensor, g: torch.Tensor, which: int, a_ndim: int, b_ndim: int):
    """In-place ``[n, …]`` operand and output gradient with 1-D operands made matrices, as
    matmul does (``which``: the parameter is ``a`` (0) or ``b`` (1))."""
    if b_ndim == 1:
        g = g.unsqueeze(-1)
        if which == 0:
            other = other.unsqueeze(-1)
    if a_ndim == 1:
        g = g.unsqueeze(-2)
        if which == 1:
            other = other.unsqueeze(-2)
    ndim = max(other.dim(), g.dim()) - 1
    return right_align(other, ndim), right_align(g, ndim)


def _matrix_shape(shape: Sequence[int | None], which: int) -> tuple[int | None, ...]:
    if len(shape) > 1:
        return tuple(shape)
    return (1, *shape) if which == 0 else (*shape, 1)


def _as_parameter(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """``[n, *matrix shape]`` -> ``[n, *parameter shape]``: a 1-D parameter was promoted
    to a matrix with one dim of size 1 (``_matrix_shape``); every other matrix shape is
    the parameter's own (``reduce_per_sample`` left each sample at it)."""
    return t.flatten(-2) if ndim == 1 else t


class _Use:
    """The maths of one parameter position of one product op."""

    def __init__(self, op: Any, which: int):
        self.op = op
        self.which = which  # 0: the parameter is ``a``, 1: it is ``b``
        self.a_pos, self.b_pos, _ = _positions(op)
        self.param_pos = (self.a_pos, self.b_pos)[which]
        self.other_pos = (self.a_pos, self.b_pos)[1 - which]

    def _operands(self, g, other, config):
        layouts = config["layouts"]
        g = in_place(g, config["out_layout"])
        other = in_place(other, layouts[self.other_pos])
        return _promote(other, g, self.which, layouts[self.a_pos].ndim, layouts[self.b_pos].ndim)

    def _row_views(self, g, other, config):
        """``(operand rows [n, …, t, k], gradient rows [n, …, t, m])``: the parameter's
        gradient is ``Σ_t`` of their outer products (``…`` broadcast dims)."""
        other, g = self._operands(g, other, config)
        if self.which == 0:  # ∂a = g bᵀ: the rows are b's columns
            return other.mT, g.mT
        return other, g

    def rows(self, g, other, config):
        """``(operand rows [n, t, k], gradient rows [n, t, m])`` for a 2-D parameter, or
        ``None`` where the rows of the two do not line up one to one."""
        other, g = self._row_views(g, other, config)
        if other.shape[:-1] != g.shape[:-1]:
            return None
        # Explicit sizes: with B == 0 a -1 would be ambiguous.
        rows = math.prod(g.shape[1:-1])
        return (other.reshape(other.shape[0], rows, other.shape[-1]),
                g.reshape(g.shape[0], rows, g.shape[-1]))

    def _outer(self, rows, grads):
        """``Σ_t`` of the row outer products, oriented as the parameter: ``[…, k, m]`` for
        ``b``, ``[…, m, k]`` for ``a``."""
        return grads.mT @ rows if self.which == 0 else rows.mT @ grads

    def per_sample_grad(self, g, other, **config):
        layout = config["layouts"][self.param_pos]
        scale = config["alpha"]
        found = self.rows(g, other, config) if layout.ndim <= 2 else None
        if found is not None:
            rows, grads = found
            psg = contract("ntk,ntm->nmk" if self.which == 0 else "ntk,ntm->nkm", rows, grads)
        else:
            psg = reduce_per_sample(self._outer(*self._row_views(g, other, config)), _matrix_shape(layout.sizes, self.which))
        psg = _as_parameter(psg, layout.ndim)
        return psg * scale if scale != 1 else psg

    def sum_grad(self, g, other, **config):
        """The summed gradient without a per-sample intermediate: the batch joins the rows."""
        layout = config["layouts"][self.param_pos]
        rows, grads = self._row_views(g, other, config)
        if rows.shape[0] != grads.shape[0]:
            rows = rows.expand(grads.shape[0], *rows.shape[1:])

        def fold(t):  # [n, …, t, k] -> […, n·t, k]
            t = t.movedim(0, -3)
            return t.reshape(*t.shape[:-3], t.shape[-3] * t.shape[-2], t.shape[-1])

        grad = reduce_per_sample(self._outer(fold(rows), fold(grads)).unsqueeze(0),
                                 _matrix_shape(layout.sizes, self.which))
        grad = _as_parameter(grad, layout.ndim).squeeze(0)
        scale = config["alpha"]
        return grad * scale if scale != 1 else grad

    def ghost_sq_norm(self, g, other, **config):
        found = self.rows(g, other, config) if config["layouts"][self.param_pos].ndim == 2 else None
        if found is None:
            return self.per_sample_grad(g, other, **config).flatten(1).pow(2).sum(1)
        rows, grads = found
        sq = gram_inner(grads, rows)
        scale = config["alpha"]
        return sq * (scale * scale) if scale != 1 else sq

    def costs(self, shapes, **config) -> dict[str, float]:
        layout = config["layouts"][self.param_pos]
        g_shape, other_shape = shapes
        if layout.ndim != 2 or g_shape is None or other_shape is None or min(len(g_shape), len(other_shape)) < 2:
            return {"instantiate": 0.0}
        # A symbolic size (a table sliced to the sequence length) from the operands.
        seen = (g_shape[-2], other_shape[-2]) if self.which == 0 else (other_shape[-1], g_shape[-1])
        shape = [hint(s if s is not None else other) for s, other in zip(layout.sizes or (None, None), seen)]
        out_side, in_side = (shape[0], shape[1]) if self.which == 0 else (shape[1], shape[0])
        n = hint(shapes[0][0])
        t = max(1, math.prod(hint(s) for s in shapes[0][1:]) // out_side)
        ghost = gram_cost(n, t, in_side, out_side)
        instantiate = (contraction_cost("nto,nti->noi", (n, t, out_side), (n, t, in_side))
                       + contraction_cost("noi,noi->n", (n, out_side, in_side), (n, out_side, in_side)))
        return {"ghost": ghost, "instantiate": instantiate}

    def param_rule(self) -> ParamRule:
        name = f"{self.op.__name__.split('.')[0]}.{self.op._schema.arguments[self.param_pos].name}"
        return ParamRule(
            name=name,
            operands=(GRAD, self.other_pos),
            per_sample_grad=self.per_sample_grad,
            sum_grad=self.sum_grad,
            ghost_sq_norm=self.ghost_sq_norm,
            costs=self.costs,
        )


def _added_term_rule(op: Any) -> ParamRule:
    """``beta · c`` of ``addmm``/``baddbmm``: an elementwise use of ``c``."""

    def per_sample_grad(g, **config):
        g = right_align(in_place(g, config["out_layout"]), config["out_ndim"])
        psg = reduce_per_sample(g, config["layouts"][0].sizes)
        return psg * config["beta"] if config["beta"] != 1 else psg

    def sum_grad(g, **config):
        return per_sample_grad(g, **config).sum(0)

    return ParamRule(name=f"{op.__name__.split('.')[0]}.self", operands=(GRAD,),
                     per_sample_grad=per_sample_grad, sum_grad=sum_grad)


# ---------------------------------------------------------------------------
# The rules
# ---------------------------------------------------------------------------


def _product_grad(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor, which: int) -> torch.Tensor:
    """The ordinary gradient of ``a @ b`` with respect to ``a`` (0) or ``b`` (1)."""
    a2 = a.unsqueeze(0) if a.dim() == 1 else a
    b2 = b.unsqueeze(-1) if b.dim() == 1 else b
    if b.dim() == 1:
        g = g.unsqueeze(-1)
    if a.dim() == 1:
        g = g.unsqueeze(-2)
    if which == 0:
        return (g @ b2.mT).sum_to_size(a2.shape).reshape(a.shape)
    return (a2.mT @ g).sum_to_size(b2.shape).reshape(b.shape)


def _make_input_grad(op: Any):
    a_pos, b_pos, c_pos = _positions(op)

    def input_grad(args, grad_out, index):
        if index == c_pos:
            grad = grad_out.sum_to_size(args[c_pos].shape)
            beta = _arg(args, 3)
            return grad * beta if beta != 1 else grad
        if index not in (a_pos, b_pos):
            raise NotImplementedError(f"{op} has no differentiable argument {index}")
        grad = _product_grad(args[a_pos], args[b_pos], grad_out, 0 if index == a_pos else 1)
        alpha = _arg(args, 4) if c_pos is not None else 1
        return grad * alpha if alpha != 1 else grad

    return input_grad


def _make_config(op: Any, out_batch):
    a_pos, b_pos, c_pos = _positions(op)

    def propagate(batches, metas):
        return out_batch(batches, metas), _product_ndim(metas[a_pos].dim(), metas[b_pos].dim())

    def config(args: Sequence[Any]) -> dict:
        scales = {"alpha": _arg(args, 4), "beta": _arg(args, 3)} if c_pos is not None else {"alpha": 1}
        return {**(node_layouts(args, propagate) or {}), **scales}

    return config


def _make_check(op: Any, out_batch):
    a_pos, b_pos, c_pos = _positions(op)

    def check(args_batch, args_meta, index):
        out = out_batch(args_batch, args_meta)
        if out is None:
            return ("the parameter meets no batched operand in this product, so its gradient here is "
                    "shared by all samples; multiply it with the batched input directly")
        out_ndim = _product_ndim(args_meta[a_pos].dim(), args_meta[b_pos].dim())
        shape = tuple(args_meta[index].shape)
        if index != c_pos:
            # A matrix's own dims never hold the product's batch; its broadcast dims may.
            shape = (*shape[:-2], 1, 1) if len(shape) > 2 else ()
        if param_spans_batch(shape, out, out_ndim):
            return ("the parameter has a size other than 1 along the batch dim of the product, so each "
                    "sample would use its own slice of it; values the model builds the size of the batch from "
                    "no sample's data (torch.tensor of a Python list, a buffer sliced to B) are not the "
                    "samples' own: pass per-sample values as a tensor batched with the input")
        return None

    return check


def _register(op: Any) -> OpRule:
    a_pos, b_pos, c_pos = _positions(op)
    out_batch, batch_rule = _make_batch_rule(op)
    params = {a_pos: _Use(op, 0).param_rule(), b_pos: _Use(op, 1).param_rule()}
    if c_pos is not None:
        params[c_pos] = _added_term_rule(op)
    return register_rule(OpRule(
        op=op,
        params=params,
        input_grad=_make_input_grad(op),
        batch_rule=batch_rule,
        config=_make_config(op, out_batch),
        check=_make_check(op, out_batch),
    ))


MATMUL = _register(aten.matmul.default)
MM = _register(aten.mm.default)
BMM = _register(aten.bmm.default)
ADDMM = _register(aten.addmm.default)
BADDBMM = _register(aten.baddbmm.default)


# nn.Bilinear is canonicalised into an einsum, and so into bmm (passes/canonicalize.py).
MODULE_OPS: dict[type, tuple] = {torch.nn.Bilinear: (torch.ops.aten.bmm.default,)}
