"""The two small models (each with its own Adam) and the input that the two-thread programs train."""
import torch
from torch import nn


def two_models():
    models = []
    for i in range(2):
        torch.manual_seed(i)
        m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        models.append((m, torch.optim.Adam(m.parameters(), lr=1e-2)))
    return models, torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
