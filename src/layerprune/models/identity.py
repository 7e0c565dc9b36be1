"""What identifies a model's exact weights: the hashes of its files, or its hub id and revision.

Hashing a large checkpoint takes a while, so each file's hash is remembered in a memo file in the cache, by
path, size and modification time. The memo is written atomically and read defensively: an entry that is
garbled, or whose file has since changed size or time, is hashed again, never trusted.

Two hashes, each with its own memo and its own name wherever it is recorded: `model_hash` (sha256 of each file,
`file_hashes.json`), the key of the evaluation, importance and post-training caches; and `weights_digest`
(xxh3-128 of each file's header and tensor ranges, `file_digests.json`, about ten times faster), the record of
which weights a prune read, which a streamed prune takes from its own copy's pass (`safetensors_copy.file_digest`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from layerprune.core.outputs import write_atomic

if TYPE_CHECKING:
    from layerprune.models.loading import LoadedModel, ModelSource

log = logging.getLogger(__name__)
HASH_CHUNK = 8 << 20
MEMO_FILE = "file_hashes.json"
DIGEST_MEMO_FILE = "file_digests.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin")


class FileHash(BaseModel):
    """A file's sha256 and the size and modification time it had when it was hashed."""

    model_config = ConfigDict(extra="forbid", strict=True)

    size: int = Field(ge=0)
    mtime_ns: int
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


Memo = dict[str, FileHash]  # resolved path -> its hash


class FileDigest(BaseModel):
    """A file's `safetensors_copy.file_digest` (xxh3-128) and the size and modification time it had then."""

    model_config = ConfigDict(extra="forbid", strict=True)

    size: int = Field(ge=0)
    mtime_ns: int
    xxh3_128: str = Field(pattern=r"^[0-9a-f]{32}$")


DigestMemo = dict[str, FileDigest]  # resolved path -> its digest


def sha256_of(path: Path) -> str:
    """The sha256 of a file's bytes, read in chunks."""
    return _sha256_head(path).hexdigest()


def quick_digest(path: Path, limit: int) -> str:
    """A cheap identity for a large file (a GGUF): the sha256 of its first `limit` bytes and its size."""
    digest = _sha256_head(path, limit)
    digest.update(str(path.stat().st_size).encode())
    return digest.hexdigest()


def _sha256_head(path: Path, limit: int | None = None) -> Any:
    """A sha256 object fed the file's first `limit` bytes (all of them by default)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        remaining = limit
        while chunk := handle.read(HASH_CHUNK if remaining is None else min(HASH_CHUNK, remaining)):
            digest.update(chunk)
            if remaining is not None:
                remaining -= len(chunk)
    return digest


def file_sha256(path: Path, memo: Memo) -> str:
    """A file's sha256, taken from `memo` while the file keeps its size and time, else hashed and remembered."""
    stat = path.stat()
    key = str(path.resolve())
    known = memo.get(key)
    if known is None or (known.size, known.mtime_ns) != (stat.st_size, stat.st_mtime_ns):
        memo[key] = FileHash(size=stat.st_size, mtime_ns=stat.st_mtime_ns, sha256=sha256_of(path))
    return memo[key].sha256


def read_memo(path: Path, entry: type[BaseModel] = FileHash) -> dict[str, Any]:
    """The remembered hashes (entries of `entry`); a missing, empty, truncated or garbled memo (or entry) is left
    out, never an error."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # ValueError: bad JSON or bytes that are not text
        return {}
    if not isinstance(data, dict):
        return {}
    memo: dict[str, Any] = {}
    for key, value in data.items():
        try:
            memo[key] = entry.model_validate(value)
        except ValidationError:
            log.debug("ignoring a garbled entry of %s: %s", path, key)
    return memo


def write_memo(path: Path, memo: Mapping[str, BaseModel]) -> None:
    """Save the memo whole or not at all; a cache that cannot be written costs a re-hash next time, nothing more."""
    body = json.dumps({key: entry.model_dump() for key, entry in sorted(memo.items())}, indent=0)
    try:
        write_atomic(path, body)
    except OSError as exc:
        log.warning("could not save the file hashes to %s (%s); they will be computed again", path, exc)


def weight_files(folder: Path) -> list[Path]:
    """The files that decide what a local model computes: its weights and config.json."""
    return sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES or p.name == "config.json")


def undigested_files(folder: Path, cache_dir: Path) -> list[Path]:
    """The weight files of `folder` whose digest the digest memo in `cache_dir` does not hold for their present size
    and modification time: the ones `weights_digest` would read."""
    memo = read_memo(cache_dir / DIGEST_MEMO_FILE, FileDigest)
    return [path for path in weight_files(folder) if not _current(memo.get(str(path.resolve())), path)]


def weights_digest(folder: Path, cache_dir: Path, known: Mapping[str, tuple[int, int, str]] | None = None) -> str:
    """The xxh3-128 over `name:digest` lines of the weight files of `folder` (and config.json), each file's
    `file_digest` taken from `known` (file name -> size, mtime_ns and digest computed elsewhere, e.g. by a copy's
    own read), else from the memo in `cache_dir` while the file keeps its size and time, else read; remembered."""
    from layerprune.models.safetensors_copy import file_digest

    memo_path = cache_dir / DIGEST_MEMO_FILE
    memo: DigestMemo = read_memo(memo_path, FileDigest)
    for name, (size, mtime_ns, digest) in (known or {}).items():
        memo[str((folder / name).resolve())] = FileDigest(size=size, mtime_ns=mtime_ns, xxh3_128=digest)
    top, changed = xxhash.xxh3_128(), bool(known)
    for path in weight_files(folder):
        key = str(path.resolve())
        if not _current(memo.get(key), path):
            stat, changed = path.stat(), True
            memo[key] = FileDigest(size=stat.st_size, mtime_ns=stat.st_mtime_ns, xxh3_128=file_digest(path))
        top.update(f"{path.name}:{memo[key].xxh3_128}\n".encode())
    if changed:
        write_memo(memo_path, memo)
    return top.hexdigest()


def _current(known: FileHash | FileDigest | None, path: Path) -> bool:
    stat = path.stat()
    return known is not None and (known.size, known.mtime_ns) == (stat.st_size, stat.st_mtime_ns)


def model_hash(source: ModelSource, cache_dir: Path) -> str:
    """What identifies the exact weights: file hashes for local models (memo in `cache_dir`), id and revision
    for the hub."""
    if not source.is_local:  # the commit resolved first: an updated hub repo is another model
        from layerprune.models.hub import resolve_revision

        resolve_revision(source)
        return _sha256_text(json.dumps(source.identity, sort_keys=True, default=str))
    memo_path = cache_dir / MEMO_FILE
    memo = read_memo(memo_path)
    digest = hashlib.sha256()
    for path in weight_files(Path(source.location)):
        digest.update(f"{path.name}:{file_sha256(path, memo)}\n".encode())
    write_memo(memo_path, memo)
    return digest.hexdigest()


def model_fingerprint(source: ModelSource, cache_dir: Path, loaded: LoadedModel | None = None) -> str:
    """The weights' hash plus the block count: a model with blocks dropped in memory differs from its files."""
    if loaded is not None:
        layers = loaded.model.config.get_text_config().num_hidden_layers
    else:
        layers = _config_layers(Path(source.location) / "config.json")
    return _sha256_text(f"{model_hash(source, cache_dir)}:{layers}")


def _config_layers(config: Path) -> Any:
    body = json.loads(config.read_text()) if config.is_file() else {}
    return body.get("num_hidden_layers", body.get("text_config", {}).get("num_hidden_layers"))


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
