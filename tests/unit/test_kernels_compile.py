"""Every Triton kernel compiles for sm_90 (H100/H200) and sm_100 (B200) on a machine without a GPU
(tests/compile_for_gpu.py, in a process of its own without the interpreter): the compiler's errors,
register spills and a lost tensor-core path show up here before any device time. On GPU machines
the `gpu` tests run the kernels themselves."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow  # every kernel compiled twice: a minute or more on 2 cores

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNELS = {
    "matmul_kernel",
    "chunk_sum_kernel",
    "rms_kernel",
    "silu_mul_kernel",
    "attend",
    "rotary",
    "decode",
    "merge",
    "partial",
    "stats",
    "grad",
    "lora_merge_kernel",
}
"""Every kernel of colocate/kernels (the KV-cache store aside, reached only from CUDA tensors)."""
TENSOR_CORES = {90: "wgmma", 100: "tcgen05.mma"}
SHARED_PER_SM = 228 * 1024
"""An H100's shared memory an SM, of which a block may take 227 KiB."""


@pytest.fixture(scope="module")
def compiled_without_interpreter(tmp_path_factory):
    """Run tests/compile_for_gpu.py with these arguments; its standard output."""
    if torch.cuda.is_available():
        pytest.skip("the GPU tests run the kernels")
    triton = pytest.importorskip("triton")
    if not (pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # kernels launched without enable_fp_fusion may fuse (Triton 3.9's default)

    def run(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "compile_for_gpu.py"), *args],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    return run


@pytest.fixture(scope="module", params=sorted(TENSOR_CORES), ids=lambda arch: f"sm_{arch}")
def compiled(request, compiled_without_interpreter) -> tuple[int, list[dict]]:
    out = compiled_without_interpreter("--arch", str(request.param))
    return request.param, [json.loads(line) for line in out.splitlines()]


def test_every_kernel_compiles_without_spilling(compiled):
    """No local memory anywhere; on sm_90 no stack frame either (on sm_100 the chunk sum keeps 16 bytes)."""
    arch, rows = compiled
    assert {row["kernel"] for row in rows} == KERNELS
    spilled = [row for row in rows if row["local"] or (arch == 90 and row["stack"])]
    assert not spilled, spilled


def test_the_modes_products_use_tensor_cores_and_keep_their_occupancy(compiled):
    """Every tile config of the mode's matmul runs on the tensor cores' warpgroup MMA (so that a
    row's bits do not depend on the config), and on sm_90 keeps the blocks an SM it was chosen for:
    the decode tile (64 x 64, four 16 KiB stages) three, whether it takes one K chunk, a chunk of a
    split product or walks several with a second accumulator; the 128-row tiles one, in shared
    memory and in registers."""
    arch, rows = compiled
    products = [row for row in rows if row["kernel"] == "matmul_kernel"]
    assert len(products) == 7 and all(row["mma"] == TENSOR_CORES[arch] for row in products)
    for row in products if arch == 90 else []:
        c = row["constexprs"]
        threads = 32 * (4 if c["BLOCK_M"] == 64 else 8)
        blocks = min(SHARED_PER_SM // row["shared"], 65536 // (row["registers"] * threads))
        assert blocks >= (3 if c["BLOCK_M"] == 64 else 1), row


def test_every_attention_path_uses_the_same_tensor_core_instruction(compiled):
    """The mode's attention sums a row by MMA, so its paths may tile differently; they must still
    run one MMA instruction (a row's bits are the instruction's), the warpgroup MMA on sm_90."""
    arch, rows = compiled
    paths = [row for row in rows if row["kernel"] == "attend"]
    assert {(row["constexprs"]["PAGED"], row["constexprs"]["HEADS_AS_ROWS"]) for row in paths} == {
        (False, False),
        (True, False),
        (True, True),
    }
    assert all(row["mma"] == TENSOR_CORES[arch] for row in paths), paths


def test_the_lora_merge_multiplies_on_the_tensor_cores(compiled):
    """B A of the merge (ranks 8, 64 and 128) on the warpgroup MMA, not a scalar fp32 product; the
    scale's multiply and W's add stay two roundings, as in the torch merge, under Triton's default
    options (those a compiled graph launches it with), which fuse them into an FMA if they can."""
    arch, rows = compiled
    merges = [row for row in rows if row["kernel"] == "lora_merge_kernel"]
    assert len(merges) == 3 and all(row["mma"] == TENSOR_CORES[arch] for row in merges), merges
    assert not any(row["fp32_fma"] for row in merges), merges


def test_a_compiled_graph_launches_the_lora_merge_kernel_itself(compiled_without_interpreter):
    """Traced by torch.compile (through AOTAutograd, as inductor sees it, for sm_90), the merge is its
    Triton kernel in the graph, not an op whose dispatch costs host time at every call, and only the
    output is written: W, A and B are not copied first."""
    graph = json.loads(compiled_without_interpreter("--lora-merge-graph"))
    assert graph == {
        "calls": ["aten.empty.memory_format", "triton_kernel_wrapper_functional"],
        "kernel": "lora_merge_kernel",
        "tensors_to_clone": ["out_ptr"],
    }
