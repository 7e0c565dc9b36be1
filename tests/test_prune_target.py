"""`prune --target`: parsing and refusals, the size arithmetic against saved models, the same blocks as `--drop N`,
and the speed search's stopping rule (a fake measurement; no wall-clock assertions)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import assert_one_line_error, run_cli
from layerprune.core.errors import LayerpruneError
from layerprune.models import drop_blocks
from layerprune.models.speed import SpeedBench, measured_speedup, measured_sublayer_speedup
from layerprune.models.sublayers import Sublayer
from layerprune.prune.api import prune_model
from layerprune.prune.recipe import PruneRecipe
from layerprune.prune.target import model_sizes, parse_target, plan_sublayers, plan_to_target, rank_removals
from tiny import tiny_config, tiny_tokenizer

CHEAP = ["--calib", "arithmetic", "--calib-samples", "4", "--batch-size", "4", "--score", "block-influence"]


def prune_args(model: Path, *extra: str) -> list[str]:
    return ["prune", "--model", str(model), *CHEAP, *extra]


@pytest.mark.parametrize(("text", "quantity", "value", "relative"), [
    ("params=6.5B", "params", 6.5e9, False), ("params=800M", "params", 8e8, False),
    ("params=0.8x", "params", 0.8, True), ("memory=12GiB", "memory", 12 * 2**30, False),
    ("memory=1.5GB", "memory", 1.5e9, False), ("memory=300MiB", "memory", 300 * 2**20, False),
    ("memory=0.7x", "memory", 0.7, True), ("kv-cache=0.5x", "kv-cache", 0.5, True),
    (" speedup = 1.4X ", "speedup", 1.4, True),
])
def test_parse_target(text, quantity, value, relative):
    target = parse_target(text)
    assert (target.quantity, target.relative) == (quantity, relative)
    assert math.isclose(target.value, value)


@pytest.mark.parametrize(("target", "needle"), [
    ("params", "cannot read target"), ("params=lots", "cannot read target"), ("size=1B", "unknown target"),
    ("params=12GiB", "params=6.5B"), ("memory=3T", "memory=12GiB"), ("kv-cache=1GB", "kv-cache=0.5x"),
    ("params=1.5x", "between 0x and 1x"), ("speedup=0.9x", "above 1x"), ("speedup=2", "speedup=1.4x"),
])
def test_bad_target_is_one_line(capsys, tiny_llama, target, needle):
    code, _, err = run_cli(capsys, prune_args(tiny_llama, "--dry-run", "--target", target))
    assert_one_line_error(code, err, "target", needle)


@pytest.mark.parametrize(("extra", "needle"), [
    (["--drop", "2"], "without --drop or --layers"), (["--layers", "2"], "without --drop or --layers"),
    (["--iterative"], "not with --iterative"), (["--score", "angular"], "not with --iterative or --score angular"),
    (["--block-major"], "--block-major"), (["--outtype", "q8_0"], "--outtype prices a --target memory="),
])
def test_target_refuses_what_it_cannot_combine(capsys, tiny_llama, extra, needle):
    code, _, err = run_cli(capsys, prune_args(tiny_llama, "--dry-run", "--target", "params=0.8x", *extra))
    assert_one_line_error(code, err, needle)


@pytest.mark.parametrize(("target", "needle"), [
    ("params=0.2x", "0.12M parameters (0.454x of the original)"), ("memory=1KiB", "MiB of weights (0.454x"),
    ("kv-cache=0.1x", "512 KV-cache bytes per token (0.333x"),
])
def test_unreachable_target_names_the_best_reachable(capsys, tiny_llama, tmp_path, target, needle):
    out = tmp_path / "pruned"
    code, _, err = run_cli(capsys, prune_args(tiny_llama, "--output", str(out), "--target", target))
    assert_one_line_error(code, err, f"--target {target} cannot be reached", "removing all 4 removable", needle)
    assert not out.exists()


def _tensor_bytes(directory: Path, outtype: str | None = None) -> int:
    """The saved tensors' bytes, or with `outtype` the bytes `export --gguf --outtype` writes each as
    (models/gguf_types.written_bytes, the writer's rule; no tensor is read)."""
    from layerprune.models.gguf_types import written_bytes

    total = 0
    for path in directory.glob("*.safetensors"):
        with safe_open(path, "pt") as files:
            for name in files.keys():  # noqa: SIM118
                if outtype is not None:
                    total += written_bytes(files.get_slice(name).get_shape(), outtype)
                    continue
                tensor = files.get_tensor(name)
                total += tensor.numel() * tensor.element_size()
    return total


@pytest.mark.parametrize(("target", "dtype"), [("params=0.7x", "auto"), ("memory=0.4MiB", "bfloat16"),
                                               ("kv-cache=0.5x", "auto")])
def test_saved_model_meets_the_target_as_predicted(capsys, tiny_llama, tmp_path, target, dtype):
    out = tmp_path / "pruned"
    code, stdout, err = run_cli(capsys, prune_args(tiny_llama, "--output", str(out), "--dtype", dtype,
                                                   "--target", target))
    assert code == 0, err
    report = json.loads((out / "prune_report.json").read_text())
    before, after = report["target"]["predicted"]["before"], report["target"]["predicted"]["after"]
    saved = AutoModelForCausalLM.from_pretrained(out)
    config = saved.config
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * (2 if dtype == "bfloat16" else 4)
    assert after["params"] == saved.num_parameters() == report["params_after"]
    assert after["memory_bytes"] == _tensor_bytes(out)
    assert after["kv_bytes_per_token"] == kv
    quantity, value = target.split("=")
    key = {"params": "params", "memory": "memory_bytes", "kv-cache": "kv_bytes_per_token"}[quantity]
    limit = 0.4 * 2**20 if value.endswith("MiB") else float(value.rstrip("x")) * before[key]
    assert after[key] <= limit < before[key]
    assert sorted(int(r) for r in report["target"]["removals"]) == report["dropped"]
    assert f"target {target}: remove" in stdout


@pytest.mark.parametrize("target", ["params=0.7x", "memory=0.4MiB", "kv-cache=0.5x"])
def test_a_dry_run_prints_the_plan_the_run_carries_out_and_writes_nothing(capsys, tiny_llama, tmp_path, target):
    """`--dry-run --target` prints the plan (removals, predicted before -> after) and writes nothing; the real run
    removes the same blocks."""
    out = tmp_path / "pruned"
    code, stdout, err = run_cli(capsys, prune_args(tiny_llama, "--dry-run", "--output", str(out), "--dtype",
                                                   "bfloat16", "--target", target))
    assert code == 0, err
    assert f"target {target}: remove" in stdout and "predicted: parameters" in stdout
    assert "dry run: nothing written" in stdout and not out.exists()
    planned = stdout.split(f"target {target}: remove ", 1)[1].splitlines()[0]
    code, _, err = run_cli(capsys, prune_args(tiny_llama, "--output", str(out), "--dtype", "bfloat16", "--target",
                                              target))
    assert code == 0, err
    report = json.loads((out / "prune_report.json").read_text())
    assert sorted(int(b) for b in planned.split(", ")) == report["dropped"]


@pytest.mark.parametrize(("outtype", "extra", "needles"), [
    ("q4_k_m", [], ["--outtype q4_k_m", "GGUF the model was read from", "was not read from one"]),
    ("Q4_K_M", ["--granularity", "attention"], ["llama.cpp's quantizer, which removes whole blocks"]),
    ("q8", [], ["unknown --outtype q8", "f32, f16, bf16, q8_0, q4_0"]),
])
def test_a_memory_target_at_an_outtype_it_cannot_price_is_refused_in_one_line(capsys, tiny_llama, outtype, extra,
                                                                              needles):
    code, _, err = run_cli(capsys, prune_args(tiny_llama, "--dry-run", "--target", "memory=0.7x", "--outtype",
                                              outtype, *extra))
    assert_one_line_error(code, err, *needles)


def test_an_outtype_is_read_as_export_reads_it():
    assert PruneRecipe(target="memory=0.7x", outtype="Q8_0").outtype == "q8_0"


@pytest.mark.parametrize("bindings", ["absent", "without a dry run", "another block count"])
def test_a_k_quant_memory_target_it_cannot_price_is_one_line_before_scoring(capsys, tmp_path, monkeypatch,
                                                                            bindings):
    """A model read from a GGUF is priced by llama.cpp's quantizer: without llama-cpp-python, with bindings too old
    for the quantizer's dry run (where ctypes would take the flag silently and quantize for real), or with a GGUF of
    another depth, one line, before any block is scored."""
    import ctypes
    import sys
    import types

    import layerprune.core.extras as extras
    import layerprune.prune.in_memory as in_memory
    from test_export import smollm_gguf

    directory = tmp_path / "converted"
    AutoModelForCausalLM.from_config(tiny_config("llama", 4)).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    (directory / "source.json").write_text(json.dumps({"gguf": str(smollm_gguf())}))
    monkeypatch.setattr(extras, "_installed", lambda module: bindings != "absent" or module != "llama_cpp")
    fields = [("ftype", ctypes.c_int), ("only_copy", ctypes.c_bool), ("prune_layers", ctypes.c_void_p)]
    if bindings == "another block count":
        fields += [("dry_run", ctypes.c_bool)]
        fields[2] = ("prune_layers", ctypes.POINTER(ctypes.c_int32))
    params = type("llama_model_quantize_params", (ctypes.Structure,), {"_fields_": fields})
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(llama_model_quantize_params=params,
                                                                         __version__="0.3.16"))
    monkeypatch.setattr(in_memory, "choose_blocks", lambda *a: pytest.fail("scored before the refusal"))
    code, _, err = run_cli(capsys, prune_args(directory, "--dry-run", "--target", "memory=0.7x", "--outtype",
                                              "q4_k_m"))
    needles = {"absent": ["needs llama-cpp-python", "layerprune[gguf-run]"],
               "without a dry run": ["dry run", "llama-cpp-python 0.3.16 lacks", ">=0.3.36"],
               "another block count": ["which has 30 blocks where the model has 4"]}[bindings]
    assert_one_line_error(code, err, "--outtype q4_k_m", *needles)


def test_a_priced_memory_target_bisects_the_counts_and_takes_the_fewest():
    """Each k-quant price is a llama.cpp call: the plan bisects the ranking's prefixes instead of walking them."""
    from layerprune.prune.target import Cost, ModelSizes, plan_ranked

    sizes = ModelSizes(Cost(100, 1000, 10, 100), {b: Cost(10, 100, 1, 10) for b in range(10)}, "q4_k_m")
    asked: list[tuple[int, ...]] = []
    sizes.priced = lambda blocks: (asked.append(tuple(blocks)), 1000 - 90 * len(blocks))[1]
    plan = plan_ranked(list(range(9, -1, -1)), parse_target("memory=0.5x"), sizes)
    assert len(plan.removals) == 6 and plan.after["memory_bytes"] == 460  # 5 leave 550 > 500; 6 leave 460
    assert len(set(asked)) <= 6  # the unpruned price, about log2(11) probes and the chosen prefix, not 7 in a row
    assert plan.weights_as == "q4_k_m"


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="a k-quant price needs llama-cpp-python (make bench-engines builds it)")
def test_a_k_quant_memory_target_is_what_llama_cpp_writes_for_the_saved_model(capsys, tmp_path):
    """A tiny llama exported to F16 GGUF (its 49k-token embedding most of it) is pruned from that .gguf to a Q4_K_M
    memory target; the saved model's own `export --outtype q4_k_m` has the tensor bytes the plan priced (to the dry
    run's 0.01 MiB) and meets the target."""
    import gguf

    from layerprune.export import export_gguf
    from test_export import smollm_gguf

    source = smollm_gguf()
    directory = tmp_path / "tiny"
    torch.manual_seed(0)
    config = tiny_config("llama", 8)
    config.vocab_size, config.bos_token_id, config.eos_token_id, config.pad_token_id = 49152, 1, 2, 2
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name).save_pretrained(directory)
    (directory / "source.json").write_text(json.dumps({"gguf": str(source)}))
    export_gguf(directory, tmp_path / "tiny.gguf", "f16", verify=False)
    out = tmp_path / "pruned"
    code, stdout, err = run_cli(capsys, ["prune", "--model", str(tmp_path / "tiny.gguf"), "--score", "last",
                                         "--output", str(out), "--target", "memory=0.99x", "--outtype", "q4_k_m"])
    assert code == 0, err
    record = json.loads((out / "prune_report.json").read_text())["target"]
    export_gguf(out, tmp_path / "pruned.gguf", "q4_k_m", verify=False)
    written = sum(int(t.n_bytes) for t in gguf.GGUFReader(tmp_path / "pruned.gguf").tensors)
    after, before = record["predicted"]["after"]["memory_bytes"], record["predicted"]["before"]["memory_bytes"]
    assert abs(written - after) <= 0.005 * 2**20 and after <= 0.99 * before and len(record["removals"]) >= 2
    assert "priced by llama.cpp's quantizer" in stdout


class _Written:
    """A GGUF writer that keeps only the bytes of the tensors the export hands it."""

    def __init__(self) -> None:
        self.bytes = 0

    def add_tensor(self, name, array, raw_dtype=None) -> None:  # noqa: ANN001
        self.bytes += array.nbytes


def _exported_bytes(directory: Path, outtype: str) -> int:
    """The tensor bytes `export --gguf --outtype` writes for a folder (its writer run into a counter): the family's
    extra tensors too, such as the deci layout's zero FFNs."""
    from transformers import AutoConfig

    from layerprune.export.catalog import family_for
    from layerprune.export.writer import add_tensors

    config = AutoConfig.from_pretrained(directory, trust_remote_code=True)
    writer = _Written()
    add_tensors(writer, directory, family_for(config), config, outtype)
    return writer.bytes


@pytest.mark.parametrize("outtype", ["q8_0", "f16"])
def test_a_memory_target_at_an_outtype_counts_what_the_export_writes(capsys, tiny_llama, tmp_path, outtype):
    """The tiny model's 64-wide rows take Q8_0's 32-blocks; its 1-D norms stay F32: the plan's bytes are the bytes
    `export --gguf --outtype` writes, before and after, and the after meets the target."""
    out = tmp_path / "pruned"
    code, stdout, err = run_cli(capsys, prune_args(tiny_llama, "--output", str(out), "--target", "memory=0.7x",
                                                   "--outtype", outtype))
    assert code == 0, err
    record = json.loads((out / "prune_report.json").read_text())["target"]
    before, after = record["predicted"]["before"]["memory_bytes"], record["predicted"]["after"]["memory_bytes"]
    assert before == _exported_bytes(tiny_llama, outtype) and after == _exported_bytes(out, outtype)
    assert after <= 0.7 * before
    assert record["weights_as"] == outtype and f"weights (as {outtype} GGUF tensors)" in stdout
    assert before < _tensor_bytes(tiny_llama) * (0.6 if outtype == "q8_0" else 0.8)  # not the float32 bytes


@pytest.mark.parametrize(("granularity", "outtype"), [("mlp", "q8_0"), ("sublayer", "f16")])
def test_a_sublayer_memory_target_at_an_outtype_counts_the_deci_export_and_its_zero_ffns(capsys, tmp_path,
                                                                                           granularity, outtype):
    """At a finer grain the export writes llama.cpp's `deci` layout, where a block that lost only its MLP keeps a
    zero FFN (and its norm): the plan counts those bytes, so the prediction is what the export writes (it was
    refused: the plan did not count them)."""
    from transformers import AutoConfig

    config = tiny_config("llama", 6)
    config.intermediate_size = 512  # a multiple of 256 (the layout's widths), twice the zero FFN's
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "source")
    tiny_tokenizer().save_pretrained(tmp_path / "source")
    out = tmp_path / "pruned"
    code, _, err = run_cli(capsys, prune_args(tmp_path / "source", "--granularity", granularity, "--output", str(out),
                                              "--target", "memory=0.9x", "--outtype", outtype))
    assert code == 0, err
    record = json.loads((out / "prune_report.json").read_text())
    saved = AutoConfig.from_pretrained(out, trust_remote_code=True)
    zero_ffns = sum(block.ffn.no_op and not block.attention.no_op for block in saved.block_configs)
    assert zero_ffns >= 1, record["removed_sublayers"]  # the case the plan must price
    after = record["target"]["predicted"]["after"]["memory_bytes"]
    assert _exported_bytes(out, outtype) == after <= 0.9 * record["target"]["predicted"]["before"]["memory_bytes"]


@pytest.mark.parametrize("score", ["block-influence", "last"])
def test_target_picks_the_blocks_drop_n_would(tiny_llama, score):
    common = {"score": score, "calib": "arithmetic", "calib_samples": 4, "batch_size": 4}
    by_target = prune_model(str(tiny_llama), PruneRecipe(target="params=0.6x", **common), dry_run=True).report
    n = len(by_target["dropped"])
    assert 1 < n < 5
    by_drop = prune_model(str(tiny_llama), PruneRecipe(drop=n, **common), dry_run=True).report
    assert by_target["dropped"] == by_drop["dropped"]
    fewer = prune_model(str(tiny_llama), PruneRecipe(drop=n - 1, **common), dry_run=True).report
    assert fewer["params_after"] > 0.6 * by_target["params_before"] >= by_target["params_after"]


def _tied_qwen2(directory: Path) -> Path:
    """Qwen2 (q/k/v biases, GQA) with tied embeddings: the cases a formula of the config gets wrong."""
    config = tiny_config("qwen2")
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


@pytest.mark.parametrize("arch", ["llama", "tied-qwen2"])
def test_sizes_are_the_models_own(tiny_models, tmp_path, arch):
    path = _tied_qwen2(tmp_path / "qwen2") if arch == "tied-qwen2" else tiny_models("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sizes = model_sizes(model, torch.bfloat16)
    assert sizes.total.params == model.num_parameters() == sum(p.numel() for p in model.parameters())
    assert sizes.total.bytes == 2 * sizes.total.params
    for block in range(len(model.model.layers)):
        layer = model.model.layers[block]
        attn, mlp = sizes.costs[Sublayer(block, "attn")], sizes.costs[Sublayer(block, "mlp")]
        assert attn.params == sum(p.numel() for p in [*layer.self_attn.parameters(), layer.input_layernorm.weight])
        assert attn.kv_bytes_per_token == 2 * 2 * 16 * 2 and mlp.kv_bytes_per_token == 0  # K, V: 2 heads x 16, bf16
        assert sizes.removed([Sublayer(block, "attn"), Sublayer(block, "mlp")]) == sizes.costs[block]
        assert sizes.removed([block, Sublayer(block, "mlp")]) == sizes.costs[block]
    predicted = sizes.predicted([1, 3, Sublayer(4, "attn")])
    removed = sizes.costs[1].params + sizes.costs[3].params + sizes.costs[Sublayer(4, "attn")].params
    assert predicted["params"] == sizes.total.params - removed
    drop_blocks(model, [1, 3])
    assert sizes.predicted([1, 3])["params"] == model.num_parameters()


def _fake_sizes(tiny_llama):
    return model_sizes(AutoModelForCausalLM.from_pretrained(tiny_llama), torch.float32)


def test_ranking_protects_and_breaks_ties_like_drop(tiny_llama):
    removals = [*range(4), Sublayer(4, "attn"), Sublayer(4, "mlp")]
    ranked = rank_removals([0.5, 0.1, 0.1, None, 0.0, float("nan")], removals, protected=[0])
    assert ranked == [Sublayer(4, "attn"), 2, 1]


@pytest.mark.parametrize(("measured", "expected_count", "measured_counts"), [
    (lambda n: 1.0 + 0.1 * n, 3, [3]),  # measured below predicted: one more removal at a time
    (lambda n: 1.0 + 0.5 * n, 1, [1]),  # measured above predicted where it crossed: one fewer while it holds
])
def test_speed_search_stops_when_measured_meets_the_target(tiny_llama, measured, expected_count, measured_counts):
    sizes = _fake_sizes(tiny_llama)
    calls: list[list] = []

    def measure(removals):
        calls.append(list(removals))
        return {"speedup": measured(len(removals))}

    scores = [6.0, 5.0, 4.0, 3.0, 2.0, 1.0]
    crossing = next(n for n in range(1, 6) if sizes.predicted([5, 4, 3, 2, 1][:n])["speedup"] >= 1.25)
    assert crossing == 2  # the first measurement is where the prediction crosses
    plan = plan_to_target(scores, list(range(6)), parse_target("speedup=1.25x"), sizes, [0], 4, measure)
    assert len(plan.removals) == expected_count and plan.removals == [5, 4, 3, 2][:expected_count]
    assert sorted({len(c) for c in calls}) == sorted({*measured_counts, crossing, expected_count})
    assert len(calls) == len({len(c) for c in calls})  # each candidate measured once
    assert plan.record().measured_speedup["speedup"] >= 1.25
    assert all(m["predicted"] > 1 for m in plan.record().measurements)


def test_speed_search_refuses_an_unreachable_speedup(tiny_llama):
    with pytest.raises(LayerpruneError, match=r"speedup=3x cannot be reached: .* measured 1\.40x"):
        plan_to_target([1.0] * 6, list(range(6)), parse_target("speedup=3x"), _fake_sizes(tiny_llama), [0], 4,
                       lambda removals: {"speedup": 1.0 + 0.1 * len(removals)})


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_measured_speedup_is_a_sane_ratio(tiny_llama, clock):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    depth = len(model.model.layers)
    result = measured_speedup(model, [1, 2, 3], SpeedBench(prompt_len=16, batch=2, new_tokens=4, repeats=1,
                                                            clock=clock))
    for key in ("prefill_speedup", "decode_speedup", "speedup", "prefill_tokens_per_s", "decode_tokens_per_s_pruned"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert result["speedup"] == min(result["prefill_speedup"], result["decode_speedup"])
    assert len(model.model.layers) == depth  # the model is whole again


class _CostClock:
    """A clock that advances only where a test says a module costs time: each attention call 3 units, each MLP call
    1 (forward hooks registered before the profile's, so the profile reads the clock after the cost is added)."""

    def __init__(self, model) -> None:  # noqa: ANN001
        self.now = 0.0
        for layer in model.model.layers:
            layer.self_attn.register_forward_hook(lambda *_: self.tick(3.0))
            layer.mlp.register_forward_hook(lambda *_: self.tick(1.0))

    def tick(self, units: float) -> None:
        self.now += units

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_a_profile_times_each_part_per_phase_and_predicts_from_the_time_left(tiny_llama, monkeypatch, clock):
    """Each block and sublayer timed in the benchmark's prefill and decode steps (not the decode's prompt pass),
    repeats summed; the prediction is 1 / the share of time left, a block and its sublayers counted once."""
    import types

    import layerprune.models.speed as speed
    from layerprune.prune.target import speed_profile

    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    fake = _CostClock(model)
    monkeypatch.setattr(speed, "time", types.SimpleNamespace(perf_counter=fake, process_time=fake))
    depth, bench = len(model.model.layers), SpeedBench(prompt_len=8, new_tokens=5, repeats=2, clock=clock)
    profile = speed_profile(model, bench)
    assert profile.totals == {"prefill": 2 * 4 * depth, "decode": 2 * 5 * 4 * depth}
    for block in range(depth):
        assert profile.parts[block] == {"prefill": 2 * 4, "decode": 2 * 5 * 4}
        assert profile.parts[Sublayer(block, "attn")] == {"prefill": 2 * 3, "decode": 2 * 5 * 3}
        assert profile.parts[Sublayer(block, "mlp")] == {"prefill": 2 * 1, "decode": 2 * 5 * 1}
    assert not any(h for layer in model.model.layers for h in (layer._forward_hooks, layer._forward_pre_hooks))

    sizes = model_sizes(model, torch.float32)
    sizes.profile = profile
    attention = sizes.predicted([Sublayer(b, "attn") for b in range(3)])
    assert attention["speedup"] == pytest.approx(4 * depth / (4 * depth - 9))
    assert attention["prefill_speedup"] == attention["decode_speedup"] == attention["speedup"]
    assert attention["flops_speedup"] < attention["speedup"]  # FLOPs give attention less than its time
    whole = sizes.predicted([1, Sublayer(1, "attn"), Sublayer(2, "attn"), Sublayer(2, "mlp")])
    assert whole["speedup"] == pytest.approx(4 * depth / (4 * depth - 8))  # two blocks, each counted once


def test_speedup_target_dry_run_prints_predicted_and_measured(capsys, tiny_llama, monkeypatch):
    import layerprune.prune.target as target_module

    seen: list[list[int]] = []

    def fake(model, drop, bench):  # noqa: ANN001, ANN202
        seen.append(list(drop))
        assert len(model.model.layers) == 6  # measured on the whole model, which the real one prunes in place
        ratio = 1.0 + 0.1 * len(drop)
        return {"prefill_speedup": ratio + 0.05, "decode_speedup": ratio, "speedup": ratio}

    monkeypatch.setattr(target_module, "measured_speedup", fake)
    code, stdout, err = run_cli(capsys, prune_args(tiny_llama, "--dry-run", "--json", "--target", "speedup=1.25x"))
    assert code == 0, err
    report = json.loads(stdout[stdout.index("\n{") + 1:])
    record = report["target"]
    assert [m["removals"] for m in record["measurements"]] == sorted({len(d) for d in seen})
    assert record["measured_speedup"]["removals"] == len(report["dropped"]) == 3
    assert record["measured_speedup"]["predicted"] == record["predicted"]["after"]["speedup"]
    assert "measured: speedup 1.30x (prefill 1.35x, decode 1.30x; predicted" in stdout
    assert "(timed profile: prefill" in stdout and "FLOPs alone" in stdout
    assert record["predicted"]["after"]["speedup"] != record["predicted"]["after"]["flops_speedup"]
    assert "dry run: nothing written" in stdout


@pytest.fixture(scope="module")
def expressible_llama(tmp_path_factory) -> Path:
    """A tiny 6-block llama the Nemotron-NAS layout carries (intermediate 256, a multiple of 256)."""
    directory = tmp_path_factory.mktemp("expressible") / "llama"
    config = tiny_config("llama", 6)
    config.intermediate_size = 256
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


@pytest.mark.parametrize(("granularity", "target", "dtype"), [
    ("attention", "kv-cache=0.5x", "auto"), ("mlp", "params=0.7x", "auto"), ("sublayer", "memory=0.6x", "bfloat16"),
])
def test_a_sublayer_target_is_met_by_the_saved_layout_as_predicted(capsys, expressible_llama, tmp_path, granularity,
                                                                   target, dtype):
    out = tmp_path / "pruned"
    code, stdout, err = run_cli(capsys, prune_args(expressible_llama, "--output", str(out), "--dtype", dtype,
                                                   "--granularity", granularity, "--target", target))
    assert code == 0, err
    report = json.loads((out / "prune_report.json").read_text())
    record = report["target"]
    before, after = record["predicted"]["before"], record["predicted"]["after"]
    saved = AutoModelForCausalLM.from_pretrained(out)
    attention = sum(not block["attention"]["no_op"] for block in json.loads((out / "config.json").read_text())
                    ["block_configs"])
    config = saved.config
    kv = 2 * attention * config.num_key_value_heads * config.head_dim * (2 if dtype == "bfloat16" else 4)
    assert after["params"] == saved.num_parameters() == report["params_after"]
    assert after["memory_bytes"] == _tensor_bytes(out) and after["kv_bytes_per_token"] == kv
    quantity, value = target.split("=")
    key = {"params": "params", "memory": "memory_bytes", "kv-cache": "kv_bytes_per_token"}[quantity]
    assert after[key] <= float(value.rstrip("x")) * before[key] < before[key]
    assert sorted(record["removals"]) == sorted(report["removed_sublayers"]) and record["removals"]
    assert f"target {target}: remove" in stdout


@pytest.mark.parametrize("granularity", ["attention", "sublayer"])
def test_a_sublayer_target_takes_the_fewest_that_drop_n_would(tiny_llama, granularity):
    common = {"score": "block-influence", "calib": "arithmetic", "calib_samples": 4, "batch_size": 4,
              "granularity": granularity}
    by_target = prune_model(str(tiny_llama), PruneRecipe(target="params=0.85x", **common), dry_run=True).report
    n = len(by_target["removed_sublayers"])
    assert 1 < n
    by_drop = prune_model(str(tiny_llama), PruneRecipe(drop=n, **common), dry_run=True).report
    assert by_target["removed_sublayers"] == by_drop["removed_sublayers"]
    fewer = prune_model(str(tiny_llama), PruneRecipe(drop=n - 1, **common), dry_run=True).report
    assert fewer["params_after"] > 0.85 * by_target["params_before"] >= by_target["params_after"]


def test_a_sublayer_target_stops_where_the_layout_does(capsys, tiny_llama):
    code, _, err = run_cli(capsys, prune_args(tiny_llama, "--dry-run", "--granularity", "attention", "--protect", "5",
                                              "--target", "kv-cache=0.1x"))
    assert_one_line_error(code, err, "cannot be reached", "removing all 4 removable",
                          "the first kept block keeps its attention", "0.333x of the original")


def test_an_unreachable_target_with_nothing_removable_names_the_grain(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with pytest.raises(LayerpruneError, match=r"removing all 0 removable \(unprotected, scored; the first kept block "
                                              r"keeps its attention\)"):
        plan_sublayers(model, parse_target("params=0.5x"), [], torch.float32)
    with pytest.raises(LayerpruneError, match=r"removing all 0 removable \(unprotected, scored; one block kept\)"):
        plan_to_target([None] * 6, list(range(6)), parse_target("params=0.5x"), model_sizes(model, torch.float32))


def test_sublayer_speedup_is_measured_on_the_layout_that_would_be_saved(monkeypatch):
    import layerprune.models.nas_surgery as nas_surgery

    config = tiny_config("llama", 6)
    config.intermediate_size = 256  # one the layout expresses (ffn_mult rounds to multiples of 256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    removed = [Sublayer(2, "attn"), Sublayer(3, "mlp"), Sublayer(4, "attn"), Sublayer(4, "mlp")]
    seen = []
    real = nas_surgery.to_nas
    monkeypatch.setattr(nas_surgery, "to_nas", lambda model, removed: seen.append(real(model, removed)) or seen[-1])
    result = measured_sublayer_speedup(model, removed, SpeedBench(prompt_len=16, batch=2, new_tokens=4, repeats=1,
                                                                  clock="cpu"))
    for key in ("prefill_speedup", "decode_speedup", "speedup", "decode_tokens_per_s_pruned"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    (candidate,) = seen  # the DeciLM model the save would write: block 4 gone, 2 without attention, 3 without MLP
    blocks = candidate.config.block_configs
    assert type(candidate).__name__ == "DeciLMForCausalLM" and len(blocks) == 5
    assert [b.attention.no_op for b in blocks] == [False, False, True, False, False]
    assert [b.ffn.no_op for b in blocks] == [False, False, False, True, False]


def test_speedup_target_at_a_sublayer_grain_prints_predicted_and_measured(capsys, tiny_llama, monkeypatch, tmp_path):
    import layerprune.prune.target as target_module

    seen: list[list[str]] = []

    def fake(model, removed, bench):  # noqa: ANN001, ANN202
        seen.append([str(r) for r in removed])
        ratio = 1.0 + 0.05 * len(removed)
        return {"prefill_speedup": ratio, "decode_speedup": ratio + 0.01, "speedup": ratio}

    monkeypatch.setattr(target_module, "measured_sublayer_speedup", fake)
    code, stdout, err = run_cli(capsys, prune_args(tiny_llama, "--dry-run", "--json", "--granularity", "sublayer",
                                                   "--target", "speedup=1.12x"))
    assert code == 0, err
    report = json.loads(stdout[stdout.index("\n{") + 1:])
    record = report["target"]
    assert len(record["removals"]) == 3 and record["measured_speedup"]["removals"] == 3  # 1.15x >= 1.12x, 1.10x not
    assert sorted(record["removals"]) == sorted(report["removed_sublayers"]) and all("." in r for r in seen[-1])
    assert "measured: speedup 1.15x (prefill 1.15x, decode 1.16x; predicted" in stdout
    assert "(timed profile: prefill" in stdout


@pytest.mark.slow
@pytest.mark.parametrize(("target", "extra"), [  # params at block grain: the tiny models' test above
    ("kv-cache=0.8x", ["--granularity", "attention"]),  # saved in the Nemotron-NAS layout
    ("memory=120MiB", ["--outtype", "q8_0"]),
])
def test_the_embedded_model_pruned_to_a_target_meets_it_when_saved(capsys, tmp_path, target, extra):
    """The real SmolLM2-135M (30 blocks, GQA 9/3), pruned to a target and saved: the saved folder meets it (its
    attention sublayers, or the Q8_0 bytes export --gguf --outtype q8_0 writes)."""
    out = tmp_path / "pruned"
    code, _, err = run_cli(capsys, ["prune", "--model", "embedded", "--score", "last", "--target", target, *extra,
                                    "--output", str(out)])
    assert code == 0, err
    report = json.loads((out / "prune_report.json").read_text())
    before, after = report["target"]["predicted"]["before"], report["target"]["predicted"]["after"]
    config = json.loads((out / "config.json").read_text())
    if target.startswith("kv-cache="):
        assert config["model_type"] == "nemotron-nas"
        attentions = sum(not block["attention"]["no_op"] for block in config["block_configs"])
        assert attentions / 30 == pytest.approx(after["kv_bytes_per_token"] / before["kv_bytes_per_token"])
        assert attentions <= 0.8 * 30 < 30
    else:
        assert _tensor_bytes(out, "q8_0") == after["memory_bytes"] <= 120 * 2**20 < before["memory_bytes"]
