"""Every private torch API fxdp uses, each behind one small function.

A torch upgrade touches this module only. Verified on torch 2.13.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import os
import re
import sys
import threading
import types
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

__all__ = [
    "plain_expression",
    "fake_mode_of",
    "make_fx_traced",
    "inductor_compile",
    "eager_compile",
    "inductor_decompositions",
    "annotate",
    "breaks_at_backward",
    "breaks_at_a_data_read",
    "breaks_at_zero_grad",
    "graph_break_reason",
    "record_backward_break",
    "record_data_read",
    "after_backward",
    "in_optimizer",
    "resumed_after",
    "resumed_arguments",
    "outputs_need_grad",
    "stored_outputs",
    "inline_checkpoints",
    "erase_unused",
    "current_graph_task_id",
    "when_backward_ends",
    "refuse_silent_eager_fallback",
    "eager_fallback_at_recompile_limit",
    "size_hint",
    "new_fake_mode",
    "capture_config",
    "name_function_calls",
    "vmap_safe_solves",
    "incompatible_keys",
    "fake_kernels_torch_lacks",
]


def new_fake_mode():
    """A fresh fake-tensor mode for tracing without compute (``fxdp.explain``). Real
    tensors the model keeps outside its parameters and buffers (a plain tensor
    attribute) become fake constants instead of an error. Its shape environment gives
    an op whose output size depends on data (``nonzero``, ``masked_select`` of shared
    data) a symbolic size where a bare mode raises; callers fake tensors with
    ``static_shapes=True``, so the sizes Dynamo guards on stay numbers."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())


@functools.cache
def fake_kernels_torch_lacks() -> None:
    """Fake kernels for ops PyTorch has none for at symbolic sizes (torch 2.13).

    ``aten._upsample_bicubic2d_aa_backward``: the Python
    meta of the antialiased resizes' backward lists the bilinear and Lanczos ops but not
    the bicubic one, whose C++ meta takes sizes as integers only, so tracing the
    backward of ``F.interpolate(…, mode="bicubic", antialias=True)`` at a second image
    size (Dinov2's position embeddings resized to the image) failed inside PyTorch
    ("Expected IntList but got GenericList"). The same meta function serves it."""
    from torch._meta_registrations import (
        meta_upsample_bimode2d_aa_backward,
        register_meta,
    )

    op = torch.ops.aten._upsample_bicubic2d_aa_backward.default
    register_meta(op)(meta_upsample_bimode2d_aa_backward)
    op.py_impl(torch._C.DispatchKey.Meta)(meta_upsample_bimode2d_aa_backward)
    # ``torch.distributions``' draws of each element on its own and their reparameterised
    # gradients (Gamma, Beta, Dirichlet, Binomial), whose outputs have their inputs'
    # broadcast shape and the first's dtype: their fallback runs only at sizes that are
    # numbers, so a second batch size failed ("UnsupportedOperatorException:
    # aten._standard_gamma_grad.default").
    aten = torch.ops.aten
    for op in (aten._standard_gamma_grad.default, aten._sample_dirichlet.default, aten.binomial.default,
               aten._dirichlet_grad.default):
        register_meta(op)(_elementwise_result)
        op.py_impl(torch._C.DispatchKey.Meta)(_elementwise_result)


def _elementwise_result(first: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The result of an elementwise op of ``first`` and the tensors among ``args``."""
    shapes = [first.shape, *(a.shape for a in args if isinstance(a, torch.Tensor))]
    return first.new_empty(torch.broadcast_shapes(*shapes))


# Logger methods a forward may call (Hugging Face adds ``warning_once`` and ``warning_advice``).
_LOG_METHODS = {"debug", "info", "warning", "warn", "error", "critical", "log"}


def _call_now(fn: Callable, args: Sequence[Any], kwargs: dict) -> bool:
    """Call ``fn`` at capture time with the Python values of Dynamo's ``args`` and
    ``kwargs``; ``False`` (and no call) where one of them is a traced value."""
    try:
        values = [a.as_python_constant() for a in args]
        keywords = {k: v.as_python_constant() for k, v in kwargs.items()}
    except NotImplementedError:
        return False
    fn(*values, **keywords)
    return True


@contextlib.contextmanager
def capture_config():
    """Dynamo's settings for capturing a model whole (``fullgraph=True``), read at trace time.

    - ``allow_rnn`` traces nn.LSTM/GRU/RNN.
    - ``warnings.warn`` in a forward (PyTorch's own deprecation notices, e.g.
      ``F._canonical_mask`` on a float causal mask beside a bool padding mask) is issued
      after the graph runs instead of breaking it. Dynamo replays such reordered calls
      only from the frame it compiles and drops those made in the functions it inlines
      (every module's forward, under ``transform``), so each is recorded on that frame.
      Dynamo replays only tensors and constants; a call with a category
      (``warnings.warn(msg, FutureWarning)``) and constant arguments warns once, when the
      graph is captured.
    - A ``logging.Logger`` call with constant arguments (Hugging Face's
      ``logger.warning_once`` about a config) is logged once, when the graph is
      captured, instead of breaking it; Dynamo cannot replay logger calls.
    - A ``torch.autograd.Function`` call's higher-order op records its class and where
      each ``apply`` argument went (``meta["fxdp_function"]``), to find its rule (see
      ``name_function_calls``).
    - A string method of a class's name (``type(w).__module__.startswith("torchao.")``,
      which peft's DoRA asks of every weight) is answered from the name itself; Dynamo
      cannot call methods on the attribute as it keeps it.
    - ``requires_grad`` set on a value the forward computed is dropped (see
      ``_gradient_asked_of_a_computed_value``).
    - A ``torch.autograd.Function`` context's ``saved_variables`` (deprecated) is its
      ``saved_tensors``, the only one Dynamo knows (NAFNet's ``LayerNorm2d``).
    - ``torch.jit.isinstance(x, T)`` of a plain type (MONAI's ``UpCat``), which Dynamo
      skips, is the builtin ``isinstance``; a container type (``List[int]``) still breaks.
    - ``with torch.backends.cuda.sdp_kernel(enable_flash=..., ...)``, deprecated and
      traced by Dynamo as an op that returns no tensor (lucidrains' attention modules),
      is the ``torch.nn.attention.sdpa_kernel`` of the same backends, which it wraps.
    - ``assert seq`` on a tuple or list of objects (zuko's ``ComposedTransform``
      asserts its tuple of transforms) is decided by the sequence's length, as any
      jump on a tuple or list is; Dynamo would rewrite it as ``torch._assert(seq)``,
      which it cannot put in the graph (``_sequence_jumps_by_length``).
    - A side effect in an activation-checkpointed region on state from outside it
      (Hugging Face's output capture appends each layer's output to a collector set
      before the checkpointed layers run) happens once, in the forward: Dynamo refuses
      it by default because eager checkpointing replays the region's Python code when
      it recomputes the forward in the backward, and the graph's recompute replays no
      Python code (``skip_fwd_side_effects_in_bwd_under_checkpoint``). The gradients
      are those of the region's ops either way.
    - Module hooks are guarded on (``skip_nnmodule_hook_guards`` off): a forward hook
      registered after the first call, or removed, is seen by the next call (a
      recompile), where Dynamo's default runs the graph captured without it.
    - ``optimize_ddp`` is off: under ``DistributedDataParallel`` Dynamo's DDPOptimizer
      would split the graph at DDP's gradient buckets (the first holds 1 MB, so nearly
      every model), and clipping needs the whole model in one graph. The split would
      overlap communication with the backward, but the clipped gradients exist only at
      its end.
    """
    import warnings
    from unittest import mock

    from torch._dynamo.variables import ConstantVariable
    from torch._dynamo.variables.functions import SkipFunctionVariable
    from torch._dynamo.variables.misc import (
        DebuggingVariable,
        GetAttrVariable,
        LoggingLoggerVariable,
    )
    from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

    config = torch._dynamo.config
    logging_functions = set(config.reorderable_logging_functions) | {warnings.warn}
    record = DebuggingVariable.call_function
    logger_call = LoggingLoggerVariable.call_method

    def record_on_compiled_frame(self, tx, args, kwargs):
        if self.value is warnings.warn and not DebuggingVariable.can_reorder_logs(self.value, args, kwargs):
            # A category (``warnings.warn(msg, FutureWarning)``, as Hugging Face's
            # deprecation notices pass) cannot be replayed after the graph: warn now.
            keywords = {k: v for k, v in kwargs.items() if k != "stacklevel"}
            if _call_now(warnings.warn, args, keywords):
                return ConstantVariable.create(None)
            return record(self, tx, args, kwargs)  # a traced value: Dynamo's own answer
        while getattr(tx, "parent", None) is not None:
            tx = tx.parent
        return record(self, tx, args, kwargs)

    attribute_call = GetAttrVariable.call_method
    _install_capture_hooks()
    fake_kernels_torch_lacks()
    capturing = _NAMING.capturing
    _NAMING.capturing = True
    try:
        with config.patch(allow_rnn=True, reorderable_logging_functions=logging_functions,
                          optimize_ddp=False, skip_fwd_side_effects_in_bwd_under_checkpoint=True,
                          skip_nnmodule_hook_guards=False), \
                mock.patch.object(DebuggingVariable, "call_function", record_on_compiled_frame), \
                mock.patch.object(LoggingLoggerVariable, "call_method", _logged_at_capture(logger_call)), \
                mock.patch.object(GetAttrVariable, "call_method", _named_at_capture(attribute_call)), \
                mock.patch.object(SkipFunctionVariable, "call_function",
                                  _jit_isinstance_as_builtin(SkipFunctionVariable.call_function)), \
                mock.patch.object(TorchInGraphFunctionVariable, "call_function",
                                  _sdp_kernel_as_sdpa_kernel(TorchInGraphFunctionVariable.call_function)), \
                _sequence_jumps_by_length():
            yield
    finally:
        _NAMING.capturing = capturing


# The jumps that pop the value they test (``assert x`` is one, followed by
# ``LOAD_ASSERTION_ERROR``), by their names in Python 3.10-3.13.
_POPPING_JUMPS = ("POP_JUMP_IF_TRUE", "POP_JUMP_IF_FALSE", "POP_JUMP_FORWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_TRUE",
                  "POP_JUMP_FORWARD_IF_FALSE", "POP_JUMP_BACKWARD_IF_FALSE")


@contextlib.contextmanager
def _sequence_jumps_by_length():
    """Dynamo's handlers of the popping jumps, in every translator's dispatch table,
    first replace a plain tuple or list being tested by its truth, its length: the
    same jump, but an ``assert`` of it is then one of a constant."""
    import dis

    from torch._dynamo import symbolic_convert
    from torch._dynamo.variables import ConstantVariable, ListVariable, TupleVariable

    def by_length(handler: Callable) -> Callable:
        def jump(self, inst):
            if self.stack and type(self.stack[-1]) in (TupleVariable, ListVariable):
                self.stack[-1] = ConstantVariable.create(bool(self.stack[-1].items))
            return handler(self, inst)
        return jump

    codes = [dis.opmap[name] for name in _POPPING_JUMPS if name in dis.opmap]
    classes, pending = [], [symbolic_convert.InstructionTranslatorBase]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if "dispatch_table" in vars(cls):
            classes.append(cls)
    replaced = [(cls.dispatch_table, code, cls.dispatch_table[code]) for cls in classes for code in codes
                if cls.dispatch_table[code] is not None]
    for table, code, handler in replaced:
        table[code] = by_length(handler)
    try:
        yield
    finally:
        for table, code, handler in reversed(replaced):
            table[code] = handler


def _logged_at_capture(logger_call: Callable) -> Callable:
    """``LoggingLoggerVariable.call_method`` that logs a ``logging.Logger`` call with
    constant arguments once, when the graph is captured, instead of breaking the graph;
    ``logger_call`` (Dynamo's) answers the others: a tensor or other traced value."""
    from torch._dynamo.variables import ConstantVariable

    def call_method(self, tx, name, args, kwargs):
        if (name in _LOG_METHODS or name.endswith(("_once", "_advice"))) \
                and _call_now(getattr(self.value, name), args, kwargs):
            return ConstantVariable.create(None)
        return logger_call(self, tx, name, args, kwargs)

    return call_method


def _jit_isinstance_as_builtin(skipped_call: Callable) -> Callable:
    """``SkipFunctionVariable.call_function`` that traces ``torch.jit.isinstance(x, T)``
    as the builtin ``isinstance`` where ``T`` is a class or a tuple of classes (what it
    is outside TorchScript); ``skipped_call`` (Dynamo's) answers the others."""
    from torch._dynamo.variables import BuiltinVariable

    def call_function(self, tx, args, kwargs):
        if self.value is torch.jit.isinstance and len(args) == 2 and not kwargs and args[1].is_python_constant():
            target = args[1].as_python_constant()
            if all(isinstance(t, type) for t in (target if isinstance(target, tuple) else (target,))):
                return BuiltinVariable(isinstance).call_function(tx, args, {})
        return skipped_call(self, tx, args, kwargs)

    return call_function


def _sdp_kernel_as_sdpa_kernel(in_graph_call: Callable) -> Callable:
    """``TorchInGraphFunctionVariable.call_function`` that traces the deprecated context
    manager ``torch.backends.cuda.sdp_kernel(enable_flash=..., enable_math=...,
    enable_mem_efficient=..., enable_cudnn=...)`` with constant flags as the
    ``torch.nn.attention.sdpa_kernel`` of the backends they enable (what it calls);
    ``in_graph_call`` (Dynamo's) answers the others."""
    from torch._dynamo.variables.ctx_manager import SDPAKernelVariable
    from torch.nn.attention import SDPBackend

    flags = ("enable_flash", "enable_math", "enable_mem_efficient", "enable_cudnn")  # its signature
    # the backend each flag enables, in the order sdp_kernel lists them
    backend_of = {"enable_flash": SDPBackend.FLASH_ATTENTION, "enable_mem_efficient": SDPBackend.EFFICIENT_ATTENTION,
                  "enable_math": SDPBackend.MATH, "enable_cudnn": SDPBackend.CUDNN_ATTENTION}

    def call_function(self, tx, args, kwargs):
        if self.value is torch.backends.cuda.sdp_kernel and len(args) <= len(flags) and set(kwargs) <= set(flags) \
                and all(a.is_python_constant() for a in (*args, *kwargs.values())):
            given = {**dict(zip(flags, (a.as_python_constant() for a in args))),
                     **{k: v.as_python_constant() for k, v in kwargs.items()}}
            return SDPAKernelVariable.create(tx, [b for f, b in backend_of.items() if given.get(f, True)])
        return in_graph_call(self, tx, args, kwargs)

    return call_function


def _named_at_capture(attribute_call: Callable) -> Callable:
    """``GetAttrVariable.call_method`` that answers a string method of a class's name
    (``type(w).__module__.startswith("torchao.")``) from the name itself;
    ``attribute_call`` (Dynamo's) answers the others."""
    from torch._dynamo.variables import ConstantVariable

    def call_method(self, tx, name, args, kwargs):
        if self.name in ("__module__", "__name__", "__qualname__"):
            try:
                value = getattr(self.obj.as_python_constant(), self.name)
            except NotImplementedError:
                value = None
            if isinstance(value, str):
                return ConstantVariable.create(value).call_method(tx, name, args, kwargs)
        return attribute_call(self, tx, name, args, kwargs)

    return call_method


class _Naming(threading.local):
    capturing = False


_NAMING = _Naming()
_NAMED_FOR: list[Callable[[Any], bool]] = []


def name_function_calls(is_fxdp_backend: Callable[[Any], bool]) -> None:
    """Have Dynamo capture for fxdp as ``capture_config`` has it, in six of its
    settings, when it captures for a backend that ``is_fxdp_backend`` recognises:

    - trace ``nn.RNN``/``nn.GRU``/``nn.LSTM`` modules as ``allow_rnn`` does. Without
      it Dynamo refuses them, and where one is a ``forward``'s first call it skips the
      whole ``forward``: the model ran eagerly, unclipped, and no fxdp code ran that
      could notice;
    - drop ``requires_grad`` asked of a value the forward computed (see
      ``_gradient_asked_of_a_computed_value``);
    - record each ``torch.autograd.Function`` call's class on its higher-order op
      (``meta["fxdp_function"]``, see ``_name_function_call``);
    - log a ``logging.Logger`` call with constant arguments once, when the graph is
      captured, instead of breaking the graph (Hugging Face's ``loss_function`` warns
      once about an unset ``loss_type``, inside a compiled step's forward);
    - answer a string method of a class's name from the name (peft's DoRA asks
      ``type(w).__module__.startswith("torchao.")`` of every weight);
    - read a ``torch.autograd.Function`` context's ``saved_variables``, the deprecated
      alias of ``saved_tensors`` (NAFNet's and KBNet's ``LayerNorm2d`` read it in their
      backward), as ``saved_tensors``: Dynamo knows only the latter.

    ``torch.compile(model, backend="fxdp")`` captures without fxdp on the stack, so
    fxdp's backend module calls this when it is imported, which Dynamo does when it
    looks the backend up. Other backends' graphs get Dynamo's own behaviour.
    """
    _NAMED_FOR.append(is_fxdp_backend)
    _install_capture_hooks()


def _install_capture_hooks() -> None:
    from torch._dynamo.variables import (
        ConstantVariable,
        SetAttrBuiltinVariable,
        TensorVariable,
    )
    from torch._dynamo.variables.builder import VariableBuilder
    from torch._dynamo.variables.misc import (
        AutogradFunctionContextVariable,
        AutogradFunctionVariable,
        GetAttrVariable,
        LoggingLoggerVariable,
    )

    apply = AutogradFunctionVariable.call_apply
    if getattr(apply, "_fxdp_naming", False):
        return

    def apply_and_name(self, tx, args, kwargs):
        result = apply(self, tx, args, kwargs)
        if _NAMING.capturing or _compiles_for(tx, _NAMED_FOR):
            _name_function_call(self.fn_cls, args, result)
        return result

    def for_fxdp(call: Callable, at_capture: Callable) -> Callable:
        def call_method(self, tx, name, args, kwargs):
            return (at_capture if _compiles_for(tx, _NAMED_FOR) else call)(self, tx, name, args, kwargs)

        return call_method

    def wrap_module(self, value):
        if _compiles_for(self.tx, _NAMED_FOR) and not torch._dynamo.config.allow_rnn:
            with torch._dynamo.config.patch(allow_rnn=True):
                return module_wrapper(self, value)
        return module_wrapper(self, value)

    def requires_grad_(self, tx, requires_grad=True):
        if _gradient_asked_of_a_computed_value(tx, self, requires_grad):
            return self
        return method_requires_grad(self, tx, requires_grad)

    def set_attribute(self, tx, obj, name_var, val):
        if (name_var.is_python_constant() and name_var.as_python_constant() == "requires_grad"
                and _gradient_asked_of_a_computed_value(tx, obj, val)):
            return ConstantVariable.create(None)
        return set_attribute_call(self, tx, obj, name_var, val)

    def context_attribute(self, tx, name):
        if name == "saved_variables" and (_NAMING.capturing or _compiles_for(tx, _NAMED_FOR)):
            name = "saved_tensors"  # its deprecated alias, which Dynamo does not know
        return context_getattr(self, tx, name)

    refuse_skipped_frames_that_train()
    context_getattr = AutogradFunctionContextVariable.var_getattr
    AutogradFunctionContextVariable.var_getattr = context_attribute
    method_requires_grad = TensorVariable.method_requires_grad_
    set_attribute_call = SetAttrBuiltinVariable._call_setattr
    TensorVariable.method_requires_grad_ = requires_grad_
    SetAttrBuiltinVariable._call_setattr = set_attribute
    apply_and_name._fxdp_naming = True  # type: ignore[attr-defined]
    AutogradFunctionVariable.call_apply = apply_and_name
    module_wrapper = VariableBuilder.wrap_module
    VariableBuilder.wrap_module = wrap_module
    logger_call, attribute_call = LoggingLoggerVariable.call_method, GetAttrVariable.call_method
    LoggingLoggerVariable.call_method = for_fxdp(logger_call, _logged_at_capture(logger_call))
    GetAttrVariable.call_method = for_fxdp(attribute_call, _named_at_capture(attribute_call))


def compile_modules_in_place(is_fxdp_backend: Callable[[Any], bool]) -> None:
    """Make ``module.compile(backend=...)`` (``nn.Module.compile``) with an fxdp backend
    compile the module's call, also where its ``forward`` is ``torch.nn``'s own code.

    ``nn.Module.compile`` hands ``torch.compile`` the bound ``self._call_impl``, and
    Dynamo skips ``torch.nn``'s frames: ``nn.Sequential(...).compile(backend=...)``
    compiled nothing, with any backend, and with fxdp's the model trained eagerly,
    unclipped, and no fxdp code ran that could notice. ``torch.compile(module)`` calls
    such a module through a frame of its own that Dynamo traces (``wrap_inline``); so
    does ``torch.compile``'s context here, given a module's ``_call_impl`` to compile for
    an fxdp backend. The context is built after Dynamo looked the backend up, so this
    holds also where ``backend="fxdp"`` imports fxdp within that very call. Other
    backends keep PyTorch's behaviour."""
    from torch._dynamo.eval_frame import OptimizeContext

    wrap = OptimizeContext.__call__
    if getattr(wrap, "_fxdp", False):
        return

    def __call__(self, fn):
        if (isinstance(fn, types.MethodType) and fn.__func__ is torch.nn.Module._call_impl
                and _backend_recognised(self.callback, [is_fxdp_backend])):
            call = fn

            def call_module(*args, **kwargs):
                return call(*args, **kwargs)

            return wrap(self, call_module)
        return wrap(self, fn)

    __call__._fxdp = True  # type: ignore[attr-defined]
    OptimizeContext.__call__ = __call__


def compile_library_modules_under_ddp(is_fxdp_backend: Callable[[Any], bool]) -> None:
    """Make ``torch.compile(DistributedDataParallel(module))`` with an fxdp backend compile
    ``module`` also where its ``forward`` is ``torch.nn``'s own code (``nn.Sequential``).

    Dynamo skips DDP's ``forward`` and compiles the module DDP calls as a frame of its
    own; a ``torch.nn`` module's ``forward`` is skipped too, with any backend, and with
    fxdp's the model trained eagerly, unclipped, and no fxdp code ran that could notice.
    Compiling for an fxdp backend, DDP now calls such a module through a frame Dynamo
    traces, as ``torch.compile(module)`` does (``wrap_inline``); DDP's own work around
    the call (its active-module marker, which Dynamo's DDPOptimizer reads) is kept.
    Other backends, and modules of other code, keep PyTorch's behaviour."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # a build without torch.distributed
        return
    from torch._dynamo import trace_rules
    from torch._dynamo.decorators import skip

    run_forward = DistributedDataParallel._run_ddp_forward
    if getattr(run_forward, "_fxdp", False):
        return

    def _run_ddp_forward(self, *inputs, **kwargs):
        callback = torch._C._dynamo.eval_frame.get_eval_frame_callback()
        if not (callback and _backend_recognised(callback, [is_fxdp_backend])
                and trace_rules.check(self.module.forward)):
            return run_forward(self, *inputs, **kwargs)
        if self._use_python_reducer:
            return _call_traced(self.module, inputs, kwargs)
        with self._inside_ddp_forward():
            return _call_traced(self.module, inputs, kwargs)

    # Dynamo skips this frame, as it skips DDP's own, and compiles the frames it calls.
    _run_ddp_forward = skip(_run_ddp_forward)
    _run_ddp_forward._fxdp = True  # type: ignore[attr-defined]
    DistributedDataParallel._run_ddp_forward = _run_ddp_forward


def _call_traced(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """``module(*args, **kwargs)`` in a frame of fxdp's code, which Dynamo compiles."""
    return module(*args, **kwargs)


def _gradient_asked_of_a_computed_value(tx: Any, tensor: Any, requires_grad: Any) -> bool:
    """Whether, capturing for fxdp, ``tensor.requires_grad_()`` (or ``tensor.requires_grad
    = True``) asks for the gradient of a tensor the forward computed: a call fxdp's
    capture drops. It only makes autograd compute that value's gradient, which nothing
    outside the forward can read and no parameter's gradient depends on; Dynamo cannot
    capture it (wav2vec2's feature encoder sets it on the audio for gradient
    checkpointing; Hugging Face's ``enable_input_require_grads`` on the input
    embeddings). A graph input's flag is the caller's, and stays Dynamo's to refuse."""
    from torch._dynamo.variables import ConstantVariable, TensorVariable

    wanted = requires_grad is True or (isinstance(requires_grad, ConstantVariable)
                                       and requires_grad.as_python_constant() is True)
    return (wanted and isinstance(tensor, TensorVariable) and tensor.source is None
            and (_NAMING.capturing or _compiles_for(tx, _NAMED_FOR)))


def refuse_skipped_frames_that_train() -> None:
    """Make Dynamo raise where it would skip a frame, compiling for fxdp, whose code
    uses trainable parameters that no other compiled frame reaches.

    Dynamo skips a whole function it cannot resume after a graph break (one inside a
    ``for``/``while`` loop or a ``try`` block) and runs it eagerly. The parameters its
    code reads through ``self``, directly or through ``torch.nn``'s own modules (whose
    code Dynamo never compiles on its own), then got ordinary, unclipped gradients, and
    where that was the whole ``forward`` no fxdp code ran that could notice. A module
    of the user's own reached from there is compiled as a frame of its own and left to
    the backend's checks; so is a skip with gradients off (an evaluation), where the
    eager run is harmless: that skip is for the one call, so that a training call of
    the same code is checked too. ``fullgraph=True`` (``fxdp.transform``) raises
    Dynamo's own error anyway."""
    from torch._dynamo.convert_frame import ConvertFrameAssert
    from torch._dynamo.exc import Unsupported
    from torch._dynamo.types import ConvertFrameReturn, FrameAction, FrameExecStrategy

    convert = ConvertFrameAssert.__call__
    if getattr(convert, "_fxdp_guard", False):
        return

    def __call__(self, frame, cache_entry, hooks, frame_state, *, skip=0):
        try:
            return convert(self, frame, cache_entry, hooks, frame_state, skip=skip + 1)
        except Unsupported as error:
            if self._one_graph or not _backend_recognised(self._torchdynamo_orig_backend, _NAMED_FOR):
                raise
            names = _parameters_run_eagerly(frame)
            if not names:
                raise
            if not torch.is_grad_enabled():
                # Eagerly this time, but not for good (Dynamo's default): a training call
                # of the same code must come back here.
                return ConvertFrameReturn(FrameExecStrategy(FrameAction.SKIP, FrameAction.DEFAULT),
                                          apply_to_code=False, skip_reason=str(error))
            from fxdp.errors import UnsupportedError

            code = frame.f_code
            reasons = [str(e).strip().splitlines()[0] for e in (error, error.__cause__) if e is not None and str(e)]
            sized_by_data = any("Dynamic shape operator" in r for r in reasons)
            raise UnsupportedError(
                f"fxdp: Dynamo cannot compile {code.co_qualname} ({code.co_filename}:{code.co_firstlineno}) "
                f"and would run it eagerly, outside any fxdp graph: {', '.join(names)} would get "
                f"ordinary, unclipped gradients. Dynamo's reason: {'; '.join(dict.fromkeys(reasons))}. "
                "A graph break inside a for/while loop or a try block makes Dynamo skip the whole "
                "function: remove the break (torch._dynamo.explain shows it) or use "
                "fxdp.transform, which compiles with fullgraph=True."
                + (" An op whose output size depends on the data (nonzero, x[mask]) breaks the graph "
                   "unless torch._dynamo.config.capture_dynamic_output_shape_ops is True: set it, and "
                   "fxdp follows the op." if sized_by_data else "")) from error

    __call__._fxdp_guard = True  # type: ignore[attr-defined]
    ConvertFrameAssert.__call__ = __call__


def _parameters_run_eagerly(frame: Any) -> list[str]:
    """The trainable parameters that a skipped frame's code reaches through the modules
    it is given or names: its arguments (the first one ``self``), the variables it closes
    over and the globals its code reads, and modules one step from those
    (``_modules_held``). A ``torch.nn`` module there runs eagerly with all of its own
    (``model(x)`` of an ``nn.Sequential``); of a module of other code, whose ``forward``
    Dynamo compiles as a frame of its own, only the parameters and ``torch.nn``
    submodules the code names (``self.fc``, ``self.layers``), with those of ``torch.nn``'s
    modules under them, down to the first module of other code."""
    code = frame.f_code
    arguments = code.co_argcount + code.co_kwonlyargcount
    arguments += bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    owners = {name: frame.f_locals.get(name) for name in (*code.co_varnames[:arguments], *code.co_freevars)}
    owners.update((name, frame.f_globals[name]) for name in code.co_names if name in frame.f_globals)
    names: list[str] = []
    for owner_name, owner in _modules_held(owners, code.co_names):
        prefix = "" if owner_name == "self" else owner_name
        if _library_module(owner):
            names += _library_parameters(owner, prefix)
            continue
        dot = f"{prefix}." if prefix else ""
        for name in dict.fromkeys(code.co_names):
            param = owner._parameters.get(name)
            if param is not None and param.requires_grad:
                names.append(f"{dot}{name}")
            elif name in owner._modules and owner._modules[name] is not None:
                names += _library_parameters(owner._modules[name], f"{dot}{name}")
    return list(dict.fromkeys(names))


def _modules_held(owners: dict[str, Any], attributes: Sequence[str]):
    """``(name, module)`` for each module among ``owners``, each module in a list, tuple
    or dict among them (``step(models, x)`` calling ``models[0](x)``), and each module an
    object among them holds under an attribute name the code reads (``trainer.model``;
    read from the object's ``__dict__``: no property runs)."""
    for name, owner in owners.items():
        if isinstance(owner, torch.nn.Module):
            yield name, owner
        elif isinstance(owner, (list, tuple)):
            yield from ((f"{name}[{i}]", m) for i, m in enumerate(owner) if isinstance(m, torch.nn.Module))
        elif isinstance(owner, dict):
            yield from ((f"{name}[{k!r}]", m) for k, m in owner.items() if isinstance(m, torch.nn.Module))
        else:
            held = getattr(owner, "__dict__", None)
            if isinstance(held, dict):
                yield from ((f"{name}.{a}", held[a]) for a in dict.fromkeys(attributes)
                            if isinstance(held.get(a), torch.nn.Module))


def _library_module(module: torch.nn.Module) -> bool:
    return type(module).__module__.startswith("torch.nn.")


def _library_parameters(module: torch.nn.Module, prefix: str) -> list[str]:
    """The trainable parameters of ``module``, if it is one of ``torch.nn``'s own, and of
    ``torch.nn``'s modules under it, down to the first module of other code, named under
    ``prefix``: what runs eagerly with it, as Dynamo compiles no frame of ``torch.nn`` on
    its own (a module of other code has a ``forward`` of its own that Dynamo compiles)."""
    if not _library_module(module):
        return []
    dot = f"{prefix}." if prefix else ""
    found = [f"{dot}{n}" for n, p in module.named_parameters(recurse=False) if p.requires_grad]
    for child_name, child in module.named_children():
        found += _library_parameters(child, f"{dot}{child_name}")
    return found


def _backend_recognised(backend: Any, recognisers: list[Callable[[Any], bool]]) -> bool:
    """Whether ``backend`` is one a recogniser accepts, through Dynamo's wrappers around
    it: its debug wrappers, and a frame callback's chain of converters down to it."""
    for _ in range(8):
        if backend is None:
            return False
        if any(recognise(backend) for recognise in recognisers):
            return True
        backend = (getattr(backend, "compiler_fn", None) or getattr(backend, "__wrapped__", None)
                   or getattr(backend, "_torchdynamo_orig_backend", None))
    return False


def _compiles_for(tx: Any, recognisers: list[Callable[[Any], bool]]) -> bool:
    """Whether the backend Dynamo captures for (``tx.output.compiler_fn``, through its
    debug wrappers) is one that a recogniser accepts."""
    return _backend_recognised(getattr(getattr(tx, "output", None), "compiler_fn", None), recognisers)


def _node_of(variable: Any) -> fx.Node | None:
    from torch._dynamo.variables import TensorVariable

    return variable.as_proxy().node if isinstance(variable, TensorVariable) else None


def _name_function_call(cls: type, args: list, result: Any) -> None:
    """``meta["fxdp_function"] = (cls, {apply argument index: operand index})`` on the
    ``autograd_function_apply`` node that produced ``result``."""
    import operator

    hop = torch.ops.higher_order.autograd_function_apply
    for item in getattr(result, "items", [result]):
        node = _node_of(item)
        if node is not None and node.target is operator.getitem and getattr(node.args[0], "target", None) is hop:
            call = node.args[0]
            operands = list(call.args[2:])
            positions = {}
            for k, a in enumerate(args):
                arg = _node_of(a)
                position = next((i for i, o in enumerate(operands) if arg is not None and o is arg), None)
                if position is not None:
                    positions[k] = position
            call.meta["fxdp_function"] = (cls, positions)
            return


def incompatible_keys(missing: list[str], unexpected: list[str]) -> Any:
    """What ``load_state_dict`` hands its post hooks (and returns): ``nn.Module``'s
    ``_IncompatibleKeys`` of these lists."""
    return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


def fake_mode_of(values: Sequence[Any]):
    """The fake mode of the first fake tensor in ``values`` (Dynamo's example values)."""
    from torch._subclasses.fake_tensor import FakeTensor

    for v in values:
        if isinstance(v, FakeTensor):
            return v.fake_mode
    raise ValueError("fxdp found no fake tensor among the graph's example values")


def make_fx_traced(fn: Callable, args: Sequence[Any], *, fake_mode, pre_dispatch: bool = False,
                   decompositions: dict | None = None) -> fx.GraphModule:
    """Trace ``fn`` to an ATen graph with ``make_fx`` inside ``fake_mode``, keeping node meta.

    A size the data decides (a slice at bounds read from a buffer with ``.item()``)
    gets a fresh unbacked symbol for each value computed from it, which make_fx would
    want bound to an output of the op that made it; as AOTAutograd's own retrace, this
    one leaves them unbound: the graphs are traced again, by AOTAutograd, before they
    run."""
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    shape_env = fake_mode.shape_env
    fresh = shape_env.ignore_fresh_unbacked_symbols() if shape_env is not None else contextlib.nullcontext()
    with fake_mode, fx_traceback.preserve_node_meta(), fresh:
        return make_fx(fn, decomposition_table=decompositions or {}, pre_dispatch=pre_dispatch)(*args)


@contextlib.contextmanager
def annotate(info: dict):
    """Nodes traced inside get ``node.meta["custom"]`` = ``info``."""
    from torch.fx import traceback as fx_traceback

    with fx_traceback.annotate(info):
        yield


def inductor_decompositions() -> dict:
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inductor_compile(gm: fx.GraphModule, example_inputs: Sequence[Any],
                     backward_compiler: Callable, forward_observer: Callable = lambda g: None) -> Callable:
    """Compile with Inductor; ``backward_compiler(gm, example_inputs, inner)`` builds the backward.

    ``inner(gm, example_inputs)`` is Inductor's own graph compiler with the keyword
    arguments it was given for the backward.
    """
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(g, inputs, **kwargs):
        if kwargs.get("is_backward"):
            return backward_compiler(g, inputs, lambda g2, i2: _inductor_or_uncompiled(g2, i2, kwargs))
        forward_observer(g)
        return compile_fx_inner(pin_conv_operands_of_two_layouts(clone_overlapping_write_targets(g), backward=False),
                                inputs, **kwargs)

    from torch._inductor import config as inductor_config

    # The AOTAutograd cache keys on the Dynamo graph, not on the rewritten backward.
    # Layout optimisation would hand the backward a channels-last copy of a conv weight
    # instead of the parameter itself (results are stored on the parameters the
    # backward receives); it also measured slower here: Inductor's CPU kernels for the
    # per-channel reductions of the per-sample rules gather over channels-last data.
    with functorch_config.patch(enable_autograd_cache=False, donated_buffer=False), \
            inductor_config.patch(layout_optimization=False, joint_custom_pre_pass=_sizes_from_the_forward_pass()):
        return compile_fx(gm, list(example_inputs), inner_compile=inner_compile)


def _inductor_or_uncompiled(gm: fx.GraphModule, example_inputs: Sequence[Any], kwargs: dict) -> Callable:
    """The rewritten backward compiled by Inductor, or, where Inductor's lowering guards
    on a size only the data decides, run as it is, with a warning.

    Works around Inductor (torch 2.13): lowering a batched matmul whose operand has such
    a size (the per-sample gradient of a linear layer over ``x[:, i:i + 1]`` with
    ``i = int(k)``) asks whether it is 1 and raises ``GuardOnDataDependentSymNode``
    ("is_preferred_layout_as_bmm_input"). The graph is the same either way; only its
    speed differs.
    """
    import warnings

    from functorch.compile import make_boxed_func
    from torch._inductor.compile_fx import compile_fx_inner
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    prepared = pin_conv_operands_of_two_layouts(clone_overlapping_write_targets(gm), backward=True)
    try:
        return compile_fx_inner(prepared, example_inputs, **kwargs)
    except Exception as error:  # Inductor wraps the guard's error
        cause: BaseException | None = error
        while cause is not None and not isinstance(cause, GuardOnDataDependentSymNode):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        warnings.warn("fxdp: Inductor cannot compile this backward (its lowering guards on a size "
                      f"the data decides: {str(cause).splitlines()[0]}); it runs uncompiled, "
                      "exactly, only slower. compiler='eager' gives the same without the attempt.",
                      stacklevel=2)
        return make_boxed_func(views_as_reshapes(gm).forward)


def sizes_from_the_forward(graph: fx.Graph) -> None:
    """Every size read off a tangent that only the data decides (``x[:, i:i + 1]`` with
    ``i = int(k)``) read off the forward output the tangent belongs to instead.

    Works around AOTAutograd (torch 2.13): the tangents carry the symbols of the first
    trace, the joint graph's forward those of its own retrace, so a size the backward
    asks a tangent for (a marker's backward reshaping its output gradient; plain
    AOTAutograd never asks) has a symbol no forward node computes, and the partitioner
    makes the forward save the backward's ``sym_size`` node: "Node sym_size_int_1 was
    invalid, but is output". Which output a tangent belongs to is AOTAutograd's own
    record: the descriptor of each placeholder and output (a tangent's names its output).
    """
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    nodes = list(graph.nodes)
    tangents = [n for n in nodes if n.op == "placeholder" and str(n.target).startswith("tangents")]
    reads = [n for n in nodes if n.target is torch.ops.aten.sym_size.int and n.args[0] in tangents
             and isinstance(n.meta.get("val"), torch.SymInt) and free_unbacked_symbols(n.meta["val"])]
    if not reads:
        return
    forward: set[fx.Node] = set()
    for n in nodes:
        if n.op != "output" and n not in tangents and all(a in forward for a in n.all_input_nodes):
            forward.add(n)
    computed = {n.meta["val"].node.expr for n in forward if isinstance(n.meta.get("val"), torch.SymInt)}
    owner = _tangent_owners(graph, tangents)
    for read in reads:
        if read.meta["val"].node.expr in computed:
            continue
        out, dim = owner.get(read.args[0]), read.args[1]
        if out is None:
            continue
        size = out.meta["val"].shape[dim]
        if not isinstance(size, torch.SymInt) or not free_unbacked_symbols(size) <= {
                s for e in computed for s in getattr(e, "free_symbols", ())}:
            continue
        with graph.inserting_after(out):
            source = graph.call_function(torch.ops.aten.sym_size.int, (out, dim))
        source.meta["val"] = size
        read.replace_all_uses_with(source)
        graph.erase_node(read)


def _tangent_owners(graph: fx.Graph, tangents: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Each tangent's forward output, from the descriptors AOTAutograd gives the joint
    graph's placeholders (a ``TangentAOTInput`` names its output) and output (one per
    result); none where a descriptor is missing."""
    from torch._functorch._aot_autograd.descriptors import TangentAOTInput

    output = next(n for n in graph.nodes if n.op == "output")
    results = dict(zip(output.meta.get("desc", ()), output.args[0]))
    owners = {}
    for t in tangents:
        desc = t.meta.get("desc")
        out = results.get(desc.output) if isinstance(desc, TangentAOTInput) else None
        if isinstance(out, fx.Node) and isinstance(out.meta.get("val"), torch.Tensor):
            owners[t] = out
    return owners


@functools.cache
def _sizes_from_the_forward_pass() -> Any:
    """``sizes_from_the_forward`` as Inductor's joint-graph pass: a ``CustomGraphPass``,
    whose ``uuid`` keys Inductor's FX graph cache (a plain callable makes it bypass it)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class SizesFromTheForward(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            sizes_from_the_forward(graph)

        def uuid(self) -> str:
            return "fxdp.sizes_from_the_forward.2"

    return SizesFromTheForward()


def clone_overlapping_write_targets(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with a ``clone`` before every ``index_put`` into a tensor whose elements
    overlap (a broadcast: an ``expand``'s stride 0), for Inductor.

    Works around a PyTorch bug (torch 2.13, ``torch/_inductor/fx_passes/reinplace.py``):
    Inductor turns ``index_put(t, ...)`` into an in-place write into ``t``'s buffer when
    nothing reads that buffer later, without checking that ``t`` overlaps itself. On
    ``g.unsqueeze(1).expand(B, T, d)`` the write of one position lands in the ``g``
    row every position shares, so a masked position zeroes its whole row. A padding
    mask applied before a sum over time (``h[~mask] = 0; h.sum(1)``, Hugging Face's
    audio classification heads) has exactly that backward, and samples with padding
    got zero gradients. A clone gives the write a buffer of its own."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    aten = torch.ops.aten

    def overlaps_itself(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and any(
            statically_known_true(stride == 0) and not statically_known_true(size == 1)
            for size, stride in zip(t.shape, t.stride()))

    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (aten.index_put.default, aten._unsafe_index_put.default):
            continue
        target = node.args[0]
        if isinstance(target, fx.Node) and overlaps_itself(target.meta.get("val")):
            _read_through_copy(gm, node, target, aten.clone.default, (target,))
            changed = True
    if changed:
        gm.recompile()
    return gm


def pin_conv_operands_of_two_layouts(gm: fx.GraphModule, backward: bool) -> fx.GraphModule:
    """``gm`` with each activation a convolution reads copied first (``mul(x, 1)``) where
    its channels-first and channels-last strides address the same elements (one channel,
    or one spatial position), unless it is a forward input, for Inductor.

    Works around a PyTorch bug (torch 2.13, ``layout_optimization=False``, which
    :func:`inductor_compile` sets): such a tensor's real strides can differ from the ones
    Inductor planned in the size-1 dim, which ``assert_size_stride`` does not check; the
    convolution reading it picks its output's memory format from those strides, and the
    planned and real outputs then differ where it counts (``AssertionError: expected
    size 2==2, stride 6==1``). A one-channel 1x1 conv feeding another conv was enough;
    plain ``torch.compile`` fails the same way under that setting. Inductor writes the
    copy itself, in the layout it planned. The copy is of a one-channel or one-position
    tensor, so it costs next to nothing; ``clone`` would not do, Inductor drops it."""
    import math

    aten = torch.ops.aten
    read = {aten.convolution.default: (0,), aten.convolution_backward.default: (0, 1)}

    def two_layouts(t: Any) -> bool:
        return (isinstance(t, torch.Tensor) and t.dim() >= 3 and t.numel() > 0
                and (t.shape[1] == 1 or math.prod(t.shape[2:]) == 1))

    changed = False
    for node in list(gm.graph.nodes):
        for i in read.get(node.target, ()) if node.op == "call_function" else ():
            x = node.args[i]
            if (isinstance(x, fx.Node) and (x.op != "placeholder" or backward)
                    and two_layouts(x.meta.get("val"))):
                _read_through_copy(gm, node, x, aten.mul.Tensor, (x, 1))
                changed = True
    if changed:
        gm.recompile()
    return gm


def _read_through_copy(gm: fx.GraphModule, node: fx.Node, value: fx.Node, op: Any, args: tuple) -> None:
    """``node`` reading ``op(*args)``, a copy of ``value`` inserted before it, instead of
    ``value``. The copy gets only ``value``'s fake value: its ``tensor_meta`` strides
    would tell Inductor to lay the copy out as ``value`` (a broadcast's stride 0)."""
    with gm.graph.inserting_before(node):
        copy = gm.graph.call_function(op, args)
    copy.meta["val"] = value.meta["val"].clone()
    node.replace_input_with(value, copy)


def views_as_reshapes(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with its ``view`` calls made ``reshape`` where nothing writes through them
    and they are not outputs, for running on real tensors.

    The rules' code is traced on fake tensors, and ``reshape`` becomes ``view`` where
    the fake strides allow one. Some fake kernels promise other strides than the real
    ones (torch 2.13: ``native_layer_norm_backward`` of a transposed input keeps the
    gradient's strides on fake tensors and returns it contiguous on the CPU; wav2vec2's
    layer-normed feature encoder), and the ``view`` then fails at run time. A
    ``reshape`` is that view where the real strides allow it and a copy where not.
    Inductor needs none of this: it lays out every buffer itself."""
    from fxdp.passes.writes import is_view, writes_in_place

    def free(node: fx.Node) -> bool:
        return all(u.op == "call_function" and not writes_in_place(u.target) and (not is_view(u) or free(u))
                   for u in node.users)

    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default and free(node):
            node.target = torch.ops.aten.reshape.default
            changed = True
    if changed:
        gm.recompile()
    return gm


def _partition(joint: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any):
    """AOTAutograd's default partitioner after ``sizes_from_the_forward`` (the eager
    compiler's; Inductor runs the pass as its joint-graph pass)."""
    from torch._functorch.partitioners import default_partition

    sizes_from_the_forward(joint.graph)
    joint.recompile()
    return default_partition(joint, joint_inputs, **kwargs)


def eager_compile(gm: fx.GraphModule, example_inputs: Sequence[Any],
                  backward_compiler: Callable, forward_observer: Callable = lambda g: None) -> Callable:
    """AOTAutograd without Inductor: both graphs run as plain FX graphs."""
    from functorch.compile import make_boxed_func
    from torch._functorch import config as functorch_config
    from torch._functorch.aot_autograd import aot_module_simplified

    def fw(g, inputs):
        forward_observer(g)
        return make_boxed_func(g.forward)

    # AOTAutograd compiles the backward at the first backward(), from inside the user's
    # frames: in a compiled train step that is the eager code Dynamo resumes around
    # `loss.backward()`, where Dynamo would trace fxdp's compiler and the graphs it
    # returns as user code. Dynamo's own `aot_autograd` backends (Inductor's too) keep
    # it out the same way.
    @torch._dynamo.disable(reason="fxdp's backward compiler is not user code")
    def bw(g, inputs):
        compiled = backward_compiler(g, inputs, lambda g2, i2: make_boxed_func(views_as_reshapes(g2).forward))
        return torch._dynamo.disable(compiled, reason="fxdp's backward graph is not user code")

    with functorch_config.patch(enable_autograd_cache=False, donated_buffer=False):
        compiled = aot_module_simplified(gm, list(example_inputs), fw_compiler=fw, bw_compiler=bw,
                                         partition_fn=_partition)
    return torch._dynamo.disable(compiled, reason="fxdp's compiled graphs are not user code")


def inline_checkpoints(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace Dynamo's ``tag_activation_checkpoint`` calls by their bodies.

    The checkpointed ops become ordinary ops (they are then saved, not recomputed):
    per-sample rules need to see them, and the higher-order op does not survive
    ``make_fx(pre_dispatch=True)``.
    """
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    bodies = []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and hop is not None and node.target is hop:
            bodies.append(node.args[0])
            _replace_by_call(gm, node, _call_body, (getattr(gm, node.args[0].target), *node.args[1:]))
    if bodies:
        erase_unused(gm, bodies)
        gm.recompile()
    return gm


def nodes_with_bodies(gm: fx.GraphModule):
    """The nodes of ``gm`` and of the graphs it holds as submodules (the bodies of
    higher-order ops: a checkpointed region, a ``wrap``)."""
    yield from gm.graph.nodes
    for body in gm.children():
        if isinstance(body, fx.GraphModule):
            yield from nodes_with_bodies(body)


_TRANSFORM_ENTER = ("_vmap_increment_nesting", "_grad_increment_nesting")
_TRANSFORM_EXIT = ("_vmap_decrement_nesting", "_grad_decrement_nesting")
_TRANSFORM_UNWRAP = ("_unwrap_for_grad", "_remove_batch_dim")  # a transform's results, as plain tensors
FORWARD_MODE_AD = ("_jvp_increment_nesting", "_enter_dual_level", "_make_dual")


def transform_regions_as_aten(gm: fx.GraphModule, fake_mode) -> fx.GraphModule:
    """Replace each ``torch.func`` transform of a Dynamo graph (``vmap``, ``grad``,
    ``jacrev``, …) by the ATen ops it runs.

    Dynamo inlines a transform as its function's ops between ``_vmap_increment_nesting``
    (``_grad_increment_nesting``) and the matching ``_decrement_nesting``, the inputs
    wrapped (``_add_batch_dim``, ``_wrap_for_grad``): the ops between see one slice of a
    hidden batch dim, or values of a nested autograd level (used after the level's exit
    too, by ``vjp``'s function: the region ends at their last use), and
    ``make_fx(pre_dispatch=True)`` (whose tracer sits above functorch) would keep the
    wrapped tensors as constants. Traced below functorch, as AOTAutograd traces it, the
    region is plain ATen code on whole tensors (vmap's batching rules, grad's backward
    formulas at work), which the batch analysis follows like any other; it runs as a
    submodule of ``gm``, called where the region was. Bodies of higher-order ops (a
    checkpointed region) are done first. Forward-mode AD (``FORWARD_MODE_AD``) is
    refused before this (``refuse_unfollowable``)."""
    for body in list(gm.children()):
        if isinstance(body, fx.GraphModule):
            transform_regions_as_aten(body, fake_mode)
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    # A region ends at its last exit, or later where a value wrapped inside it is used
    # after it: ``vjp``'s function, ``jacrev``'s vmap of it, run the backward of a level
    # already exited, on that level's values.
    regions, depth, start, until = [], 0, None, -1
    for i, node in enumerate(nodes):
        name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        if name in _TRANSFORM_ENTER:
            start = i if start is None else start
            depth += 1
        elif name in _TRANSFORM_EXIT and depth:
            depth -= 1
        elif depth and name not in _TRANSFORM_UNWRAP:
            until = max([until] + [index[u] for u in node.users if u.op != "output"])
        if start is not None and depth == 0 and i >= until:
            regions.append(nodes[start:i + 1])
            start, until = None, -1
    # A region whose last saved-tensor-hooks call re-enables them after a ``grad`` level
    # (Dynamo's ``_saved_tensors_hooks_enable``) takes the call that disabled them before
    # it too: traced apart from it, the disabling would stay in effect for good. (Nested
    # levels disable them again inside the region, to restore the outer level's state:
    # the outer level's own call still stands before the region.)
    hook_calls = ("_saved_tensors_hooks_enable", "_saved_tensors_hooks_disable")
    for k, region in enumerate(regions):
        names = [name for n in region if (name := getattr(n.target, "__name__", "")) in hook_calls]
        if names and names[-1] == "_saved_tensors_hooks_enable":
            first = index[region[0]]
            floor = index[regions[k - 1][-1]] + 1 if k else 0
            disable = max((j for j in range(floor, first) if getattr(nodes[j].target, "__name__", "")
                           == "_saved_tensors_hooks_disable"), default=None)
            if disable is not None:
                regions[k] = nodes[disable:index[region[-1]] + 1]
    for k, region in enumerate(regions):
        _region_as_aten(gm, region, f"_fxdp_transform_{k}", fake_mode)
    if regions:
        gm.graph.lint()
        gm.recompile()
    return gm


def _region_as_aten(gm: fx.GraphModule, region: list[fx.Node], name: str, fake_mode) -> None:
    """``region`` (consecutive nodes of ``gm``) traced without pre-dispatch into the
    submodule ``name``, whose call replaces it; its inputs' fake values are Dynamo's."""
    inside = set(region)
    inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    graph, env = fx.Graph(), {}
    for a in inputs:
        env[a] = graph.placeholder(a.name)
        env[a].meta.update(a.meta)
    for n in region:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[o] for o in outputs))
    body = fx.GraphModule(gm, graph)
    examples = [a.meta["example_value"] if "example_value" in a.meta else getattr(gm, a.target)
                for a in inputs]
    traced = make_fx_traced(fx.Interpreter(body).run, examples, fake_mode=fake_mode)
    # A batching rule may emit ``_unsafe_view`` of a value that is viewable only one
    # slice at a time (``vmap(grad(lambda r: linear(r).sum()))``: the ``[B, n, o]``
    # expand of the sum's gradient, strides ``(1, 0, 0)``, as ``[B·n, o]``): as the
    # ``reshape`` it stands for, which copies where a view cannot be taken.
    for node in traced.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten._unsafe_view.default:
            node.target = torch.ops.aten.reshape.default
    traced.recompile()
    gm.add_submodule(name, traced)
    first = next((n for n in region if n.meta.get("stack_trace")), region[0])
    with gm.graph.inserting_before(region[0]):
        call = gm.graph.call_module(name, tuple(inputs))
        call.meta.update({k: v for k, v in first.meta.items() if k != "example_value"})
        for i, out in enumerate(outputs):
            value = gm.graph.call_function(operator.getitem, (call, i))
            value.meta.update(out.meta)
            out.replace_all_uses_with(value)
    for n in reversed(region):
        gm.graph.erase_node(n)


def erase_unused(gm: fx.GraphModule, nodes: Sequence[fx.Node]) -> None:
    """Erase those of ``nodes`` that nothing uses (any more), once each.

    Not ``eliminate_dead_code`` on a Dynamo graph: FX takes its in-place calls whose
    result goes unused (``y.add_(b); return y``, ``F.relu(h, inplace=True)``) for
    dead code, and the write would vanish from the model."""
    for node in reversed(list(dict.fromkeys(nodes))):
        if not node.users:
            gm.graph.erase_node(node)


def _call_body(body, *args):
    return body(*args)


def _replace_by_call(gm: fx.GraphModule, node: fx.Node, target: Callable, args: tuple,
                     kwargs: dict | None = None) -> fx.Node:
    """A call of ``target`` takes ``node``'s place, meta and uses; ``node`` leaves."""
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(target, args, kwargs or {})
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return new


def graph_break_reason(gm: fx.GraphModule, brief: bool = False) -> str | None:
    """Dynamo's reason when ``gm`` ends at a graph break (``brief``: its first line only),
    and where, else ``None``."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    text = str(reason.reason).splitlines()[0] if brief else str(reason.reason)
    stack = getattr(reason, "user_stack", None) or []
    if not stack:
        return text
    frame = stack[-1]
    return f"{text} (at {frame.filename}:{frame.lineno}, in {frame.name}: {(frame.line or '').strip()})"


def breaks_at_backward(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` ends at a graph break where its code calls ``loss.backward()``,
    ``torch.autograd.backward`` or ``torch.autograd.grad`` (Dynamo traces none of them).

    Such a graph holds the whole forward of the loss it returns (an earlier break that
    split it would have been refused), so that backward runs one fxdp graph, as in a
    compiled train step. Read from Dynamo's message: another wording keeps the refusal."""
    reason = str(getattr(getattr(gm, "compile_subgraph_reason", None), "reason", ""))
    return reason.startswith(("Unsupported Tensor.backward() call", "using `torch.autograd.grad` with")) or (
        "function `backward` in file" in reason
        and os.path.join("torch", "autograd", "__init__.py") in reason)


# Dynamo's reasons for a break at a read of a tensor's value: the one call it then runs
# eagerly (``Tensor.item``, ``print``, the test of an ``if``) runs no code of the model's.
_DATA_READS = re.compile(r"Unsupported Tensor\.item\(\) call|Tensor\.tolist\(\)|Data-dependent branching|"
                         r"generic_jump TensorVariable|Failed to trace builtin operator\s+Explanation: Dynamo does "
                         r"not know how to trace builtin operator `(print|str|repr|format)`")


def breaks_at_a_data_read(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` ends at a graph break where the compiled function itself (not a
    function it calls: Dynamo would run all of that one eagerly) reads a tensor's value:
    ``loss.item()``, ``print(loss)``, ``if loss > 10:``."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    stack = getattr(reason, "user_stack", None) or []
    return len(stack) == 1 and _DATA_READS.match(str(getattr(reason, "reason", ""))) is not None


def _statement_receiver(code: Any, line: int, method: str) -> list | None:
    """The loads that read the receiver when line ``line`` of ``code`` is the statement
    ``<name>[.<attr>...].<method>(<constants>)`` and nothing else (but the jump past the
    other branches, in an ``if``), else ``None``."""
    import dis

    ops = [i for i in dis.get_instructions(code) if i.positions is not None and i.positions.lineno == line
           and i.opname not in ("RESUME", "NOP", "CACHE", "PUSH_NULL", "PRECALL", "KW_NAMES", "LOAD_CONST",
                                "JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_NO_INTERRUPT", "JUMP")]
    names = [i.opname for i in ops]
    if len(ops) < 4 or names[-2:] != ["CALL", "POP_TOP"] or ops[-3].argval != method or names[-3] not in (
            "LOAD_METHOD", "LOAD_ATTR"):
        return None
    loads = ops[:-3]
    if loads[0].opname not in ("LOAD_FAST", "LOAD_DEREF", "LOAD_GLOBAL", "LOAD_NAME") or any(
            i.opname != "LOAD_ATTR" for i in loads[1:]):
        return None
    return loads


def _clears_gradients_only(code: Any, line: int, frame_globals: dict, frame_locals: dict,
                           closure: Any) -> bool:
    """Whether line ``line`` of ``code`` is the statement ``<receiver>.zero_grad(...)`` of a
    torch optimizer or module (``opt.zero_grad()``, ``Optimizer.zero_grad`` being a
    function Dynamo must not trace) or of a known wrapper of one (``_CLEARING_WRAPPERS``),
    read in the frame's variables. It sets ``.grad`` to ``None`` or zero: no value is
    read, nothing computed that a gradient flows through."""
    import builtins

    loads = _statement_receiver(code, line, "zero_grad")
    if loads is None:
        return False
    first, missing = loads[0], object()
    if first.opname == "LOAD_GLOBAL":
        value = frame_globals.get(first.argval, getattr(builtins, first.argval, missing))
    else:
        value = frame_locals.get(first.argval, missing)
        if value is missing and first.opname == "LOAD_DEREF" and closure and first.argval in code.co_freevars:
            value = closure[code.co_freevars.index(first.argval)].cell_contents
    for load in loads[1:]:
        value = missing if value is missing else getattr(value, load.argval, missing)
    zero_grad = getattr(type(value), "zero_grad", None)
    return value is not missing and (zero_grad in (torch.optim.Optimizer.zero_grad, torch.nn.Module.zero_grad) or (
        getattr(zero_grad, "__module__", None), getattr(zero_grad, "__qualname__", None)) in _CLEARING_WRAPPERS)


# Other libraries' optimizer wrappers whose ``zero_grad`` clears gradients (and their own
# per-sample state) and then calls the wrapped optimizer's: known by name, as fxdp
# imports neither.
_CLEARING_WRAPPERS = {
    ("opacus.optimizers.optimizer", "DPOptimizer.zero_grad"),  # p.grad_sample, p.summed_grad
    ("accelerate.optimizer", "AcceleratedOptimizer.zero_grad"),
}


def breaks_at_zero_grad(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` ends at the first graph break of the function Dynamo compiles, at
    ``opt.zero_grad()`` in that function itself (see ``_clears_gradients_only``)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    stack = getattr(reason, "user_stack", None) or []
    compiling = _code_dynamo_compiles()
    if len(stack) != 1 or compiling is None:
        return False
    code, variables = compiling
    return _resumed(code) is None and _clears_gradients_only(
        code, stack[0].lineno, variables.get("globals") or {}, variables.get("locals") or {},
        variables.get("closure"))


# The breaks at ``backward()`` fxdp accepted: the original code object of the frame
# (not a resume function's) and the line, each.
_BACKWARD_BREAKS: set[tuple[Any, int]] = set()
# The breaks at a read of a value fxdp accepted, the same way, with Dynamo's reason.
_DATA_READ_BREAKS: dict[tuple[Any, int], str] = {}


def _compiled_code() -> Any:
    """The code object of the frame Dynamo is compiling now (a resume function's, after a
    graph break), or ``None``."""
    codes = torch._guards.TracingContext.get_traced_code() or []
    return codes[0] if codes else None


def _resumed(code: Any) -> tuple[Any, int] | None:
    """For a resume function Dynamo generated after a graph break: the original function's
    code and the line of the break (``torch_dynamo_resume_in_<function>_at_<line>``)."""
    from torch._dynamo.resume_execution import ContinueExecutionCache

    line = code.co_firstlineno
    if code not in ContinueExecutionCache.generated_code_metadata:
        return None
    while code in ContinueExecutionCache.generated_code_metadata:
        code = ContinueExecutionCache.generated_code_metadata[code].code
    return code, line


def _break_site(gm: fx.GraphModule) -> tuple[Any, int] | None:
    """The original code object and the line of the break ``gm`` ends at."""
    code = _compiled_code()
    stack = getattr(getattr(gm, "compile_subgraph_reason", None), "user_stack", None) or []
    if code is None or not stack:
        return None
    resumed = _resumed(code)
    return resumed[0] if resumed else code, stack[0].lineno


def record_backward_break(gm: fx.GraphModule) -> None:
    """Remember that ``gm`` (accepted) ends at ``backward()``: see ``after_backward``."""
    site = _break_site(gm)
    if site is not None:
        _BACKWARD_BREAKS.add(site)


def record_data_read(gm: fx.GraphModule) -> None:
    """Remember that ``gm`` (accepted) ends at a read of a value, and Dynamo's reason,
    for the message should the graph resumed after it be refused (``resumed_after``)."""
    site = _break_site(gm)
    if site is not None:
        _DATA_READ_BREAKS[site] = graph_break_reason(gm, brief=True) or ""


def after_backward() -> bool:
    """Whether the frame Dynamo compiles now resumes its function at or after the line of
    a break at ``backward()`` that fxdp accepted there (``record_backward_break``): what
    runs there runs after the clipping. (A loop around both would have made Dynamo skip
    the frame.)"""
    code = _compiled_code()
    resumed = None if code is None else _resumed(code)
    return resumed is not None and any(original is resumed[0] and line <= resumed[1]
                                       for original, line in _BACKWARD_BREAKS)


def in_optimizer() -> bool:
    """Whether the frame Dynamo compiles now is an optimizer's code (``Optimizer.step``
    breaks the graph on purpose, around the update it runs without gradients)."""
    code = _compiled_code()
    return code is not None and code.co_filename.startswith(os.path.join(os.path.dirname(torch.__file__), "optim"))


def _first_resume() -> bool:
    """Whether the resume function Dynamo compiles now is called by the function itself,
    not by a resume function (after an earlier break): its caller is the first frame
    outside torch (and this module's wrappers of it) on the stack above Dynamo's
    ``_compile``."""
    torch_dir = os.path.dirname(torch.__file__)
    frame = _frame_running("_compile", "convert_frame.py")
    while frame is not None and (frame.f_code.co_filename.startswith(torch_dir)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return frame is not None and not frame.f_code.co_name.startswith("torch_dynamo_resume_in_")


def _judged_resume() -> tuple[Any, int] | None:
    """``_resumed`` of the frame Dynamo compiles now, where fxdp judges what follows the
    break: not inside an optimizer's code, not after an accepted ``backward()``."""
    code = _compiled_code()
    resumed = None if code is None else _resumed(code)
    return None if resumed is None or in_optimizer() or after_backward() else resumed


def resumed_after() -> tuple[str, str | None, bool] | None:
    """Where the graph break is that the frame Dynamo compiles now resumes after, when
    that break is not a ``backward()`` fxdp accepted: ``"file:line"``; where fxdp
    accepted a read of a value there (``record_data_read``), Dynamo's reason for it; and
    whether the break was the function's first, at ``opt.zero_grad()``
    (``_clears_gradients_only``). Else ``None``.

    Dynamo runs the code at a break eagerly, without any backend (the call of a
    submodule it skipped, say, as it skips a frame with a break inside ``try``), and
    then compiles the rest of the function as a resume function; by then nothing marks
    the break in the graphs fxdp sees but that function's name. An optimizer's code is
    not judged."""
    code, resumed = _compiled_code(), _judged_resume()
    if resumed is None:
        return None
    compiling = _code_dynamo_compiles()
    cleared = compiling is not None and _first_resume() and _clears_gradients_only(
        resumed[0], resumed[1], compiling[1].get("globals") or {}, compiling[1].get("locals") or {},
        compiling[1].get("closure"))
    return f"{code.co_filename}:{resumed[1]}", _DATA_READ_BREAKS.get(resumed), cleared


def resumed_arguments() -> frozenset[str] | None:
    """For a graph Dynamo compiles in a function it resumes after a break (see
    ``resumed_after``): the names of the original function's arguments, which the
    resume function receives among the locals the code before the break computed.
    Else ``None``."""
    resumed = _judged_resume()
    if resumed is None:
        return None
    original = resumed[0]
    count = original.co_argcount + original.co_kwonlyargcount \
        + bool(original.co_flags & 0x04) + bool(original.co_flags & 0x08)  # *args, **kwargs
    return frozenset(original.co_varnames[:count])


def stored_outputs(gm: fx.GraphModule) -> dict[int, bool]:
    """The positions among ``gm``'s outputs of the tensors the forward stores into objects
    that outlive the call (``module.weight = w * mask``, ``self.cache["k"] = t``, an
    append to a module's list): Dynamo returns them from the graph and stores them after
    it runs. Each says whether it goes into the model's state: a module's buffers
    (``self.center = …`` of a registered buffer), or a place this call read an input
    from (an attribute, a list's or dict's entry), which the next call reads; not a
    plain attribute the forward only writes (a statistic stored to be reported). Read
    from the side effects of the frame Dynamo compiles; empty outside one.
    """
    from torch._dynamo.symbolic_convert import InstructionTranslator
    from torch._dynamo.variables import base
    from torch._dynamo.variables.lazy import LazyVariableTracker
    from torch._dynamo.variables.tensor import TensorVariable

    tx = InstructionTranslator.current_tx()
    if tx is None:
        return frozenset()
    side_effects = tx.output.side_effects
    stored: set[fx.Node] = set()

    def collector(into: set[fx.Node]) -> Callable[[base.VariableTracker], None]:
        def collect(variable: base.VariableTracker) -> None:
            # A value the forward never read (a module's other buffers, beside one it
            # reassigns) holds nothing it computed; asking its type would realise it, a new
            # input of the graph that the compiled code, built for the inputs before, lacks.
            if type(variable) is LazyVariableTracker and not variable.is_realized():
                return
            if isinstance(variable, TensorVariable):
                into.add(variable.as_proxy().node)
        return collect

    # Where the graph's inputs come from: a value stored where the forward read one is
    # the next call's input.
    read = [_source_name(getattr(n.meta.get("grapharg"), "source", None)) for n in gm.graph.nodes
            if n.op == "placeholder"]

    def is_read(place: str | None) -> bool:
        return place is not None and any(r is not None and (r == place or r.startswith((place + "[", place + ".")))
                                         for r in read)

    state: set[fx.Node] = set()
    for variable in side_effects._get_modified_vars():
        # An object the call creates reaches the caller only through one that existed,
        # or as a returned value.
        if not isinstance(variable.mutation_type, (base.AttributeMutationNew, base.ValueMutationNew)):
            base.VariableTracker.visit(collector(stored), variable, side_effects=side_effects)
            place = _source_name(variable.source)
            attributes = side_effects.store_attr_mutations.get(variable, {})
            for name, value in attributes.items():
                if is_read(None if place is None else f"{place}.{name}"):
                    base.VariableTracker.visit(collector(state), value, side_effects=side_effects)
            if not attributes and (is_read(place) or getattr(variable.source, "member", None) == "_buffers"):
                # a list's or dict's entries the forward read, or a module's buffers
                # (``Module.__setattr__`` of a buffer)
                base.VariableTracker.visit(collector(state), variable, side_effects=side_effects)
    outputs = gm.graph.output_node().args[0]
    return {i: node in state for i, node in enumerate(outputs) if node in stored}


def _source_name(source: Any) -> str | None:
    """Dynamo's name of where a value comes from (``L['self']._buffers['center']``)."""
    if source is None:
        return None
    try:
        name = source.name
        return name() if callable(name) else name
    except NotImplementedError:  # a source without a name (a transform's local): nowhere the forward reads
        return None


def outputs_need_grad(gm: fx.GraphModule) -> bool:
    """Whether a value ``gm`` returns needs a gradient (Dynamo's example values): a
    forward that turns gradients on itself (``with torch.enable_grad():``) does, even
    when it is called under ``torch.no_grad()``."""
    output = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    if output is None:
        return False
    values = [n.meta.get("example_value") for n in output.all_input_nodes]
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)


# The messages of fxdp's in-graph run-time checks (see ``loss_normaliser_pass``).
RUN_TIME_CHECKS = ("fxdp: samples keep different numbers of targets", "fxdp: the loss is divided by the sum of a mask",
                   "fxdp: an index into rows of several samples", "fxdp: rows a boolean mask selected over the batch",
                   "fxdp: masked_scatter fills every sample's masked positions",
                   "fxdp: x[mask] = rows fills every sample's masked positions",
                   "fxdp: the loss is a mean over the elements a boolean mask selected",
                   "fxdp: a shared index into rows of several samples",
                   "fxdp: a grouped matmul's offsets count the sorted keys",
                   "fxdp: elements a boolean mask selected over the batch")


def _modules_with_backward_hooks(model: torch.nn.Module | None) -> list[str]:
    """The names of ``model``'s modules with a backward hook (``register_full_backward_hook``,
    ``register_full_backward_pre_hook``, ``register_backward_hook``), and "every module"
    for a global one (``register_module_full_backward_hook``)."""
    from torch.nn.modules import module as module_globals

    names = [] if model is None else [
        f"'{name}'" if name else "the model" for name, m in model.named_modules()
        if m._backward_hooks or m._backward_pre_hooks]
    if module_globals._global_backward_hooks or module_globals._global_backward_pre_hooks:
        names.append("every module (a global hook)")
    return names


def _eager_experts_hint(model: torch.nn.Module | None) -> str:
    """A sentence for a Hugging Face model whose mixture of experts runs transformers'
    eager experts (a loop over ``expert_hit = (...).nonzero()``, whose length the data
    decides), or ``""``. The experts are the modules ``use_experts_implementation``
    decorated (with its ``has_gate`` and ``is_concatenated``): transformers 5 also says
    ``"eager"`` in the config of models without experts."""
    if not any(getattr(getattr(m, "config", None), "_experts_implementation", None) == "eager"
               and hasattr(m, "has_gate") and hasattr(m, "is_concatenated")
               for m in (model.modules() if model is not None else ())):
        return ""
    return (" This model's experts are transformers' eager ones (experts_implementation=\"eager\"), "
            "which loop over the experts hit: load or build it with experts_implementation=\"grouped_mm\" "
            "(the default) or \"batched_mm\", which fxdp follows exactly.")


def backend_error(error: BaseException, model: torch.nn.Module | None = None) -> BaseException | None:
    """What to raise instead of a Dynamo error from an fxdp compilation, or ``None``.

    Dynamo wraps the backend's exceptions in ``BackendCompilerFailed``; fxdp's own
    (``UnsupportedError``, ``ValueError``, ``TypeError``) are the user's answer. At the
    recompile limit ``fullgraph=True`` raises "Hard failure due to fullgraph=True"; at a
    graph break, Dynamo's ``Unsupported`` (its reason is quoted); where Dynamo itself
    fails, its ``InternalTorchDynamoError`` (quoted too); a guard on a value read from a
    tensor (``GuardOnDataDependentSymNode``, from Dynamo, or from AOTAutograd tracing a
    backward on such a size) and an op failing on Dynamo's fake tensors
    (``TorchRuntimeError``) are refusals that quote them as well, and so is PyTorch's
    ShapeEnv failing its own assertion on a size's bound while AOTAutograd traces a
    backward compiled for any size. A break at a module backward hook names the modules
    of ``model`` that hold one.
    """
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    from fxdp.errors import UnsupportedError

    if isinstance(error, torch._dynamo.exc.Unsupported) and "pack_padded_sequence" in str(error):
        return UnsupportedError(
            "fxdp cannot trace packed sequences (torch.nn.utils.rnn.pack_padded_sequence). Pad "
            "the batch instead, run the RNN on the padded tensor and read each sample's last "
            "real step with a mask, e.g. (out * mask[..., None]).sum(1)")
    def one_graph(why: str) -> UnsupportedError:
        return UnsupportedError("fxdp needs the model's forward as one graph (it compiles with "
                                f"fullgraph=True), and {why} Dynamo's reason: {error}")

    if isinstance(error, torch._dynamo.exc.Unsupported) and "enter a `lock` context manager" in str(error):
        return one_graph(
            "Dynamo cannot capture a `with` of a threading lock in it. transformers 5 takes one "
            "on a model's first call that asks for hidden states or attentions (its own heads "
            "may ask), to install its output-capturing hooks: call the model once before the "
            "transformed model's first call, e.g. under torch.no_grad() on one sample.")
    if isinstance(error, torch._dynamo.exc.Unsupported) and "torch.autograd.grad" in str(error) \
            and "autograd.Function" in str(error):
        return one_graph(
            "Dynamo does not capture torch.autograd.grad inside a torch.autograd.Function. In its backward "
            "(the adjoint method of ODE and SDE solvers: torchdiffeq's odeint_adjoint, torchsde's sdeint_adjoint, "
            "torchdyn's adjoint sensitivity) such a call takes the parameters' gradient of the whole batch at "
            "once, summed over the samples, which fxdp could not make per-sample even if it were captured. "
            "Backpropagate through the solver's steps instead (odeint, sdeint, torchdyn's "
            "sensitivity='autograd'), or write the backward without torch.autograd.grad.")
    if isinstance(error, torch._dynamo.exc.Unsupported) and "torch.autograd.grad" in str(error):
        return one_graph(
            "Dynamo does not capture torch.autograd.grad there (its hint, trace_autograd_ops=True, "
            "leads to gradients the compiled code takes itself, which fxdp cannot make per-sample). "
            "Write the derivative with torch.func, which fxdp follows exactly: each sample's input "
            "gradient as torch.func.vmap(torch.func.grad(lambda xi: u(xi).sum()))(x), or the whole "
            "batch's as torch.func.vjp(u, x) (a physics-informed residual, forces as -dE/dx).")
    hooked = _modules_with_backward_hooks(model) if isinstance(
        error, torch._dynamo.exc.Unsupported) else []
    if hooked and ("backwards hooks" in str(error) or "grad_fn" in str(error)):
        return UnsupportedError(
            f"fxdp cannot capture a module backward hook (registered on {', '.join(hooked)}): "
            "Dynamo traces register_full_backward_hook, register_full_backward_pre_hook and "
            "register_backward_hook only under compiled autograd, and fxdp computes each "
            "sample's gradient inside one compiled backward, where a module's grad_input and "
            "grad_output are not values a hook could see. Remove the hook while the transformed "
            "model trains (handle.remove()). To watch gradients, register a hook on a parameter "
            "(p.register_hook(fn) sees the gradient fxdp hands it), or read p.grad, "
            "p.grad_sample and the per-sample norms after "
            f"backward(). Dynamo's reason: {error}")
    data_dependent = isinstance(error, GuardOnDataDependentSymNode) or (
        isinstance(error, (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError))
        and any(f"{what} data-dependent expression" in str(error)
                for what in ("Could not guard on", "Could not extract specialized integer from")))
    if data_dependent:
        return one_graph(
            "Dynamo cannot capture it there: a Python value is read from a tensor's contents "
            "(int(t), t.item(), a size computed from values: how many rows a nonzero or x[mask] "
            "found, a loop over the values of a tensor) and then decides a branch, a loop or a "
            "shape. Compute it from Python values or sizes instead, or once before the transform; "
            "a branch that skips an op on no rows (a mixture of experts' `if token.shape[0] == 0: "
            "continue`) can go: the op computes nothing there; a loop over the experts some token "
            "chose can run over every expert (`for e in range(num_experts)`)."
            + _eager_experts_hint(model))
    if isinstance(error, (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)):
        return one_graph(
            "Dynamo cannot capture it there; change that code or move it out of the forward "
            "(a step done once, before the transform).")
    if isinstance(error, torch._dynamo.exc.InternalTorchDynamoError):
        if "SymNodeVariable() is not a constant" in str(error):
            why = ("a Python number the forward takes changed since the first call (a step count), so "
                   "Dynamo made it symbolic, and code there needs its value as a constant (a call such as "
                   "requires_grad_(step >= n) made in the forward). Do that outside the forward, between "
                   "steps (p.requires_grad_(...) before the call: fxdp gives frozen parameters no "
                   "gradient), or pass a value that does not change.")
        elif "PendingUnbackedSymbolNotFound" in str(error):
            why = ("a tensor's value is used as a Python number where the forward makes a tensor (a fill "
                   "value: x.new_full(size, t) or torch.full(size, t) with a 0-d tensor t, such as one entry of "
                   "a buffer). Pass a Python number there (float(t) computed once, before the transform, or a "
                   "constant), or build the tensor from t itself (t.expand(size)).")
        else:
            why = ("often code Dynamo calls on the model's own objects raises (a tuple subclass whose "
                   "__len__ raises, read by Dynamo's guards); pass plain values there.")
        return UnsupportedError(
            "fxdp needs the model's forward as one graph, and Dynamo failed while capturing it (plain "
            f"torch.compile(model, fullgraph=True) fails the same way): {why} Dynamo's error: {error}")
    if isinstance(error, torch._dynamo.exc.TorchRuntimeError):
        return UnsupportedError(
            "fxdp needs the model's forward as one graph, and an op failed while Dynamo captured it "
            "on fake tensors (plain torch.compile(model, fullgraph=True) fails the same way). Run the "
            "model on these inputs without fxdp first: if it fails there too, the error is the "
            "model's own (shapes or dtypes it does not accept); if it runs, Dynamo traces a Python "
            "value differently (a NumPy scalar used as an index becomes a float tensor): pass plain "
            f"Python ints there. Dynamo's error: {error}")
    if isinstance(error, torch._dynamo.exc.FailOnRecompileLimitHit):
        return UnsupportedError(recompile_limit_message("the model"))
    if type(error) is RuntimeError and any(check in str(error) for check in RUN_TIME_CHECKS):
        # The in-graph guards of a mean over kept targets or masks (``fxdp_same_kept_targets``,
        # ``fxdp_same_mask_sums``) can only raise what ``torch._assert_async`` raises.
        return UnsupportedError(str(error)[str(error).index("fxdp: ") + len("fxdp: "):])
    inner = getattr(error, "inner_exception", None) if isinstance(
        error, torch._dynamo.exc.BackendCompilerFailed) else None
    if isinstance(inner, GuardOnDataDependentSymNode):
        return UnsupportedError(
            "AOTAutograd cannot trace this model's backward: an op's backward decides on a size that "
            "depends on the data (of the elements a boolean mask selected, x[mask], or a nonzero), as "
            "PyTorch's backward of cumprod does, and plain torch.compile(model, fullgraph=True) then "
            "fails the same way. Compute on the whole tensor and select with torch.where(mask, f(x), "
            f"other) instead. Its reason: {inner}")
    if isinstance(inner, AssertionError) and "not a subset of src_bound" in str(inner):
        return UnsupportedError(
            "PyTorch's symbolic shapes fail on this model compiled for any input size (Dynamo compiles so at "
            "a second size): tracing the backward, AOTAutograd derives a bound for a size that is not within "
            "the size's own (a PyTorch bug: plain torch.compile(model, backend='aot_eager', fullgraph=True) "
            "fails the same way; transformers' Kosmos-2.5 meets it where it writes image embeddings into the "
            "tokens' through a boolean mask). Compile for each input size instead: set "
            "torch._dynamo.config.automatic_dynamic_shapes = False (each new shape compiles again, up to "
            "torch._dynamo.config.recompile_limit), or keep the input sizes fixed (pad to one length). "
            f"Its error: {inner}")
    return inner if isinstance(inner, (UnsupportedError, ValueError, TypeError)) else None


def in_double_backward() -> bool:
    """Whether AOTAutograd runs this backward for ``create_graph=True``.

    AOTAutograd then calls the compiled backward from ``CompiledFunction._double_backward``
    inside an autograd.Function forward (grad mode off), so ``torch.is_grad_enabled()``
    cannot tell; its frame on the stack can.
    """
    return _frame_running("_double_backward", "runtime_wrappers.py") is not None


def current_graph_task_id() -> int:
    return int(torch._C._current_graph_task_id())


def when_backward_ends(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the running ``backward()`` has accumulated every gradient (the
    engine's final callbacks; an exception it raises leaves ``backward()``). Only from
    inside a backward. Dynamo does not trace ``fn`` (a backward in a compiled train step
    runs it from the step's frame)."""
    torch.autograd.Variable._execution_engine.queue_callback(
        torch._dynamo.disable(fn, reason="fxdp's check after the backward is not user code"))


def recompile_limit_message(what: str, limit: str = "recompile_limit", reason: str | None = None) -> str:
    why = ("Dynamo's warning above names the last recompile's reason" if reason is None
           else f"The last recompile's reason: {reason}")
    return (
        f"Dynamo hit its recompile limit (torch._dynamo.config.{limit}) and would run {what} "
        f"eagerly, without the fxdp backward: its gradients would not be private. {why} "
        "(TORCH_LOGS=\"recompiles\" logs them all). A size "
        "mismatch at the batch dim means something read the batch size as an int, so each new size "
        "compiled anew (see \"Limits\" in the user guide). An nn.LSTM/nn.GRU/nn.RNN is unrolled per "
        "sequence length, so each new length compiles anew: pad every batch to one length (or a "
        "few). Otherwise raise the limit or keep input shapes/types stable.")


_GUARDED_CODE: "weakref.WeakSet" = weakref.WeakSet()


def _code_dynamo_compiles() -> tuple[Any, dict] | None:
    """The code object Dynamo is compiling, and the locals of its ``_compile(code, ...)``
    (frame ids would not do: ``torch._dynamo.reset()`` numbers frames anew)."""
    frame = _frame_running("_compile", "convert_frame.py")
    code = None if frame is None else frame.f_locals.get("code")
    return (code, frame.f_locals) if isinstance(code, types.CodeType) else None


def _frame_running(function: str, file_suffix: str) -> types.FrameType | None:
    """The innermost frame on the stack that runs ``function`` of a file whose name ends
    in ``file_suffix`` (a torch function fxdp is called from), or ``None``."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_code.co_filename.endswith(file_suffix):
            return frame
        frame = frame.f_back
    return None


def refuse_silent_eager_fallback() -> None:
    """Make Dynamo raise at its recompile limit, instead of running the frame whose graph
    is being compiled eagerly: that would bypass the fxdp backward and leave unclipped
    gradients.

    The ``torch.compile`` backend sees no call of its own, so the check is Dynamo's own
    recompile-limit test, wrapped once per process: it raises for the code the fxdp
    backend compiled a trainable graph of, called with gradients enabled. Every other
    frame keeps Dynamo's eager fallback: an evaluation under ``torch.no_grad()``, a
    compiled step's optimizer update after ``backward()`` (where a scheduler's learning
    rate is a new constant each step) and the user's other compiled code. Where this
    torch has no such test, every frame of the process raises.
    """
    convert_frame = torch._dynamo.convert_frame
    check = getattr(convert_frame, "exceeds_recompile_limit", None)
    compiling = _code_dynamo_compiles()
    if compiling is None or check is None:
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        return
    _GUARDED_CODE.add(compiling[0])
    if getattr(check, "fxdp_guard", False):
        return

    def exceeds_recompile_limit(cache_size, compile_id):
        exceeded, limit = check(cache_size, compile_id)
        # Without gradients (an evaluation) an eager run is harmless.
        compiling = _code_dynamo_compiles() if exceeded and torch.is_grad_enabled() else None
        if compiling is not None and compiling[0] in _GUARDED_CODE:
            code, reason = compiling[0], compiling[1].get("recompile_reason")
            raise torch._dynamo.exc.FailOnRecompileLimitHit("fxdp: " + recompile_limit_message(
                f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})", limit,
                reason if isinstance(reason, str) else None))
        return exceeded, limit

    exceeds_recompile_limit.fxdp_guard = True
    convert_frame.exceeds_recompile_limit = exceeds_recompile_limit


def stance_without_backend() -> str | None:
    """The ``torch.compiler.set_stance`` in force, if it lets Dynamo run a frame without
    the backend it was compiled with: eagerly (``"eager_on_recompile"`` at a new
    shape, ``"eager_then_compile"`` on the first call, ``"force_eager"``) or with
    another backend (``force_backend=``). ``None`` under the default and
    ``"fail_on_recompile"``. Dynamo reads the stance when a compiled function is called."""
    stance = torch._dynamo.eval_frame._stance
    if stance.stance not in ("default", "fail_on_recompile"):
        return f"torch.compiler.set_stance({stance.stance!r})"
    if stance.backend is not None:
        return f"torch.compiler.set_stance(force_backend={stance.backend!r})"
    return None


@contextlib.contextmanager
def eager_fallback_at_recompile_limit(allowed: bool):
    """A context in which Dynamo runs a frame eagerly at its recompile limit
    (``allowed``) or raises. (Set and restored by hand: ``config.patch`` costs four
    times as much, on every call of a model.)"""
    config = torch._dynamo.config
    previous = config.fail_on_recompile_limit_hit
    if previous == (not allowed):
        yield
        return
    config.fail_on_recompile_limit_hit = not allowed
    try:
        yield
    finally:
        config.fail_on_recompile_limit_hit = previous


def size_hint(size: Any) -> int:
    """A concrete size for decisions that guard nothing. A size that depends on the data
    (``x[:, mask]``) gets the shape environment's guess (Inductor's fallback for such
    sizes, within the size's known range)."""
    if isinstance(size, torch.SymInt):
        node = size.node
        if node.hint is not None:
            return int(node.hint)
        from torch._inductor import config as inductor_config

        return int(node.shape_env.optimization_hint(node.expr, fallback=inductor_config.unbacked_symint_fallback))
    return int(size)


def decided_size(size: Any) -> Any:
    """``size`` as an int where the shape environment's guards already decide its value
    (without a new guard, and without tracing a comparison: the backward's tracer does
    not know the forward's sizes), else ``size``."""
    if not isinstance(size, torch.SymInt) or size.node.hint is None:
        return size
    import sympy

    hint = int(size.node.hint)
    decided = size.node.shape_env._maybe_evaluate_static(sympy.Eq(size.node.expr, hint))
    return hint if decided is not None and bool(decided) else size


def plain_expression(size: Any) -> Any:
    """The sympy expression of a symbolic size or number, with the functions Dynamo
    writes float arithmetic with (``FloatTrueDiv(1.0, ToFloat(s0))`` for ``1.0 / B``)
    as plain division, powers and the value itself, so that sympy can simplify it."""
    from torch.utils._sympy.functions import (
        FloatPow,
        FloatTrueDiv,
        IntTrueDiv,
        PowByNatural,
        ToFloat,
    )

    expr = size.node.expr
    for division in (FloatTrueDiv, IntTrueDiv):
        expr = expr.replace(division, lambda a, b: a / b)
    for power in (FloatPow, PowByNatural):
        expr = expr.replace(power, lambda a, b: a ** b)
    return expr.replace(ToFloat, lambda a: a)


_SOLVES = {torch.linalg.solve, torch.linalg.solve_ex, torch.ops.aten.linalg_solve.default,
           torch.ops.aten.linalg_solve_ex.default, torch.ops.aten._linalg_solve_ex.default}


class _SolvesWithMatchingRanks(torch.overrides.TorchFunctionMode):
    """``linalg.solve(A, B)`` with ``A`` given as many leading dims as ``B``: the same
    solution. ``vmap``'s batch rule for ``_linalg_solve_ex`` (torch 2.13) mishandles an
    ``A`` that is not batched against a batched ``B`` of higher rank (a sample's
    ``[1, n, k]`` against a shared ``[n, n]``): run eagerly it fails, traced by
    ``make_fx`` it broadcasts the batch against ``B``'s leading dim and returns ``B``
    rows per sample. The factors and ``info`` it returns beside the solution keep the
    shapes of the ``A`` asked for."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func not in _SOLVES:
            return func(*args, **kwargs)
        args = (*args, *[kwargs.pop(name) for name in ("A", "B")[len(args):] if name in kwargs])
        a, b = (*args, None, None)[:2]
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and b.dim() > a.dim()):
            return func(*args, **kwargs)  # ranks that match, or a vector right-hand side
        out = func(a.reshape((1,) * (b.dim() - a.dim()) + tuple(a.shape)), b, *args[2:], **kwargs)
        if not isinstance(out, tuple):
            return out
        # (solution, LU, pivots, info) of _linalg_solve_ex; (solution, info) of solve_ex
        shapes = [a.shape, a.shape[:-1], a.shape[:-2]][3 - (len(out) - 1):]
        rest = [t.reshape(shape) for t, shape in zip(out[1:], shapes)]
        return type(out)((out[0], *rest))


def vmap_safe_solves() -> contextlib.AbstractContextManager:
    """Run linear solves so that ``vmap`` batches them right (see
    ``_SolvesWithMatchingRanks``): around every ``vmap`` fxdp runs over user code."""
    return _SolvesWithMatchingRanks()
