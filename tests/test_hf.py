"""shorthand_from_hf against real Hugging Face config.json files.

Fixtures in tests/data/hf/ are Hub config.json texts:
  gpt2.json                 openai-community/gpt2
  meta-llama-3-8b.json      meta-llama/Meta-Llama-3-8B (ungated copy: NousResearch/Meta-Llama-3-8B)
  mistral-7b-v0.1.json      mistralai/Mistral-7B-v0.1
  mixtral-8x7b-v0.1.json    mistralai/Mixtral-8x7B-v0.1
  qwen2.5-0.5b.json         Qwen/Qwen2.5-0.5B (model_type qwen2)
  pythia-1b.json            EleutherAI/pythia-1b (model_type gpt_neox)
  deepseek-v2-lite.json     deepseek-ai/DeepSeek-V2-Lite
  (the families added for issue 14 are listed in tests/test_hf_families.py)
  qwen1.5-moe-a2.7b-chat-gptq-int4.json
                            Qwen/Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4, with its quantization_config
                            block removed (the copy found had it abridged); the architecture
                            keys are those of Qwen1.5-MoE-A2.7B.

The parameter count below is computed from the shorthand alone by an independent
helper and compared with published totals; a wrong mapping (ffn size, tied head,
kv heads, biases, learned positions, MoE layout) moves the count off the number.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from autoplace.errors import SpecError
from autoplace.specs.hf import SEQ_LEN_CAP, shorthand_from_hf

DATA = Path(__file__).parent / "data" / "hf"

SCHEMA_KEYS = {
    "name", "layers", "hidden", "ffn_hidden", "heads", "kv_heads", "head_dim", "vocab", "seq_len",
    "ffn", "norm", "norm_eps", "bias", "qkv_bias", "tied_embeddings", "position", "rope_theta", "max_position", "dropout",
    "flash_attention", "moe", "attention", "source", "qk_norm", "block_norms", "embedding_norm",
    "sliding_window", "full_attention_every", "final_logit_softcap", "mtp_layers",
    "activation", "rotary_fraction", "rope_scaling", "attn_softcap", "norm_position", "parallel_block",
    "scaled_embeddings",
}
MOE_KEYS = {"experts", "top_k", "expert_ffn_hidden", "shared_experts", "shared_ffn_hidden",
            "first_dense_layers", "layer_freq"}
# routing keys a family states when its router is not Mixtral's (the shorthand's defaults)
MOE_ROUTING_KEYS = {"score_function", "normalize_top_k", "topk_scaling", "groups", "group_top_k", "group_score",
                    "expert_bias", "shared_expert_gate"}
MLA_KEYS = {"type", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim"}


def load(name: str) -> dict[str, Any]:
    """A fixture config.json, parsed."""
    config: dict[str, Any] = json.loads((DATA / name).read_text())
    return config


def translate(name: str) -> dict[str, Any]:
    """The shorthand for a fixture."""
    return shorthand_from_hf(load(name), source=f"tests/data/hf/{name}")


# ---------------------------------------------------------------- independent parameter count


def _mlp(hidden: int, ffn: int, gated: bool, bias: bool) -> int:
    """Gated (gate, up, down) or plain (up, down) MLP."""
    if gated:
        return 3 * hidden * ffn + (2 * ffn + hidden if bias else 0)
    return 2 * hidden * ffn + (ffn + hidden if bias else 0)


def _attention(m: dict[str, Any]) -> int:
    """q, k, v, o projections (standard or DeepSeek MLA)."""
    h: int = m["hidden"]
    heads: int = m["heads"]
    mla: dict[str, int] | None = m.get("attention")
    if mla:
        qk = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        r_q, r_kv = mla["q_lora_rank"], mla["kv_lora_rank"]
        q = h * heads * qk if r_q == 0 else h * r_q + r_q + r_q * heads * qk  # + q_a_layernorm
        kv_a = h * (r_kv + mla["qk_rope_head_dim"]) + r_kv  # + kv_a_layernorm
        kv_b = r_kv * heads * (mla["qk_nope_head_dim"] + mla["v_head_dim"])
        return q + kv_a + kv_b + heads * mla["v_head_dim"] * h
    d: int = m.get("head_dim", h // heads)
    kv_heads: int = m["kv_heads"]
    q, kv, o = h * heads * d, 2 * h * kv_heads * d, heads * d * h
    biases = (heads * d + 2 * kv_heads * d) if (m["qkv_bias"] or m["bias"]) else 0
    return q + kv + o + biases + (h if m["bias"] else 0)


def _is_moe_layer(moe: dict[str, int], i: int) -> bool:
    """DeepSeek's rule: dense first layers, then every layer_freq-th layer is MoE."""
    return i >= moe["first_dense_layers"] and i % moe["layer_freq"] == 0


def param_count(m: dict[str, Any]) -> int:
    """Exact parameter count of a decoder described by the shorthand."""
    h: int = m["hidden"]
    gated = m["ffn"] == "swiglu"
    norm = h if m["norm"] == "rmsnorm" else 2 * h
    dense = _mlp(h, m["ffn_hidden"], gated, m["bias"])
    moe = m.get("moe")
    total = 0
    for i in range(m["layers"]):
        if moe and _is_moe_layer(moe, i):
            mlp = (moe["experts"] * _mlp(h, moe["expert_ffn_hidden"], gated, m["bias"])
                   + moe["shared_experts"] * _mlp(h, moe["shared_ffn_hidden"], gated, m["bias"])
                   + h * moe["experts"])  # router
        else:
            mlp = dense
        total += _attention(m) + mlp + 2 * norm
    embeddings: int = m["vocab"] * h * (1 if m["tied_embeddings"] else 2)
    positions: int = m["max_position"] * h if m["position"] == "learned" else 0
    return total + embeddings + positions + norm


def active_param_count(m: dict[str, Any]) -> int:
    """Parameters touched per token: only top_k of the routed experts count."""
    moe: dict[str, int] = m["moe"]
    idle = moe["experts"] - moe["top_k"]
    expert = _mlp(m["hidden"], moe["expert_ffn_hidden"], m["ffn"] == "swiglu", m["bias"])
    moe_layers = sum(_is_moe_layer(moe, i) for i in range(m["layers"]))
    return param_count(m) - moe_layers * idle * expert


# Published totals (exact where the number is well known).
@pytest.mark.parametrize(
    ("fixture", "published"),
    [
        ("gpt2.json", 124_439_808),  # GPT-2 small, tied head + learned positions
        ("meta-llama-3-8b.json", 8_030_261_248),  # Hub safetensors total
        ("mistral-7b-v0.1.json", 7_241_732_096),  # Hub safetensors total
        ("mixtral-8x7b-v0.1.json", 46_702_792_704),  # Hub safetensors total
        ("qwen2.5-0.5b.json", 494_032_768),  # Hub safetensors total (0.49B, tied)
        ("pythia-1b.json", 1_011_781_632),  # Pythia paper (Biderman et al. 2023), Table 1
    ],
)
def test_parameter_count_matches_published(fixture: str, published: int) -> None:
    assert param_count(translate(fixture)) == published


@pytest.mark.parametrize(
    ("fixture", "published_billions"),
    [
        # DeepSeek-V2 paper / model card: 15.7B total (helper: 15,706,484,224).
        ("deepseek-v2-lite.json", 15.7),
        # Qwen1.5-MoE model card: 14.3B total. The helper leaves out Qwen's per-layer
        # shared_expert_gate (hidden -> 1), 49k parameters, far below the rounding.
        ("qwen1.5-moe-a2.7b-chat-gptq-int4.json", 14.3),
    ],
)
def test_moe_parameter_count_matches_published_rounding(fixture: str, published_billions: float) -> None:
    assert round(param_count(translate(fixture)) / 1e9, 1) == published_billions


def test_mixtral_active_parameters_match_published() -> None:
    # Mistral AI, "Mixtral of experts": 12.9B active parameters per token.
    assert round(active_param_count(translate("mixtral-8x7b-v0.1.json")) / 1e9, 1) == 12.9


# ---------------------------------------------------------------- translated fields, per family


def test_llama3_8b_fields() -> None:
    m = translate("meta-llama-3-8b.json")
    assert m == {
        "name": "meta-llama-3-8b", "layers": 32, "hidden": 4096, "ffn_hidden": 14336, "heads": 32,
        "kv_heads": 8, "vocab": 128256, "seq_len": 8192, "ffn": "swiglu", "norm": "rmsnorm", "norm_eps": 1e-5,
        "bias": False, "qkv_bias": False, "tied_embeddings": False, "position": "rope",
        "rope_theta": 500000.0, "dropout": False, "flash_attention": True,
        "source": "tests/data/hf/meta-llama-3-8b.json (Hugging Face config, model_type=llama)",
    }


@pytest.mark.parametrize("name, key, stated", [("qwen2.5-0.5b.json", "rms_norm_eps", 1e-6),
                                               ("pythia-1b.json", "layer_norm_eps", 1e-5),
                                               ("starcoder2-3b.json", "norm_epsilon", 1e-5)])
def test_norm_eps_is_each_familys_key_or_its_transformers_default(name: str, key: str, stated: float) -> None:
    """Issue 34: the norms' epsilon is part of the model (Qwen2.5's 1e-6 is not Megatron's 1e-5)."""
    config = load(name)
    assert config[key] == stated and translate(name)["norm_eps"] == stated
    del config[key]  # what transformers' config class builds without the key
    defaults = {"qwen2.5-0.5b.json": 1e-6, "pythia-1b.json": 1e-5, "starcoder2-3b.json": 1e-5}
    assert shorthand_from_hf(config, source=name)["norm_eps"] == defaults[name]
    with pytest.raises(SpecError, match=f"{key}: must be a number between 0 and 1"):
        shorthand_from_hf({**config, key: "1e-6"}, source=name)


def test_mistral_seq_len_is_capped() -> None:
    m = translate("mistral-7b-v0.1.json")
    assert (m["layers"], m["hidden"], m["ffn_hidden"], m["heads"], m["kv_heads"], m["vocab"]) == (
        32, 4096, 14336, 32, 8, 32000)
    assert m["seq_len"] == SEQ_LEN_CAP == 8192  # max_position_embeddings is 32768
    assert "moe" not in m and "max_position" not in m


def test_mixtral_moe_block() -> None:
    m = translate("mixtral-8x7b-v0.1.json")
    assert m["ffn_hidden"] == 14336
    assert m["moe"] == {"experts": 8, "top_k": 2, "expert_ffn_hidden": 14336, "shared_experts": 0,
                        "shared_ffn_hidden": 0, "first_dense_layers": 0, "layer_freq": 1}


def test_qwen2_has_qkv_bias_and_tied_head() -> None:
    m = translate("qwen2.5-0.5b.json")
    assert (m["layers"], m["hidden"], m["ffn_hidden"], m["heads"], m["kv_heads"]) == (24, 896, 4864, 14, 2)
    assert (m["qkv_bias"], m["bias"], m["tied_embeddings"]) == (True, False, True)
    assert m["vocab"] == 151936 and m["seq_len"] == 8192


def test_qwen2_moe_block() -> None:
    m = translate("qwen1.5-moe-a2.7b-chat-gptq-int4.json")
    assert (m["layers"], m["hidden"], m["heads"], m["kv_heads"], m["qkv_bias"]) == (24, 2048, 16, 16, True)
    assert m["moe"] == {"experts": 60, "top_k": 4, "expert_ffn_hidden": 1408, "shared_experts": 1,
                        "shared_ffn_hidden": 5632, "first_dense_layers": 0, "layer_freq": 1,
                        "normalize_top_k": False, "shared_expert_gate": True}  # routing: Qwen2MoeConfig's


def test_gpt2_fields() -> None:
    m = translate("gpt2.json")
    assert m == {
        "name": "gpt2", "layers": 12, "hidden": 768, "ffn_hidden": 3072, "heads": 12, "kv_heads": 12,
        "vocab": 50257, "seq_len": 1024, "ffn": "gelu", "norm": "layernorm", "norm_eps": 1e-5, "bias": True,
        "qkv_bias": True, "tied_embeddings": True, "position": "learned", "max_position": 1024,
        "dropout": True, "flash_attention": True, "activation": "gelu_tanh",  # activation_function gelu_new
        "source": "tests/data/hf/gpt2.json (Hugging Face config, model_type=gpt2)",
    }


def test_pythia_gpt_neox_fields() -> None:
    m = translate("pythia-1b.json")
    assert (m["layers"], m["hidden"], m["ffn_hidden"], m["heads"], m["kv_heads"]) == (16, 2048, 8192, 8, 8)
    assert (m["ffn"], m["norm"], m["bias"], m["position"]) == ("gelu", "layernorm", True, "rope")
    assert (m["tied_embeddings"], m["dropout"], m["seq_len"]) == (False, False, 2048)


def test_deepseek_v2_lite_mla_and_moe() -> None:
    m = translate("deepseek-v2-lite.json")
    shape = (m["layers"], m["hidden"], m["ffn_hidden"], m["heads"], m["vocab"])
    assert shape == (27, 2048, 10944, 16, 102400)
    assert "head_dim" not in m
    assert m["attention"] == {"type": "mla", "q_lora_rank": 0, "kv_lora_rank": 512,
                              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    assert m["moe"] == {"experts": 64, "top_k": 6, "expert_ffn_hidden": 1408, "shared_experts": 2,
                        "shared_ffn_hidden": 1408, "first_dense_layers": 1, "layer_freq": 1,
                        # V2-Lite's router: softmax, greedy top-6 kept as they are, no groups, no bias
                        "score_function": "softmax", "normalize_top_k": False, "topk_scaling": 1.0,
                        "expert_bias": False}


def test_deepseek_v3_shape() -> None:
    # DeepSeek-V3's published architecture keys; its q_lora_rank is set (1536).
    config = {**load("deepseek-v2-lite.json"), "model_type": "deepseek_v3",
              "architectures": ["DeepseekV3ForCausalLM"], "q_lora_rank": 1536, "n_routed_experts": 256,
              "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 3,
              "moe_intermediate_size": 2048, "num_hidden_layers": 61, "hidden_size": 7168,
              "intermediate_size": 18432, "num_attention_heads": 128, "num_key_value_heads": 128,
              "vocab_size": 129280, "num_nextn_predict_layers": 1}
    m = shorthand_from_hf(config, source="v3")
    assert m["attention"]["q_lora_rank"] == 1536
    moe = m["moe"]
    assert (moe["experts"], moe["first_dense_layers"], moe["shared_ffn_hidden"]) == (256, 3, 2048)
    # DeepSeek-V3 technical report: 671B total parameters (the MTP module is extra).
    assert round(param_count(m) / 1e9) == 671


@pytest.mark.parametrize("fixture", sorted(p.name for p in DATA.glob("*.json")))
def test_every_fixture_fits_the_schema(fixture: str) -> None:
    m = translate(fixture)
    assert set(m) <= SCHEMA_KEYS and "training" not in m
    assert MOE_KEYS <= set(m.get("moe", MOE_KEYS)) <= MOE_KEYS | MOE_ROUTING_KEYS
    assert set(m.get("attention", MLA_KEYS)) == MLA_KEYS
    assert m["flash_attention"] is True and m["seq_len"] <= SEQ_LEN_CAP
    assert ("max_position" in m) == (m["position"] == "learned")
    assert ("full_attention_every" not in m) or "sliding_window" in m
    assert json.loads(json.dumps(m)) == m


# ---------------------------------------------------------------- defaults and tolerated keys


def test_unknown_keys_and_rope_scaling_are_tolerated() -> None:
    config = load("meta-llama-3-8b.json")
    config["rope_scaling"] = {"factor": 8.0, "rope_type": "llama3", "original_max_position_embeddings": 8192}
    config["max_position_embeddings"] = 131072
    config["some_future_key"] = {"nested": [1, 2]}
    m = shorthand_from_hf(config, source="x")
    assert m["seq_len"] == 8192 and m["layers"] == 32


def test_name_comes_from_name_or_path() -> None:
    config = {**load("mistral-7b-v0.1.json"), "_name_or_path": "mistralai/Mistral-7B-v0.1"}
    assert shorthand_from_hf(config, source="x")["name"] == "mistralai/Mistral-7B-v0.1"


def test_gpt2_defaults_tied_and_n_inner() -> None:
    config = {**load("gpt2.json"), "n_inner": None, "n_embd": 1024, "n_head": 16}
    m = shorthand_from_hf(config, source="x")
    assert m["ffn_hidden"] == 4096 and m["tied_embeddings"] is True
    untied = shorthand_from_hf({**config, "tie_word_embeddings": False}, source="x")
    assert untied["tied_embeddings"] is False


def test_gpt2_without_dropout() -> None:
    config = {**load("gpt2.json"), "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0}
    assert shorthand_from_hf(config, source="x")["dropout"] is False  # summary_first_dropout is a head


def test_llama_kv_heads_default_to_heads() -> None:
    config = load("meta-llama-3-8b.json")
    del config["num_key_value_heads"]
    assert shorthand_from_hf(config, source="x")["kv_heads"] == 32


def test_head_dim_only_when_it_differs() -> None:
    config = load("mistral-7b-v0.1.json")
    assert "head_dim" not in shorthand_from_hf({**config, "head_dim": 128}, source="x")
    # Mistral-NeMo style: 5120 hidden, 32 heads of 128.
    m = shorthand_from_hf({**config, "hidden_size": 5120, "head_dim": 128}, source="x")
    assert m["head_dim"] == 128


def test_llama_with_biases_everywhere() -> None:
    config = {**load("meta-llama-3-8b.json"), "attention_bias": True, "mlp_bias": True}
    m = shorthand_from_hf(config, source="x")
    assert (m["bias"], m["qkv_bias"]) == (True, True)


def test_dense_deepseek_has_no_moe() -> None:
    config = {**load("deepseek-v2-lite.json"), "n_routed_experts": None}
    m = shorthand_from_hf(config, source="x")
    assert "moe" not in m and m["attention"]["type"] == "mla"


# ---------------------------------------------------------------- errors


def _raises(config: Any, field: str | None) -> SpecError:
    with pytest.raises(SpecError) as info:
        shorthand_from_hf(config, source="cfg.json")
    assert info.value.field == field
    assert info.value.source == "cfg.json"
    assert "\n" not in str(info.value)
    return info.value


def test_unsupported_model_type_lists_supported() -> None:
    error = _raises({**load("gpt2.json"), "model_type": "bert"}, "model_type")
    assert "'bert'" in str(error)
    for name in ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "gpt2", "gpt_neox",
                 "deepseek_v2", "deepseek_v3", "qwen3", "qwen3_moe", "gemma2", "gemma3", "phi3", "olmo2",
                 "falcon", "RefinedWebModel", "RefinedWeb", "bloom", "mpt", "gpt_bigcode", "starcoder2"):
        assert name in str(error)


def test_missing_model_type() -> None:
    config = load("gpt2.json")
    del config["model_type"]
    assert "missing" in str(_raises(config, "model_type"))


def test_unsupported_architecture() -> None:
    config = {**load("meta-llama-3-8b.json"), "architectures": ["LlamaForSequenceClassification"]}
    assert "LlamaForCausalLM" in str(_raises(config, "architectures"))


def test_missing_hidden_size() -> None:
    config = load("meta-llama-3-8b.json")
    del config["hidden_size"]
    assert "missing" in str(_raises(config, "hidden_size"))


@pytest.mark.parametrize("value", ["4096", 4096.0, True, 0, -1, [4096]])
def test_ill_typed_hidden_size(value: Any) -> None:
    error = _raises({**load("meta-llama-3-8b.json"), "hidden_size": value}, "hidden_size")
    assert "integer" in str(error)


@pytest.mark.parametrize(
    ("key", "value"),
    [("tie_word_embeddings", "false"), ("attention_dropout", 1.5), ("attention_dropout", "0.1"),
     ("num_key_value_heads", 5), ("num_attention_heads", 24)],
)
def test_ill_typed_or_inconsistent_llama_keys(key: str, value: Any) -> None:
    _raises({**load("meta-llama-3-8b.json"), key: value}, key)


def test_gpt2_missing_n_embd() -> None:
    config = load("gpt2.json")
    del config["n_embd"]
    _raises(config, "n_embd")


def test_mixtral_top_k_above_experts() -> None:
    _raises({**load("mixtral-8x7b-v0.1.json"), "num_experts_per_tok": 9}, "num_experts_per_tok")


def test_qwen2_moe_mlp_only_layers_refused() -> None:
    _raises({**load("qwen1.5-moe-a2.7b-chat-gptq-int4.json"), "mlp_only_layers": [0, 1]}, "mlp_only_layers")


def test_deepseek_q_lora_rank_must_be_present() -> None:
    config = load("deepseek-v2-lite.json")
    del config["q_lora_rank"]
    _raises(config, "q_lora_rank")


def test_partial_llama_biases_refused() -> None:
    _raises({**load("meta-llama-3-8b.json"), "attention_bias": True}, "attention_bias")


def test_config_must_be_an_object() -> None:
    _raises([1, 2, 3], None)


def test_input_is_not_mutated() -> None:
    config = load("deepseek-v2-lite.json")
    before = copy.deepcopy(config)
    shorthand_from_hf(config, source="x")
    assert config == before


def test_a_config_without_model_type_names_model_type(tmp_path: Path) -> None:
    """An HF config.json that lost its model_type is read as one and told so (the key, what it is
    for, an example and the supported values), not as a shorthand missing ``layers``; a
    shorthand still gets its own error."""
    from autoplace.specs.model import load_model

    config = json.loads((DATA / "meta-llama-3-8b.json").read_text())
    del config["model_type"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(SpecError) as info:
        load_model(path)
    assert info.value.field == "model_type" and "required key is missing" in str(info.value)
    assert '"model_type": "llama"' in str(info.value) and "qwen3" in str(info.value) and "layers" not in str(info.value)
    path.write_text(json.dumps({"hidden": 512, "heads": 8}))  # a shorthand without layers
    with pytest.raises(SpecError) as info:
        load_model(path)
    assert info.value.field == "layers"
