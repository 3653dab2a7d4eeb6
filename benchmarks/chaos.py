"""Chaos for ``autoplace tune``: three workers on one study, SIGKILLed at any point, one database restart.

    python benchmarks/chaos.py [--seeds 0 1 2] [--kills 12] [--candidates 6] [--storage postgresql journal]

Each worker is the real CLI (``autoplace tune``, in-process in a small Python driver) whose trial is
a short subprocess launched and reaped exactly as torchrun would be (:func:`run_command`), so a run
costs seconds, not torch start-ups.  A seeded schedule makes workers SIGKILL themselves at a chosen
moment -- right after ``ask`` popped a trial (RUNNING, no heartbeat yet), inside ``claim``, halfway
through a trial, or just before ``tell`` -- and the harness restarts each one at once, as an operator
would.  Halfway through the kills a PostgreSQL server is stopped with ``-m immediate`` and started
again.  Then one clean worker finishes the study.

Printed per run: kills, restarts, trials COMPLETE, duplicates (a candidate COMPLETE more than once),
given up (worker exits 4 during the chaos; the clean worker must leave none), orphans (trial
processes that outlived their worker), the clean worker's exit code and wall seconds.
``tests/test_tune_chaos.py`` runs a small slice of this in CI.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "examples" / "models" / "tiny-llama.json"
CLUSTER = "name: cpu-1\nnodes: 1\ngpus_per_node: 1\ngpu: cpu\nintra_node: loopback\ninter_node: loopback\n" \
          "host_memory_GB: 16\n"
PHASES = ("ask", "claim", "trial", "tell")
PLANS = ("mbs=1", "mbs=2", "mbs=4", "mbs=8", "mbs=1,recompute=full", "mbs=2,recompute=full", "mbs=4,recompute=full",
         "mbs=8,recompute=full")

# The worker: ``autoplace tune`` with CP-SAT's top-K replaced by fixed candidates, a trial that is a
# short sleeping subprocess (reaped like torchrun), and a self-SIGKILL at CHAOS_DIE_AT=phase:nth.
DRIVER = """\
import faulthandler, json, os, signal, sys, threading
faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung worker's stacks, asked for at the deadline
from pathlib import Path
import optuna
import autoplace.tune as tune
from autoplace.runtime.launch import read_outcome, run_command

phase, _, nth = os.environ.get("CHAOS_DIE_AT", "none:0").partition(":")
trial_s, cands, out = float(os.environ["CHAOS_TRIAL_S"]), json.loads(os.environ["CHAOS_CANDIDATES"]), Path(sys.argv[1])
seen = {}

def hit(name):
    seen[name] = seen.get(name, 0) + 1
    if name == phase and seen[name] == int(nth):
        out.joinpath("died_at").write_text(name)
        os.kill(os.getpid(), signal.SIGKILL)

def ask(st, dists, _real=tune._ask):
    trial = _real(st, dists)
    hit("ask")  # popped or created: RUNNING, not beating yet
    return trial

def claim(*args, _real=tune.claim, **kwargs):
    hit("claim")  # beating
    return _real(*args, **kwargs)

def tell(self, *args, _real=optuna.study.Study.tell, **kwargs):
    hit("tell")
    return _real(self, *args, **kwargs)

def launch_trial(ctx, plan, directory, extra, env):
    directory.mkdir(parents=True, exist_ok=True)
    result = directory / "result.json"
    result.unlink(missing_ok=True)
    body = {"step_time_s": 0.1 + 0.01 * plan.mbs, "tokens_per_s": 1.0, "losses": [1.0],
            "memory": {"peak_rss_bytes": 1, "state_bytes_per_device": 1}}
    code = f"import json, time; time.sleep({trial_s}); open({str(result)!r}, 'w').write({json.dumps(body)!r})"
    timer = threading.Timer(trial_s / 2, hit, ["trial"])  # halfway through the trial
    timer.start()
    try:
        rc, wall = run_command([sys.executable, "-c", code], directory / "run.log", ctx.timeout_s, env)
    finally:
        timer.cancel()
    return read_outcome(result, rc, wall, directory / "run.log")

tune._ask, tune.claim, optuna.study.Study.tell, tune.launch_trial = ask, claim, tell, launch_trial
tune.top_candidates = lambda *a, **k: list(cands)
from autoplace.cli import app
app(["--debug", *sys.argv[2:]], prog_name="autoplace")  # a worker's unexpected end leaves its traceback
"""


# ---- a throwaway PostgreSQL ---------------------------------------------------------------------


def pg_bin() -> Path | None:
    """Debian's server binaries (/usr/lib/postgresql/N/bin), else initdb and pg_ctl on PATH."""
    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (d / "initdb").is_file() and (d / "pg_ctl").is_file():
            return d
    found = shutil.which("initdb")
    return Path(found).parent if found and shutil.which("pg_ctl") else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Postgres:
    """A PostgreSQL server on 127.0.0.1 in a temp dir; ``restart`` is a crash and a start."""

    url: str
    ctl: list[str]
    opts: list[str]

    def restart(self, down_s: float) -> None:
        subprocess.run([*self.ctl, "-m", "immediate", "-w", "stop"], check=True, capture_output=True, timeout=120)
        time.sleep(down_s)
        subprocess.run([*self.ctl, *self.opts, "-w", "start"], check=True, capture_output=True, timeout=120)

    def database(self, name: str) -> str:
        """A fresh database on this server; its URL."""
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as con:
            con.execute(f"CREATE DATABASE {name}")
        return self.url.rsplit("/", 1)[0] + f"/{name}"


@contextmanager
def throwaway_postgres() -> Iterator[Postgres | None]:
    """A running server, stopped and deleted on exit; None without PostgreSQL's binaries.  As root
    the server runs as the ``postgres`` user (it refuses root), from a directory that user owns."""
    bindir = pg_bin()
    if bindir is None:
        yield None
        return
    as_user: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="autoplace-pg-"))
    if os.geteuid() == 0:
        import pwd

        pg = pwd.getpwnam("postgres")  # Debian's package creates the user
        os.chown(root, pg.pw_uid, pg.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    ctl = [*as_user, str(bindir / "pg_ctl"), "-D", str(root / "data")]
    opts = ["-o", f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c max_connections=200", "-l", str(root / "log")]
    try:
        subprocess.run([*as_user, str(bindir / "initdb"), "-D", str(root / "data"), "-A", "trust", "-U", "postgres"],
                       check=True, capture_output=True, timeout=120)
        subprocess.run([*ctl, *opts, "-w", "start"], check=True, capture_output=True, timeout=120)
        yield Postgres(f"postgresql://postgres@127.0.0.1:{port}/postgres", ctl, opts)
    finally:
        subprocess.run([*ctl, "-m", "fast", "-w", "stop"], capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


# ---- the run --------------------------------------------------------------------------------------


def processes_naming(text: str) -> list[int]:
    """Live processes (not this one) whose command line contains ``text``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int(proc.name) != os.getpid() and text.encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@dataclass
class ChaosResult:
    """What one seeded run left: the table's row, plus what the asserts need."""

    seed: int
    storage: str
    kills: list[str] = field(default_factory=list)  # the phase each kill landed in
    restarts: int = 0
    server_restarts: int = 0
    exits: list[int] = field(default_factory=list)  # every worker incarnation's exit code
    final_exit: int | None = None
    final_err: str = ""
    complete: dict[str, int] = field(default_factory=dict)  # plan -> COMPLETE trials
    states: dict[str, int] = field(default_factory=dict)  # trial state -> count
    given_up: int = 0  # worker incarnations that exited 4
    failures: list[str] = field(default_factory=list)  # stderr tails of workers that exited otherwise
    orphans: list[int] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def duplicates(self) -> int:
        return sum(n - 1 for n in self.complete.values() if n > 1)


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen
    out: Path


def candidates(n: int) -> list[str]:
    """``n`` single-process plans of tiny-llama, as the study stores them."""
    from autoplace.cost.layers import layer_table
    from autoplace.plan import build_plan, parse_plan_string
    from autoplace.specs.model import load_model

    m = load_model(MODEL)
    return [build_plan(parse_plan_string(text), world=1, blocks=layer_table(m).blocks,
                       global_batch=m.training.global_batch).to_string() for text in PLANS[:n]]


def _spawn(root: Path, index: int, storage: str, cands: list[str], die_at: str, grace: int, retries: int,
           trial_s: float) -> _Worker:
    out = root / f"w{index}-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    cluster = root / "cpu-1.yaml"
    env = {**os.environ, "PYTHONPATH": str(REPO), "CHAOS_DIE_AT": die_at, "CHAOS_TRIAL_S": str(trial_s),
           "CHAOS_CANDIDATES": __import__("json").dumps(cands)}
    args = ["tune", str(MODEL), str(cluster), "--trials", str(len(cands)), "--storage", storage, "--out", str(out),
            "--timeout", "60", "--grace", str(grace), "--retries", str(retries), "--seed", str(index), "--json"]
    with open(out / "stdout", "wb") as so, open(out / "stderr", "wb") as se:
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(out), *args], env=env, stdout=so, stderr=se)
    return _Worker(index, proc, out)


def run_chaos(root: Path, storage: str, seed: int, *, kills: int = 4, n_candidates: int = 4, workers: int = 3,
              trial_s: float = 0.4, grace: int = 4, retries: int = 3, server: Postgres | None = None,
              deadline_s: float = 600.0, nth_max: int = 2) -> ChaosResult:
    """One seeded run: ``workers`` workers, ``kills`` self-SIGKILLs at seeded phases (every phase
    at least once when ``kills`` >= 4), each killed worker restarted at once, ``server``
    restarted once halfway; then a clean worker.  Everything it starts is stopped before it returns."""
    import optuna

    from autoplace.studies import Heartbeat, open_storage

    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    (root / "cpu-1.yaml").write_text(CLUSTER)
    cands = candidates(n_candidates)
    plan = [PHASES[i % len(PHASES)] for i in range(kills)]
    rng.shuffle(plan)
    schedule = [f"{p}:{rng.randint(1, nth_max)}" for p in plan]  # die at the nth ask, claim, ...
    result = ChaosResult(seed, storage.split(":", 1)[0] if "://" in storage else "journal")
    t0 = time.monotonic()
    live = [_spawn(root, i, storage, cands, schedule.pop() if schedule else "none:0", grace, retries, trial_s)
            for i in range(workers)]
    try:
        while live:
            if time.monotonic() - t0 > deadline_s:
                raise TimeoutError(f"chaos run (seed {seed}) still running after {deadline_s:.0f} s; "
                                   f"{_stacks(live)}")
            time.sleep(0.1)
            for w in [w for w in live if w.proc.poll() is not None]:
                live.remove(w)
                code = w.proc.returncode
                result.exits.append(code)
                if code == -signal.SIGKILL:
                    result.kills.append((w.out / "died_at").read_text() if (w.out / "died_at").exists() else "?")
                    if server is not None and not result.server_restarts and len(result.kills) >= (kills + 1) // 2:
                        server.restart(down_s=rng.uniform(0.5, 3.0))
                        result.server_restarts += 1
                    live.append(_spawn(root, w.index, storage, cands, schedule.pop() if schedule else "none:0",
                                       grace, retries, trial_s))
                    result.restarts += 1
                elif code == 4:
                    result.given_up += 1
                elif code != 0:
                    result.failures.append(f"worker {w.index} exited {code}: " + (w.out / "stderr").read_text()[-3000:])
        final = _spawn(root, 99, storage, cands, "none:0", grace, retries, trial_s)
        live.append(final)
        final.proc.wait(timeout=max(60.0, deadline_s - (time.monotonic() - t0)))
        result.final_exit, result.final_err = final.proc.returncode, (final.out / "stderr").read_text()[-2000:]
    finally:
        for w in live:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
    result.wall_s = time.monotonic() - t0
    result.orphans = _orphans(str(root))
    store, _ = open_storage(storage, root, Heartbeat(interval_s=1, grace_s=grace))
    for t in optuna.load_study(study_name="autoplace", storage=store).get_trials():
        result.states[t.state.name] = result.states.get(t.state.name, 0) + 1
        if t.state.name == "COMPLETE":
            result.complete[t.params["plan"]] = result.complete.get(t.params["plan"], 0) + 1
    for c in cands:
        result.complete.setdefault(c, 0)
    return result


def _stacks(live: list[_Worker]) -> str:
    """The live workers' stacks (their faulthandler writes them to stderr on SIGUSR1)."""
    for w in live:
        w.proc.send_signal(signal.SIGUSR1)
    time.sleep(1.0)
    return "\n".join(f"worker {w.index}: " + (w.out / "stderr").read_text()[-4000:] for w in live)


def _orphans(text: str, wait_s: float = 20.0) -> list[int]:
    """Trial processes naming ``text`` still alive after ``wait_s`` (then SIGKILLed)."""
    deadline = time.time() + wait_s
    while (left := processes_naming(text)) and time.time() < deadline:
        time.sleep(0.5)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return left


def row(r: ChaosResult) -> list[Any]:
    phases = ",".join(f"{p}={r.kills.count(p)}" for p in PHASES if p in r.kills)
    return [r.storage, r.seed, f"{len(r.kills)} ({phases})", r.restarts, r.server_restarts,
            f"{sum(1 for n in r.complete.values() if n >= 1)}/{len(r.complete)}", r.duplicates, r.given_up,
            r.states.get("RUNNING", 0) + r.states.get("WAITING", 0), len(r.orphans), r.final_exit, f"{r.wall_s:.0f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--kills", type=int, default=12)
    parser.add_argument("--candidates", type=int, default=6)
    parser.add_argument("--storage", nargs="+", default=["postgresql", "journal"], choices=["postgresql", "journal"])
    parser.add_argument("--retries", type=int, default=3)
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"autoplace tune under chaos: 3 workers, {args.candidates} candidates, {args.kills} kills")
    for col in ("storage", "seed", "kills (phase)", "restarts", "db restarts", "complete", "duplicates",
                "given up (exit 4)", "left open", "orphans", "final exit", "wall s"):
        table.add_column(col, justify="right")
    with throwaway_postgres() as pg:
        for kind in args.storage:
            for seed in args.seeds:
                with tempfile.TemporaryDirectory(prefix="autoplace-chaos-") as tmp:
                    if kind == "postgresql" and pg is None:
                        print("no PostgreSQL binaries (apt-get install postgresql); skipping postgresql")
                        break
                    storage = pg.database(f"chaos_{seed}_{os.getpid()}") if kind == "postgresql" and pg else \
                        str(Path(tmp) / "study.journal")
                    r = run_chaos(Path(tmp), storage, seed, kills=args.kills, n_candidates=args.candidates,
                                  retries=args.retries, server=pg if kind == "postgresql" else None)
                    table.add_row(*map(str, row(r)))
                    if r.final_exit != 0:
                        print(f"seed {seed} {kind}: final worker exited {r.final_exit}: {r.final_err}")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
