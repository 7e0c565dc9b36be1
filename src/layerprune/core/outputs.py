"""Output directories that appear whole or not at all."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError


def check_output_dir(output: Path, overwrite: bool, inputs: tuple[Path, ...] = ()) -> None:
    """Refuse an output that exists (without overwrite), that is, holds or lies in an input, or that cannot be made
    (a file where a parent folder should be)."""
    check_not_input(output, inputs)
    out = output.expanduser().resolve()
    if out.exists() and not overwrite:
        raise LayerpruneError(f"output {output} already exists; pass --overwrite to replace it")
    check_can_make(output)


def check_can_make(output: Path) -> None:
    """Refuse an output folder that is a file, or lies under one."""
    out = output.expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise LayerpruneError(f"output {output} exists and is not a directory")
    parent = next(p for p in out.parents if p.exists())
    if not parent.is_dir():
        raise LayerpruneError(f"cannot make output {output}: {parent} is a file, not a folder")


def check_not_input(output: Path, inputs: tuple[Path, ...]) -> None:
    """Refuse an output that is an input, holds one or lies inside one: replacing it would delete the input."""
    out = output.expanduser().resolve()
    for source in inputs:
        src = source.expanduser().resolve()
        if out == src or src.is_relative_to(out) or out.is_relative_to(src):
            raise LayerpruneError(f"output {output} is the input {source} (or holds it, or lies inside it); "
                                  "choose another")


def input_paths(*values: Any) -> tuple[Path, ...]:
    """The inputs among `values` that are on this disk, for check_output_dir: paths and specs naming an existing
    file or folder, sources with a local `location`; lists and tuples looked into; anything else (a hub id, an
    embedded model, None) left out."""
    found: list[Path] = []
    for value in values:
        if isinstance(value, (list, tuple)):
            found += input_paths(*value)
        elif isinstance(value, (str, os.PathLike)) and str(value) and Path(value).expanduser().exists():
            found.append(Path(value).expanduser())
        elif getattr(value, "is_local", False) and getattr(value, "location", None):
            found.append(Path(value.location))
    return tuple(found)


def run_folder(name: str) -> Path:
    """runs/NAME, for a recipe's or study's name that is one plain folder name (not empty, '.', '..' or a path)."""
    if name in ("", ".", "..") or "/" in name or "\\" in name:
        raise LayerpruneError(f"name {name!r} is not a plain folder name (its run folder is runs/NAME); choose "
                              "another, or give --output")
    return Path("runs") / name


@contextlib.contextmanager
def atomic_output_dir(output: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `output`, on failure it vanishes."""
    output = output.expanduser()
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    except OSError as exc:
        raise LayerpruneError(f"cannot make output {output}: {exc.strerror or exc} ({exc.filename or output})") \
            from exc
    try:
        yield tmp
        _normal_permissions(tmp)
        if output.exists():
            if not overwrite:
                raise LayerpruneError(f"output {output} appeared while writing; pass --overwrite to replace it")
            shutil.rmtree(output)
        tmp.rename(output)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno == errno.ENOSPC:
            raise LayerpruneError(f"no space left on device while writing {output}; nothing was written") from exc
        raise LayerpruneError(f"could not write {output}: {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def cache_lock(cache_dir: Path, name: str) -> Iterator[None]:
    """Hold an exclusive lock named `name` in the cache while building one of its entries.

    Two processes sharing a cache (two runs, or parallel test workers) then build an entry once: the second waits,
    re-checks and finds it made. An advisory lock (flock) in `cache_dir/locks`; where the platform has none
    (Windows) it holds nothing and each build is still atomic.
    """
    locks = cache_dir / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with file_lock(locks / f"{name}.lock"):
        yield


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock (flock) on the file at `path` (made if absent); where the platform has none
    (Windows) it holds nothing."""
    with open(path, "a") as handle:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write a file (text as UTF-8, or bytes) that appears whole or not at all: a temporary sibling, then
    os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with (os.fdopen(fd, "wb") if isinstance(text, bytes) else os.fdopen(fd, "w", encoding="utf-8")) as handle:
            handle.write(text)
        os.chmod(name, 0o666 & ~current_umask())
        os.replace(name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise


def current_umask() -> int:
    """The process umask (read by setting it and putting it back)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _normal_permissions(root: Path) -> None:
    """mkdtemp makes a private directory; give the result the user's usual permissions."""
    umask = current_umask()
    root.chmod(0o777 & ~umask)
    for path in root.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
