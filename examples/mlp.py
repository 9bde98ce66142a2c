"""A small MLP regression trained with SGD+momentum; prints each step's loss (exact, as hex)."""
import argparse

import torch
from torch import nn


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1)).to(a.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(64, 256, device=a.device)
    y = torch.randn(64, 1, device=a.device)
    for step in range(a.steps):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item().hex()}")


if __name__ == "__main__":
    main()
