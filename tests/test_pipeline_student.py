"""The original as a student (k = 0 controls, variants): its checkpoint files linked, not loaded and saved again."""

from __future__ import annotations

from layerprune.core.settings import RunSettings
from layerprune.pipeline.student import original_as_student


def test_the_original_is_linked_file_by_file_once(tiny_llama, tmp_path):
    target = original_as_student(str(tiny_llama), RunSettings(), tmp_path / "original")
    names = {p.name for p in tiny_llama.iterdir() if p.is_file()}
    assert {p.name for p in target.iterdir()} == names and "model.safetensors" in names
    for name in names:  # hard links: the same file, no second copy of the weights
        assert (target / name).stat().st_ino == (tiny_llama / name).stat().st_ino
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    (target / "marker").write_text("kept")
    assert original_as_student(str(tiny_llama), RunSettings(), target) == target  # made once
    assert (target / "marker").read_text() == "kept"
