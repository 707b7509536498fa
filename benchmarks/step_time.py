"""Training-step time and memory of fxdp against eager, torch.compile and Opacus.

For every model of ``benchmarks/models.py`` chosen with ``--models`` this script trains
the same initial weights on the same batch with each variant and reports:

* **median ms**: the median time of one whole training step — ``zero_grad``,
  forward, cross-entropy loss, backward, the variant's clipping and noise,
  ``SGD.step`` — timed with ``time.perf_counter`` after ``--warmup`` steps (the first
  of which compiles), over at least ``--steps`` steps and at least ``--min-seconds``
  of them (a fast step is repeated more, so a burst of other load on the machine
  cannot hold all of them). Every variant of a model is compiled and warmed up first;
  the timed steps then run in ``--rounds`` alternating rounds (each variant takes its
  share of the steps in turn), so that a machine whose speed drifts meets every
  variant alike. On CUDA the device is synchronised around each step.
* **peak MB**: the most memory steady-state training holds *above the model's
  parameters*: activations, gradients, per-sample gradients or norms, noise, and what
  one step leaves alive into the next (``p.grad``, ``p.grad_sample``). Every per-step
  tensor is dropped first, so the measurement starts from the parameters alone, then
  two consecutive steps run and the peak is taken over both. On CPU they run under
  ``torch.profiler`` with ``profile_memory=True`` and the peak is the highest running
  sum of the allocation and free events in time order (the process' ``ru_maxrss``
  never decreases, and ``tracemalloc`` does not see torch's allocator). On CUDA it is
  ``torch.cuda.max_memory_allocated()`` minus the bytes allocated at the start. Both
  see tensors only: not allocator caches, not oneDNN scratch space. If the profiler
  prints "Memory block of unknown size was allocated before the profiling started",
  a variant freed a tensor it kept from before (e.g. fxdp's last ``per_sample_norms``);
  the peak then over-counts by that tensor, a few bytes per sample.
* **first step s**: the first call, compilation included (Inductor's on-disk caches
  make it shorter on a second run).

``--allocator keep`` runs with glibc told to keep freed memory (the user guide's "Speed
on a CPU"): by default its thresholds for mapping and trimming move with the process's
allocation history, so how many pages each step faults in afresh, and the step times,
differ from one process to the next.

Variants (every ratio is to ``compiled``, the non-private baseline):

====================  ================================================================
``eager``             the model as written, non-private
``compiled``          ``torch.compile(model)``, non-private — the baseline
``fxdp_clipped``      ``fxdp.transform(model, max_grad_norm=C, loss_reduction="mean")``;
                      ``loss.backward()`` leaves the clipped mean gradient in
                      ``p.grad`` — fxdp's own work, the issue's target
``fxdp_dpsgd``        the same plus Gaussian noise of std ``sigma * C / B`` added to
                      ``p.grad``, as DP-SGD does (what Opacus's optimizers include)
``fxdp_kept``         ``fxdp_clipped`` with ``memory_budget_bytes=2**40``: every
                      per-sample gradient is instantiated and kept for the clipped
                      sum, no ghost norm (time against memory)
``fxdp_grad_sample``  ``fxdp.transform(model, grad_sample=True)``: the backward also
                      materialises ``p.grad_sample``; no clipping or noise, so this is
                      the cost of per-sample gradients alone
``opacus``            Opacus ``GradSampleModule`` (module hooks) + ``DPOptimizer``
``opacus_ghost``      Opacus ghost clipping: ``GradSampleModuleFastGradientClipping`` +
                      ``DPOptimizerFastGradientClipping`` +
                      ``DPLossFastGradientClipping`` (two backward passes), as
                      ``make_private(grad_sample_mode="ghost")`` wires them
====================  ================================================================

All private variants use ``C = 1.0``, ``sigma = 1.0`` and the "mean" reduction over
the batch ``B``. A variant that raises (fxdp or Opacus not supporting a model) is
reported as ``failed: <reason>`` and the run goes on.

Before timing, the first step of every private variant is checked against the
microbatch loop (each sample alone through the eager model, ``torch.autograd.grad``):
the noiseless clipped sum ``sum_i min(1, C / (||g_i|| + 1e-6)) g_i`` must agree to
``1e-4 * max|ref|`` (``1e-3`` with convolutions), as ``DESIGN.md`` asks of fxdp.

Run from the repository root::

    python benchmarks/step_time.py                      # mlp and seq, every variant
    python benchmarks/step_time.py --models mlp --steps 5 --warmup 2 \\
        --variants eager,compiled,opacus,opacus_ghost
    python benchmarks/step_time.py --models cnn,gpt --json results.json
    python benchmarks/step_time.py --models cnn --allocator keep
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.autograd import DeviceType

if __package__ in (None, ""):
    # Run as a script: make the repository root importable, for `benchmarks.models`
    # and for an fxdp checkout that is not installed.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.models import CASES, BenchmarkCase, cross_entropy  # noqa: E402

__all__ = [
    "BASELINE",
    "VARIANTS",
    "VariantResult",
    "format_case",
    "main",
    "measure_peak_bytes",
    "microbatch_clipped_sum",
    "run_case",
    "VariantRun",
]

BASELINE = "compiled"
MAX_GRAD_NORM = 1.0
NOISE_MULTIPLIER = 1.0
# --allocator keep: glibc serves every allocation from its heap and never returns freed
# memory to the kernel (by default it maps large blocks afresh and trims the heap, with
# thresholds that move with the process's history: the same compiled CNN step measured
# 25 ms in one process and 47 ms in the next).
KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": "4000000000", "MALLOC_TRIM_THRESHOLD_": "4000000000"}
# Small enough that neither the noise nor the same batch seen every step makes the
# weights diverge within a benchmark run; the value does not change the work done.
LEARNING_RATE = 1e-3
# ``fxdp_kept``'s memory budget: more than any model here keeps.
KEEP_ALL = 2**40


def _import_fxdp():
    """fxdp, with the rule of the ``moe`` case's grouped matmul (the op Hugging Face's
    fallback is, under another name) registered."""
    import fxdp
    from fxdp.registry import lookup
    from fxdp.rules.grouped import grouped_mm_rule

    op = torch.ops.fxdp_benchmarks.grouped_mm.default
    if lookup(op) is None:
        fxdp.register_rule(grouped_mm_rule(op))
    return fxdp


class _Trainer(abc.ABC):
    """One variant's training step on one model.

    Attributes:
        model: The plain module whose parameters are trained (shared with any wrapper).
        captured: After ``step(..., capture=True)`` of a private variant, the noiseless
            clipped sum ``{name: sum_i c_i g_i}`` and ``"norms"``: the ``[B]``
            per-sample gradient norms; ``None`` for non-private variants.
    """

    private = True

    def __init__(self, model: nn.Module, case: BenchmarkCase) -> None:
        self.model = model
        self.case = case
        self.params = dict(model.named_parameters())
        self.captured: dict[str, torch.Tensor] | None = None

    @abc.abstractmethod
    def step(self, x: torch.Tensor, y: torch.Tensor, capture: bool = False) -> None:
        """One training step on the batch ``(x, y)``."""

    def clear(self) -> None:
        """Drops every per-step tensor, leaving only the parameters alive."""
        for p in self.params.values():
            p.grad = None
            for name in ("grad_sample", "summed_grad", "_norm_sample"):
                if getattr(p, name, None) is not None:
                    setattr(p, name, None)

    def _capture(
        self, clipped_sum: dict[str, torch.Tensor], norms: torch.Tensor
    ) -> None:
        self.captured = {k: v.detach().clone() for k, v in clipped_sum.items()}
        self.captured["norms"] = norms.detach().flatten().clone()


class _PlainTrainer(_Trainer):
    """Non-private SGD on ``forward`` (the model itself or a compiled wrapper)."""

    private = False

    def __init__(
        self, model: nn.Module, case: BenchmarkCase, forward: Callable[..., Any]
    ) -> None:
        super().__init__(model, case)
        self.forward = forward
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)

    def step(self, x: torch.Tensor, y: torch.Tensor, capture: bool = False) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        cross_entropy(self.forward(x), y).backward()
        self.optimizer.step()


class _FxdpClippedTrainer(_Trainer):
    def __init__(
        self,
        model: nn.Module,
        case: BenchmarkCase,
        noise: bool = False,
        memory_budget_bytes: int | None = None,
    ) -> None:
        super().__init__(model, case)
        self.noise = noise
        fxdp = _import_fxdp()

        self.dp_model = fxdp.transform(
            model,
            max_grad_norm=MAX_GRAD_NORM,
            loss_reduction="mean",
            memory_budget_bytes=memory_budget_bytes,
        )
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        # Opacus adds N(0, (sigma C)^2) to the clipped sum, then divides by B; fxdp's
        # p.grad is already the mean, so the noise is scaled by 1 / B instead.
        self.noise_std = NOISE_MULTIPLIER * MAX_GRAD_NORM / case.batch_size

    def step(self, x: torch.Tensor, y: torch.Tensor, capture: bool = False) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        cross_entropy(self.dp_model(x), y).backward()
        if capture:
            batch_size = x.shape[0]
            self._capture(
                {n: p.grad * batch_size for n, p in self.params.items()},
                self.dp_model.per_sample_norms,
            )
        if self.noise:
            with torch.no_grad():
                for p in self.params.values():
                    p.grad.add_(torch.randn_like(p.grad), alpha=self.noise_std)
        self.optimizer.step()


class _FxdpGradSampleTrainer(_Trainer):
    def __init__(self, model: nn.Module, case: BenchmarkCase) -> None:
        super().__init__(model, case)
        fxdp = _import_fxdp()

        self.dp_model = fxdp.transform(model, grad_sample=True)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)

    def step(self, x: torch.Tensor, y: torch.Tensor, capture: bool = False) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        cross_entropy(self.dp_model(x), y).backward()
        if capture:
            # Clip from the per-sample gradients, outside the timed steps, to check
            # them against the same reference as the clipping variants.
            grad_samples = {
                n: getattr(p, "grad_sample", None) for n, p in self.params.items()
            }
            missing = [n for n, g in grad_samples.items() if g is None]
            if missing:
                raise RuntimeError(f"no p.grad_sample after backward: {missing}")
            self._capture(*_clip_and_sum(grad_samples))
        self.optimizer.step()


class _OpacusTrainer(_Trainer):
    def __init__(self, model: nn.Module, case: BenchmarkCase) -> None:
        super().__init__(model, case)
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        self.module = GradSampleModule(model, batch_first=True, loss_reduction="mean")
        self.optimizer = DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=LEARNING_RATE),
            noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=MAX_GRAD_NORM,
            expected_batch_size=case.batch_size,
            loss_reduction="mean",
        )

    def step(self, x: torch.Tensor, y: torch.Tensor, capture: bool = False) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        cross_entropy(self.module(x), y).backward()
        self.optimizer.step()
        if capture:
            # After step() DPOptimizer still holds the noiseless clipped sum
            # (summed_grad) and the per-sample gradients, until the next zero_grad.
            grad_samples = {n: p.grad_sample for n, p in self.params.items()}
            self._capture(
                {n: p.summed_grad for n, p in self.params.items()},
                _clip_and_sum(grad_samples)[1],
            )


class _OpacusGhostTrainer(_Trainer):
    def __init__(self, model: nn.Module, case: BenchmarkCase) -> None:
        super().__init__(model, case)
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import (
            DPLossFastGradientClipping,
        )

        # The same objects PrivacyEngine.make_private(grad_sample_mode="ghost") builds;
        # the module needs max_grad_norm too, it computes the clip factors itself.
        self.module = GradSampleModuleFastGradientClipping(
            model,
            batch_first=True,
            loss_reduction="mean",
            max_grad_norm=MAX_GRAD_NORM,
            use_ghost_clipping=True,
        )
        self.optimizer = DPOptimizerFastGradientClipping(
            torch.optim.SGD(model.parameters(), lr=LEARNING_RATE),
            noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=MAX_GRAD_NORM,
            expected_batch_size=case.batch_size,
            loss_reduction="mean",
        )
        self.criterion = DPLossFastGradientClipping(
            self.module, self.optimizer, nn.CrossEntropyLoss(), loss_reduction="mean"
        )

    def step(self, x: torch.Tensor, y: torch.Tensor, capture: bool = False) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        out = self.module(x)
        # Token logits are flattened for the criterion; `shape` lets Opacus fold the
        # per-token losses back into one loss per sequence (the privacy unit).
        shape = out.shape if self.case.per_token else None
        loss = self.criterion(out.flatten(0, -2), y.flatten(), shape=shape)
        loss.backward()  # two backward passes: norms, then the clipped gradient
        self.optimizer.step()
        if capture:
            self._capture(
                {n: p.summed_grad for n, p in self.params.items()},
                self.module.per_sample_gradient_norms,
            )

    def clear(self) -> None:
        super().clear()
        # The module keeps the last step's norms; freeing them inside the measured
        # step would be a free of a block the profiler never saw allocated.
        self.module.per_sample_gradient_norms = None


_TRAINERS: dict[str, Callable[[nn.Module, BenchmarkCase], _Trainer]] = {
    "eager": lambda model, case: _PlainTrainer(model, case, model),
    "compiled": lambda model, case: _PlainTrainer(model, case, torch.compile(model)),
    "fxdp_clipped": _FxdpClippedTrainer,
    "fxdp_dpsgd": lambda model, case: _FxdpClippedTrainer(model, case, noise=True),
    "fxdp_kept": lambda model, case: _FxdpClippedTrainer(model, case, memory_budget_bytes=KEEP_ALL),
    "fxdp_grad_sample": _FxdpGradSampleTrainer,
    "opacus": _OpacusTrainer,
    "opacus_ghost": _OpacusGhostTrainer,
}
VARIANTS = tuple(_TRAINERS)


def _clip_and_sum(
    grad_samples: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Flat clipping of per-sample gradients ``{name: [B, *p.shape]}``.

    Returns:
        ``({name: sum_i c_i g_i}, norms [B])``, where
        ``c_i = min(1, C / (norm_i + 1e-6))``.
    """
    norms = torch.stack(
        [g.flatten(1).norm(dim=1) for g in grad_samples.values()], dim=1
    ).norm(dim=1)
    factors = (MAX_GRAD_NORM / (norms + 1e-6)).clamp(max=1.0)
    clipped = {
        n: torch.einsum("n,n...->...", factors, g) for n, g in grad_samples.items()
    }
    return clipped, norms


def microbatch_clipped_sum(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The ground truth: clip each sample's gradient, computed alone, and sum.

    Two passes over the samples (norms, then the clipped sum) so that only one
    sample's gradient is alive at a time.

    Args:
        model: The eager model, in the state the variants start from.
        x: Inputs, batch first.
        y: Targets, batch first.

    Returns:
        ``({name: sum_i c_i g_i}, norms [B])``.
    """
    params = dict(model.named_parameters())

    def sample_grads(i: int) -> tuple[torch.Tensor, ...]:
        loss = cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        return torch.autograd.grad(loss, list(params.values()))

    norms = torch.stack(
        [
            torch.stack([g.norm() for g in sample_grads(i)]).norm()
            for i in range(x.shape[0])
        ]
    )
    factors = (MAX_GRAD_NORM / (norms + 1e-6)).clamp(max=1.0)
    clipped = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(x.shape[0]):
        for total, g in zip(clipped.values(), sample_grads(i)):
            total.add_(g, alpha=factors[i].item())
    return clipped, norms


def _relative_error(
    got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
) -> float:
    """``max |got - ref| / max |ref|``, both maxima over all parameters."""
    scale = max(r.abs().max().item() for r in reference.values())
    error = max((got[n].to(r) - r).abs().max().item() for n, r in reference.items())
    return error / scale


def measure_peak_bytes(
    trainer: _Trainer, x: torch.Tensor, y: torch.Tensor, device: torch.device
) -> int:
    """Peak bytes two consecutive training steps hold above the parameters.

    The second step runs with whatever the first left alive, as in a training loop.

    Args:
        trainer: A warmed-up variant; its per-step tensors are dropped first.
        x: Inputs.
        y: Targets.
        device: Where the step runs.

    Returns:
        The peak, in bytes.
    """
    trainer.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        trainer.step(x, y)
        trainer.step(x, y)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as profiler:
        trainer.step(x, y)
        trainer.step(x, y)
    return _peak_of_memory_events(profiler)


def _peak_of_memory_events(profiler: torch.profiler.profile) -> int:
    # The public EventList nets each op's allocations against its frees, which hides
    # peaks inside an op; the raw Kineto events keep every allocation and free with its
    # timestamp. The one private access of this script.
    events = [
        event
        for event in profiler.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == DeviceType.CPU
    ]
    events.sort(key=lambda event: event.start_ns())
    running = peak = 0
    for event in events:
        running += event.nbytes()
        peak = max(peak, running)
    return peak


@dataclasses.dataclass
class VariantResult:
    """What one variant measured on one model.

    Attributes:
        variant: Variant name, one of ``VARIANTS``.
        median_ms: Median step time, milliseconds.
        times_ms: Every timed step, milliseconds.
        first_step_s: First step including compilation, seconds.
        peak_bytes: Peak step memory above the parameters, bytes.
        clip_error: ``max |got - ref| / max |ref|`` of the clipped sum against the
            microbatch loop (private variants only).
        norm_error: The same measure for the per-sample norms.
        samples_clipped: How many samples had a norm above ``C`` (so clipping acted).
        grads_finite: Whether every ``p.grad`` was finite after the last step.
        error: ``"ExceptionType: message"`` when the variant failed, else ``None``.
    """

    variant: str
    median_ms: float | None = None
    times_ms: list[float] = dataclasses.field(default_factory=list)
    first_step_s: float | None = None
    peak_bytes: int | None = None
    clip_error: float | None = None
    norm_error: float | None = None
    samples_clipped: int | None = None
    grads_finite: bool | None = None
    error: str | None = None


def _short_reason(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    message = lines[0] if lines else ""
    if len(message) > 110:
        message = message[:107] + "..."
    return f"{type(error).__name__}: {message}"


class VariantRun:
    """One variant, from its compiling first step to its peak-memory measurement.

    The stages are separate so that ``run_case`` can time the variants of a case in
    alternating rounds: a machine whose speed drifts over minutes (a shared VM, a
    laptop's thermals) then slows every variant alike instead of whichever ran last.
    An exception in any stage ends the variant; it is kept in ``result.error``.
    """

    def __init__(
        self,
        variant: str,
        case: BenchmarkCase,
        initial_model: nn.Module,
        batch: tuple[torch.Tensor, torch.Tensor],
        reference: tuple[dict[str, torch.Tensor], torch.Tensor] | None,
        warmup: int,
        device: torch.device,
    ) -> None:
        """Builds the trainer on a copy of ``initial_model``, runs and checks the first
        step, then ``warmup - 1`` more untimed steps."""
        self.result = VariantResult(variant)
        self.batch = batch
        self.device = device
        self.trainer: Any = None
        x, y = batch
        try:
            self.trainer = _TRAINERS[variant](copy.deepcopy(initial_model), case)
            start = time.perf_counter()
            self.trainer.step(x, y, capture=self.trainer.private)
            self._sync()
            self.result.first_step_s = time.perf_counter() - start
            if self.trainer.captured is not None and reference is not None:
                clipped_reference, norms_reference = reference
                self.result.clip_error = _relative_error(self.trainer.captured, clipped_reference)
                self.result.norm_error = _relative_error(
                    {"norms": self.trainer.captured["norms"]}, {"norms": norms_reference}
                )
                self.result.samples_clipped = int((norms_reference > MAX_GRAD_NORM).sum())
            for _ in range(warmup - 1):
                self.trainer.step(x, y)
        except Exception as error:  # noqa: BLE001 - a failing variant must not end the run
            self._fail(error)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _fail(self, error: BaseException) -> None:
        self.result.error = _short_reason(error)
        self.trainer = None
        gc.collect()

    def time_steps(self, steps: int, min_seconds: float = 0.0) -> None:
        """Times at least ``steps`` more steps, and more until this call's steps add up
        to ``min_seconds``."""
        if self.trainer is None:
            return
        x, y = self.batch
        spent, count = 0.0, 0
        try:
            while count < steps or spent < min_seconds:
                self._sync()
                start = time.perf_counter()
                self.trainer.step(x, y)
                self._sync()
                elapsed = time.perf_counter() - start
                spent += elapsed
                count += 1
                self.result.times_ms.append(elapsed * 1e3)
        except Exception as error:  # noqa: BLE001
            self._fail(error)

    def finish(self) -> VariantResult:
        """The median step time, the finiteness of the gradients and the peak memory;
        releases the trainer."""
        if self.trainer is not None:
            try:
                self.result.median_ms = statistics.median(self.result.times_ms)
                grads = [p.grad for p in self.trainer.params.values() if p.grad is not None]
                self.result.grads_finite = bool(grads) and all(
                    bool(torch.isfinite(g).all()) for g in grads
                )
                x, y = self.batch
                self.result.peak_bytes = measure_peak_bytes(self.trainer, x, y, self.device)
            except Exception as error:  # noqa: BLE001
                self._fail(error)
        self.trainer = None
        gc.collect()
        return self.result


def run_case(
    case: BenchmarkCase,
    variants: Sequence[str],
    steps: int,
    warmup: int,
    device: torch.device,
    min_seconds: float = 0.0,
    check: bool = True,
    rounds: int = 1,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Runs every variant on one case.

    Every variant is built and warmed up first; the timed steps then run in
    ``rounds`` rounds, each timing every variant in turn for its share of ``steps``
    and ``min_seconds``; the peak memory is measured last, a variant at a time.

    Args:
        case: The benchmark case.
        variants: Names from ``VARIANTS``.
        steps: Timed steps per variant, at least.
        warmup: Untimed steps per variant, compilation included.
        device: Where to run.
        min_seconds: Least total time of a variant's timed steps.
        check: Whether to check private variants against the microbatch loop.
        rounds: How many alternating rounds the timed steps are split into.
        log: Progress messages.

    Returns:
        ``{"case", "description", "param_bytes", "check_tolerance",
        "variants": {name: VariantResult}}``.
    """
    torch.manual_seed(0)
    initial_model = case.build().to(device)
    x, y = (t.to(device) for t in case.make_batch(torch.Generator().manual_seed(0)))
    reference = None
    if check and any(v not in ("eager", "compiled") for v in variants):
        log(f"[{case.name}] microbatch reference over {x.shape[0]} samples")
        reference = microbatch_clipped_sum(copy.deepcopy(initial_model), x, y)
    # One Dynamo state per case: no graph of another case's model serves this one.
    # Variants of one case compile different module objects, guarded apart.
    torch._dynamo.reset()
    # ``compiled`` captures ``moe_loop``'s nonzero in its graph, as fxdp.transform does.
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    runs = {}
    for variant in variants:
        log(f"[{case.name}] {variant}: compile and warm up")
        runs[variant] = VariantRun(variant, case, initial_model, (x, y), reference, warmup, device)
    rounds = max(1, min(rounds, steps))
    for r in range(rounds):
        log(f"[{case.name}] timing round {r + 1} of {rounds}")
        share = steps // rounds + (1 if r < steps % rounds else 0)
        for run in runs.values():
            run.time_steps(share, min_seconds / rounds)
    results = {}
    for variant, run in runs.items():
        log(f"[{case.name}] {variant}: peak memory")
        results[variant] = run.finish()
    param_bytes = sum(p.numel() * p.element_size() for p in initial_model.parameters())
    # Convolutions sum over more terms: DESIGN.md's looser float32 bound for them.
    has_conv = any(isinstance(m, nn.Conv2d) for m in initial_model.modules())
    return {
        "case": case.name,
        "description": case.description,
        "param_bytes": param_bytes,
        "check_tolerance": 1e-3 if has_conv else 1e-4,
        "variants": results,
    }


def _ratio(value: float | None, baseline: float | None) -> str:
    if value is None or not baseline:
        return "-"
    return f"{value / baseline:.2f}x"


def format_case(case_result: dict[str, Any]) -> str:
    """The table and the checks of one case (a ``run_case`` result), as printed."""
    check_tolerance = case_result["check_tolerance"]
    results: dict[str, VariantResult] = case_result["variants"]
    baseline = results.get(BASELINE)
    base_ms = baseline.median_ms if baseline else None
    base_bytes = baseline.peak_bytes if baseline else None
    mb = 2**20
    lines = [
        f"\n== {case_result['case']}: {case_result['description']} "
        f"(parameters {case_result['param_bytes'] / mb:.1f} MB)",
        f"{'variant':<18}{'median ms':>11}{'vs compiled':>13}{'peak MB':>10}"
        f"{'vs compiled':>13}{'first step s':>14}",
    ]
    for name, r in results.items():
        if r.error:
            lines.append(f"{name:<18}failed: {r.error}")
            continue
        peak = f"{r.peak_bytes / mb:.1f}" if r.peak_bytes is not None else "-"
        lines.append(
            f"{name:<18}{r.median_ms:>11.1f}{_ratio(r.median_ms, base_ms):>13}"
            f"{peak:>10}{_ratio(r.peak_bytes, base_bytes):>13}{r.first_step_s:>14.1f}"
        )
    lines.append("checks:")
    clipped, ghost = results.get("fxdp_clipped"), results.get("opacus_ghost")

    def unavailable(*named: tuple[str, VariantResult | None]) -> str | None:
        for label, r in named:
            if r is None:
                return f"n/a ({label} not run)"
            if r.error:
                return f"n/a ({label} failed)"
        return None

    why = unavailable(("fxdp_clipped", clipped), (BASELINE, baseline))
    lines.append(
        "  fxdp clipped vs compiled: "
        + (
            why
            or f"{_ratio(clipped.median_ms, base_ms)} time, "
            f"{_ratio(clipped.peak_bytes, base_bytes)} peak memory"
        )
    )
    why = unavailable(("fxdp_clipped", clipped), ("opacus_ghost", ghost))
    lines.append(
        "  speed-up over Opacus ghost (clipping only): "
        + (
            why
            or f"{ghost.median_ms / clipped.median_ms:.2f}x faster, "
            f"{_ratio(ghost.peak_bytes, clipped.peak_bytes)} the memory of fxdp"
        )
    )
    dpsgd = results.get("fxdp_dpsgd")
    why = unavailable(("fxdp_dpsgd", dpsgd), ("opacus_ghost", ghost))
    lines.append(
        "  speed-up over Opacus ghost (both with noise): "
        + (why or f"{ghost.median_ms / dpsgd.median_ms:.2f}x faster")
    )
    for name, r in results.items():
        if r.clip_error is None:
            continue
        verdict = "ok" if r.clip_error <= check_tolerance else "MISMATCH"
        lines.append(
            f"  {name} vs microbatch loop: clipped sum {r.clip_error:.1e}, "
            f"norms {r.norm_error:.1e} (x max|ref|) {verdict}; "
            f"{r.samples_clipped} samples above C"
        )
    for name, r in results.items():
        if r.grads_finite is False:
            lines.append(f"  {name}: NON-FINITE gradients after the timed steps")
    return "\n".join(lines)


def _parse_list(text: str, allowed: Sequence[str], what: str) -> list[str]:
    # dict.fromkeys: drop repeats, keep the order given.
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {', '.join(unknown)}; choose from {', '.join(allowed)}"
        )
    return names


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parses the command line, runs the benchmark, prints the tables.

    Returns:
        Everything measured, as written by ``--json``.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--models",
        default="mlp,seq",
        type=lambda s: _parse_list(s, tuple(CASES), "model"),
        help=f"comma-separated, from {','.join(CASES)} (default: mlp,seq)",
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        type=lambda s: _parse_list(s, VARIANTS, "variant"),
        help=f"comma-separated subset of {','.join(VARIANTS)} (default: all)",
    )
    parser.add_argument(
        "--steps", type=int, default=10, help="timed steps, at least (default 10)"
    )
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=1.0,
        help="time more steps until they add up to this (default 1.0), so that the "
        "median of a fast step is not taken over a burst of other load",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed steps before timing, the first compiles (default 3, at least 1)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="alternating rounds the timed steps of the variants are split into, so "
        "that drift in the machine's speed meets every variant alike (default 5)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip the check of private variants against the microbatch loop",
    )
    parser.add_argument(
        "--autocast",
        choices=("bfloat16", "float16"),
        default=None,
        help="run every variant (and the reference) under torch.autocast with this "
        "dtype; the check then allows the low precision's error (3e-2)",
    )
    parser.add_argument(
        "--allocator",
        choices=("system", "keep"),
        default="system",
        help="system: glibc's malloc as the process has it; keep: glibc told to keep "
        "freed memory (MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_, the user guide's "
        "'Speed on a CPU'), so no step pays for faulting in fresh pages; the script "
        "then runs itself again with those variables set (default system)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    args = parser.parse_args(argv)
    if args.allocator == "keep" and not all(os.environ.get(k) for k in KEEP_FREED_MEMORY):
        # glibc reads them once, at start-up.
        env = {**os.environ, **KEEP_FREED_MEMORY}
        argv = sys.argv[1:] if argv is None else list(argv)
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *argv], env)
    # Opacus' full backward hooks warn on every step that the model's input does not
    # require grad; it never does here, and the warning says nothing about correctness.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1:
        parser.error("--steps, --warmup and --rounds must be at least 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    config = {
        "allocator": args.allocator,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "min_seconds": args.min_seconds,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "max_grad_norm": MAX_GRAD_NORM,
        "noise_multiplier": NOISE_MULTIPLIER,
        "autocast": args.autocast,
    }
    try:
        import opacus

        config["opacus"] = opacus.__version__
    except ImportError:
        pass
    config["load_average"] = os.getloadavg()[0]
    print(
        f"torch {config['torch']}, {device}, {config['threads']} threads, "
        + (f"autocast {args.autocast}, " if args.autocast else "")
        + ("freed memory kept (MALLOC_*_THRESHOLD_), " if args.allocator == "keep" else "")
        + f"median of >= {args.steps} steps and >= {args.min_seconds:g} s "
        f"after {args.warmup} warm-up, in {args.rounds} alternating rounds",
        flush=True,
    )
    if config["load_average"] > 0.5 * (os.cpu_count() or 1):
        # Other processes take cores from the timed steps (and make OpenMP's
        # threads wait on each other), which skews every ratio.
        print(
            f"note: load average {config['load_average']:.1f} on "
            f"{os.cpu_count()} cores before starting; timings will be noisy",
            flush=True,
        )

    precision = (
        torch.autocast(device.type, dtype=getattr(torch, args.autocast))
        if args.autocast
        else contextlib.nullcontext()
    )
    cases = []
    for name in args.models:
        case = CASES[name]
        with precision:
            case_result = run_case(
                case,
                args.variants,
                args.steps,
                args.warmup,
                device,
                min_seconds=args.min_seconds,
                check=args.check,
                rounds=args.rounds,
                log=lambda message: print(message, file=sys.stderr, flush=True),
            )
        if args.autocast:
            # Each sample alone and in the batch round differently in low precision.
            case_result["check_tolerance"] = 3e-2
        print(format_case(case_result), flush=True)
        cases.append(case_result)

    report = {
        "config": config,
        "cases": [
            {
                **c,
                "variants": {
                    name: dataclasses.asdict(r) for name, r in c["variants"].items()
                },
            }
            for c in cases
        ],
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=_json_default))
        print(f"\nwrote {args.json}")
    return report


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


if __name__ == "__main__":
    main()
