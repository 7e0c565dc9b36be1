"""The streamed prune's byte copies: files as `save_file` writes them, one chunk of memory, the source read once,
and verification that refuses any written byte that is not the source's."""

from __future__ import annotations

import json
import os
import shutil
import tracemalloc
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

import layerprune.models.identity as identity
import layerprune.models.safetensors_copy as safetensors_copy
import layerprune.prune.streaming as streaming
from helpers import assert_one_line_error, run_cli
from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.models.identity import weights_digest
from layerprune.models.safetensors_copy import copy_tensors, file_digest, plan_layout, read_header
from layerprune.prune.api import prune_model
from layerprune.prune.recipe import PruneRecipe
from test_shards import bf16_model

DROP = [1, 3]


def mixed_tensors() -> dict[str, torch.Tensor]:
    """Every dtype size, odd element counts (alignment), a 0-d and an empty tensor."""
    gen = torch.Generator().manual_seed(0)
    return {
        "z.f32": torch.randn(3, 5, generator=gen),
        "a.bf16": torch.randn(7, generator=gen).to(torch.bfloat16),
        "m.f16": torch.randn(2, 3, generator=gen).to(torch.float16),
        "b.i64": torch.arange(5),
        "c.bool": torch.tensor([True, False, True]),
        "d.u8": torch.arange(9, dtype=torch.uint8),
        "e.scalar": torch.tensor(2.5),
        "f.empty": torch.zeros(0, 4),
        "g.f64": torch.randn(2, generator=gen, dtype=torch.float64),
    }


def test_copied_file_is_byte_for_byte_what_save_file_writes(tmp_path):
    tensors = mixed_tensors()
    save_file(dict(list(tensors.items())[:4]), tmp_path / "one.safetensors", metadata={"format": "pt"})
    save_file(dict(list(tensors.items())[4:]), tmp_path / "two.safetensors", metadata={"format": "pt"})
    stored = {**read_header(tmp_path / "one.safetensors"), **read_header(tmp_path / "two.safetensors")}
    new = {f"renamed.{name}": stored[name] for name in stored}
    target = tmp_path / "out"
    target.mkdir()
    copy_tensors(tmp_path, {"out.safetensors": plan_layout(new)}, target)
    save_file({f"renamed.{k}": v for k, v in tensors.items()}, tmp_path / "reference.safetensors",
              metadata={"format": "pt"})
    assert (target / "out.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    with safe_open(target / "out.safetensors", "pt") as handle:
        assert handle.metadata() == {"format": "pt"}
        for name, tensor in tensors.items():
            got = handle.get_tensor(f"renamed.{name}")
            assert got.dtype == tensor.dtype and got.shape == tensor.shape
            assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def test_copy_holds_one_chunk_whatever_the_tensor_size_and_digests_what_it_wrote(tmp_path, monkeypatch):
    """Each chunk is hashed and then written from the source's mapping: the digests are of the bytes handed to the
    writes, no buffer is allocated, and the kernel's copy (which would need a second read for the digest) is not
    used."""
    big = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))  # 4 MiB
    save_file({"big": big, "small": torch.ones(3)}, tmp_path / "src.safetensors")
    stored = read_header(tmp_path / "src.safetensors")
    chunk = 64 << 10
    writes: list[int] = []
    wrote: dict[int, xxhash.xxh3_128] = {}  # output offset of a tensor -> hash of the bytes written into it
    real = safetensors_copy._write_all
    layout = plan_layout({"renamed.big": stored["big"], "small": stored["small"]})

    def counted(fd, data, offset):  # noqa: ANN001, ANN202
        writes.append(len(data))
        for _, tensor, start in layout.places:
            if start <= offset < start + tensor.nbytes:
                wrote.setdefault(start, xxhash.xxh3_128()).update(data)
        real(fd, data, offset)

    monkeypatch.setattr(safetensors_copy, "WRITE_CHUNK", chunk)
    monkeypatch.setattr(safetensors_copy, "_write_all", counted)
    monkeypatch.setattr(safetensors_copy.os, "copy_file_range", lambda *a: pytest.fail("a kernel copy"),
                        raising=False)
    target = tmp_path / "out"
    target.mkdir()
    tracemalloc.start()
    try:
        result = copy_tensors(tmp_path, {"out.safetensors": layout}, target)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert max(writes[1:]) == chunk and sum(writes) == layout.size  # writes[0]: the header
    assert (target / "out.safetensors").stat().st_size == layout.size
    assert peak < 3 * chunk < big.numel() * 4 / 16  # no buffer, never a tensor
    with safe_open(target / "out.safetensors", "pt") as handle:
        assert torch.equal(handle.get_tensor("renamed.big"), big)
    for name, tensor, offset in layout.places:  # each digest is of the bytes written at the tensor's place
        assert result.tensor_digests[tensor] == wrote[offset].hexdigest(), name
    assert result.tensor_digests == {stored["big"]: xxhash.xxh3_128(big.numpy().tobytes()).hexdigest(),
                                     stored["small"]: xxhash.xxh3_128(torch.ones(3).numpy().tobytes()).hexdigest()}


def test_a_source_changed_during_the_copy_is_refused(tmp_path, monkeypatch):
    """A file rewritten while its ranges are hashed and written (a new modification time) is refused, not copied
    with digests of another version."""
    save_file({"a": torch.ones(4), "b": torch.zeros(4)}, tmp_path / "src.safetensors")
    stored = read_header(tmp_path / "src.safetensors")
    real = safetensors_copy._write_hashed
    path = tmp_path / "src.safetensors"

    def touched(*args):  # noqa: ANN002, ANN202
        os.utime(path, ns=(0, path.stat().st_mtime_ns + 10**9))
        return real(*args)

    monkeypatch.setattr(safetensors_copy, "_write_hashed", touched)
    (tmp_path / "out").mkdir()
    with pytest.raises(LayerpruneError, match="changed while it was read"):
        copy_tensors(tmp_path, {"out.safetensors": plan_layout(stored)}, tmp_path / "out")


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])  # chunks that split tensors anywhere, and one for the file
def test_a_file_read_whole_once_gives_its_digest_and_the_same_copy(tmp_path, monkeypatch, chunk):
    tensors = mixed_tensors()
    save_file(tensors, tmp_path / "src.safetensors", metadata={"format": "pt"})
    stored = read_header(tmp_path / "src.safetensors")
    kept = {f"new.{name}": stored[name] for name in list(stored)[::2]}
    maps: list[int] = []
    real = safetensors_copy._mapped

    def counted(fd, size):  # noqa: ANN001, ANN202
        maps.append(size)
        return real(fd, size)

    monkeypatch.setattr(safetensors_copy, "WRITE_CHUNK", chunk)
    monkeypatch.setattr(safetensors_copy, "_mapped", counted)
    layouts = {"out.safetensors": plan_layout(kept)}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole = copy_tensors(tmp_path, layouts, tmp_path / "a", {"src.safetensors"})
    ranges = copy_tensors(tmp_path, layouts, tmp_path / "b")
    size = (tmp_path / "src.safetensors").stat().st_size
    assert maps == [size, size]  # each copy maps the file once; with the digest, from that mapping
    monkeypatch.undo()
    assert whole.file_digests["src.safetensors"][2] == file_digest(tmp_path / "src.safetensors")
    assert ranges.file_digests == {}
    assert (tmp_path / "a" / "out.safetensors").read_bytes() == (tmp_path / "b" / "out.safetensors").read_bytes()
    assert whole.tensor_digests == ranges.tensor_digests and len(whole.tensor_digests) == len(kept)


@pytest.mark.parametrize("where", ["header", "kept tensor", "dropped tensor", "last byte"])
def test_a_file_digest_changes_with_any_byte(tmp_path, where):
    save_file(mixed_tensors(), tmp_path / "src.safetensors", metadata={"format": "pt"})
    path = tmp_path / "src.safetensors"
    stored = read_header(path)
    before = file_digest(path)
    at = {"header": 12, "kept tensor": stored["z.f32"].start + 3, "dropped tensor": stored["g.f64"].start,
          "last byte": path.stat().st_size - 1}[where]
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))
    assert file_digest(path) != before


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as handle:
            found.update({name: handle.get_tensor(name) for name in handle.keys()})
    return found


def test_first_run_hashes_the_source_in_the_copys_own_read(tiny_llama, tmp_path, monkeypatch):
    """The source's identity is the fast digest, under a key naming it, taken from the copy's own pass: no file
    is read for it but config.json, and no sha256 (the evaluation caches' key, at a tenth of the speed) is taken."""
    digested: list[str] = []
    real = safetensors_copy.file_digest
    monkeypatch.setattr(safetensors_copy, "file_digest", lambda path: digested.append(Path(path).name) or real(path))
    monkeypatch.setattr(identity, "sha256_of", lambda path: pytest.fail(f"sha256 of {path}"))
    settings = RunSettings(max_shard_size="60KB", cache_dir=tmp_path / "cache")
    result = prune_model(str(tiny_llama), PruneRecipe(layers=DROP), settings, output=tmp_path / "out")
    assert digested == ["config.json"]  # the weights' digests came from the copy's pass
    monkeypatch.undo()
    fresh = weights_digest(tiny_llama, tmp_path / "c2")
    report = json.loads((tmp_path / "out" / "prune_report.json").read_text())
    assert report["source"]["identity"]["weights_xxh3_128"] == fresh
    assert result.report["source"]["identity"]["weights_xxh3_128"] == fresh
    assert "weights_sha256" not in report["source"]["identity"]
    again = prune_model(str(tiny_llama), PruneRecipe(layers=DROP), settings, output=tmp_path / "again")
    assert again.report["source"]["identity"]["weights_xxh3_128"] == fresh
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for shard in sorted(out.glob("model-*.safetensors")):
        with safe_open(shard, "pt") as handle:
            assert sorted(handle.keys()) == sorted(n for n, f in index["weight_map"].items() if f == shard.name)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in _tensors(out).values())


def test_verification_refuses_a_written_byte_the_logits_cannot_see(tmp_path, monkeypatch):
    source = bf16_model(tmp_path / "src", "llama")
    real = streaming.write_stream

    def one_bit_off(plan, target, *args):  # noqa: ANN001, ANN002, ANN202
        copied = real(plan, target, *args)
        shard = sorted(target.glob("*.safetensors"))[0]
        data = bytearray(shard.read_bytes())
        data[-2] ^= 1  # the lowest mantissa bit of the last bf16 element
        shard.write_bytes(bytes(data))
        return copied

    monkeypatch.setattr(streaming, "write_stream", one_bit_off)
    with pytest.raises(LayerpruneError, match="is not a copy of"):
        prune_model(str(source), PruneRecipe(layers=DROP), RunSettings(), output=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    result = prune_model(str(source), PruneRecipe(layers=DROP), RunSettings(), output=tmp_path / "out")
    written = sum(t.numel() * t.element_size() for t in _tensors(tmp_path / "out").values())
    assert result.report["verification"]["bytes_compared"] == written


def test_a_source_cut_short_during_the_copy_is_one_line_and_leaves_nothing(capsys, tiny_llama, tmp_path,
                                                                             monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    real = safetensors_copy.read_headers

    def then_cut(directory, files):  # noqa: ANN001, ANN202
        stored = real(directory, files)
        path = directory / files[0]
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return stored

    monkeypatch.setattr("layerprune.models.shards.read_headers", then_cut)
    code, _, err = run_cli(capsys, ["prune", "--model", str(model), "--output", str(tmp_path / "out"),
                                    "--layers", "1,3"])
    assert_one_line_error(code, err, "truncated while read")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_a_failed_hash_stops_the_copy_at_once_and_leaves_nothing(capsys, tiny_llama, tmp_path, monkeypatch):
    """A hash that fails stops the copy before the chunk it could not hash is written, as one line."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    chunk, written = 4096, []

    class Failing:
        def update(self, data):  # noqa: ANN001, ANN202
            raise LayerpruneError(f"the hash could not read {len(data)} bytes")

    class Xxhash:
        xxh3_128 = Failing

    real = safetensors_copy._write_all
    monkeypatch.setattr(safetensors_copy, "WRITE_CHUNK", chunk)
    monkeypatch.setattr(safetensors_copy, "xxhash", Xxhash)
    monkeypatch.setattr(safetensors_copy, "_write_all", lambda fd, data, offset: written.append(len(data))
                        or real(fd, data, offset))
    code, _, err = run_cli(capsys, ["prune", "--model", str(model), "--output", str(tmp_path / "out"),
                                    "--layers", "1,3"])
    assert_one_line_error(code, err, "the hash could not read")
    assert 0 < len(written) <= 4 and sum(written) < 65536  # the headers only: no tensor byte was written unhashed
    assert not (tmp_path / "out").exists()
