"""PyTorch's own test inputs, run against fxdp.

``torch.testing._internal.common_modules.module_db`` holds, for every ``torch.nn``
module, the constructor arguments and forward inputs PyTorch tests it with;
``common_methods_invocations.op_db`` does the same for functional ops, and
``common_nn``'s older ``module_tests``/``new_module_tests`` list more layer
configurations (padding modes, depthwise and dilated convolutions, bags). Here every
batched sample of a module or op that takes trainable tensors goes through
``fxdp.transform(..., grad_sample=True, max_grad_norm=...)`` and is compared with the
microbatch loop (``tests/reference.py``) in float64: inputs written by someone else,
for every layer PyTorch ships.

Samples without a batch dim are left out, except for the recurrent layers, multi-head
attention and transformer layers, whose samples are all unbatched: those are batched
here by stacking perturbed copies. A sample fxdp must refuse (BatchNorm in training, a
mean normalised over other samples' labels) must be refused with the reason the table
below names; a sample Dynamo itself cannot capture in one graph is listed too.
"""
from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

import fxdp
from reference import assert_close_all, reference

pytest.importorskip("expecttest", reason="torch.testing._internal imports it (the test extra)")

from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402
from torch.testing._internal.common_modules import module_db  # noqa: E402

DTYPE = torch.float64
TOL = 1e-9
SEQUENCE_FIRST = {"RNN", "GRU", "LSTM", "MultiheadAttention", "Transformer", "TransformerEncoder",
                  "TransformerEncoderLayer", "TransformerDecoderLayer"}

# What fxdp refuses on purpose, by module: a sample meeting it must raise this.
REFUSED = {
    "BatchNorm1d": "BatchNorm in training mode", "BatchNorm2d": "BatchNorm in training mode",
    "BatchNorm3d": "BatchNorm in training mode",
    "LinearCrossEntropyLoss": "class weights make the mean's normaliser|ignore_index=.* under reduction='mean'|"
                              "loss inside the graph is a mean",
    "nn.functional.instance_norm": "track_running_stats=True in training",
    "EmbeddingBag": "mode='max' routes each feature's gradient to the row of its maximum",
}
# What Dynamo cannot capture in one graph (plain ``torch.compile(fullgraph=True)``
# fails the same way), by module: the error must say so.
DYNAMO = {
    # momentum=None: the running average's factor is 1 / num_batches_tracked, a tensor read
    "BatchNorm2d": "data-dependent", "BatchNorm3d": "data-dependent",
    # chunked options under Dynamo: a function marked as skipped
    "LinearCrossEntropyLoss": "marked as skipped",
    # a causal mask passed without is_causal: PyTorch tests the mask's values
    "Transformer": "data-dependent", "TransformerEncoder": "data-dependent",
}


def _expected(name: str, error: Exception) -> bool:
    """Whether ``error`` is the refusal or the Dynamo limit the tables name for ``name``."""
    expected = "|".join(f"(?:{table[name]})" for table in (REFUSED, DYNAMO) if name in table)
    return bool(expected) and re.search(expected, str(error)) is not None


_SHARE = {"LinearCrossEntropyLoss": 16, "Transformer": 2, "TransformerDecoderLayer": 8}


def _loss(out: Any) -> torch.Tensor:
    """A loss that sums over samples: the output itself when the module is a loss
    (reduced already), else the sum of squares of every floating output."""
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.pow(2).sum() for t in leaves)


def _clip_between(norms: torch.Tensor) -> float:
    """A clipping norm that clips some samples and not others."""
    return float(norms.median()) + 1e-3 if norms.numel() else 1.0


def _batched(name: str, desc: str, first: torch.Tensor) -> bool:
    if name.endswith("Cell"):
        return first.dim() == 2
    if name in SEQUENCE_FIRST:
        return first.dim() == 3
    return "no_batch" not in desc and (first.dim() >= 2 or name == "Embedding")


def _stack(t: Any, dim: int, batch: int, seed: int) -> Any:
    """``batch`` perturbed copies of an unbatched tensor, stacked at ``dim``."""
    if not isinstance(t, torch.Tensor):
        return t
    g = torch.Generator().manual_seed(seed)
    copies = [t if not t.is_floating_point() else t + 0.3 * torch.randn(t.shape, generator=g, dtype=t.dtype)
              for _ in range(batch)]
    return torch.stack(copies, dim)


def _module_cases():
    cases = []
    for info in module_db:
        name = info.module_cls.__name__
        if name.startswith("Lazy"):
            continue
        samples = info.module_inputs_func(info, device="cpu", dtype=DTYPE, requires_grad=False, training=True)
        for k, sample in enumerate(samples):
            if sample.forward_input is None:
                continue
            args, kwargs = sample.forward_input.args, sample.forward_input.kwargs
            first = next((a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)), None)
            if first is None:
                continue
            desc = sample.desc or ""
            # Some modules have dozens of samples, each a fresh compile: a share of them
            # keeps every kind (CI time). Recurrent samples come in pairs, without and
            # with an initial state: a third of the configurations (every third of the
            # bias x batch_first x bidirectional product meets each value), both of each pair.
            if k % _SHARE.get(name, 1) or (name in ("RNN", "GRU", "LSTM") and (k // 2) % 3):
                continue
            if not _has_parameters(info, sample):
                continue
            recurrent = name in ("RNN", "GRU", "LSTM") or name.endswith("Cell")
            if not (recurrent or _batched(name, desc, first)):
                continue
            cases.append(pytest.param(info, sample, id=f"{name}-{k}{'-' + desc if desc else ''}"))
    return cases


def _has_parameters(info, sample) -> bool:
    module = info.module_cls(*sample.constructor_input.args, **sample.constructor_input.kwargs)
    return any(p.requires_grad for p in module.parameters())


def _recurrent_batch(name: str, args: tuple, batch_first: bool, batch: int):
    """Batch the unbatched samples of the recurrent layers and cells: the input at
    its batch dim, the hidden state (tensor or tuple) at dim 1 (dim 0 for cells)."""
    input_dim = 0 if (batch_first or name.endswith("Cell")) else 1
    state_dim = 0 if name.endswith("Cell") else 1
    x = _stack(args[0], input_dim, batch, seed=1)
    if len(args) == 1:
        return (x,), {0: input_dim}
    state = tree_map(lambda t: _stack(t, state_dim, batch, seed=2), args[1])
    return (x, state), {0: input_dim, 1: state_dim}


@pytest.mark.parametrize("info,sample", _module_cases())
def test_module_db(info, sample):
    name = info.module_cls.__name__
    ckwargs = sample.constructor_input.kwargs
    torch.manual_seed(0)
    model = info.module_cls(*sample.constructor_input.args, **ckwargs).to(DTYPE).train()
    args, kwargs = tuple(sample.forward_input.args), dict(sample.forward_input.kwargs)
    batch_first = name not in SEQUENCE_FIRST
    first = next(a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor))
    batch_first = next((m.batch_first for m in model.modules() if hasattr(m, "batch_first")), batch_first)
    in_dims = None
    if not _batched(name, sample.desc or "", first):  # a recurrent layer's sample
        args, in_dims = _recurrent_batch(name, args, batch_first, batch=3)
    if not batch_first:  # padding masks are [B, S] and attention masks shared, whatever the layout
        named = {k: 0 if k.endswith("key_padding_mask") else None
                 for k, v in kwargs.items() if k.endswith("mask") and isinstance(v, torch.Tensor)}
        in_dims = {**(in_dims or {}), **named} or None
    reduction = getattr(model, "reduction", None)
    loss_reduction = reduction if reduction in ("mean", "sum") else "sum"
    try:
        ref = reference(model, list(args), lambda out, i: _loss(out), batch_dim=0 if batch_first else 1,
                        kwargs=kwargs, in_dims=in_dims)
    except (RuntimeError, ValueError, AssertionError) as e:  # a batch of one PyTorch itself rejects
        pytest.skip(f"the microbatch loop cannot run it: {e}")
    if not torch.isfinite(ref.norms).all():  # a mean over no kept target, an empty LayerNorm
        pytest.skip("the microbatch loop gives non-finite gradients")
    torch._dynamo.reset()
    dp = fxdp.transform(model, max_grad_norm=_clip_between(ref.norms), grad_sample=True,
                        loss_reduction=loss_reduction, batch_first=batch_first, compiler="eager",
                        in_dims=in_dims)
    try:
        _loss(dp(*args, **kwargs)).backward()
    except Exception as e:  # noqa: BLE001 - checked against the tables
        if _expected(name, e):
            return
        raise
    grads = {n: p.grad_sample for n, p in model.named_parameters() if p.requires_grad}
    assert_close_all(grads, ref.per_sample, TOL, f"{name}: p.grad_sample")
    clipped = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert_close_all(clipped, ref.grad(loss_reduction, dp.options.max_grad_norm), TOL, f"{name}: p.grad")


# ---------------------------------------------------------------------------
# op_db: functional ops whose weights become parameters
# ---------------------------------------------------------------------------

OPS = {"nn.functional.linear", "nn.functional.bilinear", "nn.functional.conv1d", "nn.functional.conv2d",
       "nn.functional.conv3d", "nn.functional.conv_transpose1d", "nn.functional.conv_transpose2d",
       "nn.functional.conv_transpose3d", "nn.functional.layer_norm", "nn.functional.group_norm",
       "nn.functional.instance_norm", "nn.functional.rms_norm", "nn.functional.prelu", "matmul", "mm",
       "addmm", "baddbmm", "einsum", "mul", "add"}


class Functional(nn.Module):
    """``op(x, *args, **kwargs)`` with its floating tensors that require grad as
    parameters, its other tensors with ``x``'s leading size as further inputs (batched)
    and the rest as constants (running statistics, say)."""

    def __init__(self, op, x: torch.Tensor, args: tuple, kwargs: dict):
        super().__init__()
        self.op = op
        self.spec: list[tuple[str, Any]] = []
        for i, a in enumerate([*args, *kwargs.values()]):
            if isinstance(a, torch.Tensor) and a.requires_grad and a.is_floating_point():
                self.register_parameter(f"w{i}", nn.Parameter(a.detach().clone()))
                self.spec.append(("param", f"w{i}"))
            else:
                batched = isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[0] == x.shape[0]
                self.spec.append(("input" if batched else "const", a))
        self.n_args = len(args)
        self.keys = list(kwargs)

    def inputs(self) -> list[torch.Tensor]:
        return [v.detach() for kind, v in self.spec if kind == "input"]

    def forward(self, x, *inputs):
        it = iter(inputs)
        values = [getattr(self, v) if kind == "param" else next(it) if kind == "input" else v
                  for kind, v in self.spec]
        return self.op(x, *values[:self.n_args], **dict(zip(self.keys, values[self.n_args:])))


def _op_cases():
    cases = []
    for op in op_db:
        if op.name not in OPS:
            continue
        for k, sample in enumerate(op.sample_inputs("cpu", DTYPE, requires_grad=True)):
            x = sample.input
            if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[0] < 2:
                continue
            weight = next((a for a in sample.args if isinstance(a, torch.Tensor)), None)
            if "conv" in op.name and weight is not None and x.dim() != weight.dim():
                continue  # an unbatched convolution
            cases.append(pytest.param(op, sample, id=f"{op.name}-{k}"))
    return cases


@pytest.mark.parametrize("op,sample", _op_cases())
def test_op_db(op, sample):
    model = Functional(op.op, sample.input, sample.args, sample.kwargs)
    if not any(True for _ in model.parameters()):
        pytest.skip("no tensor that requires grad")
    x = sample.input.detach()
    args = [x, *model.inputs()]
    try:
        with torch.no_grad():  # the sample is per-sample only where samples do not mix
            whole = _loss(model(*args))
            parts = sum(_loss(model(*[a[i:i + 1] for a in args])) for i in range(x.shape[0]))
    except RuntimeError as e:  # a weight of the sample holds per-row data (bilinear's x2)
        pytest.skip(f"this sample's dim 0 is no batch: {e}")
    if not torch.allclose(whole, parts):
        pytest.skip("this sample's dim 0 is no batch")
    ref = reference(model, args, lambda out, i: _loss(out))
    torch._dynamo.reset()
    dp = fxdp.transform(model, max_grad_norm=_clip_between(ref.norms), grad_sample=True,
                        loss_reduction="sum", compiler="eager")
    try:
        _loss(dp(*args)).backward()
    except Exception as e:  # noqa: BLE001 - checked against the table
        if op.name in REFUSED and re.search(REFUSED[op.name], str(e)):
            return
        raise
    assert_close_all({n: p.grad_sample for n, p in model.named_parameters()}, ref.per_sample, TOL,
                     f"{op.name}: p.grad_sample")
    assert_close_all({n: p.grad for n, p in model.named_parameters()},
                     ref.grad("sum", dp.options.max_grad_norm), TOL, f"{op.name}: p.grad")


# ---------------------------------------------------------------------------
# op_db: every op's batch propagation, behind a parameter
# ---------------------------------------------------------------------------

class _Scaled(nn.Module):
    """``op(x * p, *args)`` with ``p`` a trainable per-feature scale: the op's batch
    propagation decides whether ``p`` gets per-sample gradients."""

    def __init__(self, op, x: torch.Tensor, args: tuple, kwargs: dict):
        super().__init__()
        self.op, self.args, self.kwargs = op, args, kwargs
        scale = torch.randn(x.shape[1:], dtype=x.dtype, generator=torch.Generator().manual_seed(0))
        self.p = nn.Parameter(1 + 0.1 * scale)

    def forward(self, x):
        return self.op(x * self.p, *self.args, **self.kwargs)


def _per_sample_case(op):
    """The first sample of ``op`` whose dim 0 is a batch: the loss of the whole batch is
    the sum of the samples' own (``None`` when no sample is)."""
    for sample in op.sample_inputs("cpu", DTYPE, requires_grad=False):
        x = sample.input
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2 or x.shape[0] < 2:
            continue
        if any(isinstance(a, torch.Tensor) and a.dim() >= 1 and a.shape[0] == x.shape[0]
               for a in tree_flatten((sample.args, sample.kwargs))[0]):
            continue
        model = _Scaled(op.op, x, sample.args, sample.kwargs)
        try:
            with torch.no_grad():
                whole = _loss(model(x))
                parts = sum(_loss(model(x[i:i + 1])) for i in range(x.shape[0]))
        except Exception:  # noqa: BLE001 - the op rejects a batch of one
            continue
        if isinstance(whole, torch.Tensor) and torch.isfinite(whole) and torch.allclose(whole, parts, rtol=1e-9):
            return model, x
    return None


# ``op_db`` split into shards run as separate tests, so that pytest-xdist spreads them
# over its workers (one test over every op takes seven minutes). How many of each
# shard's ops were exact with torch 2.13.0: the floors guard the coverage.
_SHARDS = 8
_EXACT_FLOOR = {0: 30, 1: 26, 2: 36, 3: 42, 4: 38, 5: 31, 6: 30, 7: 28}


@pytest.mark.parametrize("shard", range(_SHARDS))
def test_every_op_db_op_is_exact_or_refused(shard):
    """Every op of ``op_db`` (this shard: every ``_SHARDS``-th one) with a sample whose
    dim 0 is a batch, run on a parameter's output: fxdp's per-sample gradient of that
    parameter matches the microbatch loop, or fxdp refuses the model (an op it cannot
    prove keeps samples apart, or one that works along the batch dim). Never a crash,
    never a wrong gradient. With torch 2.13.0, 261 ops are exact and 50 refused (ops
    that work along the batch dim or flatten it, ops without a propagation, random or
    sparse ops Dynamo does not capture); the count of exact ops per shard guards the
    coverage."""
    exact, refused, wrong = [], [], []
    for op in op_db[shard::_SHARDS]:
        try:
            case = _per_sample_case(op)
        except Exception:  # noqa: BLE001 - sample generation itself (missing optional deps)
            continue
        if case is None:
            continue
        model, x = case
        try:
            ref = reference(model, [x], lambda out, i: _loss(out))
        except RuntimeError:  # not differentiable (floor_divide), or no path to p
            continue
        if not torch.isfinite(ref.per_sample["p"]).all():
            continue
        torch._dynamo.reset()
        dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
        try:
            _loss(dp(x)).backward()
        except fxdp.UnsupportedError:
            refused.append(op.name)
            continue
        except Exception as e:  # noqa: BLE001 - collected, reported below
            wrong.append(f"{op.name}: {type(e).__name__}: {str(e)[:200]}")
            continue
        r = ref.per_sample["p"]
        err = float((model.p.grad_sample - r).abs().max() / r.abs().max().clamp_min(1e-300)) if r.numel() else 0.0
        if err <= TOL:
            exact.append(op.name)
        else:
            wrong.append(f"{op.name}: relative error {err:.1e}")
    assert not wrong, "\n".join(wrong)
    assert len(exact) >= _EXACT_FLOOR[shard], (len(exact), sorted(set(refused)))


# ---------------------------------------------------------------------------
# common_nn: the older module tests (``module_tests`` and ``new_module_tests``)
# ---------------------------------------------------------------------------

def _legacy_entries():
    from torch.testing._internal import common_nn
    entries = []
    for entry in [*common_nn.module_tests, *common_nn.get_new_module_tests()]:
        name = entry.get("fullname") or "_".join(filter(None, (entry.get("module_name"), entry.get("desc"))))
        if "no_batch_dim" in name:
            continue
        module = _legacy_module(entry)
        if isinstance(module, nn.Module) and any(p.requires_grad for p in module.parameters()):
            entries.append(pytest.param(entry, id=name))
    return entries


def _legacy_module(entry: dict) -> nn.Module:
    constructor = entry.get("constructor") or getattr(nn, entry["module_name"])
    return constructor(*entry.get("constructor_args", ()))


def _legacy_input(entry: dict, batch_dim: int, batch: int = 3) -> Any:
    """The entry's input with ``batch`` samples: its own rows, cycled, perturbed
    where they are floating point (a batch of one or two says little per sample)."""
    torch.manual_seed(1)
    given = entry["input_fn"]() if "input_fn" in entry else torch.randn(entry["input_size"])

    def grow(t: torch.Tensor) -> torch.Tensor:
        t = t.to(DTYPE) if t.is_floating_point() else t
        size = t.shape[batch_dim]
        if size == 0 or size >= batch:
            return t
        rows = [t.select(batch_dim, i % size) for i in range(batch)]
        if t.is_floating_point():
            rows = [r if i < size else r + 0.3 * torch.randn_like(r) for i, r in enumerate(rows)]
        return torch.stack(rows, batch_dim)

    return tree_map(lambda t: grow(t) if isinstance(t, torch.Tensor) else t, given)


@pytest.mark.parametrize("entry", _legacy_entries())
def test_common_nn_module_tests(entry):
    """PyTorch's older module tests (``common_nn``): every configuration of a layer with
    parameters, batched to three samples, against the microbatch loop."""
    torch.manual_seed(0)
    model = _legacy_module(entry).to(DTYPE).train()
    batch_first = next((m.batch_first for m in model.modules() if hasattr(m, "batch_first")),
                       type(model).__name__ not in SEQUENCE_FIRST)
    batch_dim = 0 if batch_first else 1
    given = _legacy_input(entry, batch_dim)
    args = list(given) if isinstance(given, (tuple, list)) else [given]
    # A sequence-first layer's 2-D tensors are attention masks, shared by the samples.
    in_dims = {k: None for k, a in enumerate(args) if not batch_first and a.dim() == 2} or None
    ref = reference(model, args, lambda out, i: _loss(out), batch_dim=batch_dim, in_dims=in_dims)
    torch._dynamo.reset()
    dp = fxdp.transform(model, max_grad_norm=_clip_between(ref.norms), grad_sample=True,
                        loss_reduction="sum", batch_first=batch_first, compiler="eager", in_dims=in_dims)
    try:
        _loss(dp(*args)).backward()
    except Exception as e:  # noqa: BLE001 - checked against the tables
        if _expected(type(model).__name__, e):
            return
        raise
    grads = {n: p.grad_sample for n, p in model.named_parameters() if p.requires_grad}
    assert_close_all(grads, ref.per_sample, TOL, "p.grad_sample")
    clipped = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert_close_all(clipped, ref.grad("sum", dp.options.max_grad_norm), TOL, "p.grad")
