"""Convolutions: ``aten.conv{1,2,3}d`` (integer and string padding),
``aten.conv_transpose{1,2,3}d`` and ``aten.convolution``.

Index letters: ``n`` batch, ``g`` group, ``o`` output channels of one group, ``c`` input
channels of one group, ``r`` rows of one sample (when the batch is merged into the
op's batch dim, ``[B·R, C, H, W]``), ``u v w`` output positions and ``i j l`` kernel
offsets along each spatial dim, ``k`` one patch (``c`` and the kernel offsets,
flattened in the weight's order), ``p``/``s`` positions of one sample (``r`` and the
output positions flattened, ``P`` of them).

A convolution is a linear layer over patches: with ``U = unfold(x)`` of shape
``[n, g, p, k]`` and the output gradient ``M`` of shape ``[n, g, p, o]``, the
per-sample weight gradient of group ``g`` is ``∂W_ng = Σ_p M_ngpo U_ngpk``; the groups
are the diagonal blocks of the weight, so the squared norm adds over them.
Ghost norm (Gram route): ``‖∂W_n‖² = Σ_g Σ_{p,s} (U_ngp·U_ngs)(M_ngp·M_ngs)``, which
costs ``O(G·P²·(k+o))`` per sample against ``O(G·P·k·o)`` for instantiating; the
cheaper is chosen per layer from the sizes at compile time (small feature maps with
many channels go ghost, large feature maps instantiate).

A transposed convolution ``y = Cᵀx`` is the adjoint of the convolution ``C`` with the
same weight, stride, padding, dilation and groups (``C`` maps ``y``'s space to ``x``'s),
so ``∂L/∂W = ∂⟨C(∂L/∂y), x⟩/∂W``: its weight gradient is the convolution's with input
and output gradient swapped, ``U = unfold(∂L/∂y)`` (positions cut to ``x``'s size:
with ``output_padding ≥ stride`` the convolution of ``y`` has more) and ``M = x``.

``padding="same"`` with an odd total padding ``dilation·(kernel - 1)`` pads one more on
the right than on the left, as PyTorch does; padding is kept as ``(left, right)`` per dim.
``padding_mode`` other than zeros arrives as an ``aten.pad`` before the convolution,
whose output is the input these rules see.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxdp.batching import BatchDim
from fxdp.registry import GRAD, OpRule, ParamRule, register_rule
from fxdp.rules._common import contraction_cost, fastest_route, gram_cost, gram_inner, hint

__all__ = [
    "CONV_RULES",
    "conv_weight",
    "conv_bias",
    "conv_config",
    "unfold_patches",
    "conv_weight_per_sample_grad",
    "conv_weight_ghost_sq_norm",
    "PATCH_CHUNK_BYTES",
    "INPUT_GRAD_CHUNK_BYTES",
    "conv_input_grad_channels_first",
    "MODULE_OPS",
]

aten = torch.ops.aten


# ---------------------------------------------------------------------------
# Static settings of one call
# ---------------------------------------------------------------------------


def _meta(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def _ints(value: Any, n: int) -> tuple[int, ...]:
    if isinstance(value, (list, tuple)):
        value = [int(v) for v in value]
        return tuple(value * n) if len(value) == 1 else tuple(value)
    return (int(value),) * n


def conv_config(args: Sequence[Any], *, layout: str = "conv") -> dict:
    """The static settings of one convolution call, normalised.

    Args:
        args: The op's positional arguments (FX nodes or tensors for the tensors).
        layout: Which argument list: "conv" ``(x, w, b, stride, padding, dilation,
            groups)``, "transpose" ``(x, w, b, stride, padding, output_padding,
            groups, dilation)`` or "convolution" (``aten.convolution``'s).

    Returns:
        ``kernel``, ``stride``, ``dilation``, ``output_padding`` (tuples, one entry per
        spatial dim), ``padding`` (``((left, right), ...)``), ``groups``, ``transposed``.
    """
    weight = _meta(args[1])
    kernel = tuple(hint(s) for s in weight.shape[2:])
    n = len(kernel)

    def arg(i: int, default: Any) -> Any:
        return args[i] if len(args) > i and args[i] is not None else default

    if layout == "conv":
        stride, padding, dilation, groups = arg(3, 1), arg(4, 0), arg(5, 1), arg(6, 1)
        output_padding, transposed = 0, False
    elif layout == "transpose":
        stride, padding, output_padding, groups, dilation = arg(3, 1), arg(4, 0), arg(5, 0), arg(6, 1), arg(7, 1)
        transposed = True
    else:
        stride, padding, dilation = args[3], args[4], args[5]
        transposed, output_padding, groups = bool(args[6]), args[7], args[8]
    stride, dilation = _ints(stride, n), _ints(dilation, n)
    if isinstance(padding, str):
        if padding == "valid":
            pairs = ((0, 0),) * n
        elif padding == "same":
            # PyTorch's rule (aten/native/Convolution.cpp): the odd one goes right.
            pairs = tuple((d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2) for d, k in zip(dilation, kernel))
        else:
            raise ValueError(f"unknown convolution padding {padding!r}")
    else:
        pairs = tuple((p, p) for p in _ints(padding, n))
    return {
        "kernel": kernel,
        "stride": stride,
        "padding": pairs,
        "dilation": dilation,
        # A graph value where it is the batch size (``groups=B``, see _samples_as_groups).
        "groups": _meta(groups) if isinstance(groups, fx.Node) else int(groups),
        "transposed": transposed,
        "output_padding": _ints(output_padding, n),
    }


def _symmetric(padding: tuple) -> bool:
    return all(left == right for left, right in padding)


def _pad_list(padding: tuple) -> list[int]:
    """``((l1, r1), (l2, r2))`` in ``F.pad``'s order (last dim first)."""
    out: list[int] = []
    for left, right in reversed(padding):
        out += [left, right]
    return out


# ---------------------------------------------------------------------------
# Layout helpers: a sample's rows and the patches
# ---------------------------------------------------------------------------


def _rows(t: torch.Tensor, spatial: int) -> tuple[torch.Tensor, int, int]:
    """``[n, C, *sp]`` or ``[n, R, C, *sp]`` -> (``[n·R, C, *sp]``, n, R).

    ``R`` is how many rows of the op's batch dim belong to one sample (the batch
    merged with other dims, or a sample of an unbatched call brought to ``[1, ...]``).
    """
    if t.dim() == spatial + 2:
        return t, t.shape[0], 1
    return t.flatten(0, 1), t.shape[0], t.shape[1]


def unfold_patches(x: torch.Tensor, kernel: Sequence[int], stride: Sequence[int],
                   padding: Sequence[tuple[int, int]], dilation: Sequence[int]) -> torch.Tensor:
    """im2col for any number of spatial dims, padding ``(left, right)`` per dim.

    Args:
        x: ``[N, C, *in]``.

    Returns:
        ``[N, C, *out, *kernel]``, a strided view of (the padded) ``x``:
        ``out[n, c, *q, *j] = x_pad[n, c, *(q·stride + j·dilation)]``.
    """
    pads = _pad_list(tuple(padding))
    if any(pads):
        x = F.pad(x, pads)
    for i, (k, s, d) in enumerate(zip(kernel, stride, dilation)):
        # Each unfold turns spatial dim i into output positions and appends the window.
        x = x.unfold(2 + i, d * (k - 1) + 1, s)
        if d > 1:
            x = x[..., ::d]
    return x


def _patch_views(g: torch.Tensor, x: torch.Tensor, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Patches ``[n, r, g, c, u.., i..]`` and multiplier ``[n, r, g, o, u..]``, both views.

    ``∂W_n[g·o, c, i..] = Σ_{r, u..} multiplier · patches`` (see the module docstring).
    """
    kernel, groups = config["kernel"], config["groups"]
    spatial = len(kernel)
    if config["transposed"]:
        source, multiplier = g, x
    else:
        source, multiplier = x, g
    source, n, rows = _rows(source, spatial)
    multiplier, _, _ = _rows(multiplier, spatial)
    patches = unfold_patches(source, kernel, config["stride"], config["padding"], config["dilation"])
    if config["transposed"]:
        # The adjoint convolution of ∂L/∂y can reach past x (output_padding ≥ stride).
        for i, size in enumerate(multiplier.shape[2:]):
            if patches.shape[2 + i] != size:
                patches = patches.narrow(2 + i, 0, size)
    patches = patches.unflatten(1, (groups, -1)).unflatten(0, (n, rows))
    multiplier = multiplier.unflatten(1, (groups, -1)).unflatten(0, (n, rows))
    return patches, multiplier


def _channels_last(t: torch.Tensor) -> bool:
    """Channels innermost in memory (``[N, C, *sp]`` stored as ``[N, *sp, C]``)."""
    return t.dim() in (4, 5) and t.shape[1] > 1 and t.stride(1) == 1 and not t.is_contiguous()


def _patch_matrices(g: torch.Tensor, x: torch.Tensor, config: dict) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The patches ``U``, the multiplier ``M [n, g, o, p]`` and whether ``U`` is
    positions-major (positions ``p`` = rows × output positions).

    ``U`` is one copy of the strided patch view in the order the input's memory is
    read fastest: ``[n, g, k, p]`` (``k`` = channel, kernel offsets) from a
    channels-first input, ``[n, g, p, k']`` (``k'`` = kernel offsets, channel) from a
    channels-last one (a model run in ``torch.channels_last``). Either
    copy is several times faster on a CPU than ``F.unfold``. ``M`` is a view when a
    sample has one row. Every contraction below is then a plain batched matmul.
    """
    patches, multiplier = _patch_views(g, x, config)
    spatial = len(config["kernel"])
    n, rows, groups = patches.shape[:3]
    out = list(range(4, 4 + spatial))
    kernel = list(range(4 + spatial, 4 + 2 * spatial))
    positions_major = _channels_last(g if config["transposed"] else x)
    if positions_major:
        # [n, r, g, c, *out, *kernel] -> [n, g, r, *out, *kernel, c] -> [n, g, p, k']
        patches = patches.permute([0, 2, 1, *out, *kernel, 3]).reshape(n, groups, -1, patches.shape[3] * math.prod(config["kernel"]))
    else:
        # [n, r, g, c, *out, *kernel] -> [n, g, c, *kernel, r, *out] -> [n, g, k, p]
        patches = patches.permute([0, 2, 3, *kernel, 1, *out]).reshape(n, groups, patches.shape[3] * math.prod(config["kernel"]), -1)
    multiplier = multiplier.permute([0, 2, 3, 1, *out]).reshape(n, groups, multiplier.shape[3], -1)
    return patches, multiplier, positions_major


def _weight_shape(g: torch.Tensor, x: torch.Tensor, config: dict) -> tuple:
    spatial = len(config["kernel"])
    c_out, c_in = g.shape[g.dim() - spatial - 1], x.shape[x.dim() - spatial - 1]
    if config["transposed"]:
        return (c_in, c_out // config["groups"], *config["kernel"])
    return (c_out, c_in // config["groups"], *config["kernel"])


# ---------------------------------------------------------------------------
# Weight
# ---------------------------------------------------------------------------


def _weight_grad_by_convolution(g: torch.Tensor, x: torch.Tensor, config: dict, *, per_sample: bool) -> torch.Tensor:
    """The weight gradient by ``aten.convolution_backward``, summed or per sample.

    Per sample, the samples become groups: ``[n, C, *sp]`` is read as one batch row
    of ``n·C`` channels, and a convolution with ``n·groups`` groups has exactly the
    per-sample weight gradients as its weight gradient ``[n·C_out, C_in/groups, *k]``.
    Rows of a sample (``[n, R, C, *sp]``) stay the batch, which the gradient sums.
    """
    spatial = len(config["kernel"])
    shape = weight_shape = _weight_shape(g, x, config)
    n = g.shape[0]
    if per_sample:
        def fold(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == spatial + 2:
                return t.reshape(1, -1, *t.shape[2:])
            return t.transpose(0, 1).reshape(t.shape[1], -1, *t.shape[3:])

        g, x = fold(g), fold(x)
        shape, groups = (n * shape[0], *shape[1:]), n * config["groups"]
    else:
        (g, _, _), (x, _, _) = _rows(g, spatial), _rows(x, spatial)
        groups = config["groups"]
    padding = config["padding"]
    if not _symmetric(padding):
        x, padding = F.pad(x, _pad_list(padding)), ((0, 0),) * spatial
    # Only the weight gradient is asked for: the weight's values are never read.
    weight = x.new_zeros(()).expand(shape)
    # Contiguous operands get the contiguous strides also on their size-1 dims: the
    # CPU's slow_conv2d (float64) reads the memory format off the input's strides and
    # took a length-1 sequence of a transposed view ([B, C, 1] with strides (C, 1, C))
    # for channels-last, then refused its own weight gradient ("slow_conv2d: grad_weight
    # must be contiguous").
    g, x = (t.reshape(-1).view(t.shape) if t.is_contiguous() else t for t in (g, x))
    _, grad_weight, _ = aten.convolution_backward(
        g, x, weight, None, list(config["stride"]), [left for left, _ in padding],
        list(config["dilation"]), config["transposed"], list(config["output_padding"]),
        groups, [False, True, False])
    return grad_weight.reshape(n, *weight_shape) if per_sample else grad_weight


def _per_sample_grad_chunk(g: torch.Tensor, x: torch.Tensor, config: dict) -> torch.Tensor:
    patches, multiplier, positions_major = _patch_matrices(g, x, config)
    if not positions_major:
        return torch.matmul(multiplier, patches.transpose(2, 3))  # [n, g, o, k]
    per_sample = torch.matmul(multiplier, patches)  # [n, g, o, (kernel offsets, c)]
    kernel = config["kernel"]
    per_sample = per_sample.unflatten(3, (*kernel, -1)).movedim(-1, 3)  # [n, g, o, c, *kernel]
    return per_sample.flatten(3)


def _ghost_sq_norm_chunk(g: torch.Tensor, x: torch.Tensor, config: dict) -> torch.Tensor:
    patches, multiplier, positions_major = _patch_matrices(g, x, config)
    if not positions_major:
        patches = patches.transpose(2, 3)  # [n, g, p, k]
    return gram_inner(multiplier.transpose(2, 3), patches).sum(1)


# Bytes of patches one chunk of samples may unfold at once: small enough to stay in
# cache between the copy and the matmul, and to keep the unfolded input out of the
# step's peak memory.
PATCH_CHUNK_BYTES = 4 << 20


def _by_chunks(fn, g: torch.Tensor, x: torch.Tensor, config: dict) -> torch.Tensor:
    """``fn`` over chunks of samples, written into one output; a chunk unfolds at most
    ``PATCH_CHUNK_BYTES`` of patches (at least one sample)."""
    n = g.shape[0]
    source = g if config["transposed"] else x
    spatial = len(config["kernel"])
    out_positions = (x if config["transposed"] else g).shape[-spatial:]
    rows = math.prod(source.shape[1:-spatial - 1])
    channels = source.shape[-spatial - 1]
    patch_bytes = rows * channels * math.prod(config["kernel"]) * math.prod(out_positions) * source.element_size()
    step = max(1, min(n, PATCH_CHUNK_BYTES // max(1, patch_bytes)))
    if step >= n:
        return fn(g, x, config)
    first = fn(g[:step], x[:step], config)
    out = first.new_empty((n, *first.shape[1:]))
    out[:step] = first
    for i in range(step, n, step):
        out[i:i + step] = fn(g[i:i + step], x[i:i + step], config)
    return out


def _config_of(kernel, stride, padding, dilation, groups, transposed, output_padding) -> dict:
    return {
        "kernel": tuple(kernel), "stride": tuple(stride),
        "padding": tuple(zip(padding[0::2], padding[1::2])), "dilation": tuple(dilation),
        "groups": groups, "transposed": transposed, "output_padding": tuple(output_padding),
    }


def _op_args(config: dict) -> tuple:
    padding = [p for pair in config["padding"] for p in pair]
    return (list(config["kernel"]), list(config["stride"]), padding, list(config["dilation"]),
            config["groups"], config["transposed"], list(config["output_padding"]))


# The per-sample contractions run as opaque ops: Inductor would otherwise fuse the
# patch gather of every layer into one early kernel (an index-heavy, unvectorised
# loop that also holds every layer's unfolded input at once); here each layer copies
# its patches in cache-sized chunks right before its batched matmul. The grouped
# convolution (the samples as groups) runs in here too, not in the graph: Inductor's
# convolution_backward lowering reads the n·groups groups as an int, which would pin the
# batch size (a recompile per size). They take any strides (``flexible_layout``):
# Inductor hands its buffers over as they are (channels-last ones included) instead of
# copying them to the strides seen when the backward was traced.
@torch.library.custom_op("fxdp::conv_weight_per_sample_grad", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def conv_weight_per_sample_grad(g: torch.Tensor, x: torch.Tensor, kernel: list[int], stride: list[int],
                                padding: list[int], dilation: list[int], groups: int, transposed: bool,
                                output_padding: list[int]) -> torch.Tensor:
    """``[n, g·o, c, *kernel]``-ordered per-sample weight gradients, flattened per group."""
    config = _config_of(kernel, stride, padding, dilation, groups, transposed, output_padding)
    weight_shape = _weight_shape(g, x, config)

    def grouped(g: torch.Tensor, x: torch.Tensor, config: dict) -> torch.Tensor:
        per_sample = _weight_grad_by_convolution(g, x, config, per_sample=True)
        return per_sample.reshape(g.shape[0], groups, weight_shape[0] // groups, math.prod(weight_shape[1:]))

    def by_grouped_convolution() -> torch.Tensor:
        return _by_chunks(grouped, g, x, config)

    def by_patches() -> torch.Tensor:
        return _by_chunks(_per_sample_grad_chunk, g, x, config).contiguous()

    if g.shape[0] == 0:
        return by_patches()
    if weight_shape[1] == 1:
        # One input channel per group (depthwise): the contraction would be a batch of
        # 1-row matmuls; the grouped convolution is one fast kernel.
        return by_grouped_convolution()
    # Which of the two is faster depends on the shapes and the machine by up to 3x either
    # way (on a 2-core CPU: [64, 32, 32, 32] -> 64 channels 4.1 ms grouped, 8.8 ms by
    # patches; [64, 3, 64, 64] -> 32 channels 8.0 ms against 3.7 ms).
    key = ("conv_weight_per_sample_grad", tuple(g.shape), g.stride(), tuple(x.shape), x.stride(), g.dtype,
           x.dtype, g.device, *map(tuple, (kernel, stride, padding, dilation, output_padding)), groups, transposed)
    return fastest_route(key, {"patches": by_patches, "grouped convolution": by_grouped_convolution}, g.device)


@conv_weight_per_sample_grad.register_fake
def _(g, x, kernel, stride, padding, dilation, groups, transposed, output_padding):
    spatial = len(kernel)
    source, multiplier = (g, x) if transposed else (x, g)
    k = source.shape[-spatial - 1] // groups * math.prod(kernel)
    o = multiplier.shape[-spatial - 1] // groups
    return g.new_empty((g.shape[0], groups, o, k))


@torch.library.custom_op("fxdp::conv_weight_ghost_sq_norm", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def conv_weight_ghost_sq_norm(g: torch.Tensor, x: torch.Tensor, kernel: list[int], stride: list[int],
                              padding: list[int], dilation: list[int], groups: int, transposed: bool,
                              output_padding: list[int]) -> torch.Tensor:
    """``[n]``, each sample's squared weight-gradient norm by Gram matrices."""
    config = _config_of(kernel, stride, padding, dilation, groups, transposed, output_padding)
    return _by_chunks(_ghost_sq_norm_chunk, g, x, config)


@conv_weight_ghost_sq_norm.register_fake
def _(g, x, kernel, stride, padding, dilation, groups, transposed, output_padding):
    return g.new_empty((g.shape[0],))


def _weight_per_sample_grad(g: torch.Tensor, x: torch.Tensor, **config) -> torch.Tensor:
    weight_shape = _weight_shape(g, x, config)
    per_sample = torch.ops.fxdp.conv_weight_per_sample_grad(g, x, *_op_args(config))
    return per_sample.reshape(per_sample.shape[0], *weight_shape)


def _weight_sum_grad(g: torch.Tensor, x: torch.Tensor, **config) -> torch.Tensor:
    return _weight_grad_by_convolution(g, x, config, per_sample=False)


def _weight_ghost_sq_norm(g: torch.Tensor, x: torch.Tensor, **config) -> torch.Tensor:
    return torch.ops.fxdp.conv_weight_ghost_sq_norm(g, x, *_op_args(config))


def _weight_costs(shapes, **config) -> dict[str, float]:
    """Flops of the two routes from the operand shapes (``[n, (R,) C, *sp]``)."""
    g_shape, x_shape = ([hint(s) for s in shape] for shape in shapes)
    spatial = len(config["kernel"])
    groups = config["groups"]
    rows = g_shape[1] if len(g_shape) == spatial + 3 else 1
    n = g_shape[0]
    c_out, c_in = g_shape[-spatial - 1], x_shape[-spatial - 1]
    if config["transposed"]:
        positions = rows * math.prod(x_shape[-spatial:])
        k, o = c_out // groups * math.prod(config["kernel"]), c_in // groups
    else:
        positions = rows * math.prod(g_shape[-spatial:])
        k, o = c_in // groups * math.prod(config["kernel"]), c_out // groups
    p = positions
    ghost = gram_cost(n * groups, p, k, o)
    instantiate = (contraction_cost("ngpo,ngpk->ngok", (n, groups, p, o), (n, groups, p, k))
                   + contraction_cost("ngok,ngok->n", (n, groups, o, k), (n, groups, o, k)))
    return {"ghost": ghost, "instantiate": instantiate}


conv_weight = ParamRule(
    name="conv.weight",
    operands=(GRAD, 0),
    per_sample_grad=_weight_per_sample_grad,
    sum_grad=_weight_sum_grad,
    ghost_sq_norm=_weight_ghost_sq_norm,
    costs=_weight_costs,
)


# ---------------------------------------------------------------------------
# Bias: ∂b_n = Σ over the sample's rows and output positions of the output gradient
# ---------------------------------------------------------------------------


def _channel_dim(g: torch.Tensor, config: dict) -> int:
    return g.dim() - len(config["kernel"]) - 1


def _bias_per_sample_grad(g: torch.Tensor, **config) -> torch.Tensor:
    channel = _channel_dim(g, config)
    return g.sum([d for d in range(1, g.dim()) if d != channel])


def _bias_sum_grad(g: torch.Tensor, **config) -> torch.Tensor:
    channel = _channel_dim(g, config)
    return g.sum([d for d in range(g.dim()) if d != channel])


conv_bias = ParamRule(
    name="conv.bias",
    operands=(GRAD,),
    per_sample_grad=_bias_per_sample_grad,
    sum_grad=_bias_sum_grad,
)


# ---------------------------------------------------------------------------
# The ops
# ---------------------------------------------------------------------------


def _oneDNN_prefers_channels_last(x: torch.Tensor) -> bool:
    """oneDNN's 2-D input gradient is several times faster channels-last on a CPU
    (a stride-2 3×3 layer: 4 ms against 15 ms), which the non-private compiled step
    gets from Inductor's layout optimisation."""
    return x.device.type == "cpu" and x.dim() == 4 and x.dtype in (torch.float32, torch.bfloat16)


def _channels_last_for_input_grad(grad_out: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The output gradient and input of an input-gradient-only ``convolution_backward``
    in channels-last.

    The input's values are not read for the input gradient, only its shape and memory
    format, so ``x`` is not copied: a contiguous ``x`` stands in for itself viewed with
    channels-last strides (its values scrambled, its storage reused: nothing is
    allocated), any other layout by an uninitialised channels-last tensor. The
    gradient comes out channels-last; where ``x`` was contiguous it is written back to
    channels-first (``conv_input_grad_channels_first``).
    """
    cl = torch.channels_last
    if x.is_contiguous(memory_format=cl):
        stand_in = x
    elif x.is_contiguous():
        n, c, h, w = x.shape
        stand_in = x.as_strided(x.shape, (c * h * w, 1, w * c, c))
    else:
        stand_in = x.new_empty((x.shape[0], *x.shape[2:], x.shape[1])).permute(0, 3, 1, 2)
    return grad_out.contiguous(memory_format=cl), stand_in


# Bytes of input gradient one chunk of samples computes channels-last before it is
# copied into the channels-first result: the two layouts then coexist for one chunk,
# not for the whole gradient (on the benchmark CNN that was the step's peak memory).
INPUT_GRAD_CHUNK_BYTES = 1 << 20


@torch.library.custom_op("fxdp::conv_input_grad_channels_first", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def conv_input_grad_channels_first(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                   stride: list[int], padding: list[int], dilation: list[int],
                                   transposed: bool, output_padding: list[int], groups: int) -> torch.Tensor:
    """The input gradient of a 2-D convolution with a contiguous ``x``, computed
    channels-last by oneDNN in chunks of samples and written into a contiguous result.

    Opaque on purpose: Inductor would otherwise fold the layout change into the kernels
    that read the gradient (a group norm's backward and per-sample reductions), which
    then gather every element across the channels-last layout, several times slower
    than the copy (a GroupNorm backward on ``[64, 32, 32, 32]``: 2.1 ms contiguous,
    9.7 ms reading a channels-last gradient, against 1.5 ms for the copy). The input
    gradient of a sample depends on that sample's output gradient only, so chunks of
    samples give exactly the whole gradient.
    """
    out = x.new_empty(x.shape)
    n = x.shape[0]
    step = max(1, min(n, INPUT_GRAD_CHUNK_BYTES // max(1, x[0].numel() * x.element_size())))
    weight = weight.contiguous(memory_format=torch.channels_last)
    for i in range(0, n, step):
        g_chunk, stand_in = _channels_last_for_input_grad(grad_out[i:i + step], x[i:i + step])
        grad, _, _ = aten.convolution_backward(
            g_chunk, stand_in, weight, None, stride, padding, dilation, transposed, output_padding,
            groups, [True, False, False])
        out[i:i + step] = grad
        del grad  # before the next chunk's
    return out


@conv_input_grad_channels_first.register_fake
def _(grad_out, x, weight, stride, padding, dilation, transposed, output_padding, groups):
    return x.new_empty(x.shape)


def _make_input_grad(parse):
    def input_grad(args, grad_out, index):
        config = parse(args)
        x, weight, bias = args[0], args[1], args[2] if len(args) > 2 else None
        spatial = len(config["kernel"])
        unbatched = x.dim() == spatial + 1
        if unbatched:
            x, grad_out = x.unsqueeze(0), grad_out.unsqueeze(0)
        padding = config["padding"]
        x_padded = x
        if not _symmetric(padding):
            x_padded, padding = F.pad(x, _pad_list(padding)), ((0, 0),) * spatial
        stride, dilation = list(config["stride"]), list(config["dilation"])
        pad_left = [left for left, _ in padding]
        transposed, output_padding = config["transposed"], list(config["output_padding"])
        channels_last = index == 0 and _oneDNN_prefers_channels_last(x_padded)
        if index == 0:
            if channels_last and x.is_contiguous():
                # Channels-last for oneDNN, back to the layout of the activations around it.
                grad = torch.ops.fxdp.conv_input_grad_channels_first(
                    grad_out, x_padded, weight, stride, pad_left, dilation, transposed, output_padding,
                    config["groups"])
            else:
                x_operand = x_padded
                if channels_last:
                    grad_out, x_operand = _channels_last_for_input_grad(grad_out, x_padded)
                    weight = weight.contiguous(memory_format=torch.channels_last)
                grad = aten.convolution_backward(
                    grad_out, x_operand, weight, None, stride, pad_left, dilation, transposed,
                    output_padding, config["groups"], [True, False, False])[0]
            if x_padded is not x:
                for i, (left, _) in enumerate(config["padding"]):
                    grad = grad.narrow(2 + i, left, x.shape[2 + i])
            if unbatched:
                grad = grad.squeeze(0)
            return grad
        mask = [False, index == 1, index == 2]
        return aten.convolution_backward(
            grad_out, x_padded, weight, None if bias is None else list(bias.shape), stride, pad_left,
            dilation, transposed, output_padding, config["groups"], mask)[index]

    return input_grad


def _samples_as_groups(args_batch, args_meta, config) -> BatchDim | None:
    """StyleGAN2's modulated convolution: each sample's own weights, the batch folded
    into the channels and the groups, ``conv2d(x.reshape(1, B·C, H, W), w.reshape(B·E,
    C, k, k), groups=B)``. Every group lies within one sample when ``groups`` is a
    multiple of ``B`` and the input's and weight's batched rows are whole samples: the
    output's channels are then ``B`` blocks, sample by sample. Its upsampling form,
    ``conv_transpose2d`` with ``groups=B`` and the weight ``[B·C, E, k, k]``, too."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    x_batch, w_batch = args_batch[0], args_batch[1]
    b_batch = args_batch[2] if len(args_batch) > 2 else None
    if not (isinstance(x_batch, BatchDim) and x_batch.dim == 1 and isinstance(w_batch, BatchDim)
            and w_batch.dim == 0 and statically_known_true(x_batch.outer == 1)
            and statically_known_true(w_batch.outer == 1)):
        return None
    if b_batch is not None and not (isinstance(b_batch, BatchDim) and b_batch.dim == 0
                                    and b_batch.same_as(w_batch)):
        return None
    samples, groups, weight = args_meta[0].shape[1] // x_batch.inner, config["groups"], args_meta[1]
    if not (statically_known_true(groups % samples == 0)
            and statically_known_true(weight.shape[0] == samples * w_batch.inner)):
        return None
    if config["transposed"]:  # the weight's rows are input channels: [B·C, E/groups, k, k]
        if b_batch is not None or not statically_known_true(w_batch.inner == x_batch.inner):
            return None
        return BatchDim(1, inner=groups // samples * weight.shape[1])
    return BatchDim(1, inner=w_batch.inner)


def _batch_rule(args_batch, args_meta, out_meta, config):
    grouped = _samples_as_groups(args_batch, args_meta, config)
    if grouped is not None:
        return grouped
    for i, what in ((1, "weight"), (2, "bias")):
        b = args_batch[i] if len(args_batch) > i else None
        if isinstance(b, BatchDim) and b.dim is not None:
            raise ValueError(f"the convolution's {what} is batched (each sample would need its own)")
    x_batch = args_batch[0]
    if x_batch is None or x_batch.dim is None:
        return x_batch
    if args_meta[0].dim() != len(config["kernel"]) + 2:
        raise ValueError("an unbatched convolution input [C, *spatial] holds the batch in a channel "
                         "or spatial dim, which the convolution mixes")
    if x_batch.dim != 0:
        raise ValueError("the batch is a channel or spatial dim of the convolution, which it mixes; "
                         "it must be dim 0 ([N, C, *spatial])")
    return x_batch


def _check(args_batch, args_meta, index):
    if args_batch[0] is None:
        return (
            "the input of this convolution has no batch dim, so its parameter gradient is "
            "shared by all samples; give the input a batch dim (expand it) or freeze it"
        )
    if args_batch[index] is not None:
        return f"the {'weight' if index == 1 else 'bias'} itself is batched"
    return None


def _register_conv(op, layout: str) -> OpRule:
    def parse(args):
        return conv_config(args, layout=layout)

    return register_rule(OpRule(
        op=op,
        params={1: conv_weight, 2: conv_bias},
        input_grad=_make_input_grad(parse),
        batch_rule=_batch_rule,
        config=parse,
        check=_check,
    ))


CONV_RULES: dict[Any, OpRule] = {
    op: _register_conv(op, layout)
    for op, layout in [
        (aten.conv1d.default, "conv"), (aten.conv2d.default, "conv"), (aten.conv3d.default, "conv"),
        (aten.conv1d.padding, "conv"), (aten.conv2d.padding, "conv"), (aten.conv3d.padding, "conv"),
        (aten.conv_transpose1d.default, "transpose"), (aten.conv_transpose2d.input, "transpose"),
        (aten.conv_transpose3d.input, "transpose"), (aten.convolution.default, "convolution"),
    ]
}


MODULE_OPS = {
    torch.nn.Conv1d: (aten.conv1d.default, aten.conv1d.padding),
    torch.nn.Conv2d: (aten.conv2d.default, aten.conv2d.padding),
    torch.nn.Conv3d: (aten.conv3d.default, aten.conv3d.padding),
    torch.nn.ConvTranspose1d: (aten.conv_transpose1d.default,),
    torch.nn.ConvTranspose2d: (aten.conv_transpose2d.input,),
    torch.nn.ConvTranspose3d: (aten.conv_transpose3d.input,),
}
