"""The step time: how stage times, pipeline schedule and the once-per-step tail combine, and
how much of a collective that runs under compute still costs time.

These few formulas are the only place they are written: the evaluator, the solvers' bounds and
tables, and the CP-SAT model (which builds the same expressions from
:func:`pipeline_weights` and :func:`exposed_reduction`'s parts) all use them.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from autoplace.cost.memory import SCHEDULE_CODES

Array = np.ndarray


# The bubble of each schedule (autoplace.plan.SCHEDULES) as a share of the looped 1F1B's at the same pp,
# chunks and micro-batches, with forward, input-gradient and weight-gradient passes of equal time
# (T_F = T_B = T_W: Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR, Sec. 2, the case their
# handcrafted schedules and their authors' comparison table assume):
# - gpipe, 1f1b, interleaved: (p - 1)(T_F + T_B + T_W) / v, the whole backward idle in the warm-up and
#   cool-down (Narayanan et al. 2021, Sec. 2.2);
# - interleaved-zb (ZB1P, ZB-H1 on looped chunks): (p - 1)(T_F + T_B - T_W) / v -- W passes fill the
#   cool-down -- 1/3 of 1F1B's at equal times (Sec. 2.1, Fig. 3: "one-third");
# - zbv (ZB-V, Sec. 6): two half-stage chunks a rank in a V, W passes filling both ends: 0 at equal
#   times once its steady state is reached, from 2p micro-batches on (autoplace.plan.schedule_batching
#   keeps it there).  The authors' comparison at T_F = T_B = T_W (sail-sg's zero-bubble description):
#   bubble rate (p-1)/m for 1F1B, (p-1)/3m for ZB1P, 0 for ZBV, all three at 1F1B's activation memory.
# - dualpipev (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Sec. 3.2.1, Table 2; its V form in
#   deepseek-ai/DualPipe's README table): (PP/2 - 1)(F&B + B - 3W) over PP = 2p chunk stages on p ranks,
#   F, B (the whole backward, input and weight gradients) and W per chunk, F&B a paired forward and
#   backward.  A chunk's passes are half a stage's: F = W = t/2, B = t, F&B = F + B = 3t/2 before the
#   pair hides any communication, so (p - 1)(3t/2 + t - 3t/2) = (p - 1)t: 1/3 of 1F1B's (p - 1)3t
#   (Table 2's 1F1B row, (PP - 1)(F + B)), 2/3 of the (p - 1)3t/2 of two looped chunks.  What the
#   pairing saves, the all-to-all hidden under the paired chunk, is in the stage times
#   (terms_time._block_comm), so the bubble's F&B shrinks with it.
# What the equal-times case leaves out (B slower than W under recompute or attention) the model does not see.
# Fractions, so the CP-SAT model's integer weights state them exactly (solvers.cpsat).
BUBBLE_SHARE = {"gpipe": Fraction(1), "1f1b": Fraction(1), "interleaved": Fraction(1),
                "interleaved-zb": Fraction(1, 3), "zbv": Fraction(0), "dualpipev": Fraction(2, 3)}
_SHARE_BY_CODE = np.array([float(BUBBLE_SHARE[s]) for s in SCHEDULE_CODES])  # indexed by the code


def bubble_shares(schedule: Array) -> Array:
    """``BUBBLE_SHARE`` over candidate arrays of schedule codes (``SCHEDULE_CODES``)."""
    return _SHARE_BY_CODE[np.asarray(schedule)]


def pipeline_weights(m: Array | float, v: Array | float, share: Array | float | Fraction = 1.0) -> tuple[Array, Array]:
    """``(w_max, w_sum)`` with pipeline time = ``w_max * slowest stage + w_sum * sum of stages``.

    With ``m`` micro-batches and ``v`` virtual stages per device, the slowest stage works
    ``m`` micro-batches and the others' (warm-up and cool-down) add ``(sum - slowest) / v``
    (Narayanan et al. 2021, Sec. 2.2: the bubble ``(p - 1) / (v m)`` of the ideal time), times
    the schedule's ``share`` of that bubble (``BUBBLE_SHARE``: 1 but for the zero-bubble schedules).
    """
    w = np.asarray(share, dtype=float) / np.asarray(v, dtype=float)
    return np.asarray(m, dtype=float) - w, w


def pipeline_time(stage_times: Array, m: Array | float, v: Array | float, share: Array | float | Fraction = 1.0) -> Array:
    """Seconds of the forward-backward pipeline; ``stage_times`` ``[..., S]`` per micro-batch
    (padded stages hold 0); ``share`` as in :func:`pipeline_weights`."""
    w_max, w_sum = pipeline_weights(m, v, share)
    return w_max * stage_times.max(axis=-1) + w_sum * stage_times.sum(axis=-1)


def bubble_time(stage_times: Array, v: Array | float, share: Array | float | Fraction = 1.0) -> Array:
    """The pipeline's idle time on its slowest stage: everything but that stage's own ``m``
    micro-batches, ``share (sum - slowest) / v``."""
    return (stage_times.sum(axis=-1) - stage_times.max(axis=-1)) * pipeline_weights(0.0, v, share)[1]


def hidden(comm: Array, window: Array, slowdown: float) -> Array:
    """Seconds a collective of ``comm`` seconds costs when it runs beside ``window`` seconds of
    compute: what does not fit under the compute, plus ``slowdown`` of what does (its kernels
    share the SMs and HBM with the compute they hide under)."""
    under = np.minimum(comm, window)
    return comm - under + slowdown * under


def exposed_reduction(reduce: Array, window: Array, last_bucket: Array, slowdown: float) -> Array:
    """Seconds the once-per-step gradient reduction adds after the last backward.

    Buckets reduce while backward runs (PyTorch DDP, Li et al. 2020, VLDB; DeepSpeed and
    Megatron's overlapped reductions), so only what outlasts the ``window`` is exposed -- but
    never less than the last bucket, which cannot start before backward ends.  The part that
    runs under compute costs ``slowdown`` of itself (:func:`hidden`).
    """
    exposed = np.maximum(reduce - window, np.minimum(reduce, last_bucket))
    return (1 - slowdown) * exposed + slowdown * reduce
