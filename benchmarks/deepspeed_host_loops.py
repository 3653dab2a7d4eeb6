"""Print (never assert) the host time DeepSpeed's ZeRO-3 gradient reduce-scatter spends per
(parameter tensor, rank), the source of ``Assumptions.zero3_reduce_host_us``.

``deepspeed.runtime.comm.coalesced_collectives.reduce_scatter_coalesced`` (what ZeRO-3's
``__avg_scatter_grads`` calls for every gradient bucket, DeepSpeed 0.6 to 0.19) slices every
gradient in the bucket into one view per rank (a Python list comprehension), interleaves them
rank by rank in a second Python loop, and concatenates the pieces; then it issues one
reduce-scatter.  Its host time is (tensors x ranks) Python iterations.  This runs DeepSpeed's
own function on the CPU with the world size faked and the collective replaced by a no-op, on
tensors of one element per rank, so what is left is the host time of the loops.  On a GPU the
slicing and the loops are the same host code; the concatenation launches batched copy kernels.

Run: python benchmarks/deepspeed_host_loops.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch
from rich.console import Console
from rich.table import Table

WORLDS = (64, 256, 1024)
TENSORS = (4, 12, 32)  # a bucket's gradients: one block's weights, a GPT block with biases and norms, several blocks


def us_per_slice(world: int, tensors: int, repeats: int) -> float:
    """Best of ``repeats`` calls of DeepSpeed's reduce_scatter_coalesced, in microseconds per
    (tensor, rank)."""
    from deepspeed.runtime.comm import coalesced_collectives as cc

    grads = [torch.zeros(world) for _ in range(tensors)]
    best = float("inf")
    with mock.patch.object(cc.dist, "get_rank", lambda group=None: 0), \
            mock.patch.object(cc.dist, "get_world_size", lambda group=None: world), \
            mock.patch.object(cc, "_torch_reduce_scatter_fn", lambda *args, **kwargs: None):
        for _ in range(repeats):
            start = time.perf_counter()
            cc.reduce_scatter_coalesced(grads)
            best = min(best, time.perf_counter() - start)
    return best / (world * tensors) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    table = Table(title="DeepSpeed reduce_scatter_coalesced host time, us per (tensor, rank)")
    table.add_column("ranks", justify="right")
    for n in TENSORS:
        table.add_column(f"{n} tensors", justify="right")
    values = []
    for world in WORLDS:
        row = [us_per_slice(world, n, args.repeats) for n in TENSORS]
        values += row
        table.add_row(str(world), *(f"{v:.1f}" for v in row))
    console = Console()
    console.print(table)
    console.print(f"median {statistics.median(values):.1f} us per (tensor, rank)")


if __name__ == "__main__":
    main()
