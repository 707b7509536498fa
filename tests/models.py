"""Models written as ordinary PyTorch, shared by the end-to-end tests.

Nothing here knows about fxdp: each model is what a user would write (or what a
library such as nanoGPT, timm or peft writes), small enough for the microbatch
reference to run in milliseconds. Sizes are chosen distinct from the batch sizes the
tests use so that a batch/feature mix-up shows.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint_utils
from torch import nn
from torch.nn.utils import parametrize

__all__ = [
    "BasicBlock", "ResNetCNN",
    "GPTBlock", "GPT", "GPTWithLoss",
    "RNNClassifier", "PackedLSTM", "PaddedLSTM",
    "ViTBlock", "ViT", "Attention",
    "LoRALinear", "add_lora",
    "TransposedWeight", "PackedChunk", "PackedSlice", "WeightNormLinear", "Symmetric",
    "CustomParametrized", "SpectralNormDiscriminator", "DiffusionUNet", "TiedTranspose", "LayerScaleBias",
    "FirstOutput", "SequenceFirstBias",
    "VmapPerSample", "VmapOverPositions", "VmapMask", "VmapSegmentMask", "ScanRecurrence", "VmapEnsemble",
    "EnergyForces", "VmapJacobian", "CheckpointedVmap", "PerSampleLoop", "SortedExperts", "loop_grouped_mm",
    "LoopedExperts",
]


# -- 1. ResNet-style CNN ----------------------------------------------------------------

class BasicBlock(nn.Module):
    """torchvision's BasicBlock with GroupNorm: conv3x3-GN-ReLU-conv3x3-GN, residual add."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1, groups: int = 2):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(groups, c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(groups, c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                            nn.GroupNorm(groups, c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.gn1(self.conv1(x)))
        out = self.gn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNetCNN(nn.Module):
    """Stem conv3x3 (with bias) + GroupNorm + in-place ReLU, two residual blocks (the
    second downsamples with a 1x1 shortcut), global average pool, Linear head."""

    def __init__(self, c_in: int = 3, width: int = 4, classes: int = 3):
        super().__init__()
        self.conv = nn.Conv2d(c_in, width, 3, padding=1)
        self.gn = nn.GroupNorm(2, width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.gn(self.conv(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.pool(x), 1))


# -- 2. nanoGPT -------------------------------------------------------------------------

class GPTBlock(nn.Module):
    """nanoGPT's block: pre-LN, causal SDPA over a fused qkv projection, GELU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)
        self.heads = heads

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    """nanoGPT: ``wte(idx) + wpe(arange(T))``, blocks, final LayerNorm, lm_head tied to wte.

    Args:
        checkpoint: Run every block under ``torch.utils.checkpoint`` (non-reentrant).
    """

    def __init__(self, vocab: int = 11, block_size: int = 6, d: int = 8, layers: int = 2, heads: int = 2,
                 checkpoint: bool = False):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block_size, d)
        self.h = nn.ModuleList([GPTBlock(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as nanoGPT does
        self.checkpoint = checkpoint

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = checkpoint_utils.checkpoint(block, x, use_reentrant=False) if self.checkpoint else block(x)
        return self.lm_head(self.ln_f(x))


class GPTWithLoss(nn.Module):
    """The loss inside the graph: ``forward(idx, targets)`` returns the token cross-entropy."""

    def __init__(self, gpt: GPT, reduction: str = "mean"):
        super().__init__()
        self.gpt = gpt
        self.reduction = reduction

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(idx)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction=self.reduction)


# -- 3. Recurrent networks --------------------------------------------------------------

class RNNClassifier(nn.Module):
    """``nn.LSTM``/``nn.GRU``/``nn.RNN`` over the sequence, Linear head on the last step.

    The output is ``[B, classes]`` whatever ``batch_first`` is. With ``learned_state``
    the layers start from trainable states ``h0`` (and ``c0``) ``[layers, 1, H]``
    broadcast to the batch as models write it: ``h0.expand(-1, B, -1).contiguous()``
    for an LSTM, ``h0.repeat(1, B, 1)`` otherwise.
    """

    def __init__(self, cell: str = "lstm", d_in: int = 4, hidden: int = 6, classes: int = 3,
                 num_layers: int = 1, bidirectional: bool = False, batch_first: bool = True,
                 learned_state: bool = False):
        super().__init__()
        rnn = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[cell]
        self.rnn = rnn(d_in, hidden, num_layers=num_layers, bidirectional=bidirectional,
                       batch_first=batch_first)
        self.fc = nn.Linear(hidden * (2 if bidirectional else 1), classes)
        self.batch_first = batch_first
        self.state = None
        if learned_state:
            states = 2 if cell == "lstm" else 1
            layers = num_layers * (2 if bidirectional else 1)
            self.state = nn.ParameterList(nn.Parameter(torch.randn(layers, 1, hidden)) for _ in range(states))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.state is None:
            out, _ = self.rnn(x)
        else:
            n = x.shape[0 if self.batch_first else 1]
            if isinstance(self.rnn, nn.LSTM):
                state = tuple(s.expand(-1, n, -1).contiguous() for s in self.state)
            else:
                state = self.state[0].repeat(1, n, 1)
            out, _ = self.rnn(x, state)
        last = out[:, -1] if self.batch_first else out[-1]
        return self.fc(last)


class CellDecoder(nn.Module):
    """Recurrent cells stepped by hand (seq2seq decoders): two stacked ``nn.LSTMCell``,
    ``GRUCell`` or ``RNNCell``, called without a state on the first step (the cell builds
    ``zeros(B, H)`` itself), or with ``learned_state`` the second one from a trainable
    ``h0 [1, H]`` as ``h0.expand(B, -1)``."""

    def __init__(self, kind: str, input_size: int = 4, hidden: int = 5, learned_state: bool = False):
        super().__init__()
        cell = {"lstm": nn.LSTMCell, "gru": nn.GRUCell, "rnn": nn.RNNCell}[kind]
        self.kind = kind
        self.first = cell(input_size, hidden)
        self.second = cell(hidden, hidden)
        self.head = nn.Linear(hidden, 3)
        self.h0 = nn.Parameter(torch.randn(1, hidden)) if learned_state else None

    def forward(self, x):
        h1 = h2 = None
        if self.h0 is not None:
            h0 = self.h0.expand(x.shape[0], -1)
            h2 = (h0, h0) if self.kind == "lstm" else h0
        for t in range(x.shape[1]):
            h1 = self.first(x[:, t], h1)
            h2 = self.second(h1[0] if self.kind == "lstm" else h1, h2)
        return self.head(h2[0] if self.kind == "lstm" else h2)


class BilinearHead(nn.Module):
    """``nn.Bilinear`` between two views of each sample (ATen's ``_trilinear``)."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(4, 4)
        self.bilinear = nn.Bilinear(4, 3, 2)

    def forward(self, x):
        h = torch.tanh(self.encoder(x))
        return self.bilinear(h[:, 0], h[:, 1, :3])


class PackedLSTM(nn.Module):
    """The textbook variable-length LSTM: pack, run, unpack, read each sample's last step."""

    def __init__(self, d_in: int = 4, hidden: int = 6, classes: int = 3):
        super().__init__()
        self.rnn = nn.LSTM(d_in, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.rnn(packed)
        return self.fc(h[-1])


class PaddedLSTM(PackedLSTM):
    """``PackedLSTM`` without packing: run over the padded batch and read each sample's
    last real step through a one-hot ``[B, T]`` mask. Same parameters, same outputs."""

    def forward(self, x: torch.Tensor, last_step: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.fc((out * last_step.unsqueeze(-1)).sum(1))


# -- 4. ViT and nn.MultiheadAttention ---------------------------------------------------

class ViTBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """timm-style ViT: patch embedding, cls token ``[1, 1, d]`` expanded and concatenated,
    learned position table ``[1, N + 1, d]`` added, MultiheadAttention blocks, head on cls.

    Args:
        patch_embed: "conv" (``Conv2d(stride=patch)``) or "linear" (a Linear on patches
            cut out with view/permute, as ``einops.rearrange`` does).
    """

    def __init__(self, patch_embed: str = "conv", image: int = 12, patch: int = 4, c_in: int = 3,
                 d: int = 8, heads: int = 2, depth: int = 2, classes: int = 3):
        super().__init__()
        self.patch, self.patch_embed_kind = patch, patch_embed
        n = (image // patch) ** 2
        if patch_embed == "conv":
            self.patch_embed = nn.Conv2d(c_in, d, patch, stride=patch)
        else:
            self.patch_embed = nn.Linear(c_in * patch * patch, d)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d))
        self.pos_embed = nn.Parameter(torch.randn(1, n + 1, d))
        self.blocks = nn.ModuleList([ViTBlock(d, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def patches(self, x: torch.Tensor) -> torch.Tensor:
        if self.patch_embed_kind == "conv":
            return self.patch_embed(x).flatten(2).transpose(1, 2)
        B, C, H, W = x.shape
        p = self.patch
        x = x.view(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
        return self.patch_embed(x.reshape(B, (H // p) * (W // p), C * p * p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patches(x)
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)
        tokens = torch.cat([cls, tokens], dim=1) + self.pos_embed
        for block in self.blocks:
            tokens = block(tokens)
        return self.head(self.norm(tokens)[:, 0])


class Attention(nn.Module):
    """One ``nn.MultiheadAttention`` called as ``attn(query, key, value)``; key and value
    default to the query (self-attention)."""

    def __init__(self, d: int = 8, heads: int = 2, **kwargs):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, **kwargs)

    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None) -> torch.Tensor:
        key = query if key is None else key
        value = key if value is None else value
        return self.attn(query, key, value, need_weights=False)[0]


# -- 5. LoRA as peft writes it ----------------------------------------------------------

class LoRALinear(nn.Module):
    """``peft.tuners.lora.Linear``'s structure: a frozen ``base_layer``, adapters in
    ``ModuleDict``s keyed by adapter name, ``lora_dropout``, ``scaling``."""

    def __init__(self, base_layer: nn.Linear, r: int = 2, lora_alpha: int = 4, lora_dropout: float = 0.0,
                 adapter: str = "default"):
        super().__init__()
        self.base_layer = base_layer
        for p in base_layer.parameters():
            p.requires_grad_(False)
        self.lora_dropout = nn.ModuleDict({adapter: nn.Dropout(lora_dropout)})
        self.lora_A = nn.ModuleDict({adapter: nn.Linear(base_layer.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({adapter: nn.Linear(r, base_layer.out_features, bias=False)})
        self.scaling = {adapter: lora_alpha / r}
        self.active_adapter = adapter
        nn.init.kaiming_uniform_(self.lora_A[adapter].weight, a=math.sqrt(5))
        # peft starts lora_B at zero; a trained adapter is not, and zero would hide
        # every gradient of lora_A.
        nn.init.normal_(self.lora_B[adapter].weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.active_adapter
        result = self.base_layer(x)
        return result + self.lora_B[a](self.lora_A[a](self.lora_dropout[a](x))) * self.scaling[a]


def add_lora(model: nn.Module, targets: tuple[str, ...], r: int = 2) -> nn.Module:
    """Freeze ``model`` and wrap every ``nn.Linear`` whose name ends with a target, as
    ``peft.get_peft_model`` does: afterwards only the adapters are trainable."""
    for p in model.parameters():
        p.requires_grad_(False)
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child_name in targets:
                setattr(module, child_name, LoRALinear(child, r=r))
    return model


# -- 7. Parameters transformed before use -----------------------------------------------

class TransposedWeight(nn.Module):
    """A weight stored ``[in, out]`` and used as ``F.linear(x, W.t())``."""

    def __init__(self, d_in: int = 4, d_hidden: int = 6, d_out: int = 2):
        super().__init__()
        self.W = nn.Parameter(torch.randn(d_in, d_hidden))
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(F.linear(x, self.W.t())))


class PackedChunk(nn.Module):
    """One packed ``[3·h, d]`` weight split with ``chunk`` (a fused gate projection)."""

    def __init__(self, d_in: int = 4, hidden: int = 6):
        super().__init__()
        self.W = nn.Parameter(torch.randn(3 * hidden, d_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c = self.W.chunk(3)
        return F.linear(x, a) * torch.tanh(F.linear(x, b)) + F.linear(x, c)


class PackedSlice(nn.Module):
    """A packed weight and bias cut by slicing, ``W[:h]``, ``W[h:2h]``, ``b[h:]``."""

    def __init__(self, d_in: int = 4, hidden: int = 6):
        super().__init__()
        self.hidden = hidden
        self.W = nn.Parameter(torch.randn(2 * hidden, d_in))
        self.b = nn.Parameter(torch.randn(2 * hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden
        gate = torch.sigmoid(F.linear(x, self.W[:h], self.b[:h]))
        return gate * F.linear(x, self.W[h:], self.b[h:])


class WeightNormLinear(nn.Module):
    """``torch.nn.utils.parametrizations.weight_norm`` on a Linear, then a plain head."""

    def __init__(self, d_in: int = 4, d_hidden: int = 6, d_out: int = 3):
        super().__init__()
        self.lin = nn.utils.parametrizations.weight_norm(nn.Linear(d_in, d_hidden))
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(x)))


class SpectralNormDiscriminator(nn.Module):
    """A DP-GAN discriminator: convolutions and a head under
    ``torch.nn.utils.parametrizations.spectral_norm``, whose forward runs one power
    iteration and writes it into buffers (from the weights only, no data)."""

    def __init__(self, c: int = 4):
        super().__init__()
        sn = nn.utils.parametrizations.spectral_norm
        self.conv1 = sn(nn.Conv2d(3, c, 3, stride=2, padding=1))
        self.conv2 = sn(nn.Conv2d(c, 2 * c, 3, stride=2, padding=1))
        self.head = sn(nn.Linear(2 * c, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.leaky_relu(self.conv1(x), 0.2)
        h = F.leaky_relu(self.conv2(h), 0.2)
        return self.head(h.mean((2, 3)))


class _DiffusionResBlock(nn.Module):
    def __init__(self, c: int, t_dim: int):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(2, c), nn.Conv2d(c, c, 3, padding=1)
        self.time = nn.Linear(t_dim, c)
        self.norm2, self.conv2 = nn.GroupNorm(2, c), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x))) + self.time(F.silu(t_emb))[:, :, None, None]
        return x + self.conv2(F.silu(self.norm2(h)))


class DiffusionUNet(nn.Module):
    """A denoiser as DP diffusion models write it: sinusoidal embedding of each sample's
    timestep and an MLP on it, added into GroupNorm residual blocks, a strided down
    convolution, self-attention over the positions, a transposed-convolution up path and
    a skip connection."""

    def __init__(self, c: int = 4, t_dim: int = 8):
        super().__init__()
        self.t_dim = t_dim
        self.inp = nn.Conv2d(1, c, 3, padding=1)
        self.time = nn.Sequential(nn.Linear(t_dim, t_dim), nn.SiLU(), nn.Linear(t_dim, t_dim))
        self.down, self.mid = _DiffusionResBlock(c, t_dim), _DiffusionResBlock(c, t_dim)
        self.downsample = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.attn = nn.MultiheadAttention(c, 2, batch_first=True)
        self.up = nn.ConvTranspose2d(c, c, 4, stride=2, padding=1)
        self.out = nn.Conv2d(2 * c, 1, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        half = self.t_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=x.dtype, device=x.device) / half)
        angles = t[:, None].to(x.dtype) * freqs
        t_emb = self.time(torch.cat([torch.cos(angles), torch.sin(angles)], -1))
        skip = self.down(self.inp(x), t_emb)
        h = self.mid(self.downsample(skip), t_emb)
        n, c, height, width = h.shape
        seq = h.flatten(2).transpose(1, 2)
        seq = seq + self.attn(seq, seq, seq, need_weights=False)[0]
        h = seq.transpose(1, 2).reshape(n, c, height, width)
        return self.out(torch.cat([self.up(h), skip], 1))


class Symmetric(nn.Module):
    """The parametrization of the ``torch.nn.utils.parametrize`` tutorial."""

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return X.triu() + X.triu(1).transpose(-1, -2)


class CustomParametrized(nn.Module):
    """A user parametrization registered with ``register_parametrization``."""

    def __init__(self, d: int = 6, d_out: int = 3):
        super().__init__()
        self.lin = nn.Linear(d, d)
        parametrize.register_parametrization(self.lin, "weight", Symmetric())
        self.head = nn.Linear(d, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(x)))


class TiedTranspose(nn.Module):
    """One weight used as ``W`` and as ``W.t()`` (an autoencoder with tied decoder)."""

    def __init__(self, d: int = 4, code: int = 3):
        super().__init__()
        self.W = nn.Parameter(torch.randn(code, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(F.linear(x, self.W)), self.W.t())


class LayerScaleBias(nn.Module):
    """Bare parameters used by elementwise ops: layer scale ``x * gamma``, bias ``x + b``."""

    def __init__(self, d: int = 4, d_out: int = 3):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.gamma = nn.Parameter(torch.randn(d))
        self.b = nn.Parameter(torch.randn(d))
        self.head = nn.Linear(d, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.fc(x)) * self.gamma
        return self.head(x + self.b)


class FirstOutput(nn.Module):
    """A layer that returns a tuple (RNNs, ``nn.MultiheadAttention``), reduced to its
    first output."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, *args):
        return self.layer(*args)[0]


class SequenceFirstBias(nn.Module):
    """Opacus's ``SequenceBias`` after a linear: ``cat([h, bias.repeat(1, B, 1)])`` with
    ``bias`` 1-D (``repeat`` with more counts than dims, the parameter inside ``cat``'s
    list argument), sequence first."""

    def __init__(self, d: int):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.bias = nn.Parameter(torch.randn(d))

    def forward(self, x):
        h = self.inp(x)
        return torch.cat([h, self.bias.repeat(1, h.shape[1], 1)])


class AsksTheType(nn.Module):
    """peft's DoRA asks ``type(weight).__module__.startswith("torchao.")`` of every
    weight (and of the input's class name), which Dynamo alone cannot answer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        weight = self.lin.weight
        if type(weight).__module__.startswith("torchao.") or type(x).__name__.endswith("Int8"):
            weight = weight.dequantize()
        return F.linear(torch.tanh(x), weight, self.lin.bias)


# -- torch.func.vmap inside the forward ----------------------------------------------------

class VmapPerSample(nn.Module):
    """A layer written for one sample and mapped over the batch by ``torch.func.vmap``:
    a Linear, a bare matrix and a scale inside the mapped function."""

    def __init__(self, d: int = 4, hidden: int = 6):
        super().__init__()
        self.fc = nn.Linear(d, hidden)
        self.mix = nn.Parameter(torch.randn(hidden, hidden) / math.sqrt(hidden))
        self.scale = nn.Parameter(torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def one_sample(tokens: torch.Tensor) -> torch.Tensor:  # [T, d]
            return (torch.tanh(self.fc(tokens)) @ self.mix) * self.scale

        return torch.func.vmap(one_sample)(x)


class VmapOverPositions(nn.Module):
    """``vmap`` over the positions (``in_dims=1``), the batch a dim the mapped function
    sees, with a nested ``vmap`` over features that pairs each with its own gain."""

    def __init__(self, d: int = 4, hidden: int = 6):
        super().__init__()
        self.fc = nn.Linear(d, hidden)
        self.gain = nn.Parameter(torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def position(h: torch.Tensor) -> torch.Tensor:  # [B, hidden]
            return torch.func.vmap(lambda v, g: torch.sin(v) * g, in_dims=(1, 0), out_dims=1)(h, self.gain)

        return torch.func.vmap(position, in_dims=1, out_dims=1)(self.fc(x))


class VmapMask(nn.Module):
    """A causal mask built by mapping a mask function over query and key positions, as
    Hugging Face's masking utilities build masks: the mask has no batch dim."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        causal = torch.func.vmap(torch.func.vmap(lambda q, k: k <= q, in_dims=(None, 0)), in_dims=(0, None))
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal(positions, positions))


class VmapSegmentMask(nn.Module):
    """Attention within the segments of each sample (packed sequences): a mask function of
    ``(sample, query, key)`` indices that reads the per-sample ``segment`` ids, mapped by
    ``vmap`` over the three index grids, as Hugging Face's ``packed_sequence_mask_function``
    (its ``TransformGetItemToIndex`` lets the function index by the mapped 0-d indices)."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
        from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

        def same_segment(b, q, k):
            return segment[b, q] == segment[b, k]

        grid = torch.func.vmap(torch.func.vmap(torch.func.vmap(same_segment, in_dims=(None, None, 0)),
                                               in_dims=(None, 0, None)), in_dims=(0, None, None))
        samples, positions = torch.arange(x.shape[0], device=x.device), torch.arange(x.shape[1], device=x.device)
        with TransformGetItemToIndex():
            mask = grid(samples, positions, positions)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _linear_recurrence(left, right):
    a1, b1 = left
    a2, b2 = right
    return a1 * a2, a2 * b1 + b2


class ScanRecurrence(nn.Module):
    """The gated linear recurrence ``h_t = a_t * h_(t-1) + b_t`` by
    ``associative_scan`` (its generic mode is built on ``vmap``), as state-space models
    such as Mamba write it for compilation."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.gate = nn.Linear(d, d)
        self.inp = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch._higher_order_ops.associative_scan import associative_scan

        a, b = torch.sigmoid(self.gate(x)), self.inp(x)
        return associative_scan(_linear_recurrence, (a, b), dim=1, combine_mode="generic")[1]


class VmapEnsemble(nn.Module):
    """Members of an ensemble stacked along a leading dim of their weights and mapped by
    ``vmap`` over that dim (not over the samples), their outputs summed."""

    def __init__(self, d: int = 4, d_out: int = 3, members: int = 2):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(members, d, d_out) / math.sqrt(d))
        self.bias = nn.Parameter(torch.randn(members, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.func.vmap(lambda w, b: torch.tanh(x @ w + b))(self.weight, self.bias).sum(0)


class EnergyForces(nn.Module):
    """A learned energy whose forces (its gradient with respect to the positions) are
    the output, each sample's by ``vmap(torch.func.grad(energy))``: the loss on the
    forces differentiates the gradient again (molecular dynamics potentials)."""

    def __init__(self, d: int = 4, hidden: int = 6):
        super().__init__()
        self.fc = nn.Linear(d, hidden)
        self.out = nn.Parameter(torch.randn(hidden) / math.sqrt(hidden))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        def energy(r: torch.Tensor) -> torch.Tensor:  # [atoms, d] -> []
            return (torch.tanh(self.fc(r)) * self.out).sum()

        return -torch.func.vmap(torch.func.grad(energy))(positions)


class VmapJacobian(nn.Module):
    """Each sample's Jacobian of a layer by ``vmap(jacrev(...))``, reduced to its trace
    (a divergence, as continuous normalising flows use)."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.gain = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        jacobian = torch.func.vmap(torch.func.jacrev(lambda v: torch.tanh(self.fc(v)) * self.gain))(x)
        return torch.cat([jacobian.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True), torch.tanh(self.fc(x))], -1)


class CheckpointedVmap(nn.Module):
    """A ``vmap`` inside an activation-checkpointed function."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.gain = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def block(h: torch.Tensor) -> torch.Tensor:
            return torch.func.vmap(lambda row: torch.sin(self.fc(row)) * self.gain)(h)

        return checkpoint_utils.checkpoint(block, x, use_reentrant=False)


class _Step:
    """A transformation object built in the forward (zuko's transforms are)."""

    def __init__(self, scale: torch.Tensor):
        self.scale = scale

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h) * self.scale


class ComposedSteps(nn.Module):
    """zuko's ``ComposedTransform(*steps)`` asserts its tuple of transformation objects
    (``assert transforms, "..."``) and jumps on a list of them."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(4, 4)
        self.scales = nn.Parameter(torch.rand(2, 4) + 0.5)

    def forward(self, x):
        steps = tuple(_Step(s) for s in self.scales)
        if self.kind == "list":
            steps = list(steps)
            if not steps:
                return x
        assert steps, "'steps' cannot be empty"
        h = self.lin(x)
        for step in steps:
            h = step(h)
        return h


class _Collector:
    """State outside the model, as Hugging Face's output capture keeps it."""

    outputs: list | None = None


class CheckpointedCollected(nn.Module):
    """Checkpointed blocks that append their outputs to a list set before they run
    (Hugging Face's ``output_hidden_states`` under gradient checkpointing): a side
    effect inside each checkpoint on state from outside it."""

    collector = _Collector()

    def __init__(self, d: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(2))

    def _block(self, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(layer(h))
        if self.collector.outputs is not None:
            self.collector.outputs.append(h)
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.collector.outputs = []
        for layer in self.blocks:
            x = checkpoint_utils.checkpoint(self._block, layer, x, use_reentrant=False)
        outputs, self.collector.outputs = self.collector.outputs, None
        return x + torch.stack(outputs).mean(0)


# -- loops over the samples ----------------------------------------------------------------

class PerSampleLoop(nn.Module):
    """Parameter-free code run on each sample alone and its results put together again:
    attention per sample (diffusers' Mochi attention processor: ``q[i:i + 1]`` …
    ``torch.cat``), a row ``h[i]`` centred and stacked, ``for row in h.unbind(0)``,
    ``h.split(1)``, rows written into a buffer (``h[i] = f(q[i])``); the projections
    before and after see the whole batch."""

    def __init__(self, kind: str, d: int = 4):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.kind == "slice":
            h = torch.cat([F.scaled_dot_product_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1])
                           for i in range(x.shape[0])])
        elif self.kind == "select":
            h = torch.stack([torch.softmax(q[i] @ k[i].T, -1) @ (v[i] - v[i].mean(0)) for i in range(x.shape[0])])
        elif self.kind == "unbind":
            h = torch.stack([torch.tanh(row).cumsum(0) for row in (q * v).unbind(0)])
        elif self.kind == "split":
            h = torch.cat([piece.flip(1) * k.shape[1] for piece in (q + v).split(1)])
        else:  # each sample's rows written into a buffer of the batch's shape
            h = torch.zeros_like(q)
            for i in range(x.shape[0]):
                h[i] = torch.softmax(q[i], -1) * v[i]
        return self.out(h)


# -- a mixture of experts that sorts the batch's tokens by expert ---------------------------

@torch.library.custom_op("fxdp_tests::loop_grouped_mm", mutates_args=())
def loop_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` as a loop over the groups, for any dtype (Hugging Face's
    ``grouped_mm_fallback``): rows ``offs[e - 1]:offs[e]`` times ``w[e]``; rows past
    the last offset stay zero."""
    out = x.new_zeros(x.shape[0], w.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[e]
        start = end
    return out


@loop_grouped_mm.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("fxdp_tests::loop_grouped_mm_backward", mutates_args=())
def loop_grouped_mm_backward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                             grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both gradients of ``loop_grouped_mm``, an op of its own as the forward's (a
    traced backward cannot read the offsets as numbers)."""
    grad_x, grad_w = torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for e, end in enumerate(offs.tolist()):
        grad_x[start:end] = grad[start:end] @ w[e].T
        grad_w[e] = x[start:end].T @ grad[start:end]
        start = end
    return grad_x, grad_w


@loop_grouped_mm_backward.register_fake
def _(x, w, offs, grad):
    return torch.empty_like(x), torch.empty_like(w)


def _loop_grouped_mm_backward(ctx, grad):
    grad_x, grad_w = loop_grouped_mm_backward(*ctx.saved_tensors, grad)
    return grad_x, grad_w, None


loop_grouped_mm.register_autograd(
    _loop_grouped_mm_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


class SortedExperts(nn.Module):
    """A top-k mixture of experts that runs each expert on its tokens at once, as Hugging
    Face's default ``grouped_mm`` experts do: the batch's tokens flattened, sorted by
    expert, grouped matmuls with offsets counted from the sorted experts, the results
    put back by the sort's inverse (``combine="inverse"``) or added into their tokens'
    rows (``combine="index_add"``); with ``biases``, GPT-OSS's per-expert biases
    gathered by the sorted experts, an RMSNorm and a learned scale of the experts' rows;
    with ``dispatch="argsort"``, torchtitan's order: the unsorted experts counted and an
    ``argsort`` (no biases then). ``torch._grouped_mm`` in bfloat16, a loop over the
    groups otherwise (``torch.compile`` takes ``_grouped_mm`` in bfloat16 only)."""

    def __init__(self, d: int = 8, hidden: int = 12, experts: int = 3, top_k: int = 2, combine: str = "inverse",
                 biases: bool = False, dispatch: str = "sort"):
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, 2 * hidden, d) / d ** 0.5)  # [E, out, in], as HF's
        self.down = nn.Parameter(torch.randn(experts, hidden, d) / hidden ** 0.5)  # [E, in, out]
        self.experts, self.top_k, self.combine, self.dispatch = experts, top_k, combine, dispatch
        # GPT-OSS's per-expert biases, gathered for the sorted tokens, and a norm after the experts
        self.up_bias = nn.Parameter(torch.randn(experts, 2 * hidden)) if biases else None
        self.down_bias = nn.Parameter(torch.randn(experts, d)) if biases else None
        self.norm = nn.RMSNorm(d) if biases else None
        self.scale = nn.Parameter(torch.rand(d) + 0.5) if biases else None

    def _grouped(self, x, w, offs):
        if w.dtype == torch.bfloat16:
            return torch._grouped_mm(x, w, offs=offs)
        return loop_grouped_mm(x, w, offs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(h).softmax(-1).topk(self.top_k)
        if self.dispatch == "sort":
            keys, order = chosen.reshape(-1).sort()
            offsets = torch.histc(keys.float(), bins=self.experts, min=0, max=self.experts - 1)
        else:  # torchtitan's: the unsorted experts counted, their order by argsort
            offsets = torch.histc(chosen.reshape(-1).float(), bins=self.experts, min=0, max=self.experts)
            order = chosen.reshape(-1).argsort(stable=True)
        offsets = offsets.cumsum(0, dtype=torch.int32)
        rows = h[order // self.top_k]
        projected = self._grouped(rows, self.up.transpose(-2, -1), offsets)
        if self.up_bias is not None:
            projected.add_(self.up_bias[keys])
        gate, up = projected.chunk(2, dim=-1)
        out = self._grouped(F.silu(gate) * up, self.down, offsets)
        if self.down_bias is not None:
            out = self.norm(out + self.down_bias[keys]) * self.scale
        out = out * weights.reshape(-1)[order].unsqueeze(-1)
        if self.combine == "inverse":
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.shape[0], device=order.device)
            mixed = out[inverse].view(h.shape[0], self.top_k, -1).sum(1)
        else:
            mixed = torch.zeros_like(h).index_add(0, order // self.top_k, out)
        return x + mixed.view(x.shape)


class LoopedExperts(nn.Module):
    """A top-k mixture of experts written as a loop over the experts, each run on the
    tokens routed to it, which a ``nonzero`` finds (the rows of the whole batch routed
    there, in the order of the mask's positions):

    - ``"where"``: Mixtral's eager experts in transformers (``slot, token =
      torch.where(one_hot(chosen).permute(2, 1, 0)[e])``, ``h[token]``, the expert's
      ``F.linear`` of a slice of stacked weights, ``index_add_`` into zeros);
    - ``"where_eq"``: DeepSeek-V3's reference (``token, slot = torch.where(chosen ==
      e)``, ``y[token] += expert(h[token]) * weights[token, slot, None]``), experts as
      ``nn.Linear`` modules;
    - ``"flat"``: the flattened choices' ``nonzero().squeeze(-1)``, the token by
      ``// top_k``, ``index_select`` and ``index_add``."""

    def __init__(self, d: int = 8, hidden: int = 12, experts: int = 3, top_k: int = 2, dispatch: str = "where"):
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts, self.top_k, self.dispatch = experts, top_k, dispatch
        if dispatch == "where":  # [E, out, in] stacks, as transformers' MixtralExperts
            self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * hidden, d) / d ** 0.5)
            self.down_proj = nn.Parameter(torch.randn(experts, d, hidden) / hidden ** 0.5)
        else:
            self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
                                      for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(h).softmax(-1).topk(self.top_k)
        out = torch.zeros_like(h)
        if self.dispatch == "where":
            expert_mask = F.one_hot(chosen, num_classes=self.experts).permute(2, 1, 0)
            for e in range(self.experts):
                slot, token = torch.where(expert_mask[e])
                gate, up = F.linear(h[token], self.gate_up_proj[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[token, slot, None]
                out.index_add_(0, token, y)
        elif self.dispatch == "where_eq":
            for e in range(self.experts):
                token, slot = torch.where(chosen == e)
                out[token] += self.mlps[e](h[token]) * weights[token, slot, None]
        else:
            flat = weights.reshape(-1)
            for e in range(self.experts):
                found = (chosen.reshape(-1) == e).nonzero().squeeze(-1)
                token = found // self.top_k
                out = out.index_add(0, token, self.mlps[e](h.index_select(0, token)) * flat[found, None])
        return x + out.view(x.shape)
