"""`layerprune variant` / make_variant: post-training on tiny random models (seconds each)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import assert_one_line_error, run_cli, write_rows
from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.models.lineage import VARIANT_REPORT
from layerprune.posttrain import VariantRecipe, make_variant
from layerprune.posttrain import methods as variant_methods
from layerprune.posttrain.items import Item, gsm8k_items, load_items
from layerprune.posttrain.methods import METHODS, Job
from layerprune.posttrain.schema import KINDS, DataSection
from layerprune.posttrain.train import Row, TrainResult, plain_ids
from layerprune.tasks import probes

FAST = {"batch_size": 4, "grad_accum": 1, "max_steps": 2, "learning_rate": 1e-3, "logging_steps": 1}


def recipe_of(model: Path, **fields: object) -> VariantRecipe:
    base = {"kind": "sft", "model": str(model), "data": {"probes": {"arith_2d_add": 8}}, "train": FAST}
    return VariantRecipe.model_validate({**base, **fields})


@pytest.fixture
def settings(tmp_path) -> RunSettings:
    return RunSettings(device="cpu", cache_dir=tmp_path / "cache")


def completion_loss(folder: Path, rows: list[Row]) -> float:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    total, count = 0.0, 0
    for row in rows:
        ids, start = plain_ids(tokenizer, row, 512)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, start - 1:-1]
        total += torch.nn.functional.cross_entropy(logits, torch.tensor(ids[start:]), reduction="sum").item()
        count += len(ids) - start
    return total / count


def test_every_kind_of_the_schema_is_registered():
    assert sorted(KINDS) == METHODS.names()


def test_sft_lowers_the_loss_on_its_data_and_writes_a_checkpoint_that_says_how_it_was_made(tiny_llama, settings,
                                                                                           tmp_path):
    recipe = recipe_of(tiny_llama, train={**FAST, "max_steps": 6, "learning_rate": 5e-3})
    rows = [Row(item, item.answer) for item in load_items(recipe.data, None)[0]]
    out = make_variant(recipe, settings, tmp_path / "variant")
    assert completion_loss(out, rows) < completion_loss(tiny_llama, rows) - 0.3
    report = json.loads((out / VARIANT_REPORT).read_text())
    assert report["kind"] == "sft" and report["train"]["steps"] == 6 and report["train"]["sequences"] == 24
    assert report["data"]["per_source"] == {"arith_2d_add": 8} and report["data"]["scored_items_trained"] == 0
    assert report["train"]["target_tokens"] > 0 and report["provenance"]["layerprune"]
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= {p.name for p in out.iterdir()}
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers") and f"source: {tiny_llama}" in card  # no hub id
    assert "evaluation items trained on: 0" in card
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_no_scored_item_is_trained_on_even_where_the_calibration_stream_asks_another_seeds_items():
    seed1 = {p.question for args in probes.probe_tasks().values() if args["family"] == "arithmetic"
             for p in probes.generate_probes(args, probes.PROBE_DOCS, 1)}
    drawn = probes.generate_probes(probes.probe_tasks()["arith_2d_add"], 300, seed=0, stream="calib")
    assert any({p.question, *(q for q, _ in p.examples)} & seed1 for p in drawn)  # the collision case exists
    items, card = load_items(DataSection(probes={"arith_2d_add": 300}, exclude_probe_seeds=[0, 1]), None)
    assert len(items) == 300 and card["dropped_scored"]["arith_2d_add"] > 0 and card["scored_items_trained"] == 0
    trained = {q for item in items for role, q in item.messages if role == "user"}
    assert not trained & seed1


def test_gsm8k_items_are_train_gold_solutions_without_test_questions(data_dir):
    rows = [{"question": f"What is {n} + 1?", "answer": f"{n} + 1 = {n + 1}\n#### {n + 1}"} for n in range(4)]
    write_rows(data_dir, "gsm8k", "train", rows)
    write_rows(data_dir, "gsm8k", "test", rows[:1])
    items, dropped = gsm8k_items(10, DataSection(gsm8k=10), data_dir)
    assert dropped == 1 and len(items) == 3
    assert all(i.prompt.startswith("Question: ") and i.prompt.endswith("\nAnswer:") for i in items)
    assert all(i.grade(i.answer) and not i.grade(" #### 0") for i in items)


def test_rft_keeps_only_the_graded_right_samples(monkeypatch, tmp_path):
    items = [Item("arith_2d_add", "1 + 1 =", " 2", "2", "exact", "\n"), Item("arith_2d_add", "2 + 2 =", " 4", "4",
                                                                            "exact", "\n")]
    samples = [[" 2", " 3", " 2 ", " 22"], [" 5", " 4", " 4", "4\nmore"]]
    monkeypatch.setattr(variant_methods, "sample_answers", lambda *a, **k: samples)
    trained: list[Row] = []
    monkeypatch.setattr(variant_methods, "run_sft",
                        lambda model, tok, rows, *a: (trained.extend(rows), (model, TrainResult(1, 1, 1, 1, None,
                                                                                                 None)))[1])
    job = Job(None, None, items, VariantRecipe(kind="rft"), tmp_path)
    METHODS.get("rft")(job)
    assert [(r.item.gold, r.completion) for r in trained] == [("2", " 2"), ("2", " 2 "), ("4", " 4"), ("4", "4\nmore")]
    assert job.card == {"sampled": 8, "kept_right": 4, "problems_solved": 2}


def test_rft_end_to_end_samples_grades_and_trains_on_the_right_ones(tiny_llama, settings, tmp_path):
    """make_variant(kind rft) on a real model, nothing stubbed: a tiny model first taught four problems by SFT samples
    its own answers, the exact grader keeps the right ones and the variant trains on those alone."""
    data = {"probes": {"arith_2d_add": 4}}
    taught = make_variant(recipe_of(tiny_llama, data=data, train={**FAST, "max_steps": 40, "learning_rate": 1e-2}),
                          settings, tmp_path / "taught")
    recipe = recipe_of(taught, kind="rft", data=data, sample={"k": 6, "temperature": 1.0, "max_new_tokens": 4},
                       train={**FAST, "max_steps": 2})
    out = make_variant(recipe, settings, tmp_path / "rft")
    report = json.loads((out / VARIANT_REPORT).read_text())
    kept = report["data"]["kept_right"]
    assert report["kind"] == "rft" and report["data"]["sampled"] == 24 and 0 < kept < 24  # some, not all, kept
    assert 1 <= report["data"]["problems_solved"] <= 4 and report["data"]["scored_items_trained"] == 0
    assert report["train"]["steps"] == 2 and report["train"]["target_tokens"] > 0
    assert f"{kept} distinct right answers kept" in (out / "README.md").read_text()


def test_rft_with_no_right_sample_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(variant_methods, "sample_answers", lambda *a, **k: [[" 9"]])
    job = Job(None, None, [Item("arith_2d_add", "1 + 1 =", " 2", "2", "exact", "\n")], VariantRecipe(kind="rft"),
              tmp_path)
    with pytest.raises(LayerpruneError, match="none of the 1 samples is right"):
        METHODS.get("rft")(job)


def test_the_cache_is_keyed_by_the_recipe(tiny_llama, settings, monkeypatch):
    recipe = recipe_of(tiny_llama, train={**FAST, "max_steps": 1})
    first = make_variant(recipe, settings)
    assert first.parent == settings.resolved_cache_dir() / "variants"

    def refuse(job: Job) -> None:
        raise AssertionError("trained again")

    monkeypatch.setitem(METHODS._items, "sft", refuse)
    assert make_variant(recipe, settings) == first  # cached: no training
    recomputing = recipe_of(tiny_llama, train={**FAST, "max_steps": 1, "gradient_checkpointing": True})
    assert make_variant(recomputing, settings) == first  # the same weights: recomputation is not in the key
    changed = recipe_of(tiny_llama, train={**FAST, "max_steps": 1, "learning_rate": 2e-3})
    with pytest.raises(AssertionError, match="trained again"):
        make_variant(changed, settings)
    assert not (settings.resolved_cache_dir() / "variants" / "x").exists()
    assert [p.name for p in (settings.resolved_cache_dir() / "variants").iterdir()] == [first.name]  # nothing half
    monkeypatch.undo()
    second = make_variant(changed, settings)
    assert second != first and second.parent == first.parent


def test_an_output_holding_something_else_is_refused(tiny_llama, settings, tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(LayerpruneError, match="is not this recipe's variant"):
        make_variant(recipe_of(tiny_llama), settings, tmp_path / "taken")


def test_distill_trains_on_the_teachers_greedy_answers(tiny_models, settings, tmp_path):
    teacher = tiny_models("llama", 2)
    recipe = recipe_of(tiny_models("llama", 6), kind="distill", teacher=str(teacher),
                       sample={"max_new_tokens": 4, "temperature": 0.0}, train={**FAST, "max_steps": 1})
    report = json.loads((make_variant(recipe, settings, tmp_path / "d") / VARIANT_REPORT).read_text())
    assert report["teacher"] == str(teacher) and report["data"]["teacher_answers"] == 8
    assert report["train"]["steps"] == 1
    card = (tmp_path / "d" / "README.md").read_text()
    assert f"- trained on the teacher's greedy answers: 8, {report['data']['teacher_right']} graded right" in card


def test_the_card_says_what_rft_and_grpo_trained_on():
    """An rft card names the samples and the right ones it trained on (it said only '2700 problems'), a grpo card
    its completions and reward."""
    from layerprune.posttrain.api import model_card

    base = {"kind": "rft", "source_model": "embedded", "format": "plain", "teacher": None, "seconds": 1.0,
            "fingerprint": "0" * 64, "provenance": {"layerprune": "0"},
            "recipe": VariantRecipe(kind="rft", sample={"k": 8, "temperature": 0.8}).model_dump(mode="json"),
            "data": {"items": 2700, "per_source": {"arith_2d_add": 2700}, "calibration_seed": 1,
                     "scored_items_trained": 0, "exclude_probe_seeds": [0], "dropped_scored": {},
                     "sampled": 21600, "kept_right": 587, "problems_solved": 575},
            "train": {"method": "full", "steps": 37, "sequences": 587, "tokens": 1, "target_tokens": 1,
                      "loss_first": 0.55079, "loss_last": 0.35014}}
    card = model_card(base)
    assert ("- trained on its own right answers: 21600 samples (8 a problem at temperature 0.8), 587 distinct right "
            "answers kept (2.7% of the samples; 575 problems solved at least once), SFT on those") in card
    assert "loss 0.5508 -> 0.3501" in card
    grpo = {**base, "kind": "grpo", "recipe": VariantRecipe(kind="grpo").model_dump(mode="json"),
            "data": {**base["data"], "reward_first": 0.0625, "reward_last": 0.18125}}
    assert "mean reward of a logging window 0.0625 (first) -> 0.1812 (last)" in model_card(grpo)


def test_grpo_reward_is_the_graders_verdict():
    from layerprune.posttrain.rl import exact_reward

    assert exact_reward([" 12\nmore", "12", " 13", "#### 7", "the answer is 7"], ["12", "12", "12", "7", "8"],
                        ["exact", "exact", "exact", "number", "number"]) == [1.0, 1.0, 0.0, 1.0, 0.0]
    chat = [[{"role": "assistant", "content": "12"}]]
    assert exact_reward(chat, ["12"], ["exact"]) == [1.0]


def write_recipe(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_cli_dry_run_prints_the_plan(capsys, tiny_llama, tmp_path):
    recipe = write_recipe(tmp_path / "v.yaml", {"kind": "variant", "method": "sft", "model": str(tiny_llama),
                                                "data": {"probes": {"arith_2d_add": 20, "brackets_mix": 12}},
                                                "train": {"batch_size": 4, "grad_accum": 2}})
    code, out, _ = run_cli(capsys, ["variant", str(recipe), "--dry-run", "--epochs", "2"])
    assert code == 0 and "32 problems: arith_2d_add 20, brackets_mix 12" in out
    assert "steps 8 x 8 sequences = 64 sequences" in out and "min" in out
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(("fields", "needle"), [({"trian": {}}, "unknown key 'trian'"),
                                                 ({"method": "sfft"}, "did you mean: sft"),
                                                 ({"kind": "rft"}, "is a rft recipe (its `kind:`), not a variant"),
                                                 ({"method": "distill"}, "needs a teacher"),
                                                 ({"data": {"probes": {"arith_2d_ad": 3}}}, "arith_2d_add")])
def test_cli_bad_recipe_is_one_line(capsys, tmp_path, fields, needle):
    recipe = write_recipe(tmp_path / "bad.yaml", {"kind": "variant", "method": "sft", **fields})
    code, out, err = run_cli(capsys, ["variant", str(recipe), "--dry-run"])
    assert_one_line_error(code, err, needle)


def test_grpo_moves_the_policy_toward_the_rewarded_answer(tiny_models, tmp_path):
    """A toy task: after '1 + 1 =' the head is set so that '7' and '9' share nearly all the probability; the grader
    rewards '7' only; four GRPO steps raise its probability."""
    folder = tiny_models("llama", 2)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    right, wrong = tokenizer.convert_tokens_to_ids("7"), tokenizer.convert_tokens_to_ids("9")
    ids = tokenizer("1 + 1 =", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        last = model(ids, output_hidden_states=True).hidden_states[-1][0, -1]
        model.lm_head.weight.zero_()
        model.lm_head.weight[right] = model.lm_head.weight[wrong] = 8 * last / last.dot(last)

    def p_right(m: torch.nn.Module) -> float:
        with torch.no_grad():
            return torch.softmax(m(ids).logits[0, -1], -1)[right].item()

    before = p_right(model)
    recipe = VariantRecipe(kind="grpo", sample={"k": 4, "max_new_tokens": 1, "temperature": 1.0},
                           train={**FAST, "max_steps": 4, "learning_rate": 2e-2})
    job = Job(model, tokenizer, [Item("arith_2d_add", "1 + 1 =", " 7", "7", "exact", "\n")] * 4, recipe,
              tmp_path / "work")
    trained, result = METHODS.get("grpo")(job)
    assert result.steps == 4 and job.card["reward_last"] > job.card["reward_first"]
    assert 0.4 < before < 0.5 and p_right(trained) > before + 0.15


def test_lora_in_the_chat_format_writes_a_merged_checkpoint(tiny_llama, settings, tmp_path):
    recipe = recipe_of(tiny_llama, format="chat", train={**FAST, "method": "lora", "max_steps": 1})
    out = make_variant(recipe, settings, tmp_path / "lora")
    assert not list(out.glob("adapter_*")) and (out / "model.safetensors").is_file()
    merged = AutoModelForCausalLM.from_pretrained(out).state_dict()
    source = AutoModelForCausalLM.from_pretrained(tiny_llama).state_dict()
    assert merged.keys() == source.keys()
    assert any(not torch.equal(merged[k], source[k]) for k in source)


def test_sampled_answers_are_k_per_problem_cut_before_the_stop(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    items = load_items(DataSection(probes={"arith_2d_add": 2, "brackets_mix": 1}), None)[0]
    answers = variant_methods.sample_answers(model, tokenizer, items, "plain", 3, 1.0, 1.0, 6, 4, seed=0)
    assert [len(a) for a in answers] == [3, 3, 3] and not any("\n" in t for a in answers for t in a)
    assert len({t for a in answers for t in a}) > 1


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_trainer_recomputes_activations_only_when_the_recipe_asks(tmp_path, checkpointing):
    """TRL's SFTConfig and GRPOConfig turn gradient checkpointing on unless told: a third more compute on the CPU
    variants, whose sequences are short. The recipe's field decides."""
    import torch
    from trl import GRPOConfig, SFTConfig

    from layerprune.posttrain.schema import TrainSection
    from layerprune.posttrain.train import common_arguments

    args = common_arguments(TrainSection(gradient_checkpointing=checkpointing), tmp_path, torch.device("cpu"), 0)
    for config in (SFTConfig(**args), GRPOConfig(**args, num_generations=2)):
        assert config.gradient_checkpointing is checkpointing


def test_training_prints_one_line_per_logged_step(caplog):
    from types import SimpleNamespace

    from layerprune.models.train_log import LossLogCallback

    state = SimpleNamespace(global_step=10, max_steps=175)
    with caplog.at_level("INFO", logger="layerprune"):
        LossLogCallback().on_log(None, state, None, logs={"loss": 0.5, "learning_rate": 1e-4, "reward": 0.25})
        LossLogCallback().on_log(None, state, None, logs={"eval_loss": 0.75})
    assert "step 10/175  loss 0.5000  lr 1.00e-04  reward 0.250" in caplog.text
    assert "step 10/175  held-out loss 0.7500" in caplog.text


def test_a_variant_spec_names_the_seed_0_variant_and_warns_of_one_made_under_another_seed(tiny_llama, settings,
                                                                                          tmp_path, caplog):
    from layerprune.core.recipe_loading import build_from_recipe
    from layerprune.models.loading import resolve_model

    path = write_recipe(tmp_path / "v.yaml", {"kind": "variant", "method": "sft", "model": str(tiny_llama),
                                              "name": "tiny-seeds", "data": {"probes": {"arith_2d_add": 8}},
                                              "train": FAST})
    seed3 = settings.model_copy(update={"seed": 3})
    made_3 = make_variant(build_from_recipe(VariantRecipe, "variant", str(path), {}), seed3)  # variant --seed 3
    with caplog.at_level("WARNING", logger="layerprune"):
        named = Path(resolve_model(f"variant:{path}", seed3).location)
    assert named != made_3 and json.loads((named / VARIANT_REPORT).read_text())["settings"]["seed"] == 0
    assert f"{made_3} holds this recipe's variant made under another seed" in caplog.text


def test_a_variant_spec_is_made_once_and_found_again_wherever_a_model_is_accepted(tiny_llama, settings, tmp_path,
                                                                                   monkeypatch, capsys):
    from layerprune.models.loading import planning, resolve_model

    recipe = write_recipe(tmp_path / "v.yaml", {"kind": "variant", "method": "sft", "model": str(tiny_llama),
                                                "name": "tiny-math", "data": {"probes": {"arith_2d_add": 8}},
                                                "train": FAST})
    spec = f"variant:{recipe}"
    with planning():  # a dry run: nothing made, planned on the source
        planned = resolve_model(spec, settings)
    assert planned.location == str(tiny_llama) and planned.identity["variant_made"] is False
    assert not (settings.resolved_cache_dir() / "variants").exists()
    made = resolve_model(spec, settings)
    folder = Path(made.location)
    assert folder.parent == settings.resolved_cache_dir() / "variants" and folder.name.startswith("tiny-math-")
    assert made.kind == "local" and made.identity["fingerprint"] == json.loads((folder / VARIANT_REPORT).read_text())[
        "fingerprint"]

    def refuse(job: Job) -> None:
        raise AssertionError("trained again")

    monkeypatch.setitem(METHODS._items, "sft", refuse)
    assert resolve_model(spec, settings).location == made.location  # cached: found by its fingerprint
    replicate = settings.model_copy(update={"seed": settings.seed + 1})  # a study's replicate r = 1
    assert resolve_model(spec, replicate).location == made.location  # the same model, not one made with seed 1
    code, _, err = run_cli(capsys, ["analyze", "importance", "--models", spec, "--dry-run",
                                    "--cache-dir", str(settings.resolved_cache_dir())])
    assert code == 0, err  # a command takes it where it takes a model


def test_rft_dry_run_estimates_its_sampling_at_the_measured_rates(capsys, tiny_llama, tmp_path):
    """rft's sampling (k answers to every problem) is most of its time on a CPU: the dry run counts every prompt
    prefilled k times and every answer decoded to max_new_tokens, at the measured rates."""
    from layerprune.posttrain.api import DECODE_S_PER_ROW_TOKEN, PREFILL_TOKENS_PER_S
    from layerprune.posttrain.items import load_items
    from layerprune.posttrain.schema import VariantRecipe

    fields = {"method": "rft", "model": str(tiny_llama), "format": "plain", "data": {"probes": {"arith_2d_add": 20}},
              "sample": {"k": 4, "max_new_tokens": 6}}
    recipe = write_recipe(tmp_path / "r.yaml", {"kind": "variant", **fields})
    code, out, _ = run_cli(capsys, ["variant", str(recipe), "--dry-run"])
    items, _ = load_items(VariantRecipe.model_validate(fields).data, None)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokens = 4 * sum(len(tokenizer(item.prompt)["input_ids"]) for item in items)
    minutes = (tokens / PREFILL_TOKENS_PER_S + 20 * 4 * 6 * DECODE_S_PER_ROW_TOKEN) / 60
    assert code == 0 and len(items) == 20
    assert f"plus sampling: 20 problems x 4 answers of up to 6 tokens ({tokens} prompt tokens prefilled): " \
           f"~{minutes:.0f} min for SmolLM2-135M on 2 idle CPU cores" in out
