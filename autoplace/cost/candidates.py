"""Plans as arrays: the struct-of-arrays view the vectorized cost model scores.

One entry per candidate configuration; ``counts[c, s, k, r]`` says how many blocks of kind
``k`` in recompute mode ``r`` (none, selective, full) stage ``s`` holds.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autoplace.cost.layers import LayerTable
from autoplace.cost.memory import SCHEDULE_CODES
from autoplace.plan import COMPRESS, CONFIG_FIELDS, FP8, OFFLOAD, TP_OVERLAP, Config, Plan, stage_mode_counts

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
    offload_optimizer: Array  # index into plan.OFFLOAD: none, cpu, nvme
    offload_params: Array
    counts: Array
    compress: Array  # index into plan.COMPRESS
    powersgd_rank: Array
    # recipes (plan.Config): bool columns, and indices into plan.TP_OVERLAP and plan.FP8
    compile: Array
    fused_loss: Array
    tp_overlap: Array
    overlap: Array
    fp8: Array
    # the embedding / the loss counted as a pipeline layer (plan.stage_slots)
    pp_embedding: Array
    pp_loss: Array

    @property
    def size(self) -> int:
        return int(self.tp.shape[0])

    @property
    def off_opt(self) -> Array:
        """Whether the optimizer step (and its states) is offloaded, to the host or NVMe."""
        return self.offload_optimizer > 0

    @property
    def off_par(self) -> Array:
        """Whether the parameters are offloaded, to the host or NVMe."""
        return self.offload_params > 0

    @property
    def dp(self) -> Array:
        return self.dp_rep * self.dp_shard

    @property
    def world(self) -> Array:
        return self.dp * self.tp * self.pp * self.cp

    def take(self, rows: Array) -> Candidates:
        """The candidates at the indices ``rows``, in that order."""
        return Candidates(**{f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self)})


# Every Config field packed: (the Candidates attribute, how its values become numbers).  Taken from
# Config's own fields (a test holds the two equal), so the packed copy cannot drift from the type.
def _codes(values: Sequence[str]) -> Callable[[Sequence[Any]], Array]:
    index = {v: i for i, v in enumerate(values)}
    return lambda column: np.array([index[x] for x in column], dtype=np.int64)


def _bools(column: Sequence[Any]) -> Array:
    return np.array(column, dtype=bool)


def _ints(column: Sequence[Any]) -> Array:
    return np.array(column, dtype=np.int64)


PACKED: dict[str, tuple[str, Callable[[Sequence[Any]], Array]]] = {
    "tp": ("tp", _ints), "pp": ("pp", _ints), "cp": ("cp", _ints), "ep": ("ep", _ints),
    "dp_replicate": ("dp_rep", _ints), "dp_shard": ("dp_shard", _ints), "vpp": ("vpp", _ints),
    "sp": ("sp", _bools), "zero": ("zero", _ints), "mbs": ("mbs", _ints),
    "grad_accum": ("ga", _ints),
    "schedule": ("schedule", lambda column: np.array([SCHEDULE_CODES[x] for x in column], dtype=np.int64)),
    "offload_optimizer": ("offload_optimizer", _codes(OFFLOAD)), "offload_params": ("offload_params", _codes(OFFLOAD)),
    "compress": ("compress", _codes(COMPRESS)), "powersgd_rank": ("powersgd_rank", _ints),
    "compile": ("compile", _bools), "fused_loss": ("fused_loss", _bools),
    "tp_overlap": ("tp_overlap", _codes(TP_OVERLAP)), "overlap": ("overlap", _bools), "fp8": ("fp8", _codes(FP8)),
    "pp_embedding": ("pp_embedding", _bools), "pp_loss": ("pp_loss", _bools),
}


def pack(configs: Sequence[Config], counts: Array) -> Candidates:
    """Configurations (or plans) as arrays, with their per-stage block counts ``[C, S, K, 3]``."""
    columns = zip(*map(operator.attrgetter(*CONFIG_FIELDS), configs), strict=True)
    arrays = {PACKED[name][0]: PACKED[name][1](column) for name, column in zip(CONFIG_FIELDS, columns, strict=True)}
    arrays["sp"] = arrays["sp"] & (arrays["tp"] > 1)  # sequence parallelism exists only with TP
    return Candidates(**arrays, counts=counts)


def candidates_from_plans(plans: Sequence[Plan], table: LayerTable) -> Candidates:
    """Pack plans into arrays (stages padded with empty ones up to the largest pp)."""
    stages = max(p.pp for p in plans)
    counts = np.zeros((len(plans), stages, len(table.kinds), 3))
    for c, plan in enumerate(plans):
        counts[c, : plan.pp] = np.asarray(stage_mode_counts(plan, table.sequence, len(table.kinds)))
    return pack(plans, counts)
