"""What torchtitan 0.2.2 checks when it builds a pipeline schedule, restated so the search can ask it.

torchtitan's ``pipeline_llm`` and ``build_pipeline_schedule`` (``torchtitan/distributed/pipeline_parallel.py``,
0.2.2) and the schedule classes they construct (``torch/distributed/pipelining/schedules.py``, torch 2.13)
raise, before the first step, on a batch or a stage count they cannot schedule.  :func:`schedule_refusal`
states each of those checks once, on the numbers the job config carries; the torchtitan framework asks it
of every configuration the search enumerates and before it renders a bundle, and
``tests/test_emit_torchtitan.py`` holds it to torchtitan's own schedule builder.
"""

from __future__ import annotations

import functools

# schedules that run one stage per pipeline rank (torch's PipelineScheduleSingle subclasses); the others
# (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ...) are PipelineScheduleMulti: several per rank
SINGLE_STAGE = frozenset({"1F1B", "GPipe"})
# schedules whose two stages a rank are placed in a V (rank r: stages r and 2 pp - 1 - r), the others looped
# (rank r: r, r + pp, ...): torchtitan's pipeline_module_split, style "v" for these classes (0.2.2)
V_SHAPED = frozenset({"ZBVZeroBubble", "DualPipeV"})
# the schedules that split backward into input- and weight-gradient passes: torch refuses them on
# torch.compile'd stage modules (schedules.py _check_torch_compile_compatibility, torch 2.13)
SPLIT_BACKWARD = frozenset({"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"})


def torch_stage_order(parts: list[int], pp: int, schedule: str) -> list[int]:
    """Model chunks from the looped order (chunk ``v * pp + r``, :func:`autoplace.plan.model_chunks`)
    to torchtitan's stage order for ``schedule``, and back: a V-shaped schedule's second chunk of
    rank r is stage ``2 pp - 1 - r``, so the second half reverses (an involution: the same call
    reads a config's stages back into the looped order)."""
    return parts[:pp] + parts[pp:][::-1] if schedule in V_SHAPED else list(parts)


@functools.cache  # the search asks it once per micro-batching of every pipeline shape
def schedule_refusal(schedule: str, pp: int, stages_per_rank: int, local_batch: int, microbatch: int) -> str | None:
    """Why torchtitan 0.2.2 cannot build pipeline schedule ``schedule`` for these numbers (one line), or None.

    Args:
        schedule: ``parallelism.pipeline_parallel_schedule`` (a torch schedule class name).
        pp: ``parallelism.pipeline_parallel_degree``.
        stages_per_rank: model chunks per pipeline rank (1 without virtual stages).
        local_batch: ``training.local_batch_size``, the sequences one step runs through the pipeline.
        microbatch: ``parallelism.pipeline_parallel_microbatch_size``.
    """
    if local_batch % microbatch:  # build_pipeline_schedule: "Batch size ... must be divisible by microbatch_size"
        return (f"local_batch_size {local_batch} is not a multiple of pipeline_parallel_microbatch_size {microbatch} "
                "(torchtitan's build_pipeline_schedule)")
    single = schedule in SINGLE_STAGE
    if single != (stages_per_rank == 1):  # pipeline_llm: exactly one stage per rank, or at least two
        need = "exactly 1 stage per rank" if single else "at least 2 stages per rank (vpp >= 2)"
        return f"{schedule} with {stages_per_rank} stage(s) per pipeline rank: torchtitan's pipeline_llm needs {need}"
    micro = local_batch // microbatch
    if schedule in V_SHAPED and stages_per_rank != 2:  # ScheduleZBVZeroBubble / ScheduleDualPipeV.__init__
        return f"{schedule} with {stages_per_rank} stage(s) per pipeline rank: torch's schedule needs exactly 2"
    if schedule == "DualPipeV" and micro < 2 * pp:  # ScheduleDualPipeV.__init__: n_microbatches >= its 2 pp stages
        return (f"DualPipeV with {micro} micro-batch(es) per step on {2 * pp} stages: torch's ScheduleDualPipeV needs "
                f"at least as many micro-batches as stages (grad_accum >= 2*pp = {2 * pp})")
    if schedule == "1F1B" and micro < pp:  # Schedule1F1B.__init__ (GPipe only warns)
        return (f"1F1B with {micro} micro-batch(es) per step on {pp} stages: torch's Schedule1F1B needs at least as "
                f"many micro-batches as stages (grad_accum >= pp = {pp}, or schedule=gpipe)")
    rounds = max(1, micro // pp)  # ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble.__init__: whole rounds
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and micro % rounds:
        return (f"{schedule} with {micro} micro-batches per step on pp={pp}: torch's schedule runs them in "
                f"{rounds} rounds of equal size (grad_accum a multiple of {rounds}, or of pp)")
    return None
