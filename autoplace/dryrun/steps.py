"""What a framework's dry run is given and what it reports, step by step.

A framework module's :meth:`~autoplace.frameworks.base.Framework.dry_run` receives a
:class:`DryContext` (the bundle, the words its launch passes, the plan it was written for, the
rank to build) and a :class:`Steps` log.  It runs the framework's own code one named step at a
time inside :meth:`Steps.step` (the first exception ends the run: the step fails with the
framework's own message and the fix autoplace suggests), says which steps it cannot take without a
GPU with :meth:`Steps.skip`, which pipeline stage the rank holds with :meth:`Steps.stage`, and the
bytes the framework allocated on the rank per training state with :meth:`Steps.measured`.

No torch at import: the framework modules import this module, and ``autoplace solve`` imports them.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoplace.errors import AutoplaceError

if TYPE_CHECKING:
    from autoplace.dryrun.launches import Launched
    from autoplace.plan import Plan
    from autoplace.specs.cluster import ClusterSpec
    from autoplace.specs.model import ModelSpec

# the training states a dry run measures, as plan.json's memory_per_stage_bytes names them
STATES = ("params", "grads", "optimizer", "buffers")

Event = dict[str, Any]
Fix = Callable[[BaseException], "str | None"]


@dataclass(frozen=True)
class DryContext:
    """What a framework's dry run builds from.

    Attributes:
        bundle: the bundle directory.
        launched: what the bundle's launch passes its program (words and environment), recorded.
        plan: the plan the bundle was written for (plan.json).
        model: the model plan.json names (its ``inputs``), loaded with the same overrides.
        cluster: the cluster plan.json names.
        rank: the global rank to build.
        world: the planned world size (the launch's nodes x processes per node).
        extra: words the user gave ``dryrun`` after ``--`` (as they would give the launch), e.g. ``--model DIR``.
        launches: every launch kind of the bundle, recorded as ``launched`` is (a framework checks that each
            hands its program what the plan needs).
    """

    bundle: Path
    launched: Launched
    plan: Plan
    model: ModelSpec
    cluster: ClusterSpec
    rank: int
    world: int
    extra: tuple[str, ...] = ()
    launches: Mapping[str, Launched] = field(default_factory=dict)


class StepFailed(AutoplaceError):
    """A step the framework's own code refused: the run ends there (exit code 1, the bundle does not start)."""

    exit_code = 1

    def __init__(self, step: str, message: str, fix: str | None = None) -> None:
        super().__init__(f"{step}: {message}")
        self.step, self.message, self.fix = step, message, fix


class Steps:
    """The log of a dry run: each event goes to ``sink`` as it happens (the parent shows progress)."""

    def __init__(self, sink: Callable[[Event], None]) -> None:
        self._sink = sink

    @contextmanager
    def step(self, name: str, fix: Fix | None = None) -> Iterator[None]:
        """Run the body as the step ``name``: done, or failed with the framework's own message.

        Args:
            name: what the step builds, as a person would say it ("megatron-core's GPTModel").
            fix: the fix autoplace suggests for an exception the step raises (None: none known).

        Raises:
            StepFailed: the body raised; the original exception is its cause.
        """
        self._sink({"event": "start", "step": name})
        started = time.perf_counter()
        try:
            yield
        except StepFailed:
            raise
        except BaseException as exc:  # noqa: BLE001 - whatever the framework raises is the step's verdict
            if isinstance(exc, KeyboardInterrupt):
                raise
            message = framework_message(exc)
            suggestion = fix(exc) if fix else None
            self._sink({"event": "step", "step": name, "status": "failed", "error": message, "fix": suggestion,
                        "seconds": time.perf_counter() - started,
                        "where": _where(exc)})
            raise StepFailed(name, message, suggestion) from exc
        self._sink({"event": "step", "step": name, "status": "done", "seconds": time.perf_counter() - started})

    def skip(self, name: str, why: str) -> None:
        """A step the framework takes before its first training step that cannot run here, and why."""
        self._sink({"event": "step", "step": name, "status": "skipped", "why": why})

    def note(self, text: str) -> None:
        """Something a reader of the dry run must know (what was redirected to the meta device, say)."""
        self._sink({"event": "note", "text": text})

    def stage(self, pipeline_rank: int, chunks: Iterable[int] = ()) -> None:
        """The pipeline stage the rank holds, as the framework's own code placed it (and its virtual chunks)."""
        self._sink({"event": "stage", "stage": int(pipeline_rank), "chunks": [int(c) for c in chunks]})

    def measured(self, state: str, nbytes: int, how: str, *, backward_end: tuple[int, str] | None = None) -> None:
        """Bytes of ``state`` the framework allocated on the rank, and where they were counted.

        Args:
            backward_end: bytes of the state that exist only at the end of a backward, and what they are
                (FSDP2's unsharded copies under a pipeline): the comparison counts them where plan.json's
                peak on the rank's stage is the end of the first backward (:func:`at_peak`).
        """
        if state not in STATES:
            raise ValueError(f"unknown state {state!r}; valid: {', '.join(STATES)}")
        event: Event = {"event": "measured", "state": state, "bytes": int(nbytes), "how": how}
        if backward_end is not None:
            event |= {"backward_end_bytes": int(backward_end[0]), "backward_end_how": backward_end[1]}
        self._sink(event)


def framework_message(exc: BaseException) -> str:
    """The framework's own error as one line: its type and message (an AssertionError's source line
    when it has no message, as Megatron-LM's bare asserts)."""
    text = " ".join(str(exc).split())
    if not text and isinstance(exc, AssertionError):
        frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        text = f"assert failed: {frame.line}" if frame and frame.line else "assert failed"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _where(exc: BaseException) -> str | None:
    """The innermost source line that raised (file:line), for the report."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes the tensors take on their device (a DTensor: its local shard; meta tensors count their size)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


@contextmanager
def fake_world(world: int, rank: int = 0) -> Iterator[None]:
    """A fake process group of ``world`` ranks in which this process is ``rank``: every collective
    returns at once (PyTorch's ``fake`` backend, ``torch.testing._internal.distributed.fake_pg``).

    Raises:
        AutoplaceError: a process group is already initialized, or the rank is outside the world.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < world:
        raise AutoplaceError(f"rank {rank} is outside the world of {world} ranks")
    if dist.is_initialized():
        raise AutoplaceError("a process group is already initialized; the fake world needs its own")
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def at_peak(event: Mapping[str, Any], phase: str | None) -> tuple[int, str]:
    """A ``measured`` event's bytes and how, at plan.json's peak ``phase`` for the rank's stage
    (``memory_peak_at_per_stage``: "bwd start" or "bwd end", :data:`autoplace.cost.terms.MEMORY_PHASES`):
    what exists only at the end of a backward is counted at "bwd end" and named as left out otherwise."""
    nbytes, how, extra = int(event["bytes"]), str(event["how"]), int(event.get("backward_end_bytes") or 0)
    if not extra:
        return nbytes, how
    what = event["backward_end_how"]
    if phase == "bwd end":
        return nbytes + extra, f"{how} + {what} (plan.json's peak on this stage: the end of the first backward)"
    when = {"bwd start": "the start of backward"}.get(phase or "", "not stated")
    return nbytes, (f"{how}; not counted: {what} ({extra / 2**30:.2f} GiB), which exist only at the end of a "
                    f"backward (plan.json's peak on this stage: {when})")


def predicted_states(stage: Mapping[str, Any]) -> dict[str, int]:
    """plan.json's bytes per state for one stage (memory_per_stage_bytes), the states a dry run measures."""
    return {s: int(stage[s]) for s in STATES if isinstance(stage.get(s), int | float)}
