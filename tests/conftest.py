from __future__ import annotations

import os

# before anything imports huggingface_hub, which reads these once: tests never wait on a hub they cannot reach
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tiny import make_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = (ROOT.parent / "shared" / "data").resolve()
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> directory of a saved tiny random model (built once per session)."""
    cache: dict[tuple[str, int], Path] = {}
    root = tmp_path_factory.mktemp("tiny")

    def get(arch: str = "llama", layers: int = 6) -> Path:
        key = (arch, layers)
        if key not in cache:
            cache[key] = make_tiny_model(root / f"{arch}-{layers}", arch, layers)
        return cache[key]

    return get


@pytest.fixture
def tiny_llama(tiny_models) -> Path:
    return tiny_models("llama", 6)
