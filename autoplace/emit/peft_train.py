"""A LoRA / QLoRA fine-tuning script for a plan: Hugging Face model + PEFT adapters, run by accelerate.

The script is what people fine-tune with: ``AutoModelForCausalLM`` loads the base weights
(QLoRA: through bitsandbytes' ``BitsAndBytesConfig``, 4-bit NF4 with double quantization and
the compute dtype for the matmuls, as Dettmers et al. 2023 and the transformers docs do), PEFT's
``LoraConfig`` adds the adapters (rank, alpha and ``target_modules`` from the model's spec, the
module names of its family: :mod:`autoplace.specs.lora`), and ``accelerate.Accelerator`` runs
it with the plan's micro-batch and accumulation under the framework config the plan was costed
with, which every launch kind hands it (``--deepspeed_config ds_config.json``: accelerate's
DeepSpeed plugin; ``--accelerate_config accelerate_config.yaml``: its FSDP plugin and
ParallelismConfig) -- built from the file, so the placement does not depend on which launcher
(torchrun, the deepspeed launcher, accelerate launch) started it.  Under ZeRO-Offload it steps
with DeepSpeed's CPU Adam (DeepSpeed refuses another optimizer there).  For sharded 4-bit weights (FSDP, ZeRO-3) the
packed weights are stored in the compute dtype (``bnb_4bit_quant_storage``) so every rank's
flat shard has one dtype (the transformers "FSDP-QLoRA" recipe).

The script's configuration is plain functions (``lora_config()``, ``quantization_config()``)
above a ``__main__`` guard, so a test can execute it without training.  ``lora_dropout`` is 0:
a dropout on the adapter input keeps a second copy of every adapted projection's input, which
the cost model does not count.
"""

from __future__ import annotations

from autoplace.emit._common import training_dtype
from autoplace.errors import EmitError
from autoplace.plan import Plan
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.lora import target_modules
from autoplace.specs.model import ModelSpec, TransformerSpec

_TORCH_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}

_TEMPLATE = '''\
\"\"\"Fine-tune {name} with {method_title} (written by autoplace for the plan below).

plan: {plan}
cluster: {cluster}
The bundle's launch scripts run it with the framework config the plan was costed with, e.g.
    torchrun --nproc-per-node N peft_train.py --deepspeed_config ds_config.json --model MODEL_DIR_OR_HUB_ID
    accelerate launch --config_file accelerate_config.yaml peft_train.py \\\\
        --accelerate_config accelerate_config.yaml --model MODEL_DIR_OR_HUB_ID --data corpus.txt
It builds its Accelerator from that file, whichever launcher starts it.
\"\"\"

import argparse

import torch
import torch.distributed as dist
import yaml
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

METHOD = {method!r}
SEQ_LEN = {seq_len}
MICRO_BATCH = {mbs}  # sequences per device per micro-batch
GRAD_ACCUM = {ga}  # micro-batches per optimizer step
GRADIENT_CHECKPOINTING = {checkpointing}
PAGED_OPTIMIZER = {paged}
COMPUTE_DTYPE = {dtype}
LORA_RANK = {rank}
LORA_ALPHA = {alpha}
TARGET_MODULES = {targets!r}


def lora_config():
    \"\"\"The adapters: rank, alpha and the projections autoplace costed.\"\"\"
    return LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=TARGET_MODULES, lora_dropout=0.0,
                      bias="none", task_type="CAUSAL_LM")


def quantization_config():
    \"\"\"QLoRA's 4-bit NF4 base with double-quantized constants; None for LoRA (a 16-bit base).\"\"\"
    if METHOD != "qlora":
        return None
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=COMPUTE_DTYPE, bnb_4bit_quant_storage=COMPUTE_DTYPE)


def build_model(model_id, checkpointing=GRADIENT_CHECKPOINTING):
    \"\"\"The frozen base with its adapters; only the adapters require gradients.  ``checkpointing``:
    Hugging Face's gradient checkpointing (off when accelerate's FSDP checkpoints the blocks).\"\"\"
    model = AutoModelForCausalLM.from_pretrained(model_id, dtype=COMPUTE_DTYPE,
                                                 quantization_config=quantization_config())
    if METHOD == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing)
    elif checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()  # the frozen embedding's output must carry gradients
    model.config.use_cache = False
    return get_peft_model(model, lora_config())


def accelerate_plugins(config):
    \"\"\"accelerate's FSDP plugin, ParallelismConfig and mixed precision from its config YAML, as
    ``accelerate launch --config_file`` sets them up (so any launcher runs the same placement).\"\"\"
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin

    out = {{"mixed_precision": config.get("mixed_precision", "no")}}
    if config.get("distributed_type") == "FSDP":
        fsdp = config["fsdp_config"]
        out["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            fsdp_version=fsdp["fsdp_version"], reshard_after_forward=fsdp["fsdp_reshard_after_forward"],
            cpu_offload=fsdp["fsdp_offload_params"], auto_wrap_policy=fsdp["fsdp_auto_wrap_policy"],
            state_dict_type=fsdp["fsdp_state_dict_type"], activation_checkpointing=fsdp["fsdp_activation_checkpointing"])
    sizes = config.get("parallelism_config")
    if sizes:
        out["parallelism_config"] = ParallelismConfig(
            **{{key.removeprefix("parallelism_config_"): value for key, value in sizes.items()}})
    return out


def make_accelerator(args):
    \"\"\"The Accelerator of the framework config the launch passes: DeepSpeed's JSON (through
    accelerate's DeepSpeed plugin; ZeRO-3 then partitions the model as it loads) or accelerate's
    FSDP / parallelism YAML.  Built before the model, as ZeRO-3's partitioned loading needs.  Its DDP
    makes each .grad a view of the reducer's bucket (gradient_as_bucket_view): one copy of the
    gradients, not two.\"\"\"
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    if args.deepspeed_config:
        from accelerate.utils import DeepSpeedPlugin

        plugin = DeepSpeedPlugin(hf_ds_config=args.deepspeed_config)
        return Accelerator(gradient_accumulation_steps=GRAD_ACCUM, deepspeed_plugin=plugin)
    with open(args.accelerate_config) as f:
        config = yaml.safe_load(f)
    return Accelerator(gradient_accumulation_steps=GRAD_ACCUM, **accelerate_plugins(config),
                       kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=True)])


def offloads_optimizer(accelerator):
    \"\"\"Whether DeepSpeed runs the optimizer step on the host (ZeRO-Offload), which takes its CPU Adam.\"\"\"
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)  # set only under DeepSpeed
    zero = plugin.deepspeed_config.get("zero_optimization", {{}}) if plugin is not None else {{}}
    return zero.get("offload_optimizer", {{}}).get("device", "none") in ("cpu", "nvme")


def optimizer_for(model, lr, host=False):
    \"\"\"AdamW over the adapters: DeepSpeed's CPU Adam when ZeRO-Offload steps on the host (DeepSpeed
    refuses other optimizers there), bitsandbytes' paged AdamW with --paged-optimizer, else torch's.\"\"\"
    trainable = [p for p in model.parameters() if p.requires_grad]
    if host:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(trainable, lr=lr)
    if PAGED_OPTIMIZER:
        import bitsandbytes as bnb

        return bnb.optim.PagedAdamW32bit(trainable, lr=lr)
    return torch.optim.AdamW(trainable, lr=lr)


def batches(path, vocab, steps, rank=0, world=1, model_id=None):
    \"\"\"This data-parallel rank's sequences of SEQ_LEN token ids: a text file's, tokenized and packed
    (rank r of w takes every w-th micro-batch from the r-th), or random ones seeded by the rank.\"\"\"
    if path is None:
        generator = torch.Generator().manual_seed(rank)
        for _ in range(steps * GRAD_ACCUM):
            yield torch.randint(0, vocab, (MICRO_BATCH, SEQ_LEN), generator=generator)
        return
    from transformers import AutoTokenizer

    with open(path) as f:
        ids = AutoTokenizer.from_pretrained(model_id)(f.read(), return_tensors="pt").input_ids[0]
    per_batch = MICRO_BATCH * SEQ_LEN
    for i in range(steps * GRAD_ACCUM):
        start = ((i * world + rank) * per_batch) % max(1, len(ids) - per_batch)
        yield ids[start:start + per_batch].reshape(MICRO_BATCH, SEQ_LEN)


def adapter_state(accelerator, model):
    """The adapters' whole tensors on the host, for saving: gathered from ZeRO-3's partitions
    (deepspeed.zero.GatheredParameters) or FSDP2's shards (DTensor.full_tensor); the frozen base
    is not gathered.  A collective: every rank calls it."""
    named = {{n: p for n, p in accelerator.unwrap_model(model).named_parameters() if p.requires_grad}}
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(named.values()), modifier_rank=None):
            return {{n: p.detach().cpu().clone() for n, p in named.items()}}
    return {{n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu() for n, p in named.items()}}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the base model: a Hugging Face directory or Hub id")
    config = parser.add_mutually_exclusive_group(required=True)
    config.add_argument("--deepspeed_config", help="the bundle's ds_config.json")
    config.add_argument("--accelerate_config", help="the bundle's accelerate_config.yaml")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher (unused)")
    parser.add_argument("--data", help="a text file to fine-tune on (default: random tokens)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--out", default="adapter")
    return parser.parse_args(argv)


def main():
    args = parse_args()
    accelerator = make_accelerator(args)
    fsdp = getattr(accelerator.state, "fsdp_plugin", None)  # set only under FSDP
    model = build_model(args.model, GRADIENT_CHECKPOINTING and not (fsdp and fsdp.activation_checkpointing))
    model.print_trainable_parameters()
    vocab = model.config.vocab_size  # before prepare: a DeepSpeed engine's .config is its own
    optimizer = optimizer_for(model, args.lr, offloads_optimizer(accelerator))
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    # this rank's place among the data-parallel ranks (the plan's only dimension here), from torch's own
    # process group: accelerate's state counts one process under DeepSpeed on a CPU host
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    for step, ids in enumerate(batches(args.data, vocab, args.steps, rank, world, args.model)):
        with accelerator.accumulate(model):
            ids = ids.to(accelerator.device)
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients and rank == 0:
            print(f"step {{step // GRAD_ACCUM + 1}} loss {{loss.item():.4f}} on {{world}} data-parallel ranks", flush=True)
    adapters = adapter_state(accelerator, model)  # every rank takes part in the gather
    if rank == 0:
        accelerator.unwrap_model(model).save_pretrained(args.out, state_dict=adapters)
    # every rank waits for the save, then the process group is torn down before the interpreter exits:
    # left to exit, a rank's communication threads can be destroyed while joinable (std::terminate, SIGABRT),
    # and the launcher reports the run failed after it trained
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''


def render_peft_train(plan: Plan, model: ModelSpec, cluster: ClusterSpec) -> str:
    """The train script for ``plan`` of ``model`` (method lora or qlora) on ``cluster``.

    Raises:
        EmitError: the model trains with method full, or is a layer graph (no projections).
    """
    if not isinstance(model, TransformerSpec) or not model.training.frozen_base:
        raise EmitError(f"peft: the train script is for method lora or qlora; {model.name} trains with method "
                        f"{model.training.method}")
    lora = model.training.lora
    return _TEMPLATE.format(
        name=model.name, method_title="QLoRA" if model.training.method == "qlora" else "LoRA",
        plan=plan.to_string(), cluster=cluster.name, method=model.training.method,
        seq_len=model.seq_len, mbs=plan.mbs, ga=plan.grad_accum, checkpointing=plan.recompute_mode != "none",
        paged=model.training.paged_optimizer, dtype=_TORCH_DTYPE[training_dtype(model)], rank=lora.rank,
        alpha=lora.alpha, targets=target_modules(model.family, lora.targets))
