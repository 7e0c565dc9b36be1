"""Typed reports: one model for each file, used by its writers and readers; older reports fail on one line naming
the file and the field; model cards through huggingface_hub; one provenance record."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import transformers
from huggingface_hub import ModelCard

from helpers import assert_one_line_error, run_cli
from layerprune.core.errors import LayerpruneError
from layerprune.core.provenance import checkout_root, collect_provenance, git_state


def test_drop_blocks_record_reads_back_in_the_run_report(tiny_llama, tmp_path):
    """recover's drop_blocks writes the lineage the run report reads (it wrote method.name, the report read
    method.score)."""
    from layerprune.core.settings import RunSettings
    from layerprune.models import resolve_model
    from layerprune.models.lineage import read_lineage
    from layerprune.pipeline.report import _prune_lines
    from layerprune.recover.student_teacher import save_dropped

    save_dropped(resolve_model(str(tiny_llama)), [2, 3], RunSettings(seed=7), tmp_path / "student")
    lineage = read_lineage(tmp_path / "student")
    assert lineage is not None and lineage.dropped == [2, 3] and lineage.kept == [0, 1, 4, 5]
    assert lineage.source.spec == str(tiny_llama) and lineage.method.score == "explicit" and lineage.method.seed == 7
    text = "\n".join(_prune_lines(lineage))
    assert "Score `explicit`; calibration: none." in text and "Dropped (original numbering): [2, 3]" in text


def test_pruned_model_card_names_the_base_model_and_the_dropped_blocks(pruned, tiny_llama):
    from layerprune.prune.report import read_prune_report

    card = ModelCard.load(pruned / "README.md")
    assert card.data.base_model is None and card.data.library_name == "transformers"  # no hub id for a local path
    assert card.data.layerprune["source"] == str(tiny_llama)
    assert {"layerprune", "pruned"} <= set(card.data.tags)
    assert card.data.layerprune["dropped_blocks"] == [2, 4] and card.data.layerprune["score"] == "explicit"
    assert "- dropped blocks (original numbering): [2, 4]" in card.text
    report = read_prune_report(pruned)
    assert report.dropped == [2, 4] and report.provenance.versions["transformers"] == transformers.__version__


def test_prune_report_with_an_unknown_or_missing_field_is_one_line(pruned):
    from layerprune.prune.report import read_prune_report

    data = json.loads((pruned / "prune_report.json").read_text())
    (pruned / "prune_report.json").write_text(json.dumps({**data, "versions": {"torch": "2.0"}}))
    with pytest.raises(LayerpruneError, match=r"prune_report.json: unknown field 'versions'"):
        read_prune_report(pruned)
    del data["method"]["score"]
    (pruned / "prune_report.json").write_text(json.dumps(data))
    with pytest.raises(LayerpruneError, match=r"prune_report.json: field 'method.score' missing"):
        read_prune_report(pruned)


def test_recover_on_a_prune_report_of_an_older_version_is_one_line(capsys, tiny_llama, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(tiny_llama, old)
    source = {"spec": str(tiny_llama), "location": str(tiny_llama), "kind": "local", "identity": {}}
    (old / "prune_report.json").write_text(json.dumps({  # as layerprune wrote it before provenance
        "source": source, "method": {"score": "last"}, "calibration": None, "dropped": [5], "kept": [0, 1, 2, 3, 4],
        "num_blocks_before": 6, "num_blocks_after": 5, "versions": {"layerprune": "0.1.0"}}))
    code, _, err = run_cli(capsys, ["recover", "--model", str(old), "--dry-run"])
    assert_one_line_error(code, err, "prune_report.json", "'provenance' missing")


def test_provenance_records_versions_host_and_this_checkout():
    import layerprune

    record = collect_provenance()
    assert record.layerprune == layerprune.__version__ and record.versions["transformers"] == transformers.__version__
    assert record.host and record.python and record.time.tzinfo is not None
    root = checkout_root(Path(layerprune.__file__).resolve().parent)
    if root is not None and (root / ".git").exists():
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        assert record.git is not None and record.git.commit == head.strip()


def test_provenance_names_the_cpu_and_its_widest_vector_extension(monkeypatch, tmp_path):
    """The math variant, made again from the same code, versions and seed, once came out with other weights: the
    record names the CPU (and the vector extension its kernels can use) that made it."""
    from layerprune.core import provenance

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu sse4_2 avx avx2 avx512f\n\n"
                    "processor\t: 1\nmodel name\t: AMD EPYC 9654\n")
    real = Path

    monkeypatch.setattr(provenance, "Path", lambda path: info if path == "/proc/cpuinfo" else real(path))
    assert provenance.cpu_model() == "AMD EPYC 9654 (avx512f)"
    info.write_text("processor\t: 0\nmodel name\t: Old\nflags\t\t: fpu sse4_2 avx\n")
    assert provenance.cpu_model() == "Old (avx)"
    assert provenance.collect_provenance().cpu == "Old (avx)"


def test_git_state_commit_and_dirty_flag(tmp_path):
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              capture_output=True, text=True, check=True)
        return done.stdout.strip()

    assert git_state(tmp_path) is None  # not a repository
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-q", "-m", "one")
    state = git_state(tmp_path)
    assert state is not None and state.commit == git("rev-parse", "HEAD") and not state.dirty
    (tmp_path / "untracked.txt").write_text("not part of the source")
    assert not git_state(tmp_path).dirty
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_state(tmp_path).dirty
    (tmp_path / "sub").mkdir()
    assert git_state(tmp_path / "sub") is None  # inside a repository, not its top


def test_installed_package_has_no_checkout(tmp_path):
    package = tmp_path / "site-packages" / "layerprune"
    package.mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text("")
    assert checkout_root(package) is None
    src = tmp_path / "src" / "layerprune"
    src.mkdir(parents=True)
    assert checkout_root(src) == tmp_path
