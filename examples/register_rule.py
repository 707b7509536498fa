"""Teach fxdp a custom op: ``fxdp.register_rule`` for a ``torch.library.custom_op``.

fxdp makes an op per-sample from its *rule*. A user's own op is opaque to it, so a
model that feeds a trainable parameter into one is refused until the op has a rule
(as Opacus users call ``register_grad_sampler`` for their own layers). This script:

1. defines ``mylib::scaled_linear(x, weight, scale) = scale · x Wᵀ`` with
   ``torch.library.custom_op``, ``register_fake`` and ``register_autograd``;
2. shows ``fxdp.validate`` refusing the model (the op and the parameter by name);
3. registers an ``fxdp.OpRule`` for it: where the batch goes, which argument is the
   parameter, its per-sample gradient, summed gradient and Gram-matrix ghost norm;
4. checks the per-sample gradients and the clipped gradient against a plain loop
   over the samples, and prints the strategy fxdp chose for each parameter;
5. writes the same layer as a ``torch.autograd.Function``, which fxdp runs without a
   rule (its backward per sample), then registers the same maths for the Function
   class, which gives it the ghost norm.

Run: ``python examples/register_rule.py`` (a few seconds, CPU, no download).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fxdp
from fxdp.registry import GRAD


# -- 1. the custom op, as torch.library documents it ------------------------------------

@torch.library.custom_op("mylib::scaled_linear", mutates_args=())
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
    grad_x = grad @ weight * ctx.scale
    grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) * ctx.scale
    return grad_x, grad_weight, None


scaled_linear.register_autograd(_backward, setup_context=_setup_context)


class ScaledLinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, scale: float):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in ** 0.5)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mylib.scaled_linear(x, self.weight, self.scale)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = ScaledLinear(16, 16, scale=0.5)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(x)))


# -- 3. the rule ---------------------------------------------------------------------------
# The op appears in fxdp's canonical graph as itself:
#     scaled_linear = torch.ops.mylib.scaled_linear.default(x, weight, 0.5)
# Argument 1 is the parameter. Its marker operands are the output gradient (GRAD) and
# argument 0 (x), both brought to batch-major layout before the functions below run.
# Index letters: n batch, t positions of one sample (T of them), i in, o out features.

def _sequence(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1, t.shape[-1])  # [n, *positions, f] -> [n, t, f]


def per_sample_grad(g: torch.Tensor, x: torch.Tensor, *, scale: float) -> torch.Tensor:
    """``∂W_n = scale · Σ_t g_nto x_nti``  -> ``[n, o, i]``."""
    return torch.einsum("nto,nti->noi", _sequence(g), _sequence(x)) * scale


def sum_grad(g: torch.Tensor, x: torch.Tensor, *, scale: float) -> torch.Tensor:
    """``Σ_n ∂W_n`` (linear in ``g``: with clip-scaled ``g`` it is the clipped gradient)."""
    g, x = _sequence(g), _sequence(x)
    return g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) * scale


def ghost_sq_norm(g: torch.Tensor, x: torch.Tensor, *, scale: float) -> torch.Tensor:
    """``‖∂W_n‖² = scale² Σ_{t,s} (x_nt·x_ns)(g_nt·g_ns)`` without building ``∂W_n``."""
    g, x = _sequence(g), _sequence(x)
    return (torch.bmm(x, x.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2)) * scale ** 2


def costs(shapes, *, scale: float) -> dict[str, float]:
    """Flops of each strategy, from the operand shapes ``[n, *t, o]`` and ``[n, *t, i]``."""
    (n, *positions, o), (_, *_, i) = shapes
    t = 1
    for s in positions:
        t *= s
    return {"ghost": n * t * t * (i + o + 1), "instantiate": n * t * i * o + n * i * o}


def input_grad(args, grad_out, index):
    x, weight, scale = args
    if index != 0:
        raise NotImplementedError(f"scaled_linear: argument {index} has no input gradient rule")
    return grad_out @ weight * scale


def batch_rule(args_batch, args_meta, out_meta, config):
    """The output keeps x's batch dim; the feature dim (last) must not be it."""
    x_batch = args_batch[0]
    if x_batch is not None and x_batch.dim is not None and x_batch.dim == args_meta[0].dim() - 1:
        raise ValueError("the batch dim is the feature dim that scaled_linear contracts")
    return x_batch


def check(args_batch, args_meta, index):
    if args_batch[0] is None:
        return "the input of scaled_linear has no batch dim: its weight gradient is shared by all samples"
    if args_batch[index] is not None:
        return "the weight itself is batched"
    return None


SCALED_LINEAR_WEIGHT = fxdp.ParamRule(
    name="scaled_linear.weight",
    operands=(GRAD, 0),
    per_sample_grad=per_sample_grad,
    sum_grad=sum_grad,
    ghost_sq_norm=ghost_sq_norm,
    costs=costs,
)

SCALED_LINEAR = fxdp.OpRule(
    op=torch.ops.mylib.scaled_linear.default,
    params={1: SCALED_LINEAR_WEIGHT},
    input_grad=input_grad,
    batch_rule=batch_rule,
    config=lambda args: {"scale": args[2]},
    check=check,
)


# -- 4. check against the loop ---------------------------------------------------------------

def per_sample_loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum(-1).mean(-1)  # [B, T, 3] -> [B]


def loop_grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each sample's own gradient, one sample at a time (the ground truth)."""
    grads: dict[str, list[torch.Tensor]] = {n: [] for n, _ in model.named_parameters()}
    for i in range(x.shape[0]):
        model.zero_grad()
        per_sample_loss(model(x[i:i + 1])).sum().backward()
        for n, p in model.named_parameters():
            grads[n].append(p.grad.clone())
    model.zero_grad()
    return {n: torch.stack(g) for n, g in grads.items()}


def main() -> None:
    torch.manual_seed(0)
    model = Model().double()
    x = torch.randn(8, 2, 16, dtype=torch.float64)  # 8 samples, 2 positions each

    print("Before registering a rule, fxdp.validate says:")
    for problem in fxdp.validate(model, x):
        print("   ", problem)

    fxdp.register_rule(SCALED_LINEAR)
    print(f"\nfxdp.is_supported(torch.ops.mylib.scaled_linear) = "
          f"{fxdp.is_supported(torch.ops.mylib.scaled_linear)}")
    assert not fxdp.validate(model, x)

    truth = loop_grads(model, x)
    dp_model = fxdp.transform(model, grad_sample=True, compiler="eager")
    per_sample_loss(dp_model(x)).mean().backward()
    print("\nPer-sample gradients, fxdp vs. the loop over samples:")
    for n, p in model.named_parameters():
        err = (p.grad_sample - truth[n]).abs().max().item()
        print(f"    {n:12s} grad_sample {tuple(p.grad_sample.shape)}  max |fxdp - loop| = {err:.2e}")
        assert err <= 1e-9 * truth[n].abs().max().item()
    print("    per-sample gradients match the loop")

    # Clipping: the norms come from the ghost norm where it is cheaper.
    norms = torch.cat([g.flatten(1) for g in truth.values()], 1).norm(dim=1)
    clip = float(norms.median())
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    model.zero_grad()
    dp_model = fxdp.transform(model, max_grad_norm=clip, compiler="eager")
    per_sample_loss(dp_model(x)).mean().backward()
    print(f"\nClipped gradient (C = {clip:.3f}), fxdp vs. the loop:")
    for n, p in model.named_parameters():
        expected = (truth[n] * factors.reshape(-1, *[1] * (truth[n].dim() - 1))).mean(0)
        err = (p.grad - expected).abs().max().item()
        print(f"    {n:12s} max |fxdp - loop| = {err:.2e}")
        assert err <= 1e-9 * expected.abs().max().item()
    print("\nPer-parameter strategy:")
    for plan in dp_model.explain().plans:
        cost = ", ".join(f"{k}={v:.3g}" for k, v in plan.costs.items()) or "-"
        print(f"    {plan.name:12s} rule={plan.rule:22s} strategy={plan.strategy:12s} flops: {cost}")

    function_part(x)


# -- 5. the same layer as a torch.autograd.Function --------------------------------------------

class ScaledLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, scale):
        ctx.save_for_backward(x, weight)
        ctx.scale = scale
        return x @ weight.t() * scale

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) * ctx.scale
        return grad @ weight * ctx.scale, grad_weight, None


class FunctionModel(Model):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = ScaledLinearFunction.apply(x, self.proj.weight, self.proj.scale)
        return self.head(torch.tanh(h))


# For a Function, ``params`` and the operand indices count ``apply``'s arguments
# (weight is argument 1, x argument 0); fxdp reads the batch dims from its forward and
# the input gradient from its backward. The scale is a constant of this model.
SCALED_LINEAR_FUNCTION = fxdp.OpRule(op=ScaledLinearFunction, params={1: fxdp.ParamRule(
    name="scaled_linear_function.weight",
    operands=(GRAD, 0),
    per_sample_grad=lambda g, x: per_sample_grad(g, x, scale=0.5),
    sum_grad=lambda g, x: sum_grad(g, x, scale=0.5),
    ghost_sq_norm=lambda g, x: ghost_sq_norm(g, x, scale=0.5),
    costs=lambda shapes: costs(shapes, scale=0.5),
)})


def function_part(x: torch.Tensor) -> None:
    torch.manual_seed(0)
    model = FunctionModel().double()
    truth = loop_grads(model, x)
    norms = torch.cat([g.flatten(1) for g in truth.values()], 1).norm(dim=1)
    clip = float(norms.median())
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    for registered in (False, True):
        if registered:
            fxdp.register_rule(SCALED_LINEAR_FUNCTION)
        model.zero_grad()
        dp_model = fxdp.transform(model, max_grad_norm=clip, compiler="eager")
        per_sample_loss(dp_model(x)).mean().backward()
        for n, p in model.named_parameters():
            expected = (truth[n] * factors.reshape(-1, *[1] * (truth[n].dim() - 1))).mean(0)
            assert (p.grad - expected).abs().max().item() <= 1e-9 * expected.abs().max().item()
        plan = next(p for p in dp_model.explain().plans if p.name == "proj.weight")
        print(f"\nautograd.Function, {'with' if registered else 'without'} a rule: clipped gradient "
              f"matches the loop; proj.weight rule={plan.rule} strategy={plan.strategy}")


if __name__ == "__main__":
    main()
