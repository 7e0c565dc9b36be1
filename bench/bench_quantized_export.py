"""Depth and bits together: the embedded SmolLM2-135M, unpruned and pruned, exported at F16, Q8_0 and llama.cpp's
k-quants, each run by llama.cpp (llama-cpp-python) against transformers on the same model directory.

    python bench/bench_quantized_export.py
    python bench/bench_quantized_export.py --outtypes f16,q4_k_m --work /tmp/bench-quant
    python bench/bench_quantized_export.py --outtypes f16,q8_0,q4_k_m --speed --scores arc_easy,piqa,copy_l7 \
        --limit 100 --work /tmp/bench-quant
    python bench/bench_quantized_export.py --run runs/demo --outtypes f16,q8_0,q4_k_m --speed \
        --scores arc_easy,piqa,copy_l7 --limit 200 --work /tmp/bench-quant-run

Per (model, type): file size, the tensor types llama.cpp's quantizer chose, mean KL(transformers || llama.cpp) and
top-1 agreement at every position of prompt + continuation where transformers' top-2 margin is above the type's
near-tie threshold, the verdict and the near-ties that flipped (models/verification.compare), tokenization and greedy
continuation agreement (4 prompts, 16 tokens). F16 and Q8_0 are written by the gguf package; the others by llama.cpp's
quantizer from the F16 file. With --speed, llama.cpp's prefill and decode tokens/s of every file, measured in rounds
that alternate the files (medians; ratios to the unpruned file of the same type). With --scores, every file scored by
llama.cpp itself (`layerprune evaluate --backend llamacpp`), each pruned file paired with the unpruned file of the
same type (95% paired intervals), and each unpruned file paired with the unpruned F16 file (the bits' own cost).
Markdown rows at the end.

With --run DIR (a `layerprune run` output folder), the models are the unpruned one and that run's pruned/ and
recovered/ models (instead of the fixed prunes above), and each type is scored three ways in one paired comparison:
the unpruned, pruned and recovered files of that type, so the table gives what pruning cost and the share recovery won
back *at that quantization*, with paired intervals; then each pruned and recovered file against its own F16 file
(the bits' cost to that model).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

PRUNES = {"unpruned": None, "blocks 20-23": ["--layers", "20,21,22,23"],
          "7 sublayers": ["--granularity", "sublayer", "--layers",
                          "20.attn,22.attn,24.attn,25.mlp,27.attn,27.mlp,28.attn"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outtypes", default="f16,q8_0,q6_k,q5_k_m,q4_k_m")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--speed", action="store_true", help="llama.cpp prefill/decode tokens/s per file")
    parser.add_argument("--rounds", type=int, default=5, help="speed rounds (each times every file once)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scores", default=None, help="tasks scored by llama.cpp on every file (comma-separated)")
    parser.add_argument("--limit", type=int, default=100, help="documents per scored task")
    parser.add_argument("--run", type=Path, default=None,
                        help="a `layerprune run` output folder: its pruned/ and recovered/ models replace the fixed "
                             "prunes, each type scored unpruned / pruned / recovered")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-quant-"))
    rows = []
    for label, model in _models(work, args.run).items():
        for outtype in args.outtypes.split(","):
            row = {"model": label, "outtype": outtype, **_measure(model, work / f"{_slug(label)}-{outtype}.gguf",
                                                                   outtype)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    files = {(row["model"], row["outtype"]): work / f"{_slug(row['model'])}-{row['outtype']}.gguf" for row in rows}
    if args.speed:
        _speed_table(files, args.rounds, args.threads)
    if args.scores and args.run is not None:
        _recovery_table(files, args.scores, args.limit, work)
    elif args.scores:
        _score_table(files, args.scores, args.limit, work)
    print("\n| model | type | MB | tensor types | mean KL (nats) | top-1 | verdict | near-ties | greedy equal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['model']} | {row['outtype']} | {row['mb']} | {row['tensor_types']} | {row['mean_kl']} | "
              f"{row['top1']} | {row['verdict']} | {row['near_ties']} | {row['greedy']} |")


def _models(work: Path, run: Path | None) -> dict[str, Path]:
    """label -> model folder: the fixed prunes, or the unpruned model with a run's pruned and recovered models."""
    if run is None:
        return {label: _model(work, label, flags) for label, flags in PRUNES.items()}
    source = json.loads((run / "run.json").read_text())["recipe"]["model"]
    if source != "embedded":
        raise SystemExit(f"--run {run}: pruned from {source}; this bench's unpruned model is the embedded one")
    folders = {"unpruned": _model(work, "unpruned", None), "pruned": run / "pruned", "recovered": run / "recovered"}
    missing = [str(f) for f in folders.values() if not (f / "config.json").is_file()]
    if missing:
        raise SystemExit(f"--run {run}: no model in {', '.join(missing)} (run `layerprune run` to the end first)")
    return folders


def _model(work: Path, label: str, flags: list[str] | None) -> Path:
    from layerprune.cli import main as cli
    from layerprune.models.loading import resolve_model

    if flags is None:
        return Path(resolve_model("embedded").location)
    directory = work / _slug(label)
    if not (directory / "config.json").is_file():
        cli(["-q", "prune", "--model", "embedded", *flags, "--dtype", "float32", "--no-verify", "-o", str(directory)])
    return directory


def _measure(model: Path, path: Path, outtype: str) -> dict:
    from layerprune.export import export_gguf
    from layerprune.export.llamacpp import compare_with_transformers
    from layerprune.export.quantize import logit_agreement

    report = export_gguf(model, path, outtype, overwrite=True, verify=False)
    logits = logit_agreement(path, model)
    ran = compare_with_transformers(path, model)
    types = (report.quantized or {}).get("tensor_types") or {f"{outtype.upper()} (2-D; gguf package)": report.tensors}
    return {"mb": round(report.bytes / 1e6, 1), "tensor_types": " ".join(f"{k}:{v}" for k, v in types.items()),
            "mean_kl": logits["mean_kl"], "top1": logits["top1_agreement"], "verdict": ran["verdict"],
            "near_ties": f"{ran['near_ties_differing']} of {ran['near_ties']} flipped",
            "tokenization": ran["tokenization_equal"],
            "greedy": f"{ran['continuations']['equal']}/{ran['continuations']['of']}",
            "first_difference": ran["continuations"]["first_difference"]}


PROMPT = ("The committee met on a grey morning to settle the budget for the coming year. Each member had brought "
          "notes, tables and a list of questions about the roads, the schools and the library. ") * 8


def _speed_table(files: dict[tuple[str, str], Path], rounds: int, threads: int,
                 prefill: int = 128, decode: int = 64) -> None:
    """Prefill and decode tokens/s of every file in llama.cpp, `rounds` rounds alternating the files."""
    import statistics
    import time

    from llama_cpp import Llama  # type: ignore[import-not-found]

    loaded = {key: Llama(model_path=str(path), n_ctx=prefill + decode + 8, n_threads=threads, verbose=False)
              for key, path in files.items()}
    times: dict[tuple[str, str], list[tuple[float, float]]] = {key: [] for key in files}
    for _ in range(rounds):
        for key, llm in loaded.items():
            tokens = llm.tokenize(PROMPT.encode(), add_bos=False)[:prefill]
            llm.reset()
            start = time.perf_counter()
            llm.eval(tokens)
            middle = time.perf_counter()
            for token in tokens[:decode]:  # one token at a time: decode's cost does not depend on the token
                llm.eval([token])
            times[key].append((prefill / (middle - start), decode / (time.perf_counter() - middle)))
    print(f"\n| model | type | prefill tok/s | decode tok/s | prefill / unpruned | decode / unpruned |  "
          f"({rounds} rounds, {threads} threads, {prefill}-token prompt, {decode} decoded; medians)")
    print("|---|---|---|---|---|---|")
    medians = {key: (statistics.median(p for p, _ in t), statistics.median(d for _, d in t))
               for key, t in times.items()}
    for (model, outtype), (p, d) in medians.items():
        base = medians.get(("unpruned", outtype), (p, d))
        print(f"| {model} | {outtype} | {p:.0f} | {d:.1f} | {p / base[0]:.2f}x | {d / base[1]:.2f}x |", flush=True)


def _score_table(files: dict[tuple[str, str], Path], tasks: str, limit: int, work: Path) -> None:
    """Each pruned file against the unpruned file of its type, both scored by llama.cpp, paired."""
    from layerprune.cli import main as cli

    for (model, outtype), path in files.items():
        if model == "unpruned":
            continue
        output = work / f"scores-{_slug(model)}-{outtype}"
        print(f"\n## {model}, {outtype}: llama.cpp, paired with the unpruned {outtype} file", flush=True)
        cli(["evaluate", "--backend", "llamacpp", "--baseline", str(files[("unpruned", outtype)]),
             "--model", str(path), "--tasks", *tasks.split(","), "--limit", str(limit), "--output", str(output),
             "--overwrite"])
    _bits_alone(work)


def _recovery_table(files: dict[tuple[str, str], Path], tasks: str, limit: int, work: Path) -> None:
    """Per type: the unpruned, pruned and recovered files scored by llama.cpp, one paired comparison (what pruning
    cost and the share recovery won back at that type); then each pruned and recovered file against its F16 file."""
    from layerprune.cli import main as cli

    for outtype in dict.fromkeys(t for _, t in files):
        output = work / f"scores-run-{outtype}"
        print(f"\n## unpruned / pruned / recovered, {outtype}: llama.cpp, paired", flush=True)
        cli(["evaluate", "--backend", "llamacpp", "--baseline", str(files[("unpruned", outtype)]),
             "--pruned", str(files[("pruned", outtype)]), "--model", str(files[("recovered", outtype)]),
             "--tasks", *tasks.split(","), "--limit", str(limit), "--output", str(output), "--overwrite"])
    _against_f16(work)


def _against_f16(work: Path) -> None:
    """Each role's file at a type paired with the same role's F16 file (nothing scored again)."""
    runs = {path.name.rsplit("-", 1)[-1]: path for path in sorted(work.glob("scores-run-*"))}
    for role in ("baseline", "pruned", "recovered"):
        _pair_with_f16({t: folder / role for t, folder in runs.items()}, role, work)


def _bits_alone(work: Path) -> None:
    """The quantization's own cost: each unpruned file's scores (the baselines above) paired with the unpruned F16
    file's, item by item (nothing scored again)."""
    _pair_with_f16({path.name.rsplit("-", 1)[-1]: path / "baseline" for path in sorted(work.glob("scores-*"))},
                   "unpruned", work)


def _pair_with_f16(folders: dict[str, Path], label: str, work: Path) -> None:
    """Each type's evaluation folder (type -> folder) paired with the F16 one, item by item; printed."""
    from layerprune.evaluate.report import compare
    from layerprune.evaluate.summary import read_summary

    folders = {t: f for t, f in folders.items() if (f / "summary.json").is_file()}
    if "f16" not in folders:
        return
    for outtype, folder in folders.items():
        if outtype == "f16":
            continue
        pair = {"baseline": folders["f16"], "pruned": folder}
        result = compare({role: read_summary(f / "summary.json") for role, f in pair.items()},
                         work / f"bits-{label}-{outtype}", folders=pair)
        print(f"\n## {label} {outtype} against {label} f16 (both llama.cpp, paired)\n\n{result['table']}",
              flush=True)


def _slug(label: str) -> str:
    return label.replace(" ", "-")


if __name__ == "__main__":
    sys.exit(main())
