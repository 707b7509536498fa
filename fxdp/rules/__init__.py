"""Built-in rules, one file per op family; importing this package registers them all.

Each rule file registers its ``OpRule``s at import and may define ``MODULE_OPS``
(module class -> canonical ops its parameters feed), merged here for
``fxdp.is_supported``.
"""
from __future__ import annotations

import importlib
import pkgutil

import torch

__all__ = ["MODULE_OPS", "REFUSED_MODULES"]

# Modules without parameters are trivially supported.
MODULE_OPS: dict[type, tuple] = {
    cls: ()
    for cls in (
        torch.nn.Identity, torch.nn.ReLU, torch.nn.GELU, torch.nn.SiLU, torch.nn.Tanh,
        torch.nn.Sigmoid, torch.nn.Dropout, torch.nn.Flatten, torch.nn.Softmax,
        torch.nn.LogSoftmax, torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict,
    )
}

# Modules that lower to ops of several rule files.
MODULE_OPS.update({
    torch.nn.MultiheadAttention: (torch.ops.aten.linear.default,),
    torch.nn.TransformerEncoderLayer: (torch.ops.aten.linear.default, torch.ops.aten.layer_norm.default),
    torch.nn.TransformerDecoderLayer: (torch.ops.aten.linear.default, torch.ops.aten.layer_norm.default),
    torch.nn.TransformerEncoder: (torch.ops.aten.linear.default, torch.ops.aten.layer_norm.default),
    torch.nn.TransformerDecoder: (torch.ops.aten.linear.default, torch.ops.aten.layer_norm.default),
    torch.nn.Transformer: (torch.ops.aten.linear.default, torch.ops.aten.layer_norm.default),
})

# So is every module of torch.nn's parameter-free families: activations, pooling, padding,
# dropout, losses, upsampling, pixel and channel shuffles, fold/unfold, distances,
# (un)flattening, local response norms. (``nn.PReLU`` and ``nn.MultiheadAttention`` live
# among the activations and hold parameters.)
_PARAMETER_FREE_FILES = {"activation", "pooling", "padding", "dropout", "loss", "pixelshuffle", "upsampling",
                         "fold", "distance", "flatten", "channelshuffle"}
MODULE_OPS.update({
    cls: () for cls in vars(torch.nn).values()
    if isinstance(cls, type) and issubclass(cls, torch.nn.Module)
    and cls.__module__.rpartition(".")[2] in _PARAMETER_FREE_FILES
    and not issubclass(cls, (torch.nn.PReLU, torch.nn.MultiheadAttention))
})
# Parameter-free, but refused: torch.compile's gradient of ``multilabel_margin_loss`` is
# wrong in torch 2.13, so its op has no batch propagation (passes/batch_dims.py).
REFUSED_MODULES = (torch.nn.MultiLabelMarginLoss,)
for _cls in REFUSED_MODULES:
    del MODULE_OPS[_cls]
MODULE_OPS.update({torch.nn.LocalResponseNorm: (), torch.nn.CrossMapLRN2d: ()})

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name.startswith("_"):
        continue
    _module = importlib.import_module(f"{__name__}.{_info.name}")
    MODULE_OPS.update(getattr(_module, "MODULE_OPS", {}))
