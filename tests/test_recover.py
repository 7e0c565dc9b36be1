"""recover on tiny random models: self-generation, TRL training, outputs, precedence and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer

from helpers import pruned_copy
from layerprune.cli import build_parser, main
from layerprune.cli.recover import build_recipe
from layerprune.recover import runner, selfgen, train
from layerprune.recover.report import RecoverReport
from layerprune.recover.schema import GenerationSection, PromptSource, RecoverRecipe

FAST = ["--max-new-tokens", "6", "--no-generate-drop-truncated", "--samples", "8", "--train-max-length", "64",
        "--train-batch-size", "4", "--max-steps", "2", "--held-out", "0.25", "--train-warmup-steps", "0",
        "--no-train-gradient-checkpointing", "--learning-rate", "1e-2", "--lora-r", "4", "--device", "cpu", "-q"]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"what is {i} + 7?", "answer": str(i + 7)}) + "\n" for i in range(12))
    )
    return path


@pytest.fixture(scope="module")
def pruned(tiny_models, tmp_path_factory) -> Path:
    """A tiny model minus two blocks, with the prune_report.json that names its teacher."""
    return pruned_copy(tiny_models("llama", 6), tmp_path_factory.mktemp("pruned") / "p2", [2, 3])


def recover_cli(*extra: str) -> int:
    return main(["recover", *extra, *FAST])


def io_args(model: Path, prompts: Path | str, out: Path) -> list[str]:
    """--model, --prompts and -o, as most tests pass them."""
    return ["--model", str(model), "--prompts", str(prompts), "-o", str(out)]


def test_cli_lora_end_to_end_merged_model_loads_and_generates(pruned, prompts_file, tmp_path):
    out = tmp_path / "rec"
    assert recover_cli("--model", str(pruned), "--prompts", str(prompts_file), "-o", str(out)) == 0
    report = json.loads((out / "recover_report.json").read_text())
    assert report["teacher"] == json.loads((pruned / "prune_report.json").read_text())["source"]["spec"]
    assert report["held_out_loss"]["before"] is not None and report["held_out_loss"]["after"] is not None
    assert report["loss_curve"]["held_out"][0][0] == 0 and report["tokens_seen"] > 0
    assert report["data"]["filter"]["kept"] == 8 and report["data"]["held_out_examples"] == 2
    assert (out / "adapter" / "adapter_config.json").is_file() and (out / "loss_curve.png").is_file()
    assert not list(out.glob("*.bin")) and not (out.parent / "rec.work").exists()
    card = ModelCard.load(out / "README.md")  # the original as base model, the blocks dropped, the recovery
    assert card.data.base_model is None and "recover-lora" in card.data.tags  # a local original: no hub id to name
    assert card.data.layerprune["recover_method"] == "lora" and card.data.layerprune["dropped_blocks"] == [2, 3]
    assert "- dropped blocks (original numbering): [2, 3]" in card.text and f"`{report['teacher']}`" in card.text
    assert RecoverReport.model_validate(report).provenance.versions["peft"]
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.num_hidden_layers == 4
    assert not any("lora" in name for name, _ in model.named_parameters())
    ids = tokenizer("what is", return_tensors="pt")
    assert model.generate(**ids, max_new_tokens=3, do_sample=False).shape[1] == ids["input_ids"].shape[1] + 3


def test_generation_resume_skips_done_prompts(tiny_llama, prompts_file, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    prompts = selfgen.load_prompts(PromptSource(source=str(prompts_file)), None)
    settings = GenerationSection(max_new_tokens=3, batch_size=4)
    path = tmp_path / "responses.jsonl"
    first = selfgen.generate_responses(model, tokenizer, prompts[:5], settings, path)
    path.write_text(path.read_text() + '{"id": "torn')  # an interrupted write
    second = selfgen.generate_responses(model, tokenizer, prompts, settings, path)
    assert first["generated"] == 5 and second["resumed_from"] == 5 and second["generated"] == 7
    rows = selfgen.responses_for(prompts, path)
    assert [r["id"] for r in rows] == [p.id for p in prompts]
    assert selfgen.generate_responses(model, tokenizer, prompts, settings, path)["generated"] == 0


def test_cli_resumes_an_interrupted_generation(pruned, prompts_file, tmp_path, capsys):
    out = tmp_path / "rec"
    prompts = selfgen.load_prompts(PromptSource(source=str(prompts_file), samples=8), None)
    work = tmp_path / "rec.work"
    work.mkdir()
    done = [
        {"id": p.id, "prompt": p.text, "answer": p.answer, "response": f"FAKE {i}", "tokens": 2, "truncated": False}
        for i, p in enumerate(prompts[:3])
    ]
    (work / "responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in done))
    assert recover_cli("--model", str(pruned), "--prompts", str(prompts_file), "-o", str(out)) == 0
    report = json.loads((out / "recover_report.json").read_text())
    assert report["data"]["generation"]["resumed_from"] == 3 and report["data"]["generation"]["generated"] == 5
    assert (out / "data" / "responses.jsonl").read_text().count("FAKE") == 3


def _rows(n: int = 8) -> list[dict]:
    return [{"prompt": f"what is {i} + 1?", "response": f"The answer is {i + 1}.", "tokens": 5} for i in range(n)]


def _trainer(model_dir: Path, tmp_path: Path, method: str, teacher: Path | None = None, **train_fields):
    recipe = RecoverRecipe.model_validate(
        {
            "method": method,
            "lora": {"r": 4},
            "generate": {"max_new_tokens": 16},
            "train": {
                "max_steps": 2,
                "batch_size": 4,
                "grad_accum": 1,
                "warmup_steps": 0,
                "learning_rate": 1e-2,
                "gradient_checkpointing": False,
                "max_length": 64,
                **train_fields,
            },
        }
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = train.sft_config(recipe, tmp_path / "trainer", torch.device("cpu"), "adamw_torch", 0, has_eval=False)
    teacher_model = AutoModelForCausalLM.from_pretrained(teacher or model_dir).eval() if method == "kd" else None
    dataset = train.to_dataset(_rows(), recipe.generate, tokenizer, 64)
    return train.make_trainer(recipe, model, tokenizer, args, dataset, None, teacher_model)


def test_lora_leaves_base_weights_unchanged_and_changes_the_adapter(tiny_llama, tmp_path):
    trainer = _trainer(tiny_llama, tmp_path, "lora")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    lora = [n for n in before if "lora_" in n]
    assert lora and all(not before[n].equal(after[n]) for n in lora if "lora_B" in n)
    assert all(before[n].equal(after[n]) for n in before if "lora_" not in n)


def test_full_sft_changes_the_weights(tiny_llama, tmp_path):
    trainer = _trainer(tiny_llama, tmp_path, "full")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if not before[n].equal(p)]
    assert len(changed) > 0.9 * len(before)


def _kl_to_teacher(trainer) -> float:
    """Forward KL(teacher || student) per token over the training rows, as the student stands now."""
    texts = [row["prompt"] + " " + row["response"] for row in _rows()]
    batch = trainer.processing_class(texts, return_tensors="pt", padding=True)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    mask = batch["attention_mask"].bool()
    trainer.model.eval()
    with torch.no_grad():
        student = trainer.model(**inputs).logits[mask]
        teacher = trainer.teacher(**inputs).logits[mask]
    return float(train.forward_kl(student, teacher))


def test_kd_trains_the_adapter_towards_the_teacher(tiny_llama, tmp_path):
    from tiny import make_tiny_model

    other = make_tiny_model(tmp_path / "teacher", "llama", 6, seed=1)  # same tokenizer, other weights
    trainer = _trainer(tiny_llama, tmp_path, "kd", teacher=other, max_steps=4, learning_rate=3e-2)
    before = _kl_to_teacher(trainer)
    lora_b = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    after = _kl_to_teacher(trainer)
    assert before > 1e-3 and after < 0.85 * before  # the student moved towards a teacher it did not equal (0.71x)
    moved = [float((p.detach() - lora_b[n]).abs().max()) for n, p in trainer.model.named_parameters() if n in lora_b]
    assert moved and min(moved) > 1e-4  # the KL's gradient reached every adapter


def test_forward_kl_is_zero_for_equal_distributions_and_positive_otherwise():
    logits = torch.randn(5, 11)
    assert train.forward_kl(logits, logits).abs() < 1e-6
    assert train.forward_kl(logits, logits.flip(-1)) > 0.01


def test_nan_loss_stops_with_one_line_and_keeps_weights(tiny_llama, tmp_path):
    trainer = _trainer(tiny_llama, tmp_path, "lora")
    with torch.no_grad():
        next(p for n, p in trainer.model.named_parameters() if "embed" in n).fill_(float("nan"))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(train.NonFiniteLossError, match="loss became nan at step 0; stopped .no checkpoint"):
        trainer.train()
    after = dict(trainer.model.named_parameters())
    # no optimizer step reached the weights: the adapters and every other weight are bit for bit as before, finite
    assert all(torch.equal(before[n], after[n].detach()) for n in before if "embed" not in n)
    assert all(after[n].detach().isfinite().all() for n in before if "embed" not in n)
    assert not (tmp_path / "trainer").exists() or not list((tmp_path / "trainer").glob("checkpoint-*"))


def test_lora_config_maps_the_flat_section():
    config = train.lora_config(
        RecoverRecipe.model_validate({"lora": {"r": 8, "alpha": 4, "target_modules": "q_proj,v_proj"}}).lora
    )
    assert (config.r, config.lora_alpha, config.lora_dropout, set(config.target_modules)) == (
        8,
        4,
        0.05,
        {"q_proj", "v_proj"},
    )
    assert RecoverRecipe().lora.target_modules == "all-linear"


def test_final_number_and_correctness_filter():
    assert selfgen.is_correct("so 1,234.0 apples", "1234") and not selfgen.is_correct("none", "7")
    assert selfgen.is_correct("... 3 + 4 = 7 so the answer is 7.", "7") and not selfgen.is_correct("8", "7")
    rows = [
        {"response": "it is 7", "answer": "7", "tokens": 3},
        {"response": "it is 9", "answer": "7", "tokens": 3},
        {"response": "7 " * 40, "answer": "7", "tokens": 40},
    ]
    kept, card = selfgen.filter_responses(rows, GenerationSection(filter="correct", max_response_tokens=10))
    assert len(kept) == 1 and card == {"responses": 3, "empty": 0, "truncated": 0, "too_long": 1, "wrong": 1, "kept": 1}


def test_precedence_defaults_recipe_cli(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: r\ntrain:\n  bf16: true\n  epochs: 3\nlora:\n  r: 32\n  alpha: 8\n")
    parse = build_parser().parse_args
    from_recipe = build_recipe(parse(["recover", "--recipe", str(path)]))
    assert (from_recipe.train.epochs, from_recipe.lora.r, from_recipe.lora.alpha, from_recipe.lora.dropout) == (
        3,
        32,
        8,
        0.05,
    )
    cli = build_recipe(parse(["recover", "--recipe", str(path), "--no-train-bf16", "--lora-r", "4", "--samples", "9"]))
    assert (cli.train.bf16, cli.lora.r, cli.lora.alpha, cli.prompts.samples, cli.train.epochs) == (False, 4, 8, 9, 3)
    assert build_recipe(parse(["recover"])).train.bf16 is True


def test_cli_resume_continues_from_the_last_checkpoint(pruned, prompts_file, tmp_path, monkeypatch, caplog):
    out = tmp_path / "rec"
    args = [*io_args(pruned, prompts_file, out), "--train-save-steps", "1", "--train-grad-accum", "1"]
    # one training_step per optimizer step

    def crash(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "save_outputs", crash)
    assert recover_cli(*args) == 130 and not out.exists()
    assert (tmp_path / "rec.work" / "trainer" / "checkpoint-2").is_dir()
    monkeypatch.undo()
    caplog.set_level("INFO")
    steps = []
    step = Trainer.training_step
    monkeypatch.setattr(Trainer, "training_step", lambda self, *a, **k: steps.append(1) or step(self, *a, **k))
    assert main(["recover", *args, *FAST[:-1], "--max-steps", "3", "--resume"]) == 0
    assert "resuming from" in caplog.text
    report = json.loads((out / "recover_report.json").read_text())
    assert report["data"]["generation"]["generated"] == 0 and report["data"]["steps"] == 3
    assert len(steps) == 1 and report["data"]["resumed_from_step"] == 2  # step 3 only; without resume all three


def test_checkpoints_made_under_another_seed_are_not_resumed(tmp_path, caplog):
    """A replicate's interrupted run is continued under its own seed only (a study re-run with another --seed, or
    another replicate in the same folder, starts over)."""
    from layerprune.recover import train

    trainer = tmp_path / "work" / "trainer"
    (trainer / "checkpoint-2").mkdir(parents=True)
    (trainer / "checkpoint-2" / "trainer_state.json").write_text("{}")
    assert train.prepare_trainer_dir(trainer, True, {"seed": 1}) == trainer / "checkpoint-2"  # no record: resumed
    assert train.prepare_trainer_dir(trainer, True, {"seed": 1}) == trainer / "checkpoint-2"  # its own seed
    with caplog.at_level("WARNING", logger="layerprune"):
        assert train.prepare_trainer_dir(trainer, True, {"seed": 2}) is None
    assert "trained under another seed" in caplog.text and not trainer.exists()
    assert json.loads((tmp_path / "work" / train.TRAINING_RECORD).read_text()) == {"seed": 2}


def test_dry_run_prints_a_memory_plan(pruned, capsys):
    assert main(["recover", "--model", str(pruned), "--dry-run", "--method", "full", "--memory-budget", "0.001"]) == 0
    out = capsys.readouterr().out
    assert "memory plan" in out and "switched to" in out and "does NOT fit" in out


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "case",
    ["recipe", "bad_field", "not_model", "no_teacher", "qlora", "empty_prompts", "all_filtered", "exists", "vllm",
     "hub_offline", "bad_hub", "bad_hub_config", "no_field"],
)
def test_bad_input_gives_one_line_and_nonzero_exit(case, pruned, tiny_llama, prompts_file, tmp_path, capsys):
    out = tmp_path / "out"
    base = ["--model", str(pruned), "--prompts", str(prompts_file), "-o", str(out)]
    args, expect = {
        "recipe": (["--recipe", "demoo", *base], "unknown recipe 'demoo'"),
        "bad_field": (
            ["--recipe", str(_write(tmp_path / "b.yaml", "lora:\n  rank: 3\n")), *base],
            "unknown key 'lora.rank'",
        ),
        "not_model": (
            ["--model", str(tmp_path), "--prompts", str(prompts_file), "-o", str(out)],
            "not a model directory",
        ),
        "no_teacher": (
            ["--model", str(tiny_llama), "--prompts", str(prompts_file), "-o", str(out)],
            "no teacher known",
        ),
        "qlora": ([*base, "--method", "qlora"], "needs a CUDA GPU"),
        "empty_prompts": (io_args(pruned, _write(tmp_path / "e.jsonl", '{"prompt": " "}\n'), out), "is empty"),
        "all_filtered": ([*base, "--filter", "correct"], "every response was filtered away"),
        "exists": ([*base[:-1], str(tmp_path)], "already exists; pass --overwrite"),
        "vllm": ([*base, "--backend", "vllm"], "needs vLLM"),
        "hub_offline": (io_args(pruned, "hf:tatsu-lab/alpaca", out),  # tests run with HF_HUB_OFFLINE=1
                        "tatsu-lab/alpaca/train is a hub dataset, not in the datasets cache, and the hub is offline: "
                        "save the split as a .jsonl"),
        "bad_hub": (io_args(pruned, "hf:alpaca", out), "'hf:alpaca' is not a hub dataset: write hf:OWNER/NAME"),
        "bad_hub_config": (io_args(pruned, "hf:a/b:c:d", out), "'hf:a/b:c:d' is not a hub dataset"),
        "no_field": (io_args(pruned, _write(tmp_path / "t.jsonl", '{"text": "hi"}\n'), out),
                     "has no 'prompt' field (prompts.field); its fields: text"),
    }[case]
    code = recover_cli(*args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and expect in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.gpu
def test_qlora_on_cuda_trains_and_merges_into_a_bf16_model(pruned, prompts_file, tmp_path):
    out = tmp_path / "q"
    fast = [a if a != "cpu" else "cuda" for a in FAST]
    assert main(["recover", *io_args(pruned, prompts_file, out), "--method", "qlora", *fast]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 4 and not getattr(model.config, "quantization_config", None)


def test_cached_responses_from_other_sampling_settings_are_refused(pruned, prompts_file, tmp_path, capsys):
    work = tmp_path / "out.work"
    work.mkdir()
    (work / "generation.json").write_text(json.dumps({"teacher": "x", "temperature": 0.1}))
    assert recover_cli("--model", str(pruned), "--prompts", str(prompts_file), "-o", str(tmp_path / "out")) == 2
    assert (
        "holds responses generated with other settings (backend, max_new_tokens, system_prompt, teacher, temp"
        in capsys.readouterr().err
    )


def test_the_held_out_loss_after_training_reuses_the_trainers_evaluation_at_the_last_step(
        pruned, prompts_file, tmp_path, monkeypatch):
    """eval_steps falls on the last step: the trainer evaluated the trained weights there, so the loss after training
    is that number, not a second evaluation of the same weights (steps 0, 1, 2: three evaluations, not four)."""
    calls = []
    evaluate = Trainer.evaluate

    def counted(self, *args, **kwargs):
        calls.append(self.state.global_step)
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "evaluate", counted)
    out = tmp_path / "rec"
    assert recover_cli(*io_args(pruned, prompts_file, out), "--train-eval-steps", "1") == 0
    report = json.loads((out / "recover_report.json").read_text())
    assert calls == [0, 1, 2]
    step, loss = report["loss_curve"]["held_out"][-1]  # the merged model's CE, measured apart, agrees with it
    assert step == 2 and loss == pytest.approx(report["held_out_loss"]["after"], abs=1e-4)
