"""`evaluate --backend llamacpp`: a GGUF scored by llama.cpp itself (llama-cpp-python, in process), so a quantized or
Nemotron-NAS (`deci`) export is measured as llama.cpp runs it, not as transformers dequantizes it.

lm-eval's own GGUF model talks to a llama.cpp server over HTTP; this is the same contract in process: `TemplateLM`
does the context/continuation split as HFLM does, llama.cpp gives every position's logits (`logits_all`), and a
request that shares a prefix with the one before reuses its KV cache (the choices of one question). Tokens are
llama.cpp's own; no BOS is added unless the architecture is Gemma's, as HFLM does.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
from lm_eval.api.model import TemplateLM

from layerprune.core.errors import LayerpruneError
from layerprune.core.extras import require_extra
from layerprune.core.settings import RunSettings
from layerprune.evaluate.handle import ModelHandle
from layerprune.models import ModelSource

CONTEXT = 2048  # at most: llama.cpp keeps n_ctx x vocabulary logits (2048 x 262k floats is 2 GiB for Gemma-3)


class LlamaCppLM(TemplateLM):
    """lm-eval's LM over llama.cpp's context on one GGUF file."""

    def __init__(self, path: Path, threads: int | None = None, n_ctx: int = CONTEXT) -> None:
        super().__init__()
        from llama_cpp import Llama  # type: ignore[import-not-found]

        try:  # the model's own context, as HFLM's max_length, capped: every position's logits are kept
            self.llm = Llama(model_path=str(path), n_ctx=min(n_ctx, _trained_context(path) or n_ctx),
                             logits_all=True, verbose=False, seed=0, n_threads=threads)
        except ValueError as exc:  # llama-cpp-python's "Failed to load model from file"
            raise LayerpruneError(f"llama.cpp cannot load {path.name}: {exc}") from exc
        meta = self.llm.metadata
        self.add_bos = meta.get("general.architecture", "").startswith("gemma")
        self.template = meta.get("tokenizer.chat_template")
        self.n_ctx = self.llm.n_ctx()
        self.path = path

    @property
    def eot_token_id(self) -> int:
        return int(self.llm.token_eos())

    @property
    def prefix_token_id(self) -> int:
        bos = self.llm.token_bos()
        return int(bos) if bos is not None and bos >= 0 else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return f"llamacpp:{self.path.name}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        bos = self.add_bos if add_special_tokens is None else add_special_tokens
        return list(self.llm.tokenize(string.encode(), add_bos=bos, special=True))

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              **kwargs: Any) -> list[tuple[float, bool]]:
        return [self._score(context, continuation) for _, context, continuation in requests]

    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Sum of the continuation's log-probabilities and whether each was the top token (HFLM's truncation:
        the last n_ctx + 1 tokens, the final one only predicted)."""
        tokens = (context + continuation)[-(self.n_ctx + 1):][:-1]
        logits = self._logits(tokens)[-len(continuation):].astype(np.float64)
        log_probs = logits - logits.max(-1, keepdims=True)
        log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
        picked = log_probs[np.arange(len(continuation)), continuation]
        return float(picked.sum()), bool((logits.argmax(-1) == np.asarray(continuation)).all())

    def _logits(self, tokens: list[int]) -> np.ndarray:
        """Logits at every position of `tokens`; the positions shared with the previous request are kept."""
        done = self.llm.n_tokens
        shared = 0
        previous = self.llm.input_ids[:done]
        while shared < min(done, len(tokens) - 1) and previous[shared] == tokens[shared]:
            shared += 1
        self.llm.n_tokens = shared
        self.llm.eval(tokens[shared:])
        return np.asarray(self.llm.scores[: len(tokens)])

    def loglikelihood_rolling(self, requests: Any, disable_tqdm: bool = False) -> list[float]:
        raise LayerpruneError("--backend llamacpp scores choice and generation tasks; perplexity tasks "
                              "(loglikelihood_rolling) are not supported, use --backend hf")

    def generate_until(self, requests: Any, disable_tqdm: bool = False) -> list[str]:
        return [self._generate(*request.args) for request in requests]

    def _generate(self, context: str, gen_kwargs: dict[str, Any]) -> str:
        """Greedy continuation (a sampling request is refused), cut at the first stop string, as HFLM cuts it."""
        if gen_kwargs.get("do_sample") or (gen_kwargs.get("temperature") or 0) > 0:
            raise LayerpruneError("--backend llamacpp decodes greedily; a sampled task needs --backend hf")
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        limit = int(gen_kwargs.get("max_gen_toks") or 256)
        prompt = self.tok_encode(context)[-(self.n_ctx - limit):]
        new: list[int] = []
        text = ""
        for token in self.llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if token == self.eot_token_id or len(new) >= limit:
                break
            new.append(int(token))
            text = self.llm.detokenize(new).decode(errors="ignore")
            if any(stop in text for stop in until):
                break
        for stop in until:
            text = text.split(stop)[0]
        return text

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The GGUF's own chat template (tokenizer.chat_template), rendered as transformers renders it."""
        if not self.template:
            raise LayerpruneError(f"{self.path.name} carries no chat template (tokenizer.chat_template); "
                                  "use --chat-template off")
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(conversations=[chat_history], chat_template=self.template,
                                            add_generation_prompt=add_generation_prompt,
                                            bos_token=self._piece(self.llm.token_bos()),
                                            eos_token=self._piece(self.llm.token_eos()))
        return rendered[0]

    def _piece(self, token: int) -> str:
        return self.llm.detokenize([token], special=True).decode(errors="ignore") if token >= 0 else ""


def llamacpp_handle(model: Any, run: RunSettings) -> ModelHandle:
    """The handle of a GGUF file scored by llama.cpp: its digest is the file's own (not a conversion's), so the
    cache never mixes it with the same file read by transformers."""
    path = Path(str(model)) if model is not None else None
    if path is None or path.suffix != ".gguf" or not path.is_file():
        raise LayerpruneError(f"--backend llamacpp scores a .gguf file; {model} is not one")
    require_extra("gguf-run", "--backend llamacpp")
    digest = _file_digest(path)
    source = ModelSource(str(model), str(path), "gguf-llamacpp", {"gguf_file": path.name, "sha256": digest})
    handle = ModelHandle(source, run, lm=LlamaCppLM(path, threads=_threads(run)))
    handle.digest = hashlib.sha256(f"llamacpp:{digest}".encode()).hexdigest()
    return handle


def gguf_vocabulary(spec: Any) -> tuple[str, ...]:
    """The token list a GGUF file carries (a file that is not one: the handle's one-line refusal)."""
    from layerprune.models.gguf_once import fast_reader

    path = Path(str(spec))
    if path.suffix != ".gguf" or not path.is_file():
        raise LayerpruneError(f"--backend llamacpp scores a .gguf file; {spec} is not one")
    return tuple(fast_reader(path).fields["tokenizer.ggml.tokens"].contents())


def _trained_context(path: Path) -> int | None:
    from layerprune.models.gguf_once import fast_reader

    fields = fast_reader(path).fields
    arch = fields["general.architecture"].contents()
    length = fields.get(f"{arch}.context_length")
    return int(length.contents()) if length is not None else None


def _threads(run: RunSettings) -> int | None:
    import torch

    return max(1, torch.get_num_threads()) if run.resolved_device().type == "cpu" else None


def _file_digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            sha.update(chunk)
    return sha.hexdigest()
