import torch
import msmemscope
from msmemscope import TakeSnapshot, take_snapshot

x = torch.zeros(1 << 20)           # 4 MiB
take_snapshot(name="after x")


@TakeSnapshot("work")
def work():
    return torch.ones(1 << 18) * 2  # 1 MiB kept


y = work()
try:
    torch.empty(1 << 50)
except RuntimeError:
    pass
