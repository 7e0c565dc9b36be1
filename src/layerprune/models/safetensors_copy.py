"""Copy tensors from safetensors files into new ones as bytes: headers parsed, data ranges copied in chunks.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte range of
the data section; `__metadata__`) padded with spaces to a multiple of 8, then the raw data. A pruned checkpoint
holds the source's tensors under new names, so each output file is its new header followed by byte ranges of the
source files, written at their planned offsets: nothing is deserialised, and the layout is the one
`safetensors.torch.save_file` writes (its dtype order, then names), so the files are byte for byte what `save_file`
would have made of the same tensors. Each source file is mapped in memory (the page cache, no copy into this
process): each kept range's xxh3-128 digest is taken there (so the written model can later be checked against the
source without reading the source again) and its bytes are copied by the kernel (`copy_file_range`, as `cp` does);
where a source file's sha256 is wanted, a thread hashes the whole mapping meanwhile (`hashlib` releases the GIL).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import struct
import threading
from collections import defaultdict
from collections.abc import Collection, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
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
NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM, errno.EBADF}


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
    """What a copy read: the sha256 of each source file it hashed whole, with the size and mtime it had throughout,
    and the xxh3-128 digest of every source tensor it copied (of the source's bytes, which kept their size and mtime
    while they were hashed and copied)."""

    file_sha256: dict[str, tuple[int, int, str]] = field(default_factory=dict)  # file -> size, mtime_ns, sha256
    tensor_digests: dict[Stored, str] = field(default_factory=dict)  # source tensor -> xxh3-128 of its bytes


def copy_tensors(source_dir: Path, layouts: Mapping[str, Layout], target: Path,
                 hash_files: Collection[str] = ()) -> CopyResult:
    """Write each output file of `layouts` into `target`: its header, then every tensor's bytes copied from its
    mapped source file by the kernel (through one CHUNK buffer where the kernel cannot), each tensor's digest taken
    from the mapping. The sha256 of a file in `hash_files` is taken from the same mapping by a thread meanwhile.
    A source shorter than its header says, or changed while copied, is a one-line error."""
    jobs: dict[str, list[tuple[Stored, str, int]]] = defaultdict(list)
    for out, layout in layouts.items():
        for _, tensor, offset in layout.places:
            jobs[tensor.file].append((tensor, out, offset))
    result = CopyResult()
    buffer = memoryview(bytearray(CHUNK))
    fds: dict[str, int] = {}
    try:
        for out, layout in layouts.items():
            fds[out] = os.open(target / out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            _write_all(fds[out], memoryview(layout.header), 0)
        for file in sorted(set(jobs) | set(hash_files)):
            ordered = sorted(jobs[file], key=lambda job: job[0].start)
            sha = _copy_ranges(source_dir / file, ordered, fds, buffer, result.tensor_digests, file in hash_files)
            if sha is not None:
                result.file_sha256[file] = sha
    finally:
        for fd in fds.values():
            os.close(fd)
    for out, layout in layouts.items():
        if (size := (target / out).stat().st_size) != layout.size:
            raise LayerpruneError(f"wrote {size} bytes to {out}, its layout holds {layout.size}; nothing was kept")
    return result


def _copy_ranges(path: Path, jobs: list[tuple[Stored, str, int]], fds: dict[str, int], buffer: memoryview,
                 digests: dict[Stored, str], whole_sha: bool = False) -> tuple[int, int, str] | None:
    """The kept ranges of `path`, in offset order: each hashed where the file is mapped (the page cache, no copy)
    and copied by the kernel (`copy_file_range`, as `cp` does; through `buffer` where the kernel cannot). With
    `whole_sha`, a thread hashes the whole mapped file meanwhile (`hashlib` releases the GIL): its size, mtime and
    sha256 are returned; a failed hash stops the copy before its next tensor. A file whose size or modification
    time changed meanwhile is refused: the digests are then not those of the bytes copied (and the verification,
    which hashes the written bytes, would refuse the copy as well)."""
    with path.open("rb", buffering=0) as handle:
        before = os.fstat(handle.fileno())
        if jobs and (end := max(tensor.end for tensor, _, _ in jobs)) > before.st_size:
            raise LayerpruneError(f"{path} ends at byte {before.st_size}, its header says {end}: truncated while "
                                  "read; nothing was written")
        stop = threading.Event()
        with _mapped(handle.fileno(), before.st_size) as view, ThreadPoolExecutor(1) as pool:
            hashing = pool.submit(_sha256_of_view, view, stop) if whole_sha else None
            try:
                for tensor, out, offset in jobs:
                    if hashing is not None and hashing.done():
                        hashing.result()  # raises the hash's error at once
                    digests[tensor] = xxhash.xxh3_128(view[tensor.start : tensor.end]).hexdigest()
                    _kernel_copy(handle, path, tensor, fds[out], offset, buffer)
                sha = hashing.result() if hashing is not None else None
            finally:
                stop.set()
        after = os.fstat(handle.fileno())
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        raise LayerpruneError(f"{path} changed while it was read; nothing was written")
    return (before.st_size, before.st_mtime_ns, sha) if sha is not None else None


def _sha256_of_view(view: memoryview, stop: threading.Event) -> str:
    """The sha256 of the mapped bytes, CHUNK at a time; "" when `stop` is set before the end."""
    sha = hashlib.sha256()
    for start in range(0, len(view), CHUNK):
        if stop.is_set():
            return ""
        sha.update(view[start : start + CHUNK])
    return sha.hexdigest()


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


def _kernel_copy(handle: Any, path: Path, tensor: Stored, out: int, offset: int, buffer: memoryview) -> None:
    """Bytes [tensor.start, tensor.end) of `handle` to `offset` of `out`, copied in the kernel; read through `buffer`
    and written from it where the kernel refuses (another file system on an old kernel, a file system without it)."""
    done = 0
    while done < tensor.nbytes:
        try:
            copied = os.copy_file_range(handle.fileno(), out, tensor.nbytes - done, tensor.start + done,
                                        offset + done)
        except OSError as exc:
            if exc.errno not in NO_KERNEL_COPY:
                raise
            for start, chunk in _chunks(handle, path, tensor.start + done, tensor.end, buffer, None, seek=True):
                _write_all(out, chunk, offset + start - tensor.start)
            return
        if not copied:
            raise LayerpruneError(f"{path} ends before byte {tensor.end}: truncated while read; nothing was written")
        done += copied


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
