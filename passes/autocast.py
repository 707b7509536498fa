"""Autocast made explicit: the casts ``torch.autocast`` applies become ops of the graph.

Under autocast (entered around the call, or inside the forward) ``F.linear(x, w, b)``
runs as ``linear(x.to(bf16), w.to(bf16), b.to(bf16))``, but a pre-dispatch trace records
the op before autocast's casts. Rules would then see an float32 activation beside a
bfloat16 output gradient, and the casts of the parameters (whose gradients come back
in float32) would be invisible. This pass asks autocast itself, op by op, which
arguments it casts to which dtype, writes those casts into the graph, drops the
``_enter_autocast``/``_exit_autocast`` markers of regions inside the forward, and
retraces with autocast off. From then on the graph says everything: fxdp compiles and
runs it with autocast off (``no_autocast``), so it computes exactly what it shows.

A parameter cast (``w.to(bf16)``) is a parameter transform like a transpose: its
vector-Jacobian product casts the gradient back, which keeps each sample's norm, so
ghost norms stay available (``ISOMETRIC`` in ``passes/tag.py``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

from fxdp._torch_internals import make_fx_traced

__all__ = ["ambient_autocast", "no_autocast", "explicit_autocast_pass"]

aten = torch.ops.aten

_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu")
_ENTER = torch.amp.autocast_mode._enter_autocast
_EXIT = torch.amp.autocast_mode._exit_autocast


def ambient_autocast() -> dict[str, torch.dtype]:
    """Device type -> dtype of each autocast enabled where this is called."""
    state = {}
    for device in _DEVICE_TYPES:
        try:
            if torch.is_autocast_enabled(device):
                state[device] = torch.get_autocast_dtype(device)
        except RuntimeError:  # a device type this build does not know
            continue
    return state


@contextlib.contextmanager
def no_autocast(devices: Sequence[str]) -> Iterator[None]:
    """Autocast off for ``devices`` (those an explicit graph was made for)."""
    with contextlib.ExitStack() as stack:
        for device in devices:
            stack.enter_context(torch.autocast(device, enabled=False))
        yield


@contextlib.contextmanager
def _autocast(state: dict[str, torch.dtype | None]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device, dtype in state.items():
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=dtype is not None))
        yield


class _RecordCasts(TorchDispatchMode):
    """What autocast copies to another dtype (below the Autocast key, its casts arrive
    here as ``aten._to_copy``): which of ``watched`` (the op's arguments), and to which
    dtypes values computed inside the op (a composite op's sub-ops are cast one by one)."""

    def __init__(self, watched: list[torch.Tensor]):
        super().__init__()
        self.watched = watched
        self.casts: dict[int, torch.dtype] = {}
        self.inner: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._to_copy.default and args and "dtype" in kwargs:
            if any(args[0] is w for w in self.watched):
                self.casts[id(args[0])] = kwargs["dtype"]
            elif args[0].dtype != kwargs["dtype"]:
                self.inner.add(kwargs["dtype"])
        return func(*args, **kwargs)


_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)  # autocast leaves float64 alone


def _in_mode(value: Any, fake_mode) -> Any:
    """``value`` as a tensor of ``fake_mode`` (a graph constant may be real, or fake
    from another mode)."""
    if not isinstance(value, torch.Tensor) or getattr(value, "fake_mode", None) is fake_mode:
        return value
    with fake_mode:
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)


def _casts_of(node: fx.Node, state: dict, fake_mode) -> dict[int, torch.dtype]:
    """``id(argument value) -> dtype`` for the arguments autocast casts at ``node``.

    A composite op without an autocast kernel of its own (``einsum``) is cast inside,
    sub-op by sub-op; when every such cast goes to one dtype, its floating arguments
    are cast to that dtype up front, which is what its matrix products then see.
    """
    values = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    tensors: list[torch.Tensor] = []
    fx.node.map_aggregate(values, lambda v: tensors.append(v) if isinstance(v, torch.Tensor) else None)
    if not tensors:
        return {}
    own = {id(t): _in_mode(t, fake_mode) for t in tensors}
    recorder = _RecordCasts(list(own.values()))
    args, kwargs = fx.node.map_aggregate(values, lambda v: own[id(v)] if isinstance(v, torch.Tensor) else v)
    try:
        with fake_mode, _autocast(state), recorder:
            node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op fake tensors cannot run (data-dependent): no casts
        return {}
    # Reported by the graph's own values (``cast`` in the pass looks them up).
    by_value = {id(t): recorder.casts[id(own[id(t)])] for t in tensors if id(own[id(t)]) in recorder.casts}
    if not by_value and len(recorder.inner) == 1:
        (dtype,) = recorder.inner
        by_value = {id(t): dtype for t in tensors if t.dtype in _CASTABLE and t.dtype != dtype}
    return by_value


def _uses_autocast(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and n.target in (_ENTER, _EXIT) for n in gm.graph.nodes)


def explicit_autocast_pass(gm: fx.GraphModule, fake_args: Sequence[Any], *, fake_mode,
                           ambient: dict[str, torch.dtype]) -> fx.GraphModule:
    """The graph with autocast's casts as ``aten._to_copy`` nodes, traced with autocast off.

    Args:
        gm: A pre-dispatch ATen graph (recorded before autocast).
        fake_args: Its example inputs.
        fake_mode: Their fake mode.
        ambient: The autocast state the graph was captured under (``ambient_autocast``).
    """
    if not ambient and not _uses_autocast(gm):
        return gm
    graph = gm.graph
    state: dict[str, torch.dtype | None] = dict(ambient)
    saved: list[dict] = []
    markers: list[fx.Node] = []
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _ENTER:
            device, dtype, enabled = node.args[0], node.args[1], node.args[2]
            saved.append(dict(state))
            state[device] = (dtype or torch.get_autocast_dtype(device)) if enabled else None
            markers.append(node)
            continue
        if node.target is _EXIT:
            state = saved.pop() if saved else dict(ambient)
            markers.append(node)
            continue
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
            continue
        if not any(dtype is not None for dtype in state.values()):
            continue
        casts = _casts_of(node, state, fake_mode)
        if not casts:
            continue

        def cast(a: Any) -> Any:
            value = a.meta.get("val") if isinstance(a, fx.Node) else None
            dtype = casts.get(id(value)) if value is not None else None
            if dtype is None:
                return a
            with graph.inserting_before(node):
                new = graph.call_function(aten._to_copy.default, (a,), {"dtype": dtype})
            new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            with fake_mode:
                new.meta["val"] = _in_mode(value, fake_mode).to(dtype)
            return new

        node.args, node.kwargs = fx.node.map_arg((node.args, node.kwargs), cast)
    for node in reversed(markers):  # an exit before the enter it closes
        graph.erase_node(node)
    gm.recompile()
    devices = sorted(set(ambient) | {n.args[0] for n in markers if n.target is _ENTER})
    with no_autocast(devices):
        return make_fx_traced(fx.Interpreter(gm).run, fake_args, fake_mode=fake_mode, pre_dispatch=True)
