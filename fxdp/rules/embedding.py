"""``aten.embedding`` and ``aten.embedding_bag``: rows of a table picked by integer ids.

Index letters: ``n`` batch, ``t``/``s`` the ids of one sample (all index dims
flattened, ``T`` of them), ``d`` embedding features, ``v`` rows of the table (``V``).

Per-sample gradient: ``∂E_n[v] = Σ_t [id_nt = v] c_nt g_nt`` where ``g_nt`` is the
output gradient that reaches id ``t`` and ``c_nt`` its weight: 1 for ``embedding``
(0 at ``padding_idx``); for ``embedding_bag`` the bag's output gradient times the
per-sample weight (``mode="sum"``) or ``1 / bag size`` (``mode="mean"``).

Ghost norm, two exact routes, the cheaper chosen from the sizes:

- pairs: ``‖∂E_n‖² = Σ_{t,s} [id_nt = id_ns] (g_nt·g_ns)``, ``O(T²d)`` per sample;
- segments: sort the keys ``n·V + id``, sum the gradients of equal keys into one
  row each (``index_add`` into ``[B·T, d]``) and add up the rows' squared norms,
  ``O(T d + T log T)`` per sample.

Instantiating costs ``O(V d)`` per sample (a ``[B, V, d]`` buffer), so the ghost
norm wins for any real vocabulary. ``scale_grad_by_freq`` is refused (the ordinary
gradient divides by each id's frequency in the whole batch), as is
``embedding_bag``'s ``mode="max"``. Gradients are dense even with ``sparse=True``.

``embedding_bag`` comes in two layouts:

- ``"regular"``: the offsets are ``arange(0, N, K)`` (what ``F.embedding_bag`` makes
  of a 2-D input ``[B, K]``; or the model's own ``arange(B) * K``): the indices are
  batched, each sample owns ``P`` whole bags of ``K`` ids, its output rows ``[B, P, d]``;
- ``"offsets"``: 1-D indices shared by the graph and offsets batched (pass
  ``in_dims=(None, 0)``): bag ``n`` (``offsets[n]`` to the next offset) is sample ``n``.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from fxdp.batching import WHOLE, BatchDim
from fxdp.registry import GRAD, OpRule, ParamRule, register_rule
from fxdp.rules._common import as_sequence, hint

__all__ = [
    "EMBEDDING",
    "EMBEDDING_BAG",
    "EMBEDDING_BAG_DEFAULT",
    "embedding_weight",
    "embedding_bag_weight",
    "MODULE_OPS",
]

aten = torch.ops.aten

_MODE_SUM, _MODE_MEAN, _MODE_MAX = 0, 1, 2


_FREQ = (
    "scale_grad_by_freq divides the gradient by each id's frequency in the whole batch, "
    "which ties the samples' gradients together; use scale_grad_by_freq=False"
)
_MAX = (
    "embedding_bag mode='max' routes each feature's gradient to the row of its maximum; "
    "fxdp has no per-sample rule for it; use mode='sum' or 'mean'"
)


def _arg(args, index: int, default: Any) -> Any:
    return args[index] if len(args) > index and args[index] is not None else default


def _refuse(config: dict) -> None:
    """Settings ``check`` refuses; raised again here should a use reach the maths unchecked."""
    if config.get("scale_grad_by_freq"):
        raise NotImplementedError(_FREQ)
    if config.get("mode") == _MODE_MAX:
        raise NotImplementedError(_MAX)


# ---------------------------------------------------------------------------
# Shared maths over "tokens": each id with the gradient that reaches it, either
# batch-major ``g [B, T, d]``, ``ids [B, T]`` or flat with each token's sample.
# ---------------------------------------------------------------------------


def _keys(ids: torch.Tensor, sample: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    """``sample·V + id``: one key per (sample, table row)."""
    return sample.to(torch.int64) * num_embeddings + ids.to(torch.int64)


def _regular_sample(ids: torch.Tensor) -> torch.Tensor:
    """``[B, T] -> [B, T]``: the sample index of each id."""
    return torch.arange(ids.shape[0], device=ids.device).unsqueeze(1).expand(ids.shape)


def _scatter_rows(keys: torch.Tensor, grads: torch.Tensor, rows: int) -> torch.Tensor:
    """``Σ`` of ``grads [N, d]`` into ``rows`` rows by ``keys [N]``: ``[rows, d]``."""
    return grads.new_zeros(rows, grads.shape[-1]).index_add(0, keys, grads)


def _segments(keys: torch.Tensor) -> torch.Tensor:
    """Rank of each key among the distinct keys, ``[N] -> [N]`` in ``[0, N)``.

    Equal keys get equal ranks; the shape never depends on the data (unlike
    ``unique``), so it traces with fake tensors.
    """
    sorted_keys, order = torch.sort(keys)
    new = torch.cat([torch.ones_like(sorted_keys[:1], dtype=torch.bool),
                     sorted_keys[1:] != sorted_keys[:-1]])
    rank_sorted = torch.cumsum(new, 0) - 1
    return torch.zeros_like(rank_sorted).scatter(0, order, rank_sorted)


def _segments_sq_norm(keys: torch.Tensor, sample: torch.Tensor, grads: torch.Tensor,
                      batch_size: Any) -> torch.Tensor:
    """``‖∂E_n‖²`` from flat tokens: ``keys, sample [N]``, ``grads [N, d]`` -> ``[B]``."""
    rank = _segments(keys)
    rows = _scatter_rows(rank, grads, keys.shape[0]).pow(2).sum(1)
    # Every token of one segment belongs to one sample; rows past the last segment are 0.
    row_sample = torch.zeros_like(rank).scatter(0, rank, sample.to(torch.int64))
    return rows.new_zeros(batch_size).index_add(0, row_sample, rows)


def _pairs_sq_norm(g: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``Σ_{t,s} [id_nt = id_ns] (g_nt·g_ns)``: ``g [B, T, d]``, ``ids [B, T]`` -> ``[B]``."""
    same = ids.unsqueeze(2) == ids.unsqueeze(1)
    gram = torch.bmm(g, g.transpose(1, 2))
    return (gram * same.to(gram.dtype)).sum((1, 2))


def _pairs_cost(n: int, t: int, d: int) -> float:
    return float(n * t * t * (d + 2))


def _segments_cost(tokens: int, d: int) -> float:
    # Sorting is charged as a few comparisons per level; index_add, square and sum as 3 d.
    return float(tokens * (3 * d + 8 * max(1, math.ceil(math.log2(tokens + 1)))))


def _instantiate_cost(n: int, tokens: int, v: int, d: int) -> float:
    # Fill and reduce a [B, V, d] buffer, scatter the tokens' gradients into it.
    return float(2 * n * v * d + tokens * d)


def _regular_sq_norm(g: torch.Tensor, ids: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    """Ghost norm of batch-major tokens, by the cheaper of pairs and segments."""
    n, t, d = (hint(s) for s in g.shape)
    if _pairs_cost(n, t, d) <= _segments_cost(n * t, d):
        return _pairs_sq_norm(g, ids)
    sample = _regular_sample(ids)
    return _segments_sq_norm(_keys(ids, sample, num_embeddings).reshape(-1), sample.reshape(-1),
                             g.reshape(-1, g.shape[-1]), g.shape[0])


def _regular_costs(n: int, t: int, d: int, v: int) -> dict[str, float]:
    return {
        "ghost": min(_pairs_cost(n, t, d), _segments_cost(n * t, d)),
        "instantiate": _instantiate_cost(n, n * t, v, d),
    }


def _not_padding(ids: torch.Tensor, padding_idx: int | None) -> torch.Tensor | None:
    if padding_idx is None or padding_idx < 0:
        return None
    return ids != padding_idx


def _meta(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def _num_rows(weight: Any) -> Any:
    rows = _meta(weight).shape[0]
    return rows if isinstance(rows, torch.SymInt) else int(rows)


# ---------------------------------------------------------------------------
# aten.embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False)
# ---------------------------------------------------------------------------


def _embedding_tokens(g: torch.Tensor, ids: torch.Tensor, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``g [B, *, d]``, ``ids [B, *]`` -> ``[B, T, d]``, ``[B, T]``, padding's gradient zeroed."""
    _refuse(config)
    padding_idx = config.get("padding_idx", -1)
    g, ids = as_sequence(g), as_sequence(ids, last=0)
    keep = _not_padding(ids, padding_idx)
    if keep is not None:  # (selected, not multiplied: a NaN gradient there stays out, as PyTorch skips it)
        g = torch.where(keep.unsqueeze(-1), g, 0)
    return g, ids


def _embedding_per_sample_grad(g, ids, *, num_embeddings, **config):
    g, ids = _embedding_tokens(g, ids, config)
    n, d = g.shape[0], g.shape[-1]
    keys = _keys(ids, _regular_sample(ids), num_embeddings).reshape(-1)
    return _scatter_rows(keys, g.reshape(-1, d), n * num_embeddings).reshape(n, num_embeddings, d)


def _embedding_sum_grad(g, ids, *, num_embeddings, **config):
    g, ids = _embedding_tokens(g, ids, config)
    return _scatter_rows(ids.reshape(-1).to(torch.int64), g.reshape(-1, g.shape[-1]), num_embeddings)


def _embedding_ghost_sq_norm(g, ids, *, num_embeddings, **config):
    g, ids = _embedding_tokens(g, ids, config)
    return _regular_sq_norm(g, ids, num_embeddings)


def _embedding_costs(shapes, *, num_embeddings, **config) -> dict[str, float]:
    (n, *mid, d), _ = shapes
    t = math.prod(hint(s) for s in mid)
    return _regular_costs(hint(n), t, hint(d), hint(num_embeddings))


def _embedding_concat(uses: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [
        torch.cat([as_sequence(g) for g, _ in uses], dim=1),
        torch.cat([as_sequence(ids, last=0) for _, ids in uses], dim=1),
    ]


embedding_weight = ParamRule(
    name="embedding.weight",
    operands=(GRAD, 1),
    per_sample_grad=_embedding_per_sample_grad,
    sum_grad=_embedding_sum_grad,
    ghost_sq_norm=_embedding_ghost_sq_norm,
    costs=_embedding_costs,
    concat_uses=_embedding_concat,
)


def _embedding_config(args) -> dict:
    return {
        "num_embeddings": _num_rows(args[0]),
        "padding_idx": _arg(args, 2, -1),
        "scale_grad_by_freq": bool(_arg(args, 3, False)),
    }


def _no_input_grad(op_name: str):
    def input_grad(args, grad_out, index):
        raise NotImplementedError(
            f"{op_name} has no differentiable non-parameter argument {index} "
            "(its indices are integers)")

    return input_grad


def _table_batched(args_batch) -> None:
    if args_batch[0] is not None:
        raise ValueError("the embedding table itself is batched")


def _embedding_batch_rule(args_batch, args_meta, out_meta, config):
    # The output is [*indices.shape, d]: the indices' batch stays where it is.
    _table_batched(args_batch)
    return args_batch[1]


def _embedding_check(args_batch, args_meta, index):
    # Unbatched indices (positions from arange) are the core's business: it expands the
    # output to the batch when its users allow, so the gradient reaching us is per-sample.
    if _arg(args_meta, 3, False):
        return _FREQ
    if args_batch[0] is not None:
        return "the embedding table itself is batched"
    return None


EMBEDDING = register_rule(
    OpRule(
        op=aten.embedding.default,
        params={0: embedding_weight},
        input_grad=_no_input_grad("aten.embedding"),
        batch_rule=_embedding_batch_rule,
        config=_embedding_config,
        check=_embedding_check,
    )
)


# ---------------------------------------------------------------------------
# aten.embedding_bag.padding_idx(weight, indices, offsets, scale_grad_by_freq, mode,
#     sparse, per_sample_weights, include_last_offset, padding_idx)
# -> (output [bags, d], offset2bag, bag_size, max_indices)
# ---------------------------------------------------------------------------


def _bag_of(num_ids: Any, offsets: torch.Tensor) -> torch.Tensor:
    """``[N]``: the bag of each of ``N`` flat ids, from the start offsets of the bags."""
    positions = torch.arange(num_ids, device=offsets.device, dtype=offsets.dtype)
    # right=True: an id at an empty bag's offset belongs to the next, non-empty bag.
    return torch.bucketize(positions, offsets, right=True) - 1


def _bag_weights(ids: torch.Tensor, bag: torch.Tensor | None, bags: Any,
                 per_sample_weights: torch.Tensor | None, *, mode: int, padding_idx: Any,
                 dtype: torch.dtype, bag_shape: tuple | None = None) -> torch.Tensor:
    """``c`` of each id: per-sample weight or ``1/size of its bag``, 0 at padding.

    Either ``ids [B, P·K]`` with ``bag_shape = (B, P, K)`` (regular bags) or flat
    ``ids [N]`` with ``bag [N]`` of ``bags`` bags.
    """
    keep = _not_padding(ids, padding_idx)
    weight = torch.ones_like(ids, dtype=dtype) if keep is None else keep.to(dtype)
    if mode == _MODE_MEAN:
        if bag_shape is not None:
            sizes = weight.reshape(bag_shape).sum(-1, keepdim=True)
            weight = (weight.reshape(bag_shape) / sizes.clamp(min=1)).reshape(ids.shape)
        else:
            sizes = weight.new_zeros(bags).index_add(0, bag, weight)
            weight = weight / sizes.clamp(min=1)[bag]
    if per_sample_weights is not None:
        weight = weight * per_sample_weights.reshape(ids.shape).to(dtype)
    return weight


def _bag_tokens(g, ids, offsets, per_sample_weights, *, mode, padding_idx, bags, **config):
    """Every id with the weighted gradient that reaches it.

    Returns:
        ``(grads [N, d], ids [N], sample [N], B)``, flat.
    """
    _refuse({"mode": mode, **config})
    if bags == "regular":
        # g [B, P, d] (P bags per sample), ids [B, P·K].
        g, ids = as_sequence(g), as_sequence(ids, last=0)
        n, p, d = g.shape
        k = ids.shape[1] // p if p else 0
        psw = None if per_sample_weights is None else per_sample_weights.reshape(ids.shape)
        c = _bag_weights(ids, None, None, psw, mode=mode, padding_idx=padding_idx,
                         dtype=g.dtype, bag_shape=(n, p, k))
        grads = _without_padding(g.unsqueeze(2).expand(n, p, k, d).reshape(n, p * k, d) * c.unsqueeze(-1), ids,
                                 padding_idx)
        sample = _regular_sample(ids)
        return grads.reshape(-1, d), ids.reshape(-1), sample.reshape(-1), n
    # "offsets": g [B, d], shared ids [1, N], offsets [B]: bag n is sample n.
    ids = ids.reshape(-1)
    n = g.shape[0]
    bag = _bag_of(ids.shape[0], offsets.reshape(-1))
    psw = None if per_sample_weights is None else per_sample_weights.reshape(-1)
    c = _bag_weights(ids, bag, n, psw, mode=mode, padding_idx=padding_idx, dtype=g.dtype)
    grads = _without_padding(g.reshape(n, -1)[bag] * c.unsqueeze(-1), ids, padding_idx)
    return grads, ids, bag, n


def _without_padding(grads: torch.Tensor, ids: torch.Tensor, padding_idx: Any) -> torch.Tensor:
    """``grads`` zero at the padding ids, selected, not multiplied: a NaN gradient of a bag
    of padding alone stays out, as PyTorch skips padding."""
    keep = _not_padding(ids, padding_idx)
    return grads if keep is None else torch.where(keep.unsqueeze(-1), grads, 0)


def _bag_per_sample_grad(g, ids, offsets, per_sample_weights=None, *, num_embeddings, **config):
    grads, ids, sample, n = _bag_tokens(g, ids, offsets, per_sample_weights, **config)
    keys = _keys(ids, sample, num_embeddings)
    return _scatter_rows(keys, grads, n * num_embeddings).reshape(n, num_embeddings, grads.shape[-1])


def _bag_sum_grad(g, ids, offsets, per_sample_weights=None, *, num_embeddings, **config):
    grads, ids, _, _ = _bag_tokens(g, ids, offsets, per_sample_weights, **config)
    return _scatter_rows(ids.to(torch.int64), grads, num_embeddings)


def _bag_ghost_sq_norm(g, ids, offsets, per_sample_weights=None, *, num_embeddings, **config):
    grads, flat_ids, sample, n = _bag_tokens(g, ids, offsets, per_sample_weights, **config)
    if config["bags"] == "regular":
        t = flat_ids.shape[0] // n if n else 0
        return _regular_sq_norm(grads.reshape(n, t, -1), flat_ids.reshape(n, t), num_embeddings)
    return _segments_sq_norm(_keys(flat_ids, sample, num_embeddings), sample, grads, n)


def _bag_costs(shapes, *, num_embeddings, bags, **config) -> dict[str, float]:
    g_shape, ids_shape = shapes[0], shapes[1]
    n, d = hint(g_shape[0]), hint(g_shape[-1])
    v = hint(num_embeddings)
    if bags == "regular":
        t = math.prod(hint(s) for s in ids_shape[1:])
        return _regular_costs(n, t, d, v)
    tokens = math.prod(hint(s) for s in ids_shape)
    return {"ghost": _segments_cost(tokens, d), "instantiate": _instantiate_cost(n, tokens, v, d)}


embedding_bag_weight = ParamRule(
    name="embedding_bag.weight",
    operands=(GRAD, 1, 2, 6),
    per_sample_grad=_bag_per_sample_grad,
    sum_grad=_bag_sum_grad,
    ghost_sq_norm=_bag_ghost_sq_norm,
    costs=_bag_costs,
    # Uses of one table by several bag ops are summed per use (no common layout).
    concat_uses=None,
)


def _arange(node: Any) -> tuple[Any, Any, Any] | None:
    """``(start, end, step)`` of an ``arange`` node, or of one times a number
    (``arange(B) * K`` is ``arange(0, B·K, K)``); ``None`` for anything else."""
    if not isinstance(node, fx.Node):
        return None
    if node.target in (aten.mul.Tensor, aten.mul.Scalar) and len(node.args) == 2:
        inner, factor = node.args
        if isinstance(factor, fx.Node) and not isinstance(inner, fx.Node):
            inner, factor = factor, inner
        found = _arange(inner)
        if found is None or not isinstance(factor, int):
            return None
        return tuple(v * factor for v in found)
    # On a graph compiled for any batch size, ``end`` is a symbolic size (a node).
    if node.target is aten.arange.start_step:  # (its step left at 1 where a bag holds one id)
        step = node.args[2] if len(node.args) > 2 else node.kwargs.get("step", 1)
        return _meta(node.args[0]), _meta(node.args[1]), _meta(step)
    if node.target is aten.arange.start:
        return _meta(node.args[0]), _meta(node.args[1]), 1
    if node.target is aten.arange.default:
        return 0, _meta(node.args[0]), 1
    return None


def _regular_offsets(indices: Any, offsets: Any) -> bool:
    """Whether the offsets are ``arange(0, N, K)`` (or ``arange(N // K) * K``) with
    ``K`` dividing ``N``, the ``N`` indices' count: bags of ``K`` ids each, as
    F.embedding_bag lowers a 2-D input."""
    found = _arange(offsets)
    if found is None:
        return False
    start, end, step = found
    num_ids = _meta(indices).shape[0]
    return bool(start == 0) and bool(end == num_ids) and bool(step > 0) and bool(end % step == 0)


def _bag_config(args) -> dict:
    return {
        "num_embeddings": _num_rows(args[0]),
        "mode": _arg(args, 4, _MODE_SUM),
        "padding_idx": _arg(args, 8, -1),
        "include_last_offset": bool(_arg(args, 7, False)),
        "scale_grad_by_freq": bool(_arg(args, 3, False)),
        "bags": "regular" if _regular_offsets(args[1], args[2]) else "offsets",
    }


def _bag_input_grad(args, grad_out, index):
    if index != 6:
        raise NotImplementedError(
            f"aten.embedding_bag has no differentiable non-parameter argument {index} "
            "(its indices and offsets are integers)")
    # d out[bag_j] / d per_sample_weights_j = weight[id_j] (mode "sum" only).
    weight, ids, offsets = args[0], args[1], args[2]
    padding_idx = _arg(args, 8, -1)
    bag = _bag_of(ids.shape[0], offsets)
    grad = (weight[ids] * grad_out[bag]).sum(-1)
    keep = _not_padding(ids, padding_idx)
    return grad if keep is None else grad * keep.to(grad.dtype)


def _bag_batch_rule(args_batch, args_meta, out_meta, config):
    """Where the bags' batch goes; see the module docstring for the two layouts."""
    _table_batched(args_batch)
    ids_batch, offsets_batch = args_batch[1], args_batch[2]
    psw_batch = args_batch[6] if len(args_batch) > 6 else None
    ids, offsets = args_meta[1], args_meta[2]
    if ids_batch is not None:
        if offsets_batch is not None:
            raise ValueError("both its indices and its offsets are batched")
        if psw_batch is not None and not psw_batch.same_as(ids_batch):
            raise ValueError("per_sample_weights are batched differently from the indices")
        if psw_batch is None and _arg(args_meta, 6, None) is not None:
            raise ValueError("the indices are batched but per_sample_weights are shared")
        if ids_batch.dim is None:
            bags_batch = WHOLE
        else:
            if config["bags"] != "regular" or config["include_last_offset"]:
                raise ValueError(
                    "its bags (offsets shared by all samples) may hold the ids of several "
                    "samples; pass 2-D input [B, K], or 1-D input with batched offsets "
                    "(in_dims=(None, 0): bag n is sample n)")
            num_ids, bags = ids.shape[0], offsets.shape[0]
            size = num_ids // bags if bool(bags != 0) else 1
            if not bool(size * bags == num_ids) or not bool(ids_batch.inner % size == 0):
                raise ValueError("its bags hold the ids of several samples")
            bags_batch = BatchDim(0, ids_batch.inner // size, ids_batch.outer)
        per_id_batch = ids_batch
    elif offsets_batch is not None:
        if psw_batch is not None:
            raise ValueError("per_sample_weights are batched but the indices are shared")
        if config["include_last_offset"]:
            raise ValueError(
                "with include_last_offset=True the offsets have one entry more than there are "
                "bags, so batched offsets do not give one bag per sample; use "
                "include_last_offset=False")
        if offsets_batch.dim is not None and not bool(offsets_batch.inner == 1):
            raise ValueError("batched offsets must hold one bag per sample")
        bags_batch = offsets_batch
        per_id_batch = None  # the ids are shared; which sample they serve is data
    else:
        raise ValueError("per_sample_weights are batched but its indices and offsets are shared")
    # (output [bags, d], offset2bag [N] or [0], bag_size [bags], max_indices [bags(, d)])
    offset2bag = per_id_batch if config["mode"] != _MODE_SUM else None
    return [bags_batch, offset2bag, bags_batch, bags_batch]


def _bag_check(args_batch, args_meta, index):
    if index != 0:
        return None
    if args_batch[0] is not None:
        return "the embedding table itself is batched"
    if args_batch[1] is None and args_batch[2] is None:
        return (
            "neither the indices nor the offsets of this embedding_bag have a batch dim, so its "
            "output and its table's gradient are shared by all samples")
    if _arg(args_meta, 4, _MODE_SUM) == _MODE_MAX:
        return _MAX
    if _arg(args_meta, 3, False):
        return _FREQ
    return None


def _bag_rule(op) -> OpRule:
    return register_rule(
        OpRule(
            op=op,
            params={0: embedding_bag_weight},
            input_grad=_bag_input_grad,
            batch_rule=_bag_batch_rule,
            config=_bag_config,
            check=_bag_check,
        )
    )


EMBEDDING_BAG = _bag_rule(aten.embedding_bag.padding_idx)
EMBEDDING_BAG_DEFAULT = _bag_rule(aten.embedding_bag.default)


MODULE_OPS = {
    torch.nn.Embedding: (aten.embedding.default,),
    torch.nn.EmbeddingBag: (aten.embedding_bag.padding_idx,),
}
