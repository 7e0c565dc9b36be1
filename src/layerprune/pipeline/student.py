"""The unpruned original as a student: its files linked into a folder of the study's own.

A k = 0 control (the recovery applied to the original) and a post-trained variant train the original with the
original as its teacher, and recover refuses a student whose folder is its teacher's. The checkpoint's files are
hard-linked (copied where the file system cannot link) into `target`, once: no weights are loaded or written again,
which matters at 7-70B. Every kind of model resolves to a folder: a GGUF or an embedded model to its converted
copy in the cache, a hub id to its snapshot at the resolved commit.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from layerprune.core.settings import RunSettings


def original_as_student(model: str | None, settings: RunSettings, target: Path) -> Path:
    """`target` holding the original's checkpoint files (made once; an existing one is returned as it is)."""
    if (target / "config.json").is_file():
        return target
    location = checkpoint_folder(model, settings)
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for file in location.iterdir():
        if file.is_file():
            try:
                os.link(file.resolve(), tmp / file.name)
            except OSError:
                shutil.copy2(file, tmp / file.name)
    tmp.replace(target)
    return target


def checkpoint_folder(model: str | None, settings: RunSettings) -> Path:
    """The folder of the model's checkpoint files (a hub model's snapshot at its resolved commit)."""
    from layerprune.models import resolve_model

    source = resolve_model(model or "embedded", settings)
    if source.kind == "hub":
        from layerprune.models.hub import download_checkpoint, resolve_revision

        return Path(download_checkpoint(source.location, resolve_revision(source)))
    return Path(source.location)
