"""Hub sources against a fake hub cache folder (no network): the commit is resolved before results are keyed on
it, and only the files the checkpoint's index names are downloaded."""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path

import pytest

from layerprune.models import hub
from layerprune.models.identity import model_hash
from layerprune.models.loading import ModelSource

SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
REPO_FILES = ["config.json", "tokenizer.json", "generation_config.json", hub.INDEX_FILE, *SHARDS,
              "consolidated.safetensors", "original/params.json", "README.md"]


def fake_cache(root: Path, sha: str) -> Path:
    """models--acme--tiny in the hub cache layout: refs/main -> sha, snapshots/sha/<files>."""
    repo = root / "models--acme--tiny"
    snapshot = repo / "snapshots" / sha
    (snapshot / "original").mkdir(parents=True, exist_ok=True)
    for name in REPO_FILES:
        (snapshot / name).write_text("{}")
    (snapshot / hub.INDEX_FILE).write_text(json.dumps({"weight_map": {"a": SHARDS[0], "b": SHARDS[1]}}))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(sha)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_the_cache_key_follows_the_commit_the_hub_id_points_at(offline_hub, tmp_path):
    fake_cache(offline_hub, "a" * 40)
    first = model_hash(ModelSource("acme/tiny", "acme/tiny", "hub", {"hub_id": "acme/tiny"}), tmp_path)
    fake_cache(offline_hub, "b" * 40)  # the repo was updated: main points at a new commit
    source = ModelSource("acme/tiny", "acme/tiny", "hub", {"hub_id": "acme/tiny"})
    assert model_hash(source, tmp_path) != first and source.identity["revision"] == "b" * 40


def test_only_the_files_the_index_names_are_downloaded(offline_hub, monkeypatch, tmp_path):
    snapshot = fake_cache(offline_hub, "c" * 40)
    monkeypatch.setattr("huggingface_hub.constants.is_offline_mode", lambda: False)  # "online", served by the fake
    monkeypatch.setattr("huggingface_hub.HfApi.model_info", lambda self, repo, revision=None: type("I", (), {
        "sha": "c" * 40})())
    monkeypatch.setattr("huggingface_hub.HfApi.list_repo_files", lambda self, repo, revision=None: REPO_FILES)
    monkeypatch.setattr("huggingface_hub.hf_hub_download", lambda repo, name, revision=None: str(snapshot / name))
    asked = {}

    def snapshot_download(repo, revision=None, allow_patterns=None):
        asked.update(revision=revision, patterns=allow_patterns)
        target = tmp_path / "download"
        target.mkdir()
        for name in REPO_FILES:
            if any(fnmatch.fnmatch(name, p) for p in allow_patterns):
                (target / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(snapshot / name, target / name)
        return str(target)

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    folder = hub.download_checkpoint("acme/tiny")
    assert asked["revision"] == "c" * 40
    assert sorted(p.name for p in folder.glob("*.safetensors")) == SHARDS  # no consolidated.safetensors
    assert (folder / "config.json").is_file() and not (folder / "original").exists()


def test_checkpoint_patterns_without_an_index():
    assert hub.checkpoint_patterns(["config.json", "model.safetensors", "consolidated.safetensors"], None) == [
        "config.json", "model.safetensors"]
