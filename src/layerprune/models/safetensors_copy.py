"""Copy tensors from safetensors files into new ones as bytes: headers parsed, data ranges copied in chunks.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte range of
the data section; `__metadata__`) padded with spaces to a multiple of 8, then the raw data. A pruned checkpoint
holds the source's tensors under new names, so each output file is its new header followed by byte ranges of the
source files, written at their planned offsets: nothing is deserialised, and the layout is the one
`safetensors.torch.save_file` writes (its dtype order, then names), so the files are byte for byte what `save_file`
would have made of the same tensors. The ranges are copied by the kernel (`copy_file_range`, as `cp` does) where
it can, else through one CHUNK buffer. A source file whose sha256 is wanted is read whole through a second buffer
and hashed by a thread while its kept ranges are copied (both reads fill and share one page cache; `hashlib` and
the copy release the GIL, so on a machine with a free core the hash costs no wall time).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
import threading
from collections import defaultdict
from collections.abc import Collection, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy

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
    """What a copy read: the sha256 of each source file it read whole, with the size and mtime it had throughout."""

    file_sha256: dict[str, tuple[int, int, str]] = field(default_factory=dict)  # file -> size, mtime_ns, sha256


def copy_tensors(source_dir: Path, layouts: Mapping[str, Layout], target: Path,
                 hash_files: Collection[str] = ()) -> CopyResult:
    """Write each output file of `layouts` into `target`: its header, then every tensor's bytes copied from its
    source file. Source files are read in turn, each range once, one CHUNK in memory (two while a file is hashed);
    a file in `hash_files` is read whole, by a thread beside the copy, and its sha256 returned. A source shorter
    than its header says is a one-line error."""
    jobs: dict[str, list[tuple[Stored, str, int]]] = defaultdict(list)
    for out, layout in layouts.items():
        for _, tensor, offset in layout.places:
            jobs[tensor.file].append((tensor, out, offset))
    result = CopyResult()
    buffers = (memoryview(bytearray(CHUNK)), memoryview(bytearray(CHUNK)) if hash_files else None)
    fds: dict[str, int] = {}
    try:
        for out, layout in layouts.items():
            fds[out] = os.open(target / out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            _write_all(fds[out], memoryview(layout.header), 0)
        for file in sorted(set(jobs) | set(hash_files)):
            digest = _copy_file(source_dir / file, sorted(jobs[file], key=lambda job: job[0].start), fds, buffers,
                                file in hash_files)
            if digest is not None:
                result.file_sha256[file] = digest
    finally:
        for fd in fds.values():
            os.close(fd)
    for out, layout in layouts.items():
        if (size := (target / out).stat().st_size) != layout.size:
            raise LayerpruneError(f"wrote {size} bytes to {out}, its layout holds {layout.size}; nothing was kept")
    return result


def _copy_file(path: Path, jobs: list[tuple[Stored, str, int]], fds: dict[str, int],
               buffers: tuple[memoryview, memoryview | None], whole: bool) -> tuple[int, int, str] | None:
    """Copy the ranges of `jobs` out of `path` (in offset order) by the kernel (`copy_file_range`: no bytes pass
    through this process) or, where it cannot, through the first buffer; with `whole`, a thread reads every byte
    of the file through the second buffer meanwhile and hashes it."""
    before = path.stat()
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        hashing: Future[str] | None = None
        if whole:
            assert buffers[1] is not None
            hashing = pool.submit(_sha256, path, before.st_size, buffers[1], stop)
        try:
            _copy_ranges(path, jobs, fds, buffers[0], hashing)
            digest = hashing.result() if hashing is not None else None
        except BaseException:
            stop.set()  # the hash is not wanted any more: the thread ends at its next chunk
            raise
    if digest is None:
        return None
    after = path.stat()
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        raise LayerpruneError(f"{path} changed while it was read; nothing was written")
    return before.st_size, before.st_mtime_ns, digest


def _copy_ranges(path: Path, jobs: list[tuple[Stored, str, int]], fds: dict[str, int], buffer: memoryview,
                 hashing: Future[str] | None) -> None:
    """The ranges, one tensor at a time; the hash thread's error (a truncation it found) raised before the next."""
    with path.open("rb", buffering=0) as handle:
        for tensor, out, offset in jobs:
            if hashing is not None and hashing.done():
                hashing.result()
            if not _kernel_copy(handle, path, tensor, fds[out], offset):
                for start, chunk in _chunks(handle, path, tensor.start, tensor.end, buffer, None, seek=True):
                    _write_all(fds[out], chunk, offset + start - tensor.start)


def _sha256(path: Path, size: int, buffer: memoryview, stop: threading.Event) -> str:
    """The sha256 of `path`'s first `size` bytes (its whole length when the copy began); stops early, with a
    meaningless digest, once `stop` is set (the copy failed)."""
    digest = hashlib.sha256()
    with path.open("rb", buffering=0) as handle:
        for _ in _chunks(handle, path, 0, size, buffer, digest, seek=True):
            if stop.is_set():
                break
    return digest.hexdigest()


def _kernel_copy(handle: Any, path: Path, tensor: Stored, fd: int, offset: int) -> bool:
    """Copy `tensor`'s bytes to `offset` of `fd` with `os.copy_file_range`, CHUNK at a time; False when the system
    cannot (then nothing was copied by it)."""
    copy = getattr(os, "copy_file_range", None)
    position = tensor.start
    while position < tensor.end:
        try:
            done = copy(handle.fileno(), fd, min(CHUNK, tensor.end - position), position,  # type: ignore[misc]
                        offset + position - tensor.start) if copy else None
        except OSError as exc:
            if position == tensor.start and exc.errno in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                return False
            raise
        if done is None:
            return False
        if not done:
            raise LayerpruneError(f"{path} ends at byte {position}, its header says {tensor.end}: truncated while "
                                  "read; nothing was written")
        position += done
    return True


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
