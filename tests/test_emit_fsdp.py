"""The emitted FSDP2 module runs for real: a tiny model trains one step on gloo ranks on CPU.

Every run also trains an unsharded copy of the same model on the whole global batch in the
same process; after one SGD step both must give the same loss on that batch (gradient
integrity: the parallel update is the single-device update).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import socket
from pathlib import Path
from typing import Any

import pytest

from autoplace.errors import EmitError
from autoplace.frameworks.fsdp import emit_fsdp_module
from tests.test_emit_plans import CLUSTER16, MODEL, cpu_cluster, make_plan, small_model

MODULE_PLANS_2 = ["zero=3,recompute_layers=f:s:n:f", "tp=2,zero=0", "tp=2,sp=false,zero=0,recompute=selective",
                  "dp_replicate=2,zero=0", "zero=2,recompute=full"]
MODULE_PLANS_4 = ["tp=2,dp_shard=2,zero=3,recompute=full", "dp_replicate=2,dp_shard=2,zero=3"]


def tiny_spec(world: int):
    """A 4-layer fp32 model spec on ``world`` CPU ranks, global batch 4 (one sequence per DP rank at most)."""
    model = small_model("fp32", layers=4, batch=4)
    return model, cpu_cluster(world)


def _tiny_model(torch: Any, nn: Any, F: Any) -> Any:
    """A Llama-shaped model: RMSNorm, GQA-free attention with -1 head reshapes, SwiGLU, .layers blocks."""

    class Attention(nn.Module):
        def __init__(self, dim: int, heads: int) -> None:
            super().__init__()
            self.head_dim = dim // heads
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.wq, self.wk, self.wv))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    class FeedForward(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.w1, self.w3 = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
            self.w2 = nn.Linear(2 * dim, dim, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
            self.attention, self.feed_forward = Attention(dim, 4), FeedForward(dim)

        def forward(self, x):
            h = x + self.attention(self.attention_norm(x))
            return h + self.feed_forward(self.ffn_norm(h))

    class Tiny(nn.Module):
        def __init__(self, vocab: int = 64, dim: int = 32) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(Block(dim) for _ in range(4))
            self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

        def forward(self, tokens):
            h = self.tok_embeddings(tokens)
            for layer in self.layers:
                h = layer(h)
            return self.output(self.norm(h))

    return Tiny


def _worker(rank: int, world: int, paths: list[str], port: int, out: str) -> None:
    import os

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.tensor import DTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    Tiny = _tiny_model(torch, nn, F)

    def loss_of(model, tokens):
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    results = []
    for i, path in enumerate(paths):
        spec = importlib.util.spec_from_file_location(f"fsdp2_parallelize_{i}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        torch.manual_seed(0)
        reference, model = Tiny(), Tiny()
        model.load_state_dict(reference.state_dict())
        batch = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
        mesh = module.build_mesh("cpu")
        dp_rank = mesh["dp_replicate"].get_local_rank() * module.DP_SHARD + mesh["dp_shard"].get_local_rank()
        module.parallelize(model, mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        loss_of(model, batch.chunk(module.DP_REPLICATE * module.DP_SHARD)[dp_rank]).backward()
        optimizer.step()
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
        loss_of(reference, batch).backward()
        ref_optimizer.step()
        # before the next forward: without resharding, FSDP2 leaves unsharded parameters registered after it
        distributed = any(isinstance(p, DTensor) for p in model.parameters())
        with torch.no_grad():
            results.append({"after": loss_of(model, batch).item(), "expected": loss_of(reference, batch).item(),
                            "distributed": distributed})
    Path(f"{out}.{rank}").write_text(json.dumps(results))
    dist.barrier()  # leave together: tearing gloo down under a peer still talking aborts it
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(plans: list[str], world: int, tmp_path: Path) -> None:
    mp = pytest.importorskip("torch.multiprocessing")
    model, cluster = tiny_spec(world)
    paths = []
    for i, text in enumerate(plans):
        path = tmp_path / f"fsdp2_parallelize_{i}.py"
        path.write_text(emit_fsdp_module(make_plan(text, model, cluster), model, cluster))
        paths.append(str(path))
    mp.spawn(_worker, args=(world, paths, _free_port(), str(tmp_path / "out")), nprocs=world)
    for rank in range(world):
        for text, result in zip(plans, json.loads((tmp_path / f"out.{rank}").read_text()), strict=True):
            assert result["after"] == pytest.approx(result["expected"], rel=1e-5), (text, rank)
            assert result["distributed"], text  # TP or FSDP really applied (parameters are DTensors)


@pytest.mark.slow
def test_fsdp2_module_trains_like_one_device_on_2_ranks(tmp_path) -> None:
    """ZeRO-3 with per-layer recompute, TP with and without SP, DDP, ZeRO-2 (~8 s)."""
    pytest.importorskip("torch.distributed.fsdp")
    _run(MODULE_PLANS_2, 2, tmp_path)


@pytest.mark.slow
def test_fsdp2_module_trains_like_one_device_on_4_ranks(tmp_path) -> None:
    """2-D meshes: FSDP x TP, and HSDP (2 replicas x 2 shards) (~15 s)."""
    pytest.importorskip("torch.distributed.fsdp")
    _run(MODULE_PLANS_4, 4, tmp_path)


def test_module_states_the_plan_and_compiles_whatever_the_model_is_called() -> None:
    model = small_model(name='m"""\n\'\'\'; import os; os.system("touch /tmp/pwned") #')
    plan = make_plan("zero=3,preset=hsdp,offload_optimizer=cpu,offload_params=cpu,recompute=selective", model,
                     CLUSTER16)
    text = emit_fsdp_module(plan, model, CLUSTER16)
    tree = ast.parse(text)
    constants = {t.id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant | ast.Tuple)}
    assert constants["MODEL_NAME"] == model.name
    assert (constants["DP_REPLICATE"], constants["DP_SHARD"], constants["TP"]) == (2, 8, 1)
    assert constants["RESHARD_AFTER_FORWARD"] is True and constants["OFFLOAD_TO_CPU"] is True
    assert constants["RECOMPUTE"] == ("selective",) * 8
    assert "import torch" not in Path(emit_fsdp_module.__code__.co_filename).read_text().split("_TEMPLATE")[0]


def test_what_the_fsdp_module_does_not_apply_raises() -> None:
    for text, message in [("pp=2,zero=3", "use torchtitan"), ("cp=2,zero=3", "use torchtitan"),
                          ("zero=1", "optimizer-only"), ("zero=3,offload_optimizer=nvme,offload_params=nvme", "NVMe")]:
        with pytest.raises(EmitError, match=message):
            emit_fsdp_module(make_plan(text, MODEL, CLUSTER16), MODEL, CLUSTER16)


# ---------------------------------------------------------------------------------------
# Compression: bf16 reduction and PowerSGD, run on 2 gloo ranks


def _compress_worker(rank: int, world: int, paths: list[str], port: int, out: str) -> None:
    """Train each emitted module 3 SGD steps, recording the dtype of every gradient collective."""
    import os

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    Tiny = _tiny_model(torch, nn, F)
    dtypes: set[str] = set()

    def recording(collective):
        def wrapped(*args, **kwargs):
            tensor = args[0] if args else kwargs.get("tensor", kwargs.get("output"))
            dtypes.add(str(tensor.dtype))
            return collective(*args, **kwargs)
        return wrapped

    # FSDP2 reduce-scatters with reduce_scatter_single and all-reduces HSDP/DDP replicas with all_reduce
    dist.all_reduce, dist.reduce_scatter_single = recording(dist.all_reduce), recording(dist.reduce_scatter_single)
    results = []
    for i, path in enumerate(paths):
        spec = importlib.util.spec_from_file_location(f"fsdp2_compress_{i}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.POWERSGD_START_ITER = 2  # compress from the third backward (error feedback needs two plain ones)
        torch.manual_seed(0)
        model = module.parallelize(Tiny(), module.build_mesh("cpu"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        batch = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(rank))
        dtypes.clear()
        losses = []
        for _ in range(3):
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        state = getattr(model, "powersgd_state", None)
        results.append({"dtypes": sorted(dtypes), "losses": losses, "type": type(model).__name__,
                        "hook": model._get_ddp_logging_data().get("comm_hook") if state else None,
                        "stats": list(state.compression_stats()[1:]) if state else None,
                        "iter": state.iter if state else None})
    Path(f"{out}.{rank}").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_module_reduces_in_bf16_and_compresses_with_powersgd_on_2_ranks(tmp_path) -> None:
    """compress=bf16 moves bf16 gradients (fp32 without it), under FSDP and under DDP-style
    replication; compress=powersgd runs DDP with torch's PowerSGD hook, which compresses once
    its warm-up is over (~10 s)."""
    mp = pytest.importorskip("torch.multiprocessing")
    model, cluster = tiny_spec(2)
    plans = ["zero=3", "zero=3,compress=bf16", "dp_replicate=2,zero=0,compress=bf16",
             "dp_replicate=2,zero=0,compress=powersgd,powersgd_rank=2"]
    paths = []
    for i, text in enumerate(plans):
        path = tmp_path / f"fsdp2_compress_{i}.py"
        path.write_text(emit_fsdp_module(make_plan(text, model, cluster), model, cluster))
        paths.append(str(path))
    mp.spawn(_compress_worker, args=(2, paths, _free_port(), str(tmp_path / "out")), nprocs=2)
    for rank in range(2):
        plain, fsdp_bf16, ddp_bf16, powersgd = json.loads((tmp_path / f"out.{rank}").read_text())
        assert plain["dtypes"] == ["torch.float32"]
        assert fsdp_bf16["dtypes"] == ddp_bf16["dtypes"] == ["torch.bfloat16"]
        assert powersgd["type"] == "DistributedDataParallel" and powersgd["hook"] == "powerSGD_hook"
        before, after = powersgd["stats"]  # elements before and after compression in the last step
        assert powersgd["iter"] == 3 and 0 < after < before
        for result in (plain, fsdp_bf16, ddp_bf16, powersgd):
            assert result["losses"][-1] < result["losses"][0], result  # it trains


def test_module_states_the_compression() -> None:
    model, cluster = tiny_spec(2)
    for text, constants in [("zero=3", {"COMPRESS": "none", "POWERSGD_RANK": 0}),
                            ("dp_replicate=2,zero=0,compress=powersgd,powersgd_rank=2",
                             {"COMPRESS": "powersgd", "POWERSGD_RANK": 2, "POWERSGD_START_ITER": 1000})]:
        tree = ast.parse(emit_fsdp_module(make_plan(text, model, cluster), model, cluster))
        found = {t.id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
        assert {k: found[k] for k in constants} == constants
    for text, message in [("tp=2,zero=0,compress=powersgd", "use tp=1 or compress=bf16"),
                          ("zero=3,compress=powersgd", "needs zero=0"), ("zero=3,compress=zeropp", "plan with compress=none")]:
        with pytest.raises(EmitError, match=message):
            emit_fsdp_module(make_plan(text, MODEL, CLUSTER16), MODEL, CLUSTER16)
