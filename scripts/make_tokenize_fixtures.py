#!/usr/bin/env python3
"""Build the fixtures of keel tokenize (test/data/test_tokenize_corpus.cpp): what
scripts/prepare_data.py (with the HF `tokenizers` library) writes for small corpora, which keel
tokenize must reproduce byte for byte, and the Python facts it relies on.

Outputs (test/fixtures/tokenize/):
  corpus.jsonl   JSON lines with text, prompt and response fields: ASCII and non-ASCII text,
                 \\u escapes and raw UTF-8, \\r\\n and \\r line ends, blank lines, records without
                 the field or with a non-string one, whitespace-only documents (Unicode spaces
                 included), invalid UTF-8 (truncated sequences, stray bytes)
  corpus.txt     plain text: paragraphs separated by lines of Unicode whitespace, \\r\\n,
                 U+2028, invalid UTF-8
  <case>/        prepare_data.py's token files (train_NNN.bin, val_NNN.bin, .mask sidecars)
  cases.json     per case: the prepare_data.py arguments and the documents, tokens and
                 characters it reported
  python.json    random.Random(seed): getrandbits and shuffle results; bytes.decode("utf-8",
                 "replace") of ill-formed bytes; the code points str.isspace() accepts;
                 re.split(r"\\n\\s*\\n", ...) of tricky texts

Deterministic: --check rebuilds into a temporary folder and compares bytes.

  python3 scripts/make_tokenize_fixtures.py [--check]
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import fixture_cli  # noqa: E402
import prepare_data  # noqa: E402

TOKENIZERS = os.path.join(ROOT, "test", "fixtures", "tokenizers")

WORDS = ["alpha", "béta", "γάμμα", "日本語", "emoji😀", "tab\tx", "new\nline", "  spaced  ", "naïve", "Ω", "x" * 18,
         "\u2028sep", "don't", "1234", "end."]


def corpus_jsonl() -> bytes:
    rng = random.Random(5)
    out = bytearray()
    for i in range(140):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 16)))
        end = b"\r\n" if i % 7 == 0 else b"\r" if i % 11 == 0 else b"\n"
        if i % 29 == 0:
            out += json.dumps({"other": text}).encode() + end  # no field: skipped
        elif i % 31 == 0:
            out += b"\n"  # blank line
        elif i % 37 == 0:
            out += json.dumps({"text": 5, "prompt": 1, "response": None}).encode() + end  # not strings
        elif i % 41 == 0:
            out += json.dumps({"text": " \u3000\u00a0\x1c", "prompt": "p", "response": "\u2003"}).encode() + end
        else:
            rec = {"text": text, "prompt": "Q: " + text[:12], "response": text[12:]}
            out += (b"  " if i % 13 == 0 else b"") + json.dumps(rec, ensure_ascii=i % 2 == 0).encode() + end
    # invalid UTF-8 inside strings: a truncated 3-byte sequence, a stray byte, a truncated 4-byte one
    out += b'{"text": "bad \xe2\x82 utf8 \xff here", "prompt": "p \xf0\x9f", "response": "r \xed\xa0\x80 s"}\n'
    out += b'{"text": "last line without a newline", "prompt": "a", "response": "b"}'
    return bytes(out)


def corpus_txt() -> bytes:
    return (b"para one\r\nstill one\n\n\npara two  \n \t\n\npara three\xe2\x80\xa8\n\nlast \xc3 bad\n"
            b"\n\xe3\x80\x80\n4th \xe2\x80\xa9 para\n\x1c\nfifth\n\n\n\n")


CASES = {
    "jsonl_gpt2": ["--jsonl", "corpus.jsonl", "--tokenizer", "gpt2.json", "--shard-tokens", "400"],
    "pairs_llama2": ["--jsonl", "corpus.jsonl", "--tokenizer", "llama2.json", "--loss-mask", "prompt",
                     "--add-special-tokens", "--shard-tokens", "300", "--seed", "11"],
    "text_llama3": ["--text", "corpus.txt", "corpus.txt", "--doc-split", "paragraph", "--tokenizer", "llama3.json",
                    "--add-special-tokens", "--val-fraction", "0.3", "--seed", "7"],
    "lines_qwen2": ["--text", "corpus.txt", "--doc-split", "line", "--tokenizer", "qwen2.json",
                    "--val-fraction", "0.25", "--seed", "0"],
}


def python_facts() -> dict:
    facts = {"random": [], "utf8_replace": [], "isspace": [], "paragraphs": []}
    for seed in [0, 1, 1337, 2**32 - 1, 2**32 + 5, 2**40 + 12345]:
        r = random.Random(seed)
        bits = [r.getrandbits(k) for k in (32, 32, 1, 7, 31, 33, 40, 64)]
        r = random.Random(seed)
        small = list(range(10))
        r.shuffle(small)
        r = random.Random(seed)
        large = list(range(100000))
        r.shuffle(large)
        facts["random"].append({"seed": seed, "getrandbits_k": [32, 32, 1, 7, 31, 33, 40, 64],
                                "getrandbits": [str(b) for b in bits], "shuffle10": small,
                                "shuffle100000_head": large[:20], "shuffle100000_weighted": sum(i * v for i, v in enumerate(large)) % (2**61 - 1)})
    for raw in [b"ok", b"\xe2\x82", b"\xe2\x82A", b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xf0\x9f\x98", b"\xf0\x9f\x98\x80",
                b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\xc2", b"\xff\xfe", b"\x80\x80", b"a\xf1\x80\x80b", b"\xef\xbf\xbd",
                b"\xe1\x80\xe2\xf0\x91\x92\xf1\xbf\x41", b"\xf5\x80", b"\xdf\xbf\xe0\xa0\x80\xf3\xbf\xbf\xbf"]:
        facts["utf8_replace"].append({"bytes": raw.hex(), "text": raw.decode("utf-8", "replace")})
    facts["isspace"] = [c for c in range(0x110000) if chr(c).isspace()]
    for text in ["a\n\nb", "a\n \n\nb\n", "\n\n", "a\n\u3000\u2028\nb", "a\n\t \nb\n\n \n\nc", "x\n y\n", "\n \n",
                 "a\n\x1c\nb", "a\n\u200b\nb", "α\n\u00a0\u1680\n\n\u0085β"]:
        facts["paragraphs"].append({"text": text, "pieces": re.split(r"\n\s*\n", text)})
    return facts


def build(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "corpus.jsonl"), "wb") as f:
        f.write(corpus_jsonl())
    with open(os.path.join(out, "corpus.txt"), "wb") as f:
        f.write(corpus_txt())
    cases = {}
    for name, args in CASES.items():
        argv = [os.path.join(out, a) if a.startswith("corpus.") else os.path.join(TOKENIZERS, a) if a.endswith(".json")
                else a for a in args]
        with tempfile.TemporaryDirectory() as tmp:
            import contextlib
            import io
            with contextlib.redirect_stdout(io.StringIO()):
                prepare_data.main(argv + ["--out", tmp, "--choice-items", "0"])
            meta = json.load(open(os.path.join(tmp, "meta.json")))
            dst = os.path.join(out, name)
            shutil.rmtree(dst, ignore_errors=True)
            os.makedirs(dst)
            for f in sorted(os.listdir(tmp)):
                if f.endswith((".bin", ".mask")):
                    shutil.copyfile(os.path.join(tmp, f), os.path.join(dst, f))
        chars = meta["source"]
        cases[name] = {"args": args, "eot_id": meta["eot_id"], "vocab_size": meta["vocab_size"],
                       "train": {"documents": meta["train"]["documents"], "tokens": meta["train"]["tokens"]},
                       "val": {"documents": meta["val"]["documents"], "tokens": meta["val"]["tokens"]},
                       "skipped": chars.get("jsonl_skipped", 0), "bad_utf8_files": chars.get("files_with_bad_utf8", 0),
                       "files": sorted(f for f in os.listdir(dst))}
        if meta["loss_mask"]:
            cases[name]["train"]["in_loss"] = meta["loss_mask"]["train_in_loss"]
            cases[name]["val"]["in_loss"] = meta["loss_mask"]["val_in_loss"]
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(cases, f, indent=1, ensure_ascii=False)
        f.write("\n")
    with open(os.path.join(out, "python.json"), "w") as f:
        json.dump(python_facts(), f, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(fixture_cli.main(build, os.path.join(ROOT, "test", "fixtures", "tokenize"), __doc__))
