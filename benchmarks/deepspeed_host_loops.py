"""Print (never assert) the host time DeepSpeed's ZeRO-3 gradient reduce-scatter spends per
(parameter tensor, rank), the source of ``Assumptions.zero3_reduce_host_us``; with ``--legacy``,
the per-(tensor, rank) loops of DeepSpeed before 0.6 (``zero3_gather_host_us`` and the reduce's).

``deepspeed.runtime.comm.coalesced_collectives.reduce_scatter_coalesced`` (what ZeRO-3's
``__avg_scatter_grads`` calls for every gradient bucket, DeepSpeed 0.6 to 0.19) slices every
gradient in the bucket into one view per rank (a Python list comprehension), interleaves them
rank by rank in a second Python loop, and concatenates the pieces; then it issues one
reduce-scatter.  Its host time is (tensors x ranks) Python iterations.  This runs DeepSpeed's
own function on the CPU with the world size faked and the collective replaced by a no-op, on
tensors of one element per rank, so what is left is the host time of the loops.  On a GPU the
slicing and the loops are the same host code; the concatenation launches batched copy kernels.

DeepSpeed 0.3-0.5 do not import under torch 2 (``from torch._six import inf``, which torch 2.0
removed), so ``--legacy`` restates their two loops (partition_parameters.py at v0.3.16 /
v0.5.10): ``_allgather_param`` cuts a zeroed flat buffer
into one ``narrow`` view per rank and hands the list to ``torch.distributed.all_gather``;
``_reduce_scatter_gradient`` cuts the gradient into one view per rank (a zeroed buffer for a rank
past its end) and hands the list to ``reduce_scatter``.  PyTorch's NCCL process group copies a
list out of (into) its flat buffer one ``copy_`` per rank in C++ (``ProcessGroupNCCL::allgather``
/ ``reduce_scatter``), which ``torch._foreach_copy_`` stands for here; on a GPU each copy is also
a kernel launch, not counted, so the figures are a floor.

Run: python benchmarks/deepspeed_host_loops.py [--repeats 5] [--legacy]
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


def legacy_gather(world: int, shard: torch.Tensor) -> None:
    """One list-form gather of a ``world``-way partitioned parameter, as DeepSpeed 0.3-0.5 issues it."""
    part = shard.numel()
    flat = torch.zeros(part * world)
    views = []
    for i in range(world):
        views.append(flat.narrow(0, part * i, part))
        if i == 0:
            views[i].copy_(shard)
    received = torch.empty(part * world)  # the process group's flat buffer, copied out view by view
    torch._foreach_copy_(views, list(received.split(part)))


def legacy_reduce(world: int, grad: torch.Tensor) -> None:
    """One list-form reduce-scatter of a gradient, as DeepSpeed 0.3-0.5 issues it."""
    part = -(-grad.numel() // world)
    inputs = []
    for i in range(world):
        start, end = i * part, (i + 1) * part
        inputs.append(grad.view(-1).narrow(0, start, part) if end <= grad.numel() else torch.zeros(part))
    flat = torch.empty(part * world)  # the process group's flat buffer, copied in view by view
    torch._foreach_copy_(list(flat.split(part)), inputs)


def us_per_legacy_slice(world: int, repeats: int) -> tuple[float, float]:
    """Best of ``repeats`` (gather, reduce) loops, in microseconds per rank for one tensor."""
    shard, grad = torch.zeros(1), torch.zeros(world)
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, (fn, arg) in enumerate(((legacy_gather, shard), (legacy_reduce, grad))):
            start = time.perf_counter()
            fn(world, arg)
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0] / world * 1e6, best[1] / world * 1e6


def legacy(repeats: int, console: Console) -> None:
    table = Table(title="DeepSpeed 0.3-0.5 list-form ZeRO-3 loops, us per (tensor, rank)")
    for name in ("ranks", "gather", "reduce-scatter"):
        table.add_column(name, justify="right")
    rows = [(world, *us_per_legacy_slice(world, repeats)) for world in (*WORLDS, 1536)]
    for world, gather, reduce in rows:
        table.add_row(str(world), f"{gather:.1f}", f"{reduce:.1f}")
    console.print(table)
    console.print(f"median gather {statistics.median(r[1] for r in rows):.1f} us, "
                  f"reduce-scatter {statistics.median(r[2] for r in rows):.1f} us per (tensor, rank)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--legacy", action="store_true", help="DeepSpeed 0.3-0.5's list-form loops")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.legacy:
        legacy(args.repeats, Console())
        return
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
