"""models/identity: the weights' hash, its memo on disk (atomic write, defensive read), and who may import it."""

from __future__ import annotations

import ast
import hashlib
import json
import os
from pathlib import Path

import pytest

from layerprune.models import ModelSource
from layerprune.models.identity import MEMO_FILE, model_fingerprint, model_hash, quick_digest, read_memo

SRC = Path(__file__).resolve().parents[1] / "src" / "layerprune"


def expected_hash(folder: Path) -> str:
    """The documented digest, computed here by hand: name:sha256 per weight file and config.json, sorted by name."""
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        digest.update(f"{name}:{hashlib.sha256((folder / name).read_bytes()).hexdigest()}\n".encode())
    return digest.hexdigest()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    (folder / "model.safetensors").write_bytes(os.urandom(4096))
    (folder / "tokenizer.json").write_text("{}")  # not part of the identity
    return folder


def source(folder: Path) -> ModelSource:
    return ModelSource(str(folder), str(folder), "local")


@pytest.mark.parametrize("memo", ["", "{", '{"a": ', "[1, 2]", "null", '{"x": {"size": "big"}}', "\udcff"])
def test_garbled_memo_is_ignored_and_rewritten(model_dir, tmp_path, memo):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / MEMO_FILE).write_text(memo, errors="surrogateescape")
    assert model_hash(source(model_dir), cache) == expected_hash(model_dir)
    assert len(read_memo(cache / MEMO_FILE)) == 2  # rewritten whole: config.json and the weights


def test_truncated_memo_from_an_interrupted_write_is_ignored(model_dir, tmp_path):
    cache = tmp_path / "cache"
    model_hash(source(model_dir), cache)
    memo = cache / MEMO_FILE
    memo.write_text(memo.read_text()[:-40])  # what a writer killed halfway would leave without os.replace
    assert read_memo(memo) == {}
    assert model_hash(source(model_dir), cache) == expected_hash(model_dir)


def test_partial_temporary_file_is_ignored(model_dir, tmp_path):
    cache = tmp_path / "cache"
    model_hash(source(model_dir), cache)
    good = (cache / MEMO_FILE).read_text()
    (cache / f".{MEMO_FILE}.tmp-killed").write_text(good[: len(good) // 2])  # a writer killed before os.replace
    assert model_hash(source(model_dir), cache) == expected_hash(model_dir)
    assert (cache / MEMO_FILE).read_text() == good


def test_a_write_interrupted_before_replace_leaves_the_old_memo(model_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    model_hash(source(model_dir), cache)
    good = (cache / MEMO_FILE).read_text()
    (model_dir / "model.safetensors").write_bytes(os.urandom(4096))

    def killed(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        model_hash(source(model_dir), cache)
    assert (cache / MEMO_FILE).read_text() == good
    assert [p.name for p in cache.iterdir()] == [MEMO_FILE]  # no temporary file left behind


def test_a_memo_entry_whose_file_changed_is_recomputed(model_dir, tmp_path):
    cache = tmp_path / "cache"
    before = model_hash(source(model_dir), cache)
    weights = model_dir / "model.safetensors"
    stat = weights.stat()
    weights.write_bytes(os.urandom(4097))  # another size
    assert model_hash(source(model_dir), cache) == expected_hash(model_dir) != before
    weights.write_bytes(os.urandom(4097))  # same size, another time
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert model_hash(source(model_dir), cache) == expected_hash(model_dir)


def test_memo_spares_rehashing(model_dir, tmp_path, monkeypatch):
    from layerprune.models import identity

    cache = tmp_path / "cache"
    first = model_hash(source(model_dir), cache)
    monkeypatch.setattr(identity, "sha256_of", lambda path: pytest.fail(f"re-hashed {path}"))
    assert model_hash(source(model_dir), cache) == first


def test_an_unwritable_cache_costs_a_rehash_not_an_error(model_dir, tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be")
    assert model_hash(source(model_dir), blocker) == expected_hash(model_dir)


def test_fingerprint_counts_the_blocks(model_dir, tmp_path):
    cache = tmp_path / "cache"
    four = model_fingerprint(source(model_dir), cache)
    assert four == hashlib.sha256(f"{expected_hash(model_dir)}:4".encode()).hexdigest()
    hub = ModelSource("org/name", "org/name", "hub", {"hub_id": "org/name", "revision": "abc"})
    unpinned = ModelSource("org/name", "org/name", "hub", {"hub_id": "org/name"})
    assert model_hash(hub, cache) != model_hash(unpinned, cache)


def test_quick_digest_reads_the_head_and_the_size(tmp_path):
    path = tmp_path / "model.gguf"
    data = os.urandom(3000)
    path.write_bytes(data)
    assert quick_digest(path, 1000) == hashlib.sha256(data[:1000] + b"3000").hexdigest()  # the GGUF cache key
    assert quick_digest(path, 1 << 20) == hashlib.sha256(data + b"3000").hexdigest()


def imported_modules(folder: Path) -> set[str]:
    """Every module named by an import statement anywhere under `folder` (lazy imports in functions included)."""
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
    return found


def test_prune_does_not_import_evaluate():
    assert not {m for m in imported_modules(SRC / "prune") if m.startswith("layerprune.evaluate")}
