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
from autoplace.plan import Config, Plan, stage_mode_counts

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


def pack(configs: Sequence[Config], counts: Array) -> Candidates:
    """Configurations (or plans) as arrays, with their per-stage block counts ``[C, S, K, 3]``."""

    def col(get: Callable[[Config], object], dtype: type = np.int64) -> Array:
        return np.array([get(c) for c in configs], dtype=dtype)

    return Candidates(
        tp=col(lambda c: c.tp), pp=col(lambda c: c.pp), cp=col(lambda c: c.cp), ep=col(lambda c: c.ep),
        dp_rep=col(lambda c: c.dp_replicate), dp_shard=col(lambda c: c.dp_shard), vpp=col(lambda c: c.vpp),
        sp=col(lambda c: c.sp and c.tp > 1, bool), zero=col(lambda c: c.zero), mbs=col(lambda c: c.mbs),
        ga=col(lambda c: c.grad_accum), schedule=col(lambda c: SCHEDULE_CODES[c.schedule]),
        off_opt=col(lambda c: c.offload_optimizer != "none", bool),
        off_par=col(lambda c: c.offload_params != "none", bool), counts=counts)


def candidates_from_plans(plans: Sequence[Plan], table: LayerTable) -> Candidates:
    """Pack plans into arrays (stages padded with empty ones up to the largest pp)."""
    stages = max(p.pp for p in plans)
    counts = np.zeros((len(plans), stages, len(table.kinds), 3))
    for c, plan in enumerate(plans):
        counts[c, : plan.pp] = np.asarray(stage_mode_counts(plan, table.sequence, len(table.kinds)))
    return pack(plans, counts)
