"""User labels: a decorated function, a with block (and the explicit __enter__/__exit__ form),
a tensor labelled after creation, and a fourth label refused (the decorator and with forms count
towards the cap of 3, a tensor's label does not)."""
import json

import torch

import msmemscope.describe as describe


@describe.describer(owner="loader")
def make_batch():
    return torch.ones(1000, 3)          # 12000 bytes


def main():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = make_batch()
    with describe.describer(owner="outer"):
        a = torch.zeros(2000)          # 8000 bytes, outer
        describe.describer(owner="loader").__enter__()
        b = torch.zeros(3000)          # 12000 bytes, outer then loader
        describe.describer(owner="loader").__exit__()
        c = torch.zeros(4000)          # 16000 bytes, outer only
    late = torch.full((5000,), 2.0)    # 20000 bytes, labelled after creation
    describe.describer(late, owner="late")
    with describe.describer(owner="third"):   # the third counted label (a tensor's label is not counted)
        pass
    refused = ""
    try:
        describe.describer(owner="fourth")
    except ValueError as e:
        refused = str(e)
    early = torch.zeros(1500)          # 6000 bytes; its MALLOC row is written at the first step end
    for _ in range(2):
        opt.zero_grad()
        loss = model(torch.randn(8, 64)).square().mean()
        loss.backward()
        opt.step()
    describe.describer(early, owner="late")   # labelled after its row was written: an OWNER row
    print(json.dumps({"refused": refused}))
    keep = (batch, a, b, c, late, early)
    return keep


if __name__ == "__main__":
    main()
