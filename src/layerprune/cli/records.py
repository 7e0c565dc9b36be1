"""`layerprune records pack RUN -o FILE.tar.gz` / `records unpack FILE.tar.gz -o DIR`: a run's per-item records and
reports, without document text, to keep beside its report and to redo its paired comparisons later.
`records report ARCHIVE... -o docs/results [--index] [--readme README.md]` draws each archive's result page (and the
index, and the README's table) from its records; `records check ARCHIVE` says whether it still redraws equal."""

from __future__ import annotations

import argparse
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    pack = actions.add_parser("pack", help="a run's per-item samples (document text taken out) and small reports "
                              "-> one reproducible .tar.gz")
    pack.add_argument("run", type=Path, help="A run, study or evaluation directory")
    pack.add_argument("-o", "--output", type=Path, required=True, help="The .tar.gz to write")
    unpack = actions.add_parser("unpack", help="a packed archive -> the run's tree of records, readable as the run")
    unpack.add_argument("archive", type=Path, help="A .tar.gz written by `records pack`")
    unpack.add_argument("-o", "--output", type=Path, required=True, help="The directory to write")
    for sub in (pack, unpack):
        sub.add_argument("--overwrite", action="store_true", help="Replace an existing output")
    report = actions.add_parser("report", help="archives -> their result pages, drawn from the records (the study's "
                                "report redrawn, headed by OUTPUT/questions.yaml's question and answer)")
    report.add_argument("archives", type=Path, nargs="+", metavar="ARCHIVE", help="Records archives (.tar.gz)")
    report.add_argument("-o", "--output", type=Path, default=Path("docs/results"),
                        help="The pages' folder, holding questions.yaml (default docs/results)")
    report.add_argument("--index", action="store_true", help="Also write OUTPUT/README.md: every question, its "
                        "answer and its page (give every archive)")
    report.add_argument("--readme", type=Path, help="Also fill this file's <!-- results:begin/end --> table")
    check = actions.add_parser("check", help="does an archive's report still redraw equal on the current code?")
    check.add_argument("archive", type=Path, help="A records archive (.tar.gz)")


def run(args: argparse.Namespace) -> int:
    from layerprune.pipeline.records import pack_records, unpack_records

    if args.action in ("report", "check"):
        return _results(args)
    if args.action == "pack":
        packed = pack_records(args.run, args.output, args.overwrite)
        print(f"wrote {packed.archive} ({packed.bytes / 1e3:.0f} kB): {packed.items} items in {packed.sample_files} "
              f"sample files, {packed.other_files} report files; document text left out")
        if packed.too_large:
            print(f"left out {len(packed.too_large)} file(s) over 2 MiB: {', '.join(packed.too_large)}")
        return 0
    names = unpack_records(args.archive, args.output, args.overwrite)
    print(f"unpacked {len(names)} files into {args.output}")
    return 0


def _results(args: argparse.Namespace) -> int:
    from layerprune.pipeline.results import check_archive, write_results

    if args.action == "report":
        for path in write_results(args.archives, args.output, args.index, args.readme):
            print(f"wrote {path}")
        return 0
    origin, compared, found = check_archive(args.archive)
    print("\n".join(origin))
    if not compared:
        print(f"{args.archive}: redraws on the current code (it holds no report of its own to compare with)")
        return 0
    if not found:
        print(f"{args.archive}: {', '.join(compared)} redraw(s) equal on the current code")
        return 0
    print(f"{args.archive}: {len(found)} value(s) differ when redrawn on the current code:")
    print("\n".join(f"  {line}" for line in found[:40]))
    if len(found) > 40:
        print(f"  ... {len(found) - 40} more")
    return 1
