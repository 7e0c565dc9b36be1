"""The one verdict every engine gets against transformers (models/verification.compare): top-1 at every position of
prompt + continuation up to near-ties, continuations cut at the same end tokens; a planted error reads "different",
a rounding-only change does not; check-serve with an engine that keeps the stop token (as vLLM does) passes."""

from __future__ import annotations

import importlib.util
import json
import sys
import types

import pytest
import torch
from transformers import LlamaConfig

from layerprune.core.settings import RunSettings
from layerprune.models.verification import Reference, compare, near_tie_for, reference, transformers_verdict
from tiny import tiny_tokenizer
from verdict_models import confident, end_early, rounded, save, wrong_norm

TINY = dict(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def hand_reference() -> Reference:
    """One prompt of 2 tokens, continuation [5, 6] (then end token 2): 4 positions; position 1 (predicting 5) is
    decisive, position 2 (predicting 6 over 7 by 0.01) a near-tie."""
    logits = torch.zeros(4, 8)
    logits[0, 3] = 4.0  # predicts prompt token 3 (decisive)
    logits[1, 5] = 4.0  # predicts 5 (decisive)
    logits[2, 6], logits[2, 7] = 4.0, 3.99  # predicts 6, 7 a near-tie
    logits[3, 2] = 4.0  # predicts the end token
    return Reference([[1, 3]], [[5, 6]], [logits.argmax(-1).tolist()], [logits], [2], max_new_tokens=16)


def test_the_verdict_counts_near_ties_and_fails_only_a_decisive_difference():
    expected = hand_reference()
    same = compare(expected, [[3, 5, 6, 2]], [[5, 6, 2]], near_tie=0.05)
    assert same["verdict"] == "equal" and same["passed"] and same["top1_agreement"] == "3/3"
    assert same["near_ties"] == 1 and same["continuations"]["equal"] == 1  # the engine kept its stop token: cut
    tie = compare(expected, [[3, 5, 7, 2]], [[5, 7, 2]], near_tie=0.05)
    assert tie["verdict"] == "equal up to 1 near-tie" and tie["passed"]
    assert tie["continuations"]["parted_at_near_tie"] == [True] and tie["top1_agreement"] == "3/3"
    wrong = compare(expected, [[3, 4, 6, 2]], [[4, 6]], near_tie=0.05)
    assert wrong["verdict"] == "different" and not wrong["passed"] and wrong["differing"] == [[0, 1]]
    assert wrong["top1_agreement"] == "2/3"
    on = compare(expected, [[3, 5, 6, 2]], [[5, 6, 9]], near_tie=0.05)  # went on past transformers' end token
    assert on["verdict"] == "different" and on["differing"] == [[0, 3]]
    # where every position is a near-tie nothing is compared, and the report says so
    loose = compare(expected, [[3, 4, 7, 2]], None, near_tie=10.0)
    assert loose["verdict"] == "equal up to 2 near-ties" and loose["near_ties"] == 4
    assert loose["top1_agreement"] == "0/0"


def test_the_threshold_is_stated_by_the_engines_encoding():
    assert near_tie_for("torch.float32") == near_tie_for("f32") == 0.05
    assert near_tie_for("bf16") == near_tie_for("q8_0") == 0.25
    assert near_tie_for("q4_k_m") == 1.0


@pytest.fixture(scope="module")
def tiny_confident():
    tokenizer = tiny_tokenizer()
    model = confident(LlamaConfig(**TINY))
    return model, tokenizer, reference(model, tokenizer)


def test_a_wrong_norm_reads_different(tiny_confident):
    model, tokenizer, expected = tiny_confident
    result = transformers_verdict(wrong_norm(model), tokenizer, expected, near_tie_for("q8_0"))
    assert result["verdict"] == "different" and not result["passed"] and result["differing"]
    assert result["max_abs_logit_diff"] > 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounding_every_weight_does_not_read_different(tiny_confident, dtype):
    model, tokenizer, expected = tiny_confident
    result = transformers_verdict(rounded(model, dtype), tokenizer, expected, near_tie_for(str(dtype)))
    assert result["verdict"].startswith("equal") and result["passed"], result
    decisive = int(result["top1_agreement"].split("/")[1])
    assert decisive >= 0.5 * result["positions"]  # the model is confident: most positions are compared
    assert 0 < result["max_abs_logit_diff"] < 0.5


def test_the_same_model_is_equal_with_its_end_token_inside_the_window(tmp_path):
    tokenizer = tiny_tokenizer()
    model = end_early(confident(LlamaConfig(**TINY)), tokenizer, end_id=2)
    expected = reference(model, tokenizer)
    assert len(expected.continuations[0]) <= 2 < 16  # it ends inside the window
    result = transformers_verdict(model, tokenizer, expected)
    assert result["verdict"] == "equal" and result["max_abs_logit_diff"] == 0.0
    assert result["continuations"]["equal"] == 4


class FakeVllm:
    """vLLM's LLM as it answers: transformers' greedy tokens with the stop token kept in `token_ids`, prompt
    log-probs (the prompt token's and the top-1's, with ranks) for a teacher-forced request."""

    def __init__(self, model, end_ids):
        self.model, self.end_ids = model, end_ids

    def generate(self, prompts, params):
        return [self._one(p["prompt_token_ids"], params) for p in prompts]

    def _one(self, ids, params):
        with torch.no_grad():
            logits = self.model(torch.tensor([ids])).logits[0].log_softmax(-1)
        if params.get("prompt_logprobs"):
            rows = [None] + [self._logprobs(logits[i], ids[i + 1]) for i in range(len(ids) - 1)]
            last = int(logits[-1].argmax())
            return types.SimpleNamespace(prompt_logprobs=rows, outputs=[types.SimpleNamespace(
                token_ids=[last], logprobs=[self._logprobs(logits[-1], last)])])
        new = []
        while len(new) < params["max_tokens"]:
            with torch.no_grad():
                token = int(self.model(torch.tensor([ids + new])).logits[0, -1].argmax())
            new.append(token)
            if token in self.end_ids:
                break  # vLLM stops here and keeps the stop token
        return types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=new)])

    @staticmethod
    def _logprobs(row, token):
        top = int(row.argmax())
        return {t: types.SimpleNamespace(logprob=float(row[t]), rank=int((row > row[t]).sum()) + 1)
                for t in {top, token}}


def test_check_serve_passes_an_engine_that_keeps_its_stop_token(tmp_path, monkeypatch):
    """Issue 57: vLLM keeps the stop token in `token_ids`, generate_ids cuts at the first end token: check-serve
    failed 2/4 on a model vLLM serves correctly. Both sides are cut at the same end tokens now."""
    from layerprune.models import serving

    tokenizer = tiny_tokenizer()
    model = end_early(confident(LlamaConfig(**TINY)), tokenizer, end_id=2)
    folder = save(model, tokenizer, tmp_path / "early")
    fake = types.SimpleNamespace(SamplingParams=lambda **kw: kw, __version__="0.fake")
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(serving, "require_vllm", lambda flag: None)
    monkeypatch.setattr(serving, "start_llm", lambda directory, engine: FakeVllm(model, [2]))
    monkeypatch.setattr(serving, "shutdown_llm", lambda llm: None)
    result = serving.check_serve(folder, RunSettings(device="cpu"))
    assert result["passed"] and result["verdict"] == "equal" and result["equal"] == result["of"] == 4
    assert result["vllm_as_generated"][0][-1] == 2 and result["vllm"] == result["transformers"]
    assert result["max_abs_logprob_diff"] < 1e-4 and result["near_tie_threshold"] == 0.05
    assert json.loads((folder / serving.SERVE_CHECK).read_text())["passed"] is True
    monkeypatch.setattr(serving, "start_llm", lambda directory, engine: FakeVllm(wrong_norm(model), [2]))
    broken = serving.check_serve(folder, RunSettings(device="cpu"))
    assert broken["verdict"] == "different" and not broken["passed"]


@pytest.fixture(scope="module")
def gguf_confident(tmp_path_factory):
    """A confident tiny llama with SmolLM2's vocabulary (its GGUF the recorded source) that ends its first
    continuation with a second end token (id 0, <|endoftext|>; generation_config's eos [2, 0]) 2 tokens in, and a
    copy of it with a wrong norm."""
    from transformers import AutoTokenizer

    from test_export import smollm_gguf

    source = smollm_gguf()
    root = tmp_path_factory.mktemp("gguf-verdict")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    model = confident(config)
    model.generation_config.eos_token_id = [2, 0]
    model = end_early(model, tokenizer, end_id=0)
    folders = {"right": save(model, tokenizer, root / "right"), "wrong": save(wrong_norm(model), tokenizer,
                                                                              root / "wrong")}
    for folder in folders.values():
        (folder / "source.json").write_text(json.dumps({"gguf": str(source)}))
    return folders


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_a_gguf_read_back_by_transformers_is_not_different_and_a_wrong_one_is(gguf_confident, tmp_path, outtype):
    """The read-back's verdict: F32 equal, Q8_0 at most its near-ties; the GGUF of a model with a wrong norm, read
    back against the right directory, "different". The first continuation ends at id 0 inside the window."""
    from layerprune.export import export_gguf
    from layerprune.export.readback import read_back

    back = export_gguf(gguf_confident["right"], tmp_path / "m.gguf", outtype).readback
    assert back["passed"] and back["verdict"].startswith("equal"), back
    parted = back["continuations"]
    assert back["near_tie_threshold"] == near_tie_for(outtype) and len(parted["transformers"][0]) <= 2
    ties = zip(parted["first_difference"], parted["parted_at_near_tie"], strict=True)
    assert all(p is None or tie for p, tie in ties)  # a continuation may part only at a near-tie
    if outtype == "f32":
        assert back["verdict"] == "equal" and back["max_abs_logit_diff"] < 1e-3 and parted["equal"] == 4
    export_gguf(gguf_confident["wrong"], tmp_path / "wrong.gguf", outtype, verify=False)
    wrong = read_back(gguf_confident["right"], tmp_path / "wrong.gguf")
    assert wrong["verdict"] == "different" and not wrong["passed"] and wrong["max_abs_logit_diff"] > 1.0


@pytest.mark.skipif(not importlib.util.find_spec("llama_cpp"), reason="needs llama-cpp-python (the gguf-run extra)")
def test_llama_cpp_continues_past_a_second_end_token_and_the_check_cuts_both(gguf_confident, tmp_path):
    """llama.cpp stops at its GGUF's eos (2) only; transformers stops at generation_config's [2, 0]. Cut at the same
    end tokens, F32 reads "equal" with every continuation equal; the wrong norm's file reads "different"."""
    from layerprune.export import export_gguf
    from layerprune.export.llamacpp import compare_with_transformers

    export_gguf(gguf_confident["right"], tmp_path / "m.gguf", "f32", verify=False)
    ran = compare_with_transformers(tmp_path / "m.gguf", gguf_confident["right"])
    assert ran["tokenization_equal"] == "4/4" and ran["verdict"] == "equal", ran
    assert ran["continuations"]["equal"] == 4 and len(ran["transformers"][0]) <= 2
    assert ran["llama_cpp"] == ran["transformers"] and ran["max_abs_logit_diff"] < 0.05  # float32 compute order
    export_gguf(gguf_confident["wrong"], tmp_path / "wrong.gguf", "f32", verify=False)
    wrong = compare_with_transformers(tmp_path / "wrong.gguf", gguf_confident["right"])
    assert wrong["verdict"] == "different" and not wrong["passed"]
