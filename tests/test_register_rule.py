"""``fxdp.register_rule``: a user's own op (DESIGN.md, "Extension").

A ``torch.library.custom_op`` stays one node in fxdp's canonical graph
(``torch.ops.fxdp_tests.scaled_linear.default(x, weight, scale)``); without a rule a
parameter fed to it is refused, with a rule it is exact against the microbatch loop
(per-sample gradients, clipping, ghost norms). A duplicate registration raises,
``override=True`` replaces a built-in rule. Rules for a ``torch.autograd.Function``
class are tested in ``test_autograd_function.py``. ``examples/register_rule.py`` runs
as a script.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdp
from fxdp.registry import GHOST_INNER, GRAD, RULES
from fxdp.rules.linear import LINEAR
from reference import assert_close_all, reference, tolerance

B, T, D = 5, 2, 16
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the custom op ---------------------------------------------------------------------------

@torch.library.custom_op("fxdp_tests::scaled_linear", mutates_args=())
def scaled_linear(x: torch.Tensor, weight: torch.Tensor, scale: float) -> torch.Tensor:
    return F.linear(x, weight) * scale


@scaled_linear.register_fake
def _(x, weight, scale):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _setup_context(ctx, inputs, output):
    x, weight, scale = inputs
    ctx.save_for_backward(x, weight)
    ctx.scale = scale


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
    return grad @ weight * ctx.scale, grad_weight * ctx.scale, None


scaled_linear.register_autograd(_backward, setup_context=_setup_context)
OP = torch.ops.fxdp_tests.scaled_linear.default


class Model(nn.Module):
    def __init__(self, d: int = D):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # keyword scale: canonicalisation passes it positionally
        return self.head(torch.tanh(torch.ops.fxdp_tests.scaled_linear(x, self.weight, scale=0.5)))


class Outer(nn.Module):
    """The op one module down, so that the refusal has a module path."""

    def __init__(self):
        super().__init__()
        self.proj = Model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


# -- its rule (index letters: n batch, t positions, i in, o out) ---------------------------------

def _sequence(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1, t.shape[-1])


def _per_sample_grad(g, x, *, scale):
    return torch.einsum("nto,nti->noi", _sequence(g), _sequence(x)) * scale


def _sum_grad(g, x, *, scale):
    g, x = _sequence(g), _sequence(x)
    return g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) * scale


def _ghost_sq_norm(g, x, *, scale):
    g, x = _sequence(g), _sequence(x)
    return (torch.bmm(x, x.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2)) * scale ** 2


def _costs(shapes, *, scale):
    (n, *positions, o), (_, *_, i) = shapes
    t = 1
    for s in positions:
        t *= s
    return {"ghost": n * t * t * (i + o + 1), "instantiate": n * t * i * o + n * i * o}


def _input_grad(args, grad_out, index):
    assert index == 0, index
    return grad_out @ args[1] * args[2]


WEIGHT_RULE = fxdp.ParamRule(name="scaled_linear.weight", operands=(GRAD, 0),
                             per_sample_grad=_per_sample_grad, sum_grad=_sum_grad,
                             ghost_sq_norm=_ghost_sq_norm, costs=_costs)


def op_rule(param_rule: fxdp.ParamRule = WEIGHT_RULE) -> fxdp.OpRule:
    return fxdp.OpRule(
        op=OP,
        params={1: param_rule},
        input_grad=_input_grad,
        batch_rule=lambda args_batch, args_meta, out_meta, config: args_batch[0],
        config=lambda args: {"scale": args[2]},
    )


@pytest.fixture(autouse=True)
def restore_rules():
    """Registrations are global: every test leaves the tables as it found them."""
    rules, inner = dict(RULES), dict(GHOST_INNER)
    yield
    RULES.clear()
    RULES.update(rules)
    GHOST_INNER.clear()
    GHOST_INNER.update(inner)


def _x(dtype=torch.float64) -> torch.Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).reshape(out.shape[0], -1).sum(1)


# -- refusal without a rule ----------------------------------------------------------------------

def _names_op_and_parameter(problems, parameter: str) -> bool:
    return any("fxdp_tests.scaled_linear" in str(p) and parameter in str(p) for p in problems)


def test_unregistered_custom_op_is_refused_by_validate():
    torch.manual_seed(0)
    problems = fxdp.validate(Outer().double(), _x())
    assert problems
    assert any(p.op == "fxdp_tests.scaled_linear.default" and p.module_path == "proj" for p in problems), problems
    assert not fxdp.is_supported(OP)
    assert not fxdp.is_supported(torch.ops.fxdp_tests.scaled_linear)


def test_unregistered_custom_op_is_refused_by_strict_transform():
    torch.manual_seed(0)
    model = Outer().double()
    with pytest.raises(fxdp.UnsupportedError, match=r"fxdp_tests\.scaled_linear\.default in proj") as info:
        fxdp.transform(model, max_grad_norm=1.0, compiler="eager")(_x())
    assert "fxdp.register_rule" in str(info.value)
    assert all(p.grad is None for p in model.parameters())


def test_unregistered_custom_op_is_refused_with_strict_false():
    """A refusal that is not tied to one parameter cannot be excluded: it raises too, with
    no warning that would say the parameters it names were left out."""
    torch.manual_seed(0)
    model = Outer().double()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(fxdp.UnsupportedError, match=r"not tied to one parameter(?s:.*)fxdp_tests\.scaled_linear"):
            fxdp.transform(model, max_grad_norm=1.0, strict=False, compiler="eager")(_x())
    assert not [w for w in caught if "get no gradient" in str(w.message)]


def test_refusal_names_the_parameter_the_custom_op_consumes():
    torch.manual_seed(0)
    problems = fxdp.validate(Outer().double(), _x())
    assert _names_op_and_parameter(problems, "proj.weight"), problems


# -- with a rule ------------------------------------------------------------------------------

def test_custom_op_stays_one_node_with_the_parameter_as_argument_1():
    fxdp.register_rule(op_rule())
    assert fxdp.is_supported(OP) and fxdp.is_supported(torch.ops.fxdp_tests.scaled_linear)
    torch.manual_seed(0)
    model = Model().double()
    dp_model = fxdp.transform(model, grad_sample=True, compiler="eager")
    _loss(dp_model(_x())).mean().backward()
    (graph,) = dp_model.explain().graphs
    canonical = graph.stages["canonical"]
    # placeholders: the parameter comes first (Dynamo's order), then x
    assert "torch.ops.fxdp_tests.scaled_linear.default(arg1_1, arg0_1, 0.5)" in canonical, canonical
    assert "fxdp_scaled_linear" in graph.stages["tagged"]
    assert dp_model.explain().rule_counts["scaled_linear.weight"] == 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("ghost", [True, False], ids=["with_ghost", "without_ghost"])
@pytest.mark.parametrize("mode", ["grad_sample", "clip"])
def test_registered_rule_matches_the_loop(mode: str, ghost: bool, dtype: torch.dtype):
    param_rule = WEIGHT_RULE if ghost else dataclasses.replace(WEIGHT_RULE, ghost_sq_norm=None, costs=None)
    fxdp.register_rule(op_rule(param_rule))
    torch.manual_seed(0)
    model = Model().to(dtype)
    x = _x(dtype)
    ref = reference(copy.deepcopy(model).double(), (x.double(),), lambda out, i: _loss(out).sum())
    clip = float(ref.norms.median()) if mode == "clip" else None
    dp_model = fxdp.transform(model, max_grad_norm=clip, grad_sample=mode == "grad_sample", compiler="eager")
    _loss(dp_model(x)).mean().backward()

    tol = tolerance(dtype)
    params = dict(model.named_parameters())
    assert_close_all({n: p.grad for n, p in params.items()}, ref.grad("mean", clip), tol, "p.grad")
    if mode == "grad_sample":
        assert_close_all({n: p.grad_sample for n, p in params.items()}, ref.per_sample, tol, "p.grad_sample")
    assert_close_all({"norms": dp_model.per_sample_norms}, {"norms": ref.norms}, tol, "per_sample_norms")

    plan = next(p for p in dp_model.explain().plans if p.name == "weight")
    assert plan.rule == "scaled_linear.weight"
    if mode == "clip" and ghost:
        # T = 2 positions against 16x16 features: the Gram route is far cheaper
        assert plan.strategy == "ghost", plan
        assert plan.costs["ghost"] < plan.costs["instantiate"]
    elif mode == "clip":
        assert plan.strategy == "instantiate", plan


# -- the registry ---------------------------------------------------------------------------

def test_duplicate_registration_raises():
    fxdp.register_rule(op_rule())
    with pytest.raises(ValueError, match="already registered.*override=True"):
        fxdp.register_rule(op_rule())
    with pytest.raises(ValueError, match="already registered"):
        fxdp.register_rule(LINEAR)
    assert RULES[torch.ops.aten.linear.default] is LINEAR


def test_override_replaces_a_builtin_rule():
    """Replace aten.linear's rule by one whose parameter rules carry other names: the
    compiled graph uses it (explain counts it) and stays exact."""
    mine = dataclasses.replace(LINEAR, params={
        1: dataclasses.replace(LINEAR.params[1], name="my_linear.weight"),
        2: dataclasses.replace(LINEAR.params[2], name="my_linear.bias"),
    })
    assert fxdp.register_rule(mine, override=True) is mine
    assert RULES[torch.ops.aten.linear.default] is mine
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = _x()
    ref = reference(model, (x,), lambda out, i: _loss(out).sum())
    clip = float(ref.norms.median())
    dp_model = fxdp.transform(model, max_grad_norm=clip, compiler="eager")
    _loss(dp_model(x)).mean().backward()
    assert dp_model.explain().rule_counts == {"my_linear.weight": 2, "my_linear.bias": 2}
    assert_close_all({n: p.grad for n, p in model.named_parameters()}, ref.grad("mean", clip),
                     tolerance(torch.float64), "p.grad")


# -- the example ---------------------------------------------------------------------------------

def test_example_script_runs_and_matches_the_loop():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "register_rule.py")],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    out = result.stdout
    assert "mylib.scaled_linear.default in proj" in out
    assert "fxdp.is_supported(torch.ops.mylib.scaled_linear) = True" in out
    assert "per-sample gradients match the loop" in out
    assert "proj.weight  grad_sample (8, 16, 16)" in out
    assert "rule=scaled_linear.weight" in out and "strategy=ghost" in out
    assert ("without a rule: clipped gradient matches the loop; proj.weight "
            "rule=function.ScaledLinearFunction[1] strategy=instantiate (per-sample VJP)") in out
    assert ("with a rule: clipped gradient matches the loop; proj.weight "
            "rule=scaled_linear_function.weight strategy=ghost") in out
