"""A hint when the global batch divides badly among the GPUs.

Data parallelism splits the global batch: ``dp`` must divide it (``global_batch = dp x
micro-batch x accumulation``).  A batch that shares few factors with the GPU count -- a
prime such as 1,021 on 8 GPUs allows ``dp = 1`` only -- forces the rest of the GPUs into
tensor, pipeline or context parallelism, which is slower for models data parallelism could
run (Llama-3-8B on 8 H100: about a quarter).  The search itself cannot see that a batch
near the user's would do better, so :func:`batch_hint` solves the nearest batches that
every GPU can share (the multiples of the GPU count just below and above) with the same
solver, cost model and framework rule, and says what each would gain in tokens/s.

It runs only for awkward batches (``gcd(batch, gpus)`` below both), two extra solves with a
quarter of the time limit each: cheap next to the solve it follows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

MIN_GAIN = 0.02  # tokens/s gains below this are not worth a different batch


def neighbours(batch: int, gpus: int) -> list[int]:
    """The nearest global batches below and above ``batch`` that ``gpus`` GPUs share evenly
    (multiples of ``gpus``), when ``batch`` shares less with them than it could (``[]`` when
    it is a multiple already, or smaller than the GPU count: then dp is at most the batch)."""
    if batch < gpus or batch % gpus == 0:
        return []
    below, above = batch // gpus * gpus, -(-batch // gpus) * gpus
    return [b for b in (below, above) if b >= gpus]


def batch_hint(problem: Any, result: Any, solve: Callable[[Any], Any]) -> dict[str, Any] | None:
    """The nearest even global batches and what each gains, or None when the batch is not
    awkward or none gains :data:`MIN_GAIN`.

    Args:
        problem: the solve's Problem (its model carries the global batch).
        result: the solve's result (its best plan's tokens/s is the reference).
        solve: solves a Problem the way the solve did (same solver, framework rule and
            objective) and returns its result.

    Returns:
        ``{"global_batch", "gpus", "shared", "alternatives": [{"global_batch", "tokens_per_s",
        "gain"}], "note"}``: ``shared`` is ``gcd(batch, gpus)``, the most data parallelism
        the batch allows; ``gain`` is relative tokens/s.
    """
    if not result.plans or problem.objective != "time":
        return None
    model, gpus = problem.model, problem.cluster.gpus
    batch = model.training.global_batch
    near = neighbours(batch, gpus)
    if not near:
        return None
    base = result.plans[0].tokens_per_s
    alternatives = []
    for other in near:
        training = model.training.model_copy(update={"global_batch": other})
        alt = solve(dataclasses.replace(problem, model=model.model_copy(update={"training": training}), top_k=1))
        if alt.plans:
            tps = alt.plans[0].tokens_per_s
            alternatives.append({"global_batch": other, "tokens_per_s": round(tps, 3), "gain": round(tps / base - 1, 4)})
    alternatives.sort(key=lambda a: -a["gain"])
    if not alternatives or alternatives[0]["gain"] < MIN_GAIN:
        return None
    shared = math.gcd(batch, gpus)
    said = "; ".join(f"{a['global_batch']:,}: {a['gain']:+.0%} tokens/s" for a in alternatives)
    note = (f"global batch {batch:,} shares only {shared} with {gpus} GPUs, so data parallelism is at most {shared}; "
            f"a batch all GPUs share would be faster ({said}; --global-batch)")
    return {"global_batch": batch, "gpus": gpus, "shared": shared, "alternatives": alternatives, "note": note}
