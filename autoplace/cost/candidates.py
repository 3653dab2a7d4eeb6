"""Plans as arrays: the struct-of-arrays view the vectorized cost model scores.

One entry per candidate configuration; ``counts[c, s, k, r]`` says how many blocks of kind
``k`` in recompute mode ``r`` (none, selective, full) stage ``s`` holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autoplace.cost.layers import LayerTable
from autoplace.cost.memory import SCHEDULE_CODES
from autoplace.plan import Plan, stage_mode_counts

Array = np.ndarray


@dataclass(frozen=True)
class Candidates:
    """Plans as arrays: one entry per candidate; ``counts[c, s, k, r]`` blocks of kind k in
    recompute mode r on stage s (r: none, selective, full)."""

    tp: Array
    pp: Array
    cp: Array
    ep: Array
    dp_rep: Array
    dp_shard: Array
    vpp: Array
    sp: Array
    zero: Array
    mbs: Array
    ga: Array
    schedule: Array
    off_opt: Array
    off_par: Array
    counts: Array

    @property
    def size(self) -> int:
        return int(self.tp.shape[0])

    @property
    def dp(self) -> Array:
        return self.dp_rep * self.dp_shard

    @property
    def world(self) -> Array:
        return self.dp * self.tp * self.pp * self.cp


def candidates_from_plans(plans: Sequence[Plan], table: LayerTable) -> Candidates:
    """Pack plans into arrays (stages padded with empty ones up to the largest pp)."""
    stages = max(p.pp for p in plans)
    kinds = len(table.kinds)
    counts = np.zeros((len(plans), stages, kinds, 3))
    for c, plan in enumerate(plans):
        counts[c, : plan.pp] = np.asarray(stage_mode_counts(plan, table.sequence, kinds))

    def col(get: Callable[[Plan], object], dtype: type = np.int64) -> Array:
        return np.array([get(p) for p in plans], dtype=dtype)

    return Candidates(
        tp=col(lambda p: p.tp), pp=col(lambda p: p.pp), cp=col(lambda p: p.cp), ep=col(lambda p: p.ep),
        dp_rep=col(lambda p: p.dp_replicate), dp_shard=col(lambda p: p.dp_shard), vpp=col(lambda p: p.vpp),
        sp=col(lambda p: p.sp and p.tp > 1, bool), zero=col(lambda p: p.zero), mbs=col(lambda p: p.mbs),
        ga=col(lambda p: p.grad_accum), schedule=col(lambda p: SCHEDULE_CODES[p.schedule]),
        off_opt=col(lambda p: p.offload_optimizer != "none", bool),
        off_par=col(lambda p: p.offload_params != "none", bool), counts=counts)
