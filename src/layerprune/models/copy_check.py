"""The byte check of a streamed prune, without a second read of the source: every written tensor must hash to the
digest the copy took of the source tensor that belongs at its name.

Which source tensor belongs at a written name is worked out here from the kept blocks alone (written block j is
source block kept[j]; tensors past the stack shift down; every other name is unchanged), not from the map the
copy followed, so a copy that put faithful bytes under the wrong block number fails here as well as in the logits.
The written bytes are hashed where they are read anyway: as the written model's block-major forward loads each
tensor (`CopyCheck.tensor`); whatever that forward did not load is read from the files afterwards (`rest`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from layerprune.core.errors import LayerpruneError
from layerprune.models.safetensors_copy import CHUNK, Stored, _chunks, read_headers
from layerprune.models.shards import block_prefix, read_checkpoint


@dataclass
class CopyCheck:
    """The written tensors, the source tensor each must equal, and the copy's digests of the source bytes."""

    directory: Path
    written: dict[str, Stored]  # written name -> where its bytes lie in the written files
    expected: dict[str, tuple[str, Stored]]  # written name -> the source tensor that must be there (name, place)
    digests: Mapping[Stored, str]  # source tensor -> xxh3-128 of the bytes the copy read and wrote
    seen: set[str] = field(default_factory=set)
    compared: int = 0

    def tensor(self, name: str, value: torch.Tensor) -> None:
        """Check one written tensor as loaded from its file (a CPU tensor holding the file's bytes)."""
        if name not in self.written or name in self.seen:
            return
        raw = value.detach().reshape(-1).view(torch.uint8).numpy()
        self._compare(name, xxhash.xxh3_128(memoryview(raw)).hexdigest())

    def rest(self) -> int:
        """Hash, from the files, every written tensor no forward loaded; return the bytes compared in all."""
        buffer = memoryview(bytearray(CHUNK))
        handles = {}
        try:
            for name in sorted(set(self.written) - self.seen, key=lambda key: self.written[key].start):
                stored = self.written[name]
                if stored.file not in handles:
                    handles[stored.file] = (self.directory / stored.file).open("rb", buffering=0)
                digest = xxhash.xxh3_128()
                path = self.directory / stored.file
                for _ in _chunks(handles[stored.file], path, stored.start, stored.end, buffer, digest, seek=True):
                    pass
                self._compare(name, digest.hexdigest())
        finally:
            for handle in handles.values():
                handle.close()
        return self.compared

    def _compare(self, name: str, digest: str) -> None:
        old, source = self.expected[name]
        if self.digests.get(source) != digest:
            raise LayerpruneError(f"{name} in {self.directory / self.written[name].file} is not a copy of {old} "
                                  f"(the source tensor that belongs there: other bytes); nothing was written")
        self.seen.add(name)
        self.compared += source.nbytes


def source_name(name: str, prefix: str, kept: Sequence[int], depth: int) -> str:
    """The source name of written tensor `name`: block j of the written stack is block kept[j]; a numbered tensor
    past the written stack (a multi-token-prediction block) is shifted back up; any other name is its own."""
    if not name.startswith(prefix + "."):
        return name
    index, dot, rest = name[len(prefix) + 1 :].partition(".")
    if not index.isdigit() or not dot:
        return name
    j = int(index)
    old = kept[j] if j < len(kept) else j + depth - len(kept)
    return f"{prefix}.{old}.{rest}"


def copy_check(source_dir: Path, written_dir: Path, drop: Sequence[int], depth: int,
               digests: Mapping[Stored, str]) -> CopyCheck:
    """A check of `written_dir` against `source_dir` without the blocks `drop` of `depth`: every written name maps
    to a source tensor of the same dtype and shape, and every source tensor that is kept is written (headers only;
    the bytes are compared as they are read)."""
    checkpoint = read_checkpoint(source_dir)
    source = read_headers(source_dir, checkpoint.files)
    prefix = block_prefix(list(checkpoint.weight_map), depth)
    kept = [i for i in range(depth) if i not in set(drop)]
    written = read_headers(written_dir, read_checkpoint(written_dir).files)
    expected: dict[str, tuple[str, Stored]] = {}
    for name, stored in written.items():
        old = source_name(name, prefix, kept, depth)
        if old not in source:
            raise LayerpruneError(f"{name} in {written_dir / stored.file} has no source tensor ({old} is not in "
                                  f"{source_dir}); nothing was written")
        if (source[old].dtype, source[old].shape) != (stored.dtype, stored.shape):
            raise LayerpruneError(f"{name} in {written_dir / stored.file} is not a copy of {old} in "
                                  f"{source_dir / source[old].file} ({stored.dtype} {list(stored.shape)} vs "
                                  f"{source[old].dtype} {list(source[old].shape)}); nothing was written")
        expected[name] = old, source[old]
    wanted = {name for name in source if _kept(name, prefix, set(kept), depth)}
    missing = sorted(wanted - {source_name(name, prefix, kept, depth) for name in written})
    if missing:
        raise LayerpruneError(f"{written_dir} lacks the copy of {missing[0]} (and {len(missing) - 1} more); "
                              "nothing was written")
    return CopyCheck(written_dir, written, expected, digests)


def _kept(name: str, prefix: str, kept: set[int], depth: int) -> bool:
    if not name.startswith(prefix + "."):
        return True
    index = name[len(prefix) + 1 :].partition(".")[0]
    return not index.isdigit() or int(index) in kept or int(index) >= depth
