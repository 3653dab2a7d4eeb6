"""The collective counter: every c10d collective of a step, its bytes, filed by plan dimension (torch).

One counter for the runtime (real gloo/NCCL ranks) and the tracker harness (a fake process
group on fake tensors, :mod:`autoplace.fidelity.trackers`): one op table, one ring-bytes
function; the two differ only in the mapping from process-group name to dimension they pass
to :class:`CommLog` (the runtime files by the cost model's dimensions, ``dp``/``tp``/``cp``...;
the harness keeps ``dp_shard``, ``dp_replicate`` and ``edp`` apart).

Collectives reach c10d by two routes:

* FSDP2, DTensor (TP/SP), pipelining, ring attention and expert all-to-alls call c10d ops from
  Python, so a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees them
  (``c10d.allreduce_``, ``c10d._allgather_base_``, ``_c10d_functional.all_gather_into_tensor``,
  ``c10d.send``, ...).  The mode defers on DTensor, so DTensor's redistributions are seen as
  the local collectives they become (as ``FSDPMemTracker`` does);
* DDP's reducer calls the process group from C++, invisible to dispatch modes, so its
  gradient buckets are counted by a DDP communication hook (:func:`ddp_hook`), in the dtype
  they travel in (bf16 under ``compress=bf16``);
* a library comm hook that chains collectives in future callbacks (PyTorch's PowerSGD hook
  all-reduces its factors P and Q from ``Future.then`` callbacks, which run on the backend's
  thread where no dispatch mode is active) is counted at its module's ``dist.all_reduce``
  (:func:`count_all_reduces`).

Every collective is recorded with the raw tensor bytes and, like the cost model
(:mod:`autoplace.cost.comm`), the bytes each rank *sends* under a ring algorithm
(:func:`ring_bytes`).  CommDebugMode counts calls, not bytes.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger("autoplace")

# c10d / functional op name -> collective kind
_OPS = {
    "allreduce_": "all_reduce", "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast", "broadcast": "broadcast", "send": "send", "recv_": "recv",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
    "reduce_": "reduce",  # DeepSpeed ZeRO-1/2 without multi-rank bucket all-reduce: each partition to its owner
}


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def ring_bytes(kind: str, full_bytes: float, n: int) -> float:
    """Bytes one rank sends for a collective over ``n`` ranks (the cost model's ring volumes)."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n * full_bytes
    if kind in ("all_gather", "reduce_scatter", "all_to_all", "reduce"):
        return (n - 1) / n * full_bytes  # reduce: every rank but the root sends the buffer once
    if kind == "send":
        return full_bytes
    return 0.0  # recv: counted by the sender; broadcast: setup only


@dataclass
class CollectiveCount:
    """Calls and bytes of one (dimension, collective): raw tensor bytes (the full gathered or
    reduced buffer) and the bytes one rank sends under a ring algorithm (:func:`ring_bytes`)."""

    calls: int = 0
    tensor_bytes: float = 0.0
    ring_bytes: float = 0.0


class CommLog:
    """Counts per (dimension, collective).

    Args:
        group_dims: process-group name -> the dimension its collectives are filed under.
        default_dim: the dimension of a group not in ``group_dims``.
    """

    def __init__(self, group_dims: dict[str, str], default_dim: str = "other") -> None:
        self.group_dims = group_dims
        self.default_dim = default_dim
        self.enabled = False
        # hooks and their callbacks count from several threads: one lock for the counts, and a
        # pause per thread (a hook that counted its own collective pauses the dispatch mode of
        # the thread issuing it, not a callback counting on another thread)
        self._lock = threading.Lock()
        self._local = threading.local()
        self.reset()

    @property
    def paused(self) -> bool:
        """Whether this thread's collectives are being counted elsewhere (set while a comm hook
        that has counted its own collective issues it)."""
        return bool(getattr(self._local, "paused", False))

    @paused.setter
    def paused(self, value: bool) -> None:
        self._local.paused = value

    def reset(self) -> None:
        self.counts: dict[tuple[str, str], CollectiveCount] = defaultdict(CollectiveCount)

    def add(self, dim: str, kind: str, full_bytes: float, n: int) -> None:
        if not self.enabled or self.paused:
            return
        with self._lock:
            c = self.counts[dim, kind]
            c.calls += 1
            c.tensor_bytes += full_bytes
            c.ring_bytes += ring_bytes(kind, full_bytes, n)

    def dim_of(self, group: Any) -> tuple[str, int]:
        """(dimension, size) of a process group given as an object or a group name."""
        if isinstance(group, str):
            name = group
            size = dist.distributed_c10d._resolve_process_group(name).size()  # type: ignore[arg-type]
        else:
            name, size = getattr(group, "group_name", ""), group.size()
        return self.group_dims.get(name, self.default_dim), size

    def summary(self) -> dict[str, Any]:
        """``{"by_collective": [...], "ring_bytes_by_dim": {...}, "total_ring_bytes": ...}``."""
        rows = [{"dim": d, "collective": k, "calls": c.calls, "tensor_bytes": int(c.tensor_bytes),
                 "ring_bytes": int(round(c.ring_bytes))} for (d, k), c in sorted(self.counts.items())]
        by_dim: dict[str, float] = defaultdict(float)
        for (d, _), c in self.counts.items():
            by_dim[d] += c.ring_bytes
        return {"by_collective": rows, "ring_bytes_by_dim": {k: int(round(v)) for k, v in sorted(by_dim.items())},
                "total_ring_bytes": int(round(sum(by_dim.values())))}


class CountingMode(TorchDispatchMode):
    """Records every c10d op dispatched from Python into a :class:`CommLog`."""

    def __init__(self, log: CommLog) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        if ns in ("c10d", "_c10d_functional"):
            if name in _OPS:
                self._record(_OPS[name], name, args)
            elif not any(word in name for word in _NOT_COLLECTIVES):
                log.warning("collective %s is not counted", func)
        return func(*args, **(kwargs or {}))

    def _record(self, kind: str, name: str, args: tuple) -> None:
        # c10d ops carry the ProcessGroup as their first ScriptObject (before the ReduceOp);
        # functional ops carry the group's name as their last string (after a reduce-op name)
        boxed = [a for a in args if isinstance(a, torch.ScriptObject)]
        names = [a for a in args if isinstance(a, str)]
        if name in _FUNCTIONAL and names:
            group: Any = names[-1]
        elif boxed:
            group = dist.ProcessGroup.unbox(boxed[0])
        else:
            return
        dim, n = self.log.dim_of(group)
        functional = name in _FUNCTIONAL
        if kind == "reduce_scatter" and not functional:
            full = _nbytes(args[1])  # c10d: (output shard(s), full input(s), group, ...)
        elif kind == "all_gather" and functional:
            full = _nbytes(args[0]) * n  # functional: the local shard goes in
        else:
            full = _nbytes(args[0])  # all-reduce buffer(s), gathered output, full functional input, sent tensor
        self.log.add(dim, kind, full, n)


_FUNCTIONAL = {"all_reduce", "all_reduce_", "all_gather_into_tensor", "all_gather_into_tensor_out",
               "all_gather_into_tensor_coalesced", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced",
               "broadcast", "all_to_all_single"}
_NOT_COLLECTIVES = ("wait", "barrier")  # synchronisation, no payload


def _nbytes(x: Any) -> float:
    return float(sum(t.numel() * t.element_size() for t in _tensors(x)))


def ddp_hook(log: CommLog, dim: str, *, average: bool = True, skip: bool = False,
             dtype: torch.dtype | None = None) -> Callable:
    """A DDP comm hook that counts each bucket and all-reduces it.

    Args:
        average: divide by the group size (DDP's default); False sums -- the injected
            "gradients summed, not averaged" fault that ``verify`` must catch.
        skip: do not reduce at all -- replicas drift apart (the "state consistency" fault).
        dtype: reduce in this dtype (``torch.bfloat16``: ``compress=bf16``), as PyTorch's
            ``bf16_compress_hook`` does -- cast, divide, all-reduce, cast back -- which DDP refuses
            to register without CUDA and NCCL although gloo reduces bf16 on CPU; None: as is.
    """

    def hook(group, bucket):  # type: ignore[no-untyped-def]  # DDP rejects non-GradBucket annotations
        buf = bucket.buffer()
        pg = group if group is not None else dist.group.WORLD
        n = dist.get_world_size(pg)
        wire = buf if dtype is None or dtype == buf.dtype else buf.to(dtype)
        log.add(dim, "all_reduce", float(wire.numel() * wire.element_size()), n)
        if skip:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(buf)
            return fut
        if average:
            wire.div_(n)  # before the sum, as torch's compression hooks do: a 16-bit sum cannot overflow
        # counted above; the dispatch mode may also see this call when autograd runs the hook on
        # the thread that entered it, so pause the log while issuing it (the op is issued synchronously)
        log.paused = True
        try:
            work = dist.all_reduce(wire, group=pg, async_op=True)
        finally:
            log.paused = False
        if wire is buf:
            return work.get_future().then(lambda f: f.value()[0])
        return work.get_future().then(lambda f: buf.copy_(f.value()[0]))

    return hook


class _CountingDist:
    """``torch.distributed`` as a hook module sees it, with ``all_reduce`` counted into a log.

    Every other name is torch.distributed's own.  A call is counted once whichever thread makes
    it: here, with the dispatch mode of the calling thread paused while it is issued.
    """

    def __init__(self, wrapped: Any, log: CommLog) -> None:
        self.wrapped = wrapped
        self.log = log

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
                   async_op: bool = False) -> Any:
        pg = group if group is not None else dist.group.WORLD
        dim, n = self.log.dim_of(pg)
        self.log.add(dim, "all_reduce", float(tensor.numel() * tensor.element_size()), n)
        paused = self.log.paused
        self.log.paused = True
        try:
            return self.wrapped.all_reduce(tensor, op=op, group=group, async_op=async_op)
        finally:
            self.log.paused = paused


def count_all_reduces(module: Any, log: CommLog) -> None:
    """Count every ``dist.all_reduce`` that ``module`` (a comm-hook module that did ``import
    torch.distributed as dist``) issues into ``log``, on any thread, for the rest of the process.

    PyTorch's PowerSGD hook issues the all-reduces of its factors in ``Future.then`` callbacks
    on the backend's thread, where the dispatch mode is not active, so they would go uncounted.
    Calling again re-targets the module to the new log.
    """
    current = module.dist
    module.dist = _CountingDist(current.wrapped if isinstance(current, _CountingDist) else current, log)
