#!/usr/bin/env python3
"""Generate data/unicode_tables.cpp, the Unicode data of keel's tokenizer, and the normalization
test fixture test/fixtures/unicode/normalization.json.

Tables (all sorted arrays of uint32, so the generated source stays small):
  kCategoryRuns        the general category of every code point, as runs: (first code point << 5)
                       | category; a run lasts until the next entry. Categories are numbered in
                       the order of kCategoryNames below, which data/unicode.h mirrors (Cn = 0 =
                       unassigned). For the \\p{L}, \\p{N}, ... classes of pre-tokenization regexes.
  kCombiningClassRuns  the canonical combining class, as runs: (first code point << 8) | ccc.
  kDecompositions      the decomposition mappings of UnicodeData.txt, one level (the normalizer
                       applies them recursively): per mapped code point a header (code point << 8)
                       | (length << 2) | (compatibility << 1) | primary, then `length` code points.
                       primary = 1 marks the canonical pairs that composition (NFC, NFKC) puts
                       back together: the primary composites, i.e. not a composition exclusion, a
                       singleton or a non-starter decomposition. Hangul syllables are decomposed
                       and composed arithmetically and are not listed.
The fixture (for test/data/test_tokenizer.cpp) holds what unicodedata gives: the CRC-32 of the
combining classes of all code points (one byte each); per form and per block of 4096 code
points, the CRC-32 of every code point normalized alone; and a few hundred multi-character
strings (combining sequences, Hangul jamo, exclusions, compatibility characters) with their
four normal forms, written "source;NFC;NFD;NFKC;NFKD" in hexadecimal code points as in
Unicode's NormalizationTest.txt.

Source: Python's unicodedata (its Unicode version is written into both files). The output is
deterministic; --check compares it with the committed files.

Usage:
  python3 scripts/make_unicode_tables.py            # writes both files
  python3 scripts/make_unicode_tables.py --check
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import unicodedata
import zlib

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO_ROOT, "data", "unicode_tables.cpp")
FIXTURE = os.path.join(REPO_ROOT, "test", "fixtures", "unicode", "normalization.json")

kCategoryNames = ["Cn", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No", "Pc", "Pd", "Ps",
                  "Pe", "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co"]
FORMS = ["NFC", "NFD", "NFKC", "NFKD"]
HANGUL_FIRST, HANGUL_COUNT = 0xAC00, 11172  # precomposed Hangul syllables, handled arithmetically
DIGEST_BLOCK = 0x1000


def is_surrogate(cp: int) -> bool:
    return 0xD800 <= cp <= 0xDFFF


def category_runs() -> list:
    code = {name: i for i, name in enumerate(kCategoryNames)}
    out, prev = [], None
    for cp in range(0x110000):
        c = code[unicodedata.category(chr(cp))]
        if c != prev:
            out.append((cp << 5) | c)
            prev = c
    return out


def combining_class_runs() -> list:
    out, prev = [], None
    for cp in range(0x110000):
        c = unicodedata.combining(chr(cp))
        if c != prev:
            out.append((cp << 8) | c)
            prev = c
    return out


def mappings() -> dict:
    """code point -> (compatibility, [code points]): the one-level mappings of UnicodeData.txt."""
    out = {}
    for cp in range(0x110000):
        if HANGUL_FIRST <= cp < HANGUL_FIRST + HANGUL_COUNT:
            continue
        fields = unicodedata.decomposition(chr(cp)).split()
        if fields:
            compat = fields[0].startswith("<")  # "<compat>", "<font>", ...: a compatibility mapping
            out[cp] = (compat, [int(f, 16) for f in fields[1 if compat else 0:]])
    return out


def is_primary(cp: int, compat: bool, target: list) -> bool:
    # A canonical pair is a primary composite exactly when NFC leaves it alone: the composition
    # exclusions (CompositionExclusions.txt, not in unicodedata) and the non-starter
    # decompositions (U+0344, U+0F73, ...) are what NFC never produces.
    return not compat and len(target) == 2 and unicodedata.normalize("NFC", chr(cp)) == chr(cp)


def self_check(maps: dict) -> None:
    """The one-level mappings applied recursively, then canonically ordered, are NFD and NFKD:
    a check that the tables say what unicodedata says (the C++ test checks the normalizer)."""
    def expand(cp: int, compat: bool) -> list:
        m = maps.get(cp)
        if m is None or (m[0] and not compat):
            return [cp]
        return [x for t in m[1] for x in expand(t, compat)]

    for cp, (compat, _) in maps.items():
        for form, k in (("NFD", False), ("NFKD", True)):
            seq = expand(cp, k)
            # canonical ordering: a stable sort by ccc of each run of non-starters
            i = 0
            while i < len(seq):
                j = i
                while j < len(seq) and unicodedata.combining(chr(seq[j])):
                    j += 1
                seq[i:j] = sorted(seq[i:j], key=lambda x: unicodedata.combining(chr(x)))
                i = j + 1
            want = unicodedata.normalize(form, chr(cp))
            if "".join(map(chr, seq)) != want:
                raise SystemExit(f"self-check failed: {form} of U+{cp:04X}")


def decomposition_table(maps: dict) -> list:
    out = []
    for cp in sorted(maps):
        compat, target = maps[cp]
        assert 1 <= len(target) < 64
        out.append((cp << 8) | (len(target) << 2) | (int(compat) << 1) | int(is_primary(cp, compat, target)))
        out.extend(target)
    return out


def digests() -> dict:
    """Per form, per block of DIGEST_BLOCK code points: the CRC-32 (zlib's) of the UTF-8 of each
    code point normalized alone, each followed by a 0xFF byte (never in UTF-8, so the boundaries
    count); surrogates are skipped."""
    out = {}
    for form in FORMS:
        blocks = []
        for start in range(0, 0x110000, DIGEST_BLOCK):
            data = bytearray()
            for cp in range(start, start + DIGEST_BLOCK):
                if not is_surrogate(cp):
                    data += unicodedata.normalize(form, chr(cp)).encode("utf-8") + b"\xff"
            blocks.append(zlib.crc32(bytes(data)))
        out[form] = blocks
    return out


# Multi-character strings whose normal forms are checked: marks to reorder, compositions blocked
# and not, Hangul jamo at the edges of their ranges, composition exclusions, singletons,
# non-starter decompositions, two-starter compositions (Indic vowel signs), compatibility
# characters (ligatures, full-width and half-width forms, super/subscripts, fractions, squares).
HAND_CASES = [
    "e\u0301", "A\u030a", "\u212b", "\u2126", "\u00c5\u0301", "a\u0316\u0301", "a\u0301\u0316",
    "a\u0301\u0316\u0300", "a\u0300\u0301", "a\u0315\u0300\u05ae\u0300b", "\u1e9b\u0323", "q\u0307\u0323",
    "\u1e0b\u0323", "\u1e0d\u0307", "d\u0323\u0307", "\u0307\u0323d", "o\u0308\u0304", "u\u0308\u0301",
    "\u1100\u1161", "\u1100\u1161\u11a8", "\uac00\u11a8", "\u1100\u1161\u11a8\u11a8", "\uac01\u11a8",
    "\u1100\u11a8", "\u1161\u11a8", "\uac00\u11a7", "\uac00\u11c2", "\uac00\u11c3", "\u1112\u1175\u11c2",
    "\u1113\u1161", "\u1112\u1176", "\u1100\u1175", "\ud7a3", "\ud7a3\u11a8", "\ud7a4", "\uabff\u11a8",
    "\u1100\u0301\u1161", "\uac00\u0301\u11a8", "\ud55c\uad6d\uc5b4",
    "\u1112\u1161\u11ab\u1100\u116e\u11a8", "\u0958", "\u0915\u093c", "\u095f", "\u0344", "\u0f73",
    "\u0f71\u0f72", "\u0f75", "\u0340\u0341", "e\u0340", "\u0b47\u0b3e", "\u0b47\u0301\u0b3e",
    "\u09c7\u09be", "\u0dd9\u0dcf\u0dca", "\ufb01", "\ufb03", "\ufb01\u0301", "\u2460", "\u2474",
    "\uff21\uff22\uff23", "\uff76\uff9e", "\uff8a\uff9f", "\u30ab\u3099", "x\u00b2", "\u00bd", "\u2153",
    "\u33cf", "\u2122", "\u2103", "\u216b", "\u017f\u0307", "\u01c4", "\u01c5\u030c", "\u1e9b",
    "\ufdfa", "\u3300", "\U0001d400\U0001d7ce", "\u00a0\u3000\u2002", "\u2026", "\u0385", "\u1fee",
    "\u03d3", "\u03d2\u0301", "Tie\u0302\u0301ng Vie\u0323\u0302t", "Ti\u1ebfng Vi\u1ec7t",
    "Nguye\u0302\u0303n", "\u00e9t\u00e9", "cafe\u0301", "\u0300a", "\u0301\u0301", "\u05d0\u05b7\u05bc",
    "\ufb2e", "\ufb4b", "\u0627\u0653", "\u0622\u0653", "\U0001109a", "\U00011099\U000110ba",
    "\U0001d15e", "\U0001d160", "\U0002f800", "\uf900", "\u2000", "\u2001", "i\u0307\u0301",
    "\u0130", "\u00df", "\u1e9e", "\u0149", "\u2f00", "\u3131\u314f", "\u321d", "\u327e", "\U0001f100",
    "\U0001f190", "\u24b6", "\u2cef", "a\u20d7\u0301", "a\u05c4\u0301", "\u0d4a\u0d57", "\u0d46\u0d3e\u0d57",
]


def random_cases(maps: dict, n: int) -> list:
    """Random short strings from code points that take part in normalization: letters that
    start a composition, combining marks of many classes, composites, Hangul jamo and syllables,
    exclusions and singletons, compatibility characters."""
    rng = random.Random(15)
    starters = sorted({t[0] for cp, (c, t) in maps.items() if is_primary(cp, c, t)})
    marks = [cp for cp in range(0x300, 0x20000) if unicodedata.combining(chr(cp))]
    canonical = sorted(cp for cp, (c, _) in maps.items() if not c)
    compat = sorted(cp for cp, (c, _) in maps.items() if c)
    jamo = list(range(0x1100, 0x1113)) + list(range(0x1161, 0x1176)) + list(range(0x11A8, 0x11C3))
    # LV syllables (no trailing jamo yet: 28 apart) and LV syllables with a trailing jamo
    syllables = [HANGUL_FIRST + 28 * k for k in range(0, 19 * 21, 7)]
    syllables += [HANGUL_FIRST + 28 * k + 5 for k in range(0, 19 * 21, 11)]
    odd = [0x0958, 0x212B, 0x2126, 0x0344, 0x0F73, 0x0340, 0x0341, 0x1E9B, 0x0B3E, 0x0CC2, 0x11A8, 0x3099, 0xFF9E]
    pools = [starters, marks, canonical, compat, jamo, syllables, odd, [ord(c) for c in "aeiouAEOU "]]
    cases = []
    while len(cases) < n:
        s = "".join(chr(rng.choice(rng.choice(pools))) for _ in range(rng.randint(2, 6)))
        if s not in cases:
            cases.append(s)
    return cases


def render_table(values: list) -> str:
    lines, line = [], "   "
    for v in values:
        item = f" 0x{v:x},"
        if len(line) + len(item) > 100:
            lines.append(line)
            line = "   "
        line += item
    lines.append(line)
    return "\n".join(lines)


def render_tables(maps: dict) -> str:
    cats, cccs, decomp = category_runs(), combining_class_runs(), decomposition_table(maps)
    names = ", ".join(kCategoryNames)
    return (
        "// Generated by scripts/make_unicode_tables.py from Python's unicodedata "
        f"(Unicode {unicodedata.unidata_version}). Do not edit.\n"
        "#include <cstddef>\n#include <cstdint>\n\n"
        "namespace keel::data::unicode::detail {\n\n"
        f"extern const char kUnicodeVersion[] = \"{unicodedata.unidata_version}\";\n\n"
        "// General category runs: (first code point << 5) | category, sorted; a run lasts until the\n"
        f"// next entry. Categories: {names} (0..{len(kCategoryNames) - 1}).\n"
        f"extern const size_t kCategoryRunCount = {len(cats)};\n"
        "extern const uint32_t kCategoryRuns[] = {\n" + render_table(cats) + "\n};\n\n"
        "// Canonical combining class runs: (first code point << 8) | ccc, sorted, as above.\n"
        f"extern const size_t kCombiningClassRunCount = {len(cccs)};\n"
        "extern const uint32_t kCombiningClassRuns[] = {\n" + render_table(cccs) + "\n};\n\n"
        "// One-level decomposition mappings, sorted by code point (Hangul syllables are left to\n"
        "// arithmetic): a header (code point << 8) | (length << 2) | (compatibility << 1) | primary,\n"
        "// then `length` code points. primary: a canonical pair that composition puts back together.\n"
        f"extern const size_t kDecompositionSize = {len(decomp)};\n"
        "extern const uint32_t kDecompositions[] = {\n" + render_table(decomp) + "\n};\n\n"
        "}  // namespace keel::data::unicode::detail\n")


def code_points(s: str) -> str:
    return " ".join(f"{ord(c):04X}" for c in s)


def render_fixture(maps: dict) -> str:
    # Cases as in Unicode's NormalizationTest.txt: "source;NFC;NFD;NFKC;NFKD", each a list of
    # hexadecimal code points (readable, where raw combining marks would not be).
    cases = HAND_CASES + random_cases(maps, 300)
    lines = [json.dumps(";".join(code_points(x) for x in [s] + [unicodedata.normalize(f, s) for f in FORMS]))
             for s in cases]
    sums = digests()
    ccc_crc = zlib.crc32(bytes(unicodedata.combining(chr(cp)) for cp in range(0x110000)))
    return ("{\n"
            "\"generated_by\": \"scripts/make_unicode_tables.py\",\n"
            f"\"unicode_version\": \"{unicodedata.unidata_version}\",\n"
            f"\"combining_class_crc\": {ccc_crc},\n"
            f"\"digest_block\": {DIGEST_BLOCK},\n"
            "\"digests\": {\n" +
            ",\n".join(f"  \"{f}\": {json.dumps(sums[f], separators=(',', ':'))}" for f in FORMS) +
            "\n},\n"
            "\"cases\": [\n" + ",\n".join(lines) + "\n]\n}\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    args = ap.parse_args()
    maps = mappings()
    self_check(maps)
    files = {OUT: render_tables(maps), FIXTURE: render_fixture(maps)}
    if args.check:
        bad = [p for p, text in files.items() if not os.path.exists(p) or open(p, encoding="utf-8").read() != text]
        for p in bad:
            print(f"{p} differs from a fresh build")
        if bad:
            return 1
        print("check ok: " + ", ".join(files))
        return 0
    for path, text in files.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {path} ({len(text.encode('utf-8'))} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
