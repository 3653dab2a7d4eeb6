"""A bundle's launches, run as a scheduler would run them, with recording stand-ins for the launchers.

Each launch kind of a bundle -- the torchrun script, the Slurm batch script, the DeepSpeed and
accelerate launcher scripts, the Kubeflow PyTorchJob's container command -- is executed by bash in
a scratch directory whose ``torchrun``, ``deepspeed`` and ``accelerate`` only write down the words and
the environment they were given, and whose ``srun`` and ``scontrol`` answer as Slurm does on the
first node of the job.  The launcher's words are then parsed by the launcher's own argument parser
(torchrun's, DeepSpeed's runner, ``accelerate launch``), which splits them into the job's geometry
(nodes x processes per node) and the program every process runs: its script (or ``-m`` module) and
the words after it.  These are what :mod:`autoplace.dryrun` hands the framework.

Required values the plan cannot know (``${DATA_PATH:?...}`` in a launch) are filled with stand-ins
named after the variable, so the words can be recorded; they are listed in :attr:`Launched.stand_ins`.
The bundle's own directory is written ``$AUTOPLACE_BUNDLE`` in the recorded words and environment, so
launches of different kinds (and a PyTorchJob, which mounts the bundle elsewhere) compare equal.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from autoplace.errors import SpecError

# launch kind -> the bundle file that starts it (autoplace.bundle.LAUNCHERS and the frameworks' own launchers)
KINDS: dict[str, str] = {"torchrun": "launch_torchrun.sh", "slurm": "job.sbatch",
                         "deepspeed": "launch_deepspeed.sh", "accelerate": "launch_accelerate.sh",
                         "k8s": "pytorchjob.yaml"}
BUNDLE = "$AUTOPLACE_BUNDLE"  # how the bundle's directory is written in recorded words
K8S_OPERATOR = "torch-operator"  # PET_* variables Kubeflow's training operator gives torchrun

_RECORDER = """#!{python}
import json, os, sys
with open(os.environ["AUTOPLACE_RECORD"], "a") as f:
    f.write(json.dumps({{"launcher": os.path.basename(sys.argv[0]), "argv": sys.argv[1:],
                        "env": dict(os.environ)}}) + "\\n")
"""
# srun runs its command as task 0 of node 0; scontrol answers the two questions the batch script asks
_SRUN = '#!/usr/bin/env bash\nexport SLURM_NODEID="${SLURM_NODEID:-0}" SLURM_PROCID="${SLURM_PROCID:-0}"\nexec "$@"\n'
_SCONTROL = """#!/usr/bin/env bash
case "$1 $2" in
  "show hostnames") for i in $(seq 0 $(( ${SLURM_JOB_NUM_NODES:-1} - 1 ))); do echo "node-$i"; done ;;
  "show job") echo "   Command=$AUTOPLACE_SBATCH" ;;
esac
"""
_REQUIRED = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*):\?")  # ${NAME:?message}: a value the launch requires
# what the stand-ins, bash and the scratch Slurm job set, not the launch
_NOT_THE_LAUNCH = {"PWD", "OLDPWD", "SHLVL", "_", "AUTOPLACE_RECORD", "AUTOPLACE_SBATCH", "SLURM_JOB_ID",
                   "SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES", "SLURM_SUBMIT_DIR", "SLURM_NODEID", "SLURM_PROCID",
                   "PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
                   "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",  # how each launcher finds the head node
                   "DS_ENV_FILE"}  # how the deepspeed launcher hands the environment to other nodes


@dataclass(frozen=True)
class Launched:
    """What one launch kind of a bundle starts.

    Attributes:
        kind: the launch kind (a key of :data:`KINDS`).
        file: its file in the bundle.
        launcher: the launcher that received the words: torchrun, deepspeed or accelerate.
        nodes: nodes of the job, as the launcher reads its words.
        per_node: processes per node.
        program: the program's words: its script, or ``-m`` and its module, then its arguments.
        env: the environment the launch set for the program (the bundle's path written ``$AUTOPLACE_BUNDLE``).
        stand_ins: required variables the recording filled in (name -> the stand-in value).
        launcher_words: every word the launcher received, its own options first (``accelerate launch
            --config_file ...``: where a framework config reaches the program through its launcher).
    """

    kind: str
    file: str
    launcher: str
    nodes: int
    per_node: int
    program: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    stand_ins: Mapping[str, str] = field(default_factory=dict)
    launcher_words: tuple[str, ...] = ()

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    @property
    def entry(self) -> str:
        """The script or module the program runs."""
        return self.program[1] if self.program[:1] == ("-m",) else self.program[0]

    @property
    def args(self) -> tuple[str, ...]:
        """The words after the script or module."""
        return self.program[2:] if self.program[:1] == ("-m",) else self.program[1:]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "file": self.file, "launcher": self.launcher, "nodes": self.nodes,
                "per_node": self.per_node, "program": list(self.program), "env": dict(self.env),
                "stand_ins": dict(self.stand_ins), "launcher_words": list(self.launcher_words)}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Launched:
        """The Launched :meth:`to_dict` wrote."""
        return cls(**{**doc, "program": tuple(doc["program"]), "launcher_words": tuple(doc.get("launcher_words", ()))})


def kinds_in(bundle: Path) -> list[str]:
    """The launch kinds whose file ``bundle`` holds, in :data:`KINDS` order."""
    return [kind for kind, name in KINDS.items() if (bundle / name).is_file()]


def record(bundle: Path, kind: str, *, extra: Sequence[str] = (), env: Mapping[str, str] | None = None,
           timeout: float = 60.0) -> Launched:
    """Run ``kind``'s launch of ``bundle`` with recording launchers; what its launcher received.

    Args:
        bundle: the bundle directory.
        kind: a launch kind whose file the bundle holds.
        extra: words a user appends to the launch (a script's arguments, a PyTorchJob's ``args``).
        env: the environment the launch starts in (default: this process's, without PYTHONPATH).

    Raises:
        SpecError: no such file, a launch that fails before its launcher runs (its stderr's last
            line), a launch that runs no launcher or more than one, or words the launcher refuses.
    """
    if kind not in KINDS:
        raise SpecError(f"unknown launch kind {kind!r}; valid: {', '.join(KINDS)}", field="kind")
    bundle = bundle.resolve()
    path = bundle / KINDS[kind]
    if not path.is_file():
        raise SpecError(f"no {KINDS[kind]} in the bundle", source=str(bundle))
    base = {k: v for k, v in (os.environ if env is None else env).items() if k != "PYTHONPATH"}
    with tempfile.TemporaryDirectory(prefix="autoplace-launch-") as scratch:
        bin_dir = _stand_ins(Path(scratch))
        base["PATH"] = f"{bin_dir}{os.pathsep}{base.get('PATH', '')}"
        base["AUTOPLACE_RECORD"] = str(Path(scratch) / "record.jsonl")
        if kind == "k8s":
            command, nodes, per_node, pod_env, mount = _pod(path, bundle)
            text = " ".join(command)
        else:
            command, nodes, per_node, pod_env, mount = ["bash", str(path)], 0, 0, {}, None
            text = path.read_text(errors="replace")
            if kind == "slurm":
                nodes = _sbatch_nodes(text)
                pod_env = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": f"node-[0-{nodes - 1}]",
                           "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_SUBMIT_DIR": str(bundle),
                           "AUTOPLACE_SBATCH": str(path)}
        stand_ins = {name: f"<{name}>" for name in _REQUIRED.findall(text) if not base.get(name)}
        # a PyTorchJob's empty env entries are the required values its user fills in
        filled = {k: v for k, v in pod_env.items() if v}
        run_env = {**base, **stand_ins, **filled}
        done = subprocess.run([*command, *extra], env=run_env, cwd=scratch, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
        calls = _calls(Path(base["AUTOPLACE_RECORD"]))
    if done.returncode != 0 and not calls:
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise SpecError(f"the launch stopped before its launcher: {last}", source=str(path))
    if len(calls) != 1:
        raise SpecError(f"expected one launcher call, got {len(calls)}", source=str(path))
    (call,) = calls
    launcher, argv = call["launcher"], call["argv"]
    parsed_nodes, parsed_per_node, program = parse_launcher(launcher, argv, source=str(path))
    # what the launch set: a PyTorchJob's env entries are the launch's too
    given = {k: v for k, v in run_env.items() if k not in filled or kind != "k8s"}
    launch_env = {k: _normal(v, bundle, mount) for k, v in call["env"].items()
                  if k not in _NOT_THE_LAUNCH and given.get(k) != v and not k.startswith(("BASH_FUNC_",))}
    return Launched(kind=kind, file=path.name, launcher=launcher, nodes=nodes or parsed_nodes,
                    per_node=per_node or parsed_per_node,
                    program=tuple(_normal(w, bundle, mount) for w in program), env=launch_env, stand_ins=stand_ins,
                    launcher_words=tuple(_normal(w, bundle, mount) for w in argv))


def record_all(bundle: Path, *, extra: Sequence[str] = (), env: Mapping[str, str] | None = None
               ) -> dict[str, Launched | SpecError]:
    """Every launch kind ``bundle`` holds: what it starts, or why it could not be recorded."""
    out: dict[str, Launched | SpecError] = {}
    for kind in kinds_in(bundle):
        try:
            out[kind] = record(bundle, kind, extra=extra, env=env)
        except SpecError as exc:
            out[kind] = exc
    return out


def disagreements(launched: Mapping[str, Launched]) -> list[str]:
    """Where launch kinds start different jobs: one line per kind that differs from the first kind.

    The job is its geometry, the program's words and the environment the launch set for it.
    Launchers differ in how the program finds its rank, so only variables some kind sets are compared.
    """
    kinds = list(launched)
    if not kinds:
        return []
    ref = launched[kinds[0]]
    lines = []
    for kind in kinds[1:]:
        other = launched[kind]
        if (other.nodes, other.per_node) != (ref.nodes, ref.per_node):
            lines.append(f"{other.file}: {other.nodes} x {other.per_node} processes, {ref.file}: "
                         f"{ref.nodes} x {ref.per_node}")
        if other.program != ref.program:
            lines.append(f"{other.file}: runs {_differ(other.program, ref.program)}, {ref.file}: "
                         f"{_differ(ref.program, other.program)}")
        for name in sorted(set(ref.env) | set(other.env)):
            if ref.env.get(name) != other.env.get(name):
                lines.append(f"{other.file}: {name}={_shown(other.env.get(name))}, {ref.file}: "
                             f"{name}={_shown(ref.env.get(name))}")
    return lines


def parse_launcher(launcher: str, argv: Sequence[str], *, source: str) -> tuple[int, int, tuple[str, ...]]:
    """(nodes, processes per node, program words) from ``launcher``'s own argument parser.

    Raises:
        SpecError: words the launcher's parser refuses (its message), or an unknown launcher.
    """
    try:
        if launcher == "torchrun":
            from torch.distributed.run import get_args_parser

            t = _parsed(get_args_parser(), list(argv))
            head = ("-m", t.training_script) if t.module else (t.training_script,)
            return int(str(t.nnodes).split(":")[-1]), int(t.nproc_per_node), (*head, *t.training_script_args)
        if launcher == "deepspeed":
            with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout as it loads: keep it for --json
                from deepspeed.launcher.runner import parse_args

            d = parse_args(list(argv))
            head = ("-m", d.user_script) if d.module else (d.user_script,)
            return max(d.num_nodes, 1), max(d.num_gpus, 1), (*head, *d.user_args)
        if launcher == "accelerate":
            from accelerate.commands.launch import launch_command_parser

            if argv[:1] != ["launch"]:
                raise SpecError(f"accelerate {' '.join(argv[:1])}: expected accelerate launch", source=source)
            a = _parsed(launch_command_parser(), list(argv[1:]))
            head = ("-m", a.training_script) if a.module else (a.training_script,)
            nodes = int(a.num_machines or 1)
            return nodes, int(a.num_processes or nodes) // nodes, (*head, *a.training_script_args)
    except SystemExit:  # argparse refused the words and printed why
        raise SpecError(f"{launcher} refuses its words: {' '.join(argv)}", source=source) from None
    raise SpecError(f"unknown launcher {launcher!r}", source=source)


def _parsed(parser: Any, argv: list[str]) -> Any:
    """argparse's namespace, its usage message kept off stderr (a refusal raises SystemExit)."""
    import io

    with contextlib.redirect_stderr(io.StringIO()):
        return parser.parse_args(argv)


def _stand_ins(scratch: Path) -> Path:
    bin_dir = scratch / "bin"
    bin_dir.mkdir()
    recorder = _RECORDER.format(python=sys.executable)
    for name, text in {"torchrun": recorder, "deepspeed": recorder, "accelerate": recorder, "srun": _SRUN,
                       "scontrol": _SCONTROL}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _calls(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _sbatch_nodes(text: str) -> int:
    found = re.search(r"^#SBATCH --nodes=(\d+)\s*$", text, re.MULTILINE)
    return int(found.group(1)) if found else 1


def _pod(path: Path, bundle: Path) -> tuple[list[str], int, int, dict[str, str], str | None]:
    """The PyTorchJob's first container: (its command and args, nodes, processes per node, the
    environment it and the training operator give, where it mounts the bundle)."""
    try:
        doc = yaml.safe_load(path.read_text())
        spec = doc["spec"]
        replicas = spec["pytorchReplicaSpecs"]
        container = replicas["Master"]["template"]["spec"]["containers"][0]
        nodes = sum(int(r.get("replicas", 1)) for r in replicas.values())
        per_node = int(spec["nprocPerNode"])
        command = [str(w) for w in container.get("command", [])] + [str(w) for w in container.get("args", [])]
    except (KeyError, IndexError, TypeError, ValueError, yaml.YAMLError) as exc:
        raise SpecError(f"not a PyTorchJob with a Master container: {exc}", source=str(path)) from None
    env = {str(e["name"]): str(e.get("value", "")) for e in container.get("env", []) if "name" in e}
    mounts = [m.get("mountPath") for m in container.get("volumeMounts", []) if m.get("name") == "autoplace-bundle"]
    mount = mounts[0] if mounts else None
    env = {k: str(bundle) if mount and v == mount else v for k, v in env.items()}  # the mount is the bundle
    # the training operator's variables (pkg/controller.v1/pytorch/envvar.go: MASTER_ADDR, MASTER_PORT,
    # WORLD_SIZE and RANK count nodes; PET_* are torchrun's)
    env.update(PET_NNODES=str(nodes), PET_NPROC_PER_NODE=str(per_node), PET_NODE_RANK="0",
               PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT="23456", MASTER_ADDR="127.0.0.1", MASTER_PORT="23456",
               WORLD_SIZE=str(nodes), RANK="0")
    return command, nodes, per_node, env, mount


def _normal(text: str, bundle: Path, mount: str | None) -> str:
    """``text`` with the bundle's directory (or the PyTorchJob's mount of it) written ``$AUTOPLACE_BUNDLE``."""
    for where in (str(bundle), mount):
        if where:
            text = text.replace(where, BUNDLE)
    return text


def _differ(words: tuple[str, ...], other: tuple[str, ...]) -> str:
    """``words`` from where they part from ``other`` (at most 6 words), or all of them."""
    at = next((i for i, (a, b) in enumerate(zip(words, other, strict=False)) if a != b), min(len(words), len(other)))
    tail = " ".join(words[at:at + 6]) or "(nothing more)"
    return ("... " if at else "") + tail + (" ..." if len(words) > at + 6 else "")


def _shown(value: str | None) -> str:
    return "(unset)" if value is None else value
