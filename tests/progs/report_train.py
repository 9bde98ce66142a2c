"""A small training loop for the report tests: AdamW on an MLP, a step mark and a range per
step, a user label (the batch loader), and a planted leak: LEAK_LINE keeps a new 32 KiB
tensor every step."""
import sys

import torch

import msmemscope
import msmemscope.describe as describe

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
history = []


@describe.describer(owner="loader")
def make_batch():
    return torch.randn(64, 128), torch.randn(64, 16)


def remember(loss):
    history.append(torch.full((8192,), float(loss)))  # LEAK_LINE


def main():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(STEPS):
        rid = msmemscope.range_start(f"step {step + 1}")
        x, y = make_batch()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        remember(loss.item())
        msmemscope.mark("after optimizer")
        msmemscope.range_end(rid)
    print("done", len(history))


if __name__ == "__main__":
    main()
