import os
import shutil
import tempfile

import pytest

# Every test process gets its own cache: tests never read or write the user's cache.
os.environ.setdefault("KGEN_CACHE_DIR", tempfile.mkdtemp(prefix="kgen-test-cache-"))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


HAS_GPU = _has_gpu()
if not HAS_GPU:
    # Triton kernels run on the CPU; set before any generated module is imported.
    from kgen.runtime import interpret

    interpret.enable()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        import torch

        if torch.cuda.device_count() < 2:
            skip_multi = pytest.mark.skip(reason="needs 2 or more CUDA GPUs")
            for item in items:
                if "multigpu" in item.keywords:
                    item.add_marker(skip_multi)
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    d = os.environ.get("KGEN_CACHE_DIR", "")
    if "kgen-test-cache-" in d:
        shutil.rmtree(d, ignore_errors=True)


requires_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("KGEN_NVCC"),
                                   reason="nvcc not installed")


@pytest.fixture
def tf32():
    """`tf32(on)` sets torch.backends.cuda.matmul.allow_tf32 for the test and restores it
    after (monkeypatch cannot: the attribute is served by the module's __getattr__, so its
    undo deletes instead of resetting)."""
    import torch

    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32

    def set_tf32(on: bool) -> None:
        matmul.allow_tf32 = on

    yield set_tf32
    matmul.allow_tf32 = saved
