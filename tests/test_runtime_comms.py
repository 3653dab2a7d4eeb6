"""The collective counter on real gloo ranks: every c10d op the runtime's frameworks issue is
seen and filed with the cost model's ring volumes."""

from __future__ import annotations

import os
import socket

import pytest

torch = pytest.importorskip("torch")

N = 2
ELEMENTS = 1000  # fp32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    from autoplace.runtime.comms import CommLog, CountingMode

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=N)
    log = CommLog({}, default_dim="dp")
    log.enabled = True
    x = torch.ones(ELEMENTS)
    with CountingMode(log):
        dist.all_reduce(x)
        dist.reduce(x, dst=0)
        dist.all_gather_into_tensor(torch.empty(N * ELEMENTS), x)
    dist.barrier()
    dist.destroy_process_group()
    out[rank] = log.summary()


def test_counter_sees_all_reduce_reduce_and_all_gather() -> None:
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(_free_port(), out), nprocs=N, join=True)
        summary = dict(out)[0]
    ring = {r["collective"]: r["ring_bytes"] for r in summary["by_collective"]}
    full = ELEMENTS * 4
    assert ring == {"all_reduce": 2 * (N - 1) / N * full, "reduce": (N - 1) / N * full,
                    "all_gather": (N - 1) / N * N * full}
