"""Print (never assert) the host time FSDP2's per-unit hooks add to a block's forward and backward,
in eager-op equivalents: the source of ``Assumptions.zero3_hook_ops_forward`` and ``_backward``.

A GPT block of tiny width (so every kernel's work is ~0) is run eager, then under
``fully_shard`` per block (world size 8 on PyTorch's fake process group: collectives are
no-ops, so what remains is the hooks' Python, the all-gather copy-in / copy-out and
per-parameter views, the post-backward reduce-scatter bookkeeping), on one CPU thread.  The
extra time per block is divided by the eager time per aten op of the plain block (counted with
a dispatch mode), so the answer does not depend on how fast this machine's core is; on a GPU
host each op-equivalent costs ``host_dispatch_us``.

Run: python benchmarks/fsdp_hooks.py [--repeats 20] [--blocks 12]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

WIDTH = 8
WORLD = 8


class Block(torch.nn.Module):
    """A GPT-2 block (layernorms, QKV, causal attention, projection, GeLU MLP, residuals)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH)
        self.qkv, self.proj = torch.nn.Linear(WIDTH, 3 * WIDTH), torch.nn.Linear(WIDTH, WIDTH)
        self.fc1, self.fc2 = torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
        a = torch.nn.functional.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], is_causal=True)
        x = x + self.proj(a[:, 0])
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _model(blocks: int, shard: bool) -> torch.nn.Module:
    model = torch.nn.Sequential(*[Block() for _ in range(blocks)])
    if shard:
        for block in model:
            fully_shard(block)
        fully_shard(model)
    return model


def _times(model: torch.nn.Module, repeats: int) -> tuple[float, float]:
    """(forward, backward) seconds per step, best of ``repeats`` (the least disturbed by load)."""
    x = torch.randn(2, 16, WIDTH)
    for _ in range(5):
        model(x).sum().backward()
    fwd, bwd = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        y = model(x).sum()
        mid = time.perf_counter()
        y.backward()
        fwd.append(mid - start)
        bwd.append(time.perf_counter() - mid)
    return min(fwd), min(bwd)


def _ops(model: torch.nn.Module) -> tuple[int, int]:
    x = torch.randn(2, 16, WIDTH)
    with _Count() as f:
        y = model(x).sum()
    with _Count() as b:
        y.backward()
    return f.ops, b.ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--blocks", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        n = args.blocks
        plain, sharded = _model(n, False), _model(n, True)
        f_ops, b_ops = _ops(plain)
        table = Table(title=f"FSDP2 hooks per block (fake process group, world {WORLD}, one CPU thread, best of {args.repeats})")
        for col in ("trial", "eager us/op", "fwd +us/block", "bwd +us/block", "fwd +ops/block", "bwd +ops/block"):
            table.add_column(col, justify="right")
        for trial in range(3):
            pf, pb = _times(plain, args.repeats)
            sf, sb = _times(sharded, args.repeats)
            per_op = (pf + pb) / (f_ops + b_ops)
            extra_f, extra_b = (sf - pf) / n, (sb - pb) / n
            table.add_row(str(trial), f"{per_op * 1e6:.1f}", f"{extra_f * 1e6:.0f}", f"{extra_b * 1e6:.0f}",
                          f"{extra_f / per_op:.0f}", f"{extra_b / per_op:.0f}")
        Console().print(table)
        print(f"plain block: {f_ops / n:.0f} aten ops forward, {b_ops / n:.0f} backward")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
