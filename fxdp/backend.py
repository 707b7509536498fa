"""``torch.compile(model, backend="fxdp")`` and ``fxdp.backend(**options)``."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from fxdp import _torch_internals as internals
from fxdp.clip_norm import ClipNorm
from fxdp.compiler import (
    CompiledGraph,
    NoBatchDim,
    compile_graph,
    mark_mixed,
    mixed_outputs,
    refuse_graph_break,
)
from fxdp.errors import UnsupportedError
from fxdp.options import Options

__all__ = ["backend", "Backend", "entry_point_backend"]


class Backend:
    """A Dynamo backend ``fn(gm, example_inputs)`` that compiles with fxdp.

    Its options are fixed at construction; Dynamo keys its cache on the backend
    object, so two backends with different options never share a graph.

    Attributes:
        options: The validated options.
        records: One ``CompiledGraph`` per graph compiled, for ``explain()``.
        guards_eager_fallback: Make Dynamo raise at its recompile limit, instead of
            running a frame eagerly without the fxdp backward, for each frame this backend
            compiles a trainable graph of. ``transform`` does without: it sets that for its
            own calls only, and checks that its graph ran.
        clip_norm: With ``max_grad_norm``, the ``C`` every graph of this backend reads
            at run time (``max_grad_norm`` below changes it between steps).
        model: ``transform``'s model, whose parameters a backward did not cover lose their
            grad samples (a backend of ``torch.compile`` may serve several models).
    """

    def __init__(self, options: Options, names: dict[int, str] | None = None,
                 arg_names: Sequence[str] = (), guards_eager_fallback: bool = True,
                 model: torch.nn.Module | None = None):
        self.options = options
        self.model = model
        self.names = names
        self.arg_names = tuple(arg_names)
        self.guards_eager_fallback = guards_eager_fallback
        self.clip_norm = None if options.max_grad_norm is None else ClipNorm(options.max_grad_norm)
        self.records: list[CompiledGraph] = []

    @property
    def max_grad_norm(self) -> float | None:
        """The clipping norm ``C`` the next backward uses.

        It may change between steps (adaptive clipping) without a new compile; clipping
        cannot be switched on or off, which changes the graphs."""
        return None if self.clip_norm is None else self.clip_norm.value

    @max_grad_norm.setter
    def max_grad_norm(self, c: float | None) -> None:
        if c is None and self.clip_norm is None:
            return  # no clipping, as before
        if self.clip_norm is None or c is None:
            raise ValueError("max_grad_norm can change between steps, but clipping cannot be switched on or "
                             "off (the compiled graphs differ): transform or compile the model anew")
        self.clip_norm.value = c

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs) -> Callable:
        if kwargs.get("options"):
            return Backend(Options.from_kwargs({**vars_of(self.options), **kwargs["options"]}),
                           self.names, self.arg_names, self.guards_eager_fallback, self.model)(gm, example_inputs)
        if not torch.is_grad_enabled() or not any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
        ):
            mixed: tuple[dict[int, str], dict[int, str]] = ({}, {})
            if torch.is_grad_enabled() and not internals.in_optimizer():
                # No gradient flows through it, but a break at its end (a call of a
                # submodule Dynamo runs eagerly) may hide parameters from the next,
                # and what it mixes may reach them there.
                refuse_graph_break(gm, self.options, example_inputs)
                if self.options.max_grad_norm is None:
                    mixed = mixed_outputs(gm, example_inputs, self.options)
            return _plain(gm, example_inputs, self.options, mixed)
        if not self.guards_eager_fallback:  # transform's: it checks that its graph ran
            return self._compile(gm, example_inputs)
        internals.refuse_silent_eager_fallback()
        try:
            compiled = self._compile(gm, example_inputs)
        except Exception as e:
            if isinstance(e, NoBatchDim) and not any(
                    isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is None for t in example_inputs):
                # A graph without trainable tensors that Dynamo resumes after the loss
                # (its first argument the 0-d loss): nothing in it to make per-sample.
                return _plain(gm, example_inputs, self.options)
            if not torch._dynamo.config.suppress_errors:
                raise
            # Dynamo would swallow the error and run the frame eagerly, with ordinary,
            # unclipped gradients: raise it when the frame runs instead.
            return _refusal(e)
        return _refusing_stances_without_backend(compiled)

    def _compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        record = CompiledGraph(self.options)
        self.records.append(record)
        return compile_graph(gm, example_inputs, self.options, self.names, record, self.arg_names, self.clip_norm,
                             self.model)

    def __repr__(self) -> str:
        return f"fxdp.backend({self.options})"


def vars_of(options: Options) -> dict:
    import dataclasses

    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}


def _plain(gm: fx.GraphModule, example_inputs: Sequence[Any], options: Options,
           mixed: tuple[dict[int, str], dict[int, str]] = ({}, {})) -> Callable:
    """No gradient can flow (``torch.no_grad()``, inference): nothing extra to do, but
    mark the ``mixed`` outputs and inputs (``mixed_outputs``)."""
    from fxdp.compiler import RUN_STATE

    if options.compiler == "inductor":
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(gm, list(example_inputs))
    else:
        compiled = gm.forward
    # A forward that turns gradients on itself (``with torch.enable_grad():``), called
    # under ``torch.no_grad()``, returns values with the ordinary autograd graph behind
    # them: a backward through them would leave ordinary gradients.
    guarded = (not torch.is_grad_enabled() and (options.max_grad_norm is not None or options.grad_sample)
               and internals.outputs_need_grad(gm)
               and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs))

    def run(*args):
        RUN_STATE.ran = True
        out = compiled(*args)
        outputs, inputs = mixed
        for i, where in outputs.items():
            mark_mixed(out[i], where)
        for i, where in inputs.items():
            mark_mixed(args[i], where)
        if guarded:
            with torch.enable_grad():
                out = type(out)(_NoBackward.apply(t) if isinstance(t, torch.Tensor) and t.requires_grad else t
                                for t in out)
        return out

    return run


class _NoBackward(torch.autograd.Function):
    """The identity, whose backward refuses (see ``_plain``)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise UnsupportedError(
            "a backward through the output of a forward that turned gradients on itself (with "
            "torch.enable_grad():) while it was called under torch.no_grad(): fxdp compiled it without "
            "gradients, so they would be ordinary, not per-sample. Call the model with gradients enabled "
            "to train it.")


def _refusal(error: Exception) -> Callable:
    """A compiled frame that raises ``error`` (what fxdp refused) when it runs."""
    def run(*args):
        raise error

    return run


def _refusing_stances_without_backend(compiled: Callable) -> Callable:
    """``compiled``, raising while a ``torch.compiler.set_stance`` lets Dynamo run this
    model's other frames without the backend: the backend sees no call of its own and
    cannot tell such a step from its own, so one of its graphs running under that
    stance is the only sign."""
    def run(*args):
        stance = internals.stance_without_backend()
        if stance is not None:
            raise UnsupportedError(
                f"{stance} lets Dynamo run a training step of a model compiled with the fxdp backend "
                "without fxdp (eagerly, at a new input shape or on the first call), with ordinary, "
                "unclipped gradients and no error. Use the default stance while it trains (set_stance("
                "'fail_on_recompile') is fine), or fxdp.transform, which checks every call.")
        return compiled(*args)

    return run


def backend(**options: Any) -> Backend:
    """A Dynamo backend with ``transform``'s options and defaults.

    Example::

        compiled = torch.compile(model, backend=fxdp.backend(max_grad_norm=1.0))
    """
    return Backend(Options.from_kwargs(options))


def entry_point_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None,
                        **_: Any) -> Callable:
    """``backend="fxdp"``: ``fxdp.backend(grad_sample=True, **options)``."""
    return Backend(Options.from_kwargs({"grad_sample": True, **(options or {})}))(gm, example_inputs)


def _is_fxdp_backend(fn: Any) -> bool:
    return isinstance(fn, Backend) or fn is entry_point_backend


# Dynamo captures for these backends as for fxdp.transform (RNNs, autograd.Function
# classes, a dropped requires_grad, ...); module.compile(backend=...) with one of them
# compiles the module's call, and so does DDP's call of a torch.nn module under one.
internals.name_function_calls(_is_fxdp_backend)
internals.compile_modules_in_place(_is_fxdp_backend)
internals.compile_library_modules_under_ddp(_is_fxdp_backend)
