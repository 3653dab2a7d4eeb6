"""A dry run for people: its progress on stderr while ranks build, then the steps and states as tables."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape

from autoplace.dryrun.run import TOLERANCE, DryRun, RankRun
from autoplace.dryrun.steps import STATES
from autoplace.report import Section, _fmt_bytes, render

_MARK = {"done": "ok", "skipped": "skipped", "failed": "FAILED"}


class DryRunProgress:
    """One progress line per rank on stderr (transient), naming the step the framework is in."""

    def __init__(self) -> None:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        console = Console(stderr=True)
        # only on a terminal: elsewhere rich leaves a blank line on stderr, and an error would not be one line
        self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                  console=console, transient=True, disable=not console.is_terminal)
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
    """The dry run's header, the steps of every rank side by side, the bytes per state against plan.json's,
    what was skipped or redirected (said once for the ranks it applies to), and the verdict."""
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
    sections = [steps_section(run.ranks)]
    states = states_section(run.ranks)
    if states is not None:
        sections.append(states)
    lines = _once([(r.rank, f"skipped: {s['step']}: {s.get('why', '')}") for r in run.ranks for s in r.steps
                   if s["status"] == "skipped"])
    lines += _once([(r.rank, f"counted {state}: {r.measured[state][1]}") for r in run.ranks for state in STATES
                    if state in r.measured])
    lines += _once([(r.rank, note) for r in run.ranks for note in r.notes])
    for rank in run.ranks:
        lines += _failure_lines(rank)
    lines.append(f"dry run {'passed' if run.ok else 'FAILED'}: " + _verdict(run))
    render(sections, lines, fmt, header=header)


def _where(rank: RankRun) -> str:
    """``rank 48 (stage 3)``, with its virtual stages when it holds several."""
    where = f"rank {rank.rank}" + (f" (stage {rank.stage}" if rank.stage is not None else "")
    if rank.stage is not None and len(rank.chunks) > 1:
        where += f", virtual {','.join(map(str, rank.chunks))}"
    return where + (")" if rank.stage is not None else "")


def steps_section(ranks: list[RankRun]) -> Section:
    """One row per step the framework took, one column per rank: ok and its seconds, skipped, FAILED."""
    names = list(dict.fromkeys(s["step"] for r in ranks for s in r.steps))
    cells = {r.rank: {s["step"]: _cell(s) for s in r.steps} for r in ranks}
    rows = [(name, *(cells[r.rank].get(name, "-") for r in ranks)) for name in names]
    columns = ("step", *(_where(r) for r in ranks))
    return Section("Steps, as the framework's own code took them", columns, rows, wrap=frozenset({"step"}))


def states_section(ranks: list[RankRun]) -> Section | None:
    """Bytes per training state as the framework allocated them on each rank, against plan.json's."""
    rows = []
    for rank in ranks:
        errors = rank.errors()
        for state in STATES:
            if state not in rank.measured:
                continue
            predicted, error = rank.predicted.get(state), errors.get(state)
            verdict = "" if error is None else ("ok" if abs(error) <= TOLERANCE else "DIFFERS")
            rows.append((_where(rank), state, _fmt_bytes(rank.measured[state][0]),
                         _fmt_bytes(predicted) if predicted else "-", f"{error:+.1%}" if error is not None else "-",
                         verdict))
    if not rows:
        return None
    return Section(f"Bytes allocated vs plan.json's prediction (within {TOLERANCE:.0%}: ok)",
                   ("rank", "state", "allocated", "predicted", "error", ""), rows,
                   right=frozenset({"allocated", "predicted", "error"}))


def _once(items: list[tuple[int, str]]) -> list[str]:
    """Each text once, prefixed with the ranks it came from (all of them: no prefix)."""
    ranks: dict[str, list[int]] = {}
    for rank, text in items:
        ranks.setdefault(text, []).append(rank)
    every = {rank for rank, _ in items}
    out = []
    for text, where in ranks.items():
        prefix = "" if set(where) == every else f"rank{'s' * (len(where) > 1)} {', '.join(map(str, where))}: "
        out.append(f"{prefix}{escape(text)}")
    return out


def _failure_lines(rank: RankRun) -> list[str]:
    lines = []
    failed = rank.failed
    if failed:
        lines.append(f"[red]rank {rank.rank}: {escape(failed['step'])}: {escape(failed['error'])}[/red]")
        if failed.get("fix"):
            lines.append(f"  fix: {escape(failed['fix'])}")
    if rank.crash:
        lines.append(f"[red]rank {rank.rank}: the dry run crashed:[/red]\n{escape(rank.crash)}")
    return lines


def _cell(step: dict[str, Any]) -> str:
    if step["status"] == "done":
        return f"ok {step.get('seconds', 0.0):.1f} s"
    return _MARK[step["status"]]


def _verdict(run: DryRun) -> str:
    if run.disagreements:
        return "the launch kinds start different jobs"
    bad = [r for r in run.ranks if not r.ok]
    if bad:
        return f"rank {bad[0].rank} does not start"
    return f"{', '.join(f'rank {r.rank}' for r in run.ranks)} built by {run.framework}'s own code"
