"""Copy tensors from safetensors files into new ones as bytes: headers parsed, data ranges copied in chunks.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte range of
the data section; `__metadata__`) padded with spaces to a multiple of 8, then the raw data. A pruned checkpoint
holds the source's tensors under new names, so each output file is its new header followed by byte ranges of the
source files, written at their planned offsets: nothing is deserialised, and the layout is the one
`safetensors.torch.save_file` writes (its dtype order, then names), so the files are byte for byte what `save_file`
would have made of the same tensors. Each source byte is read once, into one of two CHUNK buffers: the range's
xxh3-128 digest is taken from the buffer the bytes are written from (so the written model can later be checked
against the source without reading the source again), and a source file whose sha256 is wanted is read whole in
order, a thread hashing each chunk while the kept ranges in it are written (`hashlib` releases the GIL).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import defaultdict
from collections.abc import Collection, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy
import xxhash

from layerprune.core.errors import LayerpruneError
from layerprune.models.safetensors_check import check_safetensors_file

CHUNK = 8 << 20  # bytes read and written at a time: the copy's whole working memory
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
    """What a copy read: the sha256 of each source file it read whole, with the size and mtime it had throughout,
    and the xxh3-128 digest of every source tensor it copied, of the very bytes it wrote."""

    file_sha256: dict[str, tuple[int, int, str]] = field(default_factory=dict)  # file -> size, mtime_ns, sha256
    tensor_digests: dict[Stored, str] = field(default_factory=dict)  # source tensor -> xxh3-128 of its bytes


def copy_tensors(source_dir: Path, layouts: Mapping[str, Layout], target: Path,
                 hash_files: Collection[str] = ()) -> CopyResult:
    """Write each output file of `layouts` into `target`: its header, then every tensor's bytes copied from its
    source file through one CHUNK buffer, each tensor's digest taken from the buffer as it is written. A file in
    `hash_files` is read whole, once: its sha256 (by a thread, from a second buffer) and the copy share that read.
    A source shorter than its header says is a one-line error."""
    jobs: dict[str, list[tuple[Stored, str, int]]] = defaultdict(list)
    for out, layout in layouts.items():
        for _, tensor, offset in layout.places:
            jobs[tensor.file].append((tensor, out, offset))
    result = CopyResult()
    buffers = (memoryview(bytearray(CHUNK)), memoryview(bytearray(CHUNK)))
    fds: dict[str, int] = {}
    try:
        for out, layout in layouts.items():
            fds[out] = os.open(target / out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            _write_all(fds[out], memoryview(layout.header), 0)
        for file in sorted(set(jobs) | set(hash_files)):
            ordered = sorted(jobs[file], key=lambda job: job[0].start)
            if file in hash_files:
                result.file_sha256[file] = _copy_whole(source_dir / file, ordered, fds, buffers, result.tensor_digests)
            else:
                _copy_ranges(source_dir / file, ordered, fds, buffers[0], result.tensor_digests)
    finally:
        for fd in fds.values():
            os.close(fd)
    for out, layout in layouts.items():
        if (size := (target / out).stat().st_size) != layout.size:
            raise LayerpruneError(f"wrote {size} bytes to {out}, its layout holds {layout.size}; nothing was kept")
    return result


def _copy_ranges(path: Path, jobs: list[tuple[Stored, str, int]], fds: dict[str, int], buffer: memoryview,
                 digests: dict[Stored, str]) -> None:
    """The kept ranges of `path`, in offset order, one chunk at a time: each chunk hashed and written."""
    with path.open("rb", buffering=0) as handle:
        for tensor, out, offset in jobs:
            digest = xxhash.xxh3_128()
            for start, chunk in _chunks(handle, path, tensor.start, tensor.end, buffer, digest, seek=True):
                _write_all(fds[out], chunk, offset + start - tensor.start)
            digests[tensor] = digest.hexdigest()


def _copy_whole(path: Path, jobs: list[tuple[Stored, str, int]], fds: dict[str, int],
                buffers: tuple[memoryview, memoryview], digests: dict[Stored, str]) -> tuple[int, int, str]:
    """Read all of `path` once, in order: a thread feeds each chunk to the file's sha256 (the GIL released) while
    the kept ranges in it are hashed and written; the two buffers take turns. The file must keep its size and
    modification time throughout."""
    before = path.stat()
    sha = hashlib.sha256()
    pending: list[Future[None] | None] = [None, None]
    cursor = _RangeCursor(jobs, fds, digests)
    with ThreadPoolExecutor(1) as pool, path.open("rb", buffering=0) as handle:
        try:
            for turn, (start, chunk) in enumerate(_whole_chunks(handle, path, before.st_size, buffers, pending)):
                pending[turn % 2] = pool.submit(sha.update, chunk)
                cursor.feed(start, chunk)
        finally:
            for future in pending:
                if future is not None:
                    future.result()
    cursor.finish(path)
    after = path.stat()
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        raise LayerpruneError(f"{path} changed while it was read; nothing was written")
    return before.st_size, before.st_mtime_ns, sha.hexdigest()


def _whole_chunks(handle: Any, path: Path, size: int, buffers: tuple[memoryview, memoryview],
                  pending: list[Future[None] | None]) -> Iterator[tuple[int, memoryview]]:
    """(offset, bytes) of the whole file, the buffers in turn; a buffer is refilled only once its hash is done."""
    position, turn = 0, 0
    while position < size:
        if (future := pending[turn % 2]) is not None:
            future.result()
        buffer = buffers[turn % 2]
        read = handle.readinto(buffer[: min(len(buffer), size - position)])
        if not read:
            raise LayerpruneError(f"{path} ends at byte {position}, its size was {size}: truncated while read; "
                                  "nothing was written")
        yield position, buffer[:read]
        position, turn = position + read, turn + 1


class _RangeCursor:
    """The kept ranges of one file (sorted, disjoint), fed the file's chunks in order: each range's part of a
    chunk is hashed and written at its place in its output file."""

    def __init__(self, jobs: list[tuple[Stored, str, int]], fds: dict[str, int], digests: dict[Stored, str]) -> None:
        self.jobs, self.fds, self.digests = jobs, fds, digests
        self.index, self.digest = 0, xxhash.xxh3_128()

    def feed(self, start: int, chunk: memoryview) -> None:
        end = start + len(chunk)
        while self.index < len(self.jobs):
            tensor, out, offset = self.jobs[self.index]
            low, high = max(tensor.start, start), min(tensor.end, end)
            if low < high:
                part = chunk[low - start : high - start]
                self.digest.update(part)
                _write_all(self.fds[out], part, offset + low - tensor.start)
            if tensor.end > end:
                return
            self.digests[tensor] = self.digest.hexdigest()
            self.index, self.digest = self.index + 1, xxhash.xxh3_128()

    def finish(self, path: Path) -> None:
        if self.index < len(self.jobs):
            tensor = self.jobs[self.index][0]
            raise LayerpruneError(f"{path} is shorter than its header says ({tensor.end} bytes): truncated while "
                                  "read; nothing was written")


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


def compare_copied(source_dir: Path, source: Mapping[str, Stored], target_dir: Path, written: Mapping[str, Stored],
                   renamed: Mapping[str, str]) -> int:
    """Each `renamed` pair (old -> new): the new tensor in `written` has the old one's dtype, shape and bytes.
    Returns the bytes compared; a difference is a one-line error naming the tensor."""
    missing = sorted(set(renamed.values()) - set(written))
    if missing:
        raise LayerpruneError(f"{target_dir} lacks {missing[0]} (and {len(missing) - 1} more); nothing was written")
    compared, buffers = 0, (bytearray(CHUNK), bytearray(CHUNK))
    with _Files(source_dir) as a, _Files(target_dir) as b:
        for old, new in renamed.items():
            x, y = source[old], written[new]
            if (x.dtype, x.shape) != (y.dtype, y.shape) or not _same_bytes(a(x), b(y), x, y, buffers):
                raise LayerpruneError(f"{new} in {target_dir / y.file} is not a copy of {old} in "
                                      f"{source_dir / x.file} ({y.dtype} {list(y.shape)} vs {x.dtype} "
                                      f"{list(x.shape)}, or other bytes); nothing was written")
            compared += x.nbytes
    return compared


def _same_bytes(a: Any, b: Any, x: Stored, y: Stored, buffers: tuple[bytearray, bytearray]) -> bool:
    if x.nbytes != y.nbytes:
        return False
    left, right = buffers
    b.seek(y.start)
    for _, chunk in _chunks(a, Path(a.name), x.start, x.end, memoryview(left), None, seek=True):
        if b.readinto(memoryview(right)[: len(chunk)]) != len(chunk):
            return False
        if len(chunk) == len(left):
            if left != right:  # bytearray == bytearray: one memcmp
                return False
        elif not numpy.array_equal(numpy.frombuffer(left, numpy.uint8, len(chunk)),
                                   numpy.frombuffer(right, numpy.uint8, len(chunk))):
            return False
    return True


class _Files:
    """`files(tensor)` -> the open file holding it, opened on first use, all closed on exit."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.handles: dict[str, Any] = {}

    def __call__(self, tensor: Stored) -> Any:
        if tensor.file not in self.handles:
            self.handles[tensor.file] = (self.directory / tensor.file).open("rb", buffering=0)
        return self.handles[tensor.file]

    def __enter__(self) -> _Files:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles.values():
            handle.close()
