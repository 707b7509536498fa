"""fxdp: differentially private training in PyTorch as a compiler problem.

``fxdp.transform(model, max_grad_norm=1.0)`` compiles ``model`` so that one
ordinary ``loss.backward()`` leaves the clipped gradient in ``p.grad``, the
per-sample norms in ``dp_model.per_sample_norms`` and, on request, per-sample
gradients in ``p.grad_sample`` — all computed by the compiled backward graph.
"""
from fxdp import rules as _rules  # noqa: F401  (registers the built-in rules)
from fxdp.backend import backend
from fxdp.errors import Problem, UnsupportedError
from fxdp.explain import Explanation, explain, validate
from fxdp.module import DPModule, per_sample_norms, transform
from fxdp.options import Options
from fxdp.registry import OpRule, ParamRule, is_supported, register_rule

__all__ = [
    "transform",
    "backend",
    "explain",
    "validate",
    "is_supported",
    "register_rule",
    "per_sample_norms",
    "DPModule",
    "Explanation",
    "Options",
    "OpRule",
    "ParamRule",
    "Problem",
    "UnsupportedError",
]
__version__ = "0.1.0"
