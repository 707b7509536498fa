"""Canonicalise a Dynamo graph to pre-dispatch ATen, where rules are keyed."""
from __future__ import annotations

import itertools
import math
import operator
import sys
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._decomp import get_decompositions
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, guard_or_false, statically_known_true

from fxdp._torch_internals import (
    erase_unused,
    fake_kernels_torch_lacks,
    inline_checkpoints,
    make_fx_traced,
    size_hint,
    transform_regions_as_aten,
)
from fxdp.errors import UnsupportedError
from fxdp.functions import functions_as_ops, ops_as_functions
from fxdp.passes.autocast import ambient_autocast, explicit_autocast_pass, no_autocast
from fxdp.passes.batch_dims import FILLED_LIKE, pure_op, reached, values_alike_along
from fxdp.passes.writes import (carries_no_gradient, computed_without_grad, is_view, writes_in_place, written_chain,
                                written_through)
from fxdp.registry import named_arg, out_of_place

__all__ = [
    "canonicalize_pass", "expand_after_lookup_pass", "in_place_as_out_of_place_pass", "repeat_as_expand_pass",
    "rnn_initial_state_pass",
]

_RNN_CALLS = {torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu}
_ZEROS = {torch.zeros}


def _zero_state_like(x: torch.Tensor, layers: int, hidden: int, batch_first: bool) -> torch.Tensor:
    """``zeros(layers, B, hidden)`` computed from the input, so it carries its batch dim."""
    time_dim = 1 if batch_first else 0
    probe = x.narrow(time_dim, 0, 1).narrow(-1, 0, 1)  # [B, 1, 1] or [1, B, 1]
    if batch_first:
        probe = probe.transpose(0, 1)
    return torch.zeros_like(probe).expand(layers, -1, hidden)


_CELL_CALLS = {torch.lstm_cell, torch.gru_cell, torch.rnn_tanh_cell, torch.rnn_relu_cell}


def _zero_cell_state_like(x: torch.Tensor, hidden: int) -> torch.Tensor:
    """``zeros(B, hidden)`` computed from a cell's input ``[B, features]``."""
    return torch.zeros_like(x.narrow(-1, 0, 1)).expand(-1, hidden)


def _cell_state(state: Any, x: fx.Node) -> tuple[int, int] | None:
    """``(batch, hidden)`` of a cell's default ``torch.zeros(B, hidden)`` state."""
    if not (isinstance(state, fx.Node) and state.op == "call_function" and state.target in _ZEROS
            and len(state.args) == 2 and all(isinstance(a, int) for a in state.args)):
        return None
    value = x.meta.get("example_value")
    if value is None or value.dim() != 2:
        return None
    return state.args


def data_attr_as_detach_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """``p.data`` in a forward (peft's HRA reads its frozen base weight so) as ``p.detach()``.

    Dynamo records it as ``torch._C._autograd._get_data_attr(p)``, which ``make_fx``
    does not trace: the retrace would keep its fake value as a constant of the graph.
    Within one graph both are the same alias of ``p`` without a gradient.
    """
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch._C._autograd._get_data_attr:
            node.target = torch.ops.aten.detach.default
            changed = True
    if changed:
        gm.recompile()
    return gm


def rnn_initial_state_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Give an RNN's (or a recurrent cell's) default zero initial state the input's batch dim.

    ``nn.LSTM`` without ``hx`` builds ``torch.zeros(L, B, H)``: a constant whose size
    happens to be ``B``. The batch analysis never matches sizes, so the state would
    look shared and its products with the recurrent weights could not be separated
    per sample. The same zeros, computed from the input, are batched.

    Before::

        h_zeros = torch.zeros(1, 3, 5, dtype=torch.float32, device=device(type='cpu'))
        lstm = torch.lstm(x, (h_zeros, c_zeros), [...], True, 1, 0.0, True, False, True)

    After::

        zero_state = _zero_state_like(x, 1, 5, True)
        lstm = torch.lstm(x, (zero_state, zero_state_1), [...], True, 1, 0.0, True, False, True)
    """
    replaced: list[fx.Node] = []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _CELL_CALLS and len(node.args) >= 2:
            replaced += _batch_cell_states(gm, node)
            continue
        if node.op != "call_function" or node.target not in _RNN_CALLS or len(node.args) < 9:
            continue
        x, hx = node.args[0], node.args[1]
        batch_first = bool(node.args[8])
        states = hx if isinstance(hx, (list, tuple)) else [hx]
        new_states = []
        for state in states:
            if (isinstance(state, fx.Node) and state.op == "call_function" and state.target in _ZEROS
                    and len(state.args) == 3 and state.meta.get("example_value") is not None
                    and x.meta.get("example_value") is not None and x.meta["example_value"].dim() == 3):
                layers, _, hidden = state.args
                with gm.graph.inserting_before(node):
                    new = gm.graph.call_function(_zero_state_like, (x, layers, hidden, batch_first))
                new.meta.update(state.meta)
                new_states.append(new)
                replaced.append(state)
            else:
                new_states.append(state)
        args = list(node.args)
        args[1] = type(hx)(new_states) if isinstance(hx, (list, tuple)) else new_states[0]
        node.args = tuple(args)
    if replaced:
        erase_unused(gm, replaced)
        gm.recompile()
    return gm


def _batch_cell_states(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    """``nn.LSTMCell``/``GRUCell``/``RNNCell`` called without a state build
    ``torch.zeros(B, hidden)`` themselves: the same zeros, from the input. Returns the
    replaced states."""
    x, hx = node.args[0], node.args[1]
    states = list(hx) if isinstance(hx, (list, tuple)) else [hx]
    new_states, replaced = [], []
    for state in states:
        shape = _cell_state(state, x)
        if shape is None:
            new_states.append(state)
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(_zero_cell_state_like, (x, shape[1]))
        new.meta.update(state.meta)
        new_states.append(new)
        replaced.append(state)
    if replaced:
        args = list(node.args)
        args[1] = type(hx)(new_states) if isinstance(hx, (list, tuple)) else new_states[0]
        node.args = tuple(args)
    return replaced


# Recurrent layers arrive as one fused call; their decompositions unroll them into
# per-step ``aten.linear`` calls, which the linear rule handles as tied uses.
# ``F.affine_grid``'s derivative reads its size argument as ints, which fails on a
# symbolic batch size (a second batch size); its decomposition is a product and a sum.
_DECOMPOSED = [
    torch.ops.aten.lstm.input, torch.ops.aten.gru.input, torch.ops.aten.rnn_tanh.input,
    torch.ops.aten.rnn_relu.input, torch.ops.aten.affine_grid_generator.default,
    # The antialiased resizes by a list of sizes or scales, as the resize to sizes they
    # compute: ATen's own composite passes the sizes on as integers, which fails on
    # symbolic sizes (a second image size) where the op runs again under ``vmap`` (a
    # parameter resized to the image, a per-sample VJP).
    torch.ops.aten._upsample_bilinear2d_aa.vec, torch.ops.aten._upsample_bicubic2d_aa.vec,
]


def _lstm_cell(x, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """``aten.lstm_cell`` as linears and pointwise gates, on every device. ATen's own
    implementation is that on the CPU, but on CUDA it is two bias-free matrix products
    and the fused ``_thnn_fused_lstm_cell``, which adds both biases inside a kernel
    that no rule knows."""
    h, c = hx
    gates = torch.ops.aten.linear.default(h, w_hh, b_hh) + torch.ops.aten.linear.default(x, w_ih, b_ih)
    i, f, g, o = gates.chunk(4, 1)
    cy = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(cy), cy


def _gru_cell(x, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """``aten.gru_cell`` as linears and pointwise gates, on every device (CUDA's
    implementation is ``_thnn_fused_gru_cell``, as for ``_lstm_cell``)."""
    i_r, i_z, i_n = torch.ops.aten.linear.default(x, w_ih, b_ih).chunk(3, 1)
    h_r, h_z, h_n = torch.ops.aten.linear.default(hx, w_hh, b_hh).chunk(3, 1)
    reset, update = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
    new = torch.tanh(i_n + reset * h_n)
    return (hx - new) * update + new


# Recurrent cells (nn.LSTMCell, GRUCell, RNNCell) are composite ops; ATen's own
# implementation is linears and pointwise gates, which have rules (the LSTM and GRU
# cells' written out above, as CUDA's is fused).
_CELLS = {torch.ops.aten.lstm_cell.default: _lstm_cell, torch.ops.aten.gru_cell.default: _gru_cell}
_COMPOSITE = [
    torch.ops.aten.rnn_tanh_cell.default, torch.ops.aten.rnn_relu_cell.default,
    # Matrix-transpose aliases (``x.mT``, ``x.mH``, ``x.T``), kept whole by the
    # pre-dispatch trace: as the transposes and permutes they are, the batch-dim
    # analysis and the parameter-transform rules know them.
    torch.ops.aten.mT.default, torch.ops.aten.mH.default, torch.ops.aten.adjoint.default,
    torch.ops.aten.numpy_T.default, torch.ops.aten.matrix_H.default,
    # ``torch.distributions`` broadcast their parameters together: as the expands it is
    # (a learned scale expanded to the batch meets the elementwise rules). So is
    # ``broadcast_to`` (torchtune's CLS token ``cls.broadcast_to(B, T, 1, d)``, concatenated
    # with the tokens, meets the rule of an expanded parameter).
    torch.ops.aten.broadcast_tensors.default, torch.ops.aten.broadcast_to.default,
    # NumPy-style aliases of pointwise ops (``torch.multiply``, ``torch.subtract``, ...):
    # as the ops they stand for, they meet those ops' rules and propagations.
    *(getattr(getattr(torch.ops.aten, name), overload) for name, overloads in {
        "multiply": ("Tensor", "Scalar"), "subtract": ("Tensor", "Scalar"),
        "divide": ("Tensor", "Scalar", "Tensor_mode"), "true_divide": ("Tensor",),
        "greater": ("Tensor", "Scalar"), "greater_equal": ("Tensor", "Scalar"), "less": ("Tensor", "Scalar"),
        "less_equal": ("Tensor", "Scalar"), "not_equal": ("Tensor", "Scalar"), "negative": ("default",),
        "absolute": ("default",), "arccos": ("default",), "arcsin": ("default",), "arctan": ("default",),
        "arctanh": ("default",), "clip": ("default",), "fix": ("default",), "square": ("default",),
        "special_expit": ("default",),
    }.items() for overload in overloads),
]


def _unknown_composites(gm: fx.GraphModule, decompositions: dict) -> set:
    """ATen ops of ``gm`` that the analysis knows nothing about (no rule, no batch
    propagation, not pointwise) but that PyTorch writes in other ATen ops
    (``CompositeImplicitAutograd``: ``movedim``, ``tile``, ``kron``, ``fliplr``,
    ``diff``, ``narrow(Tensor)``, ``torch.fft.irfft``, ``torch.linalg.inv``, ...): the
    trace keeps them whole, and their decomposition may be known where they are not."""
    from fxdp.passes.batch_dims import PROPAGATION, _is_pointwise
    from fxdp.registry import lookup

    found = set()
    for node in gm.graph.nodes:
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or op in decompositions:
            continue
        if op.namespace != "aten" or op in _KEPT_WHOLE or op in PROPAGATION or lookup(op) is not None \
                or _is_pointwise(op):
            continue
        if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
            found.add(op)
    return found


# Composite ops that later passes take whole (``einsum`` is decomposed after the
# expands have moved onto its operands, ``_einsum_as_products``).
_KEPT_WHOLE = {torch.ops.aten.einsum.default}


def _bilinear_as_einsum(input1, input2, weight, bias=None):
    """``nn.Bilinear``: ``y_o = x1ᵀ W_o x2 + b_o`` as two ``einsum``s (ATen writes it as
    ``_trilinear``, which has no rule; the einsums become matrix products that do). Not
    one einsum of three operands: ``torch.einsum`` would order those with opt_einsum,
    whose path search reads the batch size as an int, so every batch size would compile
    again."""
    projected = torch.einsum("...j,oij->...oi", input2, weight)
    out = torch.einsum("...oi,...i->...o", projected, input1)
    return out if bias is None else out + bias


def _broadcast_letters(equation: str, operands: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The letters of ``equation`` along which every operand that has them is expanded
    (stride 0) and which the output keeps, with their sizes; ``{}`` for an equation
    with an ellipsis, an implicit output or a letter repeated within one operand."""
    if "..." in equation or "->" not in equation:
        return {}
    inputs, output = equation.replace(" ", "").split("->")
    terms = inputs.split(",")
    if len(terms) != len(operands) or any(len(set(t)) != len(t) or len(t) != o.dim()
                                          for t, o in zip(terms, operands)):
        return {}
    letters = {}
    for letter in output:
        dims = [(o, t.index(letter)) for t, o in zip(terms, operands) if letter in t]
        # An expand's stride is a literal 0; a symbolic stride is compared with nothing.
        if dims and all(isinstance(o.stride(d), int) and o.stride(d) == 0
                        and not (isinstance(o.shape[d], int) and o.shape[d] == 1) for o, d in dims):
            letters[letter] = dims[0][0].shape[dims[0][1]]
    return letters


def _chunked_linear_cross_entropy(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                                  label_smoothing, batch_chunk_size, acc_policy, acc_dtype, allow_retain_graph,
                                  compute_input_grad, compute_linear_weight_grad, compute_linear_bias_grad):
    """``nn.LinearCrossEntropyLoss`` with chunking ``options``: a custom op that computes
    the loss and its gradients chunk by chunk, in the forward. Per sample it is the linear
    and the loss it fuses, whose ops have rules; its precomputed gradients (the other
    outputs, unread by the graph) become zeros of their shapes."""
    loss = torch.nn.functional.cross_entropy(
        torch.nn.functional.linear(input, linear_weight, linear_bias), target, weight=weight,
        reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing)
    grad_shapes = (input.shape if compute_input_grad else (0, 0),
                   linear_weight.shape if compute_linear_weight_grad else (0, 0),
                   linear_weight.shape[:-1] if compute_linear_bias_grad else (0,))
    return (loss, *(input.new_zeros(shape) for shape in grad_shapes))


def _chunked_linear_cross_entropy_per_sample(input, linear_weight, target, linear_bias, weight, ignore_index,
                                             batch_chunk_size, acc_policy, acc_dtype):
    """The ``reduction="none"`` form of ``_chunked_linear_cross_entropy``."""
    return torch.nn.functional.cross_entropy(
        torch.nn.functional.linear(input, linear_weight, linear_bias), target, weight=weight,
        reduction="none", ignore_index=ignore_index)


def _chunked_linear_cross_entropy_ops() -> dict:
    """The chunked ops of ``nn.LinearCrossEntropyLoss`` (registered when torch.nn's
    module is imported; absent before torch 2.13)."""
    try:
        import torch.nn.modules.linear_cross_entropy  # noqa: F401 - registers the ops
    except ImportError:
        return {}
    ops = getattr(torch.ops, "torch_nn", None)
    found = {}
    for name, decomposition in (("_linear_cross_entropy_batch_chunked", _chunked_linear_cross_entropy),
                                ("_linear_cross_entropy_batch_chunked_no_reduction",
                                 _chunked_linear_cross_entropy_per_sample)):
        op = getattr(ops, name, None) if ops is not None else None
        if op is not None:
            found[op.default] = decomposition
    return found


def _inactive_dropout(x, p, train):
    """``dropout(x, 0.0, train)`` and ``dropout(x, p, False)`` are ``x`` (a model built
    with zero dropout keeps the call): the trace reads ``x`` itself, so an expanded ``x``
    stays visibly expanded to what reads it (XLNet drops out a position table expanded
    to the batch before an einsum); any other dropout stays itself."""
    if isinstance(p, (int, float)) and isinstance(train, bool) and (p == 0 or not train):
        return x
    return NotImplemented


def _attention_with_learned_mask(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                                 scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` with a mask that carries a gradient (a learned
    relative-position bias, ALiBi slopes) is its math kernel's ops, the kernel PyTorch
    itself picks for such a mask on the CPU. The parameter then reaches the scores
    through an addition, whose per-sample gradient is a sum of the scores' gradient,
    and a dropout of the attention weights is an ordinary dropout of a batched value.
    The fused CPU kernel has no derivative for the mask, and its dropout's draw could not
    be replayed per sample; CUDA's memory-efficient one has a derivative, but its
    per-sample replay would be the generic one (``B`` runs of the op for a mask
    expanded to the batch). Any other call stays fused."""
    if not (isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad):
        return NotImplemented
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]


def _reduction_of_one_value(x, *args, dtype=None, **kwargs):
    """A sum or mean of a 0-d tensor in its own dtype is a copy of it: a loss already
    reduced over the batch and passed through ``.mean()`` again (``mse + aux.mean()``)
    stays the loss, to which only sums, shared scalings and copies may follow."""
    if x.dim() == 0 and x.is_floating_point() and dtype in (None, x.dtype):
        return x.clone()
    return NotImplemented


def _cumsum_of_data_dependent_rows(x, dim, dtype=None):
    """``cumsum`` along a dim of static size ``K`` (at most 64) of a tensor whose other
    sizes depend on the data (the rows of ``h[mask]``: a spline's bins, in normflows'
    and nflows' rational-quadratic splines) as ``(x[..., None] * triu(ones(K, K))).sum``:
    the same sums, which AOTAutograd can differentiate, where PyTorch's ``cumsum``
    backward guards on the data-dependent number of elements (torch 2.13)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if not x.dim() or not free_unbacked_symbols(x.shape) or not (x.is_floating_point() or x.is_complex()) \
            or dtype not in (None, x.dtype):
        return NotImplemented
    dim = dim + x.dim() if dim < 0 else dim
    size = x.shape[dim]
    size = size.node.maybe_as_int() if isinstance(size, torch.SymInt) else size
    if size is None or size > 64:
        return NotImplemented
    upper = torch.ones(size, size, dtype=x.dtype, device=x.device).triu()
    return (x.movedim(dim, -1).unsqueeze(-1) * upper).sum(-2).movedim(-1, dim)


def _stack_as_cat(tensors, dim=0):
    """``stack`` as the ``cat`` of its inputs unsqueezed: a parameter stacked with
    batched data (``stack([x, p.expand_as(x)], 1)``) meets ``cat``'s rule, and expands
    of stacked parameter values move past the ``cat`` to where they broadcast."""
    dim = dim + tensors[0].dim() + 1 if dim < 0 else dim
    return torch.ops.aten.cat.default([t.unsqueeze(dim) for t in tensors], dim)


def _select_scatter_as_slice(base, src, dim, index):
    """``select_scatter`` as the ``slice_scatter`` of one row: the per-sample VJP of a
    parameter transform runs under ``vmap``, where ``select_scatter``'s backward left
    the written row's gradient through ``base`` unmasked (torch 2.13: three times the
    gradient of ``select_scatter(w, 3 * w[0], 0, 0)``'s row 0)."""
    if index < 0:
        index = index + base.shape[dim]
    return torch.ops.aten.slice_scatter.default(base, src.unsqueeze(dim), dim, index, index + 1)


def _index_fill_as_where(self, dim, index, value):
    """``index_fill`` with a tensor value as ``where`` over a mask of the filled positions:
    the same values, and the value's gradient is the sum over those positions. ATen's
    formula for it dedupes the indices with ``_unique``, whose size depends on the data,
    so the per-sample VJP of a trainable value (``h.index_fill_(1, idx, self.s)``) could
    not be traced where the indices are a graph input (a buffer, under the backend)."""
    size = self.shape[dim] if self.dim() else 1
    mask = torch.zeros(size, dtype=torch.bool, device=self.device).index_fill(0, index.reshape(-1), True)
    if self.dim():
        mask = mask.view([size if d == dim % self.dim() else 1 for d in range(self.dim())])
    return torch.where(mask.reshape(()) if not self.dim() else mask, value.to(self.dtype), self)


def _index_fill__as_where(self, dim, index, value):
    return self.copy_(_index_fill_as_where(self, dim, index, value))


def _take_along_dim_as_gather(input, indices, dim=None):
    """``take_along_dim`` as ``gather`` of its operands broadcast, as ATen writes it, but
    with the operands' own sizes: its kernel reads them as ints, which on a graph with a
    symbolic batch size would fix it (every new batch size compiled again). The
    analysis then sees a ``gather`` of an expanded table (RoBERTa's
    ``gather(token_type_ids.expand(B, -1), 1, position_ids)``). Negative indices
    count from the end, as ``take_along_dim`` has them and ``gather`` does not."""
    if dim is None:
        flat = indices.reshape(-1)
        return torch.ops.aten.gather.default(input.reshape(-1), 0, torch.where(flat < 0, flat + input.numel(), flat))
    dim %= input.dim()
    indices = torch.where(indices < 0, indices + input.shape[dim], indices)
    sizes = list(input.shape)
    sizes[dim] = indices.shape[dim]
    sizes = list(torch.broadcast_shapes(tuple(sizes), tuple(indices.shape)))
    if sizes != list(indices.shape):
        indices = indices.expand(sizes)
    sizes[dim] = input.shape[dim]
    if sizes != list(input.shape):
        input = input.expand(sizes)
    return torch.ops.aten.gather.default(input, dim, indices)


def _avg_pool_with_full_sizes(spatial: int):
    """``avg_pool{2,3}d`` with ``kernel_size``, ``stride`` and ``padding`` given for every
    spatial dim (``padding=(1,)`` means 1 in each, as ATen reads it): Inductor's
    lowering of the backward asserts full lists (torch 2.13: ``F.avg_pool2d(x, 3,
    padding=(1,))`` fails to compile, fxdp or not)."""
    op = {2: torch.ops.aten.avg_pool2d.default, 3: torch.ops.aten.avg_pool3d.default}[spatial]

    def avg_pool(input, kernel_size, stride=(), padding=None, *rest):
        # The call below gets here again, with arguments at their defaults left out
        # (stride=[], the kernel size; padding 0): those need nothing.
        padding = [0] * spatial if padding is None else padding
        sizes = [[s] if isinstance(s, int) else list(s) for s in (kernel_size, stride, padding)]
        if all(len(s) != 1 for s in sizes):
            return NotImplemented
        return op(input, *(s * spatial if len(s) == 1 else s for s in sizes), *rest)

    return avg_pool


def _batch_norm_eval_as_affine(input, weight, bias, running_mean, running_var, training, momentum, eps,
                               cudnn_enabled):
    """BatchNorm with running statistics (eval mode) as the per-channel affine map it
    is, written as PyTorch's own decomposition writes it (Inductor lowers both the
    same). Its weight and bias then meet the elementwise rules (a sample's gradient
    is a sum over its positions) instead of the generic per-sample VJP, whose ``vmap``
    takes long to trace and, on a graph with a symbolic batch size, runs eagerly at
    every step. Training mode, which mixes samples, stays whole to be refused."""
    if training or running_mean is None or running_var is None or (weight is None and bias is None):
        return NotImplemented
    shape = [-1] + [1] * (input.dim() - 2)
    compute = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
    mean, var = running_mean.to(compute).reshape(shape), running_var.to(compute).reshape(shape)
    out = (input - mean) * (1 / torch.sqrt(var + eps))
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out.to(input.dtype)


def _instance_norm_eval_as_affine(input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps,
                                  cudnn_enabled):
    """InstanceNorm with running statistics (eval mode, ``track_running_stats=True``) as
    the per-channel affine map it is, as ``_batch_norm_eval_as_affine``: its weight and
    bias then meet the elementwise rules. With the input's own statistics it stays whole
    (its rule)."""
    if use_input_stats or running_mean is None or running_var is None or (weight is None and bias is None):
        return NotImplemented
    return _batch_norm_eval_as_affine(input, weight, bias, running_mean, running_var, False, momentum, eps,
                                      cudnn_enabled)


def _einsum_as_products(equation, operands, **kwargs):
    """``aten.einsum`` as ATen's own implementation runs it: permutes, views and
    ``bmm``/``mul``/``sum``. Its tensors come as one list argument, which the tag pass
    cannot tag a parameter in; the ops it becomes have rules (a parameter operand goes
    through ``bmm`` with a parameter transform in front) and batch propagations.

    A letter along which its operands are only expanded (XLNet's
    ``einsum("ibh,hnd->ibnd", pos.expand(-1, B, -1), r)``) is contracted at size 1 and
    the result expanded: the same values, and an expand the later passes can move to
    where it meets the batch, instead of a product that mixes it into other dims.
    """
    letters = _broadcast_letters(equation, operands)
    if not letters:
        return torch.ops.aten.einsum.default.decompose(equation, operands, **kwargs)
    inputs, output = equation.replace(" ", "").split("->")
    narrowed = [o[tuple(slice(0, 1) if letter in letters else slice(None) for letter in term)]
                for term, o in zip(inputs.split(","), operands)]
    out = torch.ops.aten.einsum.default.decompose(equation, narrowed, **kwargs)
    return out.expand([letters.get(letter, -1) for letter in output])


def canonicalize_pass(gm: fx.GraphModule, fake_args: Sequence[Any], *, fake_mode) -> fx.GraphModule:
    """Retrace ``gm`` with ``make_fx(pre_dispatch=True)`` under its fake mode.

    ``torch._C._nn.linear(x, w, b)`` becomes ``torch.ops.aten.linear.default(x, w, b)``;
    ``aten.lstm`` and the recurrent cells become per-step linears, ``aten.einsum`` and
    ``aten.bilinear`` matrix products; autocast's casts become ops (``passes/autocast.py``);
    activation-checkpointed regions are inlined (their ops become ordinary ops of the
    graph), ``torch.func`` transforms become the ATen code they run
    (``transform_regions_as_aten``); ``torch.autograd.Function`` calls stay whole (``fxdp/functions.py``).
    Placeholders keep their order, node meta (``nn_module_stack``) is preserved.
    """
    fake_kernels_torch_lacks()  # (also under torch.compile(backend="fxdp"), which captures without fxdp)
    gm = functions_as_ops(inline_checkpoints(transform_regions_as_aten(gm, fake_mode)))
    gm = rnn_initial_state_pass(data_attr_as_detach_pass(gm))
    # The LSTM decomposition would pick the opaque aten.mkldnn_rnn_layer on CPU float32.
    decompositions = {
        **get_decompositions(_DECOMPOSED), **{op: op.decompose for op in _COMPOSITE}, **_CELLS,
        torch.ops.aten.bilinear.default: _bilinear_as_einsum, torch.ops.aten.dropout.default: _inactive_dropout,
        torch.ops.aten.select_scatter.default: _select_scatter_as_slice,
        torch.ops.aten.stack.default: _stack_as_cat,
        torch.ops.aten.sum.default: _reduction_of_one_value,
        torch.ops.aten.mean.default: _reduction_of_one_value,
        torch.ops.aten.sum.dim_IntList: _reduction_of_one_value,
        torch.ops.aten.mean.dim: _reduction_of_one_value,
        torch.ops.aten.take_along_dim.default: _take_along_dim_as_gather,
        torch.ops.aten.cumsum.default: _cumsum_of_data_dependent_rows,
        torch.ops.aten.index_fill.int_Tensor: _index_fill_as_where,
        torch.ops.aten.index_fill_.int_Tensor: _index_fill__as_where,
        torch.ops.aten.batch_norm.default: _batch_norm_eval_as_affine,
        torch.ops.aten.instance_norm.default: _instance_norm_eval_as_affine,
        torch.ops.aten.scaled_dot_product_attention.default: _attention_with_learned_mask,
        torch.ops.aten.avg_pool2d.default: _avg_pool_with_full_sizes(2),
        torch.ops.aten.avg_pool3d.default: _avg_pool_with_full_sizes(3),
        **_chunked_linear_cross_entropy_ops(),
    }
    def trace(table: dict) -> fx.GraphModule:
        with torch.backends.mkldnn.flags(enabled=False):
            return make_fx_traced(fx.Interpreter(gm).run, fake_args, fake_mode=fake_mode, pre_dispatch=True,
                                  decompositions=table)

    out = trace(decompositions)
    for _ in range(4):
        composites = _unknown_composites(out, decompositions)
        if not composites:
            break
        wider = {**decompositions, **{op: op.decompose for op in composites}}
        try:
            out, decompositions = trace(wider), wider
        except Exception:  # noqa: BLE001 - a decomposition that needs data (tensor_split by a tensor)
            break  # keep the ops whole: the analysis names them
    ambient = ambient_autocast()
    out = explicit_autocast_pass(out, fake_args, fake_mode=fake_mode, ambient=ambient)
    out = _simplified(out)
    if any(n.target is torch.ops.aten.einsum.default for n in out.graph.nodes):
        # Einsums are decomposed once the expands have moved onto their operands, where
        # the decomposition sees them (``_einsum_as_products``).
        with torch.backends.mkldnn.flags(enabled=False), no_autocast(list(ambient)):
            out = make_fx_traced(fx.Interpreter(out).run, fake_args, fake_mode=fake_mode, pre_dispatch=True,
                                 decompositions={torch.ops.aten.einsum.default: _einsum_as_products})
        out = _simplified(out)
    out = overlapping_outputs_as_copies_pass(ops_as_functions(out))
    out.graph.lint()
    out.recompile()
    return out


def _may_overlap_itself(t: Any) -> bool:
    """Whether two elements of ``t`` may share memory (a broadcast, overlapping windows):
    its dims, by increasing stride, must each step past everything the smaller ones span."""
    if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
        return False
    if _dense(t):
        return False
    span = 0
    for size, stride in sorted(((z, st) for z, st in zip(t.shape, t.stride()) if not statically_known_true(z <= 1)),
                               key=lambda zs: size_hint(zs[1])):
        if not statically_known_true(stride > span):
            return True
        span = span + (size - 1) * stride
    return False


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s strides are those of a contiguous tensor of its dims in some order
    (contiguous, channels-last, a transpose), expression for expression: symbolic sizes
    give strides such as ``4·Max(1, s)``, past which the span test cannot see."""
    from torch._prims_common import make_contiguous_strides_for

    order = sorted(range(t.dim()), key=lambda d: size_hint(t.stride(d)), reverse=True)
    expected = make_contiguous_strides_for([t.shape[d] for d in order])
    return all(statically_known_true(t.stride(d) == e) for d, e in zip(order, expected))


def overlapping_outputs_as_copies_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Return a copy of every output whose elements overlap in memory (``h.unfold(-1, 2, 1)``).

    Works around a PyTorch bug (torch 2.13, AOTAutograd): an output that is a view of a
    graph intermediate is regenerated outside the graph by replaying the view, and the
    replayed view's backward drops the sum over overlapping elements when the output's
    gradient is a broadcast (``(out * c).sum()``): plain ``torch.compile`` returns the
    wrong gradient too. A copy is an output of its own, whose backward (in the graph)
    sums the overlaps.
    """
    output = next(n for n in gm.graph.nodes if n.op == "output")
    changed = False
    for value in list(output.all_input_nodes):
        if _may_overlap_itself(value.meta.get("val")):
            with gm.graph.inserting_before(output):
                copy = gm.graph.call_function(torch.ops.aten.clone.default, (value,))
            copy.meta = {**value.meta, "val": value.meta["val"].clone()}
            output.replace_input_with(value, copy)
            changed = True
    return _finished(gm, changed)


def _simplified(gm: fx.GraphModule) -> fx.GraphModule:
    """The canonical graph's rewrites, in order."""
    gm = no_op_conversion_pass(gm)
    gm = whole_slice_pass(gm)
    gm = legacy_empty_cat_pass(gm)
    gm = repeat_as_expand_pass(gm)
    gm = out_arguments_as_copies_pass(gm)
    gm = written_pieces_as_views_pass(gm)
    gm = empty_scatter_pass(filled_slices_as_cat_pass(in_place_as_out_of_place_pass(gm)))
    gm = filled_pieces_as_one_fill_pass(unique_rows_gathered_back_pass(gm))
    gm = unit_scale_pass(gm)
    gm = masked_fill_by_index_put_as_where_pass(nonzero_positions_as_mask_pass(gm))
    gm = bernoulli_probability_detached_pass(gm)
    # Expands move down to the ops that consume them (the lookups and linears, then
    # what consumes those), where broadcasting replaces them; a pointwise op that an
    # expand moves past can bring it to a lookup, hence rounds until nothing moves
    # (peft's prefix: lookup, dtype cast, view, permute, split, select, cat).
    gm = uniform_constants_as_fills_pass(counting_constants_as_arange_pass(selected_before_the_slice_pass(gm)))
    gm = constant_ids_as_expand_pass(gm)
    for _ in range(6):
        before = gm.code
        gm = sink_expands_pass(gm)
        gm = expand_after_lookup_pass(gm)
        gm = sink_expands_pass(gm)
        gm = broadcast_expanded_operands_pass(gm)
        gm = tiled_pointwise_pass(gm)
        if gm.code == before:
            break
    gm = broadcast_batched_product_pass(gm)
    gm = complex_scatters_as_real_pass(gm)
    return unviewable_views_as_reshapes_pass(tiled_batched_product_pass(gm))


def selected_before_the_slice_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """A ``select`` of a ``slice`` along another dim as the slice of the select, the
    select taken down through pointwise arithmetic to the one piece of a ``cat`` along
    its dim that it reads.

    TimeSformer's ``embeddings[:B, 0, :]`` on its ``[B*T, 1 + N, D]`` frames, where
    ``embeddings = cat([cls.expand(B*T, 1, D), patches], 1) + pos``, reads the class
    token's row of the first ``B`` frames: the slice of the batch alone mixes samples,
    but the row is ``cls[:, 0] + pos[:, 0]`` in every frame, no sample's data, and ``[:B]``
    of it (an expand, once ``sink_expands_pass`` moves the expand down) is ``B`` copies::

        cat = torch.ops.aten.cat.default([expand, linear], 1)                  # before
        add = torch.ops.aten.add.Tensor(cat, pos)
        slice_1 = torch.ops.aten.slice.Tensor(add, 0, 0, 3)
        select = torch.ops.aten.select.int(slice_1, 1, 0)
        select_1 = torch.ops.aten.select.int(expand, 1, 0)                     # after
        select_2 = torch.ops.aten.select.int(pos, 1, 0)
        add_1 = torch.ops.aten.add.Tensor(select_1, select_2)
        slice_2 = torch.ops.aten.slice.Tensor(add_1, 0, 0, 3)

    Nothing changes where the select meets no such ``cat``, or where a value on the way
    is written in place.
    """
    aten = torch.ops.aten
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.select.int or not isinstance(node.args[2], int):
            continue
        sliced = node.args[0]
        if not (isinstance(sliced, fx.Node) and sliced.op == "call_function" and sliced.target is aten.slice.Tensor
                and named_arg(sliced, "step", 1) == 1 and named_arg(sliced, "start", None) in (None, 0)
                and not written_through(sliced)):
            continue
        rank = sliced.meta["val"].dim()
        dim, along = node.args[1] % rank, named_arg(sliced, "dim", 0) % rank
        if dim == along or along != 0:
            continue  # (only the first rows of the leading dim: where the batch is, ``[:B]``)
        before, visited = set(gm.graph.nodes), []
        with gm.graph.inserting_before(node):
            picked = _selected_piece(gm, sliced.args[0], dim, node.args[2], node, visited)
            if picked is not None and not _written_between(gm, visited, node):
                new = _call(gm, aten.slice.Tensor, (picked, 0, None, named_arg(sliced, "end", None)), node)
                _replace(gm, node, new)
                changed = True
                continue
        for made in reversed([n for n in gm.graph.nodes if n not in before]):
            if not made.users:
                gm.graph.erase_node(made)
    return _finished(gm, changed)


def _written_between(gm: fx.GraphModule, visited: list[fx.Node], node: fx.Node) -> bool:
    """Whether an op between the first of ``visited`` and ``node`` writes in place: the
    values the select is computed from at ``node`` would no longer be those read where
    ``visited`` were (a buffer added, then written, then the class row read)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first = min(order[v] for v in visited)
    return any(n.op == "call_function" and writes_in_place(n.target)
               for n in gm.graph.nodes if first <= order[n] < order[node])


_SELECTED_THROUGH = {torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor, torch.ops.aten.mul.Tensor,
                     torch.ops.aten.div.Tensor}


def _selected_piece(gm: fx.GraphModule, x: Any, dim: int, index: int, like: fx.Node,
                    visited: list[fx.Node]) -> fx.Node | None:
    """``x.select(dim, index)`` computed from the one piece of a ``cat`` along ``dim`` it
    reads, through the pointwise arithmetic on the way, in ``x``'s dtype; ``None`` where
    there is no such ``cat`` (or a value on the way is written in place, or a piece has
    another dtype than the ``cat`` it was promoted to). ``visited`` gets the nodes read."""
    aten = torch.ops.aten
    if not isinstance(x, fx.Node) or x.op != "call_function" or written_through(x):
        return None
    visited.append(x)
    size = x.meta["val"].shape[dim]
    if not isinstance(size, int) or not -size <= index < size:
        return None
    index %= size
    if x.target is aten.cat.default and named_arg(x, "dim", 0) % x.meta["val"].dim() == dim:
        start = 0
        for piece in x.args[0]:
            rows = piece.meta["val"].shape[dim] if piece.meta["val"].dim() == x.meta["val"].dim() else 0
            if not isinstance(rows, int):
                return None
            if index < start + rows:
                if piece.meta["val"].dtype != x.meta["val"].dtype or written_through(piece):
                    return None
                visited.append(piece)
                inner = _selected_piece(gm, piece, dim, index - start, like, visited)
                return inner if inner is not None else _call(gm, aten.select.int, (piece, dim, index - start), like)
            start += rows
        return None
    if x.target not in _SELECTED_THROUGH:
        return None
    rank, operands, found = x.meta["val"].dim(), [], False
    for arg in x.args[:2]:
        value = arg.meta.get("val") if isinstance(arg, fx.Node) else None
        at = dim - (rank - value.dim()) if isinstance(value, torch.Tensor) else -1
        if at < 0:
            operands.append(arg)  # a number, or a tensor broadcast along ``dim``
            continue
        row = 0 if value.shape[at] == 1 else index
        inner = _selected_piece(gm, arg, at, row, like, visited)
        found = found or inner is not None
        operands.append(inner if inner is not None else _call(gm, aten.select.int, (arg, at, row), like))
    if not found:
        return None
    out = _call(gm, x.target, (*operands, *x.args[2:]), like, dict(x.kwargs))
    # A selected operand of one element less may promote otherwise (a 0-d tensor does not
    # raise a dimensioned one's dtype).
    return out if out.meta["val"].dtype == x.meta["val"].dtype else None


def filled_slices_as_cat_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """A tensor whose every slice along one dim a chain of writes replaced, each slice
    once, is the ``cat`` of the written values: a loop that fills a preallocated output
    row by row (``out = torch.zeros(B, d); for i in range(B): out[i] = f(x[i])``, the
    writes made ``slice_scatter``s by ``in_place_as_out_of_place_pass``) is then the
    loop ``torch.stack([f(x[i]) for i in range(B)])`` that ``passes/chunk_loops.py``
    maps over the batch::

        slice_scatter = aten.slice_scatter.default(zeros, unsqueeze, 0, 0, 1)      # before
        slice_scatter_1 = aten.slice_scatter.default(slice_scatter, unsqueeze_1, 0, 1, 2)
        cat = aten.cat.default([unsqueeze, unsqueeze_1])                          # after

    The filled tensor's own values are all overwritten, so nothing of them is read (nor
    gets a gradient). A chain read before its last write (``out[i]`` taken before
    ``out[i] = …``) stays as it is, and so does one with a value written in place after
    its write (the ``cat`` reads it at the end)."""
    scatter = torch.ops.aten.slice_scatter.default
    for node in reversed(list(gm.graph.nodes)):
        if is_view(node) and not node.users:
            gm.graph.erase_node(node)  # the views the writes went through
    changed = False
    for node in reversed(list(gm.graph.nodes)):
        if node.target is not scatter or node.op != "call_function" or any(
                u.target is scatter and u.args[0] is node for u in node.users):
            continue  # not the last write of a chain
        chain = [node]
        while isinstance(chain[-1].args[0], fx.Node) and chain[-1].args[0].target is scatter \
                and len(chain[-1].args[0].users) == 1:
            chain.append(chain[-1].args[0])
        spans = _filled_spans(chain)
        if spans is None or any(_written_somewhere(_memory_of(src)) for _, src in spans):
            continue  # (a value written in place after its write: the cat would read it later)
        with gm.graph.inserting_before(node):
            cat = _call(gm, torch.ops.aten.cat.default, ([src for _, src in spans], spans[0][0]), node)
        node.replace_all_uses_with(cat)
        changed = True
    return _finished(gm, changed)


def _filled_spans(chain: list[fx.Node]) -> list[tuple[int, fx.Node]] | None:
    """``(dim, value)`` of each write of ``chain`` (``slice_scatter``s, the last first),
    in the order of the slices they write, where together they write every slice of
    their base along ``dim`` once, with static bounds; else ``None``."""
    base = chain[-1].args[0].meta.get("val")
    if len(chain) < 2 or not isinstance(base, torch.Tensor):
        return None
    spans, dims = [], set()
    for write in chain:
        _, src, dim, start, end, step = (list(write.args) + [0, None, None, 1][len(write.args) - 2:])[:6]
        dim = dim % base.dim()
        size = base.shape[dim]
        if step != 1 or not isinstance(size, int) or not isinstance(src, fx.Node) \
                or src.meta["val"].dtype != base.dtype:
            return None
        start, end = 0 if start is None else start, size if end is None else end
        if not (isinstance(start, int) and isinstance(end, int)):
            return None
        start, end = (max(0, min(v + size if v < 0 else v, size)) for v in (start, end))
        spans.append((start, end, src))
        dims.add(dim)
    spans.sort(key=lambda s: s[0])
    if len(dims) != 1 or spans[0][0] != 0 or spans[-1][1] != base.shape[next(iter(dims))] or any(
            a[1] != b[0] or a[0] >= a[1] for a, b in itertools.pairwise(spans)) or spans[-1][0] >= spans[-1][1]:
        return None
    return [(next(iter(dims)), src) for _, _, src in spans]


def complex_scatters_as_real_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """A ``slice_scatter`` of complex values, on their real views: autograd has no
    complex derivative of ``slice_scatter`` (torch 2.13), which the writes of the FNO
    paper's Fourier layers become (``out_ft[:, :, :m] = einsum(x_ft[:, :, :m], w)``
    into a zero spectrum, ``_write_as_scatter``)::

        slice_scatter = aten.slice_scatter.default(zeros, einsum, 2, 0, 4)             # before
        slice_scatter = aten.view_as_complex.default(aten.slice_scatter.default(
            aten.view_as_real.default(zeros), aten.view_as_real.default(einsum), 2, 0, 4))  # after

    ``view_as_real`` adds a last dim of 2: the scattered dim keeps its index."""
    changed = False
    for node in list(gm.graph.nodes):
        value = node.meta.get("val")
        if not (node.op == "call_function" and node.target is torch.ops.aten.slice_scatter.default
                and isinstance(value, torch.Tensor) and value.is_complex()):
            continue
        (base, src, *bounds), kwargs = node.args, dict(node.kwargs)
        dim = kwargs.pop("dim", bounds[0] if bounds else 0)
        if dim < 0:
            dim += value.dim()
        with gm.graph.inserting_before(node):
            real = [_call(gm, torch.ops.aten.view_as_real.default, (t,), node) for t in (base, src)]
            scattered = _call(gm, torch.ops.aten.slice_scatter.default, (*real, dim, *bounds[1:]), node, kwargs)
            back = _call(gm, torch.ops.aten.view_as_complex.default, (scattered,), node)
        node.replace_all_uses_with(back)
        gm.graph.erase_node(node)
        changed = True
    return _finished(gm, changed)


def unviewable_views_as_reshapes_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """A ``view`` of an expand that no view can give, as a ``reshape`` (which copies).

    The passes above move expands down past the ops that produced a fresh tensor (a
    linear of a learned query expanded to the batch, as in open_clip's attentional
    pooler and CoCa, runs before the expand), so a ``view`` that merged the batch with
    part of another dim of the linear's output now meets broadcast strides::

        expand_1 = torch.ops.aten.expand.default(linear, [-1, 3, 8])
        view = torch.ops.aten.view.default(expand_1, [4, 6, 4])      # before
        view = torch.ops.aten.reshape.default(expand_1, [4, 6, 4])   # after

    The values are the same; nothing writes through such a view (writes became
    out-of-place ops before the expands moved)."""
    changed = False
    for node in gm.graph.nodes:
        if not (node.op == "call_function" and node.target is torch.ops.aten.view.default
                and isinstance(node.args[0], fx.Node) and node.args[0].target in _EXPANDS):
            continue
        expand = node.args[0]
        try:
            expand.args[0].meta["val"].expand(expand.meta["val"].shape).view(node.meta["val"].shape)
        except (RuntimeError, ValueError):  # fake tensors raise the latter
            node.target = torch.ops.aten.reshape.default
            changed = True
    return _finished(gm, changed)


def out_arguments_as_copies_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """``torch.add(a, b, out=o)`` becomes the op's functional form and a copy into ``o``::

        add = aten.add.Tensor(a, b);  copy_ = aten.copy_.default(o, add)

    The ``out`` argument is written in place like ``copy_``'s first, which is what the
    in-place handling follows (a view of ``o`` taken before and read after, a write
    into a buffer); and the functional forms have batch propagations (``cat.out``,
    ``mm.out`` and ``sum.IntList_out`` had none). Ops with several ``out`` arguments
    stay."""
    for node in list(gm.graph.nodes):
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
            continue
        outs = [a for a in op._schema.arguments if a.is_out]
        functional = _functional_form(op) if len(outs) == 1 and outs[0].name in node.kwargs else None
        if functional is None:
            continue
        kwargs = {k: v for k, v in node.kwargs.items() if k != outs[0].name}
        with gm.graph.inserting_before(node):
            value = _call(gm, functional, node.args, node, kwargs)
            copy = gm.graph.call_function(torch.ops.aten.copy_.default, (node.kwargs[outs[0].name], value))
        copy.meta = dict(node.meta)  # the value of ``out`` after the write (no fake write runs)
        _replace(gm, node, copy)
    gm.graph.lint()
    gm.recompile()
    return gm


def _functional_form(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The overload of ``op``'s packet that takes its arguments but the ``out`` one and
    writes nothing (``aten.add.out`` -> ``aten.add.Tensor``)."""
    wanted = [(a.name, str(a.type)) for a in op._schema.arguments if not a.is_out]
    packet = getattr(getattr(torch.ops, op.namespace), op._schema.name.split("::")[-1])
    for name in packet.overloads():
        candidate = getattr(packet, name)
        arguments = candidate._schema.arguments
        if candidate is not op and [(a.name, str(a.type)) for a in arguments] == wanted \
                and not any(a.alias_info is not None and a.alias_info.is_write for a in arguments):
            return candidate
    return None


def masked_fill_by_index_put_as_where_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """``h[mask] = v`` with a boolean ``mask`` the shape of ``h`` and one value ``v``, out of
    place, is ``torch.where(mask, v, h)``::

        index_put = aten.index_put.default(h, [gt], s)  ->  where = aten.where.self(gt, s, h)

    The same values, without a selection whose size depends on the data: with ``v``
    a parameter (``h[h > 0.5] = self.s``) its per-sample VJP ran ``vmap`` over the
    boolean indexing, which ``vmap`` cannot batch. A read-modify-write through the mask
    (``h[x > 0] *= 2``, ``h[h > 0] += self.s``: ``v = f(h[mask], c)``) is
    ``torch.where(mask, f(h, c), h)``: the read flattened the samples' selections into
    one list, and was refused. A mask of the leading dims with one value for every
    element it selects (BERT/MAE's ``x[mask] = self.mask_token``, ``mask [B, T]``) is
    ``torch.where(mask[..., None], token, x)``."""
    for node in list(gm.graph.nodes):
        if node.target is not torch.ops.aten.index_put.default or named_arg(node, "accumulate", False):
            continue
        data, indices, values = node.args[:3]
        masks = [i for i in indices if i is not None]
        if len(indices) != 1 or len(masks) != 1:
            continue
        mask, h, v = masks[0].meta.get("val"), data.meta.get("val"), values.meta.get("val")
        if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and isinstance(v, torch.Tensor)):
            continue
        trailing = h.dim() - mask.dim()
        if trailing < 0 or tuple(mask.shape) != tuple(h.shape[:mask.dim()]):
            continue
        # A mask of the leading dims and a value for every element it selects (BERT/MAE's
        # ``x[mask] = self.mask_token``, ``mask [B, T]``): the mask broadcast over the
        # trailing dims, which the value fills alike.
        if not (v.dim() <= trailing and _broadcasts_to(v.shape, h.shape[mask.dim():])):
            values = _of_the_whole(gm, values, data, masks[0], h.shape[mask.dim():])
            if values is None:
                continue
            v = values.meta["val"]
        with gm.graph.inserting_before(node):
            wide = masks[0]
            for _ in range(trailing):
                wide = _call(gm, torch.ops.aten.unsqueeze.default, (wide, -1), node)
            if v.dtype != h.dtype:
                values = _call(gm, torch.ops.aten._to_copy.default, (values,), node, {"dtype": h.dtype})
            _replace(gm, node, _call(gm, torch.ops.aten.where.self, (wide, values, data), node))
    gm.graph.lint()
    gm.recompile()
    return gm


_SIZE_QUERIES = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int}
# (not ``_unsafe_index_put``, which takes no boolean mask)
_BY_INDICES = {torch.ops.aten.index.Tensor: 1, torch.ops.aten.index_put.default: 1,
               torch.ops.aten.index_put_.default: 1}


def nonzero_positions_as_mask_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Indexing by every coordinate of a mask's ``nonzero``, in order (``bi, ti =
    torch.where(mask)``, ``mask.nonzero(as_tuple=True)``; then ``x[bi, ti]``,
    ``out[bi, ti] = v``), is indexing by the mask itself: the same elements in the same
    (row-major) order, which the batch analysis follows as each sample's own
    (``Masked``), where the coordinates are rows of the whole batch::

        nonzero = aten.nonzero.default(gt);  unbind = aten.unbind.int(nonzero, 1)      # before
        index = aten.index.Tensor(x, [unbind[0], unbind[1]])
        index = aten.index.Tensor(x, [gt])                                             # after
    """
    changed = False
    for node in list(gm.graph.nodes):
        at = _BY_INDICES.get(node.target) if node.op == "call_function" else None
        if at is None or len(node.args) <= at or not isinstance(node.args[at], (list, tuple)):
            continue
        mask = _mask_of_coordinates(node.args[at])
        data = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if mask is not None and isinstance(data, torch.Tensor) and data.dim() >= mask.meta["val"].dim() and all(
                statically_known_true(a == b) for a, b in zip(mask.meta["val"].shape, data.shape)):
            node.args = (*node.args[:at], [mask], *node.args[at + 1:])
            changed = True
    return _finished(gm, changed)


def _mask_of_coordinates(indices: Sequence[Any]) -> fx.Node | None:
    """The boolean mask whose ``nonzero`` coordinates ``indices`` are, each of its dims
    in order (``unbind(nonzero(mask), 1)[k]`` for ``k = 0, 1, ...``), or ``None``."""
    if len(indices) < 2:
        return None  # (the rows one coordinate finds are followed as such: "Experts run in a loop")
    nonzero = None
    for k, index in enumerate(indices):
        if not (isinstance(index, fx.Node) and index.target is operator.getitem and index.args[1] == k):
            return None
        unbind = index.args[0]
        if not (isinstance(unbind, fx.Node) and unbind.target is torch.ops.aten.unbind.int
                and named_arg(unbind, "dim", 0) in (1, -1)):
            return None
        if nonzero is None:
            nonzero = unbind.args[0]
        elif unbind.args[0] is not nonzero:
            return None
    if not (isinstance(nonzero, fx.Node) and nonzero.target is torch.ops.aten.nonzero.default) or any(
            use is not indices[0].args[0] and use.target not in _SIZE_QUERIES for use in nonzero.users):
        return None  # (the coordinates read otherwise too: ``nz[:, 0]`` beside ``x[nz[:, 0], nz[:, 1]]``)
    # Every use of the coordinates must index so: rows a ``nonzero`` found read by one
    # coordinate (``h[token]`` beside ``weights[token, slot]``, a mixture of experts'
    # dispatch) are followed as such, and must meet the others in that form.
    coordinates = list(indices)
    for piece in indices[0].args[0].users:
        if piece.target is not operator.getitem or any(
                _BY_INDICES.get(use.target) is None or list(use.args[_BY_INDICES[use.target]]) != coordinates
                for use in piece.users):
            return None
    mask = nonzero.args[0]
    value = mask.meta.get("val") if isinstance(mask, fx.Node) else None
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.dim() == len(indices)):
        return None
    return mask


def _of_the_whole(gm: fx.GraphModule, values: fx.Node, data: fx.Node, mask: fx.Node,
                  trailing: Sequence[Any]) -> fx.Node | None:
    """For ``values = f(data[mask], c)`` with ``f`` elementwise and ``c`` the same for
    every element the mask selects (``h[mask] *= 2``, ``h[mask] += self.s``; with a mask
    of the leading dims, ``c`` broadcast along the ``trailing`` dims: segment-anything's
    ``point_embedding[labels == -1] += self.not_a_point_embed.weight``): ``f(data, c)``,
    whose elements at ``mask`` are those values, or ``None``. The read ``data[mask]``
    flattens the samples' selections into one list; the whole tensor keeps them apart."""
    target = values.target
    if values.op != "call_function" or torch.Tag.pointwise not in getattr(target, "tags", ()):
        return None
    reads = [a for a in values.args if isinstance(a, fx.Node) and a.target is torch.ops.aten.index.Tensor
             and a.args[0] is data and list(a.args[1]) == [mask]]
    others = [a.meta.get("val") for a in values.all_input_nodes if a not in reads]
    if len(reads) != 1 or values.kwargs or not all(
            isinstance(c, torch.Tensor) and _broadcasts_to(_without_a_leading_one(c.shape, len(trailing)), trailing)
            for c in others):
        return None
    args = tuple(data if a is reads[0] else a for a in values.args)
    with gm.graph.inserting_before(values):
        whole = _call(gm, target, args, values)
    if whole.meta["val"].shape != data.meta["val"].shape:
        gm.graph.erase_node(whole)
        return None
    return whole


def _broadcasts_to(shape: Sequence[Any], target: Sequence[Any]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``target`` (no more dims, each 1 or equal)."""
    return len(shape) <= len(target) and all(
        statically_known_true(a == 1) or statically_known_true(a == b)
        for a, b in zip(reversed(shape), reversed(target)))


def _without_a_leading_one(shape: Sequence[Any], rank: int) -> Sequence[Any]:
    """``shape`` without its dim before the last ``rank`` ones where that dim is 1: the
    dim of a selected list's elements, which a value the same for all of them has as 1."""
    return shape[1:] if len(shape) == rank + 1 and statically_known_true(shape[0] == 1) else shape


# Ops that return views of their input's pieces, each taken by an ``operator.getitem``.
_PIECES = {torch.ops.aten.split.Tensor, torch.ops.aten.split.sizes, torch.ops.aten.split_with_sizes.default,
           torch.ops.aten.chunk.default, torch.ops.aten.tensor_split.sections, torch.ops.aten.tensor_split.indices,
           torch.ops.aten.unbind.int, torch.ops.aten.unsafe_split.Tensor,
           torch.ops.aten.unsafe_split_with_sizes.default, torch.ops.aten.unsafe_chunk.default}


def written_pieces_as_views_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """A piece of ``split``/``chunk``/``unbind`` written in place, through views or not,
    becomes the ``slice`` (``select`` for ``unbind``) of its base that it is::

        getitem_1 = split[1];  mul_ = aten.mul_.Tensor(getitem_1, 0.5)
        ->  slice_1 = aten.slice.Tensor(h, 1, 2, 4);  mul_ = aten.mul_.Tensor(slice_1, 0.5)

    A piece comes out of a multi-output op through ``getitem``, which the in-place
    handling does not follow to the base: the write was taken for a write into a
    fresh value and dropped, with the base, the forward output and the gradients
    wrong. A slice is an ordinary view of the base. Pieces nothing writes stay, and so
    do written pieces of a tensor nothing else reads (a decomposed LSTM cell's
    ``gates.chunk(4, 1)`` with each gate's ``sigmoid_``: made out of place, as before,
    rather than writes into a tensor its backward needs)."""
    for node in reversed(list(gm.graph.nodes)):
        pieces = node.args[0] if node.target is operator.getitem else None
        if not (isinstance(pieces, fx.Node) and pieces.target in _PIECES and _piece_written(node)
                and _read_beside_its_pieces(pieces.args[0])):
            continue
        base, index = pieces.args[0], node.args[1]
        if pieces.target is torch.ops.aten.unbind.int:
            dim = named_arg(pieces, "dim", 0)
            view = (torch.ops.aten.select.int, (base, dim, index))
        else:
            dim = named_arg(pieces, "dim", 0) % base.meta["val"].dim()
            sizes = [piece.shape[dim] for piece in pieces.meta["val"][: index + 1]]
            if not all(isinstance(size, int) for size in sizes):
                raise UnsupportedError(
                    f"an in-place write into a piece of {pieces.target} whose sizes are symbolic: "
                    "write into a slice of the tensor instead (x[:, a:b])")
            view = (torch.ops.aten.slice.Tensor, (base, dim, sum(sizes[:-1]), sum(sizes)))
        with gm.graph.inserting_before(node):
            _replace(gm, node, _call(gm, *view, node))
    gm.graph.lint()
    gm.recompile()
    return gm


def _read_beside_its_pieces(base: fx.Node) -> bool:
    """Whether the memory of ``base`` (a piece op's input) is seen other than through the
    pieces' own writes: it is an input's or a buffer's (the write lands there), or an op
    other than a view, a piece or an in-place write reads it or a view of it."""
    root = _memory_of(base)
    return root.op == "placeholder" or any(not _writes_into(user, value) for value, user in _alias_uses(root))


def _piece_written(node: fx.Node) -> bool:
    """Whether an op writes in place into ``node`` or into a view of it (a piece included)."""
    return any(_writes_into(user, value) for value, user in _alias_uses(node))


def _alias_uses(node: fx.Node):
    """``(value, user)`` for every use of ``node`` and of its views and pieces, recursively,
    other than taking a view or a piece; an in-place write's result is its first
    argument's memory, so its uses are followed too (``v.add_(g)`` then ``add_.sin()``)."""
    stack, seen = [node], set()
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        for user in value.users:
            if user.op == "call_function" and _aliases(user) and user.args[0] is value:
                stack.append(user)
            else:
                yield value, user
                if _writes_into(user, value):
                    stack.append(user)


def _writes_into(user: fx.Node, value: fx.Node) -> bool:
    return user.op == "call_function" and writes_in_place(user.target) and bool(user.args) and user.args[0] is value


def _aliases(node: fx.Node) -> bool:
    """``node`` is a view of its first argument, the pieces of it, or one piece."""
    return is_view(node) or node.target in _PIECES or (
        node.target is operator.getitem and getattr(node.args[0], "target", None) in _PIECES)


_BERNOULLI = {torch.ops.aten.bernoulli.default, torch.ops.aten.bernoulli.p, torch.ops.aten.bernoulli.Tensor,
              torch.ops.aten.bernoulli_.Tensor, torch.ops.aten.bernoulli_.float}


def bernoulli_probability_detached_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """A Bernoulli draw's tensor arguments (its probability, the tensor it takes its shape
    from) as ``detach``-ed values: its derivative is zero everywhere, so no gradient flows
    through it and a parameter used only as a draw's probability is not consumed by the
    ops that use the draw (a learned keep-probability as a dropout mask)::

        bernoulli = torch.ops.aten.bernoulli.default(expand)                  # before
        bernoulli = torch.ops.aten.bernoulli.default(torch.ops.aten.detach.default(expand))

    An in-place draw keeps the tensor it writes.
    """
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _BERNOULLI:
            continue
        first = 1 if writes_in_place(node.target) else 0
        for i, a in enumerate(node.args[first:], first):
            if isinstance(a, fx.Node) and not (a.op == "call_function" and a.target is torch.ops.aten.detach.default):
                with gm.graph.inserting_before(node):
                    detached = gm.graph.call_function(torch.ops.aten.detach.default, (a,))
                detached.meta = dict(a.meta)
                node.update_arg(i, detached)
                changed = True
    if changed:
        gm.recompile()
    return gm


def _alias_of(value: Any, tensor: fx.Node) -> bool:
    """Whether ``value`` is ``tensor`` itself or a ``detach``/``alias`` of it (the same
    storage, sizes and strides)."""
    while isinstance(value, fx.Node) and value is not tensor and value.op == "call_function" \
            and value.target in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
        value = value.args[0]
    return value is tensor


def no_op_conversion_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop a ``.to(...)`` that changes nothing (it returns its input itself).

    Hugging Face's GPT-2 writes ``wpe(position_ids).to(inputs_embeds.device)``; with the
    ``to`` in between, the lookup's table would be a transformed parameter (a per-sample
    VJP) instead of meeting the embedding rule and its ghost norm::

        to = torch.ops.aten.to.dtype_layout(embedding, dtype=torch.float32, device=cpu)  # before
        add = torch.ops.aten.add.Tensor(h, to)
        add = torch.ops.aten.add.Tensor(h, embedding)                                     # after

    A module moved where it already is in the forward (``self.experts.to(x.device)``,
    st-moe's and soft-moe's ``Experts``) sets each parameter's data to itself,
    ``aten.set_(p, p)``, and ``p.data = p.data`` (pytorch-metric-learning's cast of a
    loss's class matrix to the dtype and device it has) sets it to its own detached
    alias, ``aten.set_(p, detach(p))``: dropped too, or they would read as writes into the
    parameter.
    """
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.set_.source_Tensor \
                and len(node.args) == 2 and _alias_of(node.args[1], node.args[0]):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            changed = True
            continue
        # ``_to_copy`` always copies (an in-place op may write the copy); ``to`` aliases.
        if node.op != "call_function" or node.target not in _TO or not node.args:
            continue
        source, out = node.args[0], node.meta.get("val")
        if not isinstance(source, fx.Node) or not isinstance(out, torch.Tensor):
            continue
        before = source.meta.get("val")
        if not isinstance(before, torch.Tensor) or named_arg(node, "copy", False) \
                or named_arg(node, "memory_format", None) not in (None, torch.preserve_format):
            continue
        if (out.dtype, out.device, out.layout) == (before.dtype, before.device, before.layout):
            node.replace_all_uses_with(source)
            changed = True
    return _finished(gm, changed)


_MUL = (torch.ops.aten.mul.Scalar, torch.ops.aten.mul.Tensor)


def unit_scale_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop a multiplication by the scalar 1 that keeps dtype, shape and strides (a
    strided input's product is contiguous: a later ``view`` may need that).

    ``addmm``'s decomposition scales its bias by ``beta = 1``; a linear traced below
    autograd (the ATen code of a ``torch.func.vmap``) reaches the graph that way, and the
    bias would be a transformed parameter (a per-sample VJP) instead of meeting the
    broadcast add's rule::

        mul = torch.ops.aten.mul.Scalar(bias, 1)            # before
        add = torch.ops.aten.add.Tensor(mul, mm)
        add = torch.ops.aten.add.Tensor(bias, mm)           # after
    """
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _MUL or len(node.args) != 2 or node.kwargs:
            continue
        source, scale, out = node.args[0], node.args[1], node.meta.get("val")
        before = source.meta.get("val") if isinstance(source, fx.Node) else None
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale != 1 \
                or not isinstance(before, torch.Tensor) \
                or not isinstance(out, torch.Tensor):
            continue
        sizes = zip((*out.shape, *out.stride()), (*before.shape, *before.stride()))
        same_layout = out.dtype == before.dtype and out.dim() == before.dim() \
            and all(statically_known_true(a == b) for a, b in sizes)
        # (a copy of a view whose memory another view writes keeps the values before that write;
        # the memory of a write's result is the memory it wrote: ``v.add_(1) * 1``, then ``h.mul_(3)``)
        memory = _memory_of(source)
        while memory.op == "call_function" and writes_in_place(memory.target) and isinstance(memory.args[0], fx.Node):
            memory = _memory_of(memory.args[0])
        if same_layout and not written_through(node) and not written_through(source) \
                and not _written_somewhere(memory):
            node.replace_all_uses_with(source)
            changed = True
    return _finished(gm, changed)


def empty_scatter_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop a ``slice_scatter`` of no element (it is its input's copy).

    DAC's quantizer dropout at rate 0 writes the first ``int(B * 0.0)`` samples' drawn
    counts, ``n_quantizers[:0] = dropout[:0]``, into counts alike for every sample; the
    write of nothing left them looking written along the batch::

        slice_scatter = torch.ops.aten.slice_scatter.default(add, to, 0, 0, 0)   # before
        lt = torch.ops.aten.lt.Tensor(full, slice_scatter)
        lt = torch.ops.aten.lt.Tensor(full, add)                                  # after
    """
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.slice_scatter.default:
            continue
        base, src = node.args[0], node.args[1]
        written = src.meta.get("val") if isinstance(src, fx.Node) else None
        if isinstance(written, torch.Tensor) and statically_known_true(written.numel() == 0) \
                and not written_through(node) and not written_through(base):
            node.replace_all_uses_with(base)
            changed = True
    return _finished(gm, changed)


def whole_slice_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop a ``slice`` that keeps all of its dim (it is its input, aliased).

    Dynamo writes ``y[:, mask] = v`` on a batch of symbolic size as an ``index_put_``
    into ``y[0:]``; on its input itself, the write is an out-of-place ``index_put``
    (``in_place_as_out_of_place_pass``) as it is on a batch of static size::

        slice_1 = torch.ops.aten.slice.Tensor(mul, 0, 0, 9223372036854775807)   # before
        index_put_ = torch.ops.aten.index_put_.default(slice_1, [None, mask], v)
        index_put_ = torch.ops.aten.index_put_.default(mul, [None, mask], v)     # after
    """
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.slice.Tensor:
            continue
        source = node.args[0]
        before = source.meta.get("val") if isinstance(source, fx.Node) else None
        if not isinstance(before, torch.Tensor):
            continue
        dim = named_arg(node, "dim", 0)
        start, end, step = (named_arg(node, name, default) for name, default in
                            (("start", None), ("end", None), ("step", 1)))
        if start not in (None, 0) or step != 1 or isinstance(end, fx.Node):
            continue
        size = before.shape[dim]
        if end is None or end >= sys.maxsize or (isinstance(size, int) and end >= size):
            node.replace_all_uses_with(source)
            changed = True
    return _finished(gm, changed)


def filled_pieces_as_one_fill_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """A ``cat`` of tensors made from sizes, each filled with one constant, as that
    tensor made from the sizes of the whole.

    fastai's AWD-LSTM grows its zero state to the batch (``cat([h, h.new_zeros(1, B - 1,
    H)], 1)`` after ``h = zeros(1, 1, H)``): pieces side by side are read as values
    placed by position, while one tensor of zeros sized by the batch is no sample's::

        cat = aten.cat.default([zeros, new_zeros], 1)                  # before
        full = aten.full.default([1, add, 5], 0.0, dtype=…, …)          # after (add = 1 + (B - 1))
    """
    written = {n for node in gm.graph.nodes for n in written_chain(node) or ()}
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.cat.default or len(node.args[0]) < 2:
            continue
        pieces = [_filled(t) if t not in written else None for t in node.args[0]]
        value = node.meta.get("val")
        if value is None or None in pieces or len({fill for _, fill in pieces}) > 1 or any(
                len(sizes) != value.dim() or t.meta["val"].dtype != value.dtype
                for t, (sizes, _) in zip(node.args[0], pieces)):
            continue
        dim = (node.args[1] if len(node.args) > 1 else named_arg(node, "dim", 0)) % value.dim()
        sizes = list(pieces[0][0])
        with gm.graph.inserting_before(node):
            for other, _ in pieces[1:]:
                total = gm.graph.call_function(operator.add, (sizes[dim], other[dim]))
                total.meta["val"] = _size_of(sizes[dim]) + _size_of(other[dim])
                sizes[dim] = total
            full = gm.graph.call_function(torch.ops.aten.full.default, (sizes, pieces[0][1]), {
                "dtype": value.dtype, "layout": torch.strided, "device": value.device, "pin_memory": False})
        full.meta = {**node.meta, "val": value}
        node.replace_all_uses_with(full)
        gm.graph.erase_node(node)
        changed = True
    return _finished(gm, changed)


def unique_rows_gathered_back_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Rows computed once for each distinct index, gathered back by the inverse, as the
    rows computed for the indices themselves: ``f(u)[inv]`` is ``f(idx)`` where ``u, inv
    = idx.unique(return_inverse=True)`` (``u[inv]`` is ``idx``) and ``f`` computes each
    row from its own index alone.

    pykeen's representations look each distinct entity up once: the distinct values
    mix the samples' indices, a lookup of each sample's own does not::

        _unique2 = aten._unique2.default(idx, True, True)            (unused: dropped)
        u, inv = getitem(_unique2, 0), getitem(_unique2, 1)
        emb = aten.embedding.default(w, u)                  emb_1 = aten.embedding.default(w, idx)
        row = aten.tanh.default(emb)                   ->   row_1 = aten.tanh.default(emb_1)
        out = aten.index.Tensor(row, [inv])                 (out's uses read row_1)

    ``f`` is a lookup of ``u`` (``embedding``, ``table[u]``, ``index_select`` along 0)
    followed by elementwise ops with operands of fewer dims, ``linear``s, and (for 1-D
    indices) reductions and softmaxes along dims other than 0; the op that applies
    ``inv`` is ``index`` by ``[inv]`` alone.
    """
    changed = False
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target is torch.ops.aten.index.Tensor
                and len(node.args[1]) == 1 and isinstance(node.args[1][0], fx.Node)):
            continue
        unique = _unique_of(node.args[1][0])
        chain = None if unique is None else _rows_of_unique(node.args[0], unique)
        if chain is None:
            continue
        env = {}
        with gm.graph.inserting_before(node):
            for step in chain:
                if step.target is operator.getitem:  # the distinct values: the indices themselves
                    env[step] = unique.args[0]
                    continue
                args, kwargs = fx.node.map_arg((step.args, step.kwargs), lambda a, env=env: env.get(a, a))
                if step.target in _SIZED_ROWS:
                    args = (args[0], [-1, *step.args[1][1:]])  # one row for each index, not each distinct one
                env[step] = _call(gm, step.target, args, step, kwargs)
        node.replace_all_uses_with(env[chain[-1]])
        gm.graph.erase_node(node)
        changed = True
    return _finished(gm, changed)


def _unique_of(inverse: fx.Node) -> fx.Node | None:
    """The ``unique`` whose inverse indices ``inverse`` is (``u[inv]`` is its input)."""
    aten = torch.ops.aten
    unique = inverse.args[0] if inverse.target is operator.getitem and inverse.args[1] == 1 else None
    if not isinstance(unique, fx.Node) or unique.op != "call_function":
        return None
    if unique.target is aten._unique2.default and named_arg(unique, "return_inverse", False):
        return unique
    if unique.target is aten.unique_consecutive.default and named_arg(unique, "return_inverse", False) \
            and named_arg(unique, "dim", None) is None:
        return unique
    return None


# Views given every size, dim 0's among them, and ops so given sizes (all rebuilt with
# ``-1`` there: an expand's keeps the size); views of the dims after dim 0 alone.
_VIEWS_OF_ROWS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default}
_SIZED_ROWS = {*_VIEWS_OF_ROWS, torch.ops.aten.expand.default}
_VIEWS_IN_ROWS = {torch.ops.aten.flatten.using_ints, torch.ops.aten.unflatten.int}


def _keeps_the_rows(view: fx.Node, after: set) -> bool:
    """Whether ``view`` (a view, reshape, ``flatten``, ``unflatten`` or ``expand``) keeps
    its input's rows as they are (dim 0 unchanged) with other sizes that are no values
    computed from ``unique`` (those in ``after``) and not 0."""
    before, value = view.args[0].meta["val"], view.meta["val"]
    if before.dim() < 1 or value.dim() < 1 or not statically_known_true(value.shape[0] == before.shape[0]):
        return False
    if view.target is torch.ops.aten.flatten.using_ints:
        return named_arg(view, "start_dim", 0) % before.dim() >= 1
    sizes = view.args[2] if view.target is torch.ops.aten.unflatten.int else view.args[1][1:]
    if view.target is torch.ops.aten.unflatten.int and view.args[1] % before.dim() < 1:
        return False
    # (a view's one -1 beside the rows' -1: no; an expand's -1 keeps its size)
    inferred = view.target in (torch.ops.aten.unflatten.int, torch.ops.aten.expand.default)
    return not any((isinstance(n, fx.Node) and n in after) or (isinstance(n, int) and n <= 0 and not (
        inferred and n == -1)) for n in sizes)


# Ops along the dims their ``dim`` names, which must not be 0 (the distinct values' dim).
_ALONG_OTHER_DIMS = {torch.ops.aten.sum.dim_IntList, torch.ops.aten.mean.dim, torch.ops.aten.amax.default,
                     torch.ops.aten.amin.default, torch.ops.aten._softmax.default, torch.ops.aten._log_softmax.default,
                     torch.ops.aten.softmax.int, torch.ops.aten.log_softmax.int,
                     torch.ops.aten.linalg_vector_norm.default}


def _rows_of_unique(rows: fx.Node, unique: fx.Node) -> list | None:
    """The nodes, in graph order, by which ``rows`` computes each of its rows from its
    own distinct value of ``unique`` alone (see ``unique_rows_gathered_back_pass``), or
    ``None`` where it does not."""
    aten = torch.ops.aten
    after = reached([unique], lambda n: n.users)
    one_dim = unique.args[0].meta["val"].dim() == 1
    chain, pending = set(), [rows]

    def distinct(a: Any) -> bool:
        return isinstance(a, fx.Node) and a.target is operator.getitem and a.args[0] is unique and a.args[1] == 0

    while pending:
        node = pending.pop()
        if node in chain:
            continue
        if not isinstance(node, fx.Node) or node.op != "call_function" or not isinstance(
                node.meta.get("val"), torch.Tensor):
            return None
        chain.add(node)
        if distinct(node):  # the distinct values as values (``emb((u + 1) % n)``): the indices'
            continue
        target, args = node.target, node.args
        others = [a for a in node.all_input_nodes if a in after]
        if target is aten.index_select.default and one_dim and args[1] == 0:
            if not distinct(args[2]) or args[0] in after:
                return None
            chain.add(args[2])
        elif target in (aten.embedding.default, aten.index.Tensor):
            # a lookup by the distinct values, or by rows computed from them (pykeen's
            # NodePiece: each entity's tokens, tokens[u], then their embeddings)
            index = args[1] if target is aten.embedding.default else (args[1][0] if len(args[1]) == 1 else None)
            if not isinstance(index, fx.Node) or args[0] in after:
                return None
            if distinct(index):
                chain.add(index)
            else:
                pending.append(index)
        elif target is aten.linear.default:
            if others != [args[0]]:
                return None
            pending.append(args[0])
        elif target in _VIEWS_OF_ROWS | _VIEWS_IN_ROWS:
            # a view that keeps the rows (pykeen's ``x.view(*u.shape, *shape)``): rebuilt
            # with ``-1`` rows, its other sizes owing nothing to the distinct values
            if not (one_dim and isinstance(args[0], fx.Node) and _keeps_the_rows(node, after)):
                return None
            pending.append(args[0])
        elif torch.Tag.pointwise in getattr(target, "tags", ()) and pure_op(target):
            # the operands computed from the distinct values hold their rows (a row and its
            # own norm: ``F.normalize``); the others broadcast over the rows (fewer dims, or one row)
            value = node.meta["val"]
            rank = value.dim()
            if not others or any(not isinstance(a.meta.get("val"), torch.Tensor) for a in others) or any(
                    a.meta["val"].dim() != rank or not statically_known_true(
                    a.meta["val"].shape[0] == value.shape[0]) for a in others) or any(
                    a not in others and a.meta["val"].dim() >= rank
                    and not statically_known_true(a.meta["val"].shape[0] == 1) for a in node.all_input_nodes):
                return None
            pending.extend(others)
        elif target is aten.expand.default and one_dim and [a for a in others if isinstance(
                a.meta.get("val"), torch.Tensor)] == [args[0]] and _keeps_the_rows(node, after) \
                and args[0].meta["val"].dim() == node.meta["val"].dim():
            # a row's own value broadcast along it (``F.normalize``'s norm expanded to the row)
            pending.append(args[0])
        elif target in _ALONG_OTHER_DIMS and one_dim and len(others) == 1 and args[0] is others[0]:
            dims = named_arg(node, "dim", None)
            dims = [dims] if isinstance(dims, int) else dims
            rank = args[0].meta["val"].dim()
            if not dims or any(d % rank == 0 for d in dims):
                return None
            pending.append(args[0])
        else:
            return None
    return [n for n in rows.graph.nodes if n in chain]


def _filled(node: Any) -> tuple[list, int | float] | None:
    """``(sizes, fill)`` of a tensor made from a list of sizes and one constant."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    target, args = node.target, node.args
    aten = torch.ops.aten
    if target in (aten.zeros.default, aten.ones.default):
        sizes, fill = args[0], int(target is aten.ones.default)
    elif target in (aten.new_zeros.default, aten.new_ones.default):
        sizes, fill = args[1], int(target is aten.new_ones.default)
    elif target is aten.full.default:
        sizes, fill = args[0], args[1]
    elif target is aten.new_full.default:
        sizes, fill = args[1], args[2]
    else:
        return None
    if not isinstance(sizes, (list, tuple)) or not isinstance(fill, (int, float)) or isinstance(fill, bool):
        return None
    return list(sizes), fill  # (as given: an int64 fill past 2**53 is no float)


def _size_of(size: Any) -> Any:
    return size.meta["val"] if isinstance(size, fx.Node) else size


def legacy_empty_cat_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop the operands ``cat`` skips: 1-D tensors of size 0 beside tensors of more dims;
    a ``cat`` of one tensor is its copy.

    Hugging Face's cache starts prefix-tuning's keys as ``torch.tensor([])`` and
    concatenates the learned prefix to it; the rules would meet an operand that has
    none of the dims they split along::

        cat = torch.ops.aten.cat.default([empty, prefix_keys], -2)   # before
        cat = torch.ops.aten.clone.default(prefix_keys)              # after (one operand left)
    """
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.cat.default:
            continue
        operands = list(node.args[0])
        shapes = [tuple(t.meta["val"].shape) if isinstance(t, fx.Node) and "val" in t.meta else None
                  for t in operands]
        # (A size the data sets, ``w[w > 0.5]``, is no legacy empty tensor.)
        legacy = [shape is not None and len(shape) == 1 and statically_known_true(shape[0] == 0) for shape in shapes]
        if all(legacy) or (not any(legacy) and len(operands) > 1):
            continue
        kept = [t for t, skip in zip(operands, legacy) if not skip]
        if len(kept) == 1:  # a copy of the one operand left
            node.target, node.args, node.kwargs = torch.ops.aten.clone.default, (kept[0],), {}
        else:
            node.args = (kept, *node.args[1:])
        changed = True
    if changed:
        gm.recompile()
    return gm


def repeat_as_expand_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """A ``repeat`` that only copies size-1 dims is an ``expand`` (then a view), and so
    are ``expand_as``, a ``repeat_interleave`` of a size-1 dim and a ``cat`` of copies of
    a tensor of size 1 along the dim joined.

    ``nn.MultiheadAttention(add_bias_kv=True)`` writes ``bias_k.repeat(1, bsz, 1)``;
    as an expand it is a parameter expanded to the batch, which the batch analysis
    hands row by row to the samples::

        repeat = torch.ops.aten.repeat.default(bias_k, [1, 5, 1])   # before
        expand = torch.ops.aten.expand.default(bias_k, [1, 5, 4])   # after
    """
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.cat.default and len(node.args[0]) > 1 \
                and all(t is node.args[0][0] for t in node.args[0]):
            # ``torch.cat(B * [p])`` (TVP's frame prompter): copies of one tensor of one row
            # along the dim joined, a repeat of it, hence an expand below (tiles of more rows
            # stay a cat: the batch analysis reads its pieces)
            src, dim = node.args[0][0], named_arg(node, "dim", 0)
            reps = [1] * src.meta["val"].dim()
            if reps and isinstance(src.meta["val"].shape[dim], int) and src.meta["val"].shape[dim] == 1:
                reps[dim % len(reps)] = len(node.args[0])
                node.target, node.args, node.kwargs = aten.repeat.default, (src, reps), {}
        if node.op == "call_function" and node.target is aten.expand_as.default:
            # ``p.expand_as(h)``: an expand to ``h``'s sizes (read from ``h`` where symbolic).
            with gm.graph.inserting_before(node):
                sizes = _expand_sizes(gm, node)
            node.target, node.args = aten.expand.default, (node.args[0], sizes)
            continue
        if node.op == "call_function" and node.target is aten.repeat_interleave.self_int:
            # ``p[None].repeat_interleave(B, 0)`` (Perceiver's latents): copies of a size-1
            # dim, an expand.
            src, repeats, dim = node.args[0], node.args[1], named_arg(node, "dim", None)
            shape = src.meta["val"].shape
            if dim is not None and isinstance(shape[dim], int) and shape[dim] == 1:
                sizes = [-1] * len(shape)
                sizes[dim % len(shape)] = repeats
                _copy_as_expand(gm, node, (src, sizes))
            continue
        if node.op != "call_function" or node.target is not aten.repeat.default:
            continue
        src, reps = node.args[0], list(node.args[1])
        shape = list(src.meta["val"].shape)
        # More counts than dims: repeat reads the tensor with leading size-1 dims added.
        lead = len(reps) - len(shape)
        shape = [1] * lead + shape
        split = _tiles_viewed_as_copies(node, shape, reps) if lead == 0 else None
        if split is not None:
            # ``q.repeat(B, 1).view(B, n, d)`` of a table ``q`` of ``n`` rows: whole
            # copies of it along a new dim, ``q.unsqueeze(0).expand(B, n, d)`` (its other
            # dims repeated first: ``q.repeat(B, 2).view(B, n, 2 * d)``).
            views, between, dim = split
            tiled = [d != dim and not (bool(r == 1) or bool(s == 1)) for d, (s, r) in enumerate(zip(shape, reps))]
            inner = src
            if any(tiled):
                with gm.graph.inserting_before(node):
                    inner = _call(gm, aten.repeat.default, (src, [r if t else 1 for t, r in zip(tiled, reps)]), node)
            for view in views:
                with gm.graph.inserting_before(view):
                    unsqueezed = _call(gm, aten.unsqueeze.default, (inner, dim), view)
                _copy_as_expand(gm, view, (unsqueezed, _sizes_of_copies(shape, reps, dim)))
            for view in reversed(between):
                gm.graph.erase_node(view)
            gm.graph.erase_node(node)
            continue
        if lead >= 0 and all(bool(r == 1) or bool(s == 1) for r, s in zip(reps, shape)):
            # -1 keeps a dim that is not repeated (its size may be symbolic), a size-1
            # dim takes the repeat count (a graph node for a symbolic batch size), and
            # so does a dim expand adds in front.
            _copy_as_expand(gm, node, (src, [r if i < lead or (isinstance(s, int) and s == 1) else -1
                                             for i, (s, r) in enumerate(zip(shape, reps))]))
    gm.graph.lint()
    gm.recompile()
    return gm


def _tiles_viewed_as_copies(node: fx.Node, shape: list, reps: list) -> tuple[list, list, int] | None:
    """``(views, between, dim)`` where every read of ``repeat`` ``node`` is a reshape
    (``views``, perhaps past reshapes to its own sizes, ``between``) that splits a dim
    ``dim`` the repeat tiles into the count and the source's size there: copies, along a
    new dim, of the source with its other dims repeated."""
    views, between, pending = [], [], list(node.users)
    while pending:
        view = pending.pop()
        if view.op != "call_function" or view.target not in _RESHAPES_OF_TILES or view.args[0] not in (
                node, *between):
            return None
        if _same_shape(view, node):
            between.append(view)
            pending.extend(view.users)
        else:
            views.append(view)
    out = list(node.meta["val"].shape)
    for dim in [d for d, (r, s) in enumerate(zip(reps, shape)) if not (bool(r == 1) or bool(s == 1))]:
        want = [*out[:dim], None, shape[dim], *out[dim + 1:]]
        if views and all(len(got) == len(want) and all(w is None or statically_known_true(g == w)
                                                        for g, w in zip(got, want))
                         and statically_known_true(got[dim] * shape[dim] == out[dim])
                         for got in (list(view.meta["val"].shape) for view in views)):
            return views, between, dim
    return None


def _sizes_of_copies(shape: list, reps: list, dim: int) -> list:
    """The sizes to expand ``source.unsqueeze(dim)`` to for ``reps[dim]`` copies along the
    new dim: -1 keeps a dim of the source (repeated already, or not at all), and a size-1
    dim takes its repeat count."""
    sizes = [reps[dim]]
    for d, (size, count) in enumerate(zip(shape, reps)):
        sizes.append(count if d != dim and isinstance(size, int) and size == 1 else -1)
    return [*sizes[1:dim + 1], sizes[0], *sizes[dim + 1:]]


_RESHAPES_OF_TILES = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
                      torch.ops.aten.unflatten.int}


def _same_shape(a: fx.Node, b: fx.Node) -> bool:
    x, y = a.meta["val"].shape, b.meta["val"].shape
    return len(x) == len(y) and all(statically_known_true(i == j) for i, j in zip(x, y))


def _copy_as_expand(gm: fx.GraphModule, node: fx.Node, args: tuple) -> None:
    """``node``, a copy of size-1 dims, as the ``expand`` with ``args``; followed by a
    ``clone`` where an op writes into the copy or a view of it (MAE's
    ``x_ = mask_token.repeat(B, N, 1); x_[rows, kept] = x``), as the write must not
    reach the expanded tensor (the parameter itself)."""
    node.target, node.args, node.kwargs = torch.ops.aten.expand.default, args, {}
    if not _piece_written(node):
        return
    with gm.graph.inserting_after(node):
        copy = gm.graph.call_function(torch.ops.aten.clone.default, (node,))
    copy.meta = {**node.meta, "val": node.meta["val"].clone()} if "val" in node.meta else dict(node.meta)
    node.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy)


_EXPANDS = {torch.ops.aten.expand.default, torch.ops.aten.expand_as.default, torch.ops.aten.broadcast_to.default}


def _expand_sizes(gm: fx.GraphModule, expand: fx.Node) -> list:
    """The sizes ``expand`` expands to, as an ``aten.expand`` argument."""
    if expand.target is not torch.ops.aten.expand_as.default:
        return list(expand.args[1])
    other = expand.args[1]
    sizes = []
    for dim, size in enumerate(other.meta["val"].shape):
        if isinstance(size, int):
            sizes.append(size)
        else:
            sizes.append(gm.graph.call_function(torch.ops.aten.sym_size.int, (other, dim)))
            sizes[-1].meta["val"] = size
    return sizes


def _replace(gm: fx.GraphModule, node: fx.Node, new: fx.Node) -> None:
    """``new`` takes every use of ``node``, which leaves the graph."""
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def _finished(gm: fx.GraphModule, changed: bool) -> fx.GraphModule:
    """``gm`` without the nodes a pass left unused, regenerated if it changed."""
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def _read_only(node: fx.Node) -> bool:
    """Whether nothing writes ``node`` (or a view of it) and the graph does not return it."""
    return not written_through(node) and not any(u.op == "output" for u in node.users)


def _leading(expand: fx.Node) -> int:
    """How many leading dims ``expand`` adds in front of its source's."""
    return expand.meta["val"].dim() - expand.args[0].meta["val"].dim()


def _expands_dim(expand: fx.Node, dim: int) -> bool:
    """Whether ``expand`` broadcasts its output dim ``dim`` (added, or from size 1)."""
    lead = _leading(expand)
    if dim < lead:
        return True
    size, source_size = expand.meta["val"].shape[dim], expand.args[0].meta["val"].shape[dim - lead]
    return isinstance(source_size, int) and source_size == 1 and not (isinstance(size, int) and size == 1)


def _call(gm: fx.GraphModule, target: Any, args: tuple, like: fx.Node, kwargs: dict | None = None) -> fx.Node:
    """A new node computing ``target(*args, **kwargs)``, its example value from the operands'."""
    kwargs = kwargs or {}
    new = gm.graph.call_function(target, args, kwargs)
    new.meta.update({k: v for k, v in like.meta.items() if k != "val"})
    values, keywords = fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
    new.meta["val"] = target(*values, **keywords)
    return new


def _sunk(gm: fx.GraphModule, view: fx.Node, expand: fx.Node, dim: int, op: Any, rest: tuple,
          sizes: list) -> fx.Node:
    """``view`` of ``expand`` (along a dim it does not broadcast) as ``expand`` of the
    same view of its source."""
    lead = _leading(expand)
    inner = _call(gm, op, (expand.args[0], dim - lead, *rest), view)
    return _call(gm, torch.ops.aten.expand.default, (inner, sizes), view)


def _rows_sliced(node: fx.Node, dim: int) -> Any:
    """How many rows a ``slice`` from the start keeps along ``dim``, as a number or the
    node of a symbolic size (its end, where it does not reach past the dim's end)."""
    rows = node.meta["val"].shape[dim]
    if isinstance(rows, int):
        return rows
    end = named_arg(node, "end", None)
    if isinstance(end, fx.Node) and isinstance(end.meta.get("val"), torch.SymInt) \
            and statically_known_true(end.meta["val"] == rows):
        return end
    return None


# Ops that cut their input into pieces along one dim: ``(input, sizes or count, dim)``.
_SPLITS = {
    torch.ops.aten.chunk.default, torch.ops.aten.unsafe_chunk.default, torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default, torch.ops.aten.unsafe_split.Tensor,
    torch.ops.aten.unsafe_split_with_sizes.default,
}


# Ops along one dim ``args[1]``, each row of it on its own.
_ALONG_ONE_DIM = {
    torch.ops.aten.softmax.int, torch.ops.aten._softmax.default, torch.ops.aten.log_softmax.int,
    torch.ops.aten._log_softmax.default, torch.ops.aten._safe_softmax.default, torch.ops.aten.cumsum.default,
    torch.ops.aten.cumprod.default, torch.ops.aten.logcumsumexp.default,
}

# Reductions over a dim list ``args[1]`` (``keepdim`` at ``args[2]``).
_REDUCTIONS = {torch.ops.aten.sum.dim_IntList, torch.ops.aten.mean.dim, torch.ops.aten.amax.default,
               torch.ops.aten.amin.default}


def sink_expands_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Move an ``expand`` below the views and copies that read it, so that it meets
    the op that consumes it: ``contiguous(expand(h0))`` (or ``clone``, ``alias``) is
    ``expand(h0)`` where nothing writes the copy; ``select``, ``unbind``, ``chunk``/``split``, ``slice``,
    ``unsqueeze``, ``squeeze``, ``permute``/``transpose`` (keeping added leading dims in front) and a
    reshape of the dims after the broadcast ones, of an expand, are the expand of that
    view of its source; so is a ``layer_norm`` over dims the expand does not broadcast
    (Perceiver's latents), a softmax or cumulative op along such a dim, and a reduction
    over such dims; ``zeros_like``/``ones_like``/``full_like``/``empty_like`` of an expand is
    the expand of that constant.

    A recurrent layer started from a learned state ``h0.expand(-1, B, -1).contiguous()``
    reads layer ``l``'s state as ``unbind(state)[l]``; once the expand reaches the
    linear and the gate arithmetic, ``expand_after_lookup_pass`` and
    ``broadcast_expanded_operands_pass`` remove it::

        expand = torch.ops.aten.expand.default(h0, [-1, 3, -1])                  # before
        contiguous = torch.ops.aten.contiguous.default(expand)
        unbind = torch.ops.aten.unbind.int(contiguous)
        getitem = unbind[0]
        select = torch.ops.aten.select.int(h0, 0, 0)                             # after
        expand_1 = torch.ops.aten.expand.default(select, [3, -1])
    """
    aten = torch.ops.aten
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.cat.default:
            new = _cat_of_expands(gm, node)
            if new is not None:
                _replace(gm, node, new)
                changed = True
            continue
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        expand = node.args[0]
        if not (expand.op == "call_function" and expand.target is aten.expand.default):
            continue
        ndim = expand.meta["val"].dim()
        sizes = list(expand.args[1])
        new = None
        with gm.graph.inserting_before(node):
            if (node.target in (aten.contiguous.default, aten.clone.default, aten.alias.default)
                    and node.kwargs.get("memory_format") in (None, torch.contiguous_format, torch.preserve_format)
                    and _read_only(node)):
                new = expand
            elif node.target is aten.select.int:
                dim = node.args[1] % ndim
                kept = sizes[:dim] + sizes[dim + 1:]
                if not _expands_dim(expand, dim):
                    new = _sunk(gm, node, expand, dim, aten.select.int, (node.args[2],), kept)
                elif dim >= _leading(expand):  # every index along it reads the source's one row
                    new = _sunk(gm, node, expand, dim, aten.select.int, (0,), kept)
                else:  # a dim the expand added: the source itself
                    new = _call(gm, aten.expand.default, (expand.args[0], kept), node)
            elif node.target is aten.unbind.int:
                dim = (node.args[1] if len(node.args) > 1 else 0) % ndim
                users = list(node.users)
                if not _expands_dim(expand, dim) and all(u.target is operator.getitem for u in users):
                    for user in users:
                        with gm.graph.inserting_before(user):
                            item = _sunk(gm, user, expand, dim, aten.select.int, (user.args[1],),
                                         sizes[:dim] + sizes[dim + 1:])
                        _replace(gm, user, item)
                    gm.graph.erase_node(node)
                    changed = True
                    continue
            elif node.target in _SPLITS:
                dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % ndim
                users = list(node.users)
                if not _expands_dim(expand, dim) and all(u.target is operator.getitem for u in users):
                    pieces = _call(gm, node.target, (expand.args[0], node.args[1], dim - _leading(expand)), node)
                    kept = sizes[:dim] + [-1] + sizes[dim + 1:]
                    for user in users:
                        with gm.graph.inserting_before(user):
                            piece = _call(gm, operator.getitem, (pieces, user.args[1]), user)
                            item = _call(gm, aten.expand.default, (piece, kept), user)
                        _replace(gm, user, item)
                    gm.graph.erase_node(node)
                    changed = True
                    continue
            elif node.target is aten.slice.Tensor:
                dim = (node.args[1] if len(node.args) > 1 else 0) % ndim
                if not _expands_dim(expand, dim):
                    sliced = sizes[:dim] + [-1] + sizes[dim + 1:]
                    new = _sunk(gm, node, expand, dim, aten.slice.Tensor, tuple(node.args[2:]), sliced)
                elif named_arg(node, "start", None) in (None, 0) and named_arg(node, "step", 1) == 1:
                    # Copies of one row: the first of them (``cls.expand(B*T, D)[:B]``).
                    rows = _rows_sliced(node, dim)
                    if rows is not None:
                        new = _call(gm, aten.expand.default, (expand.args[0], sizes[:dim] + [rows] + sizes[dim + 1:]),
                                    node)
            elif node.target in (aten.permute.default, aten.transpose.int):
                if node.target is aten.transpose.int:
                    order = list(range(ndim))
                    i, j = (d % ndim for d in node.args[1:3])
                    order[i], order[j] = order[j], order[i]
                else:
                    order = [d % ndim for d in node.args[1]]
                lead = _leading(expand)
                if all(order[i] == i for i in range(lead)):  # the added leading dims stay in front
                    inner = _call(gm, aten.permute.default, (expand.args[0], [d - lead for d in order[lead:]]), node)
                    new = _call(gm, aten.expand.default, (inner, [sizes[d] for d in order]), node)
            elif node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
                # Only a reshape of the dims after the broadcast ones, which it keeps.
                shape, target = list(expand.meta["val"].shape), list(node.meta["val"].shape)
                kept = max((d for d in range(ndim) if _expands_dim(expand, d)), default=-1) + 1
                lead = _leading(expand)
                # (sizes a slice at bounds read from a tensor gives are unbacked: not known equal)
                if 0 < kept <= len(target) and all(
                        guard_or_false(a == b) for a, b in zip(shape[:kept], target[:kept])):
                    source_shape = [1] * (kept - lead) + target[kept:]
                    if kept > lead and not all(guard_or_false(
                            expand.args[0].meta["val"].shape[d - lead] == 1) for d in range(lead, kept)):
                        source_shape = None
                    if source_shape is not None and all(isinstance(d, int) for d in source_shape):
                        inner = _call(gm, aten.reshape.default, (expand.args[0], source_shape), node)
                        new = _call(gm, aten.expand.default, (inner, sizes[:kept] + [-1] * (len(target) - kept)), node)
            elif node.target is aten.layer_norm.default:
                # Normalises each row over its last dims: the rows an expand copies stay copies.
                normalized = len(node.args[1])
                if not any(_expands_dim(expand, d) for d in range(ndim - normalized, ndim)):
                    inner = _call(gm, aten.layer_norm.default, (expand.args[0], *node.args[1:]), node)
                    new = _call(gm, aten.expand.default, (inner, sizes), node)
            elif node.target in _ALONG_ONE_DIM:
                # Works along one dim: where the expand does not broadcast it, the copies
                # stay copies (ConViT's ``pos_proj(rel.expand(B, ...)).softmax(-1)``).
                dim = node.args[1] % ndim
                if not _expands_dim(expand, dim):
                    inner = _call(gm, node.target, (expand.args[0], dim - _leading(expand), *node.args[2:]),
                                  node, node.kwargs)
                    new = _call(gm, aten.expand.default, (inner, sizes), node)
            elif node.target in _REDUCTIONS and node.args[1:2] and node.args[1]:
                # Reduces dims the expand does not broadcast: each copy reduced alike.
                dims = sorted(d % ndim for d in node.args[1])
                keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim"))
                lead = _leading(expand)
                if all(d >= lead and not _expands_dim(expand, d) for d in dims):
                    inner = _call(gm, node.target, (expand.args[0], [d - lead for d in dims], *node.args[2:]),
                                  node, node.kwargs)
                    kept = [1 if d in dims else size for d, size in enumerate(sizes)] if keepdim \
                        else [size for d, size in enumerate(sizes) if d not in dims]
                    new = _call(gm, aten.expand.default, (inner, kept), node)
            elif node.target in (aten.squeeze.dim, aten.squeeze.dims):
                # Only size-1 dims go, which the expand keeps (or added at size 1).
                named = node.args[1] if node.target is aten.squeeze.dims else [node.args[1]]
                shape = expand.meta["val"].shape
                dims = sorted({d % ndim for d in named if bool(shape[d % ndim] == 1)})
                lead = _leading(expand)
                source = expand.args[0]
                if any(d >= lead for d in dims):
                    source = _call(gm, aten.squeeze.dims, (source, [d - lead for d in dims if d >= lead]), node)
                new = _call(gm, aten.expand.default, (source, [s for d, s in enumerate(sizes) if d not in dims]), node)
            elif node.target in FILLED_LIKE and _read_only(node):
                # A constant of the expand's shape, read only, is the expand of that constant
                # of the source's (kornia's where(k == 0, ones_like(k), k) on a kernel per sample).
                inner = _call(gm, node.target, (expand.args[0], *node.args[1:]), node, node.kwargs)
                new = _call(gm, aten.expand.default, (inner, sizes), node)
            elif node.target is aten.unsqueeze.default:
                dim = node.args[1] % (ndim + 1)
                lead = _leading(expand)
                source = expand.args[0]
                if dim >= lead:
                    source = _call(gm, aten.unsqueeze.default, (source, dim - lead), node)
                new = _call(gm, aten.expand.default, (source, sizes[:dim] + [1] + sizes[dim:]), node)
        if new is not None:
            _replace(gm, node, new)
            changed = True
    return _finished(gm, changed)


def _cat_of_expands(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """A ``cat`` of expands that broadcast the same dims, none of them the cat's, to the
    same sizes, as the expand of the ``cat`` of their sources (a parameter stacked with a
    function of itself, each expanded to the batch: ``stack([p.expand_as(x), (p ** 2)
    .expand_as(x)], 1)``); ``None`` where it is not one."""
    aten = torch.ops.aten
    tensors = node.args[0]
    if len(tensors) < 2 or not all(isinstance(t, fx.Node) and t.op == "call_function"
                                   and t.target is aten.expand.default for t in tensors):
        return None
    ndim = node.meta["val"].dim()
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % ndim
    if any(t.meta["val"].dim() != ndim for t in tensors):
        return None
    broadcast = [{d for d in range(ndim) if _expands_dim(t, d)} for t in tensors]
    shapes = [t.meta["val"].shape for t in tensors]
    if any(b != broadcast[0] for b in broadcast) or dim in broadcast[0] or not broadcast[0] or not all(
            bool(shape[d] == shapes[0][d]) for shape in shapes for d in broadcast[0]):
        return None
    with gm.graph.inserting_before(node):
        sources = []
        for t in tensors:
            source = t.args[0]
            for _ in range(_leading(t)):
                source = _call(gm, aten.unsqueeze.default, (source, 0), node)
            sources.append(source)
        joined = _call(gm, aten.cat.default, (sources, dim), node)
        sizes = [tensors[0].args[1][d] if d in broadcast[0] else -1 for d in range(ndim)]
        return _call(gm, aten.expand.default, (joined, sizes), node)


def _reads_unexpanded(node: fx.Node, count: int) -> bool:
    """``scaled_dot_product_attention`` (``count`` 3: query, key, value) and ``matmul``
    (2) broadcast the batch dims of their operands (all but the last two): an operand
    expanded only along those, of the same rank, is read unexpanded where the others
    still give the output its shape (timm's attention-pool head
    ``q = self.q(self.latent.expand(B, -1, -1))``, Perceiver's latent queries)."""
    changed = False
    operands = list(node.args[:count])
    if not all(isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) for a in operands):
        return False
    for arg in list(operands):
        if arg not in operands or not (arg.op == "call_function" and arg.target in _EXPANDS):
            continue  # (read unexpanded already, as another operand)
        source = arg.args[0]
        ndim, source_ndim = arg.meta["val"].dim(), source.meta["val"].dim()
        if ndim < 3 or any(_expands_dim(arg, d) for d in (ndim - 2, ndim - 1)):
            continue
        # matmul broadcasts a matrix against a batch of them; attention wants equal ranks.
        if source_ndim < 2 or (count == 3 and source_ndim != ndim) or any(a.meta["val"].dim() < 2 for a in operands):
            continue
        # Every operand that is this expand reads its source (``sdpa(q, q, q)``).
        read = [source if a is arg else a for a in operands]
        batch_shapes = [a.meta["val"].shape[:-2] for a in read]
        if tuple(torch.broadcast_shapes(*batch_shapes)) == tuple(node.meta["val"].shape[:-2]):
            node.replace_input_with(arg, source)
            operands = read
            changed = True
    return changed


# Dtype and device conversions: elementwise like the pointwise ops, untagged.
# (``type_as`` to its own dtype returns its input itself too, though its schema names no alias)
_TO = {torch.ops.aten.to.dtype, torch.ops.aten.to.device, torch.ops.aten.to.dtype_layout, torch.ops.aten.to.other,
       torch.ops.aten.type_as.default}
_CONVERSIONS = {torch.ops.aten.to.dtype, torch.ops.aten.to.device, torch.ops.aten.to.dtype_layout,
                torch.ops.aten._to_copy.default}


def broadcast_expanded_operands_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """A pointwise op reads an expanded operand as the tensor it was expanded from
    where broadcasting gives the op the same shape: ``z * h0.expand(B, H)`` is
    ``z * h0``, values and gradients alike; where it does not (the other operands are
    shared too: ``sigmoid(gate) * pos.expand(B, …)``), the op runs on the unexpanded
    tensor and its result is expanded, for the ops after it.

    The expanded tensor has the batch's size without holding samples; a parameter
    broadcast against the batch is the ordinary elementwise use (a GRU cell started
    from a learned ``h0``)::

        expand = torch.ops.aten.expand.default(h0, [3, -1])                    # before
        mul = torch.ops.aten.mul.Tensor(sigmoid, expand)
        mul = torch.ops.aten.mul.Tensor(sigmoid, h0)                           # after
    """
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target is torch.ops.aten.scaled_dot_product_attention.default:
            changed |= _reads_unexpanded(node, 3)
            continue
        if node.target is torch.ops.aten.matmul.default:
            changed |= _reads_unexpanded(node, 2)
            continue
        if node.target in (torch.ops.aten.index_put.default, torch.ops.aten._unsafe_index_put.default):
            # The values broadcast to the rows they are written into, as an expand would
            # (MAE's mask token ``repeat``ed over the batch, written at masked positions).
            values = node.args[2]
            if isinstance(values, fx.Node) and values.op == "call_function" and values.target in _EXPANDS \
                    and values.target is not torch.ops.aten.expand_as.default:
                node.replace_input_with(values, values.args[0])
                changed = True
            continue
        if (torch.Tag.pointwise not in node.target.tags and node.target not in _CONVERSIONS) \
                or writes_in_place(node.target):
            continue
        if torch.Tag.nondeterministic_seeded in node.target.tags:
            continue  # random per element (dropout's mask): each row draws its own
        out = node.meta.get("val")
        if not isinstance(out, torch.Tensor):
            continue
        for i, arg in enumerate(node.args):
            if not (isinstance(arg, fx.Node) and arg.op == "call_function" and arg.target in _EXPANDS):
                continue
            source = arg.args[0]
            shapes = [a.meta["val"].shape for j, a in enumerate(node.args)
                      if j != i and isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
            broadcast = torch.broadcast_shapes(*shapes, source.meta["val"].shape)
            if len(broadcast) == out.dim() and all(guard_or_false(a == b) for a, b in zip(broadcast, out.shape)):
                node.replace_input_with(arg, source)
                changed = True
            elif arg.meta["val"].dim() == out.dim() and arg.target is not torch.ops.aten.expand_as.default \
                    and not any(u.target is torch.ops.aten.view.default for u in node.users) \
                    and not written_through(node):
                # (Not under a ``view``, which needs the result's memory dense: ``(p.expand(T, B,
                # d) + pos).view(T, B * H, d // H)``, as multi-head attention splits heads; nor
                # where an op writes into the result, which must own every element: stanza's
                # ``q = h.unsqueeze(3).repeat(1, 1, 1, n); q[..., 1:] = ...``.)
                # The other operands are no larger: the op runs on the unexpanded tensor
                # and its result is expanded (``f(expand(x), y) = expand(f(x, y))``).
                node.replace_input_with(arg, source)
                values = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
                node.meta["val"] = node.target(*values[0], **values[1])
                # The expand's sizes where the result is still broadcast (size 1, or a dim
                # in front); elsewhere the other operands gave the result its size.
                old, lead = list(arg.args[1]), out.dim() - node.meta["val"].dim()
                sizes = [old[i] if i < lead or (isinstance(n, int) and n == 1) else -1
                         for i, n in enumerate([None] * lead + list(node.meta["val"].shape))]
                with gm.graph.inserting_after(node):
                    expanded = gm.graph.call_function(torch.ops.aten.expand.default, (node, sizes))
                expanded.meta.update(node.meta)
                expanded.meta["val"] = out
                node.replace_all_uses_with(expanded, delete_user_cb=lambda user: user is not expanded)
                changed = True
                break
    return _finished(gm, changed)


def expand_after_lookup_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Apply an embedding or a linear before the expand of its input, not after:
    ``embedding(w, i.expand(s))`` is ``embedding(w, i).expand(*s, d)`` and
    ``linear(h.expand(*s, k), W, b)`` is ``linear(h, W, b).expand(*s, m)``, values and
    gradients alike.

    Hugging Face BERT looks token types up as ``token_type_ids.expand(B, T)`` from a
    ``[1, T]`` buffer; other models write ``arange(T).expand_as(idx)`` for positions, or
    start a recurrent cell from a learned state ``h0.expand(B, H)``. The expanded tensor
    is the size of the batch, which the batch analysis cannot tell from samples' own
    data. With the op first, its shared result is expanded to the batch like nanoGPT's
    ``wpe(arange(T))``, whose per-sample gradients are exact::

        expand = torch.ops.aten.expand.default(arange, [3, 8])              # before
        embedding = torch.ops.aten.embedding.default(wpe_weight, expand)
        embedding = torch.ops.aten.embedding.default(wpe_weight, arange)    # after
        expand_1 = torch.ops.aten.expand.default(embedding, [3, 8, 16])
    """
    aten = torch.ops.aten
    changed = False
    for node in list(gm.graph.nodes):
        if (node.op == "call_function" and node.target is aten.index.Tensor and len(node.args[1]) == 1
                and isinstance(node.args[1][0], fx.Node) and node.args[1][0].target in _EXPANDS
                and node.args[1][0].meta["val"].dtype in (torch.int64, torch.int32)
                and node.args[0].meta["val"].dim() == 2):
            # ``W[ids.expand(…)]`` of a table is the lookup ``embedding(W, ids.expand(…))``
            # (Whisper's ``embed_positions.weight[position_ids]`` with ``arange(T)`` ids
            # repeated to the batch).
            node.target = aten.embedding.default
            node.args = (node.args[0], node.args[1][0])
        if node.op != "call_function" or node.target not in (aten.embedding.default, aten.linear.default):
            continue
        position = 1 if node.target is aten.embedding.default else 0
        expanded = node.args[position] if len(node.args) > position else None
        if not (isinstance(expanded, fx.Node) and expanded.op == "call_function" and expanded.target in _EXPANDS):
            continue
        source, width = expanded.args[0], node.meta["val"].shape[-1]
        source_shape = source.meta["val"].shape
        if position == 0 and not (len(source_shape) and bool(source_shape[-1] == expanded.meta["val"].shape[-1])):
            continue  # the linear would contract an expanded dim
        with gm.graph.inserting_before(node):
            sizes = _expand_sizes(gm, expanded)
            args = list(node.args)
            args[position] = source
            applied = gm.graph.call_function(node.target, tuple(args), dict(node.kwargs))
            kept = sizes if position == 1 else sizes[:-1]
            new = gm.graph.call_function(aten.expand.default, (applied, [*kept, width]))
        applied.meta.update(node.meta)
        applied_shape = (*source_shape, width) if position == 1 else (*source_shape[:-1], width)
        applied.meta["val"] = node.meta["val"].new_empty(applied_shape)
        new.meta.update(node.meta)
        _replace(gm, node, new)
        changed = True
    return _finished(gm, changed)


_FILLED = {torch.ops.aten.zeros.default: 0, torch.ops.aten.ones.default: 1, torch.ops.aten.full.default: None}


def constant_ids_as_expand_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Ids made by ``torch.zeros(input_ids.shape)`` (or ``ones``/``full``) and only looked
    up by embeddings become one id expanded to that shape; a filled tensor read only as
    the input of linears and elementwise ops (through row views), one row expanded
    (Opacus's ``DPLSTM`` starts from ``torch.zeros(layers, B, H)``: ``linear(h0, W_hh,
    b_hh)`` is then the bias broadcast to the batch, not a parameter with one row per
    sample).

    LayoutLM, MobileBERT and SqueezeBERT build their default ``token_type_ids`` this
    way; a tensor the size of the batch that holds no samples' data would make the
    lookup's output look like one row per sample. As an expand, the lookup moves in
    front of it (``expand_after_lookup_pass``) and broadcasts::

        zeros = torch.ops.aten.zeros.default([3, 8], dtype = torch.int64)     # before
        zeros = torch.ops.aten.zeros.default([1, 1], dtype = torch.int64)     # after
        expand = torch.ops.aten.expand.default(zeros, [3, 8])
    """
    aten = torch.ops.aten
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _FILLED or not node.users:
            continue
        sizes = list(node.args[0])
        if all(u.target is aten.embedding.default and u.args[1] is node and u.args[0] is not node
               for u in node.users):
            kept = [1] * len(sizes)  # ids: every one the same
        elif len(sizes) >= 2 and not written_through(node) and _read_as_features(node):
            kept = [1] * (len(sizes) - 1) + sizes[-1:]  # rows: every one the same
        else:
            continue
        with gm.graph.inserting_before(node):
            one = gm.graph.call_function(node.target, (kept, *node.args[1:]), dict(node.kwargs))
            one.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            one.meta["val"] = node.meta["val"].new_empty([k if isinstance(k, int) else k.meta["val"] for k in kept])
            expanded = _call(gm, aten.expand.default, (one, sizes), node)
        _replace(gm, node, expanded)
        changed = True
    return _finished(gm, changed)


# Ops that keep one value in every element (the copies and views of a filled tensor).
_KEEP_ONE_VALUE = {
    torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.clone.default,
    torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
    torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims,
    torch.ops.aten.flatten.using_ints, torch.ops.aten._to_copy.default, torch.ops.aten.slice.Tensor,
    torch.ops.aten.select.int, torch.ops.aten.permute.default, torch.ops.aten.transpose.int, torch.ops.aten.t.default,
    torch.ops.aten.expand.default,
}


def _made_instead(gm: fx.GraphModule, node: fx.Node, target: Any, args: tuple) -> None:
    """``node`` replaced by the creation op ``target(*args)``, made with its dtype and
    device."""
    out = node.meta["val"]
    with gm.graph.inserting_before(node):
        made = gm.graph.call_function(target, args, {"dtype": out.dtype, "layout": torch.strided,
                                                     "device": out.device, "pin_memory": False})
    made.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    made.meta["val"] = out.new_empty(out.shape)
    _replace(gm, node, made)


def _graph_constants(gm: fx.GraphModule) -> list[tuple[fx.Node, Any]]:
    """Each tensor the model builds from Python values (a constant of the graph, copied
    in by ``lift_fresh_copy``), with that value."""
    return [(node, getattr(gm, node.args[0].target, None)) for node in gm.graph.nodes
            if node.op == "call_function" and node.target is torch.ops.aten.lift_fresh_copy.default
            and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr"]


def counting_constants_as_arange_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """A constant of the graph that counts ``0, 1, …, n - 1`` becomes ``torch.arange(n)``,
    the same values, which the analysis follows as the samples' positions where ``n`` is
    the batch size. Dynamo passes a Python ``range(B)`` used as an index as such a
    constant: supar's Eisner CRF reads each sample's score at its length by
    ``s[lens, range(B)]``::

        _tensor_constant0 = self._tensor_constant0                                # before
        lift_fresh_copy = torch.ops.aten.lift_fresh_copy.default(_tensor_constant0)
        index = torch.ops.aten.index.Tensor(s, [lens, lift_fresh_copy])
        arange = torch.ops.aten.arange.default(4, dtype = torch.int64, ...)      # after

    Dynamo guards the range: another batch size compiles again."""
    aten = torch.ops.aten
    changed = False
    for node, value in _graph_constants(gm):
        if not (isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() > 1
                and value.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
                and torch.equal(value.cpu(), torch.arange(value.numel(), dtype=value.dtype))):
            continue
        _made_instead(gm, node, aten.arange.default, (value.numel(),))
        changed = True
    return _finished(gm, changed)


def uniform_constants_as_fills_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """A tensor the model builds from a Python list of one number (``torch.tensor(freq)``
    of ``freq = [0, 0, 0]``, a constant of the graph) becomes that number filled in, as
    ``torch.full``, past the copies and views that follow it.

    Hugging Face's TimesFM looks its frequency embedding up by
    ``torch.tensor(freq[:B]).reshape(-1, 1)``: a constant the size of the batch that
    holds no sample's data. Filled, its lookup broadcasts one row to the batch
    (``constant_ids_as_expand_pass``)::

        _tensor_constant0 = self._tensor_constant0                                # before
        lift_fresh_copy = torch.ops.aten.lift_fresh_copy.default(_tensor_constant0)
        reshape = torch.ops.aten.reshape.default(lift_fresh_copy, [-1, 1])
        full = torch.ops.aten.full.default([3, 1], 0, dtype = torch.int32, ...)   # after

    Dynamo guards the list's values: another list compiles again."""
    aten = torch.ops.aten
    changed = False
    for node, value in _graph_constants(gm):
        if not (isinstance(value, torch.Tensor) and value.numel() > 1 and _one_value(value)):
            continue
        last = node
        while len(last.users) == 1 and next(iter(last.users)).target in _KEEP_ONE_VALUE \
                and next(iter(last.users)).args[0] is last:
            last = next(iter(last.users))
        out = last.meta["val"]
        if not all(isinstance(size, int) for size in out.shape) or written_through(last):
            continue
        _made_instead(gm, last, aten.full.default, (list(out.shape), value.reshape(-1)[0].to(out.dtype).item()))
        changed = True
    return _finished(gm, changed)


def _one_value(value: torch.Tensor) -> bool:
    """Whether every element of ``value`` is its first (not NaN; ``-0.0`` is no ``0.0``)."""
    return not value.is_complex() and values_alike_along(value.reshape(-1), 0, nan_alike=False)


# Views that ``sink_expands_pass`` moves an expand below, and elementwise reads.
_ROW_VIEWS = {
    torch.ops.aten.select.int, torch.ops.aten.slice.Tensor, torch.ops.aten.unsqueeze.default,
    torch.ops.aten.unbind.int, operator.getitem, *_SPLITS,
}


def _read_as_features(node: fx.Node) -> bool:
    """Whether every read of ``node`` (through row views) is the input of a linear or an
    elementwise op: the reads an expand of its rows can move past or broadcast into."""
    for user in node.users:
        if user.op != "call_function":
            return False
        if user.target in _ROW_VIEWS:
            if not _read_as_features(user):
                return False
        elif user.target is torch.ops.aten.linear.default:
            if user.args[0] is not node or any(a is node for a in user.args[1:]):
                return False
        elif not (isinstance(user.target, torch._ops.OpOverload) and torch.Tag.pointwise in user.target.tags
                  and not writes_in_place(user.target)
                  and torch.Tag.nondeterministic_seeded not in user.target.tags):
            return False
    return True


def _broadcast_source(operand: Any) -> fx.Node | None:
    """The tensor an operand of ``bmm`` was expanded from, where the expand only
    broadcast its leading (batch) dim: ``W.expand(B, k, m)``, ``W[None].expand(B, -1, -1)``."""
    if not (isinstance(operand, fx.Node) and operand.op == "call_function" and operand.target in _EXPANDS):
        return None
    source = operand.args[0]
    shape, expanded = tuple(source.meta["val"].shape), tuple(operand.meta["val"].shape)
    if not (2 <= len(shape) <= 3) or (len(shape) == 3 and not (isinstance(shape[0], int) and shape[0] == 1)):
        return None
    if not all(bool(a == b) for a, b in zip(shape[-2:], expanded[-2:])):
        return None
    return source


def broadcast_batched_product_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """A batched product with one operand expanded to the batch becomes a broadcasting
    ``matmul`` of the operand it was expanded from: ``bmm(x, W.expand(B, k, m))`` is
    ``matmul(x, W)``, and ``baddbmm(c, x, W.expand(…), beta, alpha)`` is
    ``beta·c + alpha·matmul(x, W)``, values and gradients alike.

    The expanded weight is the size of the batch without holding samples; a parameter
    in ``matmul`` is an ordinary shared operand (the matmul rule and its ghost norm)::

        expand = torch.ops.aten.expand.default(unsqueeze, [3, 8, 5])          # before
        bmm = torch.ops.aten.bmm.default(x, expand)
        matmul = torch.ops.aten.matmul.default(x, unsqueeze)                   # after
    """
    aten = torch.ops.aten
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (aten.bmm.default, aten.baddbmm.default):
            continue
        first = 0 if node.target is aten.bmm.default else 1
        a, b = node.args[first:first + 2]
        sources = _broadcast_source(a), _broadcast_source(b)
        if sources == (None, None) or None not in sources:
            continue  # nothing expanded, or both (then no batch is left to broadcast to)
        a, b = sources[0] or a, sources[1] or b
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(aten.matmul.default, (a, b))
            new.meta.update(node.meta)
            if node.target is aten.baddbmm.default:
                beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
                if alpha != 1:
                    new = _call(gm, aten.mul.Tensor, (new, alpha), node)
                if beta != 0:
                    added = node.args[0]
                    if beta != 1:
                        # ``beta·c`` has ``c``'s shape, which the sum broadcasts.
                        added = _call(gm, aten.mul.Tensor, (added, beta), node)
                    new = _call(gm, aten.add.Tensor, (added, new), node)
        _replace(gm, node, new)
        changed = True
    return _finished(gm, changed)


def _tile_source(operand: Any) -> tuple[Callable[[fx.GraphModule, fx.Node], fx.Node], Any, list[fx.Node]] | None:
    """For an operand of ``bmm`` that tiles a 3-D tensor ``s [H, m, k]`` along dim 0
    (``[R·H, m, k]``, row ``r·H + h`` is ``s[h]``), through transposes of the last two
    dims and products with a number: a function that emits ``s`` into the graph, ``H``,
    and that chain of ops, the op nearest ``s`` first. Tiles:

    - ``s.repeat(R, 1, 1)``;
    - ``s[None].expand(R, -1, -1, -1).reshape(R·H, m, k)``;
    - ``u.expand(L, R, E).view(L, R·H, k).transpose(0, 1)`` with ``u [L, 1, E]``,
      ``E = H·k``: the heads of a sequence-first query shared by the batch, as
      ``nn.MultiheadAttention`` splits them (``s`` is ``u.view(L, H, k).transpose(0, 1)``).
    """
    aten = torch.ops.aten
    chain: list[fx.Node] = []
    node = operand

    def expand_of(view: Any, dims: int | None, expanded: int) -> fx.Node | None:
        """The expand ``view`` reads, if it broadcasts dim ``expanded`` of ``dims`` (any
        number with ``None``: then a leading dim it adds counts as dim 0) only."""
        if not (isinstance(view, fx.Node) and view.op == "call_function"
                and view.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default)):
            return None
        expand = view.args[0]
        if not (isinstance(expand, fx.Node) and expand.op == "call_function" and expand.target in _EXPANDS):
            return None
        rank = expand.meta["val"].dim()
        if dims is not None and (rank != dims or expand.args[0].meta["val"].dim() != dims):
            return None
        if _leading(expand) > (0 if dims is not None else 1):
            return None
        if not all(_expands_dim(expand, d) == (d == expanded) for d in range(rank)):
            return None
        return expand

    while isinstance(node, fx.Node) and node.op == "call_function":
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dim() != 3:
            return None
        if node.target is aten.repeat.default:
            source, reps = node.args[0], list(node.args[1])
            if source.meta["val"].dim() == 3 and len(reps) == 3 and reps[1:] == [1, 1]:
                return (lambda gm, like: source), source.meta["val"].shape[0], chain[::-1]
            return None
        expand = expand_of(node, None, 0)
        if expand is not None:
            view = node
            # Row-major, [R, d1, …, dn] read as [R·H, m, k]: rows r·H + h are s[h] for
            # s = source[0] read as [H, m, k].
            source = expand.args[0]
            inner = list(expand.meta["val"].shape[1:])
            m, k = value.shape[1:]
            split = next((j for j in range(len(inner) + 1)
                          if statically_known_true(math.prod(inner[j:]) == m * k)), None)
            if split is None or not all(isinstance(n, int) for n in inner[:split]):
                return None
            heads = math.prod(inner[:split])

            def first_copy(gm: fx.GraphModule, like: fx.Node) -> fx.Node:
                first = source if _leading(expand) else _call(gm, aten.select.int, (source, 0, 0), like)
                # A symbolic size is read off the tiled tensor (the code cannot name it).
                sizes = [heads] + [n if isinstance(n, int) else _call(gm, aten.sym_size.int, (view, d), like)
                                   for d, n in ((1, m), (2, k))]
                return _call(gm, aten.reshape.default, (first, sizes), like)

            return first_copy, heads, chain[::-1]
        dims = {d % 3 for d in node.args[1:3]} if node.target is aten.transpose.int else None
        if dims == {0, 1}:
            expand = expand_of(node.args[0], 3, 1)
            if expand is None:
                return None
            length, _, width = expand.meta["val"].shape
            head_width = value.shape[2]
            if not (isinstance(length, int) and isinstance(width, int) and isinstance(head_width, int)
                    and width % head_width == 0 and node.args[0].meta["val"].shape[0] == length):
                return None
            source, heads = expand.args[0], width // head_width

            def split_heads(gm: fx.GraphModule, like: fx.Node) -> fx.Node:
                split = _call(gm, aten.view.default, (source, [length, heads, head_width]), like)
                return _call(gm, aten.transpose.int, (split, 0, 1), like)

            return split_heads, heads, chain[::-1]
        if dims == {1, 2}:
            chain.append(node)
        elif node.target in (aten.mul.Tensor, aten.div.Tensor) and isinstance(node.args[1], (int, float)):
            chain.append(node)
        elif node.target not in (aten.clone.default, aten.contiguous.default):
            return None
        node = node.args[0]
    return None


def tiled_batched_product_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """A batched product with one operand tiled over a batch merged with heads becomes a
    broadcasting ``matmul`` of the tile: with ``s [H, m, k]``,
    ``bmm(q, s.repeat(B, 1, 1))`` is ``matmul(q.unflatten(0, (-1, H)), s).flatten(0, 1)``.

    DeBERTa's relative-position keys are a parameter's projection repeated over the
    batch to ``[B·H, 2k, d]``; a sample reads one copy of it, and as a broadcast operand
    of ``matmul`` it is an ordinary shared one (the matmul rule)::

        repeat = torch.ops.aten.repeat.default(pos_key, [3, 1, 1])          # before
        bmm = torch.ops.aten.bmm.default(query, repeat)
        unflatten = torch.ops.aten.unflatten.int(query, 0, [-1, 2])          # after
        matmul = torch.ops.aten.matmul.default(unflatten, pos_key)
        flatten = torch.ops.aten.flatten.using_ints(matmul, 0, 1)
    """
    aten = torch.ops.aten
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.bmm.default:
            continue
        a, b = node.args[:2]
        with gm.graph.inserting_before(node):
            tiles = _tile_source(a), _tile_source(b)
            if (tiles[0] is None) == (tiles[1] is None):
                continue  # nothing tiled, or both (then no batch is left to broadcast to)
            side = 0 if tiles[0] is not None else 1
            emit, heads, chain = tiles[side]
            if not isinstance(heads, int):
                continue
            tile = emit(gm, node)
            for op in chain:
                tile = _call(gm, op.target, (tile, *op.args[1:]), op)
            other = _call(gm, aten.unflatten.int, ((b, a)[side], 0, [-1, heads]), node)
            product = _call(gm, aten.matmul.default, (tile, other) if side == 0 else (other, tile), node)
            new = _call(gm, aten.flatten.using_ints, (product, 0, 1), node)
        _replace(gm, node, new)
        changed = True
    return _finished(gm, changed)


def _row_tile(node: Any) -> tuple[fx.Node, Any, int] | None:
    """``(s, R, P)`` when ``node`` is ``s`` expanded along a dim 0 of size 1 (or added) to
    ``R`` copies of ``[P, …]`` and read with those two dims merged, ``[R·P, …]``: row
    ``r·P + p`` is ``s``'s row ``p``. (Swin's shift mask ``mask[None].expand(B, …)
    .reshape(-1, 1, N, N)``, added to scores whose batch is merged with the windows.)"""
    aten = torch.ops.aten
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default)):
        return None
    expand = node.args[0]
    if not (isinstance(expand, fx.Node) and expand.op == "call_function" and expand.target is aten.expand.default):
        return None
    shape, merged = list(expand.meta["val"].shape), list(node.meta["val"].shape)
    if len(shape) < 2 or len(merged) != len(shape) - 1 or not _expands_dim(expand, 0) \
            or _leading(expand) > 1 or not isinstance(shape[1], int) or _expands_dim(expand, 1):
        return None
    if not (statically_known_true(merged[0] == shape[0] * shape[1])
            and all(statically_known_true(a == b) for a, b in zip(merged[1:], shape[2:]))):
        return None
    if not all(isinstance(n, int) for n in merged[1:]):
        return None
    return expand.args[0], expand.args[1][0], shape[1]


def _copies_dim(gm: fx.GraphModule, source: fx.Node, rank: int, like: fx.Node) -> fx.Node:
    """A row tile's source with its dim of copies (size 1) in front, to stand for the
    tile's ``[R, P, …]`` split: rank ``rank + 1``."""
    if source.meta["val"].dim() == rank + 1:
        return source
    return _call(gm, torch.ops.aten.unsqueeze.default, (source, 0), like)


_TILED_POINTWISE = {torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor, torch.ops.aten.mul.Tensor,
                    torch.ops.aten.div.Tensor}


def tiled_pointwise_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """An elementwise op with a row tile (``_row_tile``) as an operand runs on the tile's
    source, the other operand's merged rows split: with ``m [nW, …]`` tiled to
    ``[B·nW, …]``, ``x + tile(m)`` is ``(x.unflatten(0, (-1, nW)) + m).flatten(0, 1)``.
    A sample then reads one copy of the tile, an ordinary shared operand; an operand
    with one row broadcasts, and the result is a tile again (Swin's relative position
    bias plus its shift mask, then added to the scores)::

        expand = torch.ops.aten.expand.default(mask, [2, -1, -1, -1, -1])          # before
        tile = torch.ops.aten.reshape.default(expand, [-1, 1, 4, 4])
        add = torch.ops.aten.add.Tensor(scores, tile)
        unflatten = torch.ops.aten.unflatten.int(scores, 0, [-1, 3])               # after
        add = torch.ops.aten.add.Tensor(unflatten, mask)
        flatten = torch.ops.aten.flatten.using_ints(add, 0, 1)
    """
    aten = torch.ops.aten
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.scaled_dot_product_attention.default:
            changed |= _attention_of_tiled_mask(gm, node)
            continue
        if node.op != "call_function" or node.target not in _TILED_POINTWISE or len(node.args) != 2:
            continue
        tiles = [_row_tile(a) for a in node.args]
        if (tiles[0] is None) == (tiles[1] is None):
            continue
        side = 0 if tiles[0] is not None else 1
        source, copies, period = tiles[side]
        other = node.args[1 - side]
        out = node.meta["val"]
        rank = node.args[side].meta["val"].dim()
        # The tile's rows must be the result's (a tile of lower rank would broadcast
        # along a later dim), and the result's trailing sizes numbers.
        if not isinstance(other, fx.Node) or out.dim() != rank or not all(isinstance(n, int) for n in out.shape[1:]):
            continue
        value = other.meta["val"]
        if value.dim() == rank and not statically_known_true(value.shape[0] == 1) \
                and not statically_known_true(value.shape[0] == out.shape[0]):
            continue
        with gm.graph.inserting_before(node):
            first = _copies_dim(gm, source, rank, node)
            if value.dim() == rank:
                split = (aten.unsqueeze.default, (other, 0)) if statically_known_true(value.shape[0] == 1) \
                    else (aten.unflatten.int, (other, 0, [-1, period]))
                other = _call(gm, split[0], split[1], node)
            result = _call(gm, node.target, (first, other) if side == 0 else (other, first), node)
            # Broadcast to the whole result: the tile's copies where no operand had them,
            # and any dim the tile's expand broadcast that the other operand does not fill.
            one = statically_known_true(result.meta["val"].shape[0] == 1)
            full = [period, *out.shape[1:]]
            if one or list(result.meta["val"].shape[1:]) != full:
                result = _call(gm, aten.expand.default, (result, [copies if one else -1, *full]), node)
            new = _call(gm, aten.reshape.default, (result, [-1, *out.shape[1:]]), node)
        _replace(gm, node, new)
        changed = True
    return _finished(gm, changed)


def _attention_of_tiled_mask(gm: fx.GraphModule, node: fx.Node) -> bool:
    """``scaled_dot_product_attention(q, k, v, tile(m))`` with ``q, k, v`` ``[R·P, …]``:
    the attention of ``q, k, v`` split to ``[R, P, …]`` with the mask ``m``, merged
    again (Swin's windows under ``attn_implementation="sdpa"``)."""
    aten = torch.ops.aten
    tile = _row_tile(node.args[3]) if len(node.args) > 3 else _row_tile(node.kwargs.get("attn_mask"))
    if tile is None:
        return False
    source, _, period = tile
    rows, rank = node.meta["val"].shape[0], node.meta["val"].dim()
    qkv = node.args[:3]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs["attn_mask"]
    # The mask's rows must be the queries' (a mask of lower rank broadcasts along later dims).
    if mask.meta["val"].dim() != rank or not all(
            t.meta["val"].dim() == rank and statically_known_true(t.meta["val"].shape[0] == rows) for t in qkv):
        return False
    with gm.graph.inserting_before(node):
        split = [_call(gm, aten.unflatten.int, (t, 0, [-1, period]), node) for t in qkv]
        mask = _copies_dim(gm, source, rank, node)
        kwargs = {k: v for k, v in node.kwargs.items() if k != "attn_mask"}
        out = _call(gm, node.target, (*split, mask, *node.args[4:]), node, kwargs)
        new = _call(gm, aten.flatten.using_ints, (out, 0, 1), node)
    _replace(gm, node, new)
    return True


def _sole_view(view: fx.Node) -> bool:
    """Whether ``view`` is the only way to its memory: a chain of views, each read by
    the next alone, from a computed tensor read by that chain alone (DeBERTa's
    ``transpose_for_scores(pos_q_proj(rel)) /= scale``). A write into it is then a
    write into a tensor nothing else aliases."""
    node = view
    while is_view(node):
        base = node.args[0]
        if not isinstance(base, fx.Node) or len(base.users) != 1:
            return False
        node = base
    # (an in-place op's result is its input's memory: ``v.mul_(2)[:, 0]`` writes into ``v``'s base)
    return node.op == "call_function" and not writes_in_place(node.target)


def _with_defaults_the_twin_lacks(node: fx.Node, twin: Any) -> tuple:
    """``node``'s arguments, with the in-place op's defaults written out where its twin
    has none: ``x.bernoulli_(0.5)`` is traced without its default ``p``, which
    ``bernoulli.p`` requires."""
    args = list(node.args)
    for i, (mine, theirs) in enumerate(zip(node.target._schema.arguments, twin._schema.arguments)):
        if mine.kwarg_only or theirs.has_default_value():
            break
        if i >= len(args) and mine.name not in node.kwargs and mine.has_default_value():
            args.append(mine.default_value)
    return tuple(args)


def in_place_as_out_of_place_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """An in-place op on a tensor nothing else aliases becomes its out-of-place twin, and
    later reads of the tensor read the op's result (views taken after the write
    included). The tensor may be a view that is its memory's only way (``_sole_view``).

    ``nn.LSTMCell`` computes ``gates = linear(hx, w_hh, b_hh); gates += linear(x, w_ih,
    b_ih)``; written as data flow, the batch analysis and the parameter transforms see
    the sum (``passes/writes.py`` follows the writes this pass leaves: into views, into
    graph inputs)::

        add_ = torch.ops.aten.add_.Tensor(linear_1, linear)     # before
        add = torch.ops.aten.add.Tensor(linear_1, linear)       # after
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    without_grad = computed_without_grad(gm.graph)
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not writes_in_place(node.target):
            continue
        written = node.args[0]
        twin = out_of_place(node.target)
        if twin is None or not isinstance(written, fx.Node) or written.op != "call_function":
            continue  # a graph input: the caller sees the write
        if writes_in_place(written.target):
            continue  # the result of a write this pass kept (into a graph input, say): the same memory
        if node in without_grad and not carries_no_gradient(_memory_of(written), without_grad):
            # A write under no_grad changes the values but keeps the gradient's path
            # through the tensor: its out-of-place twin, computed without grad, would cut it.
            continue
        if any(is_view(u) and order.get(u, -1) < order[node] for u in written.users):
            continue  # aliased memory
        if is_view(written) and not _sole_view(written):
            while (lifted := _write_one_view_up(gm, node, order)) is not None:
                node, written, changed = lifted, lifted.args[0], True
            changed |= _write_as_scatter(gm, node, twin, order)
            continue
        later = [u for u in written.users if u is not node and order.get(u, -1) > order[node]]
        if node.target is torch.ops.aten.copy_.default:
            node = _copy_as_broadcast(gm, node, written)
        else:
            node.args = _with_defaults_the_twin_lacks(node, twin)
            node.target = twin
        for user in later:
            user.replace_input_with(written, node)
        changed = True
    if changed:
        gm.recompile()
    return gm


def _memory_of(node: fx.Node) -> fx.Node:
    """The tensor whose memory view ``node`` shows, through views and pieces (``node``
    itself if no view)."""
    while node.op == "call_function" and _aliases(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _copy_as_broadcast(gm: fx.GraphModule, node: fx.Node, written: fx.Node) -> fx.Node:
    """``dst.copy_(src)`` into a tensor nothing else aliases is ``src`` broadcast to
    ``dst``'s shape in its dtype (``h = torch.zeros_like(x); h.copy_(y)``, ATen's own
    ``clone`` in some decompositions). The functional ``aten.copy`` has no derivative,
    so AOTAutograd could not train it; written as ``dst.masked_fill(True, 0) + src``,
    which gives ``dst`` the zero gradient ``copy_`` gives it (no value of ``dst`` is
    read: garbage from ``empty`` stays out) and ``src`` the output gradient::

        copy_ = torch.ops.aten.copy_.default(clone, eye)               # before
        ones_like = torch.ops.aten.ones_like.default(clone, dtype = torch.bool)   # after
        masked_fill = torch.ops.aten.masked_fill.Scalar(clone, ones_like, 0)
        add = torch.ops.aten.add.Tensor(masked_fill, eye)
    """
    src, dtype = node.args[1], written.meta["val"].dtype
    aten = torch.ops.aten
    with gm.graph.inserting_before(node):
        everywhere = _call(gm, aten.ones_like.default, (written,), node, {"dtype": torch.bool})
        kept = _call(gm, aten.masked_fill.Scalar, (written, everywhere, 0), node)
        if isinstance(src, fx.Node) and src.meta["val"].dtype != dtype:
            src = _call(gm, aten.to.dtype, (src, dtype), node)
        new = _call(gm, aten.add.Tensor, (kept, src), node)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return new


_SCATTERS = {torch.ops.aten.slice.Tensor, torch.ops.aten.select.int}
_FACTORIES = {torch.ops.aten.zeros.default, torch.ops.aten.ones.default, torch.ops.aten.full.default,
              torch.ops.aten.empty.memory_format}


def _written_somewhere(memory: fx.Node) -> bool:
    """Whether an in-place op writes into ``memory`` or a view or piece of it."""
    return any(_writes_into(user, value) for value, user in _alias_uses(memory))


def _fresh_constant(node: fx.Node) -> bool:
    """A tensor made from sizes alone (``torch.zeros(4, 5, 2)``), no tensor's values in
    it: a ``copy_`` into a slice of it is data flow (speechbrain's ``GaborConv1d``
    writes its parameters into such a filter bank, ``w[:, :, 1] = k``), as is one into
    the ``slice_scatter`` an earlier such write became (``w[..., 0] = k.exp()`` first)."""
    while node.target is torch.ops.aten.slice_scatter.default:
        node = node.args[0]
    return node.target in _FACTORIES and not any(
        isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes)


def _select_index(view: fx.Node) -> int | None:
    """The non-negative index a ``select`` takes along its dim, where the graph knows it
    (``None`` for a symbolic index, or one counted from the end of a symbolic size)."""
    dim, index = view.args[1], view.args[2]
    if not (isinstance(dim, int) and isinstance(index, int)):
        return None
    if index < 0:  # counted from the end of a dim whose size the graph may not name
        index = index + view.args[0].meta["val"].shape[dim]
    return index if isinstance(index, int) else None


def _scattered(gm: fx.GraphModule, base: fx.Node, value: fx.Node, view: fx.Node, like: fx.Node) -> fx.Node:
    """``base`` with ``value`` in place of what the slice or select ``view`` of it shows
    (a select of a known index, ``_select_index``)."""
    if view.target is torch.ops.aten.slice.Tensor:
        bounds = list(view.args[1:])
        size = base.meta["val"].shape[bounds[0]] if bounds else None
        if len(bounds) > 2 and isinstance(bounds[2], int) and isinstance(size, int) and bounds[2] > size:
            bounds[2] = size  # ``x[:, 1:]`` ends at sys.maxsize, which vmap's scatter would count to
        return _call(gm, torch.ops.aten.slice_scatter.default, (base, value, *bounds), like)
    # a select, as the slice of one row (see _select_scatter_as_slice)
    dim, index = view.args[1], _select_index(view)
    row = _call(gm, torch.ops.aten.unsqueeze.default, (value, dim), like)
    return _call(gm, torch.ops.aten.slice_scatter.default, (base, row, dim, index, index + 1), like)


def _apart(other: fx.Node, view: fx.Node, at: int, order: dict) -> bool:
    """Whether ``other``, a view of ``view``'s base taken before a write into ``view`` at
    ``at``, shows none of the memory written and is not written itself after it: rows
    of one dim, at positions known, that do not meet (a loop's ``h[i].mul_(2);
    ps.append(h[i])``: row 0's view still shows row 0 once row 1 is written). Its reads
    then read the base before the write, which holds the same values there."""
    if any(_writes_into(user, value) and order.get(user, -1) > at for value, user in _alias_uses(other)):
        return False
    if not _rows_apart(other, view):
        return False
    # A later write into the base that may reach ``other``'s positions would not show in it:
    # its reads would read the base before this write, the later write's into the scattered one.
    base = view.args[0]
    for value, user in _alias_uses(base):
        if not _writes_into(user, value) or order.get(user, -1) <= at:
            continue
        child = _view_of(base, value)
        if (child is base or not _rows_apart(child, other)) and _read_after(other, order[user], order):
            return False
    return True


def _rows_apart(a: fx.Node, b: fx.Node) -> bool:
    shown_a, shown_b = _rows_shown(a), _rows_shown(b)
    return shown_a is not None and shown_b is not None and shown_a[0] == shown_b[0] and (
        shown_a[2] <= shown_b[1] or shown_b[2] <= shown_a[1])


def _rows_shown(view: fx.Node) -> tuple[int, int, int] | None:
    """``(dim, start, end)`` of the positions a ``select`` or step-1 ``slice`` shows along
    its dim, where the graph knows them as numbers (else ``None``)."""
    if view.target not in _SCATTERS:
        return None
    shape = view.args[0].meta["val"].shape
    if view.target is torch.ops.aten.select.int:
        index = _select_index(view)
        return None if index is None else (view.args[1] % len(shape), index, index + 1)
    dim, start, end, step = (list(view.args[1:]) + [0, None, None, 1][len(view.args) - 1:])[:4]
    size = shape[dim] if isinstance(dim, int) else None
    if step != 1 or not isinstance(size, int):
        return None
    start, end = (0 if start is None else start), (size if end is None else end)
    if not (isinstance(start, int) and isinstance(end, int)):
        return None
    start, end = (max(0, min(size, b + size if b < 0 else b)) for b in (start, end))
    return dim % len(shape), start, end


def _read_after(view: fx.Node, at: int, order: dict) -> bool:
    """Whether anything reads ``view`` (or a view or piece of it) after position ``at``:
    such a read would see a write made at ``at`` into the memory they share."""
    return any(order.get(user, -1) > at for _, user in _alias_uses(view))


def _as_written(gm: fx.GraphModule, node: fx.Node, view: fx.Node) -> fx.Node:
    """What ``view.copy_(src)`` or ``view.fill_(src)`` (``node``; Dynamo writes ``out[i] =
    t`` of a 0-d ``t`` so) leaves in ``view``: ``src`` in its dtype, broadcast to its shape
    (no read of the view's values, nor of the tensor it shows). A 0-d ``src`` into a view
    whose sizes depend on the data, the rows a boolean mask selected, fills it out of
    place: an ``expand`` would take that count as a size (normflows' spline flows,
    ``cumwidths[..., 0] = left`` on ``widths[inside_interval_mask, :]``)."""
    src, shown = node.args[1], view.meta["val"]
    if src.meta["val"].dim() == 0 and free_unbacked_symbols(shown.shape):
        return _call(gm, torch.ops.aten.fill.Tensor, (view, src), node)
    copied = _written_somewhere(_memory_of(src))  # a later write into the source must not show
    if src.meta["val"].dtype != shown.dtype:
        src = _call(gm, torch.ops.aten.to.dtype, (src, shown.dtype), node)
    if tuple(src.meta["val"].shape) != tuple(shown.shape):
        sizes = [size if isinstance(size, int) else _call(gm, torch.ops.aten.sym_size.int, (view, d), node)
                 for d, size in enumerate(shown.shape)]
        src = _call(gm, torch.ops.aten.expand.default, (src, sizes), node)
    return _call(gm, torch.ops.aten.clone.default, (src,), node) if copied else src


def _write_one_view_up(gm: fx.GraphModule, node: fx.Node, order: dict) -> fx.Node | None:
    """``copy_`` into a slice or select of a slice or select (``W[0][:2] = w``,
    ``W[0, :2] = w``; spikingjelly's ``SlidingPSN`` fills a matrix so) of a tensor made
    from sizes alone (``_fresh_constant``), each view read by the write alone: the same
    write into the outer view, of the outer view's values with ``w`` scattered in, which
    ``_write_as_scatter`` can take (or ``None``)::

        select = torch.ops.aten.select.int(zeros, 0, 0)              # before
        slice_1 = torch.ops.aten.slice.Tensor(select, 0, 0, 2)
        copy_ = torch.ops.aten.copy_.default(slice_1, w)
        expand = torch.ops.aten.expand.default(w, [2])                # after
        slice_scatter = torch.ops.aten.slice_scatter.default(select, expand, 0, 0, 2)
        copy__1 = torch.ops.aten.copy_.default(select, slice_scatter)
    """
    view = node.args[0]
    outer = view.args[0] if view.args else None
    if node.target is not torch.ops.aten.copy_.default or view.target not in _SCATTERS \
            or not isinstance(outer, fx.Node) or outer.op != "call_function" or outer.target not in _SCATTERS \
            or len(view.users) != 1 or len(outer.users) != 1 or node.users:
        return None
    root = outer
    while isinstance(root, fx.Node) and root.op == "call_function" and root.target in _SCATTERS:
        root = root.args[0]
    if not (isinstance(root, fx.Node) and root.op == "call_function" and _fresh_constant(root)):
        return None  # (a write into computed values is followed by passes/writes.py as it is)
    if any(v.target is torch.ops.aten.select.int and _select_index(v) is None for v in (view, outer)):
        return None
    if not isinstance(node.args[1], fx.Node):
        return None
    with gm.graph.inserting_before(node):
        value = _as_written(gm, node, view)
        scattered = _scattered(gm, outer, value, view, node)
        lifted = _call(gm, torch.ops.aten.copy_.default, (outer, scattered), node)
    order[lifted] = order[node]
    gm.graph.erase_node(node)
    gm.graph.erase_node(view)
    return lifted


def _write_as_scatter(gm: fx.GraphModule, node: fx.Node, twin: Any, order: dict) -> bool:
    """An in-place op on a slice or select of a computed tensor, no other view of which
    taken before the write is read after it, as its out-of-place twin scattered into a
    new tensor that later reads of the base (and later views of it, and the graph's
    outputs) read: torchvision's Swin V2 ``qkv_bias = bias.clone(); qkv_bias[n:2 *
    n].zero_()``, segment-anything's ``coords = c.clone(); coords[:, :, 0] = coords[:, :,
    0] / w`` (a ``copy_``: the value as written, ``_as_written``)::

        slice_1 = torch.ops.aten.slice.Tensor(clone, 0, 4, 8)           # before
        zero_ = torch.ops.aten.zero_.default(slice_1)
        zero = torch.ops.aten.zero.default(slice_1)                     # after
        slice_scatter = torch.ops.aten.slice_scatter.default(clone, zero, 0, 4, 8)
    """
    view = node.args[0]
    base = view.args[0]
    at = order[node]
    if (view.target not in _SCATTERS or not isinstance(base, fx.Node) or base.op != "call_function"
            or is_view(base) or writes_in_place(base.target)):
        return False
    retaken = []  # views taken before, apart from the write, read later through the scattered tensor
    for other in base.users:
        if not is_view(other) or other is view or order.get(other, -1) >= at or not _read_after(other, at, order):
            continue
        if _apart(other, view, at, order):
            continue
        if not (_rows_apart(other, view) and _retakeable(other, at, order)):
            return False
        retaken.append(other)
    if any(_writes_into(u, base) and _read_after(u, at, order) for u in base.users if order.get(u, -1) < at):
        # an earlier write's result read after this one (``r = h.mul_(2); h[:, 1] = g; r + 1``):
        # the base's memory, whose later reads would not see the scattered tensor
        return False
    if any(_writes_into(user, value) for alias in (view, node) for value, user in _alias_uses(alias)
           if user is not node and order.get(user, -1) > at):
        # written again later through the view, or through the write's own result (``v.mul_(2);
        # v[:, 0] = g``), whose later views would read the out-of-place result, no view of the base
        return False
    later = [order[user] for value, user in _alias_uses(base)
             if _writes_into(user, value) and user is not node and order.get(user, -1) > at
             and not _rows_apart(_view_of(base, value), view)]
    if later and any(order.get(user, -1) > min(later) for alias in (view, node) for _, user in _alias_uses(alias)):
        # the view read after a later write into its base (``v.add_(g); h[:, 2] = c; v.sin()``,
        # ``s = h[:, 1:]; s.mul_(2); h.add_(1); s + 1``): the out-of-place result those reads
        # would get does not show that write (where none reads it, the later write goes into
        # the scattered tensor: escnn's filter, a block of zeros(...) written, then an index_put_)
        return False
    if view.target is torch.ops.aten.select.int and _select_index(view) is None:
        return False
    shown = view.meta["val"].dtype
    if node.target not in (torch.ops.aten.copy_.default, torch.ops.aten.fill_.Tensor) and any(
            isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
            and torch.promote_types(a.meta["val"].dtype, shown) != shown for a in node.args[1:]):
        return False  # the out-of-place twin would promote (``ids[:, 0] += scale``)
    if node.target in (torch.ops.aten.copy_.default, torch.ops.aten.fill_.Tensor):
        with gm.graph.inserting_before(node):  # in order, where the write was
            value = _as_written(gm, node, view)
            scattered = _scattered(gm, base, value, view, node)
        node.replace_all_uses_with(value)
        gm.graph.erase_node(node)
        node = value
    else:
        node.target = twin
        with gm.graph.inserting_before(node.next):  # in order, right after the write
            scattered = _scattered(gm, base, node, view, node)
    for user in [u for u in base.users if u is not scattered and order.get(u, -1) > at]:
        user.replace_input_with(base, scattered)
    for user in [u for u in view.users if u is not node and order.get(u, -1) > at]:
        user.replace_input_with(view, node)
    for other in retaken:
        with gm.graph.inserting_after(scattered):
            again = _call(gm, other.target, (scattered, *other.args[1:]), other, dict(other.kwargs))
        for user in [u for u in other.users if order.get(u, -1) > at]:
            user.replace_input_with(other, again)
    return True


def _retakeable(other: fx.Node, at: int, order: dict) -> bool:
    """Whether every read of view ``other`` after position ``at`` is a use of ``other``
    itself, or of what such a use made after ``at``: the view taken again at ``at`` then
    serves them all. A view of ``other``, or a write's result, made before ``at`` and
    read after it (``v = h[:, 1].reshape(-1)``, then ``v[:, None]``) would still show the
    old memory."""
    return not any(order.get(user, -1) < at and ((_aliases(user) and user.args[0] is other) or _writes_into(user, other))
                   and any(order.get(later, -1) > at for _, later in _alias_uses(user)) for user in other.users)


def _view_of(base: fx.Node, value: fx.Node) -> fx.Node:
    """The view of ``base`` itself through which ``value`` (a view of a view, or a
    write's result) shows its memory (``base`` where ``value`` is ``base``, or where an
    ``as_strided`` on the way may reach memory outside that view: ``f[:, 3:4].as_strided(
    (5,), (5,), 1)`` shows column 1)."""
    escapes = False
    while value is not base and value.args[0] is not base:
        escapes |= value.target in (torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_.default)
        value = value.args[0]
    return base if escapes or value.target in (torch.ops.aten.as_strided.default,
                                               torch.ops.aten.as_strided_.default) else value
