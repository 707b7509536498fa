"""Golden graphs of the passes on a 2-layer MLP, and ``batch_dim_pass`` unit tests.

The MLP is ``Linear(4, 8) -> ReLU -> Linear(8, 3)``, ``B = 5``, float64,
``max_grad_norm=1.0``, ``compiler="eager"``. If a golden string changes on purpose,
regenerate it and read the new graph before pasting it here.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import fxdp
import fxdp.compiler
from fxdp.batching import BatchDim
from fxdp.passes.batch_dims import Loss, batch_dim_pass

DTYPE = torch.float64
MARKER = "torch.ops.fxdp.param_grad.default"


class _Compiled:
    """What one fxdp compilation of the MLP produced, captured at the pass boundaries."""

    def __init__(self, explanation, tagged, tag_counts, rewritten, plan):
        self.explanation = explanation
        self.graph = explanation.graphs[0]
        self.tagged = tagged
        self.tag_counts = tag_counts
        self.rewritten = rewritten
        self.plan = plan


def _compile(model: nn.Module, x: torch.Tensor, **options) -> _Compiled:
    seen = {}
    tag_pass, backward_rewrite_pass = fxdp.compiler.tag_pass, fxdp.compiler.backward_rewrite_pass

    def tag(*args, **kwargs):
        seen["tagged"], seen["counts"] = tag_pass(*args, **kwargs)
        return seen["tagged"], seen["counts"]

    def rewrite(*args, **kwargs):
        seen["rewritten"], seen["plan"] = backward_rewrite_pass(*args, **kwargs)
        return seen["rewritten"], seen["plan"]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fxdp.compiler, "tag_pass", tag)
        mp.setattr(fxdp.compiler, "backward_rewrite_pass", rewrite)
        torch._dynamo.reset()
        dp = fxdp.transform(model, compiler="eager", **options)
        dp(x).pow(2).sum(1).mean().backward()
    return _Compiled(dp.explain(), seen["tagged"], seen["counts"], seen["rewritten"], seen["plan"])


@pytest.fixture(scope="module")
def mlp_compiled() -> _Compiled:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(DTYPE)
    return _compile(model, torch.randn(5, 4, dtype=DTYPE), max_grad_norm=1.0)


@pytest.fixture(scope="module")
def linear_compiled() -> _Compiled:
    torch.manual_seed(0)
    model = nn.Linear(4, 3, bias=False).to(DTYPE)
    return _compile(model, torch.randn(5, 4, dtype=DTYPE), max_grad_norm=1.0)


def _code(code: str) -> str:
    return "\n".join(line.rstrip() for line in code.strip().splitlines())


def _relative_use_ids(code: str) -> str:
    """Use ids come from a process-wide counter: number them from 0 in this graph."""
    ids = [int(m) for m in re.findall(r"param_grad\.default\(\[[^\]]*\], \w+, (\d+)\)", code)]
    base = min(ids)
    return re.sub(r"(param_grad\.default\(\[[^\]]*\], \w+, )(\d+)\)",
                  lambda m: f"{m.group(1)}{int(m.group(2)) - base})", code)


def _clip_norm_key(code: str) -> str:
    """The clip norm's key also comes from a process-wide counter: call it ``key``."""
    return re.sub(r"(max_grad_norm\.default\()\d+,", r"\1key,", code)


# ---------------------------------------------------------------------------
# golden graphs
# ---------------------------------------------------------------------------

# Placeholders in Dynamo's order: 0.weight, 0.bias, x, 2.weight, 2.bias.
CANONICAL = """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1):
    linear = torch.ops.aten.linear.default(arg2_1, arg0_1, arg1_1);  arg2_1 = arg0_1 = arg1_1 = None
    relu = torch.ops.aten.relu.default(linear);  linear = None
    linear_1 = torch.ops.aten.linear.default(relu, arg3_1, arg4_1);  relu = arg3_1 = arg4_1 = None
    return (linear_1,)"""

TAGGED = """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1):
    fxdp_linear = fxdp_markers_fxdp_linear(arg2_1, arg0_1, arg1_1);  arg2_1 = arg0_1 = arg1_1 = None
    relu = torch.ops.aten.relu.default(fxdp_linear);  fxdp_linear = None
    fxdp_linear_1 = fxdp_markers_fxdp_linear_1(relu, arg3_1, arg4_1);  relu = arg3_1 = arg4_1 = None
    return (fxdp_linear_1,)"""

# The partitioned backward before the rewrite: each marker has exactly its rule's
# operands (output gradient, and the layer input for a weight); the input gradient
# (mm, threshold_backward) is the ordinary one.
BACKWARD_WITH_MARKERS = """\
def forward(self, primals_1, primals_2, primals_3, primals_4, primals_5, relu, detach, tangents_1):
    mm = torch.ops.aten.mm.default(tangents_1, primals_4)
    param_grad = torch.ops.fxdp.param_grad.default([tangents_1, relu], primals_4, 2);  relu = primals_4 = None
    param_grad_1 = torch.ops.fxdp.param_grad.default([tangents_1], primals_5, 3);  tangents_1 = primals_5 = None
    detach_1 = torch.ops.aten.detach.default(detach);  detach = None
    threshold_backward = torch.ops.aten.threshold_backward.default(mm, detach_1, 0);  mm = detach_1 = None
    param_grad_2 = torch.ops.fxdp.param_grad.default([threshold_backward, primals_3], primals_1, 0);  primals_3 = primals_1 = None
    param_grad_3 = torch.ops.fxdp.param_grad.default([threshold_backward], primals_2, 1);  threshold_backward = primals_2 = None
    return (param_grad_2, param_grad_3, None, param_grad, param_grad_1)"""

# Linear(4, 3, bias=False), B = 5, T = 1, mean loss: ghost norm ‖g‖²·‖a‖², norms
# rescaled by B (the tangent carries 1/B), clip factors min(1, C / (norm + 1e-6)),
# then the clipped gradient (c ⊙ g)ᵀ a as one mm. Outputs: grad, None (x), norms, factors.
LINEAR_BACKWARD_REWRITTEN = """\
def forward(self, arg0_1, arg1_1, arg2_1):
    permute = torch.ops.aten.permute.default(arg2_1, [0, 1])
    permute_1 = torch.ops.aten.permute.default(arg1_1, [0, 1])
    view = torch.ops.aten.view.default(permute, [5, 1, 3]);  permute = None
    view_1 = torch.ops.aten.view.default(permute_1, [5, 1, 4]);  permute_1 = None
    pow_1 = torch.ops.aten.pow.Tensor_Scalar(view, 2);  view = None
    sum_1 = torch.ops.aten.sum.dim_IntList(pow_1, [1, 2]);  pow_1 = None
    pow_2 = torch.ops.aten.pow.Tensor_Scalar(view_1, 2);  view_1 = None
    sum_2 = torch.ops.aten.sum.dim_IntList(pow_2, [1, 2]);  pow_2 = None
    mul = torch.ops.aten.mul.Tensor(sum_1, sum_2);  sum_1 = sum_2 = None
    stack = torch.ops.aten.stack.default([mul]);  mul = None
    sum_3 = torch.ops.aten.sum.dim_IntList(stack, [0]);  stack = None
    clamp_min = torch.ops.aten.clamp_min.default(sum_3, 0);  sum_3 = None
    sqrt = torch.ops.aten.sqrt.default(clamp_min);  clamp_min = None
    mul_1 = torch.ops.aten.mul.Tensor(sqrt, 5);  sqrt = None
    max_grad_norm = torch.ops.fxdp.max_grad_norm.default(key, mul_1)
    add = torch.ops.aten.add.Tensor(mul_1, 1e-06)
    div = torch.ops.aten.div.Tensor(max_grad_norm, add);  max_grad_norm = add = None
    clamp = torch.ops.aten.clamp.default(div, None, 1.0);  div = None
    permute_2 = torch.ops.aten.permute.default(arg2_1, [0, 1]);  arg2_1 = None
    permute_3 = torch.ops.aten.permute.default(arg1_1, [0, 1]);  arg1_1 = None
    view_2 = torch.ops.aten.view.default(permute_2, [5, 1, 3]);  permute_2 = None
    view_3 = torch.ops.aten.view.default(permute_3, [5, 1, 4]);  permute_3 = None
    view_4 = torch.ops.aten.view.default(clamp, [-1, 1, 1])
    mul_2 = torch.ops.aten.mul.Tensor(view_2, view_4);  view_2 = view_4 = None
    view_5 = torch.ops.aten.view.default(mul_2, [-1, 3]);  mul_2 = None
    t = torch.ops.aten.t.default(view_5);  view_5 = None
    view_6 = torch.ops.aten.view.default(view_3, [-1, 4]);  view_3 = None
    mm = torch.ops.aten.mm.default(t, view_6);  t = view_6 = None
    view_7 = torch.ops.aten.view.default(mm, [3, 4]);  mm = None
    return (view_7, None, mul_1, clamp)"""


def test_canonical_graph(mlp_compiled):
    assert _code(mlp_compiled.graph.stages["canonical"]) == CANONICAL


def test_tagged_graph(mlp_compiled):
    assert _code(mlp_compiled.graph.stages["tagged"]) == TAGGED
    mlp_compiled.tagged.graph.lint()
    tagged = [n for n in mlp_compiled.tagged.graph.nodes if "fxdp" in n.meta]
    assert [n.meta["fxdp"]["params"] for n in tagged] == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
    assert [n.meta["fxdp"]["rule"] for n in tagged] == ["linear.weight, linear.bias"] * 2
    # nn_module_stack survives the tag pass (errors and explain() name the module)
    assert all("nn_module_stack" in n.meta for n in tagged)


def test_backward_with_markers(mlp_compiled):
    assert _relative_use_ids(_code(mlp_compiled.graph.stages["backward"])) == BACKWARD_WITH_MARKERS


def test_rule_counts(mlp_compiled):
    expected = {"linear.weight": 2, "linear.bias": 2}
    assert mlp_compiled.tag_counts == expected
    assert mlp_compiled.graph.rule_counts == expected
    assert mlp_compiled.plan.rule_counts == expected
    assert mlp_compiled.explanation.rule_counts == expected


def test_rewritten_backward(mlp_compiled):
    gm = mlp_compiled.rewritten
    gm.graph.lint()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.fxdp.param_grad.default not in targets
    assert MARKER not in mlp_compiled.graph.stages["backward_rewritten"]
    assert targets.count(torch.ops.aten.clamp.default) == 1  # the clip factors, once
    # every node the rewrite inserted says which rule, parameter and strategy made it
    annotated = [n.meta["fxdp"] for n in gm.graph.nodes if "fxdp" in n.meta]
    assert annotated and all({"rule", "strategy"} <= set(info) for info in annotated)
    per_param = {(info["param"], info["strategy"]) for info in annotated if "param" in info}
    assert {p for p, _ in per_param} == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert {s for _, s in per_param} >= {"clipped sum"}
    # outputs: 5 gradients (None for x), then norms and clip factors
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert len(out.args[0]) == 5 + 2 and out.args[0][2] is None
    assert mlp_compiled.plan.num_grads == 5 and mlp_compiled.plan.has_clip_factors


def test_plans(mlp_compiled):
    plans = {(p.name, p.rule, p.uses, p.strategy) for p in mlp_compiled.explanation.plans}
    # T = 1: the weights' ghost norm ‖g‖²‖a‖² is cheaper than instantiating; a bias
    # gradient is its output gradient, instantiated for free.
    assert plans == {
        ("0.weight", "linear.weight", 1, "ghost"),
        ("0.bias", "linear.bias", 1, "instantiate"),
        ("2.weight", "linear.weight", 1, "ghost"),
        ("2.bias", "linear.bias", 1, "instantiate"),
    }
    costs = {p.name: p.costs for p in mlp_compiled.explanation.plans}
    assert costs["0.weight"]["ghost"] < costs["0.weight"]["instantiate"]
    assert costs["2.weight"]["ghost"] < costs["2.weight"]["instantiate"]


def test_linear_rewritten_backward(linear_compiled):
    assert _clip_norm_key(_code(linear_compiled.graph.stages["backward_rewritten"])) == LINEAR_BACKWARD_REWRITTEN
    linear_compiled.rewritten.graph.lint()


# ---------------------------------------------------------------------------
# batch_dim_pass on small make_fx graphs
# ---------------------------------------------------------------------------

B, T, D = 5, 3, 4


def analyse(fn, *inputs: tuple[tuple[int, ...], int | None], batch_size: int = B):
    """Trace ``fn`` on ``(shape, batch dim or None)`` inputs and run ``batch_dim_pass``.

    Returns:
        (analysis, batch of the (single) output, the traced graph)
    """
    args = [torch.randn(*shape) for shape, _ in inputs]
    gm = make_fx(fn, tracing_mode="fake")(*args)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    placeholder_batch = {ph: None if d is None else BatchDim(d) for ph, (_, d) in zip(placeholders, inputs)}
    analysis = batch_dim_pass(gm, placeholder_batch, {}, batch_size=batch_size)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out = out[0] if isinstance(out, (list, tuple)) else out
    return analysis, analysis.batch[out], gm


def _is(batch, dim: int, inner: int = 1) -> bool:
    return isinstance(batch, BatchDim) and batch.dim == dim and batch.inner == inner \
        and getattr(batch, "outer", 1) == 1


def test_view_merging_the_batch():
    analysis, out, gm = analyse(lambda x: x.reshape(-1, D), ((B, T, D), 0))
    assert torch.ops.aten.view.default in [n.target for n in gm.graph.nodes]
    assert _is(out, 0, inner=T), out
    assert repr(out) == f"BatchDim(0, inner={T})"
    assert analysis.problems == [] and analysis.loss is None


def test_view_round_trip():
    _, out, _ = analyse(lambda x: x.reshape(-1, D).reshape(B, T, D), ((B, T, D), 0))
    assert _is(out, 0), out


def test_view_merging_a_dim_before_the_batch():
    """``[T, B, d] -> [T·B, d]`` (batch_first=False): dim 0 holds T blocks of B samples."""
    analysis, out, _ = analyse(lambda x: x.reshape(-1, D), ((T, B, D), 1))
    assert analysis.problems == []
    assert isinstance(out, BatchDim) and out.dim == 0 and out.inner == 1 and out.outer == T, out


def test_permute():
    _, out, _ = analyse(lambda x: x.permute(2, 0, 1), ((B, T, D), 0))
    assert _is(out, 1), out
    _, out, _ = analyse(lambda x: x.permute(1, 2, 0), ((B, T, D), 0))
    assert _is(out, 2), out


def test_transpose():
    _, out, _ = analyse(lambda x: x.transpose(0, 1), ((B, T, D), 0))
    assert _is(out, 1), out
    _, out, _ = analyse(lambda x: x.transpose(1, 2), ((B, T, D), 0))
    assert _is(out, 0), out
    _, out, _ = analyse(lambda x: x.transpose(0, 1), ((T, B, D), 1))
    assert _is(out, 0), out


def test_unsqueeze_and_squeeze():
    _, out, _ = analyse(lambda x: x.unsqueeze(0), ((B, T, D), 0))
    assert _is(out, 1), out
    _, out, _ = analyse(lambda x: x.unsqueeze(1).squeeze(1), ((B, T, D), 0))
    assert _is(out, 0), out


def test_sum_over_non_batch_dims():
    analysis, out, _ = analyse(lambda x: x.sum((1, 2)), ((B, T, D), 0))
    assert _is(out, 0), out
    assert analysis.loss is None and analysis.problems == []
    _, out, _ = analyse(lambda x: x.sum(1, keepdim=True), ((B, T, D), 0))
    assert _is(out, 0), out
    _, out, _ = analyse(lambda x: x.sum(0), ((T, B, D), 1))
    assert _is(out, 0), out


def test_matmul_keeps_a_merged_batch_layout():
    """``[T·B]`` rows (``outer=T``) stay so through a product, and a view splits them back."""
    analysis, out, _ = analyse(lambda x, w: torch.matmul(x.reshape(1, -1, D), w).view(T, B, D),
                               ((T, B, D), 1), ((1, D, D), None))
    assert analysis.problems == [] and _is(out, 1), (analysis.problems, out)


def test_max_pools_with_indices_and_glu():
    analysis, out, _ = analyse(lambda x: F.max_pool2d(x, 2, return_indices=True)[1], ((B, 4, 6, 6), 0))
    assert analysis.problems == [] and _is(out, 0), out
    analysis, out, _ = analyse(lambda x: F.adaptive_max_pool2d(x, 2), ((B, 4, 6, 6), 0))
    assert analysis.problems == [] and _is(out, 0), out
    analysis, out, _ = analyse(lambda x: F.glu(x), ((B, T, 2 * D), 0))
    assert analysis.problems == [] and _is(out, 0), out
    analysis, _, _ = analyse(lambda x: F.glu(x, 0), ((2 * B, D), 0), batch_size=2 * B)
    assert "along the batch dim" in analysis.problems[0].reason


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reduction_over_all_dims_is_the_loss(reduction):
    fn = (lambda x: x.pow(2).mean()) if reduction == "mean" else (lambda x: x.pow(2).sum())
    analysis, out, _ = analyse(fn, ((B, T, D), 0))
    assert isinstance(out, Loss) and out.reduction == reduction
    assert analysis.loss == reduction and analysis.problems == []


def test_sum_over_the_batch_dim_is_a_problem():
    analysis, out, _ = analyse(lambda x: x.sum(0), ((B, T, D), 0))
    assert [p.op for p in analysis.problems] == ["aten.sum.dim_IntList"]
    assert "reduces over the batch dim" in analysis.problems[0].reason
    assert not isinstance(out, BatchDim)
    assert analysis.loss is None


def test_sizes_are_never_matched():
    """B == d: only the propagated batch dim decides, not the sizes."""
    analysis, out, _ = analyse(lambda x: x.sum(1), ((4, 4), 0), batch_size=4)
    assert _is(out, 0) and analysis.problems == []
    analysis, _, _ = analyse(lambda x: x.sum(0), ((4, 4), 0), batch_size=4)
    assert [p.op for p in analysis.problems] == ["aten.sum.dim_IntList"]
    # the same graph with the batch at dim 1 is fine
    analysis, out, _ = analyse(lambda x: x.sum(0), ((4, 4), 1), batch_size=4)
    assert _is(out, 0) and analysis.problems == []


def test_shared_operands_broadcast():
    analysis, out, _ = analyse(lambda x, w: torch.relu(x @ w + w[0]), ((B, T, D), 0), ((D, D), None))
    assert _is(out, 0) and analysis.problems == []


def test_samples_multiplied_together_is_a_problem():
    analysis, _, _ = analyse(lambda x: x @ x.t(), ((B, D), 0))
    assert analysis.problems and "aten.mm.default" in {p.op for p in analysis.problems}


def test_batch_norm_in_training_is_a_problem():
    def bn(x, mean, var):
        return torch.nn.functional.batch_norm(x, mean, var, training=True)

    analysis, _, _ = analyse(bn, ((B, D), 0), ((D,), None), ((D,), None))
    assert analysis.problems
    assert any("BatchNorm in training mode" in p.reason for p in analysis.problems)


def test_pass_does_not_change_the_graph():
    def fn(x):
        return x.reshape(-1, D).sum(0)

    args = [torch.randn(B, T, D)]
    gm = make_fx(fn, tracing_mode="fake")(*args)
    before = gm.code
    ph = next(n for n in gm.graph.nodes if n.op == "placeholder")
    analysis = batch_dim_pass(gm, {ph: BatchDim(0)}, {}, batch_size=B)
    assert gm.code == before
    assert analysis.problems  # sum over the merged batch dim
    for node in gm.graph.nodes:
        assert "fxdp_batch" in node.meta


def test_norms_come_before_the_input_gradients_that_follow_them():
    """Each layer's per-sample work is emitted as soon as its operands exist: before the
    input gradient of the same layer, so the per-sample scratch memory and the input
    gradient's buffers never coexist (the CNN benchmark's peak memory)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.GroupNorm(2, 4), nn.ReLU(),
                          nn.Conv2d(4, 6, 3, stride=2, padding=1), nn.Flatten(), nn.Linear(6 * 16, 2))
    compiled = _compile(model, torch.randn(5, 3, 16, 16), max_grad_norm=1.0)
    nodes = list(compiled.rewritten.graph.nodes)
    per_sample = [i for i, n in enumerate(nodes) if "conv_weight" in str(n.target)]
    input_grads = [i for i, n in enumerate(nodes) if n.target is torch.ops.fxdp.conv_input_grad_channels_first.default
                   or (n.target is torch.ops.aten.convolution_backward.default and n.args[-1][0])]
    assert len(per_sample) == 2 and len(input_grads) == 1  # the first conv needs no input gradient
    second_conv_work = per_sample[0]  # the backward meets the second conv first
    assert second_conv_work < input_grads[0]


def test_only_outputs_whose_elements_overlap_are_copied():
    """The copy around AOTAutograd's replayed output views: overlapping windows and
    broadcasts are copied, dense outputs (symbolic strides in any order) are not."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from fxdp.passes.canonicalize import _may_overlap_itself

    env = ShapeEnv()

    def size(name: str, hint: int):
        symbol = env.create_symbol(hint, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
        return env.create_symintnode(symbol, hint=hint)

    with FakeTensorMode(shape_env=env):
        n, t = size("B", 3), size("T", 5)
        scores = torch.empty(n, 4, t, t)
        assert not _may_overlap_itself(scores) and not _may_overlap_itself(scores.transpose(1, 3))
        assert _may_overlap_itself(torch.empty(n, 6).unfold(-1, 2, 1))
        assert _may_overlap_itself(torch.empty(1, 6).expand(n, 6))
