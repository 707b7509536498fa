"""Canonicalise a Dynamo graph to pre-dispatch ATen, where rules are keyed."""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx
from torch._decomp import get_decompositions

from fxdp._torch_internals import inline_checkpoints, make_fx_traced

__all__ = [
    "canonicalize_pass", "embedding_expand_pass", "repeat_as_expand_pass", "rnn_initial_state_pass",
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


def rnn_initial_state_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Give an RNN's default zero initial state the input's batch dim.

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


# Recurrent layers arrive as one fused call; their decompositions unroll them into
# per-step ``aten.linear`` calls, which the linear rule handles as tied uses.
_DECOMPOSED = [
    torch.ops.aten.lstm.input, torch.ops.aten.gru.input, torch.ops.aten.rnn_tanh.input,
    torch.ops.aten.rnn_relu.input,
]


def _einsum_as_products(equation, operands, **kwargs):
    """``aten.einsum`` as ATen's own implementation runs it: permutes, views and
    ``bmm``/``mul``/``sum``. Its tensors come as one list argument, which the tag pass
    cannot tag a parameter in; the ops it becomes have rules (a parameter operand goes
    through ``bmm`` with a parameter transform in front) and batch propagations."""
    return torch.ops.aten.einsum.default.decompose(equation, operands, **kwargs)


def canonicalize_pass(gm: fx.GraphModule, fake_args: Sequence[Any], *, fake_mode) -> fx.GraphModule:
    """Retrace ``gm`` with ``make_fx(pre_dispatch=True)`` under its fake mode.

    ``torch._C._nn.linear(x, w, b)`` becomes ``torch.ops.aten.linear.default(x, w, b)``;
    ``aten.lstm`` becomes per-step linears, ``aten.einsum`` matrix products;
    activation-checkpointed regions are inlined (their ops become ordinary ops of the
    graph). Placeholders keep their order, node meta (``nn_module_stack``) is preserved.
    """
    gm = inline_checkpoints(gm)
    gm = rnn_initial_state_pass(gm)
    # The LSTM decomposition would pick the opaque aten.mkldnn_rnn_layer on CPU float32.
    decompositions = {**get_decompositions(_DECOMPOSED), torch.ops.aten.einsum.default: _einsum_as_products}
    with torch.backends.mkldnn.flags(enabled=False):
        out = make_fx_traced(fx.Interpreter(gm).run, fake_args, fake_mode=fake_mode, pre_dispatch=True,
                             decompositions=decompositions)
    out = repeat_as_expand_pass(out)
    out = embedding_expand_pass(out)
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


def embedding_expand_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Look up expanded indices before the expand: ``embedding(w, i.expand(s))`` is
    ``embedding(w, i).expand(*s, d)``, values and gradients alike.

    Hugging Face BERT looks token types up as ``token_type_ids.expand(B, T)`` from a
    ``[1, T]`` buffer; other models write ``arange(T).expand_as(idx)`` for positions.
    The expanded indices are a constant the size of the batch, which the batch analysis
    cannot tell from samples' own indices. Looked up first, the shared rows are expanded
    to the batch like nanoGPT's ``wpe(arange(T))``, whose per-sample gradients are exact::

        expand = torch.ops.aten.expand.default(arange, [3, 8])              # before
        embedding = torch.ops.aten.embedding.default(wpe_weight, expand)
        embedding = torch.ops.aten.embedding.default(wpe_weight, arange)    # after
        expand_1 = torch.ops.aten.expand.default(embedding, [3, 8, 16])
    """
    aten = torch.ops.aten
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.embedding.default or len(node.args) < 2:
            continue
        indices = node.args[1]
        if not (isinstance(indices, fx.Node) and indices.op == "call_function"
                and indices.target in _EXPANDS):
            continue
        source, width = indices.args[0], node.meta["val"].shape[-1]
        with gm.graph.inserting_before(node):
            sizes = _expand_sizes(gm, indices)
            lookup = gm.graph.call_function(aten.embedding.default, (node.args[0], source, *node.args[2:]),
                                            dict(node.kwargs))
            expanded = gm.graph.call_function(aten.expand.default, (lookup, [*sizes, width]))
        lookup.meta.update(node.meta)
        lookup.meta["val"] = node.meta["val"].new_empty(
            (*source.meta["val"].shape, width)) if "val" in node.meta else None
        expanded.meta.update(node.meta)
        node.replace_all_uses_with(expanded)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm
