"""Fine-tuning on the command line and in planning (issue 28): --method and the LoRA options reach
the spec, bad ones are one line and exit 2, scale names the fewest GPUs that fine-tune the model,
and the batch advice does not apply pre-training's critical batch to fine-tuning."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from autoplace.cli import app
from autoplace.planning import advise_batch

# LLaMA 65B (Touvron et al. 2023, Table 2), QLoRA's fine-tuning lengths (512-token targets)
LLAMA_65B = {"name": "llama-65b", "layers": 80, "hidden": 8192, "ffn_hidden": 22016, "heads": 64, "vocab": 32000,
             "seq_len": 512, "training": {"global_batch": 16}}


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def model_file(tmp_path: Path) -> str:
    path = tmp_path / "llama-65b.json"
    path.write_text(json.dumps(LLAMA_65B))
    return str(path)


def test_fine_tuning_gets_no_critical_batch_from_pretraining_fits() -> None:
    tuned = advise_batch(16, 512, non_embedding_params=64.8e9, method="qlora")
    assert not tuned.applies and not tuned.over and tuned.advised_batch == 16
    assert "fine-tuning (qlora)" in tuned.lines()[0] and "taken as given" in tuned.lines()[1]
    # a measured noise scale applies to any training (McCandlish et al. 2018)
    measured = advise_batch(16, 512, non_embedding_params=64.8e9, method="lora", noise_scale_tokens=4096)
    assert measured.applies and measured.over
    assert advise_batch(16, 512, non_embedding_params=64.8e9).applies  # pre-training as before


def test_qlora_65b_solves_on_one_48gb_gpu(tmp_path: Path) -> None:
    out = invoke("solve", model_file(tmp_path), "--gpu", "l40s", "--gpus-per-node", "1", "--method", "qlora",
                 "--lora-rank", "64", "--lora-alpha", "16", "--paged-optimizer", "--deny", "offload",
                 "--framework", "none", "--top", "1", "--time-limit", "5", "--json")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["status"] in ("optimal", "feasible") and doc["plans"][0]["degrees"]["dp"] == 1


def test_scale_names_the_fewest_gpus_for_the_method(tmp_path: Path) -> None:
    model = model_file(tmp_path)
    common = ("--gpu", "l40s", "--gpus", "1,2", "--time-limit", "1", "--deny", "offload", "--json")
    qlora = json.loads(invoke("scale", model, "--method", "qlora", "--lora-rank", "64", *common).stdout)
    assert (qlora["method"], qlora["fewest_gpus"]) == ("qlora", 2)  # adapters' Adam states overflow one GPU
    paged = json.loads(invoke("scale", model, "--method", "qlora", "--lora-rank", "64", "--paged-optimizer",
                              *common).stdout)
    assert paged["fewest_gpus"] == 1
    full = json.loads(invoke("scale", model, *common).stdout)
    assert (full["method"], full["fewest_gpus"]) == ("full", None)  # 1 TB of model states


def test_bad_fine_tuning_options_are_one_line(tmp_path: Path) -> None:
    model = model_file(tmp_path)
    cases = [(["--lora-rank", "8"], "--lora-rank: LoRA settings need method lora or qlora"),
             (["--method", "lora", "--lora-targets", "q,x"], "--lora-targets"),
             (["--method", "lora", "--lora-targets", ","], "names no projection"),
             (["--method", "dora"], "dora")]
    for extra, message in cases:
        out = invoke("evaluate", model, "--gpu", "l40s", "--plan", "dp=1,mbs=1", *extra)
        assert out.exit_code == 2 and message in out.output and "Traceback" not in out.output, out.output


def test_peft_runners_refuse_parallelism_their_script_does_not_set_up() -> None:
    """peft_train.py trains the Hugging Face model data parallel (under ZeRO or FSDP2): a LoRA plan with
    tensor, context or pipeline parallelism is not runnable by its bundle, and the line names the degree."""
    from autoplace import frameworks
    from tests.test_emit_plans import CLUSTER16, MODEL, make_plan

    lora = MODEL.model_copy(update={"training": MODEL.training.model_copy(update={"method": "lora"})})
    cases = [("deepspeed", "pp=2,zero=1", "pp=2"), ("deepspeed", "tp=2,sp=false,zero=3", "tp=2"),
             ("accelerate", "cp=2,zero=3", "cp=2"), ("accelerate", "tp=2,sp=false,zero=3", "tp=2")]
    for name, text, degree in cases:
        framework = frameworks.get(name)
        plan = make_plan(text, lora, CLUSTER16)
        assert framework.refusal(plan, MODEL) is None, (name, text)  # full training runs it
        why = framework.refusal(plan, lora)
        assert why is not None and why.startswith(f"{name}: {degree} with LoRA/QLoRA: peft_train.py"), why
        assert framework.config_check(lora)(plan) == why  # the search judges configurations by the same line
