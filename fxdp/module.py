"""``fxdp.transform``: a model whose backward emits per-sample results."""
from __future__ import annotations

import functools
import inspect
import itertools
from typing import Any, Iterator

import torch
from torch import nn

from fxdp import _torch_internals as internals
from fxdp.backend import Backend
from fxdp.compiler import RUN_STATE, forward_arg_names, latest_record
from fxdp.errors import UnsupportedError
from fxdp.options import Options

__all__ = ["transform", "DPModule", "per_sample_norms"]


class DPModule(nn.Module):
    """The result of ``fxdp.transform``; shares parameters (and ``state_dict``) with the model.

    Attributes:
        per_sample_norms: ``[B]`` total L2 norm of each sample's gradient, last backward.
        clip_factors: ``[B]`` clip factors of the last backward (with ``max_grad_norm``).
        max_grad_norm: The clipping norm of the next backward, adjustable between steps.
    """

    def __init__(self, model: nn.Module, options: Options):
        super().__init__()
        # Not registered as a submodule: state_dict keys must be the model's own.
        object.__setattr__(self, "_module", model)
        object.__setattr__(self, "options", options)
        names = {id(p): n for n, p in model.named_parameters()}
        backend = Backend(options, names, forward_arg_names(model), guards_eager_fallback=False, model=model)
        object.__setattr__(self, "_backend", backend)

        # Training calls and forwards without gradients (evaluation under no_grad or
        # inference_mode) compile apart: the latter's graphs (a static and a symbolic
        # batch size, sizes 0 and 1, each grad mode) would otherwise use up the training
        # step's recompile limit.
        object.__setattr__(self, "_compiled", torch.compile(_calling(model), backend=backend, fullgraph=True))
        object.__setattr__(self, "_compiled_without_grad", torch.compile(_calling(model), backend=backend))
        # ``inspect.signature(dp.forward)`` is the model's: tools that pick the arguments to
        # pass by it (the Hugging Face Trainer drops the columns the forward does not name)
        # see the model.
        forward = functools.partial(DPModule.forward, self)
        forward.__signature__ = _signature(model)
        object.__setattr__(self, "forward", forward)

    @property
    def module(self) -> nn.Module:
        return self._module

    @torch.compiler.disable(recursive=False, reason=(
        "an fxdp.transform model compiles its own graphs: call it from a step compiled without "
        "fullgraph=True (the step's graph breaks around it, and the rest compiles), or compile the "
        "step with backend='fxdp' instead of transforming the model"))
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, nn.utils.rnn.PackedSequence) for a in (*args, *kwargs.values())):
            raise UnsupportedError(
                "fxdp cannot take a PackedSequence argument: its data interleaves the samples' "
                "steps, so it has no batch dim. Pass the padded batch instead ([B, T, ...] "
                "with the lengths or a mask), run the RNN on it and read each sample's last "
                "real step with the mask, e.g. (out * mask[..., None]).sum(1)")
        RUN_STATE.ran = False
        with_grad = torch.is_grad_enabled()
        if with_grad and self.options.grad_sample:
            for p in self._module.parameters():
                if not p.requires_grad and getattr(p, "grad_sample", None) is not None:
                    p.grad_sample = None  # frozen since an earlier step: it gets nothing now
        # Dynamo raises at its recompile limit for this model's training calls, instead of
        # running them eagerly without the fxdp backward; an evaluation run eagerly is
        # harmless. (A process-wide setting would reach the user's other compiled code.)
        with internals.capture_config(), internals.eager_fallback_at_recompile_limit(not with_grad):
            try:
                out = (self._compiled if with_grad else self._compiled_without_grad)(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - only unwraps, always re-raises
                _bind(self._module, args, kwargs)  # the model's TypeError, not Dynamo's
                inner = internals.backend_error(e, self._module)
                if inner is None:
                    raise
                raise inner from None
        if not getattr(RUN_STATE, "ran", False) and torch.is_grad_enabled() and any(
            p.requires_grad for p in self._module.parameters()
        ):
            stance = internals.stance_without_backend()
            raise UnsupportedError(
                "the fxdp-compiled graph did not run for this call (Dynamo ran the model eagerly, "
                + (f"under {stance}); its gradients would not be private. Use the default stance "
                   "while the model trains." if stance else
                   "e.g. after its recompile limit); its gradients would not be private. Raise "
                   "torch._dynamo.config.recompile_limit or keep input shapes/types stable."))
        return out

    # -- results of the last backward ---------------------------------------------------
    def _trainable(self) -> list[torch.Tensor]:
        return [p for p in self._module.parameters() if p.requires_grad]

    @property
    def per_sample_norms(self) -> torch.Tensor | None:
        rec = latest_record(self._trainable())
        return None if rec is None else rec.norms

    @property
    def clip_factors(self) -> torch.Tensor | None:
        rec = latest_record(self._trainable())
        return None if rec is None else rec.clip_factors

    @property
    def max_grad_norm(self) -> float | None:
        """The clipping norm ``C`` of the next backward. Set it between steps (adaptive
        clipping) without a new compile; ``options.max_grad_norm`` keeps the first."""
        return self._backend.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, c: float | None) -> None:
        self._backend.max_grad_norm = c

    # -- inspection -------------------------------------------------------------------
    def explain(self) -> "Any":
        """The graphs this model compiled, rewritten nodes annotated (see ``fxdp.explain``)."""
        from fxdp.explain import Explanation

        return Explanation(self._backend.records)

    # -- delegation: the wrapper is the model -------------------------------------------
    def state_dict(self, *args, **kwargs):
        return self._module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self._module.load_state_dict(*args, **kwargs)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """Held by a module (``self.model = fxdp.transform(...)`` in a LightningModule), the
        wrapper's keys are under its name there: its holder's ``load_state_dict`` loads them
        into the model, whose submodules are not the wrapper's, as ``nn.Module`` loads its
        own submodules (what is missing, unexpected or of another shape is reported under
        the holder's names)."""
        for hook in self._load_state_dict_pre_hooks.values():  # the wrapper's own, as nn.Module runs them
            hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        metadata = getattr(state_dict, "_metadata", None)
        assign = local_metadata.get("assign_to_params_buffers", False)

        def load(module: nn.Module, own: dict, prefix: str) -> None:
            module_metadata = {} if metadata is None else dict(metadata.get(prefix[:-1], {}))
            if assign:
                module_metadata["assign_to_params_buffers"] = assign
            module._load_from_state_dict(own, prefix, module_metadata, True, missing_keys, unexpected_keys,
                                         error_msgs)
            for name, child in module._modules.items():
                if child is not None:
                    load(child, {k: v for k, v in own.items() if k.startswith(f"{prefix}{name}.")},
                         f"{prefix}{name}.")
            incompatible = internals.incompatible_keys(missing_keys, unexpected_keys)
            for hook in module._load_state_dict_post_hooks.values():
                hook(module, incompatible)

        load(self._module, state_dict, prefix)

    def named_parameters(self, *args, **kwargs) -> Iterator:
        return self._module.named_parameters(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator:
        return self._module.parameters(recurse)

    def named_buffers(self, *args, **kwargs) -> Iterator:
        return self._module.named_buffers(*args, **kwargs)

    def buffers(self, recurse: bool = True) -> Iterator:
        return self._module.buffers(recurse)

    def children(self) -> Iterator:
        return self._module.children()

    def named_children(self) -> Iterator:
        return self._module.named_children()

    def modules(self) -> Iterator:
        return self._module.modules()

    def named_modules(self, *args, **kwargs) -> Iterator:
        return self._module.named_modules(*args, **kwargs)

    def train(self, mode: bool = True) -> "DPModule":
        self._module.train(mode)
        return self

    @property  # type: ignore[override]
    def training(self) -> bool:
        """The model's own flag: ``model.train()``/``eval()`` called on the model shows here."""
        module = self.__dict__.get("_module")
        return True if module is None else module.training

    @training.setter
    def training(self, mode: bool) -> None:
        module = self.__dict__.get("_module")
        if module is not None:  # (nn.Module.__init__ sets it before there is a model)
            module.training = mode

    def _apply(self, fn, recurse=True):
        self._module._apply(fn, recurse)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._module.zero_grad(set_to_none)
        for p in self._module.parameters():
            if hasattr(p, "grad_sample"):
                p.grad_sample = None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._module, name)

    # -- a container model (nn.Sequential): indexing, len and iteration reach it ----------
    def __getitem__(self, index: Any) -> Any:
        return self._module[index]

    def __len__(self) -> int:
        return len(self._module)

    def __iter__(self) -> Iterator:
        return iter(self._module)

    def __bool__(self) -> bool:  # a model without __len__ is still true, as any module
        return True

    def extra_repr(self) -> str:
        return f"options={self.options}\n(module): {self._module!r}"

    # -- copies: a transform of the copied model -----------------------------------------
    def __reduce__(self):
        """``copy.deepcopy``, ``pickle`` and ``torch.save`` copy the model and transform
        the copy with the same options (and the current ``max_grad_norm``); its graphs
        compile on its first call. Copying the compiled callables would keep them
        calling the original model, whose parameters would then get the gradients."""
        return _transformed, (self._module, self.options, self.max_grad_norm)


_TRANSFORMS = itertools.count()


def _signature(model: nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):  # a forward without one (a builtin)
        return None


def _bind(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Raise the ``TypeError`` of calling ``model`` with arguments its forward does not take."""
    signature = _signature(model)
    if signature is None:
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{type(model).__name__}.forward() {e}") from None


def _calling(model: nn.Module):
    """``model(*args, **kwargs)`` as a function with a code object of its own, and a name
    of its own: Dynamo keeps its compiled graphs, and counts recompiles against its
    limit, per code object, and with one shared by every transform the ninth model of a
    process would stop at the limit on its first call; what it learned of the sizes
    that change between calls (automatic dynamic shapes) it keeps by file, line and
    name, and with one name a transform would compile for any batch size on its first
    call because an earlier one saw another size."""
    def call(*args, **kwargs):
        return model(*args, **kwargs)

    name = f"fxdp_{type(model).__name__}_{next(_TRANSFORMS)}"
    call.__code__ = call.__code__.replace(co_name=name, co_qualname=name)
    return call


def _transformed(model: nn.Module, options: Options, max_grad_norm: float | None) -> DPModule:
    dp = DPModule(model, options)
    if max_grad_norm is not None:
        dp.max_grad_norm = max_grad_norm
    return dp


def transform(model: nn.Module, max_grad_norm: float | None = None, grad_sample: bool = False,
              loss_reduction: str = "mean", batch_first: bool = True, strict: bool = True,
              compiler: str = "inductor", **options: Any) -> DPModule:
    """Compile ``model`` so that one ``loss.backward()`` yields per-sample results.

    See DESIGN.md's table: ``p.grad`` (clipped with ``max_grad_norm``),
    ``p.grad_sample`` (with ``grad_sample=True``), ``per_sample_norms``,
    ``clip_factors``. Further options: ``in_dims`` (per positional argument, its
    batch dim or ``None``), ``memory_budget_bytes``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxdp.transform expects an nn.Module, got {type(model).__name__}")
    opts = Options.from_kwargs(dict(
        max_grad_norm=max_grad_norm, grad_sample=grad_sample, loss_reduction=loss_reduction,
        batch_first=batch_first, strict=strict, compiler=compiler, **options))
    _check_in_dims(model, opts.in_dims)
    return DPModule(model, opts)


def _check_in_dims(model: nn.Module, in_dims: tuple | frozenset | None) -> None:
    """Raise where ``in_dims`` names an argument the model's forward does not have: more
    entries than its positional parameters, a position past them, or a name that is none
    of its parameters (a typo, which would leave the size rule to decide silently)."""
    signature = _signature(model)
    if in_dims is None or signature is None:
        return
    kinds = {p.kind for p in signature.parameters.values()}
    positional = None if inspect.Parameter.VAR_POSITIONAL in kinds else len(forward_arg_names(model))
    takes_any_name = inspect.Parameter.VAR_KEYWORD in kinds
    names = set(signature.parameters)
    where = f"{type(model).__name__}.forward{signature}"
    if isinstance(in_dims, tuple):
        if positional is not None and len(in_dims) > positional:
            raise ValueError(f"in_dims has {len(in_dims)} entries, but {where} takes {positional} "
                             "positional argument(s)")
        return
    for key, _ in in_dims:
        if isinstance(key, int) and positional is not None and key >= positional:
            raise ValueError(f"in_dims names position {key}, but {where} takes {positional} positional "
                             "argument(s)")
        if isinstance(key, str) and not takes_any_name and key not in names:
            raise ValueError(f"in_dims names {key!r}, which is no parameter of {where}")


def per_sample_norms(model: nn.Module) -> torch.Tensor | None:
    """The per-sample norms of the last fxdp backward that covered ``model``'s parameters."""
    rec = latest_record([p for p in model.parameters() if p.requires_grad])
    return None if rec is None else rec.norms
