"""The emitted FSDP2 module on Hugging Face models: it finds their block lists, and a tiny
``LlamaForCausalLM`` (built from a ``LlamaConfig``, no download) trains one step on 2 gloo ranks
exactly as one process does on the whole batch."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from autoplace.frameworks.fsdp import emit_fsdp_module
from tests.test_emit_fsdp import _free_port
from tests.test_emit_plans import cpu_cluster, make_plan, small_model

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")

PLAN = "zero=3,recompute_layers=f:n:s:f"  # FSDP2 over 2 ranks, a different recompute choice per block


def _module(tmp_path: Path, text: str = PLAN, world: int = 2, layers: int = 4) -> Path:
    model, cluster = small_model("fp32", layers=layers, batch=4), cpu_cluster(world)
    path = tmp_path / "fsdp2_parallelize.py"
    path.write_text(emit_fsdp_module(make_plan(text, model, cluster), model, cluster))
    return path


def _load(path: Path, name: str = "fsdp2_parallelize") -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_llama(layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(config)


def _worker(rank: int, world: int, path: str, port: int, out: str) -> None:
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    module = _load(Path(path))
    torch.manual_seed(0)
    reference, model = _tiny_llama(), _tiny_llama()
    model.load_state_dict(reference.state_dict())
    batch = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    mesh = module.build_mesh("cpu")
    dp_rank = mesh["dp_replicate"].get_local_rank() * module.DP_SHARD + mesh["dp_shard"].get_local_rank()
    module.parallelize(model, mesh)  # finds model.model.layers by itself
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    shard = batch.chunk(module.DP_REPLICATE * module.DP_SHARD)[dp_rank]
    model(input_ids=shard, labels=shard).loss.backward()
    optimizer.step()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    reference(input_ids=batch, labels=batch).loss.backward()
    ref_optimizer.step()
    wrapped = [type(layer).__name__ for layer in model.model.layers]
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    edges = [isinstance(m.weight, DTensor) for m in (model.get_input_embeddings(), model.get_output_embeddings())]
    with torch.no_grad():
        result = {"after": model(input_ids=batch, labels=batch).loss.item(),
                  "expected": reference(input_ids=batch, labels=batch).loss.item(), "sharded": sharded,
                  "edges": edges,
                  "wrapped": wrapped}
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("text", [PLAN, "tp=2,sp=true,zero=0,recompute_layers=f:n:s:f"])
def test_fsdp2_module_trains_a_hugging_face_llama_like_one_process(text: str, tmp_path: Path) -> None:
    """FSDP2 over 2 ranks; TP with SP over 2 ranks (Hugging Face's attention takes its input by keyword,
    the embedding and head are vocabulary-parallel)."""
    mp = pytest.importorskip("torch.multiprocessing")
    path = _module(tmp_path, text)
    mp.spawn(_worker, args=(2, str(path), _free_port(), str(tmp_path / "out")), nprocs=2)
    for rank in range(2):
        result = json.loads((tmp_path / f"out.{rank}").read_text())
        assert result["after"] == pytest.approx(result["expected"], rel=1e-5), rank
        # FSDP2: every parameter is a shard; TP: the embedding and head are vocabulary-parallel DTensors
        assert result["sharded"] if text == PLAN else result["edges"] == [True, True]
        # blocks 0 (full), 2 (selective) and 3 (full) are checkpoint-wrapped, block 1 is not
        assert ["CheckpointWrapper" in name for name in result["wrapped"]] == [True, False, True, True]


def test_block_lists_of_hugging_face_models_are_found(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM

    module = _load(_module(tmp_path, "zero=0", world=1, layers=2))
    assert module.find_blocks(_tiny_llama(2))[0] == "model.layers"
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32))
    assert module.find_blocks(gpt2)[0] == "transformer.h"
    neox = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=64))
    assert module.find_blocks(neox)[0] == "gpt_neox.layers"


def test_a_model_without_a_known_block_list_gets_a_clear_message(tmp_path: Path) -> None:
    import torch
    from torch import nn

    module = _load(_module(tmp_path, "zero=0", world=1, layers=2))
    odd = nn.Module()
    odd.trunk = nn.Module()
    odd.trunk.stack = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    with pytest.raises(ValueError, match=r"Module has no nn.ModuleList / nn.ModuleDict of blocks at any of layers, "
                                         r"model.layers, transformer.h.*pass parallelize\(model, blocks="):
        module.parallelize(odd, mesh=object())
    assert module.find_blocks(odd, "trunk.stack")[1] is odd.trunk.stack
    short = nn.Module()
    short.layers = nn.ModuleList([nn.Linear(4, 4)])
    with pytest.raises(ValueError, match="model.layers has 1 blocks but the plan was made for 2"):
        module.apply_ac(short)
    del torch
