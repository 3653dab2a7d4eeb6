"""What each supported framework can run and how it stores the training states.

One table read by the emitters (which write the configs) and by :mod:`autoplace.frameworks`
(which searches the plans each framework can express); it imports neither.
"""

from __future__ import annotations

# ZeRO-style frameworks keep 16-bit weights and an fp32 master copy; FSDP2-based ones keep fp32
# shards whatever the compute dtype (MixedPrecisionPolicy casts on all-gather)
ZERO_FRAMEWORKS = ("deepspeed", "megatron")
FSDP2_FRAMEWORKS = ("torchtitan", "fsdp", "accelerate")
FRAMEWORKS = ZERO_FRAMEWORKS + FSDP2_FRAMEWORKS
BF16_RECIPES = ("bf16", "bf16-fsdp2", "bf16-fp32-grads")  # specs.model recipe names
# search features the framework never has (solvers.base.FEATURES) and degrees it pins to 1
DENIED_FEATURES = {"deepspeed": {"cp", "interleave"}, "accelerate": {"interleave", "ep"}, "fsdp": {"cp", "ep", "interleave"}}
PINNED_DEGREES = {"accelerate": {"pp": 1, "ep": 1}, "fsdp": {"pp": 1, "cp": 1, "ep": 1}}
# frameworks that recompute every block alike: the search runs once per mode they offer
UNIFORM_RECOMPUTE = {"accelerate": ("none", "full"), "deepspeed": ("none", "selective", "full")}
UNIFORM_MODES = ("none", "selective", "full")


def bf16_recipe(framework: str) -> str:
    """The bf16 recipe (specs.model) ``framework`` implements.  Megatron-LM under ``--bf16``
    accumulates and all-reduces gradients in fp32 (its validate_args sets
    accumulate_allreduce_grads_in_fp32 unless --grad-reduce-in-bf16, i.e. compress=bf16)."""
    if framework == "megatron":
        return "bf16-fp32-grads"
    return "bf16-fsdp2" if framework in FSDP2_FRAMEWORKS else "bf16"
