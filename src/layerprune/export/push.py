"""`layerprune push`: a model folder (pruned, recovered, variant) or a GGUF file to a hub repo, with its card.

A folder goes as it is, through huggingface_hub's `upload_folder`, its README.md the card its stage wrote (with the
scores a run's report stage or `--scores` added); a GGUF file goes with a card made from the card of the folder it
was exported from (its .export.json names it), in one commit. Nothing is uploaded or written without a token, and a
hub or network failure ends in one line.
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
from layerprune.core.model_card import CARD_FILE, card_metadata, card_text, read_card, write_card
from layerprune.models.hub_ids import HUB_ID

IGNORED = [".*", "*/.*", "traceback-*"]  # work folders, temporary files, tracebacks of a failed run


@dataclass(frozen=True)
class PushPlan:
    """What a push sends: the files (path in the repo, bytes) and the card that goes as README.md."""

    source: Path
    repo: str
    files: list[tuple[str, int]]
    card: str
    card_changed: bool  # the card differs from the README.md in the folder (or there is none: a GGUF file)

    @property
    def is_file(self) -> bool:
        return self.source.is_file()

    def listing(self, private: bool) -> str:
        """The files with their sizes and the card's YAML metadata, to read (or paste) before pushing."""
        total = sum(size for _, size in self.files)
        lines = [f"would push {self.source} to {self.repo} ({'private' if private else 'public'}): "
                 f"{len(self.files)} files, {_size(total)}"]
        lines += [f"  {_size(size):>10}  {name}" for name, size in self.files]
        changed = " (made for the file)" if self.is_file else " (refreshed)" if self.card_changed else ""
        return "\n".join([*lines, f"card metadata ({CARD_FILE}{changed}):", "---", card_metadata(self.card).rstrip(),
                          "---"])


def plan_push(source: Path, repo: str, refresh: Callable[[str], str] | None = None) -> PushPlan:
    """What `push` would send for `source` (a model folder or a .gguf file); `refresh` rewrites the card's text
    (the scores of an evaluation)."""
    source = Path(source)
    if not HUB_ID.match(repo):
        raise LayerpruneError(f"--repo {repo!r} is not a hub repo id (OWNER/NAME)")
    if source.suffix == ".gguf":
        return _plan_gguf(source, repo, refresh)
    if not (source / "config.json").is_file():
        raise LayerpruneError(f"{source} is neither a model folder (no config.json) nor a .gguf file")
    if not (source / CARD_FILE).is_file():
        raise LayerpruneError(f"{source} has no model card ({CARD_FILE}); push shares the folders layerprune makes "
                              "(prune, recover, variant), whose card says how the model was made")
    text = (source / CARD_FILE).read_text(encoding="utf-8")
    card = refresh(text) if refresh is not None else text
    files = [(name, len(card.encode()) if name == CARD_FILE else size) for name, size in folder_files(source)]
    return PushPlan(source, repo, files, card, card != text)


def folder_files(folder: Path) -> list[tuple[str, int]]:
    """The files `upload_folder` sends from `folder` with IGNORED: (path in the repo, bytes), sorted."""
    from huggingface_hub.utils import filter_repo_objects

    paths = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}
    return [(name, paths[name].stat().st_size) for name in filter_repo_objects(sorted(paths), ignore_patterns=IGNORED)]


def _plan_gguf(path: Path, repo: str, refresh: Callable[[str], str] | None) -> PushPlan:
    if not path.is_file():
        raise LayerpruneError(f"GGUF file not found: {path}")
    card = gguf_card(path, repo)
    card = refresh(card) if refresh is not None else card
    return PushPlan(path, repo, [(path.name, path.stat().st_size), (CARD_FILE, len(card.encode()))], card, True)


def gguf_card(path: Path, repo: str) -> str:
    """The card of a GGUF file: the metadata and text of the folder it was exported from (its export record names
    it), tagged gguf, with how to run it."""
    from huggingface_hub import ModelCardData

    record = export_record(path)
    folder = Path(record["model"]) if record and record.get("model") else None
    source = read_card(folder / CARD_FILE) if folder is not None and (folder / CARD_FILE).is_file() else None
    values = source.data.to_dict() if source is not None else {}
    values.pop("library_name", None)
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
        lines += ["", source.text.strip()]
    return card_text(data, lines)


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
    """Create the repo (kept when it exists), refresh the folder's card where it changed, upload; the commit's
    url. No token, no network, or the hub refusing: one LayerpruneError line, nothing uploaded."""
    from huggingface_hub import HfApi, get_token

    token = token or get_token()
    if token is None:
        raise LayerpruneError("no Hugging Face token: run `hf auth login` or set HF_TOKEN; nothing was pushed")
    api = HfApi(token=token)
    with hub_errors(plan.repo):
        api.create_repo(plan.repo, private=private, exist_ok=True)
    if plan.is_file:
        with hub_errors(plan.repo):
            return str(_commit_file(api, plan))
    previous = (plan.source / CARD_FILE).read_text(encoding="utf-8")
    if plan.card_changed:
        write_card(plan.source, plan.card)  # the folder's card says what the hub's says
    try:
        with hub_errors(plan.repo):
            return str(api.upload_folder(repo_id=plan.repo, folder_path=plan.source, ignore_patterns=IGNORED,
                                         commit_message=f"layerprune: {plan.source.name}"))
    except BaseException:
        if plan.card_changed:
            write_card(plan.source, previous)  # nothing pushed: the folder as it was
        raise


def _commit_file(api: Any, plan: PushPlan) -> Any:
    """The GGUF file and its card in one commit."""
    from huggingface_hub import CommitOperationAdd

    name = plan.source.name
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(plan.source)),
                  CommitOperationAdd(path_in_repo=CARD_FILE, path_or_fileobj=plan.card.encode())]
    return api.create_commit(repo_id=plan.repo, operations=operations, commit_message=f"layerprune: {name}")


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

    found: list[type[BaseException]] = [HfHubHTTPError, OfflineModeIsEnabled, ConnectionError, TimeoutError]
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
