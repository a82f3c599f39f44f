import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels on CPU tensors run in Triton's interpreter, which must be on before anything
    # imports triton (torch._dynamo does): see the interpreted_triton fixture.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _device_memory_back():
    """GPU tests share one process: after each, what it left cached goes back to the device, so a
    later test that starts a whole training run in a subprocess finds the memory free."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture
def deterministic():
    """Ordered kernels (the attention backward's among them), so two identical runs agree bitwise."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture
def interpreted_triton():
    """The project's Triton kernels on CPU tensors through Triton's interpreter (skipped where triton
    is not installed, and on GPU machines, whose tests run the compiled kernels): their indexing,
    masking and loop logic, not the GPU's instruction-level numerics."""
    if torch.cuda.is_available():
        pytest.skip("the GPU tests run the compiled kernels")
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET is set to another value than 1")
