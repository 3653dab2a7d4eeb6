"""Launch scripts for a plan: torchrun, the deepspeed and accelerate launchers, Slurm sbatch, a
Kubernetes PyTorchJob -- each running the framework's own program (:class:`~autoplace.frameworks.base.Program`:
its entry point, the config it takes, the environment it requires).

Bundles are portable: a script finds the bundle as its own directory (``$(dirname "$0")``; under
Slurm, the submitted script's path as ``scontrol show job`` reports it, since sbatch runs a copy),
so the bundle can be moved or copied to the cluster and run from any working directory.

Every value a user supplied -- the training script, its arguments, the job name, the bundle
directory -- is quoted with :func:`shlex.quote` in shell, reduced to ``[a-z0-9-]`` where a
scheduler directive or a Kubernetes name takes it, and stripped to one printable line in
comments.  A model named ``x"; touch /tmp/pwned #`` runs nothing (tests/test_emit_launch.py).
"""

from __future__ import annotations

import copy
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from autoplace.emit._common import comment_safe, job_slug, launch_geometry
from autoplace.errors import SpecError
from autoplace.plan import Plan
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec


@dataclass(frozen=True)
class Launch:
    """How the job starts.

    Attributes:
        script: the training script every rank runs; None: the framework's own entry point
            (Megatron-LM's pretrain_gpt.py, torchtitan.train, else train.py).
        args: its arguments (each passed as one word).
        job_name: names the job (Slurm, Kubernetes, rendezvous id); default: the model's name.
        bundle_dir: where the emitted configs live on the nodes, exported as AUTOPLACE_BUNDLE;
            the default "." means the directory the launch script is in (found at run time).
        master_port: rendezvous port on the head node.
        image: the container image of the Kubernetes job (it must hold the training script).
        gres: request GPUs from Slurm / Kubernetes; None = unless the cluster's devices are CPUs.
        time_limit: the Slurm job's wall-clock limit (``--time``, Slurm's [D-]HH:MM:SS).
        exclusive: whole nodes for the Slurm job (``--exclusive``); training shares no node.
    """

    script: str | None = None
    args: tuple[str, ...] = ()
    job_name: str | None = None
    bundle_dir: str = "."
    master_port: int = 29500
    image: str = "YOUR_TRAINING_IMAGE"
    gres: bool | None = None
    time_limit: str = "24:00:00"
    exclusive: bool = True

    def __post_init__(self) -> None:
        port = self.master_port
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise SpecError(f"expected a port number 1..65535, got {port!r}", field="master_port")
        if not isinstance(self.args, tuple) or not all(isinstance(a, str) for a in self.args):
            raise SpecError("expected a tuple of strings", field="args")
        if not re.fullmatch(r"(\d+-)?\d+(:\d\d){0,2}", self.time_limit):
            raise SpecError(f"expected Slurm's [D-]HH:MM:SS, got {self.time_limit!r}", field="time_limit")


DEFAULT_LAUNCH = Launch()


Launcher = Callable[[int, int, str, str, str, str], list[str]]

# A required input's explanation goes inside bash's "${VAR:?...}": no character bash would expand or
# take as a quote there (a single quote opens one, even inside the double quotes)
_PLAIN_TEXT = re.compile(r"[^\"'$`\\}]*")


@dataclass(frozen=True)
class Program:
    """How a framework's job starts on every node, after the launcher (torchrun, accelerate, deepspeed).

    Every launch kind (torchrun script, Slurm sbatch, the deepspeed launcher script, accelerate
    launch, the PyTorchJob) runs these same words in the same environment (:func:`job_environment`).

    Attributes:
        words: the program and its arguments as shell words, already quoted (``"${ARGS[@]}"`` stays
            unquoted so bash expands the array; ``"$VAR"`` names a ``required`` input); ``module``
            words start with ``-m``.
        prelude: shell lines run before the launch (``source`` of an argument file).
        env: environment the framework requires, exported with these values (None: unset).
        launcher: the framework's own launcher, when torchrun does not start it: the command's
            lines (continued with ``\\``) for (nodes, GPUs per node, job id, head address, port,
            this node's rank), each given as shell text.
        required: inputs the plan cannot know (a dataset, the model's weights), as environment
            variables the user sets -> what each is.  Every shell launcher stops with
            ``set VAR to WHAT`` when one is unset or empty; the PyTorchJob lists them as empty
            ``env`` entries to fill in.
    """

    words: tuple[str, ...]
    prelude: tuple[str, ...] = ()
    env: Mapping[str, str | None] = field(default_factory=dict)
    launcher: Launcher | None = None
    required: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for var, what in self.required.items():  # autoplace's own text: a programming error, not input
            if not re.fullmatch(r"[A-Z_][A-Z0-9_]*", var) or not _PLAIN_TEXT.fullmatch(what):
                raise ValueError(f"required input {var!r}: {what!r} cannot be stated in bash's ${{VAR:?...}}")


# The model's weights, which the FSDP2 and PEFT scripts load (the plan knows the architecture only).
MODEL_INPUT = ("HF_MODEL", "your Hugging Face model directory or Hub id")


def input_words(flag: str, var: str, launch: Launch) -> tuple[str, ...]:
    """A framework input's words: ``FLAG "$VAR"`` for the framework's own entry point (``VAR`` a
    required input), but for the user's ``--script`` bash's ``${VAR:+FLAG "$VAR"}``: given when set.
    A script of the user's may not read it (a job that only needs the bundle's plan.json), so the
    launch does not stop for it."""
    if launch.script is None:
        return (flag, f'"${var}"')
    return (f'${{{var}:+{flag} "${var}"}}',)


def user_program(launch: Launch) -> tuple[str, ...]:
    """The user's training script and its arguments, quoted, then the script's own ``"$@"``."""
    return (*(shlex.quote(w) for w in (launch.script or "train.py", *launch.args)), '"$@"')


K8S_BUNDLE_MOUNT = "/autoplace/bundle"  # where the PyTorchJob mounts the bundle's ConfigMap


def _job(model: ModelSpec, launch: Launch) -> str:
    return launch.job_name or model.name


def _wants_gpus(cluster: ClusterSpec, launch: Launch) -> bool:
    if launch.gres is not None:
        return launch.gres
    return any(p.gpu.name != "cpu" for p in cluster.pools)


def header(kind: str, plan: Plan, model: ModelSpec, launch: Launch) -> list[str]:
    """Shebang and comments naming the job (one printable line) and the plan."""
    return [
        "#!/usr/bin/env bash",
        f"# {kind} launch generated by autoplace for {comment_safe(_job(model, launch))}",
        f"# plan: {plan.to_string()}",
    ]


# The bundle is the directory this script is in, wherever it was moved and whatever the cwd.
_HERE = 'export AUTOPLACE_BUNDLE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"'
# sbatch runs a copy of the script from Slurm's spool directory: ask Slurm for the submitted path
# (scontrol's Command=), and fall back to the submission directory.
_HERE_SLURM = [
    'script=""',
    'if [ -n "${SLURM_JOB_ID:-}" ]; then',
    '  script=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n \'s/^ *Command=//p\') || true',
    '  while [ -n "$script" ] && [ ! -f "$script" ] && [ "${script% *}" != "$script" ]; do',
    '    script=${script% *}  # Command= may end with the script\'s arguments; a path may hold spaces',
    '  done',
    'fi',
    '[ -n "$script" ] && [ -f "$script" ] || script=${BASH_SOURCE[0]}',
    'if [ -n "${SLURM_JOB_ID:-}" ] && [ "$(basename "$script")" = slurm_script ]; then',
    '  AUTOPLACE_BUNDLE=${SLURM_SUBMIT_DIR:-$PWD}',
    'else',
    '  AUTOPLACE_BUNDLE=$(cd "$(dirname "$script")" && pwd)',
    'fi',
    "export AUTOPLACE_BUNDLE",
]


def bundle_lines(launch: Launch, kind: str) -> list[str]:
    """How a launch kind finds the bundle: the ``--bundle-dir`` given, else its own directory
    (``script``: the launch script's; ``slurm``: the submitted sbatch script's; ``k8s``: the
    ConfigMap's mount, set in the pod's ``env``)."""
    if kind == "k8s":
        return []
    if launch.bundle_dir != Launch.bundle_dir:
        return [f"export AUTOPLACE_BUNDLE={shlex.quote(launch.bundle_dir)}"]
    return _HERE_SLURM if kind == "slurm" else [_HERE]


def job_environment(model: ModelSpec, cluster: ClusterSpec, launch: Launch, program: Program,
                    kind: str = "script") -> list[str]:
    """The shell lines every launch kind runs before its launcher, one list for all of them, so
    each passes the program the same environment: strict mode; the bundle (found as ``kind``
    finds it, :func:`bundle_lines`), the job's name and the bundle on ``PYTHONPATH`` (torchtitan's
    ``custom_import`` of the bundle's model flavor module); NCCL's settings for the fabric on GPU
    clusters; the program's own environment and required inputs, then its prelude."""
    q = shlex.quote
    path = 'export PYTHONPATH="$AUTOPLACE_BUNDLE${PYTHONPATH:+:$PYTHONPATH}"'
    lines = ["set -euo pipefail", *bundle_lines(launch, kind), f"export AUTOPLACE_JOB={q(_job(model, launch))}", path]
    if _wants_gpus(cluster, launch):
        lines += ncclenvironment(cluster)
    return lines + environment(program)


def environment(program: Program) -> list[str]:
    """``export`` (or ``unset``) lines for what the framework requires, a check of every required
    input (bash's ``${VAR:?message}``: unset or empty stops the launch with the message), then
    the bundle's prelude."""
    lines = [f"unset {k}" if v is None else f"export {k}={shlex.quote(v)}" for k, v in program.env.items()]
    lines += [f': "${{{var}:?set {var} to {what}}}"' for var, what in program.required.items()]
    return lines + list(program.prelude)


def _command(program: Program, nodes: int, per_node: int, job_id: str, head: str, port: str,
             node_rank: str) -> list[str]:
    """The launcher's lines and the program's words: torchrun with c10d rendezvous, or the
    framework's own launcher (``job_id``, ``head``, ``port``, ``node_rank``: shell text)."""
    words = f"  {' '.join(program.words)}"
    if program.launcher is not None:
        return [*program.launcher(nodes, per_node, job_id, head, port, node_rank), words]
    return [f"torchrun --nnodes {nodes} --nproc-per-node {per_node} \\",
            f"  --rdzv-backend c10d --rdzv-endpoint {head}:{port} --rdzv-id {job_id} \\", words]


def emit_torchrun(plan: Plan, model: ModelSpec, cluster: ClusterSpec, launch: Launch = DEFAULT_LAUNCH,
                  program: Program | None = None) -> str:
    """A bash script that starts the job (torchrun, c10d rendezvous, or accelerate launch); run it
    on every node.  Other nodes find the head through ``MASTER_ADDR`` (default 127.0.0.1 for one node).
    """
    nodes, per_node = launch_geometry(plan, cluster, "torchrun")
    program = program or Program(user_program(launch))
    lines = header("torchrun" if program.launcher is None else "launcher", plan, model, launch)
    lines += ["# run on every node; set MASTER_ADDR to the first node's address",
              *job_environment(model, cluster, launch, program)]
    command = _command(program, nodes, per_node, shlex.quote(job_slug(_job(model, launch))),
                       '"${MASTER_ADDR:-127.0.0.1}"', f'"${{MASTER_PORT:-{launch.master_port}}}"',
                       '"${NODE_RANK:-${SLURM_NODEID:-0}}"')
    return "\n".join([*lines, "exec " + command[0], *command[1:]]) + "\n"


def emit_slurm(plan: Plan, model: ModelSpec, cluster: ClusterSpec, launch: Launch = DEFAULT_LAUNCH,
               program: Program | None = None) -> str:
    """An sbatch script: one task per node, srun + the framework's launcher with the head node as
    rendezvous (the first name of ``scontrol show hostnames "$SLURM_JOB_NODELIST"``).  The
    script's own arguments (``sbatch job.sbatch ARGS``) reach the program as its ``"$@"``.
    """
    nodes, per_node = launch_geometry(plan, cluster, "slurm")
    program = program or Program(user_program(launch))
    slug = job_slug(_job(model, launch))
    lines = header("Slurm", plan, model, launch)
    lines += [f"#SBATCH --job-name={slug}", f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1",
              f"#SBATCH --time={launch.time_limit}"]
    if launch.exclusive:
        lines.append("#SBATCH --exclusive")
    if _wants_gpus(cluster, launch):
        lines.append(f"#SBATCH --gpus-per-node={per_node}")
    lines += [f"#SBATCH --output={slug}-%j.out", *job_environment(model, cluster, launch, program, "slurm")]
    lines += [
        'nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        "head_node=${nodes%%$'\\n'*}  # the first name (no `| head`: pipefail would see scontrol's SIGPIPE)",
    ]
    if program.launcher is not None:  # a launcher that takes the node's rank: each task expands its own
        lines.append(f'export MASTER_ADDR="$head_node" MASTER_PORT={launch.master_port}')
        command = _command(program, nodes, per_node, '"$SLURM_JOB_ID"', '"$MASTER_ADDR"', '"$MASTER_PORT"',
                           '"$SLURM_NODEID"')
        return "\n".join([*lines, f'srun bash -c {shlex.quote(chr(10).join(command))} {slug} "$@"']) + "\n"
    command = _command(program, nodes, per_node, '"$SLURM_JOB_ID"', '"$head_node"', str(launch.master_port),
                       '"$SLURM_NODEID"')
    return "\n".join([*lines, "srun " + command[0], *command[1:]]) + "\n"


# NCCL settings by the inter-node fabric the cluster file names (its inter_node profile).  Each is a
# default: a value the site already exports wins.  Sources: NCCL environment variables docs
# (NCCL_IB_DISABLE, NCCL_IB_GID_INDEX: RoCE v2 uses GID index 3 on most NICs), PyTorch
# ProcessGroupNCCL (TORCH_NCCL_ASYNC_ERROR_HANDLING=1 tears down on a collective error).
_FABRIC_ENV = {
    "ib": {"NCCL_IB_DISABLE": "0"},
    "roce": {"NCCL_IB_DISABLE": "0", "NCCL_IB_GID_INDEX": "3"},
}


def _nccl_env(cluster: ClusterSpec) -> dict[str, str]:
    names = {p.inter_node.name for p in cluster.pools}
    fabric = "ib" if all(n.startswith("ib") for n in names) else "roce" if all(
        n.startswith("roce") for n in names) else None
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_DEBUG": "WARN", **_FABRIC_ENV.get(fabric or "", {})}


def ncclenvironment(cluster: ClusterSpec) -> list[str]:
    """``export`` lines for NCCL on the cluster's inter-node fabric (InfiniBand, RoCE, or sockets)."""
    names = sorted({p.inter_node.name for p in cluster.pools})
    lines = [f"# NCCL for {', '.join(names)} (set NCCL_SOCKET_IFNAME / NCCL_IB_HCA for your site)"]
    return lines + [f'export {k}="${{{k}:-{v}}}"' for k, v in _nccl_env(cluster).items()]


def exported_names(cluster: ClusterSpec, launch: Launch, program: Program) -> list[str]:
    """The variables :func:`job_environment` exports, for a launcher that starts the program on
    other hosts without them (the deepspeed launcher over pdsh)."""
    names = ["AUTOPLACE_BUNDLE", "AUTOPLACE_JOB", "PYTHONPATH"]
    if _wants_gpus(cluster, launch):
        names += list(_nccl_env(cluster))
    return names + [k for k, v in program.env.items() if v is not None] + list(program.required)


def emit_k8s(plan: Plan, model: ModelSpec, cluster: ClusterSpec, launch: Launch = DEFAULT_LAUNCH,
             program: Program | None = None) -> dict[str, Any]:
    """A Kubeflow PyTorchJob (kubeflow.org/v1): one Master pod and nodes - 1 Worker pods.

    The pod runs ``bash -c SCRIPT NAME``: the same environment as every other launch kind
    (:func:`job_environment`, the bundle at the ConfigMap's mount), then the launcher and the
    program's words.  The training operator passes nnodes, node rank and the master address to
    torchrun through ``PET_*`` variables and ``spec.nprocPerNode`` (and ``MASTER_ADDR``,
    ``MASTER_PORT``, the node's ``RANK`` to a framework's own launcher).  Kubernetes appends a
    container's ``args`` to its command, where the script takes them as ``"$@"``.  The program's
    required inputs are empty ``env`` entries to fill in; left empty, the pod stops naming them.
    """
    nodes, per_node = launch_geometry(plan, cluster, "k8s")
    program = program or Program(user_program(launch))
    name = job_slug(_job(model, launch))
    configmap = job_slug(f"{name}-bundle")
    mount = K8S_BUNDLE_MOUNT if launch.bundle_dir == Launch.bundle_dir else launch.bundle_dir
    container: dict[str, Any] = {
        "name": "pytorch",  # the operator looks for this container name
        "image": launch.image,
        "command": ["bash", "-c", "\n".join(k8s_script(model, cluster, launch, program, nodes, per_node)), name],
        "env": [{"name": "AUTOPLACE_BUNDLE", "value": mount},
                *({"name": var, "value": ""} for var in program.required)],
        "volumeMounts": [{"name": "autoplace-bundle", "mountPath": mount, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if _wants_gpus(cluster, launch):
        container["resources"] = {"limits": {"nvidia.com/gpu": per_node}}
    # The bundle as a ConfigMap (kubectl create configmap NAME --from-file=BUNDLE); /dev/shm as
    # memory: the container runtime's 64 MiB default is too small for NCCL and DataLoader workers.
    volumes = [{"name": "autoplace-bundle", "configMap": {"name": configmap}},
               {"name": "dshm", "emptyDir": {"medium": "Memory"}}]

    def replica(count: int) -> dict[str, Any]:  # a fresh copy each: no YAML anchors in the manifest
        return {"replicas": count, "restartPolicy": "OnFailure",
                "template": {"spec": {"containers": [copy.deepcopy(container)], "volumes": copy.deepcopy(volumes)}}}

    specs: dict[str, Any] = {"Master": replica(1)}
    if nodes > 1:
        specs["Worker"] = replica(nodes - 1)
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/created-by": "autoplace"},
                         "annotations": {"autoplace/bundle": f"kubectl create configmap {configmap} --from-file=."}},
            "spec": {"nprocPerNode": str(per_node), "pytorchReplicaSpecs": specs}}


class _ManifestDumper(yaml.SafeDumper):
    """YAML with multi-line strings (the pod's script) as literal blocks, line for line."""


_ManifestDumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def manifest_yaml(doc: dict[str, Any]) -> str:
    """A PyTorchJob (:func:`emit_k8s`) as YAML, its script readable as written."""
    return yaml.dump(doc, Dumper=_ManifestDumper, sort_keys=False)


def k8s_script(model: ModelSpec, cluster: ClusterSpec, launch: Launch, program: Program, nodes: int,
               per_node: int) -> list[str]:
    """The pod's script: the shared environment, then torchrun (its geometry from the operator's
    ``PET_*`` variables) or the framework's launcher with the operator's head and node rank."""
    lines = job_environment(model, cluster, launch, program, "k8s")
    if program.launcher is None:
        return [*lines, "exec torchrun " + " ".join(program.words)]
    command = _command(program, nodes, per_node, shlex.quote(job_slug(_job(model, launch))), '"$MASTER_ADDR"',
                       '"$MASTER_PORT"', '"${PET_NODE_RANK:-${RANK:-0}}"')
    return [*lines, "exec " + command[0], *command[1:]]


def bash_array(name: str, words: list[str], what: str) -> str:
    """A sourceable bash array of ``words``, one flag and its values per line, every word quoted.

    An array, not a plain list: ``$(cat file)`` would glob-expand values such as Megatron's
    layout ``Et*9|t*11`` or ``[0,1,1]``.
    """
    lines = [f"# {what} generated by autoplace", f"{name}=("]
    current: list[str] = []
    for word in words:
        if word.startswith("--") and current:
            lines.append("  " + " ".join(current))
            current = []
        current.append(shlex.quote(word))
    if current:
        lines.append("  " + " ".join(current))
    return "\n".join([*lines, ")"]) + "\n"
