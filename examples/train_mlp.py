"""Train a small MLP on scikit-learn's 8x8 digits with DP-SGD, clipping done by fxdp.

The data (1797 images, 10 classes) ships inside scikit-learn: nothing is downloaded.

One DP-SGD step is: one ordinary ``loss.backward()`` through ``fxdp.transform(model,
max_grad_norm=C)``, after which ``p.grad`` already holds ``(1/B) Σ_i c_i g_i`` (each
sample's gradient clipped to norm ``C``); we add Gaussian noise of standard deviation
``noise_multiplier · C / B`` ourselves and take an SGD step. fxdp computes the
per-sample norms inside the compiled backward graph; at the end we print the rewritten
backward code of the first layer's weight so you can see how.

Usage::

    python examples/train_mlp.py                       # Inductor, 5 epochs
    python examples/train_mlp.py --compiler eager --epochs 1
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from tqdm import tqdm

import fxdp


class MLP(nn.Module):
    def __init__(self, d_in: int = 64, hidden: int = 128, classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.head(x)


def load_data(seed: int, test_fraction: float = 0.2):
    """Digits as float32 in [0, 1], standardised with the training set's statistics."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    mean, std = x[train].mean(0), x[train].std(0) + 0.1
    x = (x - mean) / std
    return x[train], y[train], x[test], y[test]


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    # The plain model shares its parameters with the fxdp model; evaluating it eagerly
    # needs no compilation.
    return (model(x).argmax(1) == y).float().mean().item()


def annotated_lines(explanation: fxdp.Explanation, param: str) -> list[str]:
    """The lines of the rewritten backward whose ``# fxdp:`` note names ``param``."""
    lines = []
    for graph in explanation.graphs:
        for line in graph.annotated_backward.splitlines():
            code, sep, note = line.partition("  # fxdp: ")
            if sep and f"param={param}," in note + ",":
                lines.append(line.strip())
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--compiler", choices=["inductor", "eager"], default="inductor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_data(args.seed)
    model = MLP()
    dp_model = fxdp.transform(model, max_grad_norm=args.max_grad_norm, compiler=args.compiler)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    batch, clip = args.batch_size, args.max_grad_norm
    noise_std = args.noise_multiplier * clip / batch  # the loss is a mean over the batch
    steps_per_epoch = len(x_train) // batch  # fixed batch size: one compiled graph
    print(f"digits: {len(x_train)} train / {len(x_test)} test samples, batch {batch}, "
          f"C={clip}, sigma={args.noise_multiplier}, lr={args.lr}, compiler={args.compiler}")

    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(x_train))
        norm_sum, clipped, seen = 0.0, 0, 0
        bar = tqdm(range(steps_per_epoch), desc=f"epoch {epoch}", leave=False)
        for step in bar:
            idx = order[step * batch:(step + 1) * batch]
            loss = F.cross_entropy(dp_model(x_train[idx]), y_train[idx])
            loss.backward()  # p.grad = (1/B) Σ_i min(1, C/‖g_i‖) g_i
            with torch.no_grad():
                for p in model.parameters():
                    p.grad += torch.randn_like(p.grad) * noise_std
            optimizer.step()
            optimizer.zero_grad()

            norms = dp_model.per_sample_norms
            norm_sum += norms.sum().item()
            clipped += (norms > clip).sum().item()
            seen += len(norms)
            bar.set_postfix(loss=f"{loss.item():.3f}")
        bar.close()
        print(f"epoch {epoch}: train acc {accuracy(model, x_train, y_train):.3f}, "
              f"test acc {accuracy(model, x_test, y_test):.3f}, "
              f"mean per-sample grad norm {norm_sum / seen:.3f}, clipped {clipped / seen:.0%}")
    print(f"trained in {time.perf_counter() - start:.1f}s (compilation included)")

    explanation = dp_model.explain()
    print("\nThe rewritten backward graph, the nodes fxdp inserted for fc1.weight:")
    for line in annotated_lines(explanation, "fc1.weight"):
        print("   ", line)
    print("\nPer-parameter strategy (ghost = Gram-matrix norm, instantiate = per-sample gradient):")
    for plan in explanation.plans:
        costs = ", ".join(f"{k}={v:.3g} flops" for k, v in plan.costs.items()) or "-"
        print(f"    {plan.name:12s} rule={plan.rule:14s} strategy={plan.strategy:12s} costs: {costs}")


if __name__ == "__main__":
    main()
