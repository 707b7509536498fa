"""Inspection and the rule registry (DESIGN.md, "Inspection", "Refusals", "Extension")."""
from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdp
from fxdp.registry import RULES

DTYPE = torch.float64
PARAMS = ("0.weight", "0.bias", "2.weight", "2.bias")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(DTYPE)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=DTYPE)


def _assert_shows_rewritten_graphs(text: str, strategies: str) -> None:
    forward = text.split("--- forward (after partitioning) ---")[1].split("--- backward (rewritten) ---")[0]
    backward = text.split("--- backward (rewritten) ---")[1].split("--- per-parameter strategy ---")[0]
    assert "def forward(" in forward and "torch.ops.aten.addmm.default" in forward
    assert "fxdp" not in forward  # the forward is the ordinary ATen code
    assert "def forward(" in backward and "torch.ops.aten.clamp.default" in backward
    assert "fxdp.param_grad" not in backward
    for name in PARAMS:
        rule = "linear.weight" if name.endswith("weight") else "linear.bias"
        pattern = rf"# fxdp: rule={re.escape(rule)}, param={re.escape(name)}, strategy=({strategies})"
        assert re.search(pattern, backward), f"no annotation for {name} in\n{backward}"
        assert re.search(rf"# fxdp: rule={re.escape(rule)}, param={re.escape(name)}, strategy=clipped sum", backward)
    assert "# fxdp: rule=clip, strategy=norms and clip factors" in backward
    for name in PARAMS:
        assert re.search(rf"  {re.escape(name)}: rule=linear\.\w+ uses=1 strategy=\w+ costs: ", text)
    # the weights' choice between ghost norm and instantiation shows its costs
    assert re.search(r"0\.weight: .*costs: ghost=[\d.e+]+ flops, instantiate=[\d.e+]+ flops", text)


def test_explain_shows_forward_and_annotated_backward():
    model = mlp()
    explanation = fxdp.explain(model, randn(5, 4), max_grad_norm=1.0)
    assert isinstance(explanation, fxdp.Explanation)
    assert len(explanation.graphs) == 1
    assert explanation.rule_counts == {"linear.weight": 2, "linear.bias": 2}
    _assert_shows_rewritten_graphs(str(explanation), "ghost|instantiate")
    assert repr(explanation) == str(explanation)


def test_explain_has_no_side_effects():
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = randn(5, 4)
    x_before = x.clone()
    fxdp.explain(model, x, max_grad_norm=1.0, grad_sample=True)
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and torch.equal(p, before[name]), name
        assert p.grad is None, name
        assert not hasattr(p, "grad_sample"), name
        assert not hasattr(p, "_fxdp_step"), name
    assert fxdp.per_sample_norms(model) is None
    assert torch.equal(x, x_before) and x.grad is None


def test_explain_of_a_transformed_model_after_a_step():
    model = mlp()
    dp = fxdp.transform(model, max_grad_norm=1.0, compiler="eager")
    assert dp.explain().graphs == []
    out = dp(randn(5, 4))
    assert "<not compiled: run a backward>" in str(dp.explain())
    out.pow(2).sum(1).mean().backward()
    text = str(dp.explain())
    assert "compiler='eager'" in text and "max_grad_norm=1.0" in text
    _assert_shows_rewritten_graphs(text, "ghost|instantiate")
    assert {p.name for p in dp.explain().plans} == set(PARAMS)


def test_debug_dir_dumps_every_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("FXDP_DEBUG_DIR", str(tmp_path / "dump"))
    dp = fxdp.transform(mlp(), max_grad_norm=1.0, compiler="eager")
    dp(randn(5, 4)).pow(2).sum(1).mean().backward()
    files = sorted(os.listdir(tmp_path / "dump"))
    stages = [re.sub(r"^\d+_", "", f).removesuffix(".py") for f in files]
    assert stages == ["captured", "canonical", "tagged", "forward", "backward", "backward_rewritten"], files
    text = {s: (tmp_path / "dump" / f).read_text() for s, f in zip(stages, files)}
    assert "torch._C._nn.linear" in text["captured"]
    assert "torch.ops.aten.linear.default" in text["canonical"]
    assert "fxdp_linear" in text["tagged"]
    assert "torch.ops.fxdp.param_grad.default" in text["backward"]
    assert "# fxdp: rule=linear.weight, param=0.weight" in text["backward_rewritten"]
    assert "fxdp.param_grad" not in text["backward_rewritten"]


def test_no_dump_without_debug_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("FXDP_DEBUG_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    dp = fxdp.transform(mlp(), compiler="eager")
    dp(randn(5, 4)).sum().backward()
    assert os.listdir(tmp_path) == []


def test_is_supported():
    assert fxdp.is_supported(nn.Linear)
    assert fxdp.is_supported(nn.Linear(2, 3))
    assert fxdp.is_supported(torch.ops.aten.linear.default)
    assert fxdp.is_supported(torch.ops.aten.linear)  # the overload packet
    assert fxdp.is_supported(nn.ReLU) and fxdp.is_supported(nn.Sequential)  # no parameters
    assert fxdp.is_supported(nn.LSTMCell) and fxdp.is_supported(nn.Bilinear)  # canonicalised
    assert not fxdp.is_supported(torch.ops.aten.cumsum.default)
    assert fxdp.is_supported(F.linear) and fxdp.is_supported(F.conv_transpose2d) and fxdp.is_supported(torch.bmm)
    assert fxdp.is_supported(torch.ops.aten.conv_transpose2d)  # its only overload is .input
    assert not fxdp.is_supported(F.batch_norm) and not fxdp.is_supported(F.prelu) and not fxdp.is_supported(len)
    assert not fxdp.is_supported(object)
    assert not fxdp.is_supported("linear")


PARAMETER_FREE = [nn.MaxPool2d(2), nn.AvgPool1d(2), nn.AdaptiveAvgPool2d(1), nn.LPPool2d(2, 2), nn.LeakyReLU(),
                  nn.ELU(), nn.Hardswish(), nn.Mish(), nn.GLU(), nn.Softmax2d(), nn.Upsample(scale_factor=2),
                  nn.ZeroPad2d(1), nn.ReflectionPad1d(1), nn.Dropout2d(), nn.AlphaDropout(), nn.PixelShuffle(2),
                  nn.ChannelShuffle(2), nn.Unflatten(1, (2, 2)), nn.Fold((4, 4), 2), nn.Unfold(2),
                  nn.CrossEntropyLoss(weight=torch.ones(3)), nn.MSELoss(), nn.CosineSimilarity(),
                  nn.LocalResponseNorm(2)]


@pytest.mark.parametrize("module", PARAMETER_FREE, ids=lambda m: type(m).__name__)
def test_a_parameter_free_module_of_torch_nn_is_supported_as_class_and_instance(module):
    """Trivially supported, its class too (before, only a short list of classes was)."""
    assert not list(module.parameters())
    assert fxdp.is_supported(module) and fxdp.is_supported(type(module))


def test_is_supported_answers_a_batch_norm_by_its_mode():
    """A BatchNorm in eval mode with running statistics is an affine map per sample, and
    runs exactly (validate finds nothing, the microbatch loop agrees); in training mode,
    or without running statistics, it mixes samples and validate refuses it."""
    norm = nn.BatchNorm1d(3).double()
    norm.running_mean.uniform_(-1, 1)
    norm.running_var.uniform_(0.5, 2)
    model = nn.Sequential(nn.Linear(4, 3), norm).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    assert not fxdp.is_supported(norm) and not fxdp.is_supported(nn.BatchNorm1d)
    assert fxdp.validate(model, x) != []
    model.eval()
    assert fxdp.is_supported(norm) and fxdp.validate(model, x) == []
    dp = fxdp.transform(model, grad_sample=True, loss_reduction="sum", compiler="eager")
    dp(x).pow(2).sum().backward()
    for name, p in model.named_parameters():
        loop = torch.stack([torch.autograd.grad(model(x[i:i + 1]).pow(2).sum(), p)[0] for i in range(5)])
        torch.testing.assert_close(p.grad_sample, loop, msg=name)
    stats_free = nn.BatchNorm1d(3, track_running_stats=False).eval()
    assert not fxdp.is_supported(stats_free)
    assert fxdp.validate(nn.Sequential(nn.Linear(4, 3), stats_free), torch.randn(5, 4)) != []


def test_is_supported_knows_the_other_parameterised_modules_of_torch_nn():
    """The RNN base classes count as what they become; PReLU has no rule of its own (it
    runs through the per-sample VJP of ``prelu``). An InstanceNorm with running
    statistics answers by its mode (in training mode it updates them from the batch,
    which validate refuses), and the lazy InstanceNorms keep them by default."""
    tracking = nn.InstanceNorm1d(3, affine=True, track_running_stats=True).double()
    model = nn.Sequential(nn.Linear(4, 3), nn.Unflatten(1, (3, 1)), nn.Upsample(scale_factor=4),
                          tracking).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    assert not fxdp.is_supported(tracking) and fxdp.validate(model, x) != []
    model.eval()
    assert fxdp.is_supported(tracking) and fxdp.validate(model, x) == []
    assert fxdp.is_supported(nn.InstanceNorm2d(3, affine=True)) and fxdp.is_supported(nn.InstanceNorm2d)
    assert not fxdp.is_supported(nn.LazyInstanceNorm2d) and fxdp.is_supported(nn.RNNBase)
    assert fxdp.is_supported(nn.RNNCellBase) and fxdp.is_supported(nn.LazyLinear)
    assert not fxdp.is_supported(nn.PReLU) and fxdp.is_supported(nn.MultiheadAttention(4, 2))
    assert not fxdp.is_supported(nn.AdaptiveLogSoftmaxWithLoss)


def test_a_refused_parameter_free_module_is_not_supported():
    """``multilabel_margin_loss`` has no batch propagation (torch.compile's gradient of it
    is wrong in torch 2.13): validate refuses it, and is_supported says so."""
    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.loss = nn.Linear(4, 3), nn.MultiLabelMarginLoss(reduction="sum")

        def forward(self, x, y):
            return self.loss(self.fc(x), y)

    y = torch.tensor([[0, 2, -1]] * 5)
    assert fxdp.validate(Step(), torch.randn(5, 4), y) != []
    assert not fxdp.is_supported(nn.MultiLabelMarginLoss) and not fxdp.is_supported(nn.MultiLabelMarginLoss())


class GaussianNLL(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.loss = nn.Linear(4, 3), nn.GaussianNLLLoss(reduction="sum")

    def forward(self, x, y):
        return self.loss(self.fc(x), y, torch.ones_like(y))


def test_validate_lists_a_guard_on_data_as_dynamo_problem():
    """``nn.GaussianNLLLoss`` checks its variance's values, on which Dynamo cannot guard
    (a ``UserError``, not ``Unsupported``): validate lists it, as transform refuses it,
    instead of raising Dynamo's error."""
    (problem,) = fxdp.validate(GaussianNLL(), torch.randn(5, 4), torch.randn(5, 3))
    assert problem.op == "dynamo" and "Could not guard on data-dependent expression" in problem.reason
    with pytest.raises(fxdp.UnsupportedError, match="Dynamo cannot capture it there"):
        fxdp.transform(GaussianNLL(), compiler="eager")(torch.randn(5, 4), torch.randn(5, 3))


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))


def test_unknown_module_is_not_supported():
    assert not fxdp.is_supported(Custom)
    assert not fxdp.is_supported(Custom())
    assert not fxdp.is_supported(nn.Sequential(nn.Linear(3, 3), Custom()))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.norm = nn.LayerNorm(3)

    def forward(self, x):
        return self.norm(self.fc(x))


def test_a_model_of_ones_own_is_supported_by_its_submodules():
    """An instance of a class fxdp does not list holds no parameter itself: its
    submodules answer. The class alone says nothing (its submodules are not known)."""
    assert fxdp.is_supported(Block()) and fxdp.validate(Block(), torch.randn(4, 3)) == []
    assert fxdp.is_supported(nn.ModuleDict({"a": Block(), "b": nn.Sequential(Block(), nn.ReLU())}))
    assert not fxdp.is_supported(Block)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2)
    assert fxdp.is_supported(encoder) and fxdp.is_supported(nn.TransformerEncoder)
    assert fxdp.is_supported(nn.Transformer) and fxdp.is_supported(nn.TransformerDecoder)


@pytest.mark.parametrize("module", [nn.LSTM, nn.GRU, nn.RNN])
def test_is_supported_knows_rnns(module):
    assert fxdp.is_supported(module)


def test_subclass_of_a_supported_module_is_supported():
    class MyLinear(nn.Linear):
        pass

    assert fxdp.is_supported(MyLinear)


def test_register_rule_duplicate_needs_override():
    original = RULES[torch.ops.aten.linear.default]
    copy = dataclasses.replace(original)
    with pytest.raises(ValueError, match="already registered.*override=True"):
        fxdp.register_rule(copy)
    assert RULES[torch.ops.aten.linear.default] is original
    try:
        assert fxdp.register_rule(copy, override=True) is copy
        assert RULES[torch.ops.aten.linear.default] is copy
    finally:
        fxdp.register_rule(original, override=True)
    assert RULES[torch.ops.aten.linear.default] is original


def test_register_rule_for_a_new_op():
    op = torch.ops.aten.cumsum.default
    assert not fxdp.is_supported(op)
    rule = fxdp.OpRule(op=op, params={}, input_grad=lambda args, grad, i: None,
                       batch_rule=lambda *a: None)
    try:
        fxdp.register_rule(rule)
        assert fxdp.is_supported(op)
        with pytest.raises(ValueError):
            fxdp.register_rule(rule)
    finally:
        RULES.pop(op, None)
    assert not fxdp.is_supported(op)


class _MadeWithoutDevice(nn.Module):
    """Creates tensors without ``device=``: they must meet the parameters' device."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.positions = nn.Embedding(8, 4)

    def forward(self, x):
        zeros = torch.zeros(x.shape, dtype=x.dtype)
        return self.fc(x + zeros + self.positions(torch.arange(x.shape[1])))


def test_validate_and_explain_with_tensors_created_without_device():
    model = _MadeWithoutDevice()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 5, 4)
    assert fxdp.validate(model, x) == []
    explanation = fxdp.explain(model, x, max_grad_norm=1.0)
    assert explanation.rule_counts == {"linear.weight": 1, "linear.bias": 1, "embedding.weight": 1}
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) and p.grad is None, name


def test_validate_traces_rnns_as_transform_does():
    """transform turns on Dynamo's ``allow_rnn``; validate must not report it as a problem."""
    model = nn.Sequential(nn.LSTM(4, 5, batch_first=True))
    assert fxdp.validate(model, torch.randn(3, 5, 4)) == []


def test_validate_and_explain_leave_a_lazy_model_uninitialised():
    """A lazy module's parameters get their shapes from the example arguments in the fake
    copy; the model itself stays lazy, and its first real forward initialises it."""
    model = nn.Sequential(nn.LazyConv2d(4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2),
                          nn.LazyBatchNorm1d())
    x = torch.randn(3, 2, 6, 6)
    problems = fxdp.validate(model, x)
    assert [(p.op, p.module_path) for p in problems] == [("aten.batch_norm.default", "4")], problems
    model[4].eval()  # eval mode: an uninitialised running mean cannot answer, the forward will
    explanation = fxdp.explain(model, x, max_grad_norm=1.0)
    assert {"conv.weight", "linear.weight"} <= set(explanation.rule_counts), explanation.rule_counts
    assert "3.weight: rule=linear.weight" in str(explanation)
    assert all(nn.parameter.is_lazy(p) for p in model.parameters())
    assert all(nn.parameter.is_lazy(b) for b in model.buffers() if b.dtype.is_floating_point)
    model(x)
    assert model[3].weight.shape == (2, 64) and not nn.parameter.is_lazy(model[3].weight)


class _SharedDataDependentShapes(nn.Module):
    """``nonzero`` and ``masked_select`` of shared data: output sizes known only at run time."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("keep", torch.tensor([1.0, 0.0, 1.0, 1.0]))

    def forward(self, x):
        columns = self.keep.nonzero().squeeze(1)
        kept = self.fc.weight.masked_select(self.keep.bool().expand(4, 4))
        return self.fc(x)[:, columns].sum(1) + kept.sum()


def test_explain_and_validate_with_data_dependent_shapes_of_shared_data():
    """Fake tensors have no data: ``explain`` gives sizes that depend on data a symbol."""
    model = _SharedDataDependentShapes()
    x = torch.randn(3, 4)
    assert fxdp.validate(model, x) == []
    text = str(fxdp.explain(model, x, max_grad_norm=1.0))
    assert "torch.ops.aten.nonzero.default" in text and "torch.ops.aten.masked_select.default" in text
    assert "# fxdp: rule=linear.weight, param=fc.weight" in text
    for p in model.parameters():
        assert p.grad is None


def test_a_refusal_names_the_models_line_not_a_tensor_notation_helpers(tmp_path, monkeypatch):
    """An op a helper package runs for the model (``einops.reduce``) is reported at the
    model's line that called it (was the helper's own line, in ``einops/_backends.py``)."""
    package = tmp_path / "einops"
    package.mkdir()
    (package / "__init__.py").write_text("def reduce(x, pattern, how):\n    return x.mean(0)  # over the batch\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "einops", raising=False)
    import einops

    class BatchMean(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x) - einops.reduce(self.lin(x), "b d -> d", "mean")  # the model's line

    problems = fxdp.validate(BatchMean(), torch.randn(4, 3))
    assert problems and "the model's line" in str(problems[0]) and "__init__.py" not in str(problems[0])
