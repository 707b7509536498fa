"""Opacus's own per-sample-gradient tests, run against fxdp.

``opacus/tests/grad_samples`` (shipped in the opacus wheel) checks every layer Opacus
supports — convolutions 1-3d, embeddings and bags, group/instance/layer/RMS norms,
linear, Opacus's ``DPLSTM``/``DPGRU``/``DPRNN``, ``DPMultiheadAttention`` and
``SequenceBias`` — on hypothesis-drawn shapes (empty batches included), comparing
Opacus's per-sample gradients with its microbatch loop for both loss reductions. Here
the same tests compare that microbatch loop with ``fxdp.transform(..., grad_sample=True)``
instead: a reference and a suite written by someone else. Its embedding ghost-norm test
(``embedding_norm_sample_test``, per-sample norms worked out by hand from given ids and
output gradients) runs against ``fxdp.transform(...).per_sample_norms``.

One case differs by design: a ``PackedSequence`` input, which fxdp refuses (it has no
batch dim); there the test checks the refusal and compares nothing (``dp_rnn_test``
draws packed and padded inputs; the padded ones are compared as everywhere else).
"""
from __future__ import annotations

import unittest

import pytest
import torch
from hypothesis import HealthCheck, settings
from torch.nn.utils.rnn import PackedSequence

import fxdp

pytest.importorskip("opacus", reason="Opacus's per-sample test suite ships in the opacus wheel (the test extra)")

from opacus.grad_sample import embedding_norm_sample  # noqa: E402
from opacus.tests.grad_samples import common  # noqa: E402
from opacus.utils.module_utils import trainable_parameters  # noqa: E402
from opacus.utils.per_sample_gradients_utils import (  # noqa: E402
    ModelWithLoss,
    clone_module,
    compute_microbatch_grad_sample,
    unpack_packedsequences,
)

EXAMPLES = 8  # hypothesis examples per test (Opacus's own run uses 100)


def fxdp_grad_samples(x, module, batch_first=True, loss_reduction="mean", grad_sample_mode=None):
    """Opacus's ``compute_opacus_grad_sample`` with ``fxdp.transform`` in place of
    ``GradSampleModule``: the same clone of the module, loss and backward."""
    torch._dynamo.reset()  # each drawn layer is new: no recompile limit across examples
    model = clone_module(module)
    in_dims = (None, 0) if type(x) is tuple else None  # EmbeddingBag's (flat ids, offsets)
    dp = fxdp.transform(model, grad_sample=True, loss_reduction=loss_reduction, batch_first=batch_first,
                        in_dims=in_dims, compiler="eager")
    ModelWithLoss(dp, loss_reduction)(x).backward()
    return {name: p.grad_sample for name, p in trainable_parameters(model)}


def microbatch_and_fxdp(x, module, batch_first=True, loss_reduction="mean", grad_sample_mode=None,
                        chunk_method=iter):
    """Replaces ``compute_grad_samples_microbatch_and_opacus`` in Opacus's test base."""
    if type(x) is PackedSequence:
        with pytest.raises(fxdp.UnsupportedError, match="PackedSequence"):
            fxdp_grad_samples(x, module, batch_first, loss_reduction)
        reference = compute_microbatch_grad_sample(unpack_packedsequences(x), module, batch_first=batch_first,
                                                   loss_reduction=loss_reduction, chunk_method=chunk_method)
        return reference, reference  # refused: nothing to compare
    reference = compute_microbatch_grad_sample(x, module, batch_first=batch_first, loss_reduction=loss_reduction,
                                               chunk_method=chunk_method)
    return reference, fxdp_grad_samples(x, module, batch_first, loss_reduction)


def _run_test(self, x, module, batch_first=True, atol=10e-6, rtol=10e-5, ew_compatible=True, chunk_method=iter):
    """Opacus's ``run_test`` for one "grad_sample_mode": fxdp."""
    for loss_reduction in ("sum", "mean"):
        self.run_test_with_reduction(x, module, batch_first=batch_first, loss_reduction=loss_reduction,
                                     atol=atol, rtol=rtol, grad_sample_mode="fxdp", chunk_method=chunk_method)


common.compute_grad_samples_microbatch_and_opacus = microbatch_and_fxdp
common.compute_opacus_grad_sample = fxdp_grad_samples  # the empty-batch path
common.GradSampleHooks_test.run_test = _run_test

# The tests' own ``@settings(deadline=...)`` inherit the rest from the profile loaded
# when they are defined.
_previous = settings.get_current_profile_name()
settings.register_profile("fxdp-opacus-suite", max_examples=EXAMPLES,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.load_profile("fxdp-opacus-suite")
try:
    from opacus.tests.grad_samples.conv1d_test import Conv1d_test  # noqa: E402,F401
    from opacus.tests.grad_samples.conv2d_test import Conv2d_test as _Conv2d_test  # noqa: E402
    from opacus.tests.grad_samples.conv3d_test import Conv3d_test  # noqa: E402,F401
    from opacus.tests.grad_samples.dp_multihead_attention_test import MultiHeadAttention_test  # noqa: E402,F401
    from opacus.tests.grad_samples.dp_rnn_test import RNN_test  # noqa: E402,F401
    from opacus.tests.grad_samples.embedding_bag_test import Embedding_bag_test  # noqa: E402,F401
    from opacus.tests.grad_samples.embedding_norm_sample_test import (  # noqa: E402
        TestComputeEmbeddingNormSample as _EmbeddingNormSample_test,
    )
    from opacus.tests.grad_samples.embedding_test import Embedding_test  # noqa: E402,F401
    from opacus.tests.grad_samples.group_norm_test import GroupNorm_test  # noqa: E402,F401
    from opacus.tests.grad_samples.instance_norm1d_test import InstanceNorm1d_test  # noqa: E402,F401
    from opacus.tests.grad_samples.instance_norm2d_test import InstanceNorm2d_test  # noqa: E402,F401
    from opacus.tests.grad_samples.instance_norm3d_test import InstanceNorm3d_test  # noqa: E402,F401
    from opacus.tests.grad_samples.layer_norm_test import LayerNorm_test  # noqa: E402,F401
    from opacus.tests.grad_samples.linear_test import Linear_test  # noqa: E402,F401
    from opacus.tests.grad_samples.rms_norm_test import RMSNorm_test  # noqa: E402,F401
    from opacus.tests.grad_samples.sequence_bias_test import SequenceBias_test  # noqa: E402,F401
finally:
    settings.load_profile(_previous)


class _EmbeddingOutputTimes(torch.nn.Module):
    """``embedding(ids) * backprops``: summed, its gradient at the embedding's output is
    ``backprops``, as Opacus's norm sampler is handed."""

    def __init__(self, embedding: torch.nn.Embedding):
        super().__init__()
        self.embedding = embedding

    def forward(self, ids, backprops):
        return self.embedding(ids) * backprops


def fxdp_embedding_norm_sample(layer, activations, backprops):
    """Opacus's ``compute_embedding_norm_sample`` (the weight's per-sample gradient norms,
    given the ids and the gradient at the layer's output) by ``fxdp.transform``."""
    torch._dynamo.reset()
    (ids,) = activations
    dp = fxdp.transform(_EmbeddingOutputTimes(layer), loss_reduction="sum", compiler="eager")
    dp(ids, backprops.to(layer.weight.dtype)).sum().backward()
    return {layer.weight: dp.per_sample_norms}


class EmbeddingNormSample_test(_EmbeddingNormSample_test):
    def setUp(self):
        self._opacus = embedding_norm_sample.compute_embedding_norm_sample
        embedding_norm_sample.compute_embedding_norm_sample = fxdp_embedding_norm_sample

    def tearDown(self):
        embedding_norm_sample.compute_embedding_norm_sample = self._opacus


class Conv2d_test(_Conv2d_test):
    # Opacus's own unfold and its hooks on one shape: nothing of fxdp's.
    test_unfold2d = unittest.skip("tests Opacus's unfold2d")(lambda self: None)
    test_asymetric_dilation_and_kernel_size = unittest.skip("tests GradSampleModule")(lambda self: None)


del _Conv2d_test, _EmbeddingNormSample_test
