"""Hub models: the exact commit a hub id stands for (resolved before anything is keyed on it) and a download of
only the files the checkpoint needs (its index's shards, not a consolidated copy beside them)."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError, one_line

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
META_PATTERNS = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]  # config, tokenizer, generation settings


def hub_revision(repo: str, revision: str | None = None) -> str | None:
    """The commit sha `revision` (default: the main branch) of a hub model points at now: asked of the hub, or,
    offline, read from the local hub cache (what a load would use); None when neither knows it."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache

    if not constants.is_offline_mode():
        try:
            return HfApi().model_info(repo, revision=revision).sha
        except Exception:  # no network, private, missing: the cache may still know
            pass
    cached = try_to_load_from_cache(repo, "config.json", revision=revision)
    return Path(cached).parent.name if isinstance(cached, str) else None


def resolve_revision(source: Any) -> str | None:
    """Pin a hub ModelSource to its current commit (identity['revision']) once; the commit, or None."""
    if source.kind != "hub":
        return None
    if not source.identity.get("revision"):
        source.identity["revision"] = hub_revision(source.location)
    return source.identity.get("revision")


def checkpoint_patterns(files: list[str], index: dict[str, Any] | None) -> list[str]:
    """allow_patterns for the checkpoint: config and tokenizer files, and the weights its index names (or the one
    model.safetensors); other .safetensors files beside them (consolidated.safetensors) are not the checkpoint."""
    if index is not None:
        weights = sorted(set(index.get("weight_map", {}).values()))
        if not weights:
            raise LayerpruneError(f"{INDEX_FILE} names no weight files")
    elif SINGLE_FILE in files:
        weights = [SINGLE_FILE]
    else:
        weights = [f for f in files if f.endswith(".safetensors") and "/" not in f]
    metas = [f for f in files if "/" not in f and any(fnmatch.fnmatch(f, p) for p in META_PATTERNS)]
    return sorted(set(metas + weights))


def download_checkpoint(repo: str, revision: str | None = None) -> Path:
    """The local folder of a hub checkpoint at `revision` (resolved first), holding only what checkpoint_patterns
    names."""
    from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download

    sha = revision or hub_revision(repo)
    try:
        if constants.is_offline_mode():
            return Path(snapshot_download(repo, revision=sha))  # the cache holds what was downloaded before
        files = HfApi().list_repo_files(repo, revision=sha)
        index = json.loads(Path(hf_hub_download(repo, INDEX_FILE, revision=sha)).read_text()) \
            if INDEX_FILE in files else None
        return Path(snapshot_download(repo, revision=sha, allow_patterns=checkpoint_patterns(files, index)))
    except LayerpruneError:
        raise
    except Exception as exc:  # network, auth, missing repo: all one line
        raise LayerpruneError(f"could not download {repo}: {one_line(exc)[:200]}") from exc
