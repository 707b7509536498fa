"""Built-in rules, one file per op family; importing this package registers them."""
from __future__ import annotations

import torch

from fxdp.rules import linear  # noqa: F401  (registers)

__all__ = ["MODULE_OPS"]

# Which canonical ops a module class's parameters feed into, for ``is_supported``.
MODULE_OPS: dict[type, tuple] = {
    torch.nn.Linear: (torch.ops.aten.linear.default,),
    torch.nn.Identity: (),
    torch.nn.ReLU: (),
    torch.nn.GELU: (),
    torch.nn.Dropout: (),
    torch.nn.Flatten: (),
}
