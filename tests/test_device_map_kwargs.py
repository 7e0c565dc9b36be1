"""One function turns --device-map / --max-memory into `from_pretrained` keywords (models.loading)."""

import torch

from layerprune.core.settings import RunSettings
from layerprune.models.loading import device_map_kwargs
from layerprune.prune.metrics import accumulate, mean


def test_no_device_map_no_keywords():
    assert device_map_kwargs(RunSettings(max_memory=["0=1GiB"])) == {}


def test_device_map_with_max_memory():
    settings = RunSettings(device_map="balanced", max_memory=["0=70GiB", "cpu=200GiB"])
    assert device_map_kwargs(settings) == {"device_map": "balanced", "max_memory": {0: "70GiB", "cpu": "200GiB"}}


def test_whole_pins_everything_on_the_device():
    settings = RunSettings(device="cpu", device_map="auto")
    assert device_map_kwargs(settings, whole=True) == {"device_map": {"": torch.device("cpu")}}


def test_accumulate_sums_pairs():
    total = [0.0, 0]
    accumulate(total, (3.0, 2))
    accumulate(total, (1.5, 1))
    assert total == [4.5, 3] and mean(*total) == 1.5
