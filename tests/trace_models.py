"""A plain PyTorch model for tests/test_trace.py: ``autoplace trace tests.trace_models:build``."""

from __future__ import annotations

from torch import nn


class Block(nn.Module):
    """A residual two-layer MLP block: 2 * hidden * width weights, hidden + width biases."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, width)
        self.down = nn.Linear(width, hidden)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return x + self.down(nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    """Embedding, ``layers`` blocks, an untied head."""

    def __init__(self, vocab: int, hidden: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, width) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):  # type: ignore[no-untyped-def]
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(vocab: int = 100, hidden: int = 32, width: int = 128, layers: int = 3) -> Net:
    return Net(vocab, hidden, width, layers)


class Stack(nn.Module):
    """Blocks only: float activations in, float activations out (traced with --input hidden)."""

    def __init__(self, hidden: int = 16, width: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden, width) for _ in range(layers))

    def forward(self, x):  # type: ignore[no-untyped-def]
        for block in self.blocks:
            x = block(x)
        return x
