"""What the code reads from its environment: the hub counts as offline for every value huggingface_hub and datasets
accept (1, true, yes, on; read per call); a missing optional package is one line naming its extra; the tests never
write to the user's cache; two processes sharing a cache build an entry once."""

from __future__ import annotations

import importlib
import sys
import threading
import time
import types

import pytest

from helpers import assert_one_line_error, run_cli
from layerprune.core.errors import LayerpruneError
from layerprune.evaluate import EvalSettings, plan_tasks
from layerprune.tasks.data import OFFLINE_ENVS, hub_offline, load_rows


@pytest.fixture
def online(monkeypatch):
    for name in OFFLINE_ENVS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("name", OFFLINE_ENVS)
@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "on"])
def test_every_true_value_counts_as_offline(online, name, value):
    online.setenv(name, value)
    assert hub_offline()


@pytest.mark.parametrize("value", ["0", "false", "no", "off", ""])
def test_false_values_leave_the_hub_on(online, value):
    online.setenv("HF_HUB_OFFLINE", value)
    assert not hub_offline()


def test_hf_hub_offline_true_refuses_hub_data_at_planning_and_loading(online):
    planned, _ = plan_tasks(EvalSettings(tasks=["arc_easy"]), None)  # a user with the hub: planning reads nothing
    assert [t.spec.name for t in planned] == ["arc_easy"]
    online.setenv("HF_HUB_OFFLINE", "true")
    with pytest.raises(LayerpruneError, match="no data for task 'arc_easy'.*hub is offline"):
        plan_tasks(EvalSettings(tasks=["arc_easy"]), None)
    with pytest.raises(LayerpruneError, match="no local data for gsm8k/train and the hub is offline"):
        load_rows("gsm8k", "train", None)


def test_tests_never_write_to_the_users_cache():
    from conftest import USER_CACHE
    from layerprune.core.settings import RunSettings

    cache = RunSettings().resolved_cache_dir()
    assert not cache.resolve().is_relative_to(USER_CACHE.resolve())


def test_two_loaders_sharing_a_cache_convert_a_gguf_once(tmp_path, monkeypatch):
    """Parallel runs (or test workers) on one cache: the second waits for the first's conversion and reuses it."""
    from layerprune.core.settings import RunSettings
    from layerprune.models import loading

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    made = []

    def slow_convert(path, target):
        made.append(target)
        time.sleep(0.3)  # long enough that the other thread arrives while this one converts
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")

    monkeypatch.setattr(loading, "convert_gguf", slow_convert)
    settings = RunSettings(cache_dir=tmp_path / "cache")
    found = []
    threads = [threading.Thread(target=lambda: found.append(loading._resolve_gguf(gguf, "m", settings).location))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 1 and len(set(found)) == 1


# optional dependencies: a missing one is a one-line error that names the extra installing it -------------------

@pytest.mark.parametrize("module, package", [("sklearn", "scikit-learn"), ("scipy", "scipy")])
@pytest.mark.parametrize("analysis", ["importance", "nmi"])
def test_analyze_without_its_extra_is_one_line(capsys, monkeypatch, tmp_path, tiny_llama, analysis, module, package):
    out = tmp_path / "out"
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    with pytest.raises(ImportError):
        importlib.import_module(module)
    model = ["--models" if analysis == "importance" else "--model", str(tiny_llama)]
    code, _, err = run_cli(capsys, ["analyze", analysis, *model, "--output", str(out)])
    assert_one_line_error(code, err, f"analyze {analysis} needs {package}", "pip install 'layerprune[analyze]'")
    assert not out.exists()


def test_variant_study_without_the_analyze_extra_stops_before_training(monkeypatch):
    from layerprune.pipeline.studies import variant

    monkeypatch.setitem(sys.modules, "scipy", None)
    monkeypatch.setattr(variant, "make_variant", lambda *a: pytest.fail("trained without the analyze extra"))
    with pytest.raises(LayerpruneError, match=r"the variant study needs scipy.*layerprune\[analyze\]"):
        variant.run_variant_study(None, None)  # type: ignore[arg-type]


def test_qlora_and_8bit_optimizers_without_bitsandbytes_name_the_qlora_extra(monkeypatch):
    import torch

    from layerprune.core.settings import RunSettings
    from layerprune.recover.runner import check_runnable
    from layerprune.recover.schema import RecoverRecipe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the CUDA check, to the package check
    cuda = RunSettings(device="cuda")
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.ModuleType("bitsandbytes"))  # as if installed
    check_runnable(RecoverRecipe.model_validate({"method": "qlora"}), cuda)  # installed: no error
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(LayerpruneError, match=r"^method qlora needs bitsandbytes.*pip install 'layerprune\[qlora\]'$"):
        check_runnable(RecoverRecipe.model_validate({"method": "qlora"}), cuda)
    with pytest.raises(LayerpruneError, match=r"^train.optimizer adamw_8bit needs bitsandbytes.*layerprune\[qlora\]"):
        check_runnable(RecoverRecipe.model_validate({"method": "full", "train": {"optimizer": "adamw_8bit"}}), cuda)
    check_runnable(RecoverRecipe.model_validate({"method": "lora"}), cuda)  # the rest does not need it
