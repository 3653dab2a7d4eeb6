"""What eager blocks keep for backward, measured with PyTorch's ``MemTracker`` on fake tensors.

Ground truth for the activation term of :mod:`autoplace.cost.layers` (issue 35, item 5): a
Hugging Face ``LlamaForCausalLM`` (transformers' own modelling code, SDPA attention) and an
MPT-style model (MosaicML's block as llm-foundry builds MPT-7B: LayerNorm without bias, one fused
``Wqkv`` projection, flash attention, a 4h GeLU MLP, no dropout, tied head) are run for one
training step in bf16 on fake tensors (``FakeTensorMode``: shapes and dtypes, no storage) under
``torch.distributed._tools.mem_tracker.MemTracker``, which files every live storage as
parameter, gradient, activation or temporary.  Two numbers per shape:

* ``per_layer``: the activations one more decoder layer adds once the loss exists (the tracker's
  activation bytes with ``L + 1`` layers minus with ``L``), i.e. what the layer's autograd
  nodes saved, every storage once however many nodes share it;
* ``peak``: the highest activations + temporaries from the loss to the end of the last layer's
  backward -- the cost model's "start of backward" phase; later moments trade activations for
  gradients (the embedding's dense ``[vocab, hidden]`` gradient, a tied head's held beside it),
  which the state terms and the end-of-backward phase cost.

Nothing here is fitted: the cost model's formula comes from what each op saves; these numbers
only check it (tests/test_eager_activations.py, benchmarks/eager_activations.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoplace.errors import BenchmarkError

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise BenchmarkError("autoplace.fidelity needs PyTorch: pip install torch (CPU wheel is enough)") from exc

FAMILIES = ("llama", "mpt")


@dataclass(frozen=True)
class Shape:
    """A tiny model with a real model's proportions: micro-batch, sequence and widths."""

    batch: int
    seq: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    layers: int = 2

    def hf_config(self, family: str, layers: int | None = None) -> dict[str, Any]:
        """The Hugging Face ``config.json`` of this shape (what autoplace reads as the spec)."""
        n = self.layers if layers is None else layers
        if family == "llama":
            return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": self.hidden,
                    "intermediate_size": self.ffn, "num_attention_heads": self.heads,
                    "num_key_value_heads": self.kv_heads, "num_hidden_layers": n, "vocab_size": self.vocab,
                    "max_position_embeddings": self.seq, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
        if family == "mpt":
            return {"model_type": "mpt", "architectures": ["MPTForCausalLM"], "d_model": self.hidden,
                    "n_heads": self.heads, "n_layers": n, "expansion_ratio": self.ffn / self.hidden,
                    "vocab_size": self.vocab, "max_seq_len": self.seq, "no_bias": True,
                    "attn_config": {"alibi": True, "kv_n_heads": self.kv_heads}}
        raise BenchmarkError(f"family {family!r} is not built; valid: {', '.join(FAMILIES)}")


@dataclass(frozen=True)
class Saved:
    """Bytes the tracker saw (see the module docstring)."""

    per_layer: float
    peak: float


class MptBlock(nn.Module):
    """MPT's block (llm-foundry ``MPTBlock`` with ``no_bias``, ``low_precision_layernorm``,
    ``resid_pdrop=0``): pre-norm attention through one fused ``Wqkv``, then a GeLU MLP.  ALiBi is
    applied inside the flash kernel (flash-attn's ``alibi_slopes``), which keeps nothing for it, so
    plain causal SDPA stands for it.  q, k and v are made contiguous as llm-foundry's flash path
    does when it unpads them (``index_first_axis`` copies); the kernel then writes its output in
    the (batch, seq, heads, dim) layout the CUDA flash kernel uses, which the output projection
    reads without a copy."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.heads, self.kv, self.dim = s.heads, s.kv_heads, s.hidden // s.heads
        self.norm_1 = nn.LayerNorm(s.hidden, bias=False)
        self.Wqkv = nn.Linear(s.hidden, s.hidden + 2 * s.kv_heads * self.dim, bias=False)
        self.out_proj = nn.Linear(s.hidden, s.hidden, bias=False)
        self.norm_2 = nn.LayerNorm(s.hidden, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.ffn, bias=False)
        self.act = nn.GELU(approximate="none")
        self.down_proj = nn.Linear(s.ffn, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.Wqkv(self.norm_1(x)).split([h, self.kv * self.dim, self.kv * self.dim], dim=-1)
        q, k, v = (y.reshape(b, t, -1, self.dim).contiguous().transpose(1, 2) for y in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.heads)
        x = x + self.out_proj(a.transpose(1, 2).reshape(b, t, h))
        return x + self.down_proj(self.act(self.up_proj(self.norm_2(x))))


class MptModel(nn.Module):
    """Embedding, MPT blocks, final norm and the tied head (MPT ties ``wte`` to the output)."""

    def __init__(self, s: Shape, layers: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(s.vocab, s.hidden)
        self.blocks = nn.ModuleList(MptBlock(s) for _ in range(layers))
        self.norm_f = nn.LayerNorm(s.hidden, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.norm_f(x), self.wte.weight)


def _build(family: str, s: Shape, layers: int) -> nn.Module:
    torch.set_default_dtype(torch.bfloat16)  # bf16 parameters, as FSDP's param_dtype computes
    try:
        if family == "llama":
            from transformers import LlamaConfig, LlamaForCausalLM

            cfg = {k: v for k, v in s.hf_config(family, layers).items() if k not in ("model_type", "architectures")}
            return LlamaForCausalLM(LlamaConfig(**{**cfg, "attn_implementation": "sdpa"}))
        s.hf_config(family)  # names the valid families
        return MptModel(s, layers)
    finally:
        torch.set_default_dtype(torch.float32)


def _loss(family: str, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The training loss as the frameworks compute it: transformers' ``ForCausalLMLoss`` (fp32
    logits, cross-entropy; Trainer keeps only the loss), llm-foundry's cross-entropy of the
    logits upcast to fp32 (its autocast does it)."""
    if family == "llama":
        return model(input_ids=tokens, labels=tokens).loss
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())


def _tracker() -> Any:
    from torch.distributed._tools.mem_tracker import MemTracker

    class ActivationSide(MemTracker):  # type: ignore[misc, valid-type]
        """MemTracker that also keeps the highest activations + temporaries it saw."""

        side_peak = 0
        frozen = False  # set once the last layer's backward is done

        def _update_peak_stats(self, peak_state: Any) -> None:
            super()._update_peak_stats(peak_state)
            for snap in () if self.frozen else self._curr_mem_snap.values():
                side = sum(v for k, v in snap.items() if getattr(k, "value", k) in ("Activation", "Temp"))
                self.side_peak = max(self.side_peak, side)

    return ActivationSide()


def _step(family: str, s: Shape, layers: int) -> tuple[float, float]:
    """(activation bytes once the loss exists, the step's activation-side peak) of ``layers`` layers."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = _build(family, s, layers)
        tokens = torch.randint(0, s.vocab, (s.batch, s.seq))
        tracker = _tracker()
        tracker.track_external(model)
        stack: Any = model.get_submodule("model.layers" if family == "llama" else "blocks")

        def freeze(*_: Any) -> None:
            tracker.frozen = True

        stack[-1].register_full_backward_hook(freeze)
        with tracker:
            loss = _loss(family, model, tokens)
            after = sum(v for snap in tracker.get_tracker_snapshot("current").values()
                        for k, v in snap.items() if getattr(k, "value", k) == "Activation")
            loss.backward()
    return float(after), float(tracker.side_peak)


def measure(family: str, s: Shape) -> Saved:
    """One step of ``s.layers`` and of ``s.layers + 1`` layers (see the module docstring)."""
    base, peak = _step(family, s, s.layers)
    more, _ = _step(family, s, s.layers + 1)
    return Saved(per_layer=more - base, peak=peak)
