"""`layerprune push`: a model folder (pruned, recovered, variant) or a GGUF file to a hub repo, with its card.

What goes is checked first (export/push_checks.py: whole weights, a record of the check against the source), then
sent in one commit (huggingface_hub's `create_commit`, as transformers' `push_to_hub` does): the folder's files, its
README.md the card its stage wrote (with the scores a run's report stage or `--scores` added), and the deletion of
weight files an earlier push left that the folder no longer has; a GGUF file goes with a card made from the card of
the folder it was exported from (its .export.json names it), without that folder's scores. Nothing is uploaded or
written without a token, and a hub or network failure ends in one line.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError, one_line
from layerprune.core.model_card import (
    CARD_FILE,
    SCORES_HEADING,
    card_metadata,
    card_text,
    read_card,
    without_section,
    write_card,
)
from layerprune.export.push_checks import check_folder, check_gguf, hub_metadata
from layerprune.models.hub_ids import HUB_ID

IGNORED = [".*", "*/.*", "traceback-*"]  # work folders, temporary files, tracebacks of a failed run
REPLACED = ["*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pth", "*.pt",
            "adapter/*"]  # an earlier push's weights the folder no longer has: deleted in the same commit


@dataclass(frozen=True)
class PushPlan:
    """What a push sends: the files (path in the repo, bytes) and the card that goes as README.md."""

    source: Path
    repo: str
    files: list[tuple[str, int]]
    card: str
    card_changed: bool  # the card differs from the README.md in the folder (or there is none: a GGUF file)
    notes: tuple[str, ...] = ()  # what the card that goes leaves out of the folder's, and why

    @property
    def is_file(self) -> bool:
        return self.source.is_file()

    def listing(self, private: bool) -> str:
        """The files with their sizes and the card's YAML metadata, to read (or paste) before pushing."""
        total = sum(size for _, size in self.files)
        visibility = "private" if private else "public unless the owner's default is private"
        lines = [f"would push {self.source} to {self.repo} ({visibility}; an existing repo keeps its own): "
                 f"{len(self.files)} files, {_size(total)}"]
        lines += [f"  {_size(size):>10}  {name}" for name, size in self.files]
        changed = " (made for the file)" if self.is_file else " (refreshed)" if self.card_changed else ""
        return "\n".join([*lines, *(f"note: {note}" for note in self.notes),
                          f"card metadata ({CARD_FILE}{changed}):", "---", card_metadata(self.card).rstrip(), "---"])


def plan_push(source: Path, repo: str, refresh: Callable[[str], str] | None = None,
              allow_unverified: bool = False) -> PushPlan:
    """What `push` would send for `source` (a model folder or a .gguf file), checked (push_checks); `refresh`
    rewrites the card's text (the scores of an evaluation)."""
    source = Path(source)
    if not HUB_ID.match(repo):
        raise LayerpruneError(f"--repo {repo!r} is not a hub repo id (OWNER/NAME)")
    if source.suffix == ".gguf":
        return _plan_gguf(source, repo, refresh, allow_unverified)
    if not (source / "config.json").is_file():
        raise LayerpruneError(f"{source} is neither a model folder (no config.json) nor a .gguf file")
    if not (source / CARD_FILE).is_file():
        raise LayerpruneError(f"{source} has no model card ({CARD_FILE}); push shares the folders layerprune makes "
                              "(prune, recover, variant), whose card says how the model was made")
    check_folder(source, allow_unverified)
    text = (source / CARD_FILE).read_text(encoding="utf-8")
    card, notes = hub_card(refresh(text) if refresh is not None else text)
    files = [(name, len(card.encode()) if name == CARD_FILE else size) for name, size in folder_files(source)]
    return PushPlan(source, repo, files, card, card != text, notes)


def hub_card(text: str) -> tuple[str, tuple[str, ...]]:
    """The card as the hub takes it (push_checks.hub_metadata), and what was left out; unchanged when nothing is."""
    card = read_card_text(text)
    values, note = hub_metadata(card.data.to_dict())
    if note is None:
        return text, ()
    from huggingface_hub import ModelCardData

    data = ModelCardData(**_card_fields(values), ignore_metadata_errors=True)
    return f"---\n{data.to_yaml()}\n---\n" + card.text, (note,)


def read_card_text(text: str) -> Any:
    from huggingface_hub import ModelCard

    return ModelCard(text, ignore_metadata_errors=True)


def folder_files(folder: Path) -> list[tuple[str, int]]:
    """The files a push sends from `folder` (all but IGNORED): (path in the repo, bytes), sorted."""
    from huggingface_hub.utils import filter_repo_objects

    paths = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}
    return [(name, paths[name].stat().st_size) for name in filter_repo_objects(sorted(paths), ignore_patterns=IGNORED)]


def _plan_gguf(path: Path, repo: str, refresh: Callable[[str], str] | None, allow_unverified: bool) -> PushPlan:
    if not path.is_file():
        raise LayerpruneError(f"GGUF file not found: {path}")
    record = export_record(path)
    check_gguf(path, record, allow_unverified)
    card, notes = hub_card(gguf_card(path, repo, record))
    card, more = hub_card(refresh(card)) if refresh is not None else (card, ())
    return PushPlan(path, repo, [(path.name, path.stat().st_size), (CARD_FILE, len(card.encode()))], card, True,
                    notes + more)


def gguf_card(path: Path, repo: str, record: dict[str, Any] | None) -> str:
    """The card of a GGUF file: the metadata and text of the folder it was exported from (its export record names
    it; a relative name read from the record's folder), tagged gguf, with how to run it. The folder's scores stay
    out: they were measured on the folder, not on this file (`--scores` puts an evaluation of the file on it)."""
    from huggingface_hub import ModelCardData

    folder = _exported_from(path, record)
    source = read_card(folder / CARD_FILE) if folder is not None and (folder / CARD_FILE).is_file() else None
    values = source.data.to_dict() if source is not None else {}
    for key in ("library_name", "model-index", "model_name"):
        values.pop(key, None)
    values["tags"] = [*dict.fromkeys([*(values.get("tags") or []), "gguf"])]
    outtype = (record or {}).get("outtype", "unknown")
    values["layerprune"] = {**(values.get("layerprune") or {}), "gguf": {
        "file": path.name, "outtype": outtype, "exported_from": str(folder) if folder else None}}
    data = ModelCardData(**_card_fields(values), ignore_metadata_errors=True)
    lines = [f"# {path.name}", "",
             f"One GGUF file ({outtype}) for llama.cpp and Ollama, written by `layerprune export`"
             + (" from the model described below." if source is not None else "; no record of its source was found."),
             "", f"- llama.cpp: `llama-cli -hf {repo} -cnv`",
             f"- Ollama: `ollama run hf.co/{repo}`"]
    if source is not None:
        lines += ["", "The scores of the folder it was exported from are on that folder's card, not here: this file "
                  "was not evaluated (`layerprune evaluate FILE.gguf`, then `push --scores`).", "",
                  without_section(source.text, SCORES_HEADING).strip()]
    return card_text(data, lines)


def _exported_from(path: Path, record: dict[str, Any] | None) -> Path | None:
    if not record or not record.get("model"):
        return None
    folder = Path(record["model"])  # absolute since export resolves it; an older record's relative to where it ran
    return folder if folder.is_absolute() or not (path.parent / folder).is_dir() else path.parent / folder


def _card_fields(values: dict[str, Any]) -> dict[str, Any]:
    """ModelCardData's arguments from a card's metadata dict (model-index read back into eval_results)."""
    from huggingface_hub.repocard_data import model_index_to_eval_results

    values = dict(values)
    index = values.pop("model-index", None)
    if index:
        name, results = model_index_to_eval_results(index)
        values.update(model_name=name, eval_results=results)
    return values


def export_record(path: Path) -> dict[str, Any] | None:
    """What `export --gguf` recorded beside the file (FILE.export.json, or a run's export.json), or None."""
    for record in (path.with_suffix(".export.json"), path.parent / "export.json"):
        try:
            data = json.loads(record.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        data = data.get("gguf", data) if isinstance(data, dict) else None
        if isinstance(data, dict) and Path(str(data.get("output", ""))).name == path.name:
            return data
    return None


def push(plan: PushPlan, private: bool = False, token: str | None = None) -> str:
    """Create the repo (kept when it exists; private when asked, else the owner's default), send the plan in one
    commit, then write the card that went into the folder where it changed; the commit's url. No token, no network,
    or the hub refusing: one LayerpruneError line, nothing uploaded, the folder as it was."""
    from huggingface_hub import HfApi, get_token

    token = token or get_token()
    if token is None:
        raise LayerpruneError("no Hugging Face token: run `hf auth login` or set HF_TOKEN; nothing was pushed")
    api = HfApi(token=token)
    with hub_errors(plan.repo):
        api.create_repo(plan.repo, private=True if private else None, exist_ok=True)
        url = api.create_commit(repo_id=plan.repo, operations=commit_operations(api, plan),
                                commit_message=f"layerprune: {plan.source.name}")
    if plan.card_changed and not plan.is_file:
        write_card(plan.source, plan.card)  # the folder's card says what the hub's says
    return str(url)


def commit_operations(api: Any, plan: PushPlan) -> list[Any]:
    """The plan's files (its card as text), and for a folder the deletion of the repo's weight files (REPLACED) it
    does not have: a sharded model pushed over a single file would otherwise load the old file first."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete
    from huggingface_hub.utils import filter_repo_objects

    root = plan.source.parent if plan.is_file else plan.source
    operations: list[Any] = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=plan.card.encode() if name == CARD_FILE
                           else str(root / name)) for name, _ in plan.files]
    if plan.is_file:
        return operations
    sent = {name for name, _ in plan.files}
    there = api.list_repo_files(plan.repo)
    stale = [name for name in filter_repo_objects(there, allow_patterns=REPLACED) if name not in sent]
    return operations + [CommitOperationDelete(path_in_repo=name) for name in stale]


@contextlib.contextmanager
def hub_errors(repo: str) -> Iterator[None]:
    """huggingface_hub's and the network's failures as one LayerpruneError line naming the repo."""
    try:
        yield
    except network_errors() as exc:
        raise LayerpruneError(f"could not push to {repo}: {type(exc).__name__}: {one_line(exc)[:200]}") from exc


def network_errors() -> tuple[type[BaseException], ...]:
    """huggingface_hub's HTTP and offline-mode errors, and the HTTP clients' connection errors."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    found: list[type[BaseException]] = [HfHubHTTPError, OfflineModeIsEnabled, ConnectionError, TimeoutError,
                                        ValueError]  # ValueError: the hub's check of the card's metadata
    for module, name in (("httpx", "HTTPError"), ("httpx2", "HTTPError"), ("requests", "RequestException")):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def _size(count: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"
