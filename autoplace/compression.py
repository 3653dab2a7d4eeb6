"""Communication compression as a placement choice: what each option moves, where it applies,
and the accuracy risk every plan that uses it carries.

The byte and time terms live in :mod:`autoplace.cost.compress`; this module is the facts a
report, an emitter or the search needs without numpy.  Every option is opt-in
(``--allow compress``): each changes the numbers the optimizer sees, so a plan only uses one
when the user accepts that trade.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplace.plan import POWERSGD_RANKS, Config


@dataclass(frozen=True)
class Compression:
    """One compression option.

    Attributes:
        name: the ``compress`` value of a plan.
        moves: what it changes on the wire, in words.
        risk: its known accuracy risk, as its authors report it.
        source: the paper or documentation behind the numbers.
    """

    name: str
    moves: str
    risk: str
    source: str


COMPRESSIONS: dict[str, Compression] = {
    "bf16": Compression(
        "bf16", "gradients reduced in bf16 instead of fp32 (half the reduction bytes)",
        "low: bf16 sums lose precision as the data-parallel group grows; torchtitan and Megatron default to "
        "fp32 reduction for that reason",
        "PyTorch FSDP2 MixedPrecisionPolicy(reduce_dtype); Megatron-LM --grad-reduce-in-bf16"),
    "zeropp": Compression(
        "zeropp", "ZeRO++: int8 weight all-gathers (qwZ), a node-local secondary weight shard so backward "
        "gathers stay inside the node (hpZ), int4 gradient reduce-scatter (qgZ): cross-node volume 3M -> 0.75M",
        "low to moderate: block-quantized weights and gradients; the paper's convergence runs match ZeRO-3's "
        "loss on GPT models (Wang et al. 2023); validate on your own model",
        "Wang et al. 2023, ZeRO++: Extremely Efficient Collective Communication for Giant Model Training; "
        "DeepSpeed zero_quantized_weights / zero_hpz_partition_size / zero_quantized_gradients"),
    "powersgd": Compression(
        "powersgd", "DDP gradients as rank-r factors P (n x r) and Q (m x r) per weight matrix, with error "
        "feedback; vectors (norms, biases) all-reduced as they are",
        "moderate: a lossy low-rank gradient; Vogels et al. match full-precision accuracy on ResNet and LSTM "
        "with error feedback and a warm-up of uncompressed steps (start_powerSGD_iter), not shown for LLMs at scale",
        "Vogels et al. 2019, PowerSGD (NeurIPS); torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook"),
}


# every (compress, powersgd_rank) the search and explain try, "none" first
CHOICES: tuple[tuple[str, int], ...] = (("none", 0), ("bf16", 0), ("zeropp", 0),
                                        *(("powersgd", r) for r in POWERSGD_RANKS))


def label(compress: str, rank: int) -> str:
    """``bf16``, ``zeropp``, ``powersgd r4``: an option with its rank."""
    return f"{compress} r{rank}" if rank else compress


def risk(config: Config) -> str | None:
    """The accuracy risk ``config``'s compression carries, or None without compression."""
    option = COMPRESSIONS.get(config.compress)
    return None if option is None else option.risk


def applies(config: Config, reduce_bytes: float) -> bool:
    """Whether ``config``'s compression is meaningful for it (the rules the search and
    ``evaluate`` enforce): bf16 when the recipe reduces wider than 2 bytes; ZeRO++ with ZeRO-3
    over more than one rank and no replica groups (DeepSpeed has no HSDP); PowerSGD with DDP
    (zero=0) and a positive rank."""
    c = config.compress
    if c == "none":
        return config.powersgd_rank == 0
    if c == "bf16":
        return reduce_bytes > 2 and config.powersgd_rank == 0
    if c == "zeropp":
        return config.zero == 3 and config.dp_shard * config.cp > 1 and config.dp_replicate == 1 \
            and config.powersgd_rank == 0
    return config.zero == 0 and config.dp > 1 and config.powersgd_rank > 0
