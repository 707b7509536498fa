"""fxdp's compiler passes; each is a plain function over an ``fx.GraphModule``."""
from fxdp.passes.batch_dims import BatchAnalysis, batch_dim_pass
from fxdp.passes.canonicalize import canonicalize_pass
from fxdp.passes.rewrite_backward import BackwardPlan, backward_rewrite_pass
from fxdp.passes.tag import tag_pass

__all__ = [
    "BatchAnalysis",
    "BackwardPlan",
    "batch_dim_pass",
    "canonicalize_pass",
    "tag_pass",
    "backward_rewrite_pass",
]
