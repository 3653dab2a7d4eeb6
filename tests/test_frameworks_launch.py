"""A bundle's launch line runs: the FSDP2 bundle's launch_torchrun.sh starts torchrun on 2 gloo ranks,
which runs the bundle's train_fsdp2.py, which imports the plan's module and trains a tiny
Hugging Face Llama (from its saved config) for two steps of the plan's batch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from autoplace.bundle import emit
from autoplace.emit.launch import Launch
from tests.test_emit_fsdp import _free_port
from tests.test_emit_plans import cpu_cluster, make_plan, small_model

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")


@pytest.mark.slow
def test_the_fsdp2_bundle_launches_and_trains(tmp_path) -> None:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, use_cache=False)
    config.save_pretrained(tmp_path / "hf")
    model, cluster = small_model("fp32", layers=4, batch=8, seq_len=32), cpu_cluster(2)
    written = emit(make_plan("zero=3,mbs=2,recompute_layers=f:n:s:f", model, cluster), model, cluster,
                   ["fsdp", "torchrun"], tmp_path / "bundle", launch=Launch(master_port=_free_port()))
    assert {"fsdp2_parallelize.py", "train_fsdp2.py", "launch_torchrun.sh"} <= set(written)
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(written["launch_torchrun.sh"]), "--model", str(tmp_path / "hf"),
                           "--from-config", "--steps", "2"], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 1: done" in done.stdout
