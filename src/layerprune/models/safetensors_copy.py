"""Copy tensors from safetensors files into new ones as bytes: headers parsed, data ranges copied in chunks.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte range of
the data section; `__metadata__`) padded with spaces to a multiple of 8, then the raw data. A pruned checkpoint
holds the source's tensors under new names, so each output file is its new header followed by byte ranges of the
source files, written at their planned offsets: nothing is deserialised, and the layout is the one
`safetensors.torch.save_file` writes (its dtype order, then names), so the files are byte for byte what `save_file`
would have made of the same tensors. Each source file is mapped in memory (the page cache, no copy into this
process), and each kept range is hashed (xxh3-128) and written from there a chunk at a time, so its digest is of
the very bytes written (the written model is later checked against it without reading the source again). Where a
source file's own digest is wanted (the source's identity on a first run), it is made from the same pass: the kept
ranges' digests, the header and the dropped ranges hashed besides (`file_digest` computes the same from a file).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
from collections import defaultdict
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from layerprune.core.errors import LayerpruneError
from layerprune.models.safetensors_check import check_safetensors_file

CHUNK = 8 << 20  # bytes read at a time by the checks (copy_check.py)
WRITE_CHUNK = 1 << 20  # bytes hashed, then written, at a time: still in the CPU's cache when written
# safetensors' own data order (its Dtype enum, largest first), so the files match what `save_file` writes
DTYPE_ORDER = ("U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E8M0", "F8_E4M3",
               "F8_E5M2", "I8", "U8", "F6_E3M2", "F6_E2M3", "F4", "BOOL")
METADATA = {"format": "pt"}


@dataclass(frozen=True)
class Stored:
    """One tensor as a file stores it: dtype name, shape, absolute byte range [start, end)."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: Path) -> dict[str, Stored]:
    """Name -> where the tensor's bytes lie in `path`, once safetensors' own reader has accepted the file (a
    truncated or garbled one is a one-line error naming it)."""
    check_safetensors_file(path)
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    base = 8 + length
    return {
        name: Stored(path.name, info["dtype"], tuple(info["shape"]), base + info["data_offsets"][0],
                     base + info["data_offsets"][1])
        for name, info in header.items()
        if name != "__metadata__"
    }


def read_headers(directory: Path, files: list[str]) -> dict[str, Stored]:
    """Every tensor of `files` (in `directory`) by name."""
    stored: dict[str, Stored] = {}
    for file in files:
        stored.update(read_header(directory / file))
    return stored


def _order(name: str, tensor: Stored) -> tuple[int, str]:
    rank = DTYPE_ORDER.index(tensor.dtype) if tensor.dtype in DTYPE_ORDER else len(DTYPE_ORDER)
    return rank, name


@dataclass
class Layout:
    """One output file: its header bytes and, per new name, the source tensor and its offset in the output."""

    header: bytes
    places: list[tuple[str, Stored, int]]  # new name, source tensor, absolute offset in the output file

    @property
    def size(self) -> int:
        return len(self.header) + sum(tensor.nbytes for _, tensor, _ in self.places)


def plan_layout(tensors: Mapping[str, Stored]) -> Layout:
    """The header and data offsets of a file holding `tensors` (new name -> source tensor), as `save_file`
    lays them out."""
    entries: dict[str, Any] = {"__metadata__": METADATA}
    offset, order = 0, sorted(tensors, key=lambda name: _order(name, tensors[name]))
    for name in order:
        tensor = tensors[name]
        entries[name] = {"dtype": tensor.dtype, "shape": list(tensor.shape),
                         "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    header = struct.pack("<Q", len(body)) + body
    places, position = [], len(header)
    for name in order:
        places.append((name, tensors[name], position))
        position += tensors[name].nbytes
    return Layout(header, places)


@dataclass
class CopyResult:
    """What a copy read: the digest of each source file it digested whole (`file_digest`'s, with the size and mtime
    the file had throughout) and the xxh3-128 digest of every source tensor it copied, taken of the very bytes it
    wrote (the source's, which kept their size and mtime while they were hashed and written)."""

    file_digests: dict[str, tuple[int, int, str]] = field(default_factory=dict)  # file -> size, mtime_ns, digest
    tensor_digests: dict[Stored, str] = field(default_factory=dict)  # source tensor -> xxh3-128 of its bytes


def copy_tensors(source_dir: Path, layouts: Mapping[str, Layout], target: Path,
                 digest_files: Collection[str] = ()) -> CopyResult:
    """Write each output file of `layouts` into `target`: its header, then every tensor's bytes from its mapped
    source file, hashed and written `WRITE_CHUNK` at a time (the digest is of the bytes written). The digest of a
    file in `digest_files` is made from the same pass (its dropped ranges and header hashed besides, nothing read
    twice). A source shorter than its header says, or changed while copied, is a one-line error."""
    jobs: dict[str, list[tuple[Stored, str, int]]] = defaultdict(list)
    for out, layout in layouts.items():
        for _, tensor, offset in layout.places:
            jobs[tensor.file].append((tensor, out, offset))
    result = CopyResult()
    fds: dict[str, int] = {}
    try:
        for out, layout in layouts.items():
            fds[out] = os.open(target / out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            _write_all(fds[out], memoryview(layout.header), 0)
        for file in sorted(set(jobs) | set(digest_files)):
            ordered = sorted(jobs[file], key=lambda job: job[0].start)
            whole = _copy_ranges(source_dir / file, ordered, fds, result.tensor_digests, file in digest_files)
            if whole is not None:
                result.file_digests[file] = whole
    finally:
        for fd in fds.values():
            os.close(fd)
    for out, layout in layouts.items():
        if (size := (target / out).stat().st_size) != layout.size:
            raise LayerpruneError(f"wrote {size} bytes to {out}, its layout holds {layout.size}; nothing was kept")
    return result


def _copy_ranges(path: Path, jobs: list[tuple[Stored, str, int]], fds: dict[str, int], digests: dict[Stored, str],
                 whole: bool = False) -> tuple[int, int, str] | None:
    """The kept ranges of `path`, in offset order, each hashed and written from the file's mapping (`_write_hashed`).
    With `whole`, the file's `file_digest` (made from the kept ranges' digests, the rest hashed from the same
    mapping) is returned with its size and mtime. A file whose size or modification time changed meanwhile is
    refused: the digests are then not those of one version of the file."""
    with path.open("rb", buffering=0) as handle:
        before = os.fstat(handle.fileno())
        if jobs and (end := max(tensor.end for tensor, _, _ in jobs)) > before.st_size:
            raise LayerpruneError(f"{path} ends at byte {before.st_size}, its header says {end}: truncated while "
                                  "read; nothing was written")
        with _mapped(handle.fileno(), before.st_size) as view:
            for tensor, out, offset in jobs:
                digests[tensor] = _write_hashed(view, tensor, fds[out], offset)
            known = {(tensor.start, tensor.end): digests[tensor] for tensor, _, _ in jobs}
            digest = digest_of_ranges(view, digest_ranges(path, before.st_size), known) if whole else None
        after = os.fstat(handle.fileno())
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        raise LayerpruneError(f"{path} changed while it was read; nothing was written")
    return (before.st_size, before.st_mtime_ns, digest) if digest is not None else None


def _write_hashed(view: memoryview, tensor: Stored, out: int, offset: int) -> str:
    """Bytes [tensor.start, tensor.end) of the mapped `view` to `offset` of `out`, `WRITE_CHUNK` at a time, each
    chunk hashed and then written while it is still in the CPU's cache; returns the xxh3-128 of what was written.
    (The kernel's own `copy_file_range` would need a second read of the source for the digest, and is no faster.)"""
    digest = xxhash.xxh3_128()
    for start in range(tensor.start, tensor.end, WRITE_CHUNK):
        with view[start : min(start + WRITE_CHUNK, tensor.end)] as chunk:
            digest.update(chunk)
            _write_all(out, chunk, offset + start - tensor.start)
    return digest.hexdigest()


def digest_ranges(path: Path, size: int) -> list[tuple[int, int]]:
    """The byte ranges a file's digest is made of, in file order, covering it: for a safetensors file its header,
    then each tensor's data (any byte between or after them a range of its own); any other file is one range."""
    bounds = {0, size}
    if path.suffix == ".safetensors":
        bounds |= {min(offset, size) for offset in _data_bounds(path)}
    ordered = sorted(bounds)
    return list(zip(ordered[:-1], ordered[1:], strict=True))


def _data_bounds(path: Path) -> set[int]:
    """Where each tensor's data starts and ends in `path`, from its header as written (nothing when the header
    cannot be read: the file is then digested as one range; the copy refuses such a file before this)."""
    try:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > os.fstat(handle.fileno()).st_size:
                return set()
            header = json.loads(handle.read(length))
        return {8 + length + int(offset) for name, info in header.items() if name != "__metadata__"
                for offset in info["data_offsets"]}
    except (OSError, ValueError, TypeError, KeyError, AttributeError, struct.error):
        return set()


def digest_of_ranges(view: memoryview, ranges: list[tuple[int, int]], known: Mapping[tuple[int, int], str]) -> str:
    """xxh3-128 over `start:end:digest` lines, one per range, each range's digest its xxh3-128 (from `known` where
    a copy took it of the same bytes, else hashed from `view`): a file's digest, which changes with any byte."""
    top = xxhash.xxh3_128()
    for start, end in ranges:
        digest = known.get((start, end))
        if digest is None:
            with view[start:end] as part:
                digest = xxhash.xxh3_128(part).hexdigest()
        top.update(f"{start}:{end}:{digest}\n".encode())
    return top.hexdigest()


def file_digest(path: Path) -> str:
    """A file's digest (`digest_of_ranges` over `digest_ranges`), read once from its mapping: the identity a streamed
    copy computes from its own pass, and what any other route computes for the same file."""
    with path.open("rb", buffering=0) as handle:
        size = os.fstat(handle.fileno()).st_size
        with _mapped(handle.fileno(), size) as view:
            return digest_of_ranges(view, digest_ranges(path, size), {})


@contextlib.contextmanager
def _mapped(fd: int, size: int) -> Iterator[memoryview]:
    """The file's bytes, mapped read-only (an empty view for an empty file)."""
    if size == 0:
        yield memoryview(b"")
        return
    mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    view = memoryview(mapping)
    try:
        yield view
    finally:
        with contextlib.suppress(BufferError):  # an error's traceback may still hold a slice: closed when collected
            view.release()
            mapping.close()


def _chunks(handle: Any, path: Path, start: int, end: int, buffer: memoryview, digest: Any,
            seek: bool) -> Iterator[tuple[int, memoryview]]:
    """(offset, bytes) of [start, end) of the open file, at most one buffer at a time, each fed to `digest`."""
    if seek:
        handle.seek(start)
    position = start
    while position < end:
        read = handle.readinto(buffer[: min(len(buffer), end - position)])
        if not read:
            raise LayerpruneError(f"{path} ends at byte {position}, its header says {end}: truncated while read; "
                                  "nothing was written")
        chunk = buffer[:read]
        if digest is not None:
            digest.update(chunk)
        yield position, chunk
        position += read


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written
