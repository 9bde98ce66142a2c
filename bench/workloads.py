"""The benchmark workloads (bench/run.py's table): each a model, its optimizer and one training
step, built the same way by every bench tool that times them."""
import torch


def build(workload):
    """(model, step) for "mlp", "gpt2", "deep" or "transformer"; call after seeding and setting threads.
    "deep": 50 layers of 64 x 64 on 16 rows and Adam per tensor (foreach off): ~1,500 ops of a few
    microseconds a step, the most rows per second of compute (the per-row cost's worst case)."""
    if workload == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128, bos_token_id=0,
                         eos_token_id=0)
        model = GPT2LMHeadModel(cfg)
        data = torch.randint(0, 1000, (8, 64))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=data, labels=data).loss
            loss.backward()
            opt.step()
        return model, step
    if workload == "mlp":
        from torch import nn
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        x, y = torch.randn(64, 256), torch.randn(64, 1)

        def step():
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return model, step
    if workload == "deep":
        from torch import nn
        model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(50)])
        opt = torch.optim.Adam(model.parameters(), foreach=False)
        x = torch.randn(16, 64)

        def step():
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
        return model, step
    import torch.nn.functional as F
    from examples.transformer import GPT
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.randint(0, 1024, (8, 129))
    x, y = data[:, :-1], data[:, 1:]

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).backward()
        opt.step()
    return model, step
