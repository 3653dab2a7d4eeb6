"""The step time: how stage times, pipeline schedule and the once-per-step tail combine, and
how much of a collective that runs under compute still costs time.

These few formulas are the only place they are written: the evaluator, the solvers' bounds and
tables, and the CP-SAT model (which builds the same expressions from
:func:`pipeline_weights` and :func:`exposed_reduction`'s parts) all use them.
"""

from __future__ import annotations

import numpy as np

Array = np.ndarray


def pipeline_weights(m: Array | float, v: Array | float) -> tuple[Array, Array]:
    """``(w_max, w_sum)`` with pipeline time = ``w_max * slowest stage + w_sum * sum of stages``.

    With ``m`` micro-batches and ``v`` virtual stages per device, the slowest stage works
    ``m`` micro-batches and the others' (warm-up and cool-down) add ``(sum - slowest) / v``
    (Narayanan et al. 2021, Sec. 2.2: the bubble ``(p - 1) / (v m)`` of the ideal time).
    """
    v = np.asarray(v, dtype=float)
    return np.asarray(m, dtype=float) - 1 / v, 1 / v


def pipeline_time(stage_times: Array, m: Array | float, v: Array | float) -> Array:
    """Seconds of the forward-backward pipeline; ``stage_times`` ``[..., S]`` per micro-batch
    (padded stages hold 0)."""
    w_max, w_sum = pipeline_weights(m, v)
    return w_max * stage_times.max(axis=-1) + w_sum * stage_times.sum(axis=-1)


def bubble_time(stage_times: Array, v: Array | float) -> Array:
    """The pipeline's idle time on its slowest stage: everything but that stage's own ``m``
    micro-batches, ``(sum - slowest) / v``."""
    return (stage_times.sum(axis=-1) - stage_times.max(axis=-1)) / np.asarray(v, dtype=float)


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
