"""One rank of a dry run, in a process of its own: ``python -m autoplace.dryrun.worker JOB.json``.

A fresh process per rank keeps each framework's global state (Megatron's parallel_state, torch's
process group, DeepSpeed's comm) from leaking between ranks.  The job file names the bundle, the rank,
the world and the recorded launch; the worker prints one ``EVENT_PREFIX`` JSON line per event on the
stdout it was started with, and sends everything the framework prints to stderr.
Exit code: 0 the rank was built, 1 a step failed (its event says why), anything else a crash.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

EVENT_PREFIX = "autoplace-dryrun-event "


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    events = _event_stream()
    from autoplace.dryrun.bundle import read_bundle
    from autoplace.dryrun.launches import Launched
    from autoplace.dryrun.steps import DryContext, StepFailed, Steps

    def sink(event: dict[str, Any]) -> None:
        events.write(EVENT_PREFIX + json.dumps(event) + "\n")
        events.flush()

    bundle = read_bundle(Path(job["bundle"]))
    launched = Launched.from_dict(job["launched"])
    ctx = DryContext(bundle=bundle.path, launched=launched, plan=bundle.plan, model=bundle.model,
                     cluster=bundle.cluster, rank=int(job["rank"]), world=launched.world,
                     extra=tuple(job.get("extra", ())),
                     launches={k: Launched.from_dict(v) for k, v in job.get("launches", {}).items()})
    try:
        bundle.framework.dry_run(ctx, Steps(sink))
    except StepFailed:
        return 1
    sink({"event": "end"})
    return 0


def _event_stream() -> TextIO:
    """The stdout this process started with, for events only; fd 1 then goes to stderr, so whatever the
    framework prints (DeepSpeed and Megatron log to stdout) cannot break an event line."""
    sys.stdout.flush()
    events = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return events


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
