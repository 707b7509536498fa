"""Inspection: ``fxdp.explain`` shows the rewritten graphs, ``fxdp.validate`` the refusals."""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from fxdp._torch_internals import capture_config, new_fake_mode
from fxdp.compiler import CompiledGraph, analyse_graph, forward_arg_names
from fxdp.errors import Problem, UnsupportedError, format_problems
from fxdp.options import Options

__all__ = ["Explanation", "explain", "validate"]


class Explanation:
    """The graphs fxdp compiled. ``str()`` prints, for each graph, the forward and the
    rewritten backward as code (every rewritten node annotated with rule, parameter
    and strategy), then per parameter the strategy and the costs that chose it.

    Attributes:
        graphs: One ``CompiledGraph`` per Dynamo graph.
    """

    def __init__(self, graphs: list[CompiledGraph]):
        self.graphs = list(graphs)

    @property
    def plans(self) -> list:
        return [p for g in self.graphs if g.plan for p in g.plan.params]

    @property
    def rule_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for g in self.graphs:
            for k, v in g.rule_counts.items():
                counts[k] = counts.get(k, 0) + v
        return counts

    def __str__(self) -> str:
        out = []
        for i, g in enumerate(self.graphs):
            out.append(f"=== fxdp graph {i} ({g.options}) ===")
            if g.problems:
                out.append("refused (strict=False):")
                out.append(format_problems(g.problems))
            out.append(f"rules fired: {g.rule_counts}")
            out.append("--- forward (after partitioning) ---")
            out.append(g.stages.get("forward", "<not compiled>").strip())
            out.append("--- backward (rewritten) ---")
            out.append(g.annotated_backward.strip() or "<not compiled: run a backward>")
            if g.plan:
                out.append("--- per-parameter strategy ---")
                for p in g.plan.params:
                    costs = ", ".join(f"{k}={v:.3g} flops" for k, v in p.costs.items()) or "-"
                    out.append(f"  {p.name}: rule={p.rule} uses={p.uses} strategy={p.strategy} costs: {costs}")
        return "\n".join(out)

    __repr__ = __str__


def _fake_copy(model: nn.Module, mode: Any) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake tensors of ``mode``.

    Fake tensors keep the real device (unlike meta tensors), so tensors the forward
    creates without ``device=`` (``torch.zeros(x.shape)``, ``torch.arange(T)``) land on
    the same device as the parameters; no data is copied or computed. A lazy module's
    uninitialised parameters stay uninitialised in the copy.
    """
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = (_uninitialised_like(p) if is_lazy(p) else
                       nn.Parameter(mode.from_tensor(p.detach(), static_shapes=True), requires_grad=p.requires_grad))
    for b in model.buffers():
        memo[id(b)] = _uninitialised_like(b) if is_lazy(b) else mode.from_tensor(b, static_shapes=True)
    for m in model.modules():
        # A tensor an earlier call computed from parameters and stored (prune's
        # ``module.weight``, the old ``weight_norm`` hook's): deepcopy takes no autograd
        # history, and the forward computes it afresh.
        for t in vars(m).values():
            if isinstance(t, torch.Tensor) and t.grad_fn is not None and id(t) not in memo:
                memo[id(t)] = mode.from_tensor(t.detach(), static_shapes=True).requires_grad_(t.requires_grad)
    return copy.deepcopy(model, memo)


def _uninitialised_like(t: torch.Tensor) -> torch.Tensor:
    """A fresh uninitialised parameter or buffer for a lazy module's copy: it has no data
    to copy, and the copy's first forward, under the fake mode, gives it fake data of
    the shape the example arguments imply, leaving the model's own untouched."""
    if isinstance(t, nn.Parameter):
        return nn.UninitializedParameter(requires_grad=t.requires_grad, device=t.device, dtype=t.dtype)
    return nn.UninitializedBuffer(requires_grad=t.requires_grad, device=t.device, dtype=t.dtype)


def _fake_args(args: Any, mode: Any) -> Any:
    def to_fake(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            t = mode.from_tensor(a.detach(), static_shapes=True)
            return t.requires_grad_(a.requires_grad) if a.is_leaf else t
        if isinstance(a, (list, tuple)):
            return type(a)(to_fake(x) for x in a)
        if isinstance(a, dict):
            return {k: to_fake(v) for k, v in a.items()}
        return a

    return to_fake(args)


def explain(model: nn.Module, *example_args: Any, **options: Any) -> Explanation:
    """Compile a fake-tensor copy of ``model`` on ``example_args`` and show what fxdp did.

    Nothing runs on real data and the model is not touched. Options are
    ``transform``'s; the graphs are built with ``compiler="eager"`` unless given.
    """
    from fxdp.module import transform

    kwargs = options.pop("kwargs", {})
    options.setdefault("compiler", "eager")
    mode = new_fake_mode()
    dp = transform(_fake_copy(model, mode), **options)
    args, kwargs = _fake_args((example_args, kwargs), mode)
    with mode:
        out = dp(*args, **kwargs)
        loss = _as_loss(out)
        if loss is not None and loss.requires_grad:
            loss.backward()
    return dp.explain()


def _as_loss(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else out.float().sum()
    if isinstance(out, (list, tuple)):
        parts = [_as_loss(o) for o in out]
        parts = [p for p in parts if p is not None and p.requires_grad]
        return sum(parts) if parts else None
    if isinstance(out, dict) or hasattr(out, "values"):
        return _as_loss(list(out.values()))
    return None


class _Analysed(Exception):
    """Stops ``validate``'s compile once its one graph is analysed."""


def validate(model: nn.Module, *example_args: Any, **options: Any) -> list[Problem]:
    """Every op, module and parameter fxdp cannot make per-sample (empty list: all fine).

    The answer is for the example's batch size: a batch of one cannot mix samples, so
    validate with at least two samples to see what larger batches would meet.
    """
    kwargs = options.pop("kwargs", {})
    opts = Options.from_kwargs(options)
    problems: list[Problem] = []
    mode = new_fake_mode()
    fake_model = _fake_copy(model, mode)
    names = {id(p): n for n, p in fake_model.named_parameters()}

    def backend(gm, example_inputs):
        try:
            _, _, _, analysis = analyse_graph(gm, example_inputs, opts, names, forward_arg_names(fake_model))
        except UnsupportedError as e:  # found before the analysis could run
            problems.extend(e.problems)
        else:
            problems.extend(analysis.problems)
        # The graph need not run: its ops with data-dependent output sizes (nonzero,
        # masked_select) could not, on fake tensors without Dynamo's shape environment.
        raise _Analysed

    def call(*args, **kw):
        return fake_model(*args, **kw)

    args, kwargs = _fake_args((example_args, kwargs), mode)
    torch._dynamo.reset()
    try:
        # validate must see the graph transform captures.
        with mode, capture_config():
            torch.compile(call, backend=backend, fullgraph=True)(*args, **kwargs)
    except torch._dynamo.exc.BackendCompilerFailed as e:
        if not isinstance(e.inner_exception, _Analysed):
            raise
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:
        # (UserError: a guard on a data-dependent value, as nn.GaussianNLLLoss's check of var)
        problems.append(Problem("dynamo", "", "", f"Dynamo cannot capture the model in one graph: {e}"))
    return problems
