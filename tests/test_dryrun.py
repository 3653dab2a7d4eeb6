"""``autoplace dryrun``: the bundle read back, its launches recorded as bash runs them, one line for bad input.

Each framework's own build is tested with its module (tests/test_dryrun_<framework>.py); here, what
every dry run shares: the launch recorder (the launcher's own parser splits its words), where launch
kinds or edited files disagree, and the command's errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autoplace.cli import app
from autoplace.dryrun.bundle import edits, read_bundle
from autoplace.dryrun.launches import BUNDLE, disagreements, record
from autoplace.frameworks.megatron import emit_megatron
from tests.dryrun_bundles import write_test_bundle
from tests.helpers import REPO

pytest.importorskip("torch")
TINY = REPO / "examples" / "models" / "tiny-llama.json"
CLUSTER = "2x8xa100-sxm4-80gb"


@pytest.fixture(scope="module")
def megatron_bundle(tmp_path_factory) -> Path:
    return write_test_bundle(tmp_path_factory.mktemp("mt") / "b", TINY, CLUSTER, "tp=2,pp=2,zero=1", "megatron")


def test_the_torchrun_launch_hands_pretrain_gpt_the_arguments_file(megatron_bundle: Path) -> None:
    """bash runs launch_torchrun.sh; torchrun's own parser splits the recorder's words into the
    geometry and the program: pretrain_gpt.py with the bash array's words, then the user's."""
    bundle = read_bundle(megatron_bundle)
    launched = record(megatron_bundle, "torchrun", extra=["--lr", "1e-4"])
    assert (launched.nodes, launched.per_node, launched.entry) == (2, 8, "pretrain_gpt.py")
    words = emit_megatron(bundle.plan, bundle.model, bundle.cluster)
    assert list(launched.args[:len(words)]) == words
    assert launched.args[-2:] == ("--lr", "1e-4")
    assert launched.env["PYTHONPATH"] == BUNDLE and launched.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert {"DATA_PATH", "CHECKPOINT_DIR"} <= set(launched.stand_ins)  # required, filled with stand-ins
    assert launched.args[launched.args.index("--data-path") + 1] == "<DATA_PATH>"


def test_a_launch_edited_to_differ_is_named(megatron_bundle: Path, tmp_path) -> None:
    copy = tmp_path / "b"
    copy.mkdir()
    for f in megatron_bundle.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
        (copy / f.name).chmod(f.stat().st_mode)
    sbatch = copy / "job.sbatch"
    sbatch.write_text(sbatch.read_text().replace("pretrain_gpt.py", "pretrain_gpt.py --seed 7"))
    lines = disagreements({k: record(copy, k) for k in ("torchrun", "slurm")})
    assert [line for line in lines if " runs " in line] == [
        "job.sbatch: runs ... --seed 7 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 ..., "
        "launch_torchrun.sh: ... --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
        "--context-parallel-size 1 ..."]


def test_an_edited_config_is_listed_against_plan_json(tmp_path) -> None:
    model = json.loads(TINY.read_text())
    model["training"]["global_batch"] = 64
    bundle = write_test_bundle(tmp_path / "b", model, "1x8xa100-sxm4-80gb", "zero=2,mbs=1", "deepspeed")
    assert edits(read_bundle(bundle)) == []
    config = json.loads((bundle / "ds_config.json").read_text())
    config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"] = 2, \
        config["gradient_accumulation_steps"] // 2
    (bundle / "ds_config.json").write_text(json.dumps(config))
    lines = edits(read_bundle(bundle))
    assert "ds_config.json: mbs=2, plan.json: mbs=1" in lines


@pytest.mark.parametrize(("setup", "message"), [
    (lambda p: None, "no plan.json: not an autoplace bundle"),
    (lambda p: (p / "plan.json").write_text("[1]"), "plan.json: expected a JSON object"),
    (lambda p: (p / "plan.json").write_text(json.dumps({"degrees": {}})), "inputs: expected {model: PATH"),
])
def test_what_is_no_bundle_is_one_line_and_exit_2(setup, message: str, tmp_path) -> None:
    setup(tmp_path)
    result = CliRunner().invoke(app, ["dryrun", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and message in result.output


def test_a_launch_that_stops_before_its_launcher_fails_the_dry_run(megatron_bundle: Path, tmp_path) -> None:
    copy = tmp_path / "b"
    copy.mkdir()
    for f in megatron_bundle.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    script = copy / "launch_torchrun.sh"
    script.write_text(script.read_text().replace("exec torchrun", 'echo "no such cluster" >&2; exit 3\nexec torchrun'))
    result = CliRunner().invoke(app, ["dryrun", str(copy)])
    assert result.exit_code == 1
    assert "the launch stopped before its launcher: no such cluster" in result.output


def test_a_rank_outside_the_world_is_refused(megatron_bundle: Path) -> None:
    result = CliRunner().invoke(app, ["dryrun", str(megatron_bundle), "--rank", "16"])
    assert result.exit_code == 2 and "--rank: rank 16 is outside the launch's world of 16 ranks" in result.output
