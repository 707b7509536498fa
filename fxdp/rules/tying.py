"""Cross terms of tied parameters used by two different rules (GPT-2's ``wte``/``lm_head``).

For a table ``E [V, d]`` used by ``embedding(E, ids)`` (output gradient ``h``) and by
``linear(a, E)`` (output gradient ``g`` over the vocabulary), the per-sample norm of
the sum of both gradients needs their inner product. Index letters: ``n`` batch,
``s`` embedding positions, ``t`` linear positions, ``d`` features, ``v`` vocabulary::

    <∂E_emb, ∂E_lin>_n = Σ_{s,t} g[n, t, ids[n, s]] · (h[n, s] · a[n, t])

which costs ``O(T_s·T_t·d)`` per sample and never builds a ``[B, V, d]`` tensor.
"""
from __future__ import annotations

import torch

from fxdp.registry import register_ghost_inner
from fxdp.rules._common import as_sequence

__all__ = ["embedding_linear_inner"]


def embedding_linear_inner(emb_ops, emb_config, lin_ops, lin_config) -> torch.Tensor:
    h, ids = emb_ops
    g, a = lin_ops
    h, ids = as_sequence(h), as_sequence(ids, last=0).to(torch.int64)
    padding_idx = emb_config.get("padding_idx", -1)
    if padding_idx is not None and padding_idx >= 0:
        h = torch.where((ids != padding_idx).unsqueeze(-1), h, 0)  # (a NaN there stays out, as PyTorch skips it)
    g, a = as_sequence(g), as_sequence(a)
    picked = torch.gather(g, 2, ids.unsqueeze(1).expand(-1, g.shape[1], -1))  # [n, t, s]
    features = torch.bmm(a, h.transpose(1, 2))  # [n, t, s]
    return (picked * features).sum((1, 2))


register_ghost_inner("embedding.weight", "linear.weight", embedding_linear_inner)
