"""Same model, every framework: what each framework's emitted files would train is the model file's model.

For every config in tests/data/hf and every framework whose ``model_refusal`` is None, the
framework's own model is built on the meta device from what autoplace emitted and compared with
transformers' model built from the same config.json:

* Megatron-LM: megatron-core's ``GPTModel`` as ``autoplace dryrun`` builds it from the emitted arguments
  (``autoplace.frameworks._megatron_build``: Megatron-LM's ``validate_args``,
  ``core_transformer_config_from_args`` and ``gpt_builders.py``, restated), with megatron-core's local
  layer specs laid out as Transformer Engine's;
* torchtitan: the flavor the TOML names, from torchtitan's own registry or from the bundle's
  flavor module, built by the family's own model class;
* DeepSpeed, accelerate, FSDP2: their bundles train the user's transformers model itself, so the
  model is transformers' own (their ``model_refusal`` is None for every family; nothing to compare).

Total parameter counts must be equal; per-block parameter counts too (the layouts differ in
documented ways: Megatron fuses q/k/v and gate/up, torchtitan stacks experts, so per-block
*counts* are compared rather than tensor names).  Layer counts are shrunk to the fewest that
keep every kind of block (DeepSeek's dense prefix + one MoE block, Gemma's local + global pair):
a model's parameters grow linearly with its blocks, and building 61-126 blocks proves nothing
more.  Megatron's MTP module has no transformers counterpart (transformers drops DeepSeek-V3's
MTP weights), so it is counted apart.  A refused pair asserts the refusal's one line names a feature.
"""

from __future__ import annotations

import copy
import json
import warnings
from typing import Any

import pytest

from autoplace.dryrun.hf_model import hf_config_args
from autoplace.errors import EmitError
from autoplace.frameworks import get, megatron, torchtitan
from autoplace.specs.model import model_from_dict
from tests.helpers import REPO, gpu_cluster
from tests.test_emit_plans import make_plan
from tests.test_emit_torchtitan import without_triton

HF = REPO / "tests/data/hf"
FAMILIES = sorted(p.name for p in HF.glob("*.json"))
REFUSALS = {"megatron": megatron.model_refusal, "torchtitan": torchtitan.model_refusal,
            **{name: get(name).architecture_refusal for name in ("deepspeed", "accelerate", "fsdp")}}
CLUSTER = gpu_cluster(8)


# ---------------------------------------------------------------- the model, shrunk


def shrunk(name: str) -> dict[str, Any]:
    """The config with the fewest blocks that keep each kind: DeepSeek's dense prefix + 1 MoE block,
    else 2 (Gemma's sliding + global pair, a dense pair); ``layer_types`` dropped with them."""
    config = json.loads((HF / name).read_text())
    text = config.get("text_config", config) if config.get("model_type") == "gemma3" else config
    keep = text.get("first_k_dense_replace", 0) + 1 if text.get("n_routed_experts") else 2
    for key in ("num_hidden_layers", "n_layer", "n_layers"):
        if key in text:
            text[key] = min(text[key], keep)
    text.pop("layer_types", None)
    return config


def spec_of(config: dict[str, Any]) -> Any:
    return model_from_dict(copy.deepcopy(config), source="config.json")


def hf_model(config: dict[str, Any]) -> Any:
    """transformers' causal LM for ``config`` on the meta device (Gemma 3: its text model;
    autoplace.dryrun.hf_model.hf_config_args reads the config as the dry runs do)."""
    import torch
    import transformers

    kind, args = hf_config_args(config)
    hf_config = transformers.AutoConfig.for_model(kind, **args)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(hf_config)


def count(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def norm_eps(model: Any) -> set[Any]:
    """The epsilon every norm module of ``model`` adds (torch's RMSNorm / LayerNorm and the libraries'
    own: transformers' ``variance_epsilon``); None for a norm that takes torch's dtype-dependent default."""
    norms = [m for m in model.modules() if type(m).__name__.endswith("Norm")]
    assert norms
    return {getattr(m, "eps", getattr(m, "variance_epsilon", "no eps")) for m in norms}


def hf_blocks(model: Any) -> list[int]:
    """Parameters per decoder block of a transformers model."""
    inner = getattr(model, "model", None) or getattr(model, "transformer", None) or model.gpt_neox
    layers = getattr(inner, "layers", None) or inner.h
    return [count(block) for block in layers]


@pytest.fixture(scope="module")
def hf() -> Any:
    pytest.importorskip("transformers")
    return {name: hf_model(shrunk(name)) for name in FAMILIES}


# ---------------------------------------------------------------- Megatron-LM


@pytest.fixture(scope="module")
def mcore_world() -> Any:
    """A 1-rank gloo world with megatron-core's model-parallel groups (GPTModel needs them)."""
    pytest.importorskip("megatron.core")
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def megatron_model(args: list[str]) -> Any:
    """megatron-core's GPTModel for Megatron-LM ``args``, as ``autoplace dryrun`` builds it
    (:mod:`autoplace.frameworks._megatron_build`: Megatron-LM's parse_args / validate_args,
    core_transformer_config_from_args and gpt_builder, restated; megatron-core's local layer specs laid
    out as Transformer Engine's), on the meta device."""
    import torch

    from autoplace.frameworks import _megatron_build as build
    from autoplace.frameworks._megatron_validate import megatron_arguments

    namespace = megatron_arguments(args, 1)
    config = build.buildable(build.transformer_config(namespace))
    with torch.device("meta"), build.cuda_as_meta(), build.local_norms_without_fused_kernels(), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build.gpt_model(namespace, config, True, True, None, None)


def emitted_megatron_args(spec: Any) -> list[str]:
    plan = make_plan("zero=1", spec, CLUSTER)
    return megatron.emit_megatron(plan, spec, CLUSTER)


MEGATRON_RUNS = [f for f in FAMILIES if megatron.model_refusal(spec_of(shrunk(f))) is None]


@pytest.mark.parametrize("family", MEGATRON_RUNS)
def test_megatron_trains_the_same_model(family: str, hf, mcore_world) -> None:
    spec = spec_of(shrunk(family))
    model = megatron_model(emitted_megatron_args(spec))
    params = {n: p.numel() for n, p in model.named_parameters()}
    mtp = sum(v for n, v in params.items() if n.startswith("mtp."))
    assert (mtp > 0) == (spec.mtp_layers > 0)  # transformers has no MTP module: counted apart
    assert sum(params.values()) - mtp == count(hf[family])
    blocks = [count(layer) for layer in model.decoder.layers]
    assert blocks == hf_blocks(hf[family])
    assert norm_eps(model) == norm_eps(hf[family]) == {spec.norm_eps}


# ---------------------------------------------------------------- torchtitan


@pytest.fixture(scope="module")
def titan_models() -> Any:
    """torchtitan's model packages, imported without the package's triton import (ECOSYSTEM.md)."""
    import importlib

    with without_triton():
        yield {name: importlib.import_module(f"torchtitan.models.{name}") for name in ("llama3", "qwen3", "deepseek_v3")}


def titan_model(spec: Any, packages: dict[str, Any]) -> Any:
    """The model torchtitan builds for the emitted TOML: flavor looked up in the family's registry
    (after running the bundle's flavor module, if any), built by the family's model class."""
    import torch
    from torchtitan.protocols import train_spec as specs

    plan = make_plan("zero=3", spec, CLUSTER)
    doc = torchtitan.emit_torchtitan(plan, spec, CLUSTER)
    name, flavor = doc["model"]["name"], doc["model"]["flavor"]
    registry = packages[name].get_train_spec().model_args
    saved, saved_specs = dict(registry), dict(specs._extra_train_specs)
    try:
        source = torchtitan.torchtitan_model_module(plan, spec, CLUSTER)
        if source:
            exec(compile(source, "autoplace_torchtitan_model", "exec"), {})
        train_spec = specs.get_train_spec(name)  # as Trainer.__init__ looks it up, after the custom import
        args = copy.deepcopy(registry[flavor])
    finally:
        registry.clear()
        registry.update(saved)
        specs._extra_train_specs.clear()
        specs._extra_train_specs.update(saved_specs)
    from torchtitan.config.manager import ConfigManager

    args.update_from_config(ConfigManager().parse_args(torchtitan.torchtitan_overrides(plan, spec, CLUSTER)))
    with torch.device("meta"):
        return train_spec.model_cls(args)


TITAN_RUNS = [f for f in FAMILIES if torchtitan.model_refusal(spec_of(shrunk(f))) is None]


@pytest.mark.parametrize("family", TITAN_RUNS)
def test_torchtitan_trains_the_same_model(family: str, hf, titan_models) -> None:
    spec = spec_of(shrunk(family))
    model = titan_model(spec, titan_models)
    assert count(model) == count(hf[family])
    assert [count(block) for block in model.layers.values()] == hf_blocks(hf[family])
    assert norm_eps(model) == norm_eps(hf[family]) == {spec.norm_eps}


def test_torchtitan_custom_flavors_copy_rope_scaling_exactly(titan_models) -> None:
    """Llama 3 8B (no scaling) gets factor 1 -- no change to any frequency -- and Llama 3.1 8B
    torchtitan's own 8B flavor (factor 8, as its config says)."""
    import torch

    llama3 = titan_models["llama3"]
    plain = titan_model(spec_of(json.loads((HF / "meta-llama-3-8b.json").read_text()) | {"num_hidden_layers": 1}),
                        titan_models)
    assert plain.model_args.rope_scaling_args.scaling_factor == 1.0
    scaled = llama3.llama3_args["8B"].rope_scaling_args
    freqs = llama3.model.model.precompute_freqs_cis(128, 16, 500000.0, plain.model_args.rope_scaling_args)
    unscaled = torch.polar(torch.ones(16, 64), torch.outer(torch.arange(16.0), 1.0 / (
        500000.0 ** (torch.arange(0, 128, 2)[:64].float() / 128))))
    assert torch.allclose(freqs, unscaled) and scaled.scaling_factor == 8.0
    assert torchtitan.torchtitan_model(spec_of(json.loads((HF / "llama-3.1-8b.json").read_text()))).flavor == "8B"


# ---------------------------------------------------------------- refusals and the table


@pytest.mark.parametrize("family", FAMILIES)
def test_each_refusal_is_one_line_naming_a_feature_and_the_emitter_raises_it(family: str) -> None:
    spec = spec_of(json.loads((HF / family).read_text()))
    for name, refusal in REFUSALS.items():
        why = refusal(spec)
        if why is None:
            continue
        feature, _, reason = why.partition(": ")
        assert "\n" not in why and feature and reason, (name, why)
        with pytest.raises(EmitError, match="^" + name):
            {"megatron": emitted_megatron_args,
             "torchtitan": lambda s: torchtitan.emit_torchtitan(make_plan("zero=3", s, CLUSTER), s, CLUSTER)}[name](spec)


def test_hf_bundles_refuse_nothing_and_megatron_torchtitan_refuse_what_the_issue_found() -> None:
    """The families issue 23 found wrong: each is now expressed or refused by name."""
    def why(name: str, family: str) -> str | None:
        return REFUSALS[name](spec_of(json.loads((HF / family).read_text())))

    assert all(why(f, family) is None for f in ("deepspeed", "accelerate", "fsdp") for family in FAMILIES)
    assert why("megatron", "gemma-2-9b.json") and why("torchtitan", "gemma-2-9b.json")
    assert "post-norm" in (why("megatron", "olmo-2-1124-7b.json") or "")
    assert "post-norm" in (why("torchtitan", "olmo-2-1124-7b.json") or "")
    assert "parallel attention" in (why("megatron", "pythia-1b.json") or "")
    assert "longrope" in (why("megatron", "phi-4-mini-instruct.json") or "")
    assert "longrope" in (why("torchtitan", "phi-3.5-mini-instruct.json") or "")
    for family in ("qwen3-8b.json", "qwen3-30b-a3b.json", "deepseek-v2-lite.json", "llama-3.1-405b.json"):
        assert why("torchtitan", family) is None, family
    for family in ("deepseek-v3.json", "qwen1.5-moe-a2.7b-chat-gptq-int4.json", "llama-3.1-8b.json",
                   "qwen3-30b-a3b.json", "mistral-7b-v0.1.json"):
        assert why("megatron", family) is None, family


def test_megatron_flags_state_each_feature() -> None:
    """The flags issue 23 found missing, on the models that have the features."""
    def args(family: str) -> list[str]:
        return emitted_megatron_args(spec_of(json.loads((HF / family).read_text())))

    v3 = args("deepseek-v3.json")
    for flag in ("--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
                 "--qk-pos-emb-head-dim", "--v-head-dim", "--moe-router-enable-expert-bias", "--mtp-num-layers"):
        assert flag in v3, flag
    assert v3[v3.index("--moe-router-score-function") + 1] == "sigmoid"
    assert (v3[v3.index("--moe-router-num-groups") + 1], v3[v3.index("--moe-router-group-topk") + 1]) == ("8", "4")
    assert v3[v3.index("--moe-router-topk-scaling-factor") + 1] == "2.5" and "--kv-channels" not in v3
    assert "--qk-layernorm" in args("qwen3-8b.json")
    assert {"--moe-shared-expert-gate", "--moe-router-pre-softmax"} <= set(args("qwen1.5-moe-a2.7b-chat-gptq-int4.json"))
    llama = args("llama-3.1-70b.json")
    assert "--use-rope-scaling" in llama and llama[llama.index("--rope-scaling-factor") + 1] == "8.0"
    assert "--use-rope-scaling" not in args("meta-llama-3-8b.json")
    mistral = args("mistral-7b-v0.1.json")
    assert mistral[mistral.index("--window-size") + 1] == "(4095,0)"  # 4096 keys, the query's own included
    pythia = spec_of(json.loads((HF / "pythia-1b.json").read_text())).model_copy(update={"parallel_block": False})
    neox = emitted_megatron_args(pythia)
    assert neox[neox.index("--rotary-percent") + 1] == "0.25"


def family_table() -> list[tuple[str, dict[str, str]]]:
    """families x frameworks: "emitted" or "refused: <reason>" (the report the issue asks for)."""
    rows = []
    for family in FAMILIES:
        spec = spec_of(json.loads((HF / family).read_text()))
        rows.append((family, {f: ("emitted" if r(spec) is None else f"refused: {r(spec)}") for f, r in REFUSALS.items()}))
    return rows


if __name__ == "__main__":  # print the table: python -m tests.test_architectures
    for family, cells in family_table():
        print(family)
        for framework, cell in cells.items():
            print(f"    {framework:11} {cell}")


# ---------------------------------------------------------------- every feature field, every emitter

BASE: dict[str, Any] = {"name": "base", "layers": 4, "hidden": 256, "ffn_hidden": 512, "heads": 8, "kv_heads": 4,
                        "vocab": 1024, "seq_len": 512, "rope_theta": 10000.0}
MOE: dict[str, Any] = {"experts": 8, "top_k": 2, "expert_ffn_hidden": 256}
SHARED: dict[str, Any] = {**MOE, "shared_experts": 1, "shared_ffn_hidden": 256}
LLAMA31 = {"type": "llama3", "factor": 8.0, "original_max_position": 8192, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
# spec fields that size the model or say where it came from, not how it computes
# and "family": the Hugging Face model_type, which names the modules LoRA adapts (no math of its own)
SIZE_FIELDS = {"name", "source", "layers", "hidden", "ffn_hidden", "heads", "vocab", "seq_len", "max_position",
               "training", "flash_attention", "family"}
MOE_SIZE_FIELDS = {"experts", "top_k", "expert_ffn_hidden"}
# feature field -> (the model without it, the model with it), as overrides of BASE
FEATURES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "head_dim": ({}, {"head_dim": 64}),
    "attention": ({}, {"attention": {"type": "mla", "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
                                     "v_head_dim": 32}, "kv_heads": 8}),
    "kv_heads": ({}, {"kv_heads": 1}),
    "ffn": ({}, {"ffn": "gelu"}),
    "norm": ({}, {"norm": "layernorm"}),
    "bias": ({"qkv_bias": True}, {"bias": True, "qkv_bias": True}),
    "qkv_bias": ({}, {"qkv_bias": True}),
    "tied_embeddings": ({}, {"tied_embeddings": True}),
    "norm_eps": ({}, {"norm_eps": 1e-6}),
    "position": ({}, {"position": "learned", "max_position": 512}),
    "rope_theta": ({}, {"rope_theta": 500000.0}),
    "dropout": ({}, {"dropout": True}),
    "moe": ({}, {"moe": MOE}),
    "qk_norm": ({}, {"qk_norm": "head"}),
    "block_norms": ({}, {"block_norms": 4, "norm_position": "sandwich"}),
    "embedding_norm": ({}, {"embedding_norm": True}),
    "sliding_window": ({}, {"sliding_window": 128}),
    "full_attention_every": ({"sliding_window": 128}, {"sliding_window": 128, "full_attention_every": 2}),
    "final_logit_softcap": ({}, {"final_logit_softcap": 30.0}),
    "mtp_layers": ({}, {"mtp_layers": 1}),
    "activation": ({}, {"activation": "gelu_tanh"}),
    "rotary_fraction": ({}, {"rotary_fraction": 0.5}),
    "rope_scaling": ({}, {"rope_scaling": LLAMA31}),
    "attn_softcap": ({}, {"attn_softcap": 50.0}),
    "norm_position": ({}, {"norm_position": "post"}),
    "parallel_block": ({}, {"parallel_block": True}),
    "scaled_embeddings": ({}, {"scaled_embeddings": True}),
}
MOE_FEATURES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "shared_experts": (MOE, SHARED),
    "shared_ffn_hidden": (SHARED, {**SHARED, "shared_ffn_hidden": 512}),
    "first_dense_layers": (MOE, {**MOE, "first_dense_layers": 1}),
    "layer_freq": (MOE, {**MOE, "layer_freq": 2}),
    "score_function": (MOE, {**MOE, "score_function": "sigmoid"}),
    "normalize_top_k": (MOE, {**MOE, "normalize_top_k": False}),
    "topk_scaling": (MOE, {**MOE, "topk_scaling": 2.5}),
    "groups": (MOE, {**MOE, "groups": 4}),
    "group_top_k": ({**MOE, "groups": 4}, {**MOE, "groups": 4, "group_top_k": 2}),
    "group_score": ({**MOE, "groups": 4, "group_top_k": 2},
                    {**MOE, "groups": 4, "group_top_k": 2, "group_score": "max"}),
    "expert_bias": ({**MOE, "score_function": "sigmoid"}, {**MOE, "score_function": "sigmoid", "expert_bias": True}),
    "shared_expert_gate": (SHARED, {**SHARED, "shared_expert_gate": True}),
}
# RoPE scaling values beyond Llama 3.1's: each framework states them or refuses
ROPE_VARIANTS = [{**LLAMA31, "factor": 4.0}, {"type": "linear", "factor": 2.0}, {"type": "yarn", "factor": 4.0},
                 {"type": "dynamic", "factor": 2.0}, {"type": "longrope", "original_max_position": 4096}]


def feature_pairs() -> list[tuple[str, Any, Any]]:
    pairs = [(name, model_from_dict({**BASE, **off}), model_from_dict({**BASE, **on}))
             for name, (off, on) in FEATURES.items()]
    pairs += [(f"moe.{name}", model_from_dict({**BASE, "moe": off}), model_from_dict({**BASE, "moe": on}))
              for name, (off, on) in MOE_FEATURES.items()]
    pairs += [(f"rope_scaling {r}", model_from_dict({**BASE, "rope_scaling": LLAMA31}),
               model_from_dict({**BASE, "rope_scaling": r})) for r in ROPE_VARIANTS]
    return pairs


def test_every_spec_field_is_a_size_or_a_listed_feature() -> None:
    """A new field of the spec fails here until it is listed: then every emitter must handle or refuse it."""
    from autoplace.specs.model import MoE, TransformerSpec

    assert set(TransformerSpec.model_fields) == SIZE_FIELDS | set(FEATURES)
    assert set(MoE.model_fields) == MOE_SIZE_FIELDS | set(MOE_FEATURES)


def emitted(framework: str, model: Any) -> Any:
    """What the framework's files say about ``model`` (raises EmitError for a refused model)."""
    if framework == "megatron":
        return emitted_megatron_args(model)
    plan = make_plan("zero=3", model, CLUSTER)
    return torchtitan.emit_torchtitan(plan, model, CLUSTER), torchtitan.torchtitan_model_module(plan, model, CLUSTER)


@pytest.mark.parametrize("framework", ["megatron", "torchtitan"])
def test_each_feature_is_stated_or_refused_by_name(framework: str) -> None:
    """For every feature: either the emitted files change when the model has it (it is stated), or
    the framework refuses the model and the emitter raises that one line.  The HF-code bundles
    (DeepSpeed, accelerate, FSDP2) train the user's model code, so they refuse none."""
    refusal = REFUSALS[framework]
    stated, refused = [], []
    for name, off, on in feature_pairs():
        for other in ("deepspeed", "accelerate", "fsdp"):
            assert REFUSALS[other](on) is None
        why = refusal(on)
        if why is not None:
            with pytest.raises(EmitError, match=f"^{framework}: (not written: )?"):
                emitted(framework, on)
            refused.append(name)
            continue
        if refusal(off) is not None:  # the model without the feature is itself refused: nothing to compare
            continue
        assert emitted(framework, on) != emitted(framework, off), f"{framework} drops {name} silently"
        stated.append(name)
    assert stated and refused
