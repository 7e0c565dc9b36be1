"""Sharing models: every card names its base model by hub id and carries the scores as model-index metadata that
huggingface_hub reads back; `layerprune push` lists what would go, refuses without a token or network in one line
and writes nothing, and calls huggingface_hub's upload with the repo and folder (no network in any test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub import HfApi, ModelCard

from helpers import run_cli
from layerprune.core.model_card import CardScore, with_scores, write_card
from layerprune.evaluate.summary import EvaluatedModel, Summary, TaskResult, write_summary
from layerprune.models.hub_ids import base_model_of, base_model_of_spec
from layerprune.models.lineage import VARIANT_REPORT, SourceRecord

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def summary(scores: dict[str, float], model: Path | None = None) -> Summary:
    """A summary of `scores`; with `model`, under that folder's weights' fingerprint (as `evaluate` records it)."""
    from layerprune.core.settings import RunSettings
    from layerprune.models.identity import model_fingerprint
    from layerprune.models.loading import resolve_model

    results = [TaskResult(task=task, kind="classification", metric="acc", value=value, stderr=0.01, n=200,
                          headline=True, settings={}, seconds=1.0) for task, value in scores.items()]
    digest = "0" * 16 if model is None else model_fingerprint(resolve_model(model), RunSettings().resolved_cache_dir())
    return Summary(model=EvaluatedModel(spec=str(model or "m"), location=str(model or "m"), kind="local"),
                   model_hash=digest, results=results)


def scores_of(folder: Path, tmp_path: Path, scores: dict[str, float]) -> Path:
    """An `evaluate` output folder holding `scores` of `folder`'s weights."""
    evaluation = tmp_path / "eval"
    evaluation.mkdir()
    write_summary(evaluation, summary(scores, folder))
    return evaluation


@pytest.fixture
def hub_calls(monkeypatch) -> dict:
    """A token, and HfApi's create_repo / list_repo_files / create_commit recorded, not sent (`there`: the repo's
    files before the push)."""
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    calls: dict = {"there": [".gitattributes"]}
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: calls.update(
        create_repo={"repo_id": repo_id, "token": self.token, **kw}))
    monkeypatch.setattr(HfApi, "list_repo_files", lambda self, repo_id, **kw: list(calls["there"]))
    monkeypatch.setattr(HfApi, "create_commit", lambda self, **kw: calls.setdefault("commits", []).append(kw)
                        or "https://huggingface.co/me/x/commit/abc")
    return calls


def sent(commit: dict) -> dict[str, object]:
    """path in the repo -> what a commit adds (bytes or a file path), or None for a deletion."""
    return {o.path_in_repo: getattr(o, "path_or_fileobj", None) for o in commit["operations"]}


@pytest.fixture
def no_hub(monkeypatch):
    """Every HfApi call that would reach the hub fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("the hub was called")

    for name in ("create_repo", "upload_folder", "create_commit", "upload_file"):
        monkeypatch.setattr(HfApi, name, refuse)


@pytest.fixture
def no_token(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf-home" / "stored_tokens"))


def test_base_model_is_the_hub_id_of_embedded_variant_and_pruned_sources(tmp_path):
    """The demo's card said `base_model: embedded`, which no hub resolves."""
    embedded = SourceRecord(spec="embedded", location="/cache/x", kind="embedded",
                            identity={"embedded": "smollm2-135m-instruct"})
    assert base_model_of(embedded).base_model == SMOL and base_model_of(embedded).on_hub
    assert base_model_of_spec("embedded:gemma3").base_model == "google/gemma-3-270m"
    variant = tmp_path / "math-embedded-0123"
    variant.mkdir()
    (variant / VARIANT_REPORT).write_text(json.dumps({"source_model": "embedded", "kind": "sft",
                                                      "source_identity": {"embedded": "smollm2-135m-instruct"}}))
    named = SourceRecord(spec="variant:math-embedded", location=str(variant), kind="local",
                         identity={"path": str(variant), "variant": "math-embedded"})
    assert base_model_of(named) == base_model_of(named).__class__(SMOL, True, "math-embedded")
    again = base_model_of_spec("variant:math-embedded", {"path": str(variant), "variant": "math-embedded"})
    assert (again.base_model, again.variant) == (SMOL, "math-embedded")  # a variant trained from a variant
    assert base_model_of_spec(str(variant)).base_model == SMOL  # the variant's folder named by its path
    pruned_variant = SourceRecord(spec="out/p", location="out/p", kind="local",
                                  identity={"path": "out/p", "pruned_from": named.model_dump(mode="json")})
    assert base_model_of(pruned_variant).base_model == SMOL and base_model_of(pruned_variant).variant
    hub = SourceRecord(spec="Qwen/Qwen2.5-7B", location="Qwen/Qwen2.5-7B", kind="hub", identity={})
    assert base_model_of(hub).base_model == "Qwen/Qwen2.5-7B"
    local = SourceRecord(spec=str(tmp_path), location=str(tmp_path), kind="local", identity={"path": str(tmp_path)})
    assert base_model_of(local).base_model == str(tmp_path) and not base_model_of(local).on_hub


def test_pruned_recovered_and_variant_cards_name_the_hub_id(pruned):
    from layerprune.posttrain.api import model_card as variant_card
    from layerprune.prune.report import model_card as pruned_card
    from layerprune.prune.report import read_prune_report
    from layerprune.recover.report import RecoverReport
    from layerprune.recover.report import model_card as recovered_card
    from layerprune.recover.schema import RecoverRecipe

    report = read_prune_report(pruned)
    report.source = SourceRecord(spec="embedded", location="/c", kind="embedded",
                                 identity={"embedded": "smollm2-135m-instruct"})
    card = pruned_card(report)
    assert card.data.base_model == SMOL and card.data.layerprune["source"] == "embedded"
    assert card.data.layerprune["dropped_blocks"] == [2, 4]
    recovered = RecoverReport.model_construct(
        recipe=RecoverRecipe(method="local"), student=SourceRecord(spec=str(pruned), location=str(pruned),
                                                                   kind="local"),
        teacher="embedded", held_out_loss=report_loss(), tokens_unpadded=None, tokens_seen=10, data={"steps": 2},
        seconds=seconds(), provenance=report.provenance)
    card = recovered_card(recovered, report)
    assert card.data.base_model == SMOL and card.data.layerprune["teacher"] == "embedded"
    assert card.data.layerprune["teacher_base_model"] == SMOL
    assert card.data.layerprune["recover_settings"]["method"] == "local" and "local" in card.data.layerprune[
        "recover_settings"]
    text = variant_card({"kind": "sft", "source_model": "embedded", "format": "plain", "teacher": None,
                         "seconds": 1.0, "fingerprint": "0" * 64, "provenance": {"layerprune": "0"},
                         "recipe": {"name": "math-embedded"},
                         "data": {"items": 1, "per_source": {"a": 1}, "calibration_seed": 1,
                                  "scored_items_trained": 0, "exclude_probe_seeds": [0], "dropped_scored": {}},
                         "train": {"method": "full", "steps": 1, "sequences": 1, "tokens": 1, "target_tokens": 1,
                                   "loss_first": 1.0, "loss_last": 0.5}})
    data = ModelCard(text).data
    assert data.base_model == SMOL and data.base_model_relation == "finetune"
    assert data.layerprune["variant_recipe"] == "math-embedded"


def report_loss():  # noqa: ANN201
    from layerprune.recover.report import HeldOutLoss

    return HeldOutLoss(before=2.0, after=1.5)


def seconds():  # noqa: ANN201
    from layerprune.recover.report import Seconds

    return Seconds(total=3.0, generation=1.0, training=2.0)


def test_the_card_round_trips_its_scores_through_huggingface_hub(pruned, tiny_llama):
    scores = [CardScore(task="arc_easy", metric="acc", value=0.61, stderr=0.03, n=200),
              CardScore(task="copy_l7", metric="accuracy", value=0.4, n=300)]
    text = (pruned / "README.md").read_text()
    write_card(pruned, with_scores(with_scores(text, "old", scores[:1], "| old |"), "demo-pruned", scores, "| t |"))
    card = ModelCard.load(pruned / "README.md")
    assert card.data.base_model is None and card.data.layerprune["source"] == str(tiny_llama)  # no hub id known
    assert card.data.model_name == "demo-pruned"
    assert [(r.dataset_name, r.metric_type, r.metric_value, r.task_type) for r in card.data.eval_results] == [
        (s.task, s.metric, s.value, "text-generation") for s in scores]
    assert card.text.count("## Scores") == 1 and "| t |" in card.text and "| old |" not in card.text
    assert card.data.layerprune["dropped_blocks"] == [2, 4]


def test_a_runs_report_stage_puts_each_models_scores_and_the_paired_table_on_its_card(pruned, tmp_path):
    from layerprune.evaluate.report import compare
    from layerprune.pipeline.cards import refresh_run_cards

    summaries = {"baseline": summary({"arc_easy": 0.7}), "pruned": summary({"arc_easy": 0.5})}
    written = refresh_run_cards("demo", {"pruned": pruned, "recovered": tmp_path / "none"}, summaries,
                                compare(summaries))
    assert written == [pruned / "README.md"]
    card = ModelCard.load(pruned / "README.md")
    assert [(r.dataset_name, r.metric_value) for r in card.data.eval_results] == [("arc_easy", 0.5)]
    assert "| arc_easy |" in card.text and "original" in card.text.lower()


def test_dry_run_lists_the_files_and_the_card_metadata_and_writes_nothing(capsys, pruned, no_hub, tmp_path):
    evaluation = scores_of(pruned, tmp_path, {"piqa": 0.66})
    before = (pruned / "README.md").read_text()
    code, out, err = run_cli(capsys, ["push", str(pruned), "--repo", "me/x", "--dry-run", "--scores",
                                      str(evaluation)])
    assert code == 0, err
    assert f"would push {pruned} to me/x (public unless the owner's default is private" in out
    assert "config.json" in out and "model.safetensors" in out and "model-index:" in out
    assert "name: piqa" in out and "value: 0.66" in out and "nothing uploaded or written" in out
    assert (pruned / "README.md").read_text() == before


def test_push_without_a_token_is_one_line_and_writes_nothing(capsys, pruned, no_hub, no_token, tmp_path):
    evaluation = scores_of(pruned, tmp_path, {"piqa": 0.66})
    before = (pruned / "README.md").read_text()
    code, out, err = run_cli(capsys, ["push", str(pruned), "--repo", "me/x", "--scores", str(evaluation)])
    assert code == 2 and err.startswith("error: no Hugging Face token") and len(err.strip().splitlines()) == 1
    assert (pruned / "README.md").read_text() == before and not out


@pytest.mark.parametrize("failing", ["create_repo", "create_commit", "offline"])
def test_a_network_or_hub_error_is_one_line_and_leaves_the_folder_as_it_was(capsys, monkeypatch, pruned, tmp_path,
                                                                            failing):
    import requests
    from huggingface_hub import constants

    def fail(*args, **kwargs):
        raise requests.exceptions.ConnectionError("Max retries exceeded: Name or service not known")

    monkeypatch.setenv("HF_TOKEN", "hf_test")
    if failing == "offline":  # huggingface_hub's own create_repo refuses in offline mode (HF_HUB_OFFLINE=1)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    else:
        monkeypatch.setattr(HfApi, "create_repo", lambda self, *a, **k: None)
        monkeypatch.setattr(HfApi, "list_repo_files", lambda self, *a, **k: [])
        monkeypatch.setattr(HfApi, failing, fail)
    evaluation = scores_of(pruned, tmp_path, {"piqa": 0.66})
    before = (pruned / "README.md").read_text()
    code, _, err = run_cli(capsys, ["push", str(pruned), "--repo", "me/x", "--scores", str(evaluation)])
    assert code == 2 and err.startswith("error: could not push to me/x: ") and len(err.strip().splitlines()) == 1
    assert (pruned / "README.md").read_text() == before
    assert ("OfflineModeIsEnabled" in err) == (failing == "offline")


def test_push_sends_the_folder_in_one_commit_with_the_scores_on_its_card(capsys, pruned, tmp_path, hub_calls):
    evaluation = scores_of(pruned, tmp_path, {"piqa": 0.66})
    hub_calls["there"] = [".gitattributes", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
                          "adapter/adapter_model.safetensors", "notes.md"]  # an earlier push, and a file of the owner's
    code, out, err = run_cli(capsys, ["push", str(pruned), "--repo", "me/x", "--private", "--scores",
                                      str(evaluation)])
    assert code == 0, err
    assert hub_calls["create_repo"] == {"repo_id": "me/x", "token": "hf_test", "private": True, "exist_ok": True}
    (commit,) = hub_calls["commits"]
    files = sent(commit)
    assert commit["repo_id"] == "me/x" and files["model.safetensors"] == str(pruned / "model.safetensors")
    assert not any(name.startswith(".") or "/." in name for name in files)
    assert [name for name, what in files.items() if what is None] == [
        "model-00001-of-00002.safetensors", "model.safetensors.index.json", "adapter/adapter_model.safetensors"]
    card = ModelCard(files["README.md"].decode())
    assert [(r.dataset_name, r.metric_value) for r in card.data.eval_results] == [("piqa", 0.66)]
    assert (pruned / "README.md").read_text() == files["README.md"].decode()  # the folder's card is the hub's
    assert "me/x" in out


def test_push_without_private_leaves_the_visibility_to_the_owners_default(capsys, pruned, hub_calls):
    """`private=False` made a public repo even in an organization whose repos are private by default."""
    code, _, err = run_cli(capsys, ["push", str(pruned), "--repo", "org/x"])
    assert code == 0, err
    assert hub_calls["create_repo"]["private"] is None


def test_push_refuses_a_folder_that_is_not_whole_or_was_never_checked(capsys, tiny_llama, pruned, tmp_path,
                                                                      no_hub):
    unchecked = tmp_path / "unchecked"
    code, _, err = run_cli(capsys, ["prune", "--model", str(tiny_llama), "--output", str(unchecked), "--layers",
                                    "2,4", "--no-verify"])
    assert code == 0, err
    code, _, err = run_cli(capsys, ["push", str(unchecked), "--repo", "me/x", "--dry-run"])
    assert code == 2 and "saved without being checked against its source" in err and len(err.splitlines()) == 1
    code, out, err = run_cli(capsys, ["push", str(unchecked), "--repo", "me/x", "--dry-run", "--allow-unverified"])
    assert code == 0, err
    (pruned / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "lm_head.weight": "model.safetensors", "x": "model-00002-of-00002.safetensors"}}))
    code, _, err = run_cli(capsys, ["push", str(pruned), "--repo", "me/x", "--dry-run", "--allow-unverified"])
    assert code == 2 and "names model-00002-of-00002.safetensors, which is not there" in err
    (pruned / "model.safetensors.index.json").unlink()
    weights = pruned / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-16])  # a copy cut short
    code, _, err = run_cli(capsys, ["push", str(pruned), "--repo", "me/x", "--dry-run"])
    assert code == 2 and "corrupt safetensors file" in err and len(err.splitlines()) == 1


def test_scores_of_other_weights_are_refused(capsys, pruned, tiny_llama, tmp_path, no_hub):
    evaluation = scores_of(tiny_llama, tmp_path, {"piqa": 0.66})  # the original's scores, not the pruned model's
    before = (pruned / "README.md").read_text()
    code, _, err = run_cli(capsys, ["push", str(pruned), "--repo", "me/x", "--dry-run", "--scores",
                                    str(evaluation)])
    assert code == 2 and "not of the weights in" in err and len(err.splitlines()) == 1
    assert (pruned / "README.md").read_text() == before


def test_a_local_base_model_stays_off_the_hubs_card(capsys, pruned, tiny_llama, hub_calls):
    """A card an older layerprune wrote named a local path as base_model; the hub's model tree takes ids only."""
    card = ModelCard.load(pruned / "README.md")
    card.data.base_model = str(tiny_llama)
    write_card(pruned, str(card))
    code, out, err = run_cli(capsys, ["push", str(pruned), "--repo", "me/x", "--dry-run"])
    assert code == 0, err
    assert f"base_model {str(tiny_llama)!r} is not a hub id: left out" in out and "base_model:" not in out
    code, _, err = run_cli(capsys, ["push", str(pruned), "--repo", "me/x"])
    assert code == 0, err
    pushed = ModelCard(sent(hub_calls["commits"][0])["README.md"].decode())
    assert pushed.data.base_model is None and pushed.data.layerprune["dropped_blocks"] == [2, 4]


def test_push_of_a_gguf_file_sends_it_with_a_card_from_its_source(capsys, monkeypatch, pruned, tmp_path):
    gguf = tmp_path / "gguf" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    record = {"model": str(pruned), "output": str(gguf), "outtype": "q8_0", "bytes": 64, "readback": {"ok": 1}}
    (gguf.parent / "model.export.json").write_text(json.dumps(record))
    write_card(pruned, with_scores((pruned / "README.md").read_text(), "p", [CardScore(task="piqa", metric="acc",
                                                                                          value=0.6)], "| t |"))
    code, out, err = run_cli(capsys, ["push", str(gguf), "--repo", "me/x-gguf", "--dry-run"])
    assert code == 0, err
    assert "model.gguf" in out and "64 B" in out and "- gguf" in out and "model-index" not in out
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    commits = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, *a, **k: None)
    monkeypatch.setattr(HfApi, "create_commit", lambda self, **kwargs: commits.append(kwargs) or "url")
    code, out, err = run_cli(capsys, ["push", str(gguf), "--repo", "me/x-gguf"])
    assert code == 0, err
    (commit,) = commits
    assert commit["repo_id"] == "me/x-gguf" and [o.path_in_repo for o in commit["operations"]] == ["model.gguf",
                                                                                                 "README.md"]
    card = ModelCard(commit["operations"][1].path_or_fileobj.decode())
    assert card.data.layerprune["dropped_blocks"] == [2, 4]  # the source folder's card, read from its record
    assert "gguf" in card.data.tags and card.data.layerprune["gguf"]["outtype"] == "q8_0"
    assert card.data.eval_results is None and "## Scores" not in card.text  # measured on the folder, not the file
    assert "this file was not evaluated" in card.text.replace("\n", " ")


@pytest.mark.parametrize(("record", "words"), [
    (None, "has no export record"), ({"bytes": 64}, "exported without its read-back"),
    ({"bytes": 63, "readback": {"ok": 1}}, "the file changed since it was exported")])
def test_push_refuses_a_gguf_file_its_export_did_not_check(capsys, tmp_path, no_hub, record, words):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    if record is not None:
        (tmp_path / "model.export.json").write_text(json.dumps({**record, "output": str(gguf), "model": "x"}))
    code, _, err = run_cli(capsys, ["push", str(gguf), "--repo", "me/x", "--dry-run"])
    assert code == 2 and words in err and len(err.splitlines()) == 1




def test_push_refuses_a_folder_without_a_card_or_a_bad_repo(capsys, tiny_llama, no_hub):
    code, _, err = run_cli(capsys, ["push", str(tiny_llama), "--repo", "me/x", "--dry-run"])
    assert code == 2 and "has no model card" in err
    code, _, err = run_cli(capsys, ["push", str(tiny_llama), "--repo", "not a repo", "--dry-run"])
    assert code == 2 and "is not a hub repo id" in err


def test_scores_from_an_evaluate_comparison_carry_its_paired_table(pruned, tmp_path):
    from layerprune.evaluate.report import compare
    from layerprune.pipeline.cards import card_with_evaluation

    summaries = {"baseline": summary({"arc_easy": 0.7}), "pruned": summary({"arc_easy": 0.5})}
    for role, found in summaries.items():
        (tmp_path / "eval" / role).mkdir(parents=True)
        write_summary(tmp_path / "eval" / role, found)
    compare(summaries, tmp_path / "eval")
    card = ModelCard(card_with_evaluation((pruned / "README.md").read_text(), tmp_path / "eval" / "pruned", "p"))
    assert [(r.dataset_name, r.metric_value) for r in card.data.eval_results] == [("arc_easy", 0.5)]
    assert "| task | measures | n | original | pruned |" in card.text and "| arc_easy | " in card.text
    assert "comparison.md of the evaluation" in card.text

