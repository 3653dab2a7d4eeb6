"""Print (never assert) the host time eager PyTorch takes to issue one op, the source of
``Assumptions.host_dispatch_us``.

A chain of tiny ops (8x8 matmul, SiLU, residual add) whose work is negligible, with autograd
recording, timed forward and forward + backward on one CPU thread: what is left is the
per-op host cost (Python, dispatcher, autograd, a trivial CPU kernel).  On a GPU the same
path ends in cudaLaunchKernel instead of the CPU kernel.

Run: python benchmarks/host_dispatch.py [--repeats 50]
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

LAYERS = 50  # each: matmul, silu, add
OPS = 3 * LAYERS + 1  # plus the final sum


def chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = x
    for _ in range(LAYERS):
        y = torch.nn.functional.silu(y @ w) + y
    return y.sum()


def per_op_us(repeats: int) -> tuple[float, float]:
    """(forward us per op, backward us per forward op) over ``repeats`` runs."""
    torch.set_num_threads(1)
    x = torch.randn(8, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    for _ in range(10):
        chain(x, w).backward()
    start = time.perf_counter()
    for _ in range(repeats):
        chain(x, w)
    forward = (time.perf_counter() - start) / repeats
    start = time.perf_counter()
    for _ in range(repeats):
        chain(x, w).backward()
    both = (time.perf_counter() - start) / repeats
    return forward / OPS * 1e6, (both - forward) / OPS * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    table = Table(title="eager PyTorch host time per op (one CPU thread, tiny tensors)")
    for col in ("trial", "forward us/op", "backward us per forward op"):
        table.add_column(col, justify="right")
    for trial in range(3):
        fwd, bwd = per_op_us(args.repeats)
        table.add_row(str(trial), f"{fwd:.1f}", f"{bwd:.1f}")
    Console().print(table)


if __name__ == "__main__":
    main()
