"""Models and batches shared by the benchmarks, tests and examples.

Each model is the plain PyTorch a user would write; nothing here knows about fxdp or
Opacus. ``CASES`` pairs every model with the batch it is benchmarked on, so that a
benchmark, a test and an example that name the same case run the same workload:

========  ==============================================  =============================
case      model                                           batch
========  ==============================================  =============================
``mlp``   ``MLP``: 512-1024-1024-10, ReLU                 ``x [256, 512]``, 10 classes
``seq``   ``ResidualMLPStack``: Linear-only blocks over   ``x [16, 128, 256]``,
          a sequence, d=256, hidden 4d, 4 blocks,         10 classes
          mean-pool
``cnn``   ``SmallCNN``: 3 x (conv3x3 stride 2 +           ``x [64, 3, 64, 64]``,
          GroupNorm + ReLU), global average pool          10 classes
``gpt``   ``TinyGPT``: nanoGPT-style, d=256, 4 layers,    ``idx [16, 128]`` tokens,
          4 heads, vocab 4096, tied ``wte``/``lm_head``   next tokens ``[16, 128]``
``gpt_    the same ``TinyGPT`` written the way Opacus      as ``gpt``
untied``  ghost clipping accepts it: untied head,
          positions looked up per sample
``moe``   ``SortedMoEStack``: residual top-2 mixtures     ``x [16, 128, 256]``,
          of 8 experts (hidden 512) run as Hugging        10 classes
          Face's grouped_mm experts, 4 blocks, mean-pool
``moe_    the same experts run in a loop over them, each  as ``moe``
loop``    on the tokens ``torch.where`` finds
========  ==============================================  =============================

``gpt_untied`` exists for the comparison with Opacus, which cannot run ``gpt`` (ghost
clipping refuses tied parameters, and its hooks take ``wpe(arange(T))``'s positions for
samples); it has ``V d`` more parameters and the same compute otherwise.

Every case is trained with cross entropy, averaged over the batch (and over the
tokens for ``gpt``; a sample's own loss is then the mean over its tokens), see
``cross_entropy``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "CASES",
    "MLP",
    "BenchmarkCase",
    "ResidualMLPStack",
    "SmallCNN",
    "TinyGPT",
    "SortedMoEStack",
    "cross_entropy",
]


class MLP(nn.Module):
    """A ReLU multilayer perceptron: ``in_features -> *hidden -> num_classes``.

    Args:
        in_features: Width of the input.
        hidden: Widths of the hidden layers.
        num_classes: Number of output logits.
    """

    def __init__(
        self,
        in_features: int = 512,
        hidden: tuple[int, ...] = (1024, 1024),
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        widths = (in_features, *hidden)
        layers: list[nn.Module] = []
        for width_in, width_out in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(width_in, width_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps ``x [B, in_features]`` to logits ``[B, num_classes]``."""
        return self.layers(x)


class _ResidualMLPBlock(nn.Module):
    """``x + W2(gelu(W1 x))`` applied to every position of a sequence."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(d, hidden)
        self.fc_out = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_out(F.gelu(self.fc_in(x)))


class ResidualMLPStack(nn.Module):
    """A transformer-style stack of Linear layers over sequences, without attention.

    Only Linear layers carry parameters (no normalisation), so every parameter is used
    at all ``T`` positions: the case where ghost norms of sequence Linears matter.

    Args:
        d: Model width.
        hidden: Width inside each block (4d in a transformer).
        blocks: Number of residual blocks.
        num_classes: Number of output logits of the head on the mean-pooled sequence.
    """

    def __init__(
        self, d: int = 256, hidden: int = 1024, blocks: int = 4, num_classes: int = 10
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ResidualMLPBlock(d, hidden) for _ in range(blocks))
        self.head = nn.Linear(d, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps ``x [B, T, d]`` to logits ``[B, num_classes]``."""
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


class SmallCNN(nn.Module):
    """Three conv3x3 blocks with GroupNorm (not BatchNorm, which mixes samples).

    Each block halves the resolution with a stride-2 convolution, so a 64x64 image
    ends at 8x8 before the global average pool and the linear head.

    Args:
        channels: Output channels of the three blocks.
        groups: GroupNorm groups in every block.
        num_classes: Number of output logits.
    """

    def __init__(
        self,
        channels: tuple[int, ...] = (32, 64, 128),
        groups: int = 8,
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels_in = 3
        for channels_out in channels:
            layers += [
                nn.Conv2d(channels_in, channels_out, 3, stride=2, padding=1),
                nn.GroupNorm(groups, channels_out),
                nn.ReLU(),
            ]
            channels_in = channels_out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps images ``x [B, 3, H, W]`` to logits ``[B, num_classes]``."""
        return self.head(self.features(x).mean(dim=(2, 3)))


class _CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        # [B, T, d] -> [B, heads, T, d / heads], the layout SDPA expects.
        q, k, v = (
            t.view(batch, length, self.heads, d // self.heads).transpose(1, 2)
            for t in (q, k, v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(batch, length, d))


class _GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = _CausalSelfAttention(d, heads)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """A nanoGPT-style decoder: learned positions, pre-LayerNorm blocks, tied head.

    ``lm_head.weight`` *is* ``wte.weight`` (one parameter used twice), and the causal
    mask comes from ``is_causal=True`` rather than a buffer, as in nanoGPT.

    Args:
        vocab_size: Number of tokens.
        block_size: Longest sequence (rows of the position embedding).
        d: Model width.
        layers: Number of transformer blocks.
        heads: Attention heads per block.
        tied: Whether ``lm_head.weight`` is ``wte.weight`` (nanoGPT) or its own
            parameter.
        batched_positions: Look positions up as ``[B, T]`` indices
            (``arange(T).repeat(B, 1)``) rather than nanoGPT's ``wpe(arange(T))``
            broadcast over the batch. Same values; only what a hook-based library sees
            differs.
    """

    def __init__(
        self,
        vocab_size: int = 4096,
        block_size: int = 128,
        d: int = 256,
        layers: int = 4,
        heads: int = 4,
        tied: bool = True,
        batched_positions: bool = False,
    ) -> None:
        super().__init__()
        self.batched_positions = batched_positions
        self.wte = nn.Embedding(vocab_size, d)
        self.wpe = nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList(_GPTBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab_size, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight
        # nanoGPT's initialisation; the default N(0, 1) embedding makes the tied head's
        # logits, and so the first losses, needlessly large.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            nn.init.normal_(block.c_proj.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Maps token ids ``idx [B, T]`` to next-token logits ``[B, T, vocab_size]``."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        if self.batched_positions:
            positions = positions.unsqueeze(0).repeat(idx.shape[0], 1)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@torch.library.custom_op("fxdp_benchmarks::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``offs[e - 1]:offs[e]`` of ``x`` times ``w[e]``, a matmul per group: Hugging
    Face's ``grouped_mm_fallback``, which its MoE models run on a CPU under
    ``torch.compile`` (``torch._grouped_mm`` compiles in bfloat16 only)."""
    out = x.new_zeros(x.shape[0], w.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[e]
        start = end
    return out


@grouped_mm.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("fxdp_benchmarks::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                        grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x, grad_w = torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for e, end in enumerate(offs.tolist()):
        grad_x[start:end] = grad[start:end] @ w[e].T
        grad_w[e] = x[start:end].T @ grad[start:end]
        start = end
    return grad_x, grad_w


@grouped_mm_backward.register_fake
def _(x, w, offs, grad):
    return torch.empty_like(x), torch.empty_like(w)


def _grouped_mm_grads(ctx, grad):
    return (*grouped_mm_backward(*ctx.saved_tensors, grad), None)


grouped_mm.register_autograd(_grouped_mm_grads, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


class _SortedMoE(nn.Module):
    """Top-k experts as Hugging Face's default ``grouped_mm`` experts run them: the
    batch's tokens sorted by expert, a grouped matmul per projection, the rows put back
    by the sort's inverse and summed over the k choices."""

    def __init__(self, d: int, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.gate_up = nn.Parameter(torch.randn(experts, d, 2 * hidden) / math.sqrt(d))
        self.down = nn.Parameter(torch.randn(experts, hidden, d) / math.sqrt(hidden))
        self.experts, self.top_k = experts, top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(h).softmax(-1).topk(self.top_k)
        keys, order = chosen.reshape(-1).sort()
        rows = h[order // self.top_k]
        offsets = torch.histc(keys.float(), bins=self.experts, min=0, max=self.experts - 1)
        offsets = offsets.cumsum(0, dtype=torch.int32)
        gate, up = grouped_mm(rows, self.gate_up, offsets).chunk(2, dim=-1)
        out = grouped_mm(F.silu(gate) * up, self.down, offsets)
        out = out * (weights / weights.sum(-1, keepdim=True)).reshape(-1)[order].unsqueeze(-1)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.shape[0], device=order.device)
        return out[inverse].view(h.shape[0], self.top_k, -1).sum(1).view(x.shape)


class _LoopedMoE(_SortedMoE):
    """The same experts run in a loop, each on the tokens routed to it, as transformers'
    eager experts (over ``range(E)``) and DeepSeek-V3's reference code do:
    ``torch.where`` of the expert's column of the one-hot routing, ``index_add_`` back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(h).softmax(-1).topk(self.top_k)
        weights = weights / weights.sum(-1, keepdim=True)
        expert_mask = F.one_hot(chosen, num_classes=self.experts).permute(2, 1, 0)
        out = torch.zeros_like(h)
        for e in range(self.experts):
            slot, token = torch.where(expert_mask[e])
            gate, up = (h[token] @ self.gate_up[e]).chunk(2, dim=-1)
            out.index_add_(0, token, (F.silu(gate) * up) @ self.down[e] * weights[token, slot, None])
        return out.view(x.shape)


class SortedMoEStack(nn.Module):
    """Residual pre-norm mixture-of-experts blocks over a sequence, mean-pooled to a
    linear head: ``ResidualMLPStack`` with each MLP a mixture of experts.

    Args:
        d: Model width.
        hidden: Width inside each expert.
        experts: Experts per block.
        top_k: Experts each token is routed to.
        blocks: Number of residual blocks.
        num_classes: Number of output logits.
        looped: Run the experts in a loop over them (``_LoopedMoE``), not sorted.
    """

    def __init__(self, d: int = 256, hidden: int = 512, experts: int = 8, top_k: int = 2, blocks: int = 4,
                 num_classes: int = 10, looped: bool = False) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(blocks))
        moe = _LoopedMoE if looped else _SortedMoE
        self.blocks = nn.ModuleList(moe(d, hidden, experts, top_k) for _ in range(blocks))
        self.head = nn.Linear(d, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps ``x [B, T, d]`` to logits ``[B, num_classes]``."""
        for norm, block in zip(self.norms, self.blocks):
            x = x + block(norm(x))
        return self.head(x.mean(dim=1))


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over the batch, and over the tokens for ``[B, T, V]`` logits.

    Args:
        logits: ``[B, C]`` class logits or ``[B, T, V]`` token logits.
        target: ``[B]`` classes or ``[B, T]`` tokens.

    Returns:
        The scalar loss.
    """
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


@dataclasses.dataclass(frozen=True)
class BenchmarkCase:
    """A model and the batch it is benchmarked on.

    Attributes:
        name: Short name used on command lines (``mlp``, ``seq``, ``cnn``, ``gpt``).
        description: One line for tables.
        build: Returns a freshly initialised model (seed it for reproducibility).
        make_batch: ``(generator) -> (input, target)`` for one batch.
        batch_size: ``B``, the number of samples in a batch.
        per_token: Whether the model returns one prediction per token (``[B, T, V]``).
    """

    name: str
    description: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    batch_size: int
    per_token: bool = False


def _classification_batch(
    shape: tuple[int, ...], num_classes: int = 10
) -> Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    def make_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(shape, generator=generator)
        y = torch.randint(0, num_classes, (shape[0],), generator=generator)
        return x, y

    return make_batch


def _token_batch(
    batch: int, length: int, vocab_size: int
) -> Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    def make_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        # One stream of length T + 1 per sample: the target is the input shifted by one.
        tokens = torch.randint(0, vocab_size, (batch, length + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return make_batch


CASES: dict[str, BenchmarkCase] = {
    case.name: case
    for case in (
        BenchmarkCase(
            name="mlp",
            description="MLP 512-1024-1024-10, B=256",
            build=MLP,
            make_batch=_classification_batch((256, 512)),
            batch_size=256,
        ),
        BenchmarkCase(
            name="seq",
            description="residual Linear stack d=256 h=1024 x4, B=16 T=128",
            build=ResidualMLPStack,
            make_batch=_classification_batch((16, 128, 256)),
            batch_size=16,
        ),
        BenchmarkCase(
            name="cnn",
            description="CNN 3x(conv3x3/2+GN+ReLU), 64x64 RGB, B=64",
            build=SmallCNN,
            make_batch=_classification_batch((64, 3, 64, 64)),
            batch_size=64,
        ),
        BenchmarkCase(
            name="gpt",
            description="nanoGPT d=256 L=4 V=4096 tied, B=16 T=128",
            build=TinyGPT,
            make_batch=_token_batch(16, 128, 4096),
            batch_size=16,
            per_token=True,
        ),
        BenchmarkCase(
            name="gpt_untied",
            description="nanoGPT as gpt, untied head, [B, T] positions (for Opacus)",
            build=lambda: TinyGPT(tied=False, batched_positions=True),
            make_batch=_token_batch(16, 128, 4096),
            batch_size=16,
            per_token=True,
        ),
        BenchmarkCase(
            name="moe",
            description="top-2 of 8 experts d=256 h=512 sorted (grouped_mm) x4, B=16 T=128",
            build=SortedMoEStack,
            make_batch=_classification_batch((16, 128, 256)),
            batch_size=16,
        ),
        BenchmarkCase(
            name="moe_loop",
            description="the moe experts run in a loop over them (torch.where + index_add_), B=16 T=128",
            build=lambda: SortedMoEStack(looped=True),
            make_batch=_classification_batch((16, 128, 256)),
            batch_size=16,
        ),
    )
}
