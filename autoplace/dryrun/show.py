"""A dry run for people: its progress on stderr while ranks build, then the steps and states as tables."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from autoplace.dryrun.run import TOLERANCE, DryRun, RankRun
from autoplace.dryrun.steps import STATES
from autoplace.report import Section, _fmt_bytes, render

_MARK = {"done": "ok", "skipped": "skipped", "failed": "FAILED"}


class DryRunProgress:
    """One progress line per rank on stderr (transient), naming the step the framework is in."""

    def __init__(self) -> None:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                  console=Console(stderr=True), transient=True)
        self._tasks: dict[int, Any] = {}
        self._progress.start()

    def __call__(self, rank: int, event: dict[str, Any]) -> None:
        if rank not in self._tasks:
            self._tasks[rank] = self._progress.add_task(f"rank {rank}", total=None)
        if event["event"] == "start":
            self._progress.update(self._tasks[rank], description=f"rank {rank}: {event['step']}")
        elif event["event"] == "end":
            self._progress.update(self._tasks[rank], description=f"rank {rank}: built")

    def close(self) -> None:
        self._progress.stop()


def print_dry_run(run: DryRun, fmt: str = "table") -> None:
    """The dry run's header, each rank's steps and states, and its verdict."""
    launch = run.launched
    header = [f"dryrun {run.bundle}: {run.framework}, {launch.world} ranks ({launch.nodes} x {launch.per_node}), "
              f"from {launch.file}: {' '.join(launch.program[:2])} ..."]
    if launch.stand_ins:
        header.append(f"stand-ins for what the launch requires: {', '.join(sorted(launch.stand_ins))}")
    kinds = ", ".join(run.launches)
    header.append(f"launches ({kinds}): " + ("the same job" if not run.disagreements else "DIFFER"))
    header += [f"  {line}" for line in run.disagreements]
    header.append("files agree with plan.json" if not run.edits else "files differ from plan.json (built as the "
                                                                     "files say):")
    header += [f"  {line}" for line in run.edits]
    sections: list[Section] = []
    lines: list[str] = []
    for rank in run.ranks:
        sections += rank_sections(rank)
        lines += rank_lines(rank)
    lines.append(f"dry run {'passed' if run.ok else 'FAILED'}: " + _verdict(run))
    render(sections, lines, fmt, header=header)


def rank_sections(rank: RankRun) -> list[Section]:
    """The rank's steps, and its states against plan.json's prediction."""
    where = f"rank {rank.rank}" + (f", pipeline stage {rank.stage}" if rank.stage is not None else "")
    steps = Section(f"{where}: steps", ("step", "result", "s / why"),
                    [(s["step"], _MARK[s["status"]], _detail(s)) for s in rank.steps], right=frozenset({"s / why"}))
    out = [steps]
    errors = rank.errors()
    rows = []
    for state in STATES:
        if state not in rank.measured:
            continue
        nbytes, how = rank.measured[state]
        predicted = rank.predicted.get(state)
        error = errors.get(state)
        verdict = "" if error is None else ("ok" if abs(error) <= TOLERANCE else "DIFFERS")
        rows.append((state, _fmt_bytes(nbytes), _fmt_bytes(predicted) if predicted else "-",
                     f"{error:+.1%}" if error is not None else "-", verdict, how))
    if rows:
        out.append(Section(f"{where}: bytes allocated vs predicted", ("state", "allocated", "predicted",
                                                                       "error", "", "counted"), rows,
                           right=frozenset({"allocated", "predicted", "error"}), wrap=frozenset({"counted"})))
    return out


def rank_lines(rank: RankRun) -> list[str]:
    lines = [f"rank {rank.rank}: {note}" for note in rank.notes]
    failed = rank.failed
    if failed:
        lines.append(f"rank {rank.rank}: {failed['step']}: {failed['error']}")
        if failed.get("fix"):
            lines.append(f"  fix: {failed['fix']}")
    if rank.crash:
        lines.append(f"rank {rank.rank}: the dry run crashed:\n{rank.crash}")
    return lines


def _detail(step: dict[str, Any]) -> str:
    if step["status"] == "skipped":
        return step.get("why", "")
    if step["status"] == "failed":
        return "see below"
    return f"{step.get('seconds', 0.0):.1f}"


def _verdict(run: DryRun) -> str:
    if run.disagreements:
        return "the launch kinds start different jobs"
    bad = [r for r in run.ranks if not r.ok]
    if bad:
        return f"rank {bad[0].rank} does not start"
    return f"{', '.join(f'rank {r.rank}' for r in run.ranks)} built by {run.framework}'s own code"
