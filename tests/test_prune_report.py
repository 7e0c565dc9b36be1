"""The prune report is built from typed pieces: a wrong value fails where it is set, and the file keeps its keys."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from layerprune.core.settings import RunSettings
from layerprune.models.copy_check import CopyCheck
from layerprune.prune import in_memory
from layerprune.prune.api import prune_model
from layerprune.prune.recipe import PruneRecipe
from layerprune.prune.report import read_prune_report


def test_a_wrongly_typed_timing_fails_where_it_is_set(tiny_llama, tmp_path, monkeypatch):
    def save_with_a_string(loaded, report, output, *args):
        report["timings"].save_s = "2.5 s"

    monkeypatch.setattr(in_memory, "save_pruned", save_with_a_string)
    with pytest.raises(ValidationError, match="save_s"):
        prune_model(str(tiny_llama), PruneRecipe(layers=[2]), RunSettings(dtype="float32"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_wrongly_typed_check_fails_where_it_is_made(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(CopyCheck, "rest", lambda self: "all of them")
    with pytest.raises(ValidationError, match="bytes_compared"):
        prune_model(str(tiny_llama), PruneRecipe(layers=[2]), output=tmp_path / "out")  # streamed from the files
    assert not (tmp_path / "out").exists()


CHECKS = {"auto": {"checked", "keys", "tokens", "logits_check", "max_abs_diff", "tolerance", "reference_max_abs",
                   "per_layer_settings", "bytes_compared", "reference_blocks", "phase_seconds", "seconds"},
          "float32": {"checked", "keys", "tokens", "logits_check", "max_abs_diff", "tolerance", "reference_max_abs",
                      "seconds"}}


@pytest.mark.parametrize("dtype", ["auto", "float32"])  # streamed from the files; saved from memory
def test_the_written_report_keeps_its_keys(tiny_llama, tmp_path, dtype):
    result = prune_model(str(tiny_llama), PruneRecipe(layers=[2]), RunSettings(dtype=dtype), tmp_path / "out")
    file = json.loads((tmp_path / "out" / "prune_report.json").read_text())
    assert set(file["verification"]) == CHECKS[dtype] and file["verification"]["checked"] is True  # no nulls
    written = file["timings"]
    assert list(written) == ["load_s", "score_s", "save_s", "verify_s"]  # no total_s, no nulls, in this order
    assert all(isinstance(value, float) for value in written.values())
    assert read_prune_report(tmp_path / "out").timings.save_s == written["save_s"]
    plain = json.loads(json.dumps(result.report))  # plain values, as --json prints them
    assert list(plain["timings"]) == [*written, "total_s"] and plain["verification"] == file["verification"]


def test_a_dtype_object_instead_of_its_name_fails_where_the_dtypes_are_made(tiny_llama, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(in_memory, "dtype_name", lambda dtype: dtype if dtype is torch.float32 else str(dtype))
    with pytest.raises(ValidationError, match="computed_in|saved"):
        prune_model(str(tiny_llama), PruneRecipe(layers=[2]), RunSettings(dtype="float32"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_misspelled_save_record_fails_where_the_weights_are_written(tiny_llama, tmp_path, monkeypatch):
    from layerprune.prune import streaming

    real = streaming.Saved
    monkeypatch.setattr(streaming, "Saved", lambda **kw: real(**{("shard" if k == "shards" else k): v
                                                                 for k, v in kw.items()}))
    with pytest.raises(ValidationError, match="shard"):
        prune_model(str(tiny_llama), PruneRecipe(layers=[2]), output=tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_saved_and_dtype_keep_their_keys_and_values(tiny_llama, tmp_path, dtype):
    result = prune_model(str(tiny_llama), PruneRecipe(layers=[2]), RunSettings(dtype=dtype), tmp_path / "out")
    file = json.loads((tmp_path / "out" / "prune_report.json").read_text())
    assert list(file["dtype"]) == ["checkpoint", "computed_in", "saved", "chosen_by"]
    assert file["dtype"]["chosen_by"] == ("checkpoint" if dtype == "auto" else "--dtype")
    if dtype == "auto":  # streamed: shards, bytes and tensors per dtype, all ints
        assert list(file["saved"]) == ["how", "shards", "bytes", "dtypes"] and file["saved"]["shards"] >= 1
        assert all(isinstance(n, int) for n in file["saved"]["dtypes"].values())
    else:  # saved from memory: how only, no nulls
        assert file["saved"] == {"how": "save_pretrained of the model in memory"}
    assert json.loads(json.dumps(result.report))["saved"] == file["saved"]
    assert read_prune_report(tmp_path / "out").dtype.saved == file["dtype"]["saved"]


def test_a_target_record_keeps_ints_as_ints_and_refuses_a_stray_key():
    from layerprune.prune.report import TargetRecord

    sizes = {"params": 10, "memory_bytes": 40, "kv_bytes_per_token": 8, "flops_per_token": 20, "speedup": 1.0}
    record = TargetRecord(target="params=0.5x", removals=["3"], predicted={"before": sizes, "after": sizes},
                          measured_speedup=None, measurements=[])
    assert json.loads(record.model_dump_json())["predicted"]["after"]["params"] == 10  # not 10.0
    with pytest.raises(ValidationError, match="predicted"):
        TargetRecord(target="params=0.5x", removals=["3"], predicted={"middle": sizes}, measured_speedup=None,
                     measurements=[])
