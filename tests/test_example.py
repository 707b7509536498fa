"""End-to-end: examples/train_mlp.py runs, learns, and shows the rewritten backward."""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("sklearn", reason="the example trains on scikit-learn's digits (the examples extra)")
pytest.importorskip("tqdm", reason="the example's progress bar (the examples extra)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_mlp.py")


def test_train_mlp_example_runs_and_prints_annotated_graph():
    result = subprocess.run(
        [sys.executable, EXAMPLE, "--epochs", "1", "--compiler", "eager", "--seed", "0"],
        capture_output=True, text=True, timeout=150, cwd=ROOT,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    # The rewritten backward of the first layer's weight, annotated by the rewrite pass.
    annotated = [line for line in result.stdout.splitlines() if "# fxdp:" in line]
    assert annotated, output[-4000:]
    assert all("param=fc1.weight" in line for line in annotated)
    assert any("strategy=clipped sum" in line for line in annotated)
    assert "rule=linear.weight" in result.stdout
    # Per-sample statistics and the strategy table.
    assert re.search(r"mean per-sample grad norm \d+\.\d+, clipped \d+%", result.stdout)
    assert re.search(r"fc1\.weight\s+rule=linear\.weight\s+strategy=(ghost|instantiate)", result.stdout)
    # One epoch of DP-SGD already beats chance (10 classes) by far.
    test_acc = float(re.search(r"epoch 1: .*test acc (\d\.\d+)", result.stdout).group(1))
    assert test_acc > 0.5, result.stdout
