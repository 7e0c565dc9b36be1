"""`analyze`: skip == zero-out, prefix reuse == naive loop, CLI bad inputs, tiny end-to-end runs."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from layerprune.analyze.tasks import task_items
from layerprune.analyze.walk import ablate_blocks, ablate_blocks_naive, build_batches, zero_block_outputs
from layerprune.cli import main
from layerprune.models import find_decoder_stack, load_model, skipped_blocks


def tiny_batches(loaded, n=3, score_all=False):
    items = task_items("arithmetic", n, seed=0, shots=1, data_dir=None)
    return build_batches(loaded.tokenizer, items, batch_size=2, max_length=64, score_all=score_all)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen2", "olmo2", "phi3"])
def test_skipping_a_block_equals_zeroing_its_output_projections(tiny_models, arch):
    loaded = load_model(str(tiny_models(arch, 4)))
    model = loaded.model
    ids = loaded.tokenizer(["Question: what is 12 + 7? Answer: 19"], return_tensors="pt")["input_ids"]
    for block in (0, 2):
        with torch.no_grad(), skipped_blocks(model, [block]):
            skipped = model(input_ids=ids).logits
        zeroed_model = copy.deepcopy(model)
        assert len(zero_block_outputs(find_decoder_stack(zeroed_model).layers[block])) == 2
        with torch.no_grad():
            zeroed = zeroed_model(input_ids=ids).logits
            full = model(input_ids=ids).logits
        torch.testing.assert_close(skipped, zeroed, atol=1e-5, rtol=1e-4)
        assert not torch.allclose(full, skipped, atol=1e-4)  # the block did something


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_prefix_reuse_matches_a_full_forward_per_block(tiny_models, arch):
    loaded = load_model(str(tiny_models(arch, 4)))
    batches = tiny_batches(loaded)
    fast, naive = ablate_blocks(loaded.model, batches), ablate_blocks_naive(loaded.model, batches)
    assert fast.scored_tokens == naive.scored_tokens > 0
    assert fast.base_nll == pytest.approx(naive.base_nll, rel=1e-4)
    assert fast.ablated_nll == pytest.approx(naive.ablated_nll, rel=1e-4)
    assert (fast.base_accuracy, fast.ablated_accuracy) == (naive.base_accuracy, naive.ablated_accuracy)
    assert fast.items == 3


def test_batches_score_only_the_target(tiny_llama):
    loaded = load_model(str(tiny_llama))
    items = task_items("factual", 2, seed=0, shots=1, data_dir=None)
    batch = build_batches(loaded.tokenizer, items, batch_size=2, max_length=64)[0]
    for row, item in enumerate(items):
        scored = batch.input_ids[row][batch.loss_mask[row].bool()]
        assert loaded.tokenizer.decode(scored) == item.target
    assert int((batch.loss_mask * (1 - batch.attention_mask)).sum()) == 0


def run_cli(capsys, *argv):
    code = main(["analyze", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_importance_end_to_end_with_different_depths(tiny_models, tmp_path, capsys):
    out = tmp_path / "imp"
    code, stdout, err = run_cli(capsys, "importance", "--models", str(tiny_models("llama", 6)),
                                str(tiny_models("gemma3_text", 4)), "--tasks", "arithmetic,factual",
                                "--samples", "3", "--output", str(out))
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["drops.png", "heatmap.png", "importance.json", "summary.md"]
    report = json.loads((out / "importance.json").read_text())
    assert report["across_models"]["arithmetic"]["aligned_by"] == "relative depth"
    assert report["across_models"]["arithmetic"]["rows"] == 6
    assert len(report["tasks"]["factual"]["llama-6"]["drops"]) == 6
    assert "llama-6 vs gemma3_text-4" in report["across_models"]["factual"]["pairs"]
    assert "aligned by relative depth" in (out / "summary.md").read_text()


def test_a_model_scored_before_on_the_same_items_is_read_from_the_cache_and_not_loaded(tiny_models, tmp_path,
                                                                                      capsys, monkeypatch):
    """The original of several variant studies is ablated once: a second analysis with it beside another model
    reads its results (equal to the first run's) without loading it; other items or settings score it again."""
    from layerprune.analyze import records

    monkeypatch.setenv("LAYERPRUNE_CACHE", str(tmp_path / "cache"))  # its own: no other test's result is kept there
    first, second = str(tiny_models("llama", 6)), str(tiny_models("llama", 4))
    args = ["--tasks", "arithmetic,factual", "--samples", "3"]
    loaded: list[str] = []
    real = records.load_model
    monkeypatch.setattr(records, "load_model", lambda source, settings: loaded.append(source.spec) or
                        real(source, settings))
    assert run_cli(capsys, "importance", "--models", first, *args, "--output", str(tmp_path / "a"))[0] == 0
    assert loaded == [first]
    code, _, err = run_cli(capsys, "importance", "--models", first, second, *args, "--output", str(tmp_path / "b"))
    assert code == 0, err
    assert loaded == [first, second]
    a, b = (json.loads((tmp_path / d / "importance.json").read_text()) for d in "ab")
    for task in ("arithmetic", "factual"):
        assert b["tasks"][task]["llama-6"] == a["tasks"][task]["llama-6"]
        assert list(b["tasks"][task]) == ["llama-6", "llama-4"]
    assert b["models"]["llama-6"]["kept"] == ["arithmetic", "factual"] and b["models"]["llama-4"]["kept"] == []
    code, _, err = run_cli(capsys, "importance", "--models", first, "--tasks", "arithmetic", "--samples", "4",
                           "--output", str(tmp_path / "c"))
    assert code == 0, err
    assert loaded == [first, second, first]  # four items are not the three kept


@pytest.mark.parametrize("metric", ["accuracy", "generate"])
def test_importance_accuracy_metrics(tiny_llama, tmp_path, capsys, metric):
    out = tmp_path / "acc"
    code, _, err = run_cli(capsys, "importance", "--models", str(tiny_llama), "--tasks", "arithmetic",
                           "--metric", metric, "--samples", "2", "--output", str(out))
    assert code == 0, err
    result = json.loads((out / "importance.json").read_text())["tasks"]["arithmetic"]["llama-6"]
    assert len(result["scores"]) == 6 and 0.0 <= result["base_score"] <= 1.0


def test_nmi_end_to_end(tiny_llama, tmp_path, capsys):
    out = tmp_path / "nmi"
    code, _, err = run_cli(capsys, "nmi", "--model", str(tiny_llama), "--calib", "factual", "--samples", "4",
                           "--k", "4", "--output", str(out))
    assert code == 0, err
    report = json.loads((out / "nmi.json").read_text())
    assert len(report["nmi"]) == len(report["ami"]) == len(report["seed_agreement"]) == 7
    assert all(0.0 <= v <= 1.0 + 1e-9 for v in report["nmi"]) and 1 <= report["elbow_block"] < 6
    assert report["nmi"][0] == pytest.approx(report["seed_agreement"][0], abs=0.5)  # measured, not set to 1
    assert (out / "nmi.png").stat().st_size > 0
    assert len(report["skip_drops"]) == 6 and "first 2 factual texts" in report["critical_source"]


def test_nmi_reports_part_of_speech_or_says_why_not(tiny_llama, tmp_path, capsys, monkeypatch):
    pytest.importorskip("textblob")
    args = ["nmi", "--model", str(tiny_llama), "--calib", "factual", "--samples", "4", "--k", "3", "--seeds", "2",
            "--ablation-samples", "0"]
    code, _, err = run_cli(capsys, *args, "--output", str(tmp_path / "a"))
    assert code == 0, err
    report = json.loads((tmp_path / "a" / "nmi.json").read_text())
    assert len(report["pos_nmi"]) == len(report["pos_nmi_chance"]) == len(report["nmi"]) == 7
    assert report["pos_reference"].startswith("TextBlob") and "NN" in report["pos_reference"]
    assert "NMI vs part of speech:" in (tmp_path / "a" / "summary.md").read_text()
    monkeypatch.setattr("layerprune.analyze.pos.TAGGER_MODULE", "textblob_is_not_installed")
    code, _, err = run_cli(capsys, *args, "--output", str(tmp_path / "b"))
    assert code == 0, err
    report = json.loads((tmp_path / "b" / "nmi.json").read_text())
    assert "pos_nmi" not in report and report["pos_reference"].startswith("not computed (textblob is not installed")


def test_nmi_takes_texts_until_min_tokens(tiny_llama, tmp_path, capsys):
    out = tmp_path / "nmi"
    code, _, err = run_cli(capsys, "nmi", "--model", str(tiny_llama), "--calib", "factual", "--samples", "2",
                           "--min-tokens", "300", "--k", "3", "--seeds", "2", "--ablation-samples", "0",
                           "--output", str(out))
    assert code == 0, err
    report = json.loads((out / "nmi.json").read_text())
    assert report["tokens"] >= 300 and report["texts"] > 2
    assert_one_line_error(capsys, ["nmi", "--model", str(tiny_llama), "--calib", "factual", "--min-tokens", "10000000",
                                   "--output", str(tmp_path / "nmi2")], "--min-tokens", output=tmp_path / "nmi2")


def test_nmi_takes_critical_blocks_from_an_importance_report(tiny_llama, tmp_path, capsys):
    imp = tmp_path / "imp.json"
    imp.write_text(
        json.dumps({"tasks": {"factual": {"llama-6": {"drops": [0.5, 0, 0, 0, 0, 0.3], "critical": [0, 5]}}}})
    )
    args = ["nmi", "--model", str(tiny_llama), "--calib", "arithmetic", "--samples", "2", "--k", "3",
            "--critical-from", str(imp)]
    out = tmp_path / "nmi"
    code, _, err = run_cli(capsys, *args, "--output", str(out))
    assert code == 0, err
    assert json.loads((out / "nmi.json").read_text())["critical"] == [0, 5]
    nmi2 = tmp_path / "nmi2"
    assert_one_line_error(capsys, [*args, "--critical-task", "gsm8k", "--output", str(nmi2)], "no task 'gsm8k'",
                          output=nmi2)


def test_degeneration_from_file_and_model(tiny_llama, shared_data, tmp_path, capsys):
    gen = tmp_path / "gen.jsonl"
    gen.write_text('{"prompt": "p", "output": "one two one two. one two one two."}\n')
    out = tmp_path / "deg"
    code, stdout, err = run_cli(
        capsys,
        "degeneration",
        "--generations",
        str(gen),
        "--models",
        str(tiny_llama),
        "--labels",
        "original,pruned",
        "--samples",
        "2",
        "--max-new-tokens",
        "8",
        "--data-dir",
        str(shared_data),
        "--output",
        str(out),
    )
    assert code == 0, err
    variants = json.loads((out / "degeneration.json").read_text())["variants"]
    assert list(variants) == ["original", "pruned"]
    assert variants["original"]["rep_2"] == pytest.approx(5 / 9)  # 9 bigrams, 4 kinds: ab, ba, b., .a
    assert variants["original"]["self_bleu_4"] == pytest.approx(1.0)
    assert (out / "generations" / "pruned.jsonl").is_file()


def assert_one_line_error(capsys, argv, *needles, output: Path | None = None):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    if output is not None:
        assert not output.exists() and not list(output.parent.glob(f".{output.name}.tmp-*"))


def test_bad_inputs(tiny_llama, shared_data, tmp_path, capsys):
    out = tmp_path / "out"
    model = ["--models", str(tiny_llama), "--output", str(out)]
    assert_one_line_error(
        capsys, ["importance", *model, "--tasks", "arithmetc"], "did you mean: arithmetic", output=out
    )
    assert_one_line_error(
        capsys,
        ["importance", *model, "--tasks", "triviaqa", "--data-dir", str(shared_data)],
        "triviaqa",
        "train.jsonl",
        output=out,
    )
    assert_one_line_error(capsys, ["importance", *model, "--samples", "0"], "samples", output=out)
    assert_one_line_error(
        capsys, ["importance", "--models", str(tmp_path / "nope"), "--output", str(out)], "not found", output=out
    )
    assert_one_line_error(
        capsys,
        [
            "nmi",
            "--model",
            str(tiny_llama),
            "--calib",
            "factual",
            "--samples",
            "2",
            "--k",
            "5000",
            "--output",
            str(out),
        ],
        "k=5000",
        "--k",
        output=out,
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p", "text": "no output field"}\n')
    assert_one_line_error(
        capsys,
        ["degeneration", "--generations", str(bad), "--output", str(out)],
        "'output'",
        "--output-field",
        output=out,
    )
    assert_one_line_error(capsys, ["degeneration", "--output", str(out)], "--generations", output=out)
    assert_one_line_error(
        capsys,
        ["degeneration", "--generations", str(bad), "--labels", "a,b", "--output", str(out)],
        "--labels",
        output=out,
    )
    assert bad.read_text() == '{"prompt": "p", "text": "no output field"}\n'


def test_existing_output_needs_overwrite(tmp_path, capsys):
    gen = tmp_path / "gen.jsonl"
    gen.write_text('{"prompt": "p", "output": "a b c"}\n')
    out = tmp_path / "deg"
    out.mkdir()
    assert_one_line_error(capsys, ["degeneration", "--generations", str(gen), "--output", str(out)], "--overwrite")
    assert main(["analyze", "degeneration", "--generations", str(gen), "--output", str(out), "--overwrite"]) == 0
    assert (out / "degeneration.json").is_file()


@pytest.mark.slow
def test_embedded_models_importance_and_nmi(tmp_path, capsys):
    """Both embedded models end to end at small sizes (the tiny-model tests above check the numbers); the NMI takes
    its critical blocks from this importance report instead of skipping each of the 30 blocks again (its calibration
    ablation is test_nmi_end_to_end's)."""
    imp = tmp_path / "imp" / "importance.json"
    code, _, err = run_cli(capsys, "importance", "--tasks", "arithmetic", "--samples", "2", "--shots", "0",
                           "--resamples", "100", "--output", str(imp.parent))
    assert code == 0, err
    report = json.loads(imp.read_text())
    assert report["models"]["smollm2-135m-instruct"]["depth"] == 30 and report["models"]["gemma3-270m"]["depth"] == 18
    assert report["across_models"]["arithmetic"]["aligned_by"] == "relative depth"
    code, _, err = run_cli(capsys, "nmi", "--samples", "2", "--k", "8", "--seeds", "2", "--critical-from", str(imp),
                           "--output", str(tmp_path / "nmi"))
    assert code == 0, err
    nmi = json.loads((tmp_path / "nmi" / "nmi.json").read_text())
    assert len(nmi["nmi"]) == 31
    assert nmi["critical"] == report["tasks"]["arithmetic"]["smollm2-135m-instruct"]["critical"]


@pytest.mark.parametrize("recipe", ["importance-qwen25-7b", "importance-llama31-8b"])
def test_shipped_gpu_study_recipes_fail_clearly_offline(shared_data, tmp_path, capsys, recipe):
    out = tmp_path / "imp"
    assert_one_line_error(
        capsys,
        ["importance", "--recipe", recipe, "--data-dir", str(shared_data), "--output", str(out)],
        "triviaqa/train.jsonl",
        "offline",
        output=out,
    )


QWEN_STUDY = [
    "Qwen/Qwen2.5-7B",
    "Qwen/Qwen2.5-7B-Instruct",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
    "Open-Reasoner-Zero/Open-Reasoner-Zero-7B",
]


def needs_uncached(models, filename):
    """Skip where the hub cache of this machine holds `filename` of any of `models` (the test plans their absence)."""
    from huggingface_hub import try_to_load_from_cache

    cached = [m for m in models if isinstance(try_to_load_from_cache(m, filename), str)]
    if cached:
        pytest.skip(f"the hub cache here holds {filename} of {cached}")


def test_dry_run_offline_plans_what_it_can_and_names_the_missing_tokenizers(shared_data, tmp_path, capsys,
                                                                             monkeypatch):
    needs_uncached(QWEN_STUDY, "tokenizer_config.json")
    monkeypatch.setenv("LAYERPRUNE_DATA_DIR", str(shared_data))
    out = tmp_path / "imp"
    code, stdout, err = run_cli(capsys, "importance", "--recipe", "importance-qwen25-7b", "--dry-run", "--output",
                                str(out))
    assert code == 0, err
    assert not out.exists()
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("INCOMPLETE: no tokenizer here for " + ", ".join(QWEN_STUDY))
    assert "--tokenizers MODEL=DIR" in last
    r1 = stdout.split("## deepseek-ai/DeepSeek-R1-Distill-Qwen-7B")[1].split("\n## ")[0]
    assert "no tokenizer here: not in the hub cache and the hub is offline" in r1
    gsm8k = r1.split("/ gsm8k:")[1].split("\n- ")[0]
    # the decoding and budget are the recipe's; only the template's rendering and the token counts are unknown
    assert "4096 new tokens, sampled at temperature 0.6, top_p 0.95, seed 0" in gsm8k
    assert f"200 items x (blocks + 1) runs (full model + each block skipped), at most {200 * 4096:,} new tokens a run" \
        in gsm8k
    assert "example user turn (? prompt tokens: no tokenizer)" in gsm8k
    rendered = [line.removeprefix("      | ") for line in gsm8k.splitlines() if line.startswith("      | ")]
    assert rendered[-2:] == ["Please reason step by step, and put your final answer within \\boxed{}.", "Answer:"]


def test_dry_run_names_the_models_whose_depth_is_unknown(tiny_llama, shared_data, tmp_path, capsys, monkeypatch):
    needs_uncached(QWEN_STUDY[:1], "config.json")
    monkeypatch.setenv("LAYERPRUNE_DATA_DIR", str(shared_data))
    bare = tmp_path / "tokenizer-only"  # a tokenizer directory without the model's config.json
    bare.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tiny_llama / name).exists():
            shutil.copy(tiny_llama / name, bare / name)
    code, stdout, err = run_cli(capsys, "importance", "--recipe", "importance-qwen25-7b", "--dry-run", "--output",
                                str(tmp_path / "imp"), "--tokenizers", f"{QWEN_STUDY[0]}={bare}",
                                *(f"{m}={tiny_llama}" for m in QWEN_STUDY[1:]))
    assert code == 0, err
    base = stdout.split(f"## {QWEN_STUDY[0]} (")[1].split("\n## ")[0]
    assert "depth unknown (no config)" in base and "200 items x (blocks + 1) runs" in base
    assert "prompt tokens" in base and "? prompt tokens" not in base  # the tokenizer still counts the prompt
    last = stdout.strip().splitlines()[-1]
    assert last.startswith(f"INCOMPLETE: depth unknown for {QWEN_STUDY[0]} (a tokenizer without the model's config)")
    assert "no tokenizer here" not in stdout


def test_dry_run_renders_each_models_prompt_and_budget_from_local_tokenizers(
    tiny_llama, shared_data, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("LAYERPRUNE_DATA_DIR", str(shared_data))
    out = tmp_path / "imp"
    code, stdout, err = run_cli(
        capsys,
        "importance",
        "--recipe",
        "importance-qwen25-7b",
        "--dry-run",
        "--output",
        str(out),
        "--tokenizers",
        *(f"{m}={tiny_llama}" for m in QWEN_STUDY),
    )
    assert code == 0, err
    assert not out.exists()
    assert "items per task: 200 (seed 0), shots 0" in stdout
    # R1 distill: chat template, its instruction inside the user turn, 4096 sampled tokens; the budget counts
    # the full model and each of the 6 blocks skipped (depth read from the local directory's config, and said so)
    r1 = stdout.split("## deepseek-ai/DeepSeek-R1-Distill-Qwen-7B")[1].split("\n## ")[0]
    assert f"depth from the config in {tiny_llama}; 6 blocks" in r1
    gsm8k = r1.split("/ gsm8k:")[1].split("\n- ")[0]
    assert "chat template, 4096 new tokens, sampled at temperature 0.6, top_p 0.95, seed 0" in gsm8k
    assert "200 items x 7 runs" in gsm8k and f"at most {200 * 7 * 4096:,} new tokens" in gsm8k
    rendered = [line.removeprefix("      | ") for line in gsm8k.splitlines() if line.startswith("      | ")]

    question = task_items("gsm8k", 200, 0, 0, shared_data)[0].prompt.removesuffix("\nAnswer:")  # as planned
    assert "\n".join(rendered) == (
        f"<|user|>{question}\nPlease reason step by step, and put your final answer "
        "within \\boxed{}.\nAnswer:<|end|><|assistant|>"
    )
    base = stdout.split("## Qwen/Qwen2.5-7B (")[1].split("\n## ")[0]
    assert "/ gsm8k: chat template, 192 new tokens, greedy" in base  # chat_template auto: the tokenizer has one
    assert "data not here" in stdout.split("/ triviaqa:")[1].split("\n- ")[0]  # no triviaqa in the mirror: said
