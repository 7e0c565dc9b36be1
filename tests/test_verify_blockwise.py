"""Block-major verification (one block in memory at a time) equals the whole-model check and catches what the
tensor check cannot see; the prune routes use it instead of loading a second whole copy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.models import shards, surgery
from layerprune.models.blocks import DecoderStack
from layerprune.models.blockwise import load_skeleton
from layerprune.models.shards import written_shapes
from layerprune.models.verify_blockwise import block_major_logits, verify_block_major
from layerprune.prune import from_files
from layerprune.prune.api import prune_model
from layerprune.prune.calib import CalibItem, CalibSet
from layerprune.prune.recipe import PruneRecipe
from tiny import ARCHS

DROP = [1, 3]
BLOCK_MAJOR_FAMILIES = [*sorted(ARCHS), "llama4_text", "granite", "cohere2", "falcon_h1", "bamba"]
CPU = torch.device("cpu")


def _ids() -> torch.Tensor:
    return torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(0))  # longer than the windows (8)


def _whole_logits(path, ids):  # noqa: ANN001, ANN202
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits.float()


def _block_major(path, ids, skip=()):  # noqa: ANN001, ANN202
    bw = load_skeleton(path, AutoConfig.from_pretrained(path), CPU, torch.float32)
    return block_major_logits(bw, ids, None, skip)


@pytest.mark.parametrize("arch", BLOCK_MAJOR_FAMILIES)
def test_block_major_verification_equals_the_whole_model_check(arch, tiny_models, tmp_path):
    source = tiny_models(arch, 6)
    report = prune_model(str(source), PruneRecipe(layers=DROP), output=tmp_path / "out").report
    assert report["verification"]["checked"] is True
    assert report["verification"]["logits_check"] == "block-major"
    ids = _ids()
    assert float((_block_major(tmp_path / "out", ids) - _whole_logits(tmp_path / "out", ids)).abs().max()) <= 1e-5
    reference = surgery.skip_reference_logits(AutoModelForCausalLM.from_pretrained(source).eval(), ids, None, DROP)
    assert float((_block_major(source, ids, DROP) - reference).abs().max()) <= 1e-5


def _pruned_copy(tiny_models, arch, tmp_path, edit):  # noqa: ANN001, ANN202
    source = tiny_models(arch, 6)
    out = tmp_path / "out"
    prune_model(str(source), PruneRecipe(layers=DROP, verify=False), output=out)
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    config = json.loads((bad / "config.json").read_text())
    edit(config)
    (bad / "config.json").write_text(json.dumps(config))
    meta_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(bad))
    surgery.check_config_matches_weights(meta_model, written_shapes(bad))  # the tensor check sees nothing wrong
    return source, bad


def _shift_layer_types(config: dict) -> None:
    config["layer_types"] = config["layer_types"][1:] + config["layer_types"][:1]


def _longer_window(config: dict) -> None:
    config["sliding_window"] = 16


def _window_pattern(config: dict) -> None:
    config["max_window_layers"] = 1
    config.pop("layer_types", None)


@pytest.mark.parametrize("arch,edit", [("gemma3_text", _shift_layer_types), ("mistral", _longer_window),
                                        ("qwen2", _window_pattern)])
def test_block_major_verification_catches_a_wrong_config_field(arch, edit, tiny_models, tmp_path):
    source, bad = _pruned_copy(tiny_models, arch, tmp_path, edit)
    with pytest.raises(LayerpruneError, match="surgery check failed"):
        verify_block_major(AutoConfig.from_pretrained(source), bad, DROP, _ids(), None, CPU, torch.float32, 1e-3,
                           source_dir=source)


def test_block_major_logits_catch_a_shifted_layer_type_without_the_settings_check(tiny_models, tmp_path):
    source, bad = _pruned_copy(tiny_models, "gemma3_text", tmp_path, _shift_layer_types)
    with pytest.raises(LayerpruneError, match="logits differ"):
        verify_block_major(None, bad, DROP, _ids(), None, CPU, torch.float32, 1e-3, source_dir=source,
                           reference=_block_major(source, _ids(), DROP))


def test_streamed_prune_verifies_without_loading_the_model(tiny_llama, tmp_path, monkeypatch):
    def no_loading(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a streamed prune must not load the whole model to verify it")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_loading)
    monkeypatch.setattr(from_files, "load_model", no_loading)
    scored = PruneRecipe(drop=2, score="ablation", calib="arithmetic", calib_samples=6, batch_size=4, calib_seq_len=64)
    for settings, recipe in [(RunSettings(), PruneRecipe(layers=DROP)), (RunSettings(block_major=True), scored)]:
        out = tmp_path / f"out-{settings.block_major}"
        verification = prune_model(str(tiny_llama), recipe, settings, output=out).report["verification"]
        assert verification["checked"] is True and verification["logits_check"] == "block-major"
        assert verification["max_abs_diff"] <= verification["tolerance"]


def _swap_first_two_blocks(monkeypatch):  # noqa: ANN001, ANN202
    real = shards.rename_map

    def swapped(names, prefix, kept, depth):  # noqa: ANN001, ANN202
        first, second = f"{prefix}.0.", f"{prefix}.1."
        swap = {first: second, second: first}
        renamed = real(names, prefix, kept, depth)
        return {old: next((swap[h] + new[len(h):] for h in swap if new.startswith(h)), new)
                for old, new in renamed.items()}

    monkeypatch.setattr(shards, "rename_map", swapped)


def test_streamed_verification_refuses_kept_blocks_written_in_the_wrong_order(tiny_llama, tmp_path, monkeypatch):
    """A wrong block mapping copies every tensor faithfully; the byte check works out which source block belongs at
    each written name from the kept blocks alone (not from the copy's map), so it refuses the copy."""
    _swap_first_two_blocks(monkeypatch)
    with pytest.raises(LayerpruneError, match=r"model\.layers\.0\.\S+ in .* is not a copy of model\.layers\.0\."):
        prune_model(str(tiny_llama), PruneRecipe(layers=DROP), output=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_logits_alone_refuse_kept_blocks_in_the_wrong_order(tiny_llama, tmp_path, monkeypatch):
    """Without the byte check (no digests), the original run with its own blocks skipped still sees the swap."""
    _swap_first_two_blocks(monkeypatch)
    prune_model(str(tiny_llama), PruneRecipe(layers=DROP, verify=False), output=tmp_path / "out")
    with pytest.raises(LayerpruneError, match="logits differ"):
        verify_block_major(AutoConfig.from_pretrained(tiny_llama), tmp_path / "out", DROP, _ids(), None, CPU,
                           torch.float32, 1e-3, source_dir=tiny_llama)


def test_streamed_verification_reports_where_its_time_went(tiny_llama, tmp_path):
    report = prune_model(str(tiny_llama), PruneRecipe(layers=DROP), output=tmp_path / "out").report
    verification = report["verification"]
    phases = verification["phase_seconds"]
    assert list(phases) == ["settings", "written", "bytes", "reference"]  # the bytes checked as the written loads
    assert verification["tokens"] == from_files.PROBE_ROWS * from_files.PROBE_POSITIONS == 4  # one row of the text
    assert all(seconds >= 0 for seconds in phases.values()) and sum(phases.values()) <= verification["seconds"] + 0.01


def _count_loads(monkeypatch) -> list[tuple[str, int]]:  # noqa: ANN001
    from layerprune.models import verify_blockwise

    loads: list[tuple[str, int]] = []
    real = verify_blockwise.load_block
    monkeypatch.setattr(verify_blockwise, "load_block", lambda bw, index, parked: loads.append(
        (bw.checkpoint.directory.name, index)) or real(bw, index, parked))
    return loads


def test_the_reference_replays_the_kept_blocks_from_the_written_forward(tiny_llama, tmp_path, monkeypatch):
    """The written model loads each of its blocks once (its bytes checked as they load); the original runs its own
    forward from the start, never reads a dropped block, and reads no kept block either: each is built like its
    written block, holds the bytes checked, and is called with the written block's very arguments."""
    loads = _count_loads(monkeypatch)
    verification = prune_model(str(tiny_llama), PruneRecipe(layers=[3, 4]), output=tmp_path / "out").report[
        "verification"]
    assert verification["checked"] is True and verification["max_abs_diff"] == 0.0
    assert [index for name, index in loads if name != tiny_llama.name] == [0, 1, 2, 3]
    assert [index for name, index in loads if name == tiny_llama.name] == []
    assert verification["reference_blocks"] == {"replayed": 4, "computed": 0}


def test_a_block_called_with_other_arguments_is_computed_not_replayed(tiny_llama, tmp_path, monkeypatch):
    """Where the arguments are not proven equal, the original's block is loaded from its own files and run."""
    from layerprune.models import verify_blockwise

    monkeypatch.setattr(verify_blockwise, "same_value", lambda a, b: False)
    loads = _count_loads(monkeypatch)
    verification = prune_model(str(tiny_llama), PruneRecipe(layers=[3, 4]), output=tmp_path / "out").report[
        "verification"]
    assert verification["checked"] is True and verification["max_abs_diff"] <= verification["tolerance"]
    assert [index for name, index in loads if name == tiny_llama.name] == [0, 1, 2, 5]
    assert verification["reference_blocks"] == {"replayed": 0, "computed": 4}


def _source_digests(directory: Path) -> dict:
    import xxhash

    from layerprune.models.safetensors_copy import read_headers

    digests = {}
    for stored in read_headers(directory, shards.read_checkpoint(directory).files).values():
        with (directory / stored.file).open("rb") as handle:
            handle.seek(stored.start)
            digests[stored] = xxhash.xxh3_128(handle.read(stored.nbytes)).hexdigest()
    return digests


def _capped_logits(config: dict) -> None:
    config["final_logit_softcapping"] = 1e-3


def test_a_model_level_config_change_is_not_replayed_and_is_refused(tiny_models, tmp_path, monkeypatch):
    """The bytes are right and every block is built alike, but the written config caps the logits (the model does
    it, not a block): the configs are not alike, so the original computes its blocks, and the logits differ."""
    source, bad = _pruned_copy(tiny_models, "gemma3_text", tmp_path, _capped_logits)
    loads = _count_loads(monkeypatch)
    with pytest.raises(LayerpruneError, match="logits differ"):
        verify_block_major(AutoConfig.from_pretrained(source), bad, DROP, _ids(), None, CPU, torch.float32, 1e-3,
                           source_dir=source, digests=_source_digests(source))
    assert [index for name, index in loads if name == source.name]  # computed from the original's files


def test_same_value_is_exact():
    from layerprune.models.block_replay import same_value

    x = torch.arange(6.0).reshape(2, 3)
    assert same_value((x, {"a": (x, None), "b": 1}), (x.clone(), {"a": (x.clone(), None), "b": 1}))
    assert not same_value((x,), (x + 1e-7,))
    assert not same_value((x,), (x.double(),))
    assert not same_value({"a": x}, {"a": x, "b": None})
    assert not same_value(1, 1.0) and not same_value(object(), object())


@pytest.mark.parametrize("side", ["left", "right"])
def test_the_streamed_probe_is_cut_so_every_row_keeps_its_real_tokens(side):
    ids = torch.arange(60).reshape(2, 30)
    short = [1] * 3 + [0] * 27 if side == "right" else [0] * 27 + [1] * 3
    cut_ids, cut_mask = from_files.probe_positions(ids, torch.tensor([[1] * 30, short]), positions=16, rows=2)
    assert cut_ids.shape == cut_mask.shape == (2, 16) and cut_mask.sum(-1).tolist() == [16, 3]
    assert cut_ids[0].tolist() == (list(range(16)) if side == "right" else list(range(14, 30)))
    one_ids, one_mask = from_files.probe_positions(ids, torch.tensor([[1] * 30, short]), positions=16)
    assert one_ids.tolist() == cut_ids[:1].tolist() and one_mask.tolist() == [[1] * 16]  # the side from both rows
    assert from_files.probe_positions(ids[:, :3], None, rows=2)[0].shape == (2, 3)  # as short as the cut: uncut
    assert from_files.probe_positions(ids, None)[0].shape == (from_files.PROBE_ROWS, from_files.PROBE_POSITIONS)
    assert from_files.probe_positions(ids, None, positions=16, rows=2)[0].tolist() == ids[:, :16].tolist()


def test_a_left_padding_tokenizer_does_not_cut_the_right_padded_calibration_probe(tiny_llama, tmp_path, monkeypatch):
    """The probe comes from the calibration batch, padded on the right whatever the tokenizer says: cutting its last
    columns would leave the short row nothing but padding (NaN logits, a correct prune refused)."""
    source = tmp_path / "left"
    shutil.copytree(tiny_llama, source)
    tokenizer_config = source / "tokenizer_config.json"
    tokenizer_config.write_text(json.dumps({**json.loads(tokenizer_config.read_text()), "padding_side": "left"}))
    items = [CalibItem("the cat sat on the mat and the dog sat on the log " * 3), CalibItem("a cat")]
    monkeypatch.setattr(from_files, "load_calibration", lambda *a, **k: CalibSet(items, "two texts"))
    masks = []

    def verify(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        masks.append(args[4])
        return verify_block_major(*args, **kwargs)

    monkeypatch.setattr(from_files, "verify_block_major", verify)
    recipe = PruneRecipe(drop=2, score="angular", calib="arithmetic", calib_samples=2)
    report = prune_model(str(source), recipe, RunSettings(block_major=True), output=tmp_path / "out").report
    assert report["verification"]["checked"] is True
    assert masks[0].shape[-1] == from_files.PROBE_POSITIONS and masks[0].sum(-1).min() > 0  # every row a real token


def test_device_mapped_prune_is_verified_block_major(tiny_llama, tmp_path, monkeypatch):
    """The written model is not reloaded onto one device beside the resident original."""
    monkeypatch.setattr(surgery, "compare_reloaded_logits", lambda *a, **k: pytest.fail("reloaded whole"))
    settings = RunSettings(device_map="auto", dtype="float32")  # a cast: the in-memory route
    report = prune_model(str(tiny_llama), PruneRecipe(layers=DROP), settings, output=tmp_path / "out").report
    assert report["verification"]["logits_check"] == "block-major"
    assert report["verification"]["max_abs_diff"] <= report["verification"]["tolerance"]


def test_block_major_ablation_checks_its_head_once(tiny_llama, tmp_path, monkeypatch):
    recipe = PruneRecipe(drop=2, score="ablation", calib="arithmetic", calib_samples=6, batch_size=4, calib_seq_len=64,
                         verify=False)
    report = prune_model(str(tiny_llama), recipe, RunSettings(block_major=True), output=tmp_path / "ok").report
    assert report["score_details"]["check_logits_max_abs_diff"] <= 1e-4
    real = DecoderStack.logits
    monkeypatch.setattr(DecoderStack, "logits", lambda self, hidden: real(self, hidden) * 1.5)
    with pytest.raises(LayerpruneError, match="differ from its own forward"):
        prune_model(str(tiny_llama), recipe, RunSettings(block_major=True), output=tmp_path / "bad")


def test_max_memory_bounds_the_block_major_plan_before_loading(tiny_llama, tmp_path, monkeypatch):
    from layerprune.models import blockwise

    monkeypatch.setattr(blockwise, "load_skeleton", lambda *a, **k: pytest.fail("loaded before the bound was checked"))
    recipe = PruneRecipe(drop=2, score="ablation", calib="arithmetic", calib_samples=6, batch_size=4, calib_seq_len=64)
    settings = RunSettings(block_major=True, device="cpu", max_memory=["cpu=1MiB"])
    with pytest.raises(LayerpruneError, match=r"over --max-memory cpu=1MiB: whole model .* GiB"):
        prune_model(str(tiny_llama), recipe, settings, output=tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name,drop", [("smollm2-135m-instruct", [3, 4, 25]), ("gemma3-270m", [2, 5, 9])])
def test_block_major_equals_the_whole_model_check_on_the_embedded_models(name, drop, pruned_embedded):
    from layerprune.models import resolve_model

    source = resolve_model(f"embedded:{name}")
    out, report = pruned_embedded(name, drop)  # the default prune, shared with test_real_models
    assert report["verification"]["logits_check"] == "block-major"
    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    written = float((_block_major(out, ids) - _whole_logits(out, ids)).abs().max())
    original = AutoModelForCausalLM.from_pretrained(source.location, dtype=torch.float32).eval()
    skipped = float((_block_major(Path(source.location), ids, drop)
                     - surgery.skip_reference_logits(original, ids, None, drop)).abs().max())
    assert written <= 1e-5 and skipped <= 1e-5, (written, skipped)
