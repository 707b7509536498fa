"""The pipeline: one plain function that calls the passes in order, plus the thin
runtime wrappers that move the backward's extra outputs onto the parameters."""
from __future__ import annotations

import functools
import inspect
import itertools
import os
import re
import threading
import types
import warnings
import weakref
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import is_fake

from fxdp import _torch_internals as internals
from fxdp.batching import BatchDim
from fxdp.clip_norm import ClipNorm
from fxdp.errors import Problem, UnsupportedError, format_problems
from fxdp.options import Options
from fxdp.passes.autocast import ambient_autocast, no_autocast
from fxdp.passes.batch_dims import (
    _COPIES, SHAPED_LIKE, UNKNOWN, CountedKeys, SameCounts, batch_dim_pass, module_path_of, op_name, reached, source_of,
)
from fxdp.passes.canonicalize import _aliases, canonicalize_pass
from fxdp.passes.masked_rows import rows_in_place_pass
from fxdp.passes.chunk_loops import chunk_loops_as_whole_pass, unmapped_problems
from fxdp.passes.rewrite_backward import (BackwardPlan, backward_rewrite_pass, constant_gradients, gradient_outputs,
                                          stored_gradients, unmarked_gradients)
from fxdp.passes.tag import tag_pass
from fxdp.passes.writes import written_chain

__all__ = ["compile_graph", "CompiledGraph", "RUN_STATE", "latest_record", "analyse_graph", "forward_arg_names"]

# Set by every compiled fxdp forward; ``DPModule`` checks it to detect a silent
# eager fallback of Dynamo.
RUN_STATE = threading.local()
_step_counter = itertools.count(1)
# .record: the StepRecord of the latest fxdp backward. Not thread-local: autograd runs a
# backward's nodes on one thread per device, and a backward's graphs may span devices.
_LATEST = types.SimpleNamespace(record=None)


class CompiledGraph:
    """What one Dynamo graph became; kept for ``explain()``.

    Attributes:
        options: The options it was compiled with.
        stages: Stage name -> code, in order (captured, canonical, tagged, forward,
            backward, rewritten backward).
        annotated_backward: The rewritten backward's code, rewritten nodes annotated.
        plan: The backward plan (strategies, costs, rule counts), once the backward
            is compiled.
        problems: What was refused (``strict=False``).
        rule_counts: How often each rule fired in the tag pass.
        uses: The parameter uses the tag pass made (``fxdp.markers.UseInfo``): held
            here for the backward rewrite, which may run after the tagged graph is gone.
    """

    def __init__(self, options: Options):
        self.options = options
        self.stages: dict[str, str] = {}
        self.annotated_backward = ""
        self.plan: BackwardPlan | None = None
        self.problems: list[Problem] = []
        self.rule_counts: dict[str, int] = {}
        self.uses: list = []  # the graph's parameter uses (``UseInfo``), alive while it is
        self.param_names: list[str] = []

    def _stage(self, name: str, gm: fx.GraphModule) -> None:
        self.stages[name] = gm.code
        _dump(name, gm)


_dump_counter = itertools.count()


def _dump(stage: str, gm: fx.GraphModule) -> None:
    root = os.environ.get("FXDP_DEBUG_DIR")
    if not root:
        return
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, f"{next(_dump_counter):04d}_{stage}.py")
    with open(path, "w") as f:
        f.write(annotated_code(gm))


def annotated_code(gm: fx.GraphModule) -> str:
    """``gm.code`` with every node that carries ``meta["fxdp"]`` annotated at line end."""
    notes = {}
    for node in gm.graph.nodes:
        info = node.meta.get("fxdp")
        if info:
            notes[node.name] = info
    lines = []
    for line in gm.code.splitlines():
        m = re.match(r"\s+(\w+) = ", line)
        if m and m.group(1) in notes:
            info = notes[m.group(1)]
            note = ", ".join(f"{k}={v}" for k, v in info.items() if k != "use_ids")
            line = f"{line}  # fxdp: {note}"
        lines.append(line)
    return "\n".join(lines)


_SOURCE_KEY = re.compile(r"\['([^']+)'\]|\.([A-Za-z_]\w*)|\[(\d+)\]")
_SKIP = {"_modules", "_parameters", "_buffers"}


def source_name(node: fx.Node) -> str:
    grapharg = node.meta.get("grapharg")
    return grapharg.source.name if grapharg is not None and hasattr(grapharg.source, "name") else node.name


def _param_name(source: str) -> str:
    keys = [next(g for g in m.groups() if g is not None) for m in _SOURCE_KEY.finditer(source)]
    parts = [k for k in keys[1:] if k not in _SKIP]  # keys[0] is the frame's root (self, fn, ...)
    return ".".join(parts) or (keys[0] if keys else source)


def _argument_key(source: str, arg_names: Sequence[str], frame_names: frozenset = frozenset(),
                  varargs: tuple[str, int] | None = None) -> tuple[int | None, str | None] | None:
    """Which forward argument a placeholder comes from: ``(position, name)``, either
    ``None`` where unknown; ``None`` for a value that is no argument (a plain tensor
    attribute of a module, a closure or a global: model state, shared by all samples).

    ``transform`` calls the model as ``call(*args, **kwargs)`` (``L['args'][i]``,
    ``L['kwargs']['k']``); a Dynamo backend sees the forward's own frame (``L['x']``,
    one of ``frame_names``, or ``L['a'][i]`` for its ``*a``: ``varargs`` holds that name
    and the number of positional parameters before it). A tensor inside a tuple argument
    (an LSTM's ``(h, c)``) belongs to that argument.
    """
    m = re.match(r"L\['args'\]\[(\d+)\]", source)
    if m:
        position = int(m.group(1))
        return position, arg_names[position] if position < len(arg_names) else None
    m = re.match(r"L\['(\w+)'\]\[(\d+)\]", source)
    if m and varargs is not None and m.group(1) == varargs[0]:
        position = varargs[1] + int(m.group(2))
        return position, arg_names[position] if position < len(arg_names) else None
    m = re.match(r"L\['kwargs'\]\['(\w+)'\]", source) or re.match(r"L\['(\w+)'\]", source)
    if m and (source.startswith("L['kwargs']") or m.group(1) in frame_names):
        name = m.group(1)
        return (list(arg_names).index(name) if name in arg_names else None), name
    return None


def forward_arg_names(model: torch.nn.Module) -> tuple[str, ...]:
    """The names of ``model.forward``'s positional parameters, in order."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # a builtin or C++ forward has no signature
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in parameters if p.kind in kinds)


def _frame_arg_names() -> tuple[list[str], frozenset, tuple[str, int] | None]:
    """The frame Dynamo is tracing: its positional parameter names, less the module
    whose ``forward`` it is; the names of all its parameters (keyword-only, ``*args``
    and ``**kwargs`` too); and its ``*args`` parameter with the position of its first
    element, if it has one."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        code, f_locals = tx.f_code, getattr(tx, "f_locals", {})
    except Exception:  # noqa: BLE001 - outside Dynamo there is no frame to ask
        return [], frozenset(), None
    positional = list(code.co_varnames[: code.co_argcount])
    if positional and isinstance(f_locals.get(positional[0]), torch.nn.Module):
        positional = positional[1:]
    count = code.co_argcount + code.co_kwonlyargcount
    varargs = None
    if code.co_flags & inspect.CO_VARARGS:
        varargs = (code.co_varnames[count], len(positional))
        count += 1
    count += bool(code.co_flags & inspect.CO_VARKEYWORDS)
    names = frozenset(code.co_varnames[:count])
    return positional, names - {name for name in names if isinstance(f_locals.get(name), torch.nn.Module)}, varargs


_NO_GRADIENT_USES = {"detach", "size", "dim", "numel", "stride", "item", "tolist", "data_ptr"}


def _carries_a_gradient(node: fx.Node) -> bool:
    """Whether the graph may send a gradient into placeholder ``node``: through a use
    other than ``.detach()`` or a size (a loss Dynamo hands to the graph it resumes after
    backward), whose value needs a gradient (``zeros_like(h)`` of a state a previous step
    left on the module reads only its shape)."""
    return any(not (u.op == "call_method" and u.target in _NO_GRADIENT_USES)
               and u.target not in (torch.Tensor.detach, torch.detach) and _needs_a_gradient(u) for u in node.users)


def _needs_a_gradient(node: fx.Node) -> bool:
    """Whether the value Dynamo recorded for ``node`` holds a tensor that needs a
    gradient (unknown: it may)."""
    if "example_value" not in node.meta:
        return True
    leaves = pytree.tree_leaves(node.meta["example_value"])
    return any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in leaves)


def _parameters_behind(t: torch.Tensor, any_leaf: bool = False, through_graphs: bool = True) -> list[torch.Tensor]:
    """The trainable ``nn.Parameter`` leaves of ``t``'s autograd history (with
    ``any_leaf``, every leaf that needs a gradient): what a gradient into ``t`` reaches
    outside the graph it enters. Without ``through_graphs``, the leaves behind another
    compiled graph (whose backward fxdp's backend gives them) are not looked for."""
    found, seen, stack = [], set(), [t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen or (not through_graphs and type(fn).__name__ == "CompiledFunctionBackward"):
            continue
        seen.add(fn)
        leaf = getattr(fn, "variable", None)  # AccumulateGrad
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and (
                any_leaf or isinstance(leaf, torch.nn.Parameter)):
            found.append(leaf)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return found


def classify_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any], options: Options,
                    names: dict[int, str] | None, arg_names: Sequence[str] = ()):
    """Split placeholders into trainable parameters and inputs; give inputs their batch dims.

    Args:
        arg_names: The forward's positional parameter names (``transform`` knows them;
            a Dynamo backend reads them from the traced frame).

    Returns:
        (placeholders, fake_args, param_names {node: name}, placeholder_batch, batch_size,
        notes, guessed): ``notes`` name the inputs whose sizes could have misled the size
        rule, for the error message should the analysis refuse the model; ``guessed``
        gives a note for each other input the size rule alone took as batched, for the
        message should an op that reads it refuse (``_notes_on_guesses``).
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fake_args = [n.meta.get("example_value", n.meta.get("val")) for n in placeholders]
    param_names: dict[fx.Node, str] = {}
    inputs: list[tuple] = []
    trained: list[fx.Node] = []  # leaf tensors that need a gradient but are no Parameter
    computed: list[tuple[fx.Node, torch.Tensor]] = []  # inputs with an autograd history
    frame_positional, frame_names, varargs = _frame_arg_names()
    if arg_names:  # ``transform``'s own call: no frame parameter of the model's
        varargs = None
    arg_names = list(arg_names) or frame_positional
    for order, (node, real, fake) in enumerate(zip(placeholders, example_inputs, fake_args)):
        if not isinstance(real, torch.Tensor):
            continue
        source = source_name(node)
        is_param = isinstance(real, torch.nn.Parameter) or "_parameters" in source
        is_buffer = "_buffers" in source
        if is_param:
            if real.requires_grad:
                param_names[node] = (names or {}).get(id(real)) or _param_name(source)
            continue
        if real.requires_grad and real.grad_fn is None:
            trained.append(node)
        elif real.requires_grad:
            computed.append((node, real))
        key = _argument_key(source, arg_names, frame_names, varargs)
        if is_buffer or key is None:  # model state, shared by all samples
            continue
        position, name = key
        # Positional arguments first, in order; then the rest in graph order.
        rank = (0, position, order) if position is not None else (1, 0, order)
        inputs.append((rank, node, fake, position, name))
    inputs.sort(key=lambda item: item[0])
    placeholder_batch: dict[fx.Node, BatchDim | None] = {}
    batch_size = sizing = None
    explicitly_batched: set[fx.Node] = set()
    notes: list[str] = []
    guessed: dict[fx.Node, str] = {}  # batched by the size rule alone: a note should an op that reads them refuse
    for rank, node, fake, position, name in inputs:
        dim, explicit = options.batch_dim_of(position, name)
        if dim is None:
            placeholder_batch[node] = None
            continue
        if dim < 0:  # counted from the end, as vmap's in_dims
            if dim + fake.dim() < 0:
                raise ValueError(f"in_dims gives {source_name(node)} (shape {tuple(fake.shape)}) batch dim "
                                 f"{dim}, which it does not have")
            dim += fake.dim()
        if batch_size is None:
            if fake.dim() <= dim and position is None and not explicit:
                # A keyword argument without the dim (Hugging Face's 0-d
                # num_items_in_batch, which the forward may read before the data) is
                # shared; keyword arguments come in the order the forward reads them.
                placeholder_batch[node] = None
                continue
            if fake.dim() <= dim:
                raise NoBatchDim(
                    f"the first tensor argument ({source_name(node)}, shape {tuple(fake.shape)}) has no "
                    f"batch dim {dim}; fxdp takes the batch size from it (batch_first={options.batch_first}, "
                    f"or set in_dims)"
                )
            batch_size, sizing = fake.shape[dim], node
            placeholder_batch[node] = BatchDim(dim)
            continue
        if explicit and fake.dim() <= dim:
            raise ValueError(f"in_dims gives {source_name(node)} (shape {tuple(fake.shape)}) batch dim {dim}, "
                             f"which it does not have")
        batched = fake.dim() > dim and (explicit or bool(fake.shape[dim] == batch_size))
        placeholder_batch[node] = BatchDim(dim) if batched else None
        if explicit:
            explicitly_batched.add(node)
        else:
            note = _size_rule_note(name or source_name(node), fake, dim, batched, batch_size)
            notes.extend(note)
            if batched and not note:
                guessed[node] = _batched_by_size_note(name or source_name(node), fake, dim, batch_size)
    # A leaf tensor that needs a gradient is taken for data only where it gives the batch
    # size (``x.requires_grad_()`` for input gradients) or in_dims says it is batched: a
    # size that matches B elsewhere may be chance.
    untrained = [source_name(n) for n in trained if n is not sizing and n not in explicitly_batched]
    if untrained:
        raise UnsupportedError(
            f"{', '.join(untrained)}: a tensor that needs a gradient but is no nn.Parameter "
            "(torch.func.functional_call with a dict of plain tensors?). fxdp makes the gradients of "
            "parameters per-sample; this one would get the ordinary, unclipped gradient of the whole "
            "batch. Pass nn.Parameter objects ({name: nn.Parameter(t) for ...}), detach it, or, if it "
            "is batched data, name its batch dim in in_dims.")
    if options.max_grad_norm is not None:  # (a graph without parameters of its own too)
        _refuse_parameters_behind_inputs(computed, placeholder_batch, bool(param_names))
    return placeholders, fake_args, param_names, placeholder_batch, batch_size, notes, guessed


def _refuse_parameters_behind_inputs(computed: list[tuple[fx.Node, torch.Tensor]],
                                     placeholder_batch: dict[fx.Node, BatchDim | None], clips: bool) -> None:
    """Under clipping, raise if an input was computed with gradient from trainable
    parameters outside the graph: eagerly (the part of a model Dynamo ran without the
    backend after a graph break in it, a weight computed once outside the forward) or by
    another compiled graph. Their gradients would be clipped apart from this graph's, or
    not at all. Behind a shared input (a module attribute, an argument without a batch
    dim) any leaf that needs a gradient counts, a plain tensor too; behind batched data
    only parameters do (the input's own leaf may need a gradient: ``x.requires_grad_()``
    for input gradients, then ``model(x * 2)``). A graph without trainable parameters
    (``not clips``: a loss compiled apart) clips nothing, so another compiled graph's
    parameters behind it are that graph's to clip; eager ones would get no clipping."""
    for node, real in computed:
        shared = placeholder_batch.get(node) is None
        params = _parameters_behind(real, any_leaf=shared, through_graphs=clips) if _carries_a_gradient(node) else []
        if params:
            shapes = ", ".join(str(tuple(p.shape)) for p in params[:3]) + (", ..." if len(params) > 3 else "")
            raise UnsupportedError(
                f"{source_name(node)}: this input carries a gradient back to {len(params)} trainable "
                f"tensor(s) outside the compiled graph (shapes {shapes}), computed eagerly (a graph "
                "break inside the model: Dynamo runs the code it cannot compile without any backend), by "
                "another compiled graph, or by an earlier call (a state a previous call left on the module, "
                "read as a value: a recurrent state carried across steps). fxdp clips globally, and those "
                "would get gradients clipped apart from this graph's, or not at all. Compile the whole "
                "model as one graph (torch.compile(..., fullgraph=True) names any break; fxdp.transform "
                "always compiles so), freeze those parameters (requires_grad=False), or detach the input "
                "(a carried state: state.detach() before the next step).")


def guard_gradient_hooks(named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Wrap every ``register_hook`` hook of these parameters so that it may read the
    gradient but not change it.

    Autograd runs a parameter's hooks on the gradient fxdp's backward hands it: the
    clipped sum (or the plain sum with ``grad_sample`` alone). A hook that only reads it
    (logging, ``wandb.watch``) sees what ``p.grad`` becomes. A hook that changes it (a
    mask that keeps a matrix diagonal, a clamp) would act on that sum only, while every
    sample's gradient, norm and clip factor stayed those of the unchanged gradients:
    the wrapper raises as soon as a hook returns another tensor or writes the one it was
    given. Wrapping is idempotent, ``handle.remove()`` still removes the hook (the key
    stays), and in a backward without fxdp's (the model trained without it) the hook
    runs as it was.
    """
    for name, p in named:
        hooks = p._backward_hooks
        if not hooks:
            continue
        for key, hook in list(hooks.items()):
            if not getattr(hook, "_fxdp_read_only", False):
                hooks[key] = _read_only_hook(hook, name, weakref.ref(p))


def _read_only_hook(hook: Callable, name: str, param: weakref.ref) -> Callable:
    @functools.wraps(hook)
    def read_only(grad: torch.Tensor) -> torch.Tensor | None:
        step = getattr(param(), "_fxdp_step", None)
        if step is None or step.task != internals.current_graph_task_id():
            return hook(grad)  # a backward fxdp had no part in (the model trained without it)
        # A write through ``grad.data`` leaves the version counter as it was: compare values.
        version, before = grad._version, grad.detach().clone()
        out = hook(grad)
        replaced = out is not None and out is not grad and not _same_values(out, grad)
        if replaced or grad._version != version or not _same_values(grad, before):
            raise UnsupportedError(
                f"a gradient hook (register_hook) on parameter {name!r} changed its gradient "
                f"({'returned another value' if replaced else 'wrote it in place'}). "
                "Under fxdp the hook runs on the summed, clipped gradient only: each sample's gradient, "
                "its norm and the clip factors were computed inside the compiled backward without "
                "the change. Put a constraint in the forward instead (multiply the weight by its mask, "
                "or torch.nn.utils.parametrize.register_parametrization), so that every sample's "
                "gradient has it, or remove the hook (handle.remove()). Hooks that only read the "
                "gradient run as they are. The p.grad this backward() wrote so far is incomplete: zero it.")
        return None

    read_only._fxdp_read_only = True  # type: ignore[attr-defined]
    return read_only


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where NaN."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _batched_by_size_note(name: str, fake: torch.Tensor, dim: int, batch_size: Any) -> str:
    """The note on an input the size rule alone took as batched (``edge_index`` of shape
    ``[2, E]`` beside a batch of two graphs' features)."""
    shape = tuple(internals.size_hint(size) for size in fake.shape)  # (no guard: see _size_rule_note)
    return (f"{name} (shape {shape}) was taken as batched at dim {dim} because its size there is "
            f"B = {internals.size_hint(batch_size)}; if it is shared by all samples (indices every sample "
            f"reads, a graph's edges), pass in_dims={{{name!r}: None}}")


def _notes_on_guesses(guessed: dict[fx.Node, str], mixing: Sequence[fx.Node]) -> list[str]:
    """The notes of ``guessed`` (canonical placeholder -> note) whose inputs an op at
    which the analysis found a problem reads as they are, or through views, pieces and
    casts of them (``h.index_select(-2, edge_index[0])``): there the size rule's reading
    may be the problem. Inputs that reach the op only through other computations stay
    unnamed (an attention mask reaches everything after the attention)."""
    shown: dict[fx.Node, fx.Node] = {}
    for placeholder in guessed:
        stack = [placeholder]
        while stack:
            node = stack.pop()
            if node in shown:
                continue
            shown[node] = placeholder
            stack.extend(u for u in node.users if u.op == "call_function" and u.args and u.args[0] is node
                         and (_aliases(u) or u.target in _COPIES))
    hit = {shown[a] for node in mixing for a in (node, *node.all_input_nodes) if a in shown}
    return [note for placeholder, note in guessed.items() if placeholder in hit]


class NoBatchDim(ValueError):
    """The graph's first tensor argument has no batch dim (a graph Dynamo resumes after
    the loss takes the 0-d loss first)."""


def _size_rule_note(name: str, fake: torch.Tensor, dim: int, batched: bool, batch_size: int) -> list[str]:
    """A hint where the size rule may have read an input wrongly: a shared input with
    some other dim of size ``B``, or a batched one with a second dim of size ``B``."""
    # Size hints: a note must not add guards to the compiled graph.
    shape = tuple(internals.size_hint(size) for size in fake.shape)
    batch_size = internals.size_hint(batch_size)
    others = [d for d, size in enumerate(shape) if d != dim and size == batch_size]
    if not others:
        return []
    if batched:
        return [f"{name} (shape {shape}) was taken as batched at dim {dim}, but its dim {others[0]} has size "
                f"B = {batch_size} too; if the samples are along dim {others[0]}, pass in_dims={{{name!r}: "
                f"{others[0]}}}, and if it is shared by all of them (a [T, T] mask with T == B), "
                f"in_dims={{{name!r}: None}}"]
    return [f"{name} (shape {shape}) was taken as shared by all samples: its dim {dim} is not of size "
            f"B = {batch_size}. If it holds the samples along dim {others[0]} (an RNN's hidden state is "
            f"[layers, B, hidden] even with batch_first=True), pass in_dims={{{name!r}: {others[0]}}}"]


def refuse_unfollowable(gm: fx.GraphModule) -> None:
    """Raise if the forward takes a backward itself (``loss.backward()`` and
    ``torch.autograd.grad`` under ``torch._dynamo.config.trace_autograd_ops``), whose
    ordinary gradients fxdp would have to replace inside the forward, or runs
    forward-mode AD (``torch.func.jvp``, ``jacfwd``, ``torch.autograd.forward_ad``),
    whose tangent formulas traced below functorch carry zero tensors and meta-device
    copies that the analysis does not follow."""
    nodes = list(internals.nodes_with_bodies(gm))
    for i, node in enumerate(nodes):
        if node.op != "call_function":
            continue
        if getattr(node.target, "__name__", "") in internals.FORWARD_MODE_AD:
            # The transform's own calls carry no line of the model's code; the first op
            # of its function does.
            node = next((n for n in nodes[i:] if n.meta.get("stack_trace")), node)
            raise UnsupportedError("fxdp cannot make this model per-sample:", [Problem(
                "torch.func.jvp", module_path_of(node), "",
                "forward-mode AD (torch.func.jvp, torch.func.jacfwd, torch.func.hessian, "
                "torch.autograd.forward_ad) runs inside the forward, which fxdp does not "
                "support; torch.func.vmap, torch.func.grad and torch.func.jacrev work",
                source_of(node))])
        if node.target in (torch.autograd.grad, torch.autograd.backward):
            raise UnsupportedError("fxdp cannot make this model per-sample:", [Problem(
                "torch.autograd.grad", module_path_of(node), "",
                "the compiled code takes gradients itself (loss.backward() or torch.autograd.grad, "
                "traced into the graph under torch._dynamo.config.trace_autograd_ops), and fxdp "
                "makes the gradients private in the backward it derives from the graph: leave "
                "trace_autograd_ops off (fxdp takes the graph break at loss.backward()), or compile "
                "the function that returns the loss and call loss.backward() outside it; a gradient "
                "the forward uses (a gradient penalty, an input gradient) needs double backward, "
                "which fxdp does not support", source_of(node))])


def analyse_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], options: Options,
                  names: dict[int, str] | None = None, arg_names: Sequence[str] = ()):
    """Canonicalise and analyse; no compilation. Used by ``validate`` and ``explain``."""
    refuse_unfollowable(gm)
    placeholders, fake_args, param_names, placeholder_batch, batch_size, notes, guessed = classify_inputs(
        gm, example_inputs, options, names, arg_names)
    fake_mode = internals.fake_mode_of([a for a in fake_args if isinstance(a, torch.Tensor)])
    canon = canonicalize_pass(gm, fake_args, fake_mode=fake_mode)
    canon_placeholders = [n for n in canon.graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}
    c_param_names = {canon_placeholders[index[n]]: name for n, name in param_names.items()}
    c_batch = {canon_placeholders[index[n]]: b for n, b in placeholder_batch.items()}
    if batch_size is None and c_param_names:
        shared = [source_name(n) for n, t in zip(placeholders, fake_args)
                  if isinstance(t, torch.Tensor) and n not in param_names and "_buffers" not in source_name(n)]
        raise UnsupportedError(
            "fxdp found no tensor argument to take the batch size from: pass the batch to the compiled "
            "function (or module) as an argument"
            + (f"; {', '.join(shared[:4])}{', ...' if len(shared) > 4 else ''} comes from a global, a "
               "closure or an attribute, which fxdp takes as shared by all samples" if shared else
               "; a forward that reads only the sizes of its arguments (x.shape[0]) gives no sample an "
               "output of its own"))
    # Dynamo returns what the forward stores from the graph, after what it returns.
    stored = internals.stored_outputs(gm) if len(_outputs(canon)) == len(_outputs(gm)) else {}
    analysis = batch_dim_pass(canon, c_batch, c_param_names, batch_size=batch_size, stored_outputs=stored)
    if analysis.rows_in_place:  # parameter uses on a mask's rows, run on the batch
        rows_in_place_pass(canon, analysis.rows_in_place, analysis.batch)
        analysis = batch_dim_pass(canon, c_batch, c_param_names, batch_size=batch_size, stored_outputs=stored)
    # A loop after a refused one reads layouts the analysis no longer knows: each round
    # fuses the loops it can read, until none is left. Where it can read none, the loops
    # are read with every tensor built from the batch's size batched: the reading the
    # analysis takes where the loops are fused (TabNet's random mask ``bernoulli(p *
    # ones(B, G))`` before its ghost batch norm's chunks), which the loops' own refusal
    # keeps it from taking before. There, and where the analysis kept such a reading,
    # only what the batch's data reaches is batched: a loop over chunks of ``ones(B, B)``
    # itself stays a loop (its ``sum(1)`` counts B).
    unmapped = {}
    data = [n for n, b in c_batch.items() if b is not None]
    while analysis.problems and (
            chunk_loops_as_whole_pass(canon, analysis.batch if analysis.sized_shared else
                                      _of_the_data(analysis.batch, data), c_param_names, fake_mode, unmapped)
            or (analysis.sized_by_batch and chunk_loops_as_whole_pass(
                canon, _of_the_data(batch_dim_pass(canon, c_batch, c_param_names, batch_size=batch_size,
                                                   stored_outputs=stored, sized_batched="all").batch, data),
                c_param_names, fake_mode, unmapped))):
        analysis = batch_dim_pass(canon, c_batch, c_param_names, batch_size=batch_size, stored_outputs=stored)
    analysis.problems += unmapped_problems(canon, unmapped, analysis.mixing)
    if analysis.problems:
        notes += _notes_on_guesses({canon_placeholders[index[n]]: note for n, note in guessed.items()},
                                   analysis.mixing)
    analysis.notes = list(dict.fromkeys(notes))
    if analysis.loss not in (None, "batchmean", options.loss_reduction):
        reason = (f"the loss inside the graph is a {analysis.loss} over the batch but "
                  f"loss_reduction={options.loss_reduction!r}; pass loss_reduction={analysis.loss!r}, or, "
                  "where that output is not the loss you call backward() on (a model's own loss computed "
                  "because labels were passed, beside logits your loss reads), do not compute it (call the "
                  "model without labels=)")
        analysis.problems.append(Problem("loss", "", "", reason))
    return canon, fake_mode, c_param_names, analysis


def _of_the_data(batch: dict[fx.Node, Any], data: Sequence[fx.Node]) -> dict[fx.Node, Any]:
    """``batch``'s layouts of the values computed from ``data`` (the batched inputs)."""
    reached_from = reached(data, lambda n: n.users)
    return {node: layout for node, layout in batch.items() if node in reached_from}


def refuse_graph_break(gm: fx.GraphModule, options: Options, example_inputs: Sequence[Any]) -> None:
    """Under clipping, raise where a graph break would leave a gradient unclipped, or
    clipped apart from the rest of the step.

    Accepted: a break at the loss's ``backward()`` (a compiled train step; what follows
    it runs after the clipping), and a break where the compiled function itself reads a
    value (``loss.item()``, ``print(loss)``), as the one call Dynamo runs eagerly there
    touches no parameter. A graph Dynamo resumes after any other break is refused where
    it computes with a value that carries a gradient (``_refuse_gradients_after_a_break``).
    Any other break ends a graph whose code at the break runs eagerly, unseen: refused."""
    if internals.after_backward():
        return
    if options.max_grad_norm is None:
        _refuse_values_read_before_gradients(gm, example_inputs)
        return
    resumed = internals.resumed_after()
    if resumed is not None:
        _refuse_gradients_after_a_break(gm, example_inputs, *resumed)
    reason = internals.graph_break_reason(gm)
    if reason is None:
        return
    if internals.breaks_at_backward(gm):
        internals.record_backward_break(gm)
        return
    if internals.breaks_at_a_data_read(gm):
        internals.record_data_read(gm)
        return
    if internals.breaks_at_zero_grad(gm):
        return
    if "DDPOptimizer" in reason:
        raise UnsupportedError(
            "fxdp cannot clip globally across the graphs Dynamo's DDPOptimizer splits a "
            "DistributedDataParallel model into (one per gradient bucket; DDP's first bucket "
            "holds 1 MB, so most models are split): each graph would clip its parameters "
            "separately. Set torch._dynamo.config.optimize_ddp = False before compiling (the "
            "clipped gradient exists only at the end of the backward, so the split has "
            "nothing to overlap), or use DistributedDataParallel(fxdp.transform(model, ...)). "
            f"Dynamo's reason: {reason}.")
    _refuse_break(reason)


def _inputs_carrying_gradients(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[tuple[fx.Node, Any]]:
    """``gm``'s placeholders, with their values, that need a gradient and that the graph
    may send one into (``_carries_a_gradient``)."""
    placeholders = (n for n in gm.graph.nodes if n.op == "placeholder")
    return [(node, real) for node, real in zip(placeholders, example_inputs)
            if isinstance(real, torch.Tensor) and real.requires_grad and _carries_a_gradient(node)]


def _refuse_values_read_before_gradients(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Without clipping (graph breaks are allowed then), raise where a graph Dynamo resumes
    after a break at which the compiled function read a tensor's value (``int(m.sum())``,
    ``if (t == 0).any():``, ``loss.item()``) computes with parameters or with values that
    carry a gradient: the number read, or the branch taken, is a constant in this graph,
    and may come from the whole batch (a count over every sample's mask), so each
    sample's gradient could depend on the others unseen. A graph that only reads such
    values (``loss.detach()``) is harmless."""
    resumed = internals.resumed_after()
    if resumed is not None and resumed[1] is not None:
        found = [_param_name(source_name(node)) for node, _ in _inputs_carrying_gradients(gm, example_inputs)]
        if found:
            raise UnsupportedError(
                f"fxdp cannot follow the samples across a graph break: the code reads a tensor's value at "
                f"{resumed[0]} ({resumed[1]}), and the graph after that computes with {', '.join(found[:3])}"
                f"{', ...' if len(found) > 3 else ''}, which carry gradients. The number read, or the branch "
                "taken, may come from the whole batch (int(mask.sum()), if x.any():) and would enter every "
                "sample's gradient unseen. Compute it as a tensor inside the graph (mask.sum(), torch.where), "
                "or read values once the forward has run")
    if internals.graph_break_reason(gm) is not None and internals.breaks_at_a_data_read(gm):
        internals.record_data_read(gm)


def _refuse_break(reason: str) -> None:
    raise UnsupportedError(
        "fxdp cannot clip globally across a graph break: each graph would clip its "
        f"parameters separately. Dynamo broke the graph because: {reason}. Remove the "
        "break (torch._dynamo.explain shows it) or use fxdp.transform, which compiles "
        "with fullgraph=True."
    )


def _refuse_gradients_after_a_break(gm: fx.GraphModule, example_inputs: Sequence[Any], where: str,
                                    data_read: str | None, cleared: bool) -> None:
    """Raise if ``gm``, which Dynamo resumes after a break at ``where``, computes with a
    value that carries a gradient: a trainable input of its own (the forward split, each
    part clipped apart), one computed eagerly at the break (a submodule Dynamo skipped:
    unclipped), or one an earlier graph computed, with which a value read at the break
    (a statistic of the batch, ``loss / loss.item()``) may now compute unseen. A graph
    that only reads such values (``loss.detach()``) is harmless. After a break at
    ``opt.zero_grad()`` (``cleared``), which reads and computes nothing, only the values
    an earlier graph computed are refused: the forward would be split there."""
    own, computed = [], []
    for node, real in _inputs_carrying_gradients(gm, example_inputs):
        (computed if real.grad_fn is not None else own).append(_param_name(source_name(node)))
    if not computed and (cleared or not own):
        return
    if cleared:
        _refuse_break(f"zero_grad() at {where} splits the forward: this graph computes with values that carry "
                      f"gradients from the graph before it ({', '.join(computed[:3])}), and each would clip "
                      "its parameters apart. Call zero_grad() before the forward or after the optimizer's step")
    if data_read is not None and own:
        _refuse_break(f"{data_read}, and the graph after that uses parameters too ({', '.join(own[:3])}"
                      f"{', ...' if len(own) > 3 else ''}). Read values (loss.item(), print) once the "
                      "whole forward has run, or after loss.backward()")
    if data_read is not None:
        _refuse_break(f"{data_read}, and the graph after that computes with values that carry gradients "
                      f"({', '.join(computed[:3])}), with which a value read from the batch may compute "
                      "unseen. Call backward() on the loss as it is when read, or read it after "
                      "loss.backward()")
    _refuse_break(
        f"a break at {where}, before this graph, where the code ran eagerly, without fxdp (a submodule "
        "whose frame Dynamo skipped, as it skips one with a break inside try/except; a "
        "torch.compiler.disable'd function, a read of a value), and any parameter it used would get an "
        "unclipped gradient, any value it read could enter the gradients unseen")


_LOCAL = re.compile(r"L\['(\w+)'\]")
# id -> (the tensor, held weakly; where it was mixed): see ``mixed_outputs``.
_MIXED: dict[int, tuple[weakref.ref, str]] = {}


def mark_mixed(t: torch.Tensor, where: str) -> None:
    """Remember, for as long as ``t`` lives, that it was computed by mixing samples at ``where``."""
    key = id(t)
    _MIXED[key] = (weakref.ref(t, lambda _, key=key: _MIXED.pop(key, None)), where)


def mixed_where(t: Any) -> str | None:
    """Where ``t`` was computed by mixing samples (``mark_mixed``), or ``None``."""
    entry = _MIXED.get(id(t))
    return entry[1] if entry is not None and entry[0]() is t else None


def _outputs(gm: fx.GraphModule) -> list[Any]:
    return pytree.tree_leaves(gm.graph.output_node().args[0])


def mixed_outputs(gm: fx.GraphModule, example_inputs: Sequence[Any],
                  options: Options) -> tuple[dict[int, str], dict[int, str]]:
    """For a graph no gradient flows through (no input needs one), run by the backend in a
    training step without clipping, where graph breaks are allowed: the positions of its
    outputs computed by mixing samples, or from a value an earlier graph marked so, and of
    its inputs it writes such values into (``x.sub_(x.mean(0))``), each with where that
    happened. The backend marks those tensors (``mark_mixed``) at every run, and a graph
    that computes with one of them and with parameters refuses to run
    (``_watched_inputs``): ``x = x - x.mean(0)`` before a ``print``, whose result keeps
    the batch dim, would otherwise mix samples where neither graph sees it."""
    placeholders = (n for n in gm.graph.nodes if n.op == "placeholder")
    marked = {n: where for n, t in zip(placeholders, example_inputs) if (where := mixed_where(t)) is not None}
    found = _marked_positions(gm, _spread(marked))
    try:
        canon, _, _, analysis = analyse_graph(gm, example_inputs, options)
    except Exception:  # noqa: BLE001 - no batched input (nothing to mix), or a graph the analysis cannot read
        return found
    if len(_outputs(canon)) != len(_outputs(gm)):
        return found
    starts = list(analysis.mixing) + [n for n, b in analysis.batch.items()
                                      if any(v is UNKNOWN for v in pytree.tree_leaves(b))]
    mixed = _marked_positions(canon, _spread({n: source_of(n) or op_name(n.target) for n in starts}))
    return {**mixed[0], **found[0]}, {**mixed[1], **found[1]}


def _spread(starts: dict[fx.Node, str]) -> dict[fx.Node, str]:
    """Every node computed from one of ``starts``, with the first such start's label, and
    every tensor such a value is written into (through its views), and what is computed
    from that; not through ops that read only a shape (``zeros_like``)."""
    spread: dict[fx.Node, str] = {}
    pending = dict(starts)
    while pending:
        for start, label in pending.items():
            for node in reached([start], lambda n: [u for u in n.users if u.target not in SHAPED_LIKE]):
                spread.setdefault(node, label)
        pending = {}
        for node, label in spread.items():
            chain = written_chain(node)  # the tensor it writes into, behind the views it writes through
            if chain is not None and isinstance(chain[-1], fx.Node) and chain[-1] not in spread:
                pending.setdefault(chain[-1], label)
    return spread


def _marked_positions(gm: fx.GraphModule, mixed: dict[fx.Node, str]) -> tuple[dict[int, str], dict[int, str]]:
    """The positions of ``gm``'s outputs, and of its inputs, in ``mixed``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return ({i: mixed[out] for i, out in enumerate(_outputs(gm)) if isinstance(out, fx.Node) and out in mixed},
            {i: mixed[n] for i, n in enumerate(placeholders) if n in mixed})


def _watched_inputs(gm: fx.GraphModule, canon: fx.GraphModule, param_names: dict) -> dict[int, str]:
    """Without clipping: the inputs (other than parameters) this graph computes with
    together with parameters, by position and name, which it checks at every run for a
    value an earlier graph without parameters mixed samples into (``mixed_outputs``):
    one the code before a graph break computed, also where Dynamo compiled this graph
    with a value that was not yet mixed, also one a list held, also in a submodule's
    frame Dynamo compiles apart. A value used only for its shape, or with values
    detached from the parameters (a metric), is not watched."""
    gradient = reached(list(param_names), lambda n: [u for u in n.users if u.op != "output" and u.target not in (
        *SHAPED_LIKE, torch.ops.aten.detach.default)])
    watched = {}
    for i, (node, canonical) in enumerate(zip((n for n in gm.graph.nodes if n.op == "placeholder"),
                                              (n for n in canon.graph.nodes if n.op == "placeholder"))):
        if canonical in param_names or not isinstance(node.meta.get("example_value"), torch.Tensor):
            continue
        values = reached([canonical], lambda n: [u for u in n.users if u.op != "output" and u.target not in SHAPED_LIKE])
        if values & gradient:
            watched[i] = re.sub(r"^L\['(\w+)'\]", r"\1", source_name(node))  # hs[0] for L['hs'][0]
    return watched


def _refuse_mixed_inputs(args: Sequence[Any], watched: dict[int, str]) -> None:
    mixed = [f"{name} (mixed at {where})" for i, name in watched.items() if (where := mixed_where(args[i]))]
    if mixed:
        raise UnsupportedError(
            f"fxdp cannot follow the batch: this graph computes with parameters and with {', '.join(mixed[:4])}, "
            "which a graph without parameters before it (across a graph break, or in a frame Dynamo compiled "
            "apart) computed by mixing samples: each sample's gradient would depend on the other samples. "
            "Remove the mixing, or the break (torch.compile(..., fullgraph=True) names it), and fxdp names the op")


def _refuse_unbatched_values_after_a_break(gm: fx.GraphModule, canon: fx.GraphModule, analysis) -> None:
    """Without clipping (graph breaks are allowed then), raise where a graph Dynamo resumes
    after a break computes with a tensor the code before the break computed and that has
    no batch dim here: a statistic of the batch (``mu = x.mean(0)`` before a
    ``print``), or batched values this graph cannot read as the batch (its first tensor
    argument, which gives ``B``, a list of pairs), either of which would mix samples
    where no graph sees it. The values the frame was called with are judged as any
    graph's inputs are; batched values mixed before the break are checked at run time
    (``_watched_inputs``)."""
    arguments = internals.resumed_arguments()
    if arguments is None:
        return
    found = []
    for node, canonical in zip((n for n in gm.graph.nodes if n.op == "placeholder"),
                               (n for n in canon.graph.nodes if n.op == "placeholder")):
        local = _LOCAL.fullmatch(source_name(node))
        if not (isinstance(node.meta.get("example_value"), torch.Tensor) and local is not None
                and local.group(1) not in arguments):
            continue
        if not isinstance(analysis.batch.get(canonical), BatchDim):
            found.append(local.group(1))
    if found:
        raise UnsupportedError(
            f"fxdp cannot follow the batch across a graph break: the graph after the break at "
            f"{internals.resumed_after()[0]} computes with {', '.join(found[:4])}, computed before the "
            "break, without the batch dim here. A statistic of the batch (x.mean(0)) would mix samples "
            "where no graph sees it. Remove the break (torch.compile(..., fullgraph=True) names it), or "
            "compute these values after it")


# What autograd records for a tensor an fxdp graph returned (AOTAutograd's node), and for
# the views of it AOTAutograd regenerates outside the graph.
_GRAPH_OUTPUT = "CompiledFunctionBackward"
_VIEWS_OF_OUTPUTS = ("AliasBackward0", "ViewBackward0", "AsStridedBackward0", "UnsafeViewBackward0",
                     "SliceBackward0", "SelectBackward0", "UnsqueezeBackward0", "SqueezeBackward0",
                     "TransposeBackward0", "PermuteBackward0", "ExpandBackward0", "TBackward0")


def _computed_by_a_graph(grad_fn: Any) -> bool:
    """Whether the autograd node ``grad_fn`` is that of a compiled graph's output, or of a
    view of one."""
    while grad_fn is not None and type(grad_fn).__name__ in _VIEWS_OF_OUTPUTS:
        grad_fn = next((f for f, _ in grad_fn.next_functions if f is not None), None)
    return grad_fn is not None and type(grad_fn).__name__ == _GRAPH_OUTPUT


def _refuse_eager_gradients_after_a_break(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Without clipping (graph breaks are allowed then), raise where a graph Dynamo resumes
    after a break computes with a tensor that code run eagerly at the break computed with
    a gradient (a ``torch.compiler.disable``'d function, a submodule frame Dynamo skipped):
    no graph sees that code, which may mix samples (``h - h.mean(0)``) both in its values
    and in the gradient it sends back to the graph before the break, so every grad
    sample after it could depend on the other samples. A tensor a graph returned (or a
    view of it), or the caller's input, passes."""
    resumed = internals.resumed_after()
    if resumed is None:
        return
    found = [f"{_param_name(source_name(node))} ({type(real.grad_fn).__name__})"
             for node, real in _inputs_carrying_gradients(gm, example_inputs)
             if real.grad_fn is not None and not _computed_by_a_graph(real.grad_fn)]
    if found:
        raise UnsupportedError(
            f"fxdp cannot follow the samples across a graph break: the graph after the break at {resumed[0]} "
            f"computes with {', '.join(found[:4])}, which code Dynamo ran eagerly there computed with a gradient "
            "(a torch.compiler.disable'd function, a submodule whose frame Dynamo skipped, an op it cannot "
            "trace). No graph sees that code, which may mix samples in its values and in the gradient it sends "
            "back, so the grad samples could depend on the other samples. Remove the break "
            "(torch.compile(..., fullgraph=True) names it), or use fxdp.transform")


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], options: Options,
                  names: dict[int, str] | None = None,
                  record: CompiledGraph | None = None, arg_names: Sequence[str] = (),
                  clip_norm: ClipNorm | None = None, model: torch.nn.Module | None = None) -> Callable:
    """Capture → canonicalise → analyse → tag → AOTAutograd → rewrite backward → lower.

    With ``model`` (``fxdp.transform``'s), each backward with ``grad_sample`` drops the grad
    samples of the model's parameters it did not cover (a task's head the step did not run).

    With ``clip_norm``, the backward reads ``C`` from it at every run."""
    record = record or CompiledGraph(options)
    record._stage("captured", gm)
    refuse_graph_break(gm, options, example_inputs)
    canon, fake_mode, param_names, analysis = analyse_graph(gm, example_inputs, options, names, arg_names)
    record._stage("canonical", canon)
    if options.max_grad_norm is None:
        _refuse_unbatched_values_after_a_break(gm, canon, analysis)
        _refuse_eager_gradients_after_a_break(gm, example_inputs)
    record.param_names = list(param_names.values())
    excluded: set[str] = set()
    if analysis.problems:
        record.problems = analysis.problems
        if options.strict:
            raise UnsupportedError("fxdp cannot make this model per-sample:", analysis.problems,
                                   analysis.notes)
        if any(not p.parameter for p in analysis.problems):
            raise UnsupportedError(
                "fxdp cannot make this model per-sample (problems not tied to one parameter "
                "cannot be excluded with strict=False):",
                [p for p in analysis.problems if not p.parameter], analysis.notes,
            )
        excluded = {name for p in analysis.problems for name in p.parameters}
        warnings.warn(
            "fxdp: these parameters get no gradient (strict=False):\n" + format_problems(analysis.problems)
            + "".join(f"\nNote: {note}" for note in analysis.notes),
            stacklevel=2,
        )
    loss_normaliser_pass(canon, analysis)
    own_rows_pass(canon, analysis)
    tagged, counts = tag_pass(canon, analysis, param_names, excluded)
    # Each trainable parameter's gradient output is at its forward input's index.
    guarded = {i: param_names[n] for i, n in enumerate(n for n in tagged.graph.nodes if n.op == "placeholder")
               if n in param_names and param_names[n] not in excluded}
    # AOTAutograd makes the graph module's own tensors (``torch.tensor(2.0)`` in the
    # forward, a constant ``make_fx`` keeps as a buffer) the first inputs of the joint
    # graph: the backward's gradient outputs start with theirs.
    lifted = len(list(tagged.named_parameters(remove_duplicate=False))) \
        + len(list(tagged.named_buffers(remove_duplicate=False)))
    inputs = lifted + sum(1 for n in tagged.graph.nodes if n.op == "placeholder")
    record.rule_counts = counts
    record.uses = [use for n in tagged.graph.nodes for use in getattr(n.target, "use_infos", ())]
    record._stage("tagged", tagged)

    # The graphs hold autocast's casts (passes/autocast.py): they run with autocast off.
    devices = list(ambient_autocast())
    # An empty batch (B == 0, a graph of its own: Dynamo specialises size 0) runs without
    # Inductor. Its joint-graph passes fold every tensor without elements into a constant,
    # and the min-cut partitioner then moves the gradients that no longer depend on the
    # output gradient, markers included, into the forward. The handover below gives such
    # parameters their grad samples, but where it takes them all (a model that ends in a
    # LayerNorm) nothing left in the backward holds B. There is nothing to compute fast
    # there anyway.
    inductor = options.compiler == "inductor" and not analysis.empty
    handover = _Handover(list(guarded))
    # With clipping, a parameter of the model that gets no gradient here must get none at all
    unseen = _Unseen(model) if model is not None and options.max_grad_norm is not None else None

    def backward_compiler(bw_gm: fx.GraphModule, bw_inputs: Sequence[Any], inner: Callable) -> Callable:
        record._stage("backward", bw_gm)
        outputs = bw_gm.graph.output_node().args[0]
        # Effect tokens follow the gradients: one per token the backward threads through an
        # effectful op (``_linalg_check_errors`` of a ``linalg.inv`` in a Function's backward).
        tokens = sum(1 for n in bw_gm.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents_token"))
        if len(outputs) != inputs + tokens:
            raise UnsupportedError(
                f"fxdp internal error: the backward graph has {len(outputs)} gradient outputs for {inputs} "
                "forward inputs, so fxdp cannot tell which gradient is a parameter's; please report the model")
        at_output = {lifted + i: name for i, name in guarded.items()}
        # The gradients of stored values of parameters alone must be zero (checked at run time)
        checked = stored_gradients(bw_gm, at_output) if analysis.stored else {}
        leaking = unmarked_gradients(bw_gm, at_output, checked)
        if leaking:
            raise UnsupportedError(
                "fxdp internal error: part of the gradient of " + ", ".join(leaking) + " would not be "
                "made per-sample (it reaches the parameter through no rule), so it would leave "
                "unclipped; please report the model. fxdp.validate lists what it found.")
        handover.positions = [i - lifted for i in constant_gradients(bw_gm, at_output)]
        # With clipping, each clipped gradient handed to a parameter must be all its p.grad gets
        delivered = gradient_outputs(bw_gm, at_output) if options.max_grad_norm is not None else {}
        decomps = internals.inductor_decompositions() if inductor else None
        with no_autocast(devices):
            new_gm, plan = backward_rewrite_pass(bw_gm, options, decompositions=decomps,
                                                 clip_norm_key=None if clip_norm is None else clip_norm.key)
            record.plan = plan
            record.annotated_backward = annotated_code(new_gm)
            record._stage("backward_rewritten", new_gm)
            compiled = inner(new_gm, bw_inputs)
        placeholders = [n for n in bw_gm.graph.nodes if n.op == "placeholder"]
        zero = {placeholders.index(t): names for t, names in checked.items()}
        if unseen is not None:
            unseen.covered = {name for i, name in at_output.items() if isinstance(outputs[i], fx.Node)}
        runner = _backward_runner(compiled, plan, options, devices, handover, model, zero, delivered, unseen)
        runner.clip_norm = clip_norm  # type: ignore[attr-defined]  # what it reads C from lives as long
        return runner

    with no_autocast(devices):
        if inductor:
            compiled = internals.inductor_compile(tagged, example_inputs, backward_compiler,
                                                  lambda g: record._stage("forward", g))
        else:
            compiled = internals.eager_compile(tagged, example_inputs, backward_compiler,
                                               lambda g: record._stage("forward", g))
    # A parameter frozen since an earlier step gets no grad sample now (transform clears
    # the model's; the backend sees this graph's).
    frozen = [i for i, t in enumerate(example_inputs) if isinstance(t, torch.nn.Parameter)
              and not t.requires_grad] if options.grad_sample else []
    watched = _watched_inputs(gm, canon, param_names) if options.max_grad_norm is None else {}
    return _forward_runner(compiled, record, devices, handover, frozen, guarded, watched, unseen)


CLASS_LOSSES = {
    torch.ops.aten.cross_entropy_loss.default, torch.ops.aten.nll_loss.default,
    torch.ops.aten.nll_loss_nd.default, torch.ops.aten.nll_loss2d.default,
}


def _batched_input(analysis) -> tuple[fx.Node, int] | None:
    """An input of the graph with one sample per row of its batch dim, and that dim: what
    the run-time checks read ``B`` from."""
    return next(((n, b.dim) for n, b in analysis.batch.items() if n.op == "placeholder"
                 and isinstance(b, BatchDim) and isinstance(b.dim, int) and b.plain), None)


def loss_normaliser_pass(gm: fx.GraphModule, analysis) -> fx.GraphModule:
    """Guard a mean over the batch that skips ``ignore_index`` targets.

    ``F.cross_entropy(..., reduction="mean")`` divides by the number of targets that
    are not ``ignore_index`` in the whole batch. Where every sample keeps the same
    number ``n`` of them (Hugging Face's causal-LM loss ignores the last position of
    each sequence), that mean is the mean over samples of each sample's own mean over
    its ``n`` targets, and each sample has a loss of its own. Where the numbers differ,
    the normaliser depends on the other samples' labels (DESIGN.md refuses that). The
    graph gets a run-time check, also for such a loss inside a ``torch.autograd.Function``
    (on the operand its targets come from); ``B`` is read from a batched input::

        fxdp_same_kept_targets = fxdp_same_kept_targets(view_1, -100, 0, input_ids, 0)

    Likewise a loss divided by the sum of a mask over the whole batch
    (``(l * mask).sum() / mask.sum()``, the analysis's ``normalisers``): every sample's
    mask must sum to as much (``fxdp_same_mask_sums``).
    """
    from fxdp.functions import FUNCTION_APPLY
    from fxdp.passes.batch_dims import Loss

    reference = _batched_input(analysis)
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is FUNCTION_APPLY:
            guards = [(node.args[2 + k], ignore_index) for k, ignore_index in node.meta.get("fxdp_function_losses", [])]
        elif node.target in CLASS_LOSSES and isinstance(analysis.batch.get(node), Loss) \
                and analysis.batch[node].reduction == "mean":
            guards = [(node.args[1], node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100))]
        else:
            continue
        for target, ignore_index in guards:
            layout = analysis.batch.get(target)
            if not (isinstance(layout, BatchDim) and isinstance(layout.dim, int)):
                continue  # shared targets, or one sample's (B == 1): every sample keeps as many
            # Sample b's targets are rows [b·inner, (b+1)·inner) of the batch dim, or with
            # an ``outer`` merge (``[T, B] -> [T·B]``) every B-th row from b; with both (or no
            # batched input to read B from), no target may be ignored.
            outer = not bool(layout.outer == 1)
            by_sample = reference is not None and (not outer or bool(layout.inner == 1))
            args = (target, ignore_index, layout.dim, *(reference if by_sample else (None, None)), outer)
            with gm.graph.inserting_before(node):
                gm.graph.call_function(fxdp_same_kept_targets, args)
    for division, mask, layout, floor in analysis.normalisers:
        outer = not bool(layout.outer == 1)
        if layout.plain:
            args = (mask, layout.dim, mask, layout.dim, False, floor)
        elif reference is not None and (not outer or bool(layout.inner == 1)):
            args = (mask, layout.dim, *reference, outer, floor)
        else:
            raise UnsupportedError(
                "fxdp cannot make this model per-sample:", [Problem(
                    str(division.target), module_path_of(division), "",
                    "the loss is divided by the sum of a mask whose rows of several samples are merged, "
                    "and fxdp finds no input to tell them apart by (to check that every sample's mask "
                    "sums to as much): divide by a fixed number instead, with loss_reduction='sum'",
                    source_of(division))])
        with gm.graph.inserting_before(division):
            gm.graph.call_function(fxdp_same_mask_sums, args)
    gm.graph.lint()
    gm.recompile()
    return gm


def _per_sample(values: torch.Tensor, dim: int, reference: torch.Tensor, reference_dim: int,
                outer: bool) -> torch.Tensor:
    """``values`` as ``[samples, -1]``: the samples are ``reference.shape[reference_dim]``
    consecutive blocks of ``values``' dim ``dim`` (with ``outer``, its rows taken in turn)."""
    samples, rows = reference.shape[reference_dim], values.movedim(dim, 0)
    if outer:
        rows = rows.reshape(-1, samples, *rows.shape[1:]).transpose(0, 1)
    return rows.reshape(samples, -1)


def fxdp_same_mask_sums(mask: torch.Tensor, dim: int, reference: torch.Tensor, reference_dim: int,
                        outer: bool, floor: float | None = None) -> None:
    """Assert that every sample's part of ``mask`` sums to as much as the first's (see
    ``_per_sample``): ``(l * mask).sum() / mask.sum()`` is then a mean over the samples.
    With a ``floor`` (``clamp(mask.sum(), min=floor)``), that the sum is zero or at
    least the floor: a floor would otherwise bind on one sample's sum and not on the
    batch's, and the sample's share would not be its own loss's."""
    sums = _per_sample(mask, dim, reference, reference_dim, outer).sum(1)
    torch._assert_async((sums[:1] == sums).all(), (
        "fxdp: the loss is divided by the sum of a mask over the whole batch ((l * mask).sum() / "
        "mask.sum()), and the samples' masks sum to different amounts: each sample's share would depend "
        "on the other samples' masks. Divide by a fixed number instead (the most a sample's mask can "
        "hold, times the batch size), with loss_reduction='sum'."))
    if floor is not None:
        torch._assert_async(((sums[:1] >= floor) | (sums[:1] == 0)).all(), (
            f"fxdp: the loss is divided by the sum of a mask over the whole batch with a floor, "
            f"clamp(mask.sum(), min={floor}), and each "
            f"sample's mask sums to less than {floor} (but not zero): the floor holds for one sample's loss "
            "and not for the batch's, so the batch's loss is no mean of the samples' own. Divide by a fixed "
            "number instead, with loss_reduction='sum'."))


def fxdp_same_kept_targets(target: torch.Tensor, ignore_index: int, dim: int,
                           reference: torch.Tensor | None, reference_dim: int | None,
                           outer: bool = False) -> None:
    """Assert that every sample keeps as many targets (not ``ignore_index``) as the
    first; the samples are ``reference.shape[reference_dim]`` consecutive blocks of
    ``target``'s dim ``dim`` (with ``outer``, its rows taken in turn). Without a
    reference, that no target is ignored."""
    kept = target != ignore_index
    if reference is None:
        same = kept.all()
    else:
        counts = _per_sample(kept, dim, reference, reference_dim, outer).sum(1)
        same = (counts[:1] == counts).all()
    torch._assert_async(same, (
        f"fxdp: samples keep different numbers of targets that are not ignore_index={ignore_index} "
        "under reduction='mean': the loss is then divided by the number of kept targets of the whole "
        "batch, so no sample has a loss of its own. Use reduction='sum' (loss_reduction='sum') and "
        "divide by a fixed number yourself (Hugging Face causal-LM models: pass num_items_in_batch; heads that "
        "ignore it: compute the loss outside the model)."))


def own_rows_pass(gm: fx.GraphModule, analysis) -> fx.GraphModule:
    """Guard each gather of rows along a merged batch dim by per-sample indices, and each
    write into such rows (the analysis's ``own_rows``: ``flat[arange(B)[:, None] * T +
    pos]``, ``zeros(B * S).scatter_add(0, arange(B)[:, None] * S + segment, v)``): every
    index must fall among its own sample's rows, which the graph cannot prove (``pos`` is
    data). ``B`` is read from a batched input::

        fxdp_indices_in_own_rows = fxdp_indices_in_own_rows(view_2, 0, view_1, 0, x, 0)
    """
    if not analysis.own_rows:
        return gm
    reference = _batched_input(analysis)
    order = {node: k for k, node in enumerate(gm.graph.nodes)}
    for gather in analysis.own_rows:
        if isinstance(gather, SameCounts):
            # Paired with the batch, the list is checked before the first use of its mask:
            # Dynamo's own checks of its length against the batch's follow the select.
            at = min(gather.mask.users, key=lambda n: order.get(n, -1)) if gather.one else gather.node
            with gm.graph.inserting_before(at):
                gm.graph.call_function(fxdp_same_mask_counts, (gather.mask, gather.dim, gather.source, gather.like,
                                                               gather.rows, gather.mean, gather.one))
            continue
        if isinstance(gather, CountedKeys):
            with gm.graph.inserting_before(gather.node):
                gm.graph.call_function(fxdp_keys_counted_alone, (gather.keys, gather.bins, gather.high))
            continue
        if reference is None:
            raise UnsupportedError(
                "fxdp cannot make this model per-sample:", [Problem(
                    str(gather.node.target), module_path_of(gather.node), "",
                    "it gathers (or writes) rows of several samples merged into one dim by indices the "
                    "samples computed, and fxdp finds no input to read the batch size from (to check that each "
                    "index stays among its own sample's rows): index each sample's own rows instead "
                    "(x[torch.arange(B)[:, None], pos] on x of shape [B, T, ...])",
                    source_of(gather.node))])
        with gm.graph.inserting_before(gather.node):
            gm.graph.call_function(fxdp_indices_in_own_rows, (
                gather.index, gather.index_dim, gather.data, gather.data_dim, *reference, gather.alike, gather.step))
    gm.graph.lint()
    gm.recompile()
    return gm


def fxdp_same_mask_counts(mask: torch.Tensor, dim: int, source: torch.Tensor | None = None,
                          like: torch.Tensor | None = None, rows: bool = False, mean: bool = False,
                          one: bool = False) -> None:
    """Assert that every sample's part of the boolean ``mask`` (batched along ``dim``)
    selects as many elements as the first's, or, for a ``masked_scatter``, as one
    sample's part of its ``source`` holds (``source`` batched along dim 0, a row or
    several per sample; the mask broadcast to ``like``'s shape), or, with ``rows``, as
    many positions as one sample's part of ``source`` has rows (see ``SameCounts``).
    ``mean``: the selected elements are averaged, not viewed; ``one``: they are paired with
    the samples, and every sample's part must select exactly one."""
    if like is not None:
        mask = mask.expand(torch.broadcast_shapes(mask.shape, like.shape))
    per_sample = mask.movedim(dim, 0)
    counts = (per_sample.flatten(1) if per_sample.dim() > 1 else per_sample[:, None]).sum(1)  # (a [B] mask: 0 or 1)
    if source is not None:
        held = source.shape[0] if rows else source.numel()
        how = "x[mask] = rows" if rows else "masked_scatter"
        torch._assert_async((counts * counts.numel() == held).all(), (
            f"fxdp: {how} fills every sample's masked positions from one flat list of the whole batch's "
            "source rows, and the samples' masks select other numbers of positions than a sample's "
            "source rows hold: samples would be filled from each other's rows. Fill each sample from a "
            "source of the output's shape instead: torch.where(mask, filled, x)."))
        return
    if one:
        torch._assert_async((counts == 1).all(), (
            "fxdp: elements a boolean mask selected over the batch (x[mask], one list of every sample's) are "
            "combined with the batch by broadcasting (cos + mask * f(cos[mask])[:, None]), which pairs element i "
            "with sample i, and some sample's mask selects other than exactly one element: samples would get each "
            "other's elements. Select each sample's element by position instead (cos.gather(1, labels[:, None]))."))
        return
    if mean:
        torch._assert_async((counts[:1] == counts).all(), (
            "fxdp: the loss is a mean over the elements a boolean mask selected over the batch (x[mask].mean(), "
            "a loss of logits[mask] with reduction='mean'), and the samples' masks select different numbers "
            "of elements: each sample's share would depend on the other samples' masks. Sum the selected "
            "elements' losses and divide by a fixed number instead, with loss_reduction='sum'."))
        return
    torch._assert_async((counts[:1] == counts).all(), (
        "fxdp: rows a boolean mask selected over the batch (h[mask]) are viewed as [B, n, ...] (one row of n "
        "per sample), and the samples' masks select different numbers of rows: the view would put rows of "
        "one sample in another's. Select each sample's rows by position instead (h[torch.arange(B), pos])."))


def fxdp_keys_counted_alone(keys: torch.Tensor, bins: int, high: float) -> None:
    """Assert that a ``histc(keys, bins, min=0, max=high)`` whose cumulative counts a
    grouped matmul reads as its groups' ends counts each key in its own bin or in none,
    after the counted ones (see ``CountedKeys``)."""
    torch._assert_async(((keys >= 0) & ((keys < bins) | (keys > high))).all(), (
        "fxdp: a grouped matmul's offsets count the sorted keys with histc, and some key is negative (sorted "
        "before the counted rows: every group would move by how many the whole batch has) or is at least bins "
        "and at most max (counted in the last bin, not its own): a row's group would depend on the other "
        "samples' keys. Give dropped rows the key bins (one past the last group) and count with max=bins - 1."))


def fxdp_indices_in_own_rows(index: torch.Tensor, index_dim: int, data: torch.Tensor, data_dim: int,
                             reference: torch.Tensor, reference_dim: int, alike: bool = False,
                             step: Any = None) -> None:
    """Assert that the indices into ``data``'s dim ``data_dim``, which holds the samples'
    rows one sample after the other, fall among their own sample's rows; ``index``'s
    rows along ``index_dim`` belong to the samples in turn, the samples counted by
    ``reference.shape[reference_dim]``. With ``alike`` (a shared index), every sample's
    fall at the same places among its rows; with ``step``, the index is ``arange(B) *
    step + pos``, and ``step`` must be the rows per sample."""
    samples = reference.shape[reference_dim]
    if samples == 0:
        return
    size, count = data.shape[data_dim], index.shape[index_dim]
    shape = [1] * index.dim()
    shape[index_dim] = count
    owner = (torch.arange(count, device=index.device) // (count // samples)).view(shape)
    wrapped = torch.where(index < 0, index + size, index)  # x[-1] reads the last row
    torch._assert_async((wrapped // (size // samples) == owner).all(), (
        "fxdp: an index into rows of several samples merged into one dim (x.reshape(B * T, ...)"
        "[arange(B)[:, None] * T + pos], or a scatter into zeros(B * S, ...) at arange(B)[:, None] * S + "
        "segment) falls outside its own sample's rows: the samples would read or write each other's rows. "
        "Keep each sample's indices within its own rows (0 <= pos < T)."))
    if step is not None:
        if not isinstance(step, torch.Tensor):
            step = torch.full((), step, dtype=torch.int64, device=index.device)
        torch._assert_async(step.reshape(()) == size // samples, (
            "fxdp: an index into rows of several samples merged into one dim is arange(B) * S + pos with S other "
            "than the rows each sample has: each sample's positions would move by its place in the batch among "
            "its own rows. Offset each sample's positions by its first row: arange(B)[:, None] * T + pos on a "
            "tensor of T rows per sample."))
    if alike:
        local = (wrapped - owner * (size // samples)).movedim(index_dim, 0).reshape(samples, -1)
        torch._assert_async((local == local[:1]).all(), (
            "fxdp: a shared index into rows of several samples merged into one dim (a scatter into zeros(B * S, "
            "...) at positions built from arange(B)) puts each sample's values at other places among its own "
            "rows (arange(B) * (S + 1): sample b at its row b): each sample's result would depend on its "
            "position in the batch. Offset the same positions by each sample's first row: arange(B)[:, None] * S "
            "+ positions."))


class _Handover:
    """What the forward hands the backward: the parameters whose gradient is a constant
    zero (``constant_gradients``), which the backward graph does not receive but must
    give zero grad samples. Until the backward is compiled (lazily, after the first
    forward) which ones is unknown, and every trainable one is handed over.

    Attributes:
        positions: Their positions among the graph's inputs.
        params: Those inputs of the last forward.
    """

    def __init__(self, positions: list[int]):
        self.positions = positions
        self.params: dict[int, torch.Tensor] = {}


def _forward_runner(compiled: Callable, record: CompiledGraph, autocast_devices: list[str],
                    handover: _Handover, frozen: Sequence[int], trained: dict[int, str],
                    watched: dict[int, str], unseen: _Unseen | None) -> Callable:
    def run(*args):
        if torch.is_grad_enabled():
            guard_gradient_hooks((name, args[i]) for i, name in trained.items())
            if watched and _MIXED:
                _refuse_mixed_inputs(args, watched)
            if unseen is not None:
                unseen.note_forward()
        RUN_STATE.ran = True
        if handover.positions:
            handover.params = {i: args[i] for i in handover.positions}
        for i in frozen:
            if getattr(args[i], "grad_sample", None) is not None:
                args[i].grad_sample = None
        with no_autocast(autocast_devices):
            return compiled(*args)

    return run


class StepRecord:
    """The per-sample results of one backward, shared by the parameters it covered.

    ``handed``: the clipped gradients this backward handed to parameters, checked when it
    ends (``_HandedGradient``)."""

    def __init__(self, step: int, task: int, norms: torch.Tensor, clip_factors: torch.Tensor | None):
        self.step = step
        self.task = task
        self.norms = norms
        self.clip_factors = clip_factors
        self.handed: list[_HandedGradient] = []
        self.unseen: list[tuple[str, torch.Tensor]] = []

    def check_when_backward_ends(self, handed: list[_HandedGradient],
                                 unseen: list[tuple[str, torch.Tensor]]) -> None:
        """Check, when the running ``backward()`` ends, that each parameter in ``handed``
        got its clipped gradient and nothing else, and that each in ``unseen`` (the
        model's, which this backward gives no gradient, with no ``.grad`` at the forward)
        got none."""
        if (handed or unseen) and not (self.handed or self.unseen):
            internals.when_backward_ends(self._check_handed)
        self.handed.extend(handed)
        self.unseen.extend(unseen)

    def _check_handed(self) -> None:
        handed, self.handed = self.handed, []
        unseen, self.unseen = self.unseen, []
        outside = [name for name, p in unseen if p.grad is not None and bool(p.grad.any())]
        if outside:
            raise UnsupportedError(
                f"p.grad of {', '.join(map(repr, outside))} got a gradient in this backward(), but the "
                "model's forward gives it none (it does not use the parameter, or uses it without a "
                "gradient, e.g. detached): something outside the model used it, most often the loss "
                "(logits / temperature, a penalty). That gradient is no sample's, so it was neither "
                "clipped nor counted in the norms, and it would leave the batch's data unbounded in "
                "p.grad. Use the parameter inside the forward (a wrapper module that also computes "
                "what the loss needs), put a penalty on the weights in the optimizer (weight_decay), "
                "or freeze it (requires_grad=False). p.grad now holds that gradient: zero it.")
        changed = [h.name for h in handed if not h.is_all_of_the_gradient()]
        if changed:
            raise UnsupportedError(
                f"p.grad of {', '.join(map(repr, changed))} is not the clipped gradient fxdp's backward "
                "computed: something outside the model's forward added to it in this backward(). Most "
                "often the loss uses the parameter directly (a penalty such as lam * w.pow(2).sum(), a "
                "tied head applied to the output in the loss). That part of the gradient is no sample's, "
                "so it was neither clipped nor counted in the norms, and a use that involves the batch "
                "would leave its data unbounded in p.grad. Put a penalty on the weights in the optimizer "
                "(weight_decay) and any use that involves the batch inside the forward (a wrapper "
                "module). A hook that changes p.grad after it is accumulated "
                "(register_post_accumulate_grad_hook) has the same effect. p.grad now holds the sum: "
                "zero it.")


def _before(param: torch.Tensor) -> tuple | None:
    """``(the tensor, its version, a copy)`` of ``param.grad`` where the backward will
    add to it (a dense ``.grad``)."""
    grad = param.grad
    if grad is None or grad.layout != torch.strided or is_fake(grad):
        return None
    return grad, grad._version, grad.detach().clone()


class _HandedGradient:
    """A clipped gradient fxdp's backward handed a parameter.

    Autograd sums every contribution to a parameter before it accumulates (one
    ``AccumulateGrad`` per backward), and a ``.grad`` that is None then becomes the sum
    itself (without a copy where its layout allows). So when the backward ends, that
    ``.grad`` is the handed tensor unchanged (same memory, same version), an equal copy,
    or a sum with something fxdp never saw. Holding the storage keeps autograd from
    summing into it in place and its memory from being reused meanwhile. A ``.grad``
    that was not None (gradients accumulated over steps, ``zero_grad(set_to_none=False)``)
    gets the sum added to it: it must then be what it was (``before``: that tensor, its
    version and a copy) plus the handed tensor, or untouched (a backward that wrote no
    ``.grad``: ``torch.autograd.grad``, ``backward(inputs=...)`` without it).
    """

    __slots__ = ("before", "dtype", "geometry", "name", "param", "storage", "version")

    def __init__(self, param: torch.Tensor, name: str, grad: torch.Tensor, before: tuple | None):
        self.param, self.name, self.before = param, name, before
        self.storage = grad.untyped_storage()
        self.geometry = (grad.storage_offset(), grad.shape, grad.stride())
        self.version = grad._version
        self.dtype = grad.dtype

    def is_all_of_the_gradient(self) -> bool:
        """Whether ``p.grad`` is what fxdp handed it, or was taken over after it was
        accumulated in a way that can no longer be checked: None (``torch.autograd.grad``,
        ``backward(inputs=...)`` without it, an optimizer step in a post-accumulate hook),
        a view of another buffer (DDP's ``gradient_as_bucket_view``, which holds its
        all-reduced average), or zeros (that hook's ``zero_grad(set_to_none=False)``).
        Autograd's own results are never views."""
        grad = self.param.grad
        if grad is None:
            return True
        if self.before is not None:
            kept, version, copy = self.before
            if (grad is kept and grad._version == version) or not bool(grad.any()) or grad._is_view():
                return True
            handed = torch.empty(0, dtype=self.dtype, device=grad.device).set_(self.storage, *self.geometry)
            return _same_values(grad, copy + handed)
        same = (grad.untyped_storage().data_ptr() == self.storage.data_ptr()
                and (grad.storage_offset(), grad.shape, grad.stride()) == self.geometry)
        if same and grad._version == self.version:
            return True
        if not bool(grad.any()) or (not same and grad._is_view()):
            return True
        if same:  # written in place after it was accumulated
            return False
        handed = torch.empty(0, dtype=self.dtype, device=grad.device).set_(self.storage, *self.geometry)
        return _same_values(grad, handed)


class _Unseen:
    """The trainable parameters of ``transform``'s model with no ``.grad`` when a forward
    of this graph ran with gradients: when its backward ends, each that the backward
    gives no gradient (``covered`` names those it does, known once the backward is
    compiled) must still have none, or zeros. A loss that uses a parameter the forward
    does not (``logits / temperature``) would otherwise leave an unclipped gradient
    there. Not even a view of another buffer passes: the check runs before DDP's
    finalisation, so a bucket view there holds a gradient of this backward.

    A parameter another fxdp backward covered in between (a task's head, when each
    task's forward runs before the first backward) has that backward's clipped
    gradient, which that backward checked: it is left out."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.covered: set[str] = set()
        self.fresh: list[tuple[str, torch.Tensor, StepRecord | None]] = []

    def note_forward(self) -> None:
        self.fresh = [(name, p, getattr(p, "_fxdp_step", None)) for name, p in self.model.named_parameters()
                      if p.requires_grad and p.grad is None and name not in self.covered]

    def take(self) -> list[tuple[str, torch.Tensor]]:
        """Those of the last forward this backward gives no gradient (once: a second
        backward of one forward is not the step it checks)."""
        fresh, self.fresh = self.fresh, []
        return [(name, p) for name, p, step in fresh
                if name not in self.covered and getattr(p, "_fxdp_step", None) is step]


def _backward_runner(compiled: Callable, plan: BackwardPlan, options: Options,
                     autocast_devices: list[str], handover: _Handover,
                     model: torch.nn.Module | None = None,
                     zero: dict[int, list[str]] | None = None,
                     delivered: dict[int, int] | None = None, unseen: _Unseen | None = None) -> Callable:
    """The compiled backward, run as fxdp's step: the checks before it, and the per-sample
    results it hands the parameters after it. ``zero``: the argument positions of output
    gradients that must be zero (values of parameters alone the forward stored, see
    ``stored_gradients``), and the parameters each reaches. ``delivered``: the argument
    position of each parameter → the output position of its clipped gradient, which must
    be all its ``.grad`` receives (checked when the backward ends). ``unseen``: the model's
    parameters the backward gives no gradient, which must get none (checked then too)."""
    n = plan.num_grads
    param_positions = [p.placeholder_index for p in plan.params]
    plan_names = {p.placeholder_index: p.name for p in plan.params}
    constant_positions = list(handover.positions)

    def run(args: list):
        if torch.is_grad_enabled() or internals.in_double_backward():
            raise UnsupportedError(
                "fxdp does not support double backward (create_graph=True): per-sample "
                "gradients and clipping are not differentiable here")
        for i, names in (zero or {}).items():
            if isinstance(args[i], torch.Tensor) and not is_fake(args[i]) and bool(args[i].any()):
                raise UnsupportedError(
                    "the loss used a value the forward computed from the parameter(s) "
                    f"{', '.join(names)} alone and stored (on a module or elsewhere: "
                    "torch.nn.utils.prune's module.weight = weight_orig * weight_mask, a cache): "
                    "fxdp cannot see how each sample's loss uses it outside the forward, so that "
                    "part of the gradient could not be made per-sample. Use the stored value "
                    "inside the forward only (a penalty on the weights belongs in the optimizer, "
                    "as its weight_decay)")
        params = [args[i] for i in param_positions]
        # a hook registered between the forward and this backward
        guard_gradient_hooks((p_plan.name, p) for p_plan, p in zip(plan.params, params))
        if not params:  # no trainable parameter (a compiled loss): nothing to clip or record
            with no_autocast(autocast_devices):
                return list(compiled(args)[:n])
        task = internals.current_graph_task_id()
        _refuse_second_run_in_one_backward(params, plan, task)
        earlier = _earlier_run_in_this_backward(task)
        if earlier is not None and (plan.has_clip_factors or earlier.clip_factors is not None):
            raise UnsupportedError(
                "fxdp clips globally, but a second fxdp graph ran in this backward() with "
                "max_grad_norm (submodules compiled one by one, or two transformed models in "
                "one loss): each graph would clip with the norms of its own parameters only, so "
                "no sample's whole gradient would be bounded by max_grad_norm. The gradients "
                "this backward has written so far are clipped per graph: zero them. Transform "
                "or torch.compile the whole model once; leave parts out by freezing them "
                "(requires_grad=False).")
        grad_sample_params = [args[i] for i in plan.grad_sample_params]
        for p in grad_sample_params:
            # replaced by this backward: free the old one before the new one is built
            p.grad_sample = None
        # (the boxed call frees ``args``)
        handing = []  # (the parameter, its name, its output, a copy of its .grad before) to check
        for i, o in (delivered or {}).items() if task != -1 else ():
            before = _before(args[i])
            if args[i].grad is None or before is not None:
                handing.append((args[i], plan_names[i], o, before))
        with no_autocast(autocast_devices):
            outs = compiled(args)
        extras = list(outs[n:])
        norms = extras.pop(0)
        factors = extras.pop(0) if plan.has_clip_factors else None
        if earlier is not None and earlier.norms.shape == norms.shape:
            # another graph of this backward (a graph break): one total norm per sample
            earlier.norms = torch.sqrt(earlier.norms.square() + norms.square())
            step = earlier
        else:
            step = StepRecord(next(_step_counter), task, norms, factors)
        _LATEST.record = step
        for p in params:
            p._fxdp_step = step
        outside = unseen.take() if unseen is not None else []
        if task != -1:
            step.check_when_backward_ends([
                _HandedGradient(p, name, outs[o], before) for p, name, o, before in handing
                if isinstance(outs[o], torch.Tensor) and outs[o].layout == torch.strided and not is_fake(outs[o])],
                outside)
        for p, gs in zip(grad_sample_params, extras):
            p.grad_sample = gs
        for p in (handover.params[i] for i in constant_positions if i in handover.params):
            if options.grad_sample:
                p.grad_sample = p.new_zeros(norms.shape[0], *p.shape)
            p._fxdp_step = step
        if options.grad_sample and model is not None:
            # replaced by this backward: None for a trainable parameter the forward did not run
            # (every one it ran has this step's record now), also one Dynamo left out of the
            # graph because nothing the forward returns uses it
            for p in model.parameters():
                if getattr(p, "_fxdp_step", None) is not step and (
                        p.requires_grad or getattr(p, "grad_sample", None) is not None):
                    p.grad_sample = None
        return list(outs[:n])

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _earlier_run_in_this_backward(task: int) -> StepRecord | None:
    """The record of an fxdp backward that already ran in this ``backward()``, if any."""
    record = _LATEST.record
    return record if record is not None and task != -1 and record.task == task else None


def _refuse_second_run_in_one_backward(params: list, plan: BackwardPlan, task: int) -> None:
    """Raise if an fxdp backward already covered one of ``params`` in this ``backward()``.

    That happens when the model ran twice before one backward (two views of a batch, two
    halves of it) or a parameter sits in two graphs of a graph break. Each run would clip
    its samples on their own, so a sample that went through both would have a gradient of
    norm up to twice the bound, and the second run would replace the first's grad samples
    and norms. Raising here, before any gradient leaves this graph, leaves the ``p.grad``
    of every parameter covered twice untouched: autograd accumulates a parameter's
    gradient once all its uses are done.
    """
    for p, param_plan in zip(params, plan.params):
        previous = getattr(p, "_fxdp_step", None)
        if previous is not None and task != -1 and previous.task == task:
            raise UnsupportedError(
                f"fxdp's backward ran twice for parameter {param_plan.name!r} within one "
                "backward(): the model was called more than once before it (or a graph break "
                "put the parameter in two graphs). Each call would be clipped on its own, so a "
                "sample that went through both calls would not be bounded by max_grad_norm, and "
                "the later call would replace the earlier one's grad_sample and norms. Call the "
                "model once per backward: where the calls hold different samples (a "
                "discriminator on a real and a fake batch), concatenate them (torch.cat) or call "
                "backward() on each call's loss (gradients accumulate); where one sample goes "
                "through the model twice (two views, a siamese pair), do both inside one "
                "forward of a wrapper module.")


def latest_record(params) -> StepRecord | None:
    """The most recent ``StepRecord`` among ``params``."""
    best = None
    for p in params:
        rec = getattr(p, "_fxdp_step", None)
        if rec is not None and (best is None or rec.step > best.step):
            best = rec
    return best
