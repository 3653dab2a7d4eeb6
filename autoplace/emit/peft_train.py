"""A LoRA / QLoRA fine-tuning script for a plan: Hugging Face model + PEFT adapters, run by accelerate.

The script is what people fine-tune with: ``AutoModelForCausalLM`` loads the base weights
(QLoRA: through bitsandbytes' ``BitsAndBytesConfig``, 4-bit NF4 with double quantization and
the compute dtype for the matmuls, as Dettmers et al. 2023 and the transformers docs do), PEFT's
``LoraConfig`` adds the adapters (rank, alpha and ``target_modules`` from the model's spec, the
module names of its family: :mod:`autoplace.specs.lora`), and ``accelerate.Accelerator`` runs
it under whatever the launch config says -- accelerate's FSDP config or a DeepSpeed config --
with the plan's micro-batch and accumulation.  For sharded 4-bit weights (FSDP, ZeRO-3) the
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
"""Fine-tune {name} with {method_title} (written by autoplace for the plan below).

plan: {plan}
cluster: {cluster}
Run under accelerate with the bundle's FSDP or DeepSpeed config, e.g.
    accelerate launch --config_file accelerate_fsdp.yaml train_peft.py --data corpus.txt
"""

import argparse

import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

MODEL = {model_id!r}  # a Hub id or a local directory with the weights
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
    """The adapters: rank, alpha and the projections autoplace costed."""
    return LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=TARGET_MODULES, lora_dropout=0.0,
                      bias="none", task_type="CAUSAL_LM")


def quantization_config():
    """QLoRA's 4-bit NF4 base with double-quantized constants; None for LoRA (a 16-bit base)."""
    if METHOD != "qlora":
        return None
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=COMPUTE_DTYPE, bnb_4bit_quant_storage=COMPUTE_DTYPE)


def build_model(model_id=MODEL):
    """The frozen base with its adapters; only the adapters require gradients."""
    model = AutoModelForCausalLM.from_pretrained(model_id, dtype=COMPUTE_DTYPE,
                                                 quantization_config=quantization_config())
    if METHOD == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=GRADIENT_CHECKPOINTING)
    elif GRADIENT_CHECKPOINTING:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()  # the frozen embedding's output must carry gradients
    model.config.use_cache = False
    return get_peft_model(model, lora_config())


def optimizer_for(model, lr):
    trainable = [p for p in model.parameters() if p.requires_grad]
    if PAGED_OPTIMIZER:
        import bitsandbytes as bnb

        return bnb.optim.PagedAdamW32bit(trainable, lr=lr)
    return torch.optim.AdamW(trainable, lr=lr)


def batches(path, vocab, steps, seed=0):
    """Sequences of SEQ_LEN token ids: a text file's, tokenized and packed, or random ones."""
    if path is None:
        generator = torch.Generator().manual_seed(seed)
        for _ in range(steps * GRAD_ACCUM):
            yield torch.randint(0, vocab, (MICRO_BATCH, SEQ_LEN), generator=generator)
        return
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(MODEL)(open(path).read(), return_tensors="pt").input_ids[0]
    per_batch = MICRO_BATCH * SEQ_LEN
    for i in range(steps * GRAD_ACCUM):
        start = (i * per_batch) % max(1, len(ids) - per_batch)
        yield ids[start:start + per_batch].reshape(MICRO_BATCH, SEQ_LEN)


def main():
    from accelerate import Accelerator

    parser = argparse.ArgumentParser()
    parser.add_argument("--data", help="a text file to fine-tune on (default: random tokens)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--out", default="adapter")
    args = parser.parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=GRAD_ACCUM)
    model = build_model()
    model.print_trainable_parameters()
    optimizer = optimizer_for(model, args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    for step, ids in enumerate(batches(args.data, model.config.vocab_size, args.steps)):
        with accelerator.accumulate(model):
            ids = ids.to(accelerator.device)
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            accelerator.print(f"step {{step // GRAD_ACCUM + 1}} loss {{loss.item():.4f}}")
    accelerator.unwrap_model(model).save_pretrained(args.out)  # the adapters only


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
        plan=plan.to_string(), cluster=cluster.name, model_id=model.name, method=model.training.method,
        seq_len=model.seq_len, mbs=plan.mbs, ga=plan.grad_accum, checkpointing=plan.recompute_mode != "none",
        paged=model.training.paged_optimizer, dtype=_TORCH_DTYPE[training_dtype(model)], rank=lora.rank,
        alpha=lora.alpha, targets=target_modules(model.family, lora.targets))
