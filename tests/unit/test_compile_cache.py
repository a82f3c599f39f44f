"""A warm restart takes the compiled decode from the compile caches: a second process, whose KV cache
holds a different number of blocks (on CUDA the engine sizes it from the free memory, which moves
between runs), finds every graph in inductor's and AOTAutograd's caches and compiles none."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import write_hf_model

CHILD = """
import json, sys
import torch
from torch._dynamo.utils import counters
from colocate.rollout.native.engine import NativeEngine
from colocate.rollout.protocol import SamplingParams

engine = NativeEngine(sys.argv[1], compile_decode=True, block_size=4, max_kv_tokens=int(sys.argv[2]))
out = engine.generate([[2, 3, 4, 5], [6, 7, 8]], SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=0.0))
print(json.dumps({"counters": {k: dict(counters[k]) for k in ("inductor", "aot_autograd", "stats")},
                  "ids": [c.output_ids for c in out]}))
"""


def test_the_compile_caches_are_on():
    import torch._functorch.config
    import torch._inductor.config

    assert torch._inductor.config.fx_graph_cache and torch._functorch.config.enable_autograd_cache


@pytest.mark.slow
def test_a_restart_with_another_kv_cache_size_compiles_nothing(tmp_path):
    path, _ = write_hf_model(tmp_path, "qwen3")
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        "CUDA_VISIBLE_DEVICES": "",
    }

    def run(kv_tokens: int) -> dict:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(path), str(kv_tokens)], env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    cold, warm = run(512), run(516)  # 128 blocks, then 129
    graphs = cold["counters"]["stats"]["unique_graphs"]
    assert graphs == 3  # embedding, the layer every layer shares, head
    assert cold["counters"]["inductor"]["fxgraph_cache_miss"] == graphs
    assert warm["counters"]["stats"]["unique_graphs"] == graphs
    assert warm["counters"]["inductor"].get("fxgraph_cache_hit") == graphs
    assert "fxgraph_cache_miss" not in warm["counters"]["inductor"]
    assert warm["counters"]["aot_autograd"].get("autograd_cache_hit") == graphs
    assert warm["ids"] == cold["ids"]
    assert torch.tensor(warm["ids"]).shape == (2, 3)
