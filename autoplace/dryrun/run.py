"""``autoplace dryrun`` as named steps: read the bundle -> record its launches -> build each rank -> compare.

Every launch kind of the bundle is recorded (:mod:`autoplace.dryrun.launches`) and the kinds must start
the same job; the torchrun launch's words are what the framework is handed.  Each rank is built in a
process of its own (:mod:`autoplace.dryrun.worker`), by the framework's own code on a fake process group
of the planned world size, and the bytes it allocated per training state are set beside plan.json's
prediction for the rank's pipeline stage.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoplace.bundle import LAUNCHERS
from autoplace.dryrun.bundle import Bundle, edits, read_bundle
from autoplace.dryrun.launches import KINDS, Launched, disagreements, record_all
from autoplace.dryrun.steps import STATES, StepFailed, at_peak, predicted_states
from autoplace.dryrun.worker import EVENT_PREFIX
from autoplace.errors import SpecError

SCHEMA = "autoplace.dryrun/v1"
TOLERANCE = 0.02  # a measured state within 2% of the prediction agrees with it
PRIMARY = "torchrun"  # the launch whose words the framework is handed (every bundle has launch_torchrun.sh)

Progress = Callable[[int, dict[str, Any]], None]  # (rank, event) as the rank's build goes


@dataclass(frozen=True)
class RankRun:
    """What one rank built.

    Attributes:
        rank: the global rank.
        stage: its pipeline stage as the framework placed it (None: not reported).
        steps: each step's event: its name, status (done, skipped, failed) and seconds or why.
        notes: what the framework's dry run said besides its steps.
        measured: state -> (bytes, where they were counted), as the framework allocated them.
        predicted: state -> bytes plan.json predicts for the rank's stage.
        seconds: how long the rank took, its process included.
        crash: the process's last output when it died without a verdict.
        chunks: the stage's model chunks (virtual stages), as the framework placed them.
    """

    rank: int
    stage: int | None
    steps: tuple[dict[str, Any], ...]
    notes: tuple[str, ...]
    measured: dict[str, tuple[int, str]]
    predicted: dict[str, int]
    seconds: float
    crash: str | None = None
    chunks: tuple[int, ...] = ()

    @property
    def failed(self) -> dict[str, Any] | None:
        return next((s for s in self.steps if s["status"] == "failed"), None)

    @property
    def ok(self) -> bool:
        return self.crash is None and self.failed is None

    def errors(self) -> dict[str, float]:
        """state -> signed relative error of the measured bytes against the prediction (measured / predicted - 1)."""
        return {s: self.measured[s][0] / self.predicted[s] - 1.0 for s in STATES
                if s in self.measured and self.predicted.get(s)}

    def to_dict(self) -> dict[str, Any]:
        errors = self.errors()
        states = {s: {"measured_bytes": self.measured[s][0], "how": self.measured[s][1],
                      "predicted_bytes": self.predicted.get(s), "error": errors.get(s),
                      "within_tolerance": abs(errors[s]) <= TOLERANCE if s in errors else None}
                  for s in STATES if s in self.measured}
        return {"rank": self.rank, "stage": self.stage, "chunks": list(self.chunks), "ok": self.ok,
                "steps": list(self.steps),
                "notes": list(self.notes), "states": states, "seconds": round(self.seconds, 3), "crash": self.crash}


@dataclass(frozen=True)
class DryRun:
    """A bundle's dry run: its launches, where its files differ from plan.json, and each rank built."""

    bundle: Path
    framework: str
    launched: Launched
    launches: dict[str, Launched | str]
    disagreements: list[str]
    edits: list[str]
    ranks: list[RankRun] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every rank built and every launch kind starts the same job."""
        return not self.disagreements and all(r.ok for r in self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "ok": self.ok, "bundle": str(self.bundle), "framework": self.framework,
                "world": self.launched.world, "launch": self.launched.to_dict(),
                "launches": {k: v.to_dict() if isinstance(v, Launched) else {"error": v}
                             for k, v in self.launches.items()},
                "disagreements": self.disagreements, "edits": self.edits, "tolerance": TOLERANCE,
                "ranks": [r.to_dict() for r in self.ranks]}


def dry_run(path: Path, ranks: Sequence[int] | None = None, *, extra: Sequence[str] = (),
            progress: Progress | None = None, timeout: float = 1800.0) -> DryRun:
    """Dry-run the bundle at ``path`` on ``ranks`` (default: rank 0 and the first rank of the last
    pipeline stage).

    Raises:
        SpecError: not a bundle, inputs that no longer load, a rank outside the world (exit 2).
        StepFailed: the bundle's torchrun launch stops before its launcher (exit 1).
    """
    bundle = read_bundle(path)
    launches = own_launches(bundle, record_all(bundle.path, extra=extra))
    primary = launches.get(PRIMARY)
    if not isinstance(primary, Launched):
        raise StepFailed("record the launch", str(primary) if primary else f"the bundle has no {PRIMARY} launch")
    recorded = {k: v for k, v in launches.items() if isinstance(v, Launched)}
    lines = disagreements({PRIMARY: primary, **recorded})
    lines += [f"{KINDS[k]}: {v}" for k, v in launches.items() if not isinstance(v, Launched)]
    wanted = list(dict.fromkeys(ranks if ranks else default_ranks(bundle, primary.world)))
    bad = [r for r in wanted if not 0 <= r < primary.world]
    if bad:
        raise SpecError(f"rank {bad[0]} is outside the launch's world of {primary.world} ranks "
                        f"(0..{primary.world - 1})", source="--rank")
    run = DryRun(bundle.path, bundle.framework.name, primary,
                 {k: v if isinstance(v, Launched) else str(v) for k, v in launches.items()}, lines,
                 _world_edit(bundle, primary) + edits(bundle))
    for rank in wanted:
        run.ranks.append(_build_rank(bundle, recorded, rank, extra, progress, timeout))
    return run


def own_launches(bundle: Bundle, launches: dict[str, Any]) -> dict[str, Any]:
    """The launch kinds that start the bundle's framework: the generic launchers (torchrun, Slurm,
    Kubernetes), which run the framework plan.json names, and that framework's own launcher.  A best
    plan's bundle also holds other frameworks' files and launchers; those start their own jobs."""
    return {k: v for k, v in launches.items() if k in LAUNCHERS or k == bundle.framework.name}


def default_ranks(bundle: Bundle, world: int) -> list[int]:
    """Rank 0 and the first rank of the last pipeline stage (pipeline outermost in every framework's
    default rank order: Megatron-LM's tp-cp-ep-dp-pp, torchtitan's pp-dp-cp-tp mesh, DeepSpeed's pipe-data)."""
    pp = max(bundle.plan.pp, 1)
    return [0] if pp == 1 or world % pp else [0, (pp - 1) * (world // pp)]


def _world_edit(bundle: Bundle, launched: Launched) -> list[str]:
    planned = bundle.plan.world
    if launched.world == planned:
        return []
    return [f"{launched.file}: {launched.nodes} x {launched.per_node} = {launched.world} processes, plan.json: "
            f"{planned} GPUs"]


def build_in_process(path: Path, rank: int, *, extra: Sequence[str] = ()) -> RankRun:
    """One rank built in this process (tests build many bundles without a process each; the framework's
    dry run leaves no global state behind).  The launch is recorded as :func:`dry_run` records it."""
    from autoplace.dryrun.steps import DryContext, Steps

    bundle = read_bundle(path)
    launches = own_launches(bundle, record_all(bundle.path, extra=extra))
    launched = launches.get(PRIMARY)
    if not isinstance(launched, Launched):
        raise StepFailed("record the launch", str(launched))
    events: list[dict[str, Any]] = []
    started = time.perf_counter()
    ctx = DryContext(bundle=bundle.path, launched=launched, plan=bundle.plan, model=bundle.model,
                     cluster=bundle.cluster, rank=rank, world=launched.world, extra=tuple(extra),
                     launches={k: v for k, v in launches.items() if isinstance(v, Launched)})
    try:
        bundle.framework.dry_run(ctx, Steps(events.append))
    except StepFailed:
        pass
    return _collect(bundle, rank, events, time.perf_counter() - started)


def _build_rank(bundle: Bundle, launches: dict[str, Launched], rank: int, extra: Sequence[str],
                progress: Progress | None, timeout: float) -> RankRun:
    """Run the worker for ``rank`` (built from the primary launch; ``launches``: every kind recorded) and
    gather its events into a RankRun."""
    started = time.perf_counter()
    job = {"bundle": str(bundle.path), "rank": rank, "launched": launches[PRIMARY].to_dict(), "extra": list(extra),
           "launches": {k: v.to_dict() for k, v in launches.items()}}
    events: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="autoplace-dryrun-") as scratch:
        job_file, log_file = Path(scratch) / "job.json", Path(scratch) / "stderr.log"
        job_file.write_text(json.dumps(job))
        with log_file.open("w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "autoplace.dryrun.worker", str(job_file)],
                                    stdout=subprocess.PIPE, stderr=log, text=True, stdin=subprocess.DEVNULL)
            assert proc.stdout is not None  # stdout=PIPE
            for line in proc.stdout:
                if line.startswith(EVENT_PREFIX):
                    events.append(json.loads(line[len(EVENT_PREFIX):]))
                    if progress is not None:
                        progress(rank, events[-1])
                if time.perf_counter() > started + timeout:
                    proc.kill()
                    break
            code = proc.wait()
        tail = log_file.read_text(errors="replace").strip().splitlines()[-12:]
    run = _collect(bundle, rank, events, time.perf_counter() - started)
    if code not in (0, 1) or (code == 1 and run.failed is None):
        return dataclasses.replace(run, crash="\n".join(tail) or f"the worker exited with code {code}")
    return run


def _collect(bundle: Bundle, rank: int, events: list[dict[str, Any]], seconds: float) -> RankRun:
    """A rank's events as a RankRun, beside plan.json's prediction for the stage it reported."""
    steps = tuple({k: v for k, v in e.items() if k != "event"} for e in events if e["event"] == "step")
    notes = tuple(e["text"] for e in events if e["event"] == "note")
    placed = next((e for e in reversed(events) if e["event"] == "stage"), None)
    stage = placed["stage"] if placed else None
    phase = bundle.peak_phase(stage if stage is not None else 0)
    measured = {e["state"]: at_peak(e, phase) for e in events if e["event"] == "measured"}
    predicted = predicted_states(bundle.predicted(stage if stage is not None else 0))
    return RankRun(rank, stage, steps, notes, measured, predicted, seconds,
                   chunks=tuple(placed.get("chunks", ())) if placed else ())
