#!/usr/bin/env python3
"""Ids of documents that contain the text of special tokens, from the HF `tokenizers` library
with and without `encode_special_tokens` (transformers' split_special_tokens), for the committed
tokenizer fixtures (test/fixtures/tokenizers/*.json, made by make_tokenizer_fixtures.py). keel
tokenize --split-special-tokens must give the same ids (test/data/test_tokenizer.cpp).

Output: test/fixtures/tokenizers/split_special.json
  {"tokenizers": {name: {"strings": [...], "special": [[ids]...] (default encoding),
   "split": [[ids]...] (encode_special_tokens=True), "split_bos": [[ids]...] (the same with
   add_special_tokens=True)}}}

Usage: python3 scripts/make_split_special_fixture.py [--check]
"""

import argparse
import json
import os
import sys

from tokenizers import Tokenizer

from fixture_file import write_or_check  # scripts/fixture_file.py

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIR = os.path.join(REPO_ROOT, "test", "fixtures", "tokenizers")
NAMES = ["gpt2", "llama3", "qwen2", "llama2", "metaspace", "roberta", "nfkc", "splits", "whitespace", "metaspace_unk"]


def strings_for(doc: dict) -> list:
    """Each added token in the places a web document puts one: alone, inside words, doubled,
    at either end, next to whitespace and newlines, cut short, and beside the other tokens."""
    added = [a["content"] for a in doc.get("added_tokens", [])]
    specials = [a["content"] for a in doc.get("added_tokens", []) if a["special"]]
    out = []
    for t in added:
        out += [t, f"Use {t} to end a document.", f"word{t}word", f"{t}{t}", f" {t} ", f"\n{t}\n",
                f"{t} at the start", f"at the end {t}", t[: max(1, len(t) - 2)] + " cut short"]
    out.append("all of them: " + " and ".join(added))
    out.append("".join(specials) + " glued")
    out.append("no added token here, just text.")
    return out


def build() -> str:
    result = {}
    for name in NAMES:
        path = os.path.join(DIR, name + ".json")
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        tok = Tokenizer.from_file(path)
        strings = strings_for(doc)
        entry = {"strings": strings, "special": [tok.encode(s, add_special_tokens=False).ids for s in strings]}
        tok.encode_special_tokens = True
        entry["split"] = [tok.encode(s, add_special_tokens=False).ids for s in strings]
        entry["split_bos"] = [tok.encode(s, add_special_tokens=True).ids for s in strings]
        result[name] = entry
    return json.dumps({"tokenizers": result}, ensure_ascii=False, separators=(",", ":")) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the committed file instead of writing it")
    args = ap.parse_args()
    text = build()
    out = os.path.join(DIR, "split_special.json")
    return write_or_check(out, text, args.check)


if __name__ == "__main__":
    sys.exit(main())
