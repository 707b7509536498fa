"""Canonicalise a Dynamo graph to pre-dispatch ATen, where rules are keyed."""
from __future__ import annotations

from typing import Any, Sequence

import torch.fx as fx

from fxdp._torch_internals import make_fx_traced

__all__ = ["canonicalize_pass"]


def canonicalize_pass(gm: fx.GraphModule, fake_args: Sequence[Any], *, fake_mode) -> fx.GraphModule:
    """Retrace ``gm`` with ``make_fx(pre_dispatch=True)`` under its fake mode.

    ``torch._C._nn.linear(x, w, b)`` becomes ``torch.ops.aten.linear.default(x, w, b)``;
    placeholders keep their order, node meta (``nn_module_stack``) is preserved.
    """
    out = make_fx_traced(fx.Interpreter(gm).run, fake_args, fake_mode=fake_mode, pre_dispatch=True)
    out.graph.lint()
    out.recompile()
    return out
