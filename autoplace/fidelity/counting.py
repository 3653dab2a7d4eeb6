"""Counting the bytes of every c10d collective of a step (CommDebugMode counts calls, not bytes)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from autoplace.errors import BenchmarkError

try:
    import torch
    import torch.distributed as dist
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise BenchmarkError("autoplace.fidelity needs PyTorch: pip install torch (CPU wheel is enough)") from exc


log = logging.getLogger("autoplace")

@dataclass
class CollectiveCount:
    """Calls and bytes of one collective kind; ``full`` is the gathered/reduced buffer size."""

    calls: int = 0
    full_bytes: float = 0.0
    sent_bytes: float = 0.0  # per device, ring algorithm: (n-1)/n of full, 2(n-1)/n for all-reduce


def _group_name(obj: Any) -> str:
    """The name of a process group given as a name, a ProcessGroup or its TorchScript box."""
    if isinstance(obj, str):
        return obj
    if isinstance(obj, torch.ScriptObject):
        obj = dist.ProcessGroup.unbox(obj)
    return str(obj.group_name)


def _group_size(name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return int(_resolve_process_group(name).size())  # type: ignore[arg-type]


KIND_DIM = {"all_to_all": "ep"}  # only expert parallelism issues all-to-alls; FSDP and TP never do


class CollectiveCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of every c10d collective (in-place ``c10d`` ops and ``_c10d_functional`` ops),
    keyed by ``(kind, mesh dimension)``.

    Defers on DTensor so that DTensor's redistributions are seen as the local collectives they
    become (as ``FSDPMemTracker`` does).

    Args:
        dims: process-group name -> the mesh dimensions it serves ("dp_shard", "tp", ...).  One
            group can serve two (with ep = dp_shard the EP group is all of dp); its collectives
            then go to the dimension that issues that kind (:data:`KIND_DIM`), else to FSDP's or TP's.
    """

    def __init__(self, dims: dict[str, list[str]]) -> None:
        super().__init__()
        self.dims = dims
        self.counts: dict[tuple[str, str], CollectiveCount] = {}

    def _add(self, kind: str, group: Any, full: float, factor: float = 1.0) -> None:
        name = _group_name(group)
        n = _group_size(name)
        roles = self.dims.get(name, [name])
        general = [r for r in roles if r not in KIND_DIM.values()] or roles
        dim = KIND_DIM[kind] if KIND_DIM.get(kind) in roles else general[0]
        c = self.counts.setdefault((kind, dim), CollectiveCount())
        c.calls += 1
        c.full_bytes += full
        c.sent_bytes += factor * (n - 1) / n * full

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented
        c10d, fn = torch.ops.c10d, torch.ops._c10d_functional
        if func is c10d._allgather_base_.default:
            self._add("all_gather", args[2], _nbytes(args[0]))
        elif func is c10d._reduce_scatter_base_.default:
            self._add("reduce_scatter", args[2], _nbytes(args[1]))
        elif func is c10d.allreduce_.default:
            for t in args[0]:
                self._add("all_reduce", args[1], _nbytes(t), 2.0)
        elif func is fn.all_reduce.default:
            self._add("all_reduce", args[2], _nbytes(args[0]), 2.0)
        elif func is fn.all_gather_into_tensor.default:
            self._add("all_gather", args[2], _nbytes(args[0]) * args[1])
        elif func is fn.reduce_scatter_tensor.default:
            self._add("reduce_scatter", args[3], _nbytes(args[0]))
        elif func is fn.all_to_all_single.default:
            _check_even(args[1], args[2])
            self._add("all_to_all", args[3], _nbytes(args[0]))
        elif func.namespace in ("c10d", "_c10d_functional") and "wait" not in func.__name__:
            log.warning("collective %s is not counted", func)
        return func(*args, **(kwargs or {}))


def _nbytes(t: torch.Tensor) -> float:
    return float(t.numel() * t.element_size())


def _check_even(*splits: list[int]) -> None:
    """An all-to-all sends (n-1)/n of its buffer only when every rank's share is equal;
    balanced routing makes it so, and an uneven split would be counted wrong."""
    for sizes in splits:
        if sizes and len(set(sizes)) > 1:
            raise BenchmarkError(f"uneven all-to-all splits {sizes} are not counted")


