"""`prune --granularity attention|mlp|sublayer`: the scores of sublayers against brute force, the recipe's names and
refusals, the dry-run plan, and the one call that saves (the Nemotron-NAS layout, stubbed here)."""

from __future__ import annotations

import functools
import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import assert_one_line_error, run_cli
from layerprune.models import find_decoder_stack
from layerprune.models.generate import generate_greedy
from layerprune.models.nas_surgery import most_removable
from layerprune.models.sublayers import Sublayer, all_sublayers, skipped_sublayers
from layerprune.prune.calib import CalibItem, CalibSet, arithmetic_calib, tokenize_calibration
from layerprune.prune.metrics import (
    angular_distance,
    kv_cache_kept,
    last_token_mask,
    update_influence,
)
from layerprune.prune.recipe import PruneRecipe
from layerprune.prune.scores import ScoreContext
from layerprune.prune.sublayer_scores import _generated_correct, score_sublayers, servable_lowest
from test_teacher_forced import MAX_NEW, STOP, WORDS, digits_only_model
from tiny import tiny_config, tiny_tokenizer

BOTH = ("attn", "mlp")


def test_update_influence_by_hand():
    x = torch.tensor([[[1.0, 0.0], [0.0, 2.0], [5.0, 5.0]]])
    update = torch.tensor([[[0.0, 1.0], [0.0, -1.0], [9.0, 9.0]]])
    mask = torch.tensor([[1, 1, 0]])  # the padded third token is not counted
    total, count = update_influence(x, update, mask)
    assert count == 2
    assert total == pytest.approx((1 - 1 / math.sqrt(2)) + 0.0, abs=1e-6)  # cos((1,0),(1,1)); cos((0,2),(0,1)) = 1


def lowest(scores: dict[Sublayer, float | None], n: int) -> list[Sublayer]:
    """The `n` lowest-scored sublayers, sorted, ties to the later one (the layout serves every pick of these tests)."""
    pool = sorted((sub for sub, s in scores.items() if s is not None), reverse=True)
    return sorted(sorted(pool, key=lambda sub: scores[sub])[:n])


def test_servable_lowest_and_kv_cache_by_hand():
    scores = {Sublayer(1, "attn"): 0.5, Sublayer(1, "mlp"): 0.1, Sublayer(2, "attn"): 0.1, Sublayer(3, "mlp"): None}
    assert servable_lowest(scores, 1, 4) == [Sublayer(2, "attn")]  # a tie: the later one goes first
    assert servable_lowest(scores, 5, 4) == [Sublayer(1, "attn"), Sublayer(1, "mlp"), Sublayer(2, "attn")]
    assert kv_cache_kept(6, 2) == pytest.approx(4 / 6)


def tiny_context(path, **fields) -> ScoreContext:  # noqa: ANN001
    """A 4-block model's score context over 4 arithmetic items in two batches (of unequal padding)."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    calib = arithmetic_calib(4, 0, None)
    batches = tokenize_calibration(calib, tokenizer, 48, 2)
    fields = {"drop": 2, "protected": [0], "max_new_tokens": 8, **fields}
    return ScoreContext(model=model, tokenizer=tokenizer, stack=find_decoder_stack(model), batches=batches,
                        calib=calib, **fields)


@pytest.fixture(params=["llama", "gemma3_text"])  # Gemma: norms after each sublayer, sliding-window layers
def ctx(request, tiny_models) -> ScoreContext:
    return tiny_context(tiny_models(request.param, 4))


@pytest.fixture
def llama_ctx(tiny_models) -> ScoreContext:
    return tiny_context(tiny_models("llama", 4))


def naive_loss(model, batches, skip):  # noqa: ANN001, ANN202
    """Mean NLL of the whole model's own forward with `skip` sublayers skipped (the reference)."""
    total, count = 0.0, 0
    with torch.no_grad(), skipped_sublayers(model, skip):
        for b in batches:
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
            mask = b.loss_mask[:, 1:].bool()
            total += float(F.cross_entropy(logits[:, :-1][mask].float(), b.input_ids[:, 1:][mask], reduction="sum"))
            count += int(mask.sum())
    return total / count


def test_sublayer_ablation_equals_brute_force(ctx):
    result = score_sublayers("ablation", ctx, BOTH)
    base = naive_loss(ctx.model, ctx.batches, [])
    assert result.details["base"] == pytest.approx(base, rel=1e-5)
    assert set(result.scores) == {sub for sub in all_sublayers(4) if sub.block != 0}
    for sub, score in result.scores.items():
        assert score == pytest.approx(naive_loss(ctx.model, ctx.batches, [sub]) - base, abs=1e-5), sub
    assert result.drop == lowest(result.scores, 2)


def test_iterative_sublayer_ablation_equals_naive_greedy(llama_ctx):
    ctx = llama_ctx
    ctx.iterative, ctx.drop = True, 3
    result = score_sublayers("ablation", ctx, ("mlp",))
    removed: list[Sublayer] = []
    for step in result.steps:
        assert set(step["deltas"]) == {str(Sublayer(b, "mlp")) for b in (1, 2, 3)} - {str(s) for s in removed}
        losses = {name: naive_loss(ctx.model, ctx.batches, [*removed, _sub(name)]) for name in step["deltas"]}
        for name, delta in step["deltas"].items():
            assert delta + step["base"] == pytest.approx(losses[name], abs=1e-5), name
        removed.append(_sub(min(losses, key=lambda n: (losses[n], -_sub(n).block))))
        assert step["dropped"] == str(removed[-1])
    assert result.drop == sorted(removed)


def _sub(name: str) -> Sublayer:
    block, part = name.split(".")
    return Sublayer(int(block), part)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def digits_ctx(tiny_models) -> ScoreContext:
    """A model that answers in digits only, scored on its own greedy answers (right for the full model)."""
    model, tokenizer = digits_only_model(tiny_models("llama", 4))
    rng = random.Random(1)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(16)]
    texts = generate_greedy(model, tokenizer, prompts, MAX_NEW)
    items = [CalibItem(p, t.split(STOP)[0], t.split(STOP)[0], STOP) for p, t in zip(prompts, texts, strict=True)
             if t.split(STOP)[0]]
    return ScoreContext(model=model, tokenizer=tokenizer, stack=find_decoder_stack(model), batches=[],
                        calib=CalibSet(items, "own answers"), drop=1, protected=[0], metric="accuracy",
                        batch_size=16, max_new_tokens=MAX_NEW)


def test_sublayer_accuracy_equals_generation(digits_ctx):
    """Teacher-forced exact match from the shared prefix = generating each answer with the sublayer skipped."""
    result = score_sublayers("ablation", digits_ctx, ("attn",))
    items = digits_ctx.calib.items
    assert result.details["base"] == 0.0 and any(score for score in result.scores.values())  # not all alike
    for sub, score in result.scores.items():
        assert score == pytest.approx(_generated_correct(digits_ctx, items, [sub]).count(False) / len(items)), sub


def test_iterative_sublayer_accuracy_equals_generation_with_each_removal_kept(digits_ctx):
    """Iterative accuracy ablation: at each step, each candidate's error rate (base + delta) is the share of answers
    generated wrong with the sublayers removed so far and that candidate skipped; the cheapest (servable) goes."""
    import dataclasses

    ctx = dataclasses.replace(digits_ctx, iterative=True, drop=2)
    result = score_sublayers("ablation", ctx, ("attn",))
    items = ctx.calib.items
    removed: list[Sublayer] = []
    assert len(result.steps) == 2
    for step in result.steps:
        assert step["base"] == pytest.approx(_generated_correct(ctx, items, removed).count(False) / len(items))
        for name, delta in step["deltas"].items():
            wrong = _generated_correct(ctx, items, [*removed, _sub(name)]).count(False) / len(items)
            assert step["base"] + delta == pytest.approx(wrong), name
        removed.append(_sub(step["dropped"]))
    assert result.drop == sorted(removed)


def residual_updates(model, batch):  # noqa: ANN001, ANN202
    """Per block of a Llama, from hooks: its input x and what its attention and MLP add to the residual stream
    (their outputs)."""
    seen: dict[tuple[int, str], torch.Tensor] = {}

    def block_input(key, module, args, kwargs):  # noqa: ANN001, ANN202
        seen[key] = args[0] if args else kwargs["hidden_states"]

    def output(key, module, args, out):  # noqa: ANN001, ANN202
        seen[key] = out[0] if isinstance(out, tuple) else out

    handles = []
    for index, block in enumerate(find_decoder_stack(model).layers):
        handles += [block.register_forward_pre_hook(functools.partial(block_input, (index, "x")), with_kwargs=True),
                    block.self_attn.register_forward_hook(functools.partial(output, (index, "attn"))),
                    block.mlp.register_forward_hook(functools.partial(output, (index, "mlp")))]
    try:
        with torch.no_grad():
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def test_influence_and_angular_of_the_residual_update(tiny_models):
    """block-influence: 1 - cos(x, x + f(x)) over all tokens; angular: arccos of it / pi at each row's last token,
    with x the residual stream entering the sublayer and f(x) its output (a Llama adds it as it is)."""
    ctx = tiny_context(tiny_models("llama", 4), drop=1)
    influence, angular = (score_sublayers(name, ctx, BOTH) for name in ("block-influence", "angular"))
    totals = {(name, sub): [0.0, 0] for name in ("bi", "angular") for sub in all_sublayers(4)}
    for batch in ctx.batches:
        seen = residual_updates(ctx.model, batch)
        last = last_token_mask(batch.attention_mask)
        for block in range(4):
            x = seen[(block, "x")]
            updates = {"attn": (x, seen[(block, "attn")]), "mlp": (x + seen[(block, "attn")], seen[(block, "mlp")])}
            for part, (before, update) in updates.items():
                for name, value in (("bi", update_influence(before, update, batch.attention_mask)),
                                    ("angular", angular_distance(before, before + update, last))):
                    totals[(name, Sublayer(block, part))][0] += value[0]
                    totals[(name, Sublayer(block, part))][1] += value[1]
    expected = {key: total / count for key, (total, count) in totals.items()}
    for name, result in (("bi", influence), ("angular", angular)):
        wanted = {sub: expected[(name, sub)] for sub in all_sublayers(4)}
        assert result.scores == pytest.approx(wanted, rel=1e-4, abs=1e-7), name
        assert result.drop == lowest({s: v for s, v in wanted.items() if s.block != 0}, 1)


def test_recipe_reads_blocks_and_sublayers():
    assert PruneRecipe.model_validate({"layers": ["2", 4]}).layers == [2, 4]  # old recipes and flags: ints
    recipe = PruneRecipe(granularity="sublayer", layers=[" 12.attn", "3.mlp"])
    assert recipe.layers == ["12.attn", "3.mlp"] and recipe.parts == ("attn", "mlp") and recipe.n_drop == 2
    assert PruneRecipe(granularity="mlp", drop=3).parts == ("mlp",)
    assert PruneRecipe(drop=1).granularity == "block"


def prune_args(model, *extra: str) -> list[str]:  # noqa: ANN001
    return ["prune", "--model", str(model), "--calib", "arithmetic", "--calib-samples", "8", "--batch-size", "4",
            *extra]


BAD = [
    (["--layers", "2.attn"], "--granularity attention, mlp or sublayer"),
    (["--granularity", "attention", "--layers", "2.mlp"], "BLOCK.attn, not 2.mlp"),
    (["--granularity", "mlp", "--layers", "2"], "BLOCK.mlp, not 2"),
    (["--granularity", "sublayer", "--layers", "2.attn,2.attn"], "more than once"),
    (["--granularity", "sublayer", "--layers", "2.atn"], "cannot read"),
    (["--granularity", "sublayer", "--layers", "9.attn"], "out of range"),
    (["--granularity", "sublayer", "--layers", "0.mlp"], "protected"),
    (["--granularity", "attention", "--drop", "2", "--score", "taylor"], "whole blocks only"),
    (["--granularity", "attention", "--drop", "6"], "only 5 are unprotected"),
    (["--granularity", "sublayer", "--drop", "1", "--block-major"], "block-major"),
]


@pytest.mark.parametrize(("flags", "needle"), BAD)
def test_bad_sublayer_requests(capsys, tiny_llama, tmp_path, flags, needle):
    code, _, err = run_cli(capsys, [*prune_args(tiny_llama, *flags), "--dry-run"])
    assert_one_line_error(code, err, needle)


def test_streamed_plan_refuses_sublayers(capsys, tiny_llama, tmp_path):
    config_dir = tmp_path / "config-only"
    config_dir.mkdir()
    (config_dir / "config.json").write_text((tiny_llama / "config.json").read_text())
    code, _, err = run_cli(capsys, [*prune_args(config_dir, "--granularity", "attention", "--drop", "1"), "--dry-run"])
    assert_one_line_error(code, err, "whole blocks only")


def test_dry_run_plan(capsys, tiny_llama, tmp_path):
    code, out, err = run_cli(capsys, [*prune_args(tiny_llama, "--granularity", "sublayer", "--layers", "2.attn,3.mlp"),
                                      "--dry-run", "--json", "--output", str(tmp_path / "out")])
    assert code == 0, err
    text, _, dumped = out.partition("dry run: nothing written\n")
    report = json.loads(dumped)
    assert report["removed_sublayers"] == ["2.attn", "3.mlp"] and report["dropped"] == []
    layers = find_decoder_stack(AutoModelForCausalLM.from_pretrained(tiny_llama)).layers
    gone = (layers[2].self_attn, layers[2].input_layernorm, layers[3].mlp, layers[3].post_attention_layernorm)
    removed = sum(p.numel() for m in gone for p in m.parameters())  # the layout keeps no norm of a removed sublayer
    assert report["params_before"] - report["params_after"] == removed
    assert report["kv_cache_kept"] == pytest.approx(5 / 6)
    assert "removed sublayers (original numbering): 2.attn, 3.mlp" in text
    assert "KV cache kept: 5/6 attention sublayers" in text and "blocks 6 -> 6" in text
    assert not (tmp_path / "out").exists()


def test_scored_dry_run_counts_a_whole_block(capsys, tiny_llama):
    code, out, err = run_cli(capsys, [*prune_args(tiny_llama, "--granularity", "sublayer", "--drop", "3", "--score",
                                                  "last"), "--dry-run", "--json"])
    assert code == 0, err
    report = json.loads(out.partition("dry run: nothing written\n")[2])
    assert report["removed_sublayers"] == ["4.mlp", "5.attn", "5.mlp"]
    assert report["dropped"] == [5] and report["kept"] == [0, 1, 2, 3, 4] and report["num_blocks_after"] == 5
    assert report["sublayer_scores"]["5.mlp"] == 0.0 and len(report["sublayer_scores"]) == 12


@pytest.fixture(scope="module")
def expressible_llama(tmp_path_factory) -> Path:
    """A tiny llama the Nemotron-NAS layout carries (intermediate 256: the layout's widths are multiples of 256)."""
    directory = tmp_path_factory.mktemp("expressible") / "llama"
    config = tiny_config("llama", 6)
    config.intermediate_size = 256
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.08)
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def test_a_layout_that_cannot_carry_the_model_is_refused_before_scoring(capsys, tiny_llama, tmp_path):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, [*prune_args(tiny_llama, "--granularity", "attention", "--layers", "2.attn"),
                                    "--output", str(out)])
    assert_one_line_error(code, err, "multiple of 256")
    assert not out.exists()


def test_a_sublayer_prune_saves_the_layout_verified_with_its_report(capsys, expressible_llama, tmp_path):
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, [*prune_args(expressible_llama, "--granularity", "sublayer", "--drop", "3",
                                                     "--score", "block-influence"), "--output", str(out)])
    assert code == 0, err
    report = json.loads((out / "prune_report.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert report["recipe"]["granularity"] == "sublayer" and len(report["removed_sublayers"]) == 3
    assert set(report["sublayer_scores"]) == {f"{b}.{p}" for b in range(6) for p in ("attn", "mlp")}
    removed = {tuple(name.split(".")) for name in report["removed_sublayers"]}
    blocks = [b for b in range(6) if (str(b), "attn") not in removed or (str(b), "mlp") not in removed]
    assert config["model_type"] == "nemotron-nas" and len(config["block_configs"]) == len(blocks)
    for index, block in enumerate(blocks):
        assert config["block_configs"][index]["attention"]["no_op"] == ((str(block), "attn") in removed)
        assert config["block_configs"][index]["ffn"]["no_op"] == ((str(block), "mlp") in removed)
    assert report["verification"]["max_abs_diff"] <= report["verification"]["tolerance"]
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.num_parameters() == report["params_after"]
    assert f"output: {out}" in stdout


def test_servable_lowest_skips_what_the_layout_refuses():
    scores = {_sub("0.attn"): 0.0, _sub("1.attn"): 0.3, _sub("0.mlp"): 0.5, _sub("1.mlp"): 0.2, _sub("2.attn"): 0.1}
    assert servable_lowest(scores, 1, 3) == [_sub("2.attn")]  # 0.attn alone would leave block 0 first, attention-less
    assert servable_lowest(scores, 4, 3) == [_sub("0.mlp"), _sub("1.attn"), _sub("1.mlp"), _sub("2.attn")]
    assert servable_lowest(scores, 1, 3, [_sub("0.mlp")]) == [_sub("0.attn")]  # then block 0 goes whole
    assert servable_lowest({_sub("0.attn"): 0.0, _sub("1.attn"): 0.1}, 2, 2) == [_sub("1.attn")]  # one attention kept
    assert most_removable(3, scores) == 4 and most_removable(2, [_sub("1.attn")]) == 1
    assert most_removable(2, all_sublayers(2)) == 3 and most_removable(3, all_sublayers(2)) == 4


def _without_first_attention(source: Path, directory: Path) -> Path:
    """`source` with block 0's attention writing nothing (o_proj zero): the cheapest sublayer by any score."""
    model = AutoModelForCausalLM.from_pretrained(source)
    with torch.no_grad():
        find_decoder_stack(model).layers[0].self_attn.o_proj.weight.zero_()
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(source).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("parts", [("attn",), BOTH])
def test_scores_never_pick_what_the_layout_refuses(tiny_models, tmp_path, parts):
    path = _without_first_attention(tiny_models("llama", 4), tmp_path / "model")
    ctx = tiny_context(path, protected=[3], drop=1)
    result = score_sublayers("block-influence", ctx, parts)
    assert min(result.scores, key=lambda sub: result.scores[sub]) == _sub("0.attn")
    assert result.drop == servable_lowest({s: v for s, v in result.scores.items() if s.block != 3}, 1, 4)
    assert _sub("0.attn") not in result.drop


def test_a_layout_refused_removal_is_not_scored_into_a_save(capsys, expressible_llama, tmp_path):
    path = _without_first_attention(expressible_llama, tmp_path / "model")
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, [*prune_args(path, "--granularity", "attention", "--drop", "2", "--score",
                                                "block-influence", "--protect", "5"), "--output", str(out)])
    assert code == 0, err
    report = json.loads((out / "prune_report.json").read_text())
    assert "0.attn" not in report["removed_sublayers"] and len(report["removed_sublayers"]) == 2
    assert min(report["sublayer_scores"], key=lambda name: report["sublayer_scores"][name] or 1e9) == "0.attn"


LAYOUT_REFUSED = [
    (["--granularity", "attention", "--drop", "5", "--protect", "5"], "at most 4 of the 5 unprotected"),
    (["--granularity", "sublayer", "--drop", "10", "--protect", "5", "--score", "last"], None),  # block 5 stays
    (["--granularity", "sublayer", "--layers", "0.attn", "--protect", "5"], "first kept block (0)"),
    (["--granularity", "attention", "--layers", "1.attn,2.attn", "--protect", "0"], None),
]


@pytest.mark.parametrize(("flags", "needle"), LAYOUT_REFUSED)
def test_a_removal_no_selection_can_serve_is_refused_before_scoring(capsys, tiny_llama, flags, needle):
    code, _, err = run_cli(capsys, [*prune_args(tiny_llama, *flags), "--dry-run"])
    if needle is None:
        assert code == 0, err
    else:
        assert_one_line_error(code, err, needle)
