"""Per-block importance made once per model, as evaluation results are: one model's result on one task is kept under
<cache>/importance/<model fingerprint>/<task>-<key>.json, written whole or not at all. An analysis that scores the same
weights on the same items with the same settings again (the original in each of several variant studies, the same
control) reads it instead of ablating every block again, and loads no model whose every task is kept.

The key is everything that can change the result: the weights (the folder's fingerprint) and, for a local model, its
tokenizer and chat-template files; the items themselves (prompt, scored target, answer and aliases); every analysis
setting but the model list, task list and where output goes; the model's own decoding; the run's seed, dtype and
device; the layerprune release and this module's VERSION."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from layerprune.analyze.schemas import ImportanceAnalysis
from layerprune.analyze.tasks import TaskItem
from layerprune.core.outputs import write_atomic
from layerprune.core.settings import RunSettings
from layerprune.core.version import package_version
from layerprune.models import ModelSource
from layerprune.models.identity import Memo, file_sha256, model_fingerprint

FOLDER = "importance"
VERSION = 1  # bump when the same items and settings would measure differently (within a release)
NOT_IN_KEY = {"models", "tasks", "output", "overwrite", "data_dir", "dry_run", "tokenizers", "per_model"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt")
_TOKENIZER_HASHES: Memo = {}  # the tokenizer files' hashes, for this process (as evaluate/cache.py's data files)


def model_key(source: ModelSource, settings: RunSettings) -> str:
    """The weights' fingerprint (hashed once per file, memoised in the cache), with a local model's tokenizer files:
    the tokens NLL scores and the prompts a chat template renders."""
    digest = hashlib.sha256(model_fingerprint(source, settings.resolved_cache_dir()).encode())
    folder = Path(source.location)
    for name in TOKENIZER_FILES if folder.is_dir() else ():
        if (folder / name).is_file():
            digest.update(f"{name}:{file_sha256(folder / name, _TOKENIZER_HASHES)}\n".encode())
    return digest.hexdigest()


def result_key(config: ImportanceAnalysis, task: str, items: list[TaskItem], spec: str, settings: RunSettings) -> str:
    """What can change one model's result on one task, hashed."""
    body = {"task": task, "version": VERSION,
            "items": [[item.prompt, item.target, item.answer, list(item.aliases)] for item in items],
            "analysis": config.model_dump(mode="json", exclude=NOT_IN_KEY),
            "decoding": config.decoding(spec).model_dump(mode="json"), "seed": settings.seed,
            "dtype": str(settings.resolved_dtype()), "device": settings.resolved_device().type,
            "layerprune": package_version()}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def _path(settings: RunSettings, model: str, task: str, key: str) -> Path:
    return settings.resolved_cache_dir() / FOLDER / model / f"{task}-{key[:24]}.json"


def kept_result(settings: RunSettings, model: str, task: str, key: str) -> dict[str, Any] | None:
    """The kept result (None: not kept, or a file from another key or torn)."""
    path = _path(settings, model, task, key)
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return kept["result"] if isinstance(kept, dict) and kept.get("key") == key else None


def keep_result(settings: RunSettings, model: str, task: str, key: str, result: dict[str, Any]) -> None:
    """Keep one model's result on one task (already as JSON holds it), whole or not at all."""
    write_atomic(_path(settings, model, task, key), json.dumps({"key": key, "result": result}))
