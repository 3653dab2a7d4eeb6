"""Every launch kind of a bundle starts the same job (issue 34): the torchrun script, the Slurm batch
script, the deepspeed and accelerate launcher scripts and the PyTorchJob's container command, each run by
bash with recording launchers (:mod:`autoplace.dryrun.launches`), whose own argument parsers split the
words into the geometry and the program.  Every kind passes the program the same words (a user's extra
words too) and the same environment, and stops the same way when a required input is missing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from autoplace.bundle import emit
from autoplace.dryrun.launches import BUNDLE, Launched, disagreements, record_all
from autoplace.emit.launch import Launch
from autoplace.specs.model import ModelSpec
from tests.test_emit_launch import fake_bin
from tests.test_emit_plans import CLUSTER16, MODEL, make_plan
from tests.test_lora_train_script import script_function

pytest.importorskip("torch")
EXTRA = ("--extra", "two words")


def _tuned(method: str) -> ModelSpec:
    return MODEL.model_copy(update={"training": MODEL.training.model_copy(update={"method": method})})


# (framework, method, plan, the launch kinds its bundle holds besides torchrun, slurm and k8s)
CASES = [("megatron", "full", "tp=2,pp=2,zero=1", ()), ("megatron", "full", "tp=2,zero=3", ()),
         ("torchtitan", "full", "tp=2,pp=2,zero=3", ()), ("fsdp", "full", "zero=3", ()),
         ("deepspeed", "full", "zero=3", ("deepspeed",)), ("deepspeed", "lora", "zero=3", ("deepspeed",)),
         ("accelerate", "full", "zero=3", ("accelerate",)), ("accelerate", "qlora", "zero=2", ("accelerate",))]


def bundle_of(framework: str, method: str, plan: str, out: Path, launch: Launch | None = None) -> Path:
    model = _tuned(method)
    emit(make_plan(plan, model, CLUSTER16), model, CLUSTER16, [framework, "torchrun", "slurm", "k8s"], out,
         launch=launch)
    return out


@pytest.mark.parametrize(("framework", "method", "plan", "own"), CASES)
def test_every_launch_kind_starts_the_same_program_in_the_same_environment(
        framework: str, method: str, plan: str, own: tuple[str, ...], tmp_path) -> None:
    bundle = bundle_of(framework, method, plan, tmp_path / "b")
    launched = record_all(bundle, extra=EXTRA)
    assert set(launched) == {"torchrun", "slurm", "k8s", *own}
    failed = {kind: str(v) for kind, v in launched.items() if not isinstance(v, Launched)}
    assert failed == {}
    ok = {kind: v for kind, v in launched.items() if isinstance(v, Launched)}
    assert disagreements(ok) == []
    for kind, job in ok.items():
        assert (job.nodes, job.per_node) == (2, 8), kind
        assert job.program[-2:] == EXTRA, kind  # sbatch's and the pod's arguments reach the program as "$@"
        assert job.env["PYTHONPATH"] == BUNDLE and job.env["AUTOPLACE_BUNDLE"] == BUNDLE, kind
    _the_framework_reads(framework, method, ok["k8s"], bundle)


def _the_framework_reads(framework: str, method: str, job: Launched, bundle: Path) -> None:
    """The program's words, as the program's own parser reads them, name the bundle's config."""
    if method != "full":  # the bundle's PEFT script, given the framework's config
        args = script_function((bundle / "peft_train.py").read_text(), "parse_args")(list(job.args[:-len(EXTRA)]))
        config = args.deepspeed_config or args.accelerate_config
        assert config.replace(BUNDLE, str(bundle)) == str(bundle / {"deepspeed": "ds_config.json",
                                                                      "accelerate": "accelerate_config.yaml"}[framework])
        assert args.model == "<HF_MODEL>"  # a required input: the stand-in the recording filled in
    elif framework == "deepspeed":
        import argparse

        import deepspeed

        parsed = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_known_args(list(job.args))[0]
        assert parsed.deepspeed and parsed.deepspeed_config == f"{BUNDLE}/ds_config.json"
    elif framework == "fsdp":
        assert job.args[job.args.index("--model") + 1] == "<HF_MODEL>"
    elif framework == "megatron":
        assert job.args[job.args.index("--data-path") + 1] == "<DATA_PATH>"
    elif framework == "torchtitan":
        assert job.args[job.args.index("--model.hf_assets_path") + 1] == "<HF_ASSETS_PATH>"


def _run_kind(bundle: Path, kind: str, bin_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run one launch kind of ``bundle`` as bash runs it (the pod's command with its env entries)."""
    full = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD_TO": str(bin_dir / "record.jsonl"),
            **env}
    if kind == "pytorchjob.yaml":
        doc = yaml.safe_load((bundle / kind).read_text())
        (container,) = doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
        command = container["command"]
        # the manifest's env entries, the required ones filled in with what the user gives
        full.update({e["name"]: env.get(e["name"], e["value"]) for e in container["env"]})
        full["AUTOPLACE_BUNDLE"] = str(bundle)
    else:
        command = ["bash", str(bundle / kind)]
    return subprocess.run(command, env=full, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize(("framework", "variable"), [("fsdp", "HF_MODEL"), ("megatron", "DATA_PATH"),
                                                     ("torchtitan", "HF_ASSETS_PATH")])
def test_a_missing_required_input_stops_every_launch_kind_naming_it(framework: str, variable: str, tmp_path) -> None:
    """Unset, or left empty in the PyTorchJob's env entry, a value the plan cannot know stops the launch
    before its launcher, with the variable's name and what to set it to."""
    bundle = bundle_of(framework, "full", "zero=3" if framework != "megatron" else "tp=2,zero=1", tmp_path / "b")
    job = yaml.safe_load((bundle / "pytorchjob.yaml").read_text())
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert {"name": variable, "value": ""} in container["env"]
    given = {"DATA_PATH": "/d", "TOKENIZER_MODEL": "/t", "CHECKPOINT_DIR": "/c", "TRAIN_ITERS": "1",
             "HF_MODEL": "/m", "HF_ASSETS_PATH": "/a", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node-[a-b]"}
    bin_dir = fake_bin(tmp_path)
    for kind in ("launch_torchrun.sh", "job.sbatch", "pytorchjob.yaml"):
        assert _run_kind(bundle, kind, bin_dir, given).returncode == 0, kind
        env = {k: v for k, v in given.items() if k != variable}
        done = _run_kind(bundle, kind, bin_dir, env)
        assert done.returncode != 0 and f"{variable}: set {variable} to " in done.stderr, (kind, done.stderr)


@pytest.mark.parametrize(("framework", "variable", "flag"), [("megatron", "DATA_PATH", "--data-path"),
                                                             ("torchtitan", "HF_ASSETS_PATH", "--model.hf_assets_path")])
def test_a_users_script_gets_the_frameworks_inputs_when_set_and_runs_without_them(
        framework: str, variable: str, flag: str, tmp_path) -> None:
    """``--script`` runs the user's program in the framework's place: it may need none of the inputs the
    framework's own entry point requires (a job that reads only plan.json), so no launch kind stops for
    them; one that is set reaches the script as the framework's flag."""
    plan = "tp=2,zero=1" if framework == "megatron" else "zero=3"
    bundle = bundle_of(framework, "full", plan, tmp_path / "b", Launch(script="mine.py"))
    job = yaml.safe_load((bundle / "pytorchjob.yaml").read_text())
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert variable not in {e["name"] for e in container["env"]}
    bin_dir = fake_bin(tmp_path)
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node-[a-b]"}
    for kind in ("launch_torchrun.sh", "job.sbatch", "pytorchjob.yaml"):
        record = bin_dir / "record.jsonl"
        for given in ({}, {variable: "/in put"}):
            record.unlink(missing_ok=True)
            done = _run_kind(bundle, kind, bin_dir, {**env, **given})
            assert done.returncode == 0, (kind, done.stderr)
            words = record.read_text()
            assert "mine.py" in words and (flag in words) == bool(given), (kind, given, words)
            assert not given or '"/in put"' in words, words  # one word, as set


def test_the_deepspeed_launcher_hands_other_nodes_the_launch_environment(tmp_path) -> None:
    """Over pdsh the deepspeed launcher exports on other nodes only NCCL*/PYTHON* variables and those
    DS_ENV_FILE lists: the launch lists its environment there, and DeepSpeed's own export line (its
    PDSHRunner.add_export) gives a remote bash the values the launch set, user text included."""
    from deepspeed.launcher.multinode_runner import PDSHRunner

    evil = str(tmp_path / 'b "dir" $(touch pwned) `x` \\n;')
    bundle = bundle_of("deepspeed", "lora", "zero=3", Path(evil), Launch(job_name='job "x" $HOME'))
    env = {"HF_MODEL": "/models/a `b` $x"}
    recorder = tmp_path / "bin" / "deepspeed"
    fake_bin(tmp_path)
    recorder.write_text('#!/usr/bin/env bash\ncp "$DS_ENV_FILE" "$RECORD_TO"\n')
    done = subprocess.run(["bash", str(bundle / "launch_deepspeed.sh")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
                               "RECORD_TO": str(tmp_path / "env")})
    assert done.returncode == 0, done.stderr
    runner = PDSHRunner(SimpleNamespace(user_args=[], user_script="x.py"), "")
    for line in (tmp_path / "env").read_text().splitlines():  # as deepspeed/launcher/runner.py reads the file
        key, value = line.split("=", maxsplit=1)
        runner.add_export(key, value)
    exports = "".join(f"export {k}={v}; " for k, v in runner.exports.items())  # PDSHRunner.get_cmd's line
    names = list(runner.exports)
    remote = subprocess.run(["bash", "-c", exports + 'for n in "$@"; do printf "%s=%s\\0" "$n" "${!n}"; done', "x",
                             *names], capture_output=True, text=True, env={"PATH": os.environ["PATH"]}, timeout=30,
                            cwd=tmp_path)
    got = dict(item.split("=", 1) for item in remote.stdout.split("\0") if item)
    expected: dict[str, Any] = {"AUTOPLACE_BUNDLE": evil, "AUTOPLACE_JOB": 'job "x" $HOME', **env,
                                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert {k: got.get(k) for k in expected} == expected
    assert got["PYTHONPATH"].split(":")[0] == evil
    assert not (tmp_path / "pwned").exists()
