"""The fast GGUF reader gives gguf's own reader's fields, part for part; inside parsed_once transformers parses a
file's metadata once."""

from __future__ import annotations

import numpy as np
import pytest


def _same_fields(path):
    import gguf

    from layerprune.models.gguf_once import fast_reader

    stock, fast = gguf.GGUFReader(path), fast_reader(path)
    assert list(stock.fields) == list(fast.fields)
    for name, field in stock.fields.items():
        other = fast.fields[name]
        assert (field.offset, field.data, field.types) == (other.offset, other.data, other.types), name
        assert len(field.parts) == len(other.parts), name
        for a, b in zip(field.parts, other.parts, strict=True):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
        assert field.contents() == other.contents(), name
    assert [t.name for t in stock.tensors] == [t.name for t in fast.tensors]
    assert stock.data_offset == fast.data_offset
    assert all(np.array_equal(a.data, b.data) for a, b in zip(stock.tensors, fast.tensors, strict=True))
    return stock


def test_every_kind_of_field_reads_as_gguf_reads_it(tmp_path):
    import gguf

    path = tmp_path / "fields.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("t.strings", ["a", "", "ünï", "x" * 300])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.bools", [True, False])
    writer.add_array("t.empty", [])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_string("t.string", "one")
    writer.add_uint32("t.uint", 7)
    writer.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    stock = _same_fields(path)
    assert stock.fields["t.strings"].contents() == ["a", "", "ünï", "x" * 300]


def _hand_written_gguf(path, order: str) -> None:
    """A GGUF file of metadata only, written field by field in byte order `order` ('<' or '>'): the fields
    gguf's writer will not write (empty arrays) and nested arrays whose first element is empty."""
    import struct

    def text(value: str) -> bytes:
        raw = value.encode()
        return struct.pack(order + "Q", len(raw)) + raw

    string, uint32, int32, float32, array = 8, 4, 5, 6, 9
    fields = [
        ("e.ints", struct.pack(order + "IIQ", array, int32, 0)),
        ("e.strings", struct.pack(order + "IIQ", array, string, 0)),
        ("n.first_empty", struct.pack(order + "IIQ", array, array, 2) + struct.pack(order + "IQ", int32, 0)
         + struct.pack(order + "IQi", int32, 1, 7)),
        ("s.strings", struct.pack(order + "IIQ", array, string, 3) + text("a") + text("") + text("bc")),
        ("s.floats", struct.pack(order + "IIQ", array, float32, 2) + struct.pack(order + "ff", 0.5, -2.0)),
        ("s.uint", struct.pack(order + "II", uint32, 9)),
    ]
    body = b"".join(text(key) + value for key, value in fields)
    path.write_bytes(b"GGUF" + struct.pack(order + "IQQ", 3, 0, len(fields)) + body)


@pytest.mark.parametrize("order", ["<", ">"])
def test_empty_and_nested_arrays_and_either_byte_order_read_as_gguf_reads_them(tmp_path, order):
    path = tmp_path / "hand.gguf"
    _hand_written_gguf(path, order)
    stock = _same_fields(path)
    assert stock.fields["s.strings"].contents() == ["a", "", "bc"] and stock.fields["e.ints"].contents() == []


def test_the_embedded_models_gguf_reads_as_gguf_reads_it():
    from layerprune.core.settings import RunSettings
    from layerprune.models.embedded import EMBEDDED_MODELS, gguf_path

    try:
        path = gguf_path(EMBEDDED_MODELS["smollm2-135m-instruct"], RunSettings().resolved_cache_dir())
    except Exception as err:  # noqa: BLE001 - the package is an optional install
        pytest.skip(str(err))
    stock = _same_fields(path)
    assert len(stock.fields["tokenizer.ggml.tokens"].data) == 49152


def test_transformers_parses_a_files_metadata_once_inside_parsed_once(monkeypatch):
    from transformers import modeling_gguf_pytorch_utils as loader

    from layerprune.core.settings import RunSettings
    from layerprune.models.embedded import EMBEDDED_MODELS, gguf_path
    from layerprune.models.gguf_once import parsed_once

    try:
        path = gguf_path(EMBEDDED_MODELS["smollm2-135m-instruct"], RunSettings().resolved_cache_dir())
    except Exception as err:  # noqa: BLE001
        pytest.skip(str(err))
    real, calls = loader.load_gguf_checkpoint, []
    monkeypatch.setattr(loader, "load_gguf_checkpoint", lambda *a, **k: calls.append(a) or real(*a, **k))
    with parsed_once():
        first = loader.load_gguf_checkpoint(str(path), return_tensors=False)
        first["config"]["num_hidden_layers"] = -1  # a caller's edit does not reach the next caller
        second = loader.load_gguf_checkpoint(str(path), return_tensors=False)
    assert len(calls) == 1 and second["config"]["num_hidden_layers"] == 30
    assert loader.load_gguf_checkpoint(str(path), return_tensors=False)["config"] == second["config"]
    assert len(calls) == 2  # outside the block: transformers' own again
