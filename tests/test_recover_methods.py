"""recover's distillation family on tiny random models: opd, kd (GKD and the corrected hand-written loss), replace,
task-aligned probe prompts and the exclusion of evaluation items."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import pruned_copy
from layerprune.cli import main
from layerprune.models import drop_blocks
from layerprune.recover import heldout, kd, prompts, replace, train
from layerprune.recover.methods import METHODS
from layerprune.recover.schema import GenerationSection, KdSection, PromptSource, RecoverRecipe

FAST = ["--max-new-tokens", "6", "--no-generate-drop-truncated", "--samples", "8", "--train-max-length", "64",
        "--train-batch-size", "2", "--train-grad-accum", "2", "--max-steps", "2", "--held-out", "0.25",
        "--train-warmup-steps", "0", "--no-train-gradient-checkpointing", "--learning-rate", "1e-2", "--lora-r", "4",
        "--opd-max-new-tokens", "6", "--train-eval-steps", "1", "--device", "cpu", "-q"]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [{"prompt": f"what is {i} + 7?", "answer": str(i + 7)} for i in range(12)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def pruned(tiny_models, tmp_path_factory) -> Path:
    """A tiny model minus blocks 2, 3 and 5 (two runs), with a prune_report.json naming its teacher and the drops."""
    return pruned_copy(tiny_models("llama", 6), tmp_path_factory.mktemp("pruned") / "p3", [2, 3, 5])


def run_recover(pruned: Path, prompts_file: Path, out: Path, *extra: str) -> dict:
    assert main(["recover", "--model", str(pruned), "--prompts", str(prompts_file), "-o", str(out), *FAST, *extra]) == 0
    return json.loads((out / "recover_report.json").read_text())


def test_opd_trains_on_policy_with_trl_distillation_trainer(pruned, prompts_file, tmp_path):
    report = run_recover(pruned, prompts_file, tmp_path / "opd", "--method", "opd", "--opd-beta", "1")
    data = report["data"]
    assert data["trainer"] == "DistillationTrainer" and data["steps"] == 2
    # prompts only: the teacher answered just the held-out prompts (for the common held-out yardstick)
    assert data["generation"]["prompts"] == data["held_out_examples"] == 2 and data["train_prompts"] == 6
    assert report["tokens_seen"] > 0 and report["curve" if "curve" in report else "loss_curve"]["held_out_kl"]
    metrics = data["held_out_metrics"]
    assert metrics["pruned"]["kl"] > 0 and metrics["after"]["kl"] < metrics["pruned"]["kl"] / 1.5  # 8.5e-5 -> 3.1e-5
    assert (tmp_path / "opd" / "adapter" / "adapter_config.json").is_file()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "opd").config.num_hidden_layers == 3


def test_opd_with_lmbda_below_one_uses_gkd_and_full_weights(pruned, prompts_file, tmp_path):
    report = run_recover(pruned, prompts_file, tmp_path / "mix", "--method", "opd", "--opd-lmbda", "0.5",
                         "--opd-adapter", "full")
    assert report["data"]["trainer"] == "GKDTrainer" and not (tmp_path / "mix" / "adapter").exists()
    before = AutoModelForCausalLM.from_pretrained(pruned).state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "mix").state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_kd_uses_gkd_where_it_agrees_and_logs_train_kl_and_held_out_ce_kl(pruned, prompts_file, tmp_path):
    report = run_recover(pruned, prompts_file, tmp_path / "kd", "--method", "kd")
    curve = report["loss_curve"]
    assert report["data"]["trainer"] == "GKDTrainer"
    assert curve["train"] and [p[0] for p in curve["held_out_ce"]] == [0, 1, 2] == [p[0] for p in curve["held_out_kl"]]
    soft = run_recover(pruned, prompts_file, tmp_path / "kdT", "--method", "kd", "--kd-temperature", "2")
    assert soft["data"]["trainer"] == "KDTrainer"


def _kd_batch(tiny_llama):
    from trl.experimental.utils import DataCollatorForChatML

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    rows = [{"prompt": f"what is {i} + 7?", "response": f"It is {i + 7}." * (i + 1)} for i in range(4)]
    dataset = kd.messages_dataset(rows, GenerationSection(system_prompt="Be brief."), tokenizer, 64)
    batch = DataCollatorForChatML(tokenizer=tokenizer, max_length=64)(list(dataset))
    return tokenizer, batch


def test_hand_written_kd_loss_equals_trl_gkd_with_lmbda_zero(tiny_llama, tiny_models):
    tokenizer, batch = _kd_batch(tiny_llama)
    student = AutoModelForCausalLM.from_pretrained(tiny_llama)
    drop_blocks(student, [2, 3])
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    count = int((batch["labels"][:, 1:] != -100).sum()) * 3  # as if the window held three such micro-batches
    ours = train.distillation_loss(student, teacher, batch, KdSection(), torch.tensor(count))
    with torch.no_grad():
        s_logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        t_logits = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    from trl.experimental.gkd import GKDTrainer

    theirs = GKDTrainer.generalized_jsd_loss(s_logits, t_logits, batch["labels"][:, 1:], beta=0.0,
                                             num_items_in_batch=torch.tensor(count))
    assert float(ours.detach()) > 0 and torch.allclose(ours, theirs, rtol=1e-5, atol=1e-7)


def test_kd_loss_is_normalised_by_the_window_not_the_micro_batch(tiny_llama):
    """Two micro-batches of one window sum to the loss of the window as one batch (grad_accum-invariant)."""
    tokenizer, batch = _kd_batch(tiny_llama)
    student = AutoModelForCausalLM.from_pretrained(tiny_llama)
    drop_blocks(student, [1])
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    total = (batch["labels"][:, 1:] != -100).sum()
    halves = [{k: v[i:i + 2] for k, v in batch.items() if isinstance(v, torch.Tensor)} for i in (0, 2)]
    whole = train.distillation_loss(student, teacher, batch, KdSection(), total)
    parts = sum(train.distillation_loss(student, teacher, h, KdSection(), total) for h in halves)
    assert torch.allclose(whole, parts, rtol=1e-5)


def test_dropped_runs_and_their_anchor_blocks():
    runs = replace.dropped_runs([5, 2, 3, 9], 12)
    assert [(r.first, r.last, r.anchor) for r in runs] == [(2, 3, 1), (5, 5, 2), (9, 9, 5)]
    with pytest.raises(Exception, match="block 0"):
        replace.dropped_runs([0, 1], 6)


def test_folded_map_equals_the_map_applied_to_the_anchor_mlp_output(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    drop_blocks(model, [2, 3])
    ids = torch.randint(3, 380, (2, 12), generator=torch.Generator().manual_seed(0))
    d = model.config.hidden_size
    t = torch.eye(d) + 0.1 * torch.randn(d, d, generator=torch.Generator().manual_seed(1))
    mlp = model.model.layers[1].mlp
    handle = mlp.register_forward_hook(lambda _m, _i, out: out @ t)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    handle.remove()
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    replace.fold_map(model, 1, t.double())
    with torch.no_grad():
        folded = model(input_ids=ids).logits
    assert not torch.allclose(plain, expected, atol=1e-3)
    assert torch.allclose(folded, expected, atol=1e-4)


def test_least_squares_map_beats_plain_pruning_on_calibration_tokens(tiny_llama):
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    student = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    drop_blocks(student, [2, 3])
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 380, (30,), generator=g).tolist() for _ in range(12)]
    fits = replace.replace_blocks(student, teacher, [2, 3], seqs, ridge=0.0)
    assert fits[0]["residual_fitted"] < fits[0]["residual_identity"]
    # the fold moved the pruned model's block-1 output towards the teacher's block-3 output on these tokens
    m, a = replace.capture_student(student, 1, torch.tensor([seqs[0]]))
    y = replace.capture_teacher(teacher, 3, torch.tensor([seqs[0]]))
    assert float(((a + m - y) ** 2).sum()) < fits[0]["residual_identity"] / len(seqs) * 2


def test_replace_end_to_end_lowers_held_out_kl_and_keeps_the_architecture(pruned, prompts_file, tmp_path):
    """The fold, fitted on 9 answers of 24 tokens (818 calibration tokens for d = 64; on the 6 answers of 6 tokens
    of FAST it overfits and the held-out KL rises), brings the 3 held-out answers' KL to the teacher down 4-fold."""
    report = run_recover(pruned, prompts_file, tmp_path / "rep", "--method", "replace", "--samples", "12",
                         "--max-new-tokens", "24")
    data = report["data"]
    assert [f["dropped"] for f in data["replace"]] == [[2, 3], [5, 5]] and data["steps"] == 0
    metrics = data["held_out_metrics"]
    assert metrics["replaced"] == metrics["after"] and metrics["pruned"]["tokens"] == metrics["after"]["tokens"] > 0
    assert metrics["after"]["kl"] < metrics["pruned"]["kl"] / 2  # 8.6e-5 -> 2.0e-5
    config = json.loads((tmp_path / "rep" / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["architectures"] == ["LlamaForCausalLM"]
    assert not (tmp_path / "rep" / "adapter").exists()


def test_replace_then_opd_with_a_lora_adapter_merges_into_the_folded_checkpoint(pruned, prompts_file, tmp_path):
    """The adapter trained after the fold merges into the folded weights, saved as a whole checkpoint (the study's
    replace+opd arm failed: 'replaced has no tokenizer files')."""
    report = run_recover(pruned, prompts_file, tmp_path / "chain", "--method", "replace", "--replace-then", "opd",
                         "--opd-beta", "1")
    assert report["data"]["trainer"] == "DistillationTrainer" and report["data"]["steps"] == 2
    assert (tmp_path / "chain" / "adapter" / "adapter_config.json").is_file()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "chain").config.num_hidden_layers == 3
    AutoTokenizer.from_pretrained(tmp_path / "chain")


def test_replace_refuses_a_norm_after_the_mlp(tiny_models):
    model = AutoModelForCausalLM.from_pretrained(tiny_models("gemma3_text", 6))
    with pytest.raises(Exception, match="norm follows its MLP"):
        replace.check_foldable(model)


def test_probe_prompts_never_include_evaluation_items():
    source = PromptSource(source="probes:arith_1dc+brackets_d2", samples=100)
    chosen, card = prompts.load_prompts(source, None)
    assert len(chosen) == 100 and card["excluded_probe_eval"] >= 9  # the 9 depth-2 bracket questions are all used
    assert not any("Closing" in p.text for p in chosen)  # by the evaluation
    assert not any(prompts.asks_scored_item(p.text, (0,)) for p in chosen)
    # the evaluation's own probes (seed 0, first 500) are excluded whatever the source
    from layerprune.recover.selfgen import Prompt, prompt_id

    evals = [p.prompt for p in prompts.generate_probes("arith_2d_add", 5, 0)]
    kept, card = prompts.exclude_eval_items([Prompt(prompt_id(t), t) for t in evals + ["hello"]], (0,), {"Q?"})
    assert [p.text for p in kept] == ["hello"] and card["excluded_probe_eval"] == 5


def test_probe_prompts_show_no_scored_item_even_as_a_few_shot_example_or_swapped():
    """Every question a kept probe prompt asks (its question and its few-shot examples) is none of the scored items,
    a sum's addends in either order. Before, only the question was checked: the budget study's 2048 kd-arith prompts
    held 53 of the 150 scored arith_2d_sub items, solved, in their examples, and 16 arith_2d_add items swapped."""
    source = PromptSource(source="probes:arith_2d_sub+arith_2d_add", samples=400, exclude_probe_seeds=[0])
    chosen, card = prompts.load_prompts(source, None)
    assert len(chosen) == 400 and card["excluded_probe_eval"] > 0


    def asked(question: str) -> str:  # the test's own reading: a sum of two is its addends in order
        terms = question.rstrip(" =").split(" + ")
        return " + ".join(sorted(terms, key=int)) if len(terms) == 2 else question.rstrip(" =")

    scored = {asked(p.question) for task in ("arith_2d_sub", "arith_2d_add", "arith_2d_add_nc")
              for p in prompts.generate_probes(task, prompts.EVAL_ITEMS, 0)}
    lines = [asked(line[:line.index("=") + 1]) for p in chosen for line in p.text.splitlines() if "=" in line]
    assert len(lines) == 4 * 400 and not set(lines) & scored
    swapped = next(p.question for p in prompts.generate_probes("arith_2d_add", 50, 0)
                   if p.question.split(" + ")[0] != p.question.split(" + ")[1].rstrip(" ="))
    a, b = swapped.rstrip(" =").split(" + ")
    assert prompts.asks_scored_item(f"What is 1 + 1? 2\n{b} + {a} =", (0,))


def test_hub_dataset_prompts_come_through_datasets_minus_the_evaluation_items(monkeypatch):
    import datasets

    from layerprune.tasks.data import OFFLINE_ENVS

    for name in OFFLINE_ENVS:
        monkeypatch.delenv(name, raising=False)
    leaked = prompts.generate_probes("arith_2d_add", 1, 0)[0].prompt  # an evaluation item inside the dataset
    rows = [{"instruction": "Name a prime.", "answer": "2"}, {"instruction": leaked}, {"instruction": " "}]
    asked = []

    def load_dataset(repo, config, split):
        asked.append((repo, config, split))
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    source = PromptSource(source="hf:someone/prompts:v2", split="train", field="instruction")
    chosen, card = prompts.load_prompts(source, None)
    assert asked == [("someone/prompts", "v2", "train")]
    assert [(p.text, p.answer) for p in chosen] == [("Name a prime.", "2")] and card["excluded_probe_eval"] == 1
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # offline, a split in the datasets cache still serves
    assert prompts.load_prompts(source, None)[0] == chosen and len(asked) == 2


def test_recovery_excludes_the_items_of_every_probe_task_evaluate_knows(monkeypatch):
    from layerprune.tasks import probes

    known = probes.probe_tasks()
    monkeypatch.setattr(probes, "probe_tasks", lambda: {**known, "brackets_d9": {"family": "brackets", "depth": 9}})
    prompts.scored_payloads.cache_clear()
    try:
        assert "brackets_d9" in prompts.probe_task_names("probes")  # one task list, not a copy
        new_eval = prompts.generate_probes("brackets_d9", 3, 0)
        assert all(prompts.asks_scored_item(p.question, (0,)) for p in new_eval)
    finally:
        prompts.scored_payloads.cache_clear()


def test_probe_prompts_whose_question_ends_in_a_cue_line_are_not_all_taken_for_evaluation_items():
    """A copy, reverse or count prompt asks its item over two lines ('Input: y p a' then 'Copy:'):
    the exclusion matches the item's payload, the audit's unit (tasks/contamination.py), so only the prompts that hold
    a scored list are dropped. Before, the question was the last line, 'Copy:' for every copy item: every such prompt
    was taken for an evaluation item, and so was any prompt of the user's ending in 'Count:'."""
    from layerprune.recover.selfgen import Prompt, prompt_id

    for source in ("probes:copy_l3", "probes:reverse_l3", "probes:count_2to5"):
        chosen, card = prompts.load_prompts(PromptSource(source=source, samples=64, exclude_probe_seeds=[0]), None)
        assert len(chosen) == 64, (source, card)
        assert not any(prompts.asks_scored_item(p.text, (0,)) for p in chosen)
    item = prompts.generate_probes("copy_l3", 1, 0)[0].question  # 'Input: y p a\nCopy:'
    own = ["Name three fruits, one per line.\nCount:", f"Repeat the letters.\n{item}"]
    kept, card = prompts.exclude_eval_items([Prompt(prompt_id(t), t) for t in own], (0,), set())
    assert [p.text for p in kept] == own[:1] and card["excluded_probe_eval"] == 1


def test_probe_task_names_fail_with_close_matches_and_gsm8k_test_is_refused():
    with pytest.raises(Exception, match="arith_1dc"):
        prompts.probe_task_names("probes:arith_1d")
    for source in ("gsm8k", "hf:openai/gsm8k:main", "hf:openai/gsm8k"):  # by name or by its hub id
        with pytest.raises(Exception, match="evaluation items"):
            prompts.load_prompts(PromptSource(source=source, split="test"), None)


def test_held_out_metrics_are_zero_kl_for_the_teacher_itself(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    encoded = heldout.encode_rows(tokenizer, [{"prompt": "what is 3 + 7?", "response": "It is 10."}],
                                  GenerationSection(system_prompt=None), 64)
    same = heldout.held_out_metrics(model, model, encoded)
    assert same["kl"] == pytest.approx(0.0, abs=1e-6) and same["ce"] > 0 and same["tokens"] > 0


def test_the_teachers_held_out_side_is_computed_once_a_run_with_the_same_numbers(tiny_llama, tiny_models):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    student = AutoModelForCausalLM.from_pretrained(tiny_models("llama", 6)).eval()
    rows = [{"prompt": f"what is {i} + 7?", "response": f"It is {i + 7}." * (i + 1)} for i in range(3)]
    encoded = heldout.encode_rows(tokenizer, rows, GenerationSection(system_prompt=None), 64)
    plain = [heldout.held_out_metrics(student, teacher, encoded) for _ in range(3)]
    kept = heldout.HeldOutTeacher(teacher, encoded)
    assert [heldout.held_out_metrics(student, kept, encoded) for _ in range(3)] == plain  # equal to the last bit
    assert kept.forwards == len(encoded) and len(kept.kept) == len(encoded)  # three evaluations, one teacher pass
    too_large = heldout.HeldOutTeacher(teacher, encoded, limit=1)  # past the limit: computed at each evaluation
    assert [heldout.held_out_metrics(student, too_large, encoded) for _ in range(3)] == plain
    assert too_large.forwards == 3 * len(encoded) and not too_large.kept
    callback = heldout.HeldOutCallback(kept)
    assert callback.held is kept  # the trainer's evaluations read the run's kept side
    with pytest.raises(ValueError, match="other rows"):
        heldout.held_out_metrics(student, kept, encoded[:2])
    kept.release()  # after the run's last evaluation: computed again if asked, the same numbers
    assert not kept.kept and heldout.held_out_metrics(student, kept, encoded) == plain[0]


def test_recipe_validates_the_new_sections():
    recipe = RecoverRecipe(method="replace", replace={"then": "opd"}, opd={"adapter": "full"})
    assert recipe.trainer_method() == "opd" and not recipe.uses_lora() and METHODS.get(recipe.method).needs_teacher
    with pytest.raises(ValidationError):
        RecoverRecipe(opd={"beta": 1.5})


def _actual_residual(student, teacher, anchor: int, last: int, seqs: list[list[int]]) -> float:
    """||h - y||^2 summed over the calibration tokens: the anchor block's output as the model now computes it
    against the teacher's hidden state after the dropped run (what the fit claims to shrink)."""
    total = 0.0
    for ids in seqs:
        h = replace.capture_teacher(student, anchor, torch.tensor([ids])).double()
        y = replace.capture_teacher(teacher, last, torch.tensor([ids])).double()
        total += float(((h - y) ** 2).sum())
    return total


@pytest.mark.parametrize("arch", ["granite", "llama"])
def test_replace_fits_the_block_as_it_is_computed_with_a_residual_multiplier(tiny_models, arch):
    # Granite: h = a + residual_multiplier * m (0.5 in the tiny config); a = h - m was wrong there
    teacher = AutoModelForCausalLM.from_pretrained(tiny_models(arch, 6)).eval()
    student = AutoModelForCausalLM.from_pretrained(tiny_models(arch, 6)).eval()
    drop_blocks(student, [2, 3])
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 380, (30,), generator=g).tolist() for _ in range(12)]
    plain = _actual_residual(student, teacher, 1, 3, seqs)
    fits = replace.replace_blocks(student, teacher, [2, 3], seqs, ridge=0.0)
    folded = _actual_residual(student, teacher, 1, 3, seqs)
    assert fits[0]["residual_identity"] == pytest.approx(plain, rel=1e-4)  # the report's residuals are the real ones
    assert fits[0]["residual_fitted"] == pytest.approx(folded, rel=1e-3)
    assert folded < 0.9 * plain  # the saved model is closer to the teacher than plain pruning


def test_replace_refuses_a_block_whose_output_is_not_residual_plus_scaled_mlp():
    with pytest.raises(Exception, match="not residual \\+ scalar"):
        replace.check_scaled(torch.randn(10, 8, dtype=torch.float64), torch.randn(10, 8, dtype=torch.float64), "B")
    m = torch.randn(10, 8, dtype=torch.float64)
    replace.check_scaled(0.5 * m, m, "B")


def test_every_method_holds_out_the_same_prompts_and_reports_one_yardstick(pruned, prompts_file, tmp_path):
    reports = {m: run_recover(pruned, prompts_file, tmp_path / m, "--method", m) for m in ("lora", "kd")}
    metrics = {m: r["held_out_metrics"] for m, r in reports.items()}
    assert metrics["lora"]["prompts"] == metrics["kd"]["prompts"] and len(metrics["kd"]["prompts"]) == 2
    assert metrics["lora"]["tokens"] == metrics["kd"]["tokens"] > 0
    for m in metrics.values():  # token-weighted CE and KL of the same pruned model on the same answers
        assert set(m) == {"pruned", "after", "tokens", "prompts"} and m["after"]["kl"] is not None
    assert metrics["lora"]["pruned"]["ce"] == pytest.approx(metrics["kd"]["pruned"]["ce"], rel=1e-5)
    assert metrics["lora"]["pruned"]["kl"] == pytest.approx(metrics["kd"]["pruned"]["kl"], rel=1e-5)
    assert reports["lora"]["held_out_loss"]["after"] == metrics["lora"]["after"]["ce"]
    train_ids = {json.loads(line)["id"] for line in (tmp_path / "lora" / "data" / "responses.jsonl").open()}
    assert set(metrics["lora"]["prompts"]) <= train_ids


def test_held_out_prompt_ids_do_not_depend_on_the_order_of_the_prompts():
    ids = [f"p{i}" for i in range(40)]
    held = heldout.held_out_ids(ids, 0.1, seed=3)
    assert len(held) == 4 and heldout.held_out_ids(list(reversed(ids)), 0.1, seed=3) == held
    assert heldout.held_out_ids(ids, 0.1, seed=4) != held and heldout.held_out_ids(ids[:1], 0.5, 0) == set()


def test_opd_sampling_settings_mean_one_thing_on_both_trl_paths(tiny_llama, tmp_path):
    with pytest.raises(ValidationError, match="opd.lmbda 1 or opd.temperature 1"):  # GKD: loss at 1, sampling at T
        RecoverRecipe.model_validate({"method": "opd", "opd": {"lmbda": 0.5, "temperature": 0.7}})
    with pytest.raises(ValidationError, match="opd.temperature"):
        RecoverRecipe.model_validate({"method": "replace", "replace": {"then": "opd"},
                                      "opd": {"lmbda": 0.0, "temperature": 2.0}})
    RecoverRecipe.model_validate({"method": "opd", "opd": {"lmbda": 1.0, "temperature": 0.7}})  # applies both
    recipe = RecoverRecipe.model_validate({"method": "opd", "opd": {"lmbda": 0.5, "top_p": 0.9, "max_new_tokens": 4},
                                           "train": {"max_length": 64, "max_steps": 1},
                                           "generate": {"max_new_tokens": 8}})
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    common = train.training_arguments(recipe, tmp_path / "t", torch.device("cpu"), "adamw_torch", 0)
    rows = [{"prompt": "what is 1 + 7?", "response": "8"}] * 2
    trainer = kd.gkd_trainer(recipe, model, teacher, AutoTokenizer.from_pretrained(tiny_llama), common, rows, 0.5,
                             1.0, None, [])
    assert trainer.generation_config.top_p == 0.9 and trainer.generation_config.temperature == 1.0
