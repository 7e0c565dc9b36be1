"""recover's block-restoring methods on tiny random models: merge (LaCo layer collapse; its check in
test_recover_laco.py), local (span-local hidden-state training), kd on broad text (the loss against a hand-computed
KL), and their chains."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from helpers import pruned_copy
from layerprune.cli import main
from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.models import drop_blocks
from layerprune.recover import chain, local, memory, merge
from layerprune.recover.methods import METHODS, distill
from layerprune.recover.schema import RecoverRecipe

FAST = ["--max-new-tokens", "6", "--no-generate-drop-truncated", "--samples", "8", "--train-max-length", "128",
        "--train-batch-size", "2", "--train-grad-accum", "2", "--max-steps", "2", "--held-out", "0.25",
        "--train-warmup-steps", "0", "--no-train-gradient-checkpointing", "--learning-rate", "1e-2", "--lora-r", "4",
        "--train-eval-steps", "1", "--device", "cpu", "-q"]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [{"prompt": f"Write one line about the number {i}."} for i in range(12)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def pruned(tiny_models, tmp_path_factory) -> Path:
    """A tiny model minus blocks 2, 3 and 5 (two spans), with a prune_report.json naming its teacher and the drops."""
    return pruned_copy(tiny_models("llama", 6), tmp_path_factory.mktemp("pruned") / "p3", [2, 3, 5])


def run_recover(pruned: Path, prompts_file: Path, out: Path, *extra: str) -> dict:
    assert main(["recover", "--model", str(pruned), "--prompts", str(prompts_file), "-o", str(out), *FAST, *extra]) == 0
    return json.loads((out / "recover_report.json").read_text())


def _sequences(n: int = 8, length: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 380, (length,), generator=g).tolist() for _ in range(n)]


def test_merged_weights_equal_the_hand_computed_sum(tiny_llama):
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    student = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    drop_blocks(student, [2, 3, 5])
    src = [dict(layer.named_parameters()) for layer in teacher.model.layers]
    fits = merge.merge_blocks(student, teacher, [2, 3, 5], _sequences(2, 8), threshold=-1.0, weights=[0.5, 2.0])
    assert [(f["dropped"], f["anchor"], f["weight"]) for f in fits] == [([2, 3], 1, 0.5), ([5, 5], 2, 2.0)]
    merged = [dict(layer.named_parameters()) for layer in student.model.layers]
    for name, value in merged[1].items():  # LaCo merges attention and MLP; the norms stay the anchor's
        expected = src[1][name] + 0.5 * ((src[2][name] - src[1][name]) + (src[3][name] - src[1][name]))
        assert torch.allclose(value, src[1][name] if "norm" in name else expected, atol=1e-6), name
    for name, value in merged[2].items():
        expected = src[4][name] + 2.0 * (src[5][name] - src[4][name])
        assert torch.allclose(value, src[4][name] if "norm" in name else expected, atol=1e-6), name
    for name, value in merged[0].items():  # a block next to no span is untouched
        assert torch.equal(value, src[0][name])
    assert any(not torch.equal(merged[1][n], src[1][n]) for n in merged[1])


def test_merge_refuses_a_span_at_block_0_and_a_wrong_weight_count(tiny_llama):
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama)
    student = AutoModelForCausalLM.from_pretrained(tiny_llama)
    drop_blocks(student, [0, 1])
    with pytest.raises(LayerpruneError, match="block 0"):
        merge.merge_blocks(student, teacher, [0, 1], _sequences(1, 8))
    with pytest.raises(LayerpruneError, match="2 weights for 1 dropped spans"):
        merge.merge_blocks(student, teacher, [2, 3], _sequences(1, 8), weights=[1.0, 1.0])
    with pytest.raises(LayerpruneError, match="merge needs calibration text"):
        merge.merge_blocks(student, teacher, [2, 3], [])


@pytest.mark.parametrize("block", ["before", "after"])
def test_local_training_lowers_the_span_output_error(tiny_llama, block):
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    student = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    drop_blocks(student, [2, 3])
    seqs = _sequences()
    span = local.local_spans([2, 3], 6, block)[0]
    assert (span.trained, span.student) == ((1, 1) if block == "before" else (4, 2))
    cache = [local.capture_states(teacher, span, ids) for ids in seqs]
    before = local.block_error(student.model.layers[span.student], cache, torch.device("cpu"))
    first_batch = local.block_error(student.model.layers[span.student], cache[:4], torch.device("cpu"))
    trained = f"model.layers.{span.student}."
    untouched = {n: p.clone() for n, p in student.named_parameters() if not n.startswith(trained)}
    fits = local.train_spans(student, teacher, [2, 3], seqs, block, local.LocalBudget(steps=30, sequences_per_step=4,
                                                                                      learning_rate=3e-3))
    after = local.block_error(student.model.layers[span.student], cache, torch.device("cpu"))
    assert fits[0]["mse_before"] == pytest.approx(before) and fits[0]["mse_after"] == pytest.approx(after, rel=1e-5)
    assert after < 0.8 * before and fits[0]["tokens"] == 30 * 4 * 24
    curve = fits[0]["mse_per_step"]  # each step's batch MSE in block_error's units, from the first batch's error
    assert len(curve) == 30 and curve[0] == pytest.approx(first_batch, rel=1e-4) and curve[-1] < 0.8 * curve[0]
    assert all(torch.equal(p, untouched[n]) for n, p in student.named_parameters() if n in untouched)


def test_local_keeps_the_teachers_states_for_a_studys_next_run_with_the_same_weights(tiny_llama, tmp_path,
                                                                                      monkeypatch):
    """A study's local runs at several budgets (one cut, one seed) capture the teacher's states once: the next run
    reads the kept file and trains to the same weights, bit for bit; another teacher or other sequences is another
    file."""
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    seqs = [list(range(3 + i, 3 + i + 7 + i % 4)) for i in range(8)]
    budget = local.LocalBudget(steps=6, sequences_per_step=4, learning_rate=1e-3)

    def trained(states):  # a fresh student, blocks 2 and 3 dropped; its trained weights
        student = AutoModelForCausalLM.from_pretrained(tiny_llama)
        drop_blocks(student, [2, 3])
        local.train_spans(student, teacher, [2, 3], seqs, "before", budget, states=states)
        return student.state_dict()

    plain = trained(None)
    first = trained(tmp_path / "states")
    kept = sorted((tmp_path / "states").glob("*.pt"))
    assert len(kept) == 1 and all(torch.equal(plain[k], first[k]) for k in plain)
    captured = []
    monkeypatch.setattr(local, "capture_states", lambda *args: captured.append(args) or pytest.fail("captured"))
    again = trained(tmp_path / "states")  # read from the kept file: no teacher forward
    assert not captured and all(torch.equal(plain[k], again[k]) for k in plain)
    monkeypatch.undo()
    span = local.local_spans([2, 3], 6, "before")[0]
    other = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    with torch.no_grad():
        next(other.parameters()).add_(1e-3)
    digests = {local.teacher_digest(teacher), local.teacher_digest(other)}
    local.span_states(other, span, seqs, tmp_path / "states", local.teacher_digest(other))
    local.span_states(teacher, span, seqs[:-1], tmp_path / "states", local.teacher_digest(teacher))
    assert len(digests) == 2 and len(list((tmp_path / "states").glob("*.pt"))) == 3
    (kept[0]).write_bytes(b"torn")  # an unreadable file is captured again, not trusted
    assert all(torch.equal(plain[k], v) for k, v in trained(tmp_path / "states").items())
    torch.save(local.span_states(teacher, span, seqs[:-1], None, ""), kept[0])  # a file of other sequences
    assert all(torch.equal(plain[k], v) for k, v in trained(tmp_path / "states").items())
    assert len(torch.load(kept[0], weights_only=True)) == len(seqs)  # captured again and kept in its place
    full = tmp_path / "full"
    full.write_text("")  # a folder that cannot be made (as a full disk): the run goes on, nothing kept
    assert all(torch.equal(plain[k], v) for k, v in trained(full / "states").items())
    assert full.is_file()


def test_local_refuses_a_block_that_does_not_exist():
    with pytest.raises(LayerpruneError, match="block 0; set local.block: after"):
        local.local_spans([0, 1], 6, "before")
    with pytest.raises(LayerpruneError, match="last block; set local.block: before"):
        local.local_spans([4, 5], 6, "after")
    assert [(s.trained, s.student, s.enter, s.leave) for s in local.local_spans([0, 1], 6, "after")] == [(2, 0, 0, 2)]


def test_kd_on_broad_text_loss_equals_a_hand_computed_kl(tiny_llama, tmp_path):
    """The kd arm's trainer (TRL GKD, lmbda 0) on one batch: the mean over completion tokens of
    sum_v p_teacher(v) (log p_teacher(v) - log p_student(v)), computed here by hand."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    student = AutoModelForCausalLM.from_pretrained(tiny_llama)
    drop_blocks(student, [2, 3])
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    recipe = RecoverRecipe(method="kd", kd={"adapter": "full"}, train={"max_length": 256, "batch_size": 3})
    rows = [{"prompt": f"Tell me about {w}.", "response": f"{w} is a word." * (i + 1)}
            for i, w in enumerate(["rivers", "bread", "stars"])]
    job = SimpleNamespace(settings=RunSettings(device="cpu"))
    loaded = SimpleNamespace(model=student, tokenizer=tokenizer)
    trainer = distill.make_trainer(recipe, "kd", loaded, teacher, rows, [], job, "adamw_torch", tmp_path,
                                   TrainerCallback())
    assert type(trainer).__name__ == "GKDTrainer"
    batch = next(iter(trainer.get_train_dataloader()))
    student.eval()  # no dropout (the trainer disables it too)
    loss = trainer.compute_loss(student, batch)
    with torch.no_grad():
        s = torch.log_softmax(student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, -1)
        t = torch.log_softmax(teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, -1)
    total, count = 0.0, 0
    for b in range(batch["input_ids"].shape[0]):
        for i in range(batch["input_ids"].shape[1] - 1):
            if batch["labels"][b, i + 1] != -100:
                total += float((t[b, i].exp() * (t[b, i] - s[b, i])).sum())
                count += 1
    assert count > 0 and float(loss.detach()) == pytest.approx(total / count, rel=1e-4)


def test_merge_end_to_end_reloads_as_the_merged_model(pruned, prompts_file, tmp_path):
    report = run_recover(pruned, prompts_file, tmp_path / "merge", "--method", "merge", "--merge-weight", "0.5",
                         "--merge-threshold", "-1")
    data = report["data"]
    assert data["chain"] == "merge" and [f["dropped"] for f in data["merge"]] == [[2, 3], [5, 5]]
    assert all(f["kept"] and -1 <= f["similarity"] <= 1 for f in data["merge"])  # LaCo's check, in the report
    assert data["verified"]["checked"] and data["steps"] == 0
    metrics = data["held_out_metrics"]
    assert metrics["replaced"] == metrics["after"] and metrics["after"]["kl"] != metrics["pruned"]["kl"]
    config = json.loads((tmp_path / "merge" / "config.json").read_text())
    assert config["num_hidden_layers"] == 3
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "merge")
    teacher = AutoModelForCausalLM.from_pretrained(json.loads((pruned / "prune_report.json").read_text())
                                                   ["source"]["location"])
    expected = teacher.model.layers[1].mlp.down_proj.weight + 0.5 * sum(
        teacher.model.layers[k].mlp.down_proj.weight - teacher.model.layers[1].mlp.down_proj.weight for k in (2, 3))
    assert torch.allclose(saved.model.layers[1].mlp.down_proj.weight, expected, atol=1e-6)


def test_merge_then_local_chain_trains_the_merged_blocks(pruned, prompts_file, tmp_path):
    report = run_recover(pruned, prompts_file, tmp_path / "ml", "--method", "merge", "--merge-then", "local",
                         "--learning-rate", "1e-3")
    data = report["data"]
    assert data["chain"] == "merge+local" and len(data["merge"]) == len(data["local"]) == 2
    assert all(f["mse_after"] < f["mse_before"] for f in data["local"]) and data["verified"]["checked"]
    assert report["tokens_seen"] == sum(f["tokens"] for f in data["local"]) > 0
    mse = report["loss_curve"]["local_mse"]  # the chart of a chain without a trainer: the local step's span MSE
    assert [s for s, _ in mse] == list(range(1, sum(f["steps"] for f in data["local"]) + 1))
    assert data["steps"] == len(mse)  # the report's steps count the local step's
    assert report["memory_plan"]["optimizer"] == "adamw_torch (one block)"


def test_replace_then_local_and_local_then_kd_chains():
    recipe = RecoverRecipe(method="replace", replace={"then": "local"})
    assert recipe.surgery_steps() == ["replace", "local"] and recipe.trainer_method() is None
    assert recipe.chain_name() == "replace+local" and METHODS.get(recipe.method).needs_teacher
    then_kd = RecoverRecipe(method="local", local={"then": "kd"})
    assert then_kd.chain_name() == "local+kd" and then_kd.uses_lora()
    assert RecoverRecipe(method="lora").chain_name() == "lora"
    with pytest.raises(ValueError):
        RecoverRecipe(merge={"span_weights": [-1.0]})
    with pytest.raises(ValueError):
        RecoverRecipe(local={"block": "middle"})


def test_merge_without_a_prune_report_or_from_another_teacher_is_one_line(tiny_models, pruned, prompts_file, tmp_path,
                                                                          capsys):
    unpruned = tmp_path / "copy"  # a model with no prune_report.json
    shutil.copytree(tiny_models("llama", 6), unpruned)
    code = main(["recover", "--model", str(unpruned), "--teacher", str(tiny_models("llama", 6)),
                 "--prompts", str(prompts_file), "-o", str(tmp_path / "x"), *FAST, "--method", "merge"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: merge needs the dropped blocks") and not (tmp_path / "x").exists()
    code = main(["recover", "--model", str(pruned), "--teacher", str(tiny_models("llama", 4)),
                 "--prompts", str(prompts_file), "-o", str(tmp_path / "y"), *FAST, "--method", "local"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: local reads the dropped blocks from the teacher")
    assert "(6 blocks), not a model with 4" in err[-1] and not (tmp_path / "y").exists()


def test_the_memory_plan_of_local_counts_the_cache_and_one_block(tiny_llama):
    from transformers import AutoConfig

    shape = memory.model_shape(AutoConfig.from_pretrained(tiny_llama))
    recipe = RecoverRecipe(method="local", prompts={"samples": 100}, train={"batch_size": 2, "grad_accum": 1})
    planned = chain.plan(recipe, shape, shape, 4, 80.0, 128)
    merged = chain.plan(RecoverRecipe(method="merge"), shape, shape, 4, 80.0, 128)
    cache = 2 * 100 * 128 * shape.hidden * 4 / memory.GB
    assert planned.teacher == pytest.approx(shape.params * 4 / memory.GB + cache)
    assert merged.teacher == pytest.approx(shape.params * 4 / memory.GB) and merged.gradients == 0
    assert 0 < planned.gradients < shape.params * 4 / memory.GB / shape.layers


def test_a_token_budget_stops_kd_and_local(pruned, prompts_file, tmp_path, tiny_llama):
    report = run_recover(pruned, prompts_file, tmp_path / "kd", "--method", "kd", "--max-steps", "10",
                         "--train-max-tokens", "40")
    assert 1 <= report["data"]["steps"] < 10 and report["tokens_unpadded"] >= 40
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    student = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    drop_blocks(student, [2, 3])
    fits = local.train_spans(student, teacher, [2, 3], _sequences(), "before",
                             local.LocalBudget(steps=30, sequences_per_step=4, learning_rate=1e-3, max_tokens=200))
    assert fits[0]["steps"] == 3 and fits[0]["tokens"] == fits[0]["target_tokens"] == 3 * 4 * 24


def test_merge_and_local_work_on_a_family_with_post_mlp_norms(tiny_models):
    """Gemma 3 (a norm after the MLP: replace's fold is refused) merges and trains locally; sliding-window blocks
    get their own masks and rotary tables from the teacher's call."""
    path = tiny_models("gemma3_text", 6)
    teacher = AutoModelForCausalLM.from_pretrained(path).eval()
    student = AutoModelForCausalLM.from_pretrained(path).eval()
    drop_blocks(student, [2, 3])
    merge.merge_blocks(student, teacher, [2, 3], _sequences(2, 8), threshold=-1.0, weight=0.5)
    fits = local.train_spans(student, teacher, [2, 3], _sequences(), "before",
                             local.LocalBudget(steps=20, sequences_per_step=4, learning_rate=3e-3))
    assert fits[0]["mse_after"] < fits[0]["mse_before"]


def test_dry_run_plans_a_merge_then_local_chain(pruned, prompts_file, capsys):
    code = main(["recover", "--model", str(pruned), "--prompts", str(prompts_file), "-o", "unused", *FAST,
                 "--method", "merge", "--merge-then", "local", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0 and "method merge+local" in out and "cached teacher states" in out
    assert "optimizer (adamw_torch (one block))" in out and not Path("unused").exists()
