"""Output directories that appear whole or not at all."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from layerprune.core.errors import LayerpruneError


def check_output_dir(output: Path, overwrite: bool, inputs: tuple[Path, ...] = ()) -> None:
    """Refuse an output that exists (without overwrite) or that is, or holds, an input."""
    out = output.expanduser().resolve()
    for source in inputs:
        src = source.expanduser().resolve()
        if out == src or src.is_relative_to(out) or out.is_relative_to(src):
            raise LayerpruneError(f"output {output} is the input model directory (or inside it); choose another")
    if out.exists() and not overwrite:
        raise LayerpruneError(f"output {output} already exists; pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise LayerpruneError(f"output {output} exists and is not a directory")


@contextlib.contextmanager
def atomic_output_dir(output: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `output`, on failure it vanishes."""
    output = output.expanduser()
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
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
        os.chmod(name, 0o666 & ~_umask())
        os.replace(name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _normal_permissions(root: Path) -> None:
    """mkdtemp makes a private directory; give the result the user's usual permissions."""
    umask = _umask()
    root.chmod(0o777 & ~umask)
    for path in root.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
