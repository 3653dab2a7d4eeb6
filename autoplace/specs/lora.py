"""Which Hugging Face module each LoRA role names, per model family.

PEFT's ``target_modules`` match module names, so a role (``q``, ``k``, ``v``, ``o``, ``gate``,
``up``, ``down``; :data:`autoplace.specs.model.LORA_ROLES`) adapts whatever module of the
family's Hugging Face implementation carries that name: one fused ``query_key_value`` serves
q, k and v at once (one adapter of rank r on the fused matrix, not three), and GPT-2's
``c_proj`` is both attention's output and the MLP's down projection, so targeting either
adapts both.  The names are those of transformers 5's modelling files
(``transformers/models/<family>/modeling_<family>.py``); a shorthand model with no family
uses Llama's.
"""

from __future__ import annotations

from collections.abc import Iterable

Roles = dict[str, tuple[str, ...]]
_LLAMA: Roles = {
    "q": ("q_proj",), "k": ("k_proj",), "v": ("v_proj",), "o": ("o_proj",),
    "gate": ("gate_proj",), "up": ("up_proj",), "down": ("down_proj",),
}
_GPT2: Roles = {"q": ("c_attn",), "k": ("c_attn",), "v": ("c_attn",), "o": ("c_proj",), "up": ("c_fc",), "down": ("c_proj",)}
_NEOX: Roles = {"q": ("query_key_value",), "k": ("query_key_value",), "v": ("query_key_value",), "o": ("dense",),
         "up": ("dense_h_to_4h",), "down": ("dense_4h_to_h",)}
# DeepSeek's MLA: the query (or its down and up projections) and the shared key-value
# down (with the decoupled rope key) and up projections
_DEEPSEEK: Roles = {**_LLAMA, "q": ("q_proj", "q_a_proj", "q_b_proj"), "k": ("kv_a_proj_with_mqa", "kv_b_proj"),
             "v": ("kv_a_proj_with_mqa", "kv_b_proj")}

HF_MODULES: dict[str, Roles] = {
    "gpt2": _GPT2,
    "gpt_bigcode": _GPT2,
    "gpt_neox": _NEOX,
    "falcon": _NEOX,
    "RefinedWebModel": _NEOX,
    "RefinedWeb": _NEOX,
    "bloom": _NEOX,
    "mpt": {"q": ("Wqkv",), "k": ("Wqkv",), "v": ("Wqkv",), "o": ("out_proj",), "up": ("up_proj",),
            "down": ("down_proj",)},
    "phi3": {"q": ("qkv_proj",), "k": ("qkv_proj",), "v": ("qkv_proj",), "o": ("o_proj",),
             "gate": ("gate_up_proj",), "up": ("gate_up_proj",), "down": ("down_proj",)},
    "starcoder2": {**_LLAMA, "up": ("c_fc",), "down": ("c_proj",)},
    "deepseek_v2": _DEEPSEEK,
    "deepseek_v3": _DEEPSEEK,
}


# Families whose routed experts transformers 5 stores as fused 3-D parameters and PEFT 0.21
# converts v4 target names for (peft/utils/transformers_weight_conversion.py, the "qwen2_moe"
# pattern of transformers' _MODEL_TO_CONVERSION_PATTERN): "gate_proj", "up_proj" and "down_proj"
# then adapt every routed expert (the fused gate_up with rank 2r, down with rank r) and no longer
# the dense MLP or shared-expert modules of those names.  Checked against PEFT's own count
# (tests/test_lora.py).  Mixtral's v4 expert names are w1/w2/w3, so these roles miss its experts.
PEFT_EXPERT_FAMILIES = frozenset({"qwen3_moe", "deepseek_v2", "deepseek_v3"})


def role_modules(family: str | None) -> dict[str, tuple[str, ...]]:
    """Module names of each role in ``family`` (a Hugging Face model_type; None: Llama's)."""
    return HF_MODULES.get(family or "", _LLAMA)


def target_modules(family: str | None, roles: Iterable[str]) -> list[str]:
    """PEFT's ``target_modules`` for ``roles``: every module name they name, sorted."""
    names = role_modules(family)
    return sorted({n for r in roles for n in names.get(r, ())})


def adapted(family: str | None, roles: Iterable[str], role: str) -> bool:
    """Whether the module of ``role`` gets an adapter when ``roles`` are targeted (by name)."""
    mods = set(target_modules(family, roles))
    return any(n in mods for n in role_modules(family).get(role, ()))
