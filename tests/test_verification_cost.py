"""What the streamed prune's verification costs: its forward on a handful of tokens runs on as many CPU threads as
its products are worth (one for a small model), and the caller's thread count is left as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import layerprune.models.verify_blockwise as verify_blockwise
from layerprune.core.settings import RunSettings
from layerprune.models.verify_blockwise import READ_ROWS, THREAD_WORK, check_threads
from layerprune.prune.api import prune_model
from layerprune.prune.recipe import PruneRecipe

CPU = torch.device("cpu")


@pytest.fixture
def two_threads():  # noqa: ANN201
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_streamed_check_runs_a_small_model_on_one_thread_and_restores_the_count(tiny_llama, tmp_path,
                                                                                    monkeypatch, two_threads):
    seen: list[int] = []
    real = verify_blockwise.block_major_logits

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(verify_blockwise, "block_major_logits", counted)
    report = prune_model(str(tiny_llama), PruneRecipe(layers=[1, 3]), RunSettings(), output=tmp_path / "out").report
    assert report["verification"]["checked"] is True
    assert seen == [1, 1]  # the written forward and the reference
    assert torch.get_num_threads() == 2


def test_check_threads_grows_with_the_largest_product(two_threads):
    with torch.device("meta"):
        small, large = nn.Linear(1024, 4096), nn.Linear(8192, 8192)  # no memory: shapes only
    with check_threads(small, CPU, 16) as count:
        assert count == 1 == torch.get_num_threads()
    assert 8192 * 8192 * READ_ROWS // THREAD_WORK >= 2
    with check_threads(large, CPU, 4) as count:  # few rows cost what reading the weight costs
        assert count == 2 == torch.get_num_threads()
    with check_threads(large, torch.device("meta"), 16) as count:  # not a CPU: left alone
        assert count == 2
    assert torch.get_num_threads() == 2
