"""The command line the fixture scripts share: build the fixtures into --out, or with --check
build them into a temporary folder and compare every file (subfolders included) byte for byte
with --out; exit status 1 names the files that differ."""

from __future__ import annotations

import argparse
import filecmp
import tempfile
from typing import Callable


def differing_files(left: str, right: str) -> list[str]:
    bad: list[str] = []

    def walk(c: filecmp.dircmp, prefix: str = "") -> None:
        bad.extend(prefix + f for f in c.left_only + c.right_only)
        _, mismatch, errors = filecmp.cmpfiles(c.left, c.right, c.common_files, shallow=False)
        bad.extend(prefix + f for f in mismatch + errors)
        for name, sub in c.subdirs.items():
            walk(sub, prefix + name + "/")

    walk(filecmp.dircmp(left, right))
    return sorted(set(bad))


def main(build: Callable[[str], None], default_out: str, description: str) -> int:
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=default_out)
    ap.add_argument("--check", action="store_true", help="compare a fresh build with the files in --out")
    args = ap.parse_args()
    if not args.check:
        build(args.out)
        print(f"wrote {args.out}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        build(tmp)
        bad = differing_files(tmp, args.out)
    if bad:
        print("check FAILED: differ: " + ", ".join(bad))
        return 1
    print(f"check ok: {args.out}")
    return 0
