"""Canonicalise a Dynamo graph to pre-dispatch ATen, where rules are keyed."""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx
from torch._decomp import get_decompositions

from fxdp._torch_internals import inline_checkpoints, make_fx_traced
from fxdp.passes.writes import is_view, writes_in_place
from fxdp.registry import out_of_place

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
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _CELL_CALLS and len(node.args) >= 2:
            changed |= _batch_cell_states(gm, node)
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
                changed = True
            else:
                new_states.append(state)
        args = list(node.args)
        args[1] = type(hx)(new_states) if isinstance(hx, (list, tuple)) else new_states[0]
        node.args = tuple(args)
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def _batch_cell_states(gm: fx.GraphModule, node: fx.Node) -> bool:
    """``nn.LSTMCell``/``GRUCell``/``RNNCell`` called without a state build
    ``torch.zeros(B, hidden)`` themselves: the same zeros, from the input."""
    x, hx = node.args[0], node.args[1]
    states = list(hx) if isinstance(hx, (list, tuple)) else [hx]
    new_states, changed = [], False
    for state in states:
        shape = _cell_state(state, x)
        if shape is None:
            new_states.append(state)
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(_zero_cell_state_like, (x, shape[1]))
        new.meta.update(state.meta)
        new_states.append(new)
        changed = True
    if changed:
        args = list(node.args)
        args[1] = type(hx)(new_states) if isinstance(hx, (list, tuple)) else new_states[0]
        node.args = tuple(args)
    return changed


# Recurrent layers arrive as one fused call; their decompositions unroll them into
# per-step ``aten.linear`` calls, which the linear rule handles as tied uses.
_DECOMPOSED = [
    torch.ops.aten.lstm.input, torch.ops.aten.gru.input, torch.ops.aten.rnn_tanh.input,
    torch.ops.aten.rnn_relu.input,
]


# Recurrent cells (nn.LSTMCell, GRUCell, RNNCell) are composite ops; ATen's own
# implementation is linears and pointwise gates, which have rules.
_COMPOSITE = [
    torch.ops.aten.lstm_cell.default, torch.ops.aten.gru_cell.default, torch.ops.aten.rnn_tanh_cell.default,
    torch.ops.aten.rnn_relu_cell.default,
    # Matrix-transpose aliases (``x.mT``, ``x.mH``, ``x.T``), kept whole by the
    # pre-dispatch trace: as the transposes and permutes they are, the batch-dim
    # analysis and the parameter-transform rules know them.
    torch.ops.aten.mT.default, torch.ops.aten.mH.default, torch.ops.aten.adjoint.default,
    torch.ops.aten.numpy_T.default, torch.ops.aten.matrix_H.default,
]


def _bilinear_as_einsum(input1, input2, weight, bias=None):
    """``nn.Bilinear``: ``y_o = x1ᵀ W_o x2 + b_o`` as an ``einsum`` (ATen writes it as
    ``_trilinear``, which has no rule; the einsum becomes matrix products that do)."""
    out = torch.einsum("...i,oij,...j->...o", input1, weight, input2)
    return out if bias is None else out + bias


def _einsum_as_products(equation, operands, **kwargs):
    """``aten.einsum`` as ATen's own implementation runs it: permutes, views and
    ``bmm``/``mul``/``sum``. Its tensors come as one list argument, which the tag pass
    cannot tag a parameter in; the ops it becomes have rules (a parameter operand goes
    through ``bmm`` with a parameter transform in front) and batch propagations."""
    return torch.ops.aten.einsum.default.decompose(equation, operands, **kwargs)


def canonicalize_pass(gm: fx.GraphModule, fake_args: Sequence[Any], *, fake_mode) -> fx.GraphModule:
    """Retrace ``gm`` with ``make_fx(pre_dispatch=True)`` under its fake mode.

    ``torch._C._nn.linear(x, w, b)`` becomes ``torch.ops.aten.linear.default(x, w, b)``;
    ``aten.lstm`` and the recurrent cells become per-step linears, ``aten.einsum`` and
    ``aten.bilinear`` matrix products;
    activation-checkpointed regions are inlined (their ops become ordinary ops of the
    graph). Placeholders keep their order, node meta (``nn_module_stack``) is preserved.
    """
    gm = inline_checkpoints(gm)
    gm = rnn_initial_state_pass(gm)
    # The LSTM decomposition would pick the opaque aten.mkldnn_rnn_layer on CPU float32.
    decompositions = {
        **get_decompositions(_DECOMPOSED), **{op: op.decompose for op in _COMPOSITE},
        torch.ops.aten.einsum.default: _einsum_as_products, torch.ops.aten.bilinear.default: _bilinear_as_einsum,
    }
    with torch.backends.mkldnn.flags(enabled=False):
        out = make_fx_traced(fx.Interpreter(gm).run, fake_args, fake_mode=fake_mode, pre_dispatch=True,
                             decompositions=decompositions)
    out = repeat_as_expand_pass(out)
    out = in_place_as_out_of_place_pass(out)
    out = expand_after_lookup_pass(out)
    out.graph.lint()
    out.recompile()
    return out


def repeat_as_expand_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """A ``repeat`` that only copies size-1 dims is an ``expand`` (then a view).

    ``nn.MultiheadAttention(add_bias_kv=True)`` writes ``bias_k.repeat(1, bsz, 1)``;
    as an expand it is a parameter expanded to the batch, which the batch analysis
    hands row by row to the samples::

        repeat = torch.ops.aten.repeat.default(bias_k, [1, 5, 1])   # before
        expand = torch.ops.aten.expand.default(bias_k, [1, 5, 4])   # after
    """
    aten = torch.ops.aten
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.repeat.default:
            continue
        src, reps = node.args[0], list(node.args[1])
        shape = list(src.meta["val"].shape)
        if len(reps) == len(shape) and all(bool(r == 1) or bool(s == 1) for r, s in zip(reps, shape)):
            node.target = aten.expand.default
            node.args = (src, [s * r for s, r in zip(shape, reps)])
    gm.graph.lint()
    gm.recompile()
    return gm


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
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def in_place_as_out_of_place_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """An in-place op on a tensor nothing else aliases becomes its out-of-place twin, and
    later reads of the tensor read the op's result.

    ``nn.LSTMCell`` computes ``gates = linear(hx, w_hh, b_hh); gates += linear(x, w_ih,
    b_ih)``; written as data flow, the batch analysis and the parameter transforms see
    the sum (``passes/writes.py`` follows the writes this pass leaves: into views, into
    graph inputs)::

        add_ = torch.ops.aten.add_.Tensor(linear_1, linear)     # before
        add = torch.ops.aten.add.Tensor(linear_1, linear)       # after
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not writes_in_place(node.target):
            continue
        written = node.args[0]
        twin = out_of_place(node.target)
        if (twin is None or not isinstance(written, fx.Node) or written.op != "call_function"
                or is_view(written) or any(is_view(u) for u in written.users)):
            continue  # a graph input (the caller sees the write), or aliased memory
        later = [u for u in written.users if u is not node and order[u] > order[node]]
        node.target = twin
        for user in later:
            user.replace_input_with(written, node)
        changed = True
    if changed:
        gm.recompile()
    return gm
