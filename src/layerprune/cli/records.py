"""`layerprune records pack RUN -o FILE.tar.gz` / `records unpack FILE.tar.gz -o DIR`: a run's per-item records and
reports, without document text, to keep beside its report and to redo its paired comparisons later."""

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


def run(args: argparse.Namespace) -> int:
    from layerprune.pipeline.records import pack_records, unpack_records

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
