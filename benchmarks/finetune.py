"""Fine-tuning (LoRA, QLoRA) against published figures and PEFT's own parameter counts (issue 28).

    PYTHONPATH=. python benchmarks/finetune.py            # both tables
    PYTHONPATH=. python benchmarks/finetune.py --no-peft  # the published figures only

The published figures, their sources and the models behind them are tests/reference/finetune.yaml's
(checked with tolerances in tests/test_lora_published.py); the PEFT counts are
autoplace.fidelity.peft_count's on each tests/data/hf family cut to its first dense layers and two
more (tests/test_lora_peft.py), beside autoplace's count for the whole model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from autoplace.cost.layers import layer_table  # noqa: E402
from autoplace.evaluation import Evaluation, evaluate  # noqa: E402
from autoplace.plan import build_plan, parse_plan_string  # noqa: E402
from autoplace.specs.cluster import ClusterSpec, cluster_from_dict, cluster_from_flags  # noqa: E402
from autoplace.specs.model import TransformerSpec, model_from_dict, with_overrides  # noqa: E402

GB = 1e9
REF = yaml.safe_load((REPO / "tests" / "reference" / "finetune.yaml").read_text())
ONE_GPU = "dp=1,mbs=1,recompute=full"


def model(name: str, method: str | None = None) -> TransformerSpec:
    data = REF["models"][name]
    spec = model_from_dict({**data, "training": {**data["training"], **(REF["methods"][method] if method else {})}})
    assert isinstance(spec, TransformerSpec)
    return spec


def one_gpu(memory_GB: float | None = None) -> ClusterSpec:
    """One l40s-48gb, or that GPU with ``memory_GB``."""
    gpu: Any = "l40s-48gb"
    if memory_GB is not None:
        gpu = yaml.safe_load((REPO / "hardware_profiles" / "gpu" / "l40s-48gb.yaml").read_text())
        gpu.pop("aliases", None)
        gpu.update(name=f"l40s-{memory_GB:g}gb", memory_GiB=memory_GB * GB / 2**30)
    return cluster_from_dict({"name": "one", "nodes": 1, "gpus_per_node": 1, "gpu": gpu, "intra_node": "pcie4",
                              "inter_node": "pcie4"})


def score(spec: TransformerSpec, cluster: ClusterSpec, plan: str) -> Evaluation:
    p = build_plan(parse_plan_string(plan), world=cluster.gpus, blocks=layer_table(spec).blocks,
                   global_batch=spec.training.global_batch, gpus_per_node=cluster.gpus_per_node)
    return evaluate(spec, cluster, p)


def states(ev: Evaluation) -> float:
    mem = ev.to_dict()["memory_per_device_bytes"]
    return float(mem["params"] + mem["grads"] + mem["optimizer"])


def published() -> Table:
    fig = REF["figures"]
    table = Table(title="Fine-tuning memory: published vs autoplace")
    for col in ("figure", "source", "published", "autoplace", "verdict"):
        table.add_column(col)
    for label, spec, gb in (("QLoRA LLaMA-65B, one GPU", model("llama-65b", "qlora-guanaco"), fig["qlora_65b_gpu_GB"]),
                            ("QLoRA LLaMA-33B, one GPU", model("llama-33b", "qlora-guanaco"), fig["qlora_33b_gpu_GB"])):
        ev = score(spec, one_gpu(gb), ONE_GPU)
        mem = ev.to_dict()["memory_per_device_bytes"]
        table.add_row(label, "Dettmers et al. 2023, abstract / Sec. 1", f"fits {gb} GB",
                      f"{mem['total'] / 2**30:.1f} of {mem['capacity'] / 2**30:.1f} GiB, "
                      f"{ev.step_time_s:.1f} s/step (mbs 1)", "fits" if ev.fits else "does not fit")
    lora, plan = model("gpt-3-175b", "lora-gpt3"), "tp=8,mbs=1,recompute=full"
    eight = cluster_from_flags("a100-sxm4-80gb", 1)
    tuned, full = 8 * states(score(lora, eight, plan)), 8 * states(score(model("gpt-3-175b"), eight, plan))
    t = layer_table(lora)
    src = "Hu et al. 2021, Sec. 4.2"
    rows = (("GPT-3 175B LoRA r=4 q,v: training memory", fig["gpt3_lora_training_bytes"], tuned, "model states"),
            ("GPT-3 175B full fine-tuning memory", fig["gpt3_full_training_bytes"], full, "16 B/param; paper's accounting not given"),
            ("GPT-3 175B LoRA checkpoint", fig["gpt3_lora_checkpoint_bytes"], 2 * t.trainable, "fp16 adapters"),
            ("GPT-3 175B base checkpoint", fig["gpt3_checkpoint_bytes"], 2 * t.params, "fp16"))
    for label, pub, pred, note in rows:
        table.add_row(label, src, f"{pub / GB:,.3f} GB", f"{pred / GB:,.3f} GB ({note})", f"{100 * (pred / pub - 1):+.1f}%")
    return table


def peft_counts() -> Table:
    from autoplace.fidelity.peft_count import cut, peft_trainable

    table = Table(title="LoRA trainable parameters (r = 16, q,k,v,o,gate,up,down): autoplace vs PEFT")
    for col in ("family", "autoplace, whole model", "layers built", "autoplace", "PEFT", "equal"):
        table.add_column(col, justify="right")
    for path in sorted((REPO / "tests" / "data" / "hf").glob("*.json")):
        config = json.loads(path.read_text())
        whole, part = (with_overrides(model_from_dict(c, source=path.name), {"method": "lora"}, source=path.name)
                       for c in (config, cut(config)))
        assert isinstance(part, TransformerSpec)
        ours, theirs = layer_table(part).trainable, peft_trainable(cut(config), part)
        table.add_row(path.stem, f"{layer_table(whole).trainable:,.0f}", str(part.layers), f"{ours:,.0f}",
                      f"{theirs:,}", "yes" if ours == theirs else "[red]no[/red]")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-peft", action="store_true", help="skip the PEFT table (builds every family on meta)")
    args = parser.parse_args()
    console = Console(width=160)
    console.print(published())
    if not args.no_peft:
        console.print(peft_counts())


if __name__ == "__main__":
    main()
