"""Plans as arrays: the struct-of-arrays view the vectorized cost model scores.

One entry per candidate configuration; ``counts[c, s, k, r]`` says how many blocks of kind
``k`` in recompute mode ``r`` (none, selective, full) stage ``s`` holds.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoplace.cost.layers import LayerTable
from autoplace.cost.memory import SCHEDULE_CODES
from autoplace.plan import COMPRESS, Config, Plan, stage_mode_counts

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
    compress: Array  # index into plan.COMPRESS
    powersgd_rank: Array

    @property
    def size(self) -> int:
        return int(self.tp.shape[0])

    @property
    def dp(self) -> Array:
        return self.dp_rep * self.dp_shard

    @property
    def world(self) -> Array:
        return self.dp * self.tp * self.pp * self.cp

    def take(self, rows: Array) -> Candidates:
        """The candidates at the indices ``rows``, in that order."""
        return Candidates(**{f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self)})


_FIELDS = ("tp", "pp", "cp", "ep", "dp_replicate", "dp_shard", "vpp", "sp", "zero", "mbs", "grad_accum", "schedule",
           "offload_optimizer", "offload_params", "compress", "powersgd_rank")


def pack(configs: Sequence[Config], counts: Array) -> Candidates:
    """Configurations (or plans) as arrays, with their per-stage block counts ``[C, S, K, 3]``."""
    cols = dict(zip(_FIELDS, zip(*map(operator.attrgetter(*_FIELDS), configs), strict=True), strict=True))

    def ints(name: str) -> Array:
        return np.array(cols[name], dtype=np.int64)

    tp = ints("tp")
    return Candidates(
        tp=tp, pp=ints("pp"), cp=ints("cp"), ep=ints("ep"), dp_rep=ints("dp_replicate"), dp_shard=ints("dp_shard"),
        vpp=ints("vpp"), sp=np.array(cols["sp"], dtype=bool) & (tp > 1), zero=ints("zero"), mbs=ints("mbs"),
        ga=ints("grad_accum"), schedule=np.array([SCHEDULE_CODES[x] for x in cols["schedule"]], dtype=np.int64),
        off_opt=np.array([x != "none" for x in cols["offload_optimizer"]]),
        off_par=np.array([x != "none" for x in cols["offload_params"]]), counts=counts,
        compress=np.array([COMPRESS.index(x) for x in cols["compress"]], dtype=np.int64), powersgd_rank=ints("powersgd_rank"))


def candidates_from_plans(plans: Sequence[Plan], table: LayerTable) -> Candidates:
    """Pack plans into arrays (stages padded with empty ones up to the largest pp)."""
    stages = max(p.pp for p in plans)
    counts = np.zeros((len(plans), stages, len(table.kinds), 3))
    for c, plan in enumerate(plans):
        counts[c, : plan.pp] = np.asarray(stage_mode_counts(plan, table.sequence, len(table.kinds)))
    return pack(plans, counts)
