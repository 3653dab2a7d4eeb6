"""A pipeline schedule laid out in time, for drawing: which device runs which micro-batch's
forward or backward when, under GPipe, 1F1B or interleaved 1F1B.

Each device runs its operations in the order its schedule prescribes; an operation starts when
the device is free and its input is ready (the previous virtual stage's forward, the next one's
backward).  Stage times are equal unless given (the report draws each stage's own) and a backward
takes twice a forward -- with equal stages, the shape the cost model's bubble term assumes
(:func:`autoplace.cost.step.bubble_time`, Narayanan et al. 2021, Sec. 2.2), so the drawn idle
share is its ``(p - 1) / (v m)``.  The operation orders restate
Megatron-LM's ``forward_backward_pipelining_with_interleaving`` (core_v0.16.1,
megatron/core/pipeline_parallel/schedules.py): warm-up ``2 (p - d - 1) + (v - 1) p`` chunk
forwards, then one forward and one backward alternate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FORWARD, BACKWARD = 1.0, 2.0  # duration of one stage's pass per micro-batch, in forward units
MAX_DRAWN = 8  # micro-batches drawn at least (more when a long pipeline needs them to reach steady state)


@dataclass(frozen=True)
class Op:
    """One forward (``F``) or backward (``B``) of micro-batch ``micro`` on ``chunk`` of ``device``,
    from ``start`` to ``end`` in forward units (or in the unit of :func:`lay_out`'s ``forward``)."""

    device: int
    kind: str
    micro: int
    chunk: int
    start: float
    end: float
    chunks: int = 1

    @property
    def label(self) -> str:
        return f"{self.micro + 1}" + (f".{self.chunk}" if self.chunks > 1 else "")


def drawn_microbatches(schedule: str, pp: int, microbatches: int) -> int:
    """How many micro-batches a timeline draws: all of a short step, else enough for warm-up,
    two steady rounds and cool-down (``2 pp``, at least :data:`MAX_DRAWN`); interleaved in whole
    rounds of ``pp`` (Megatron-LM runs it only with a multiple of ``pp``)."""
    drawn = min(microbatches, max(MAX_DRAWN, 2 * pp))
    return max(pp, drawn - drawn % pp) if schedule == "interleaved" else drawn


def _order(schedule: str, pp: int, vpp: int, m: int, device: int) -> list[tuple[str, int, int]]:
    """The device's operations in the order it runs them: (kind, micro-batch, chunk)."""
    if schedule == "gpipe":
        return [("F", j, 0) for j in range(m)] + [("B", j, 0) for j in range(m)]
    n = m * vpp

    def op(kind: str, k: int) -> tuple[str, int, int]:  # the device's k-th forward or backward
        chunk = (k // pp) % vpp
        return kind, (k // (pp * vpp)) * pp + k % pp, chunk if kind == "F" else vpp - 1 - chunk

    warmup = min(pp - device - 1 if vpp == 1 else 2 * (pp - device - 1) + (vpp - 1) * pp, n)
    out = [op("F", k) for k in range(warmup)]
    for i in range(n - warmup):
        out += [op("F", warmup + i), op("B", i)]
    return out + [op("B", k) for k in range(n - warmup, n)]


def lay_out(schedule: str, pp: int, vpp: int, microbatches: int,
            forward: Sequence[float] | None = None) -> list[Op]:
    """Every operation of one step with its start and end (forward units), by list scheduling.
    ``forward``: each device's time for one forward of its whole stage (all its chunks), in any
    unit, when stages differ (the first holds the embedding, the last the head and loss); equal
    stages of one unit when None.  A backward takes twice its stage's forward either way.

    Raises:
        ValueError: the orders deadlock (a schedule this module gets wrong), or interleaved with a
            micro-batch count that is not a multiple of ``pp``.
    """
    if schedule == "interleaved" and microbatches % pp:
        raise ValueError(f"interleaved needs micro-batches ({microbatches}) a multiple of pp ({pp})")
    vpp = vpp if schedule == "interleaved" else 1
    orders = [_order(schedule, pp, vpp, microbatches, d) for d in range(pp)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro) -> end
    free, nxt = [0.0] * pp, [0] * pp
    ops: list[Op] = []
    last = pp * vpp - 1
    while len(ops) < sum(map(len, orders)):
        progressed = False
        for d in range(pp):
            while nxt[d] < len(orders[d]):
                kind, micro, chunk = orders[d][nxt[d]]
                stage = chunk * pp + d
                dep = (("F", stage - 1, micro) if stage else None) if kind == "F" else \
                    (("B", stage + 1, micro) if stage < last else ("F", stage, micro))
                if dep is not None and dep not in done:
                    break
                start = max(free[d], done[dep] if dep else 0.0)
                end = start + (FORWARD if kind == "F" else BACKWARD) * (forward[d] if forward else 1.0) / vpp
                done[(kind, stage, micro)], free[d] = end, end
                ops.append(Op(d, kind, micro, chunk, start, end, vpp))
                nxt[d] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"{schedule} pp={pp} vpp={vpp} m={microbatches}: the operation orders deadlock")
    return ops


def idle_share(ops: list[Op], pp: int) -> float:
    """The share of the laid-out span the devices spend idle (the bubble drawn)."""
    end = max(op.end for op in ops)
    return 1 - sum(op.end - op.start for op in ops) / (pp * end)
