#!/usr/bin/env python3
"""Build the tokenizer fixtures: small HF tokenizers of every style keel's C++ tokenizer
(data/tokenizer.cpp) supports, and the ids the HF `tokenizers` library gives for a
multilingual test corpus, so test/data/test_tokenizer.cpp can check keel id for id.

Tokenizers (trained here on Debian's fortunes plus the multilingual text below):
  gpt2         byte-level BPE, GPT-2 style: ByteLevel pre-tokenizer with the GPT-2 regex,
               <|endoftext|>, a special and a normalized non-special added token
  llama3       byte-level BPE, Llama 3 style: Split(Llama 3 regex) + ByteLevel(no regex),
               ignore_merges, <|begin_of_text|> added by a TemplateProcessing post-processor
  roberta      byte-level BPE with add_prefix_space and RobertaProcessing (<s> ... </s>)
  llama2       SentencePiece-style BPE, Llama 2 style: Prepend("▁") + Replace(" ", "▁")
               normalizers, no pre-tokenizer, <0xXX> byte fallback, fused <unk>, decoder
               Replace + ByteFallback + Fuse + Strip, <s> added by TemplateProcessing
  metaspace    the same model with a Metaspace pre-tokenizer (prepend_scheme "first") and
               the Metaspace decoder (the newer HF conversion of Llama / Mistral)
  splits       every Split behaviour (removed, isolated, merged with previous / next,
               contiguous, invert), Digits, Strip and regex Replace normalizers, byte-level model
  metaspace_unk  Metaspace (prepend_scheme "always", split) with <unk> for unknown characters
  whitespace   WhitespaceSplit + Whitespace pre-tokenizers, no decoder
  qwen2        byte-level BPE, Qwen2 / Qwen2.5 / Qwen3 style: NFC normalizer, Split(Qwen2 regex:
               single digits) + ByteLevel(no regex), <|endoftext|> <|im_start|> <|im_end|>, no BOS
  nfkc         byte-level BPE behind normalizers NFD, Replace(\p{Mn} -> "") and NFKC (accents
               stripped, compatibility characters folded), a normalized added token "ﬁx"
               (matched and decoded as "fix", its normalized form) and a non-normalized one
               "e\u0301!" (matched in the raw text only)

Outputs (test/fixtures/tokenizers/): <name>.json (tokenizer.json files) and cases.json:
  {"strings": [...], "tokenizers": {name: {"file", "vocab_size", "encode": [[ids]...],
   "encode_special": [[ids]...] (first N_SPECIAL strings, add_special_tokens=True),
   "decode": [...] (of "encode", skip_special_tokens=False), "decode_skip": [...] (True),
   "random_ids": [[ids]...], "random_decode": [...]}}}
Deterministic: --check regenerates in memory and compares bytes.

Usage:
  python3 scripts/make_tokenizer_fixtures.py
  python3 scripts/make_tokenizer_fixtures.py --check
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "test", "fixtures", "tokenizers")
FORTUNES = "/usr/share/games/fortunes"
TRAIN_FILES = ["computers", "science", "wisdom", "songs-poems"]
TEST_FILES = ["linux", "literature", "people"]
N_FORTUNE_TESTS = 160
N_SPECIAL = 40
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Multilingual text for training and testing (so merges exist beyond ASCII).
MULTILINGUAL = [
    "Привет, мир! Как дела? Всё хорошо, спасибо.",
    "Καλημέρα κόσμε· η γλώσσα είναι ελληνική.",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "日本語のテキストです。ひらがなとカタカナと漢字。",
    "한국어 문장입니다. 안녕하세요!",
    "مرحبا بالعالم، هذه جملة عربية.",
    "שלום עולם, זה משפט בעברית.",
    "नमस्ते दुनिया, यह हिंदी वाक्य है।",
    "สวัสดีชาวโลก นี่คือประโยคภาษาไทย",
    "Tiếng Việt có dấu: Người Việt Nam.",
    "Größe, Straße, Fußgänger – ÄÖÜ äöü ß.",
    "Déjà vu, façade, naïve, crème brûlée, œuvre.",
    "¿Dónde está la biblioteca? ¡Olé!",
    "Emoji: 👍🏽 🎉 👨‍👩‍👧 🇫🇷 ❤️ 😀😃😄",
    "Math: ∑ x² ≤ ∞, π ≈ 3.14159, √2, ½ + ¼ = ¾, Ⅻ.",
    "Code: def f(x):\n    return x ** 2  # square\n",
    "int main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}",
    "https://example.com/path?q=keel&lang=c%2B%2B#frag",
]

EDGE_CASES = [
    "", " ", "  ", "   ", "\n", "\n\n\n", "\t", "\t\tx", "a  b", "a   b\n  c", "hello   ", "   hello",
    "hello world", "Hello World", "HELLO", "I'm", "DON'T", "you'LL", "it's", "'s", "'S", "we've'd",
    "1234567890", "3.14159", "1,000,000", "12345 678 9", "x²", "½", "Ⅻ", "٣٤٥", "१२३",
    "👍🏽", "👨‍👩‍👧", "🇫🇷", "a👍b", "你好", "こんにちは", "Привет", "ñ", "e\u0301", "a\u00a0b", "a\u3000b",
    "a\u200bb", "line1\r\nline2\r\n", "x\u0085y", "x\u2028y", "\x1c\x1d\x1e\x1f", "\x00\x01\x7f",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "!!!???...", "ſ", "'\u017f", "pneumonoultramicroscopicsilicovolcanoconiosis",
    "<|endoftext|>", "hello<|endoftext|>world", " <|endoftext|> ", "<|endoftext|><|endoftext|>",
    "<|begin_of_text|>Hi", "a<|eot_id|>b", "<s>", "</s>hi", "<s> hello", "<unk>", "<0x41>", "▁", "▁▁x",
    "x ok y", " ok ", "ok", "<|user|>hi<|user|>", "          x", "a\n\n b", "\n  \n  \n", "end.\n",
    "tab\tseparated\tvalues", "MiXeD CaSe WoRdS", "snake_case_identifier", "camelCaseIdentifier",
    "email@example.org", "C++ and C#", "$100.00 & 50%", "#hashtag @mention", "a-b_c.d/e\\f",
    "\u00e9t\u00e9", "Ω≈ç√∫", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "🀄🃏", "\U0001F9D1\u200d\U0001F4BB",
]


# Text that Unicode normalization changes: decomposed accents, compatibility characters, Hangul
# jamo, marks in non-canonical order, exclusions and singletons, special tokens next to marks.
# Test strings only (not training text), appended after the others.
NORMALIZATION_CASES = [
    "e\u0301", "cafe\u0301 caf\u00e9", "A\u030angstr\u00f6m \u212bngstr\u00f6m \u00c5ngstro\u0308m",
    "\ufb01x fix \ufb01", "\ufb03ce \ufb02ow", "\u2460\u2461\u2462 \u2474",
    "\uff21\uff22\uff23 \uff41\uff42\uff43 \uff11\uff12\uff13",
    "\u1100\u1161\u11a8 \u1112\u1161\u11ab\u1100\u116e\u11a8\u110b\u1165", "\uac00\u11a8 \ud55c\uad6d\uc5b4",
    "Tie\u0302\u0301ng Vie\u0323\u0302t co\u0301 da\u0302\u0301u", "Nguye\u0302\u0303n Va\u0306n A",
    "a\u0316\u0301 a\u0301\u0316 a\u0300\u0301", "\u1e9b\u0323 \u1e0b\u0323 q\u0307\u0323",
    "\u0958\u0959 \u0915\u093c", "x\u00b2 + y\u00b3 = \u00bd \u2153", "\u2122 \u2103 \u216b \u33cf \u2026",
    "\uff76\uff9e\uff8a\uff9f \u30ab\u3099", "\u01c4 \u01c5 \u0149 \u017f\u0307", "\u2126 \u212a \u0344 \u0f73",
    "\u00a0\u3000\u2002 spaces", "<|im_start|>user\nCaf\u0065\u0301?<|im_end|>\n", "<|im_start|>\u0301<|im_end|>",
    "<|endoftext|>\u0308a", "\u0301\u0301\u0301", "\U0001d400\U0001d401 \U0001d7ce\U0001d7cf",
    "\u3131\u314f \u321d \u327e", "na\u00efve nai\u0308ve \u00e9t\u00e9 e\u0301te\u0301",
    "cafe\u0301! caf\u00e9! \ufb01x!", "e\u0301!e\u0301!",
]


def read_fortunes(names: list) -> list:
    docs = []
    for name in names:
        path = os.path.join(FORTUNES, name)
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace").replace("\r\n", "\n")
        for entry in text.split("\n%\n"):
            entry = entry.strip("\n")
            if entry.strip():
                docs.append(entry)
    return docs


def test_strings() -> list:
    docs = read_fortunes(TEST_FILES)
    rng = random.Random(7)
    picked = rng.sample(docs, N_FORTUNE_TESTS)
    picked = [d[:300] for d in picked]  # keep the fixture small
    return EDGE_CASES + MULTILINGUAL + picked + NORMALIZATION_CASES


def train_bytelevel(corpus, vocab_size, pre_tok, special, normalizer=None):
    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    return tok


def make_gpt2(corpus):
    tok = train_bytelevel(corpus, 800, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                          ["<|endoftext|>"])
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    tok.add_special_tokens([AddedToken("<|user|>", normalized=False, special=True)])
    tok.add_tokens([AddedToken(" ok ", normalized=True, special=False)])
    return tok


def make_llama3(corpus):
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok = train_bytelevel(corpus, 800, pre, ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"])
    # Llama 3 looks a whole pre-token up in the vocabulary before merging (ignore_merges).
    doc = json.loads(tok.to_str())
    doc["model"]["ignore_merges"] = True
    tok = Tokenizer.from_str(json.dumps(doc))
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                      special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])])
    return tok


def make_qwen2(corpus):
    """Qwen2's tokenizer.json: NFC, the Qwen2 regex (digits one by one) then ByteLevel without
    its own regex, ByteLevel decoder and post-processor, ChatML special tokens, no BOS."""
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok = train_bytelevel(corpus, 800, pre, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                          normalizer=normalizers.NFC())
    # The decoder and post-processor as Qwen2's file has them (the Python decoder takes no options).
    doc = json.loads(tok.to_str())
    doc["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tok = Tokenizer.from_str(json.dumps(doc))
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tok


def make_nfkc(corpus):
    """Accents stripped (NFD, then combining marks removed), then NFKC: checks NFD and NFKC
    through HF, and added tokens matched before (normalized=False) or after the normalizer."""
    norm = normalizers.Sequence([normalizers.NFD(), normalizers.Replace(Regex(r"\p{Mn}"), ""), normalizers.NFKC()])
    tok = train_bytelevel(corpus, 500, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                          ["<|endoftext|>"], normalizer=norm)
    tok.add_tokens([AddedToken("\ufb01x", normalized=True, special=False),
                    AddedToken("e\u0301!", normalized=False, special=False)])
    return tok


def make_roberta(corpus):
    tok = train_bytelevel(corpus, 320, pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True),
                          ["<s>", "<pad>", "</s>", "<unk>"])
    tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")),
                                                      ("<s>", tok.token_to_id("<s>")))
    return tok


def keep_frequent_chars(corpus, n):
    """The corpus with only its n most frequent characters (ties by code point; the trainers'
    own limit_alphabet breaks ties at random)."""
    counts = {}
    for doc in corpus:
        for ch in doc:
            counts[ch] = counts.get(ch, 0) + 1
    alphabet = set(sorted(counts, key=lambda ch: (-counts[ch], ord(ch)))[:n])
    return ["".join(ch for ch in doc if ch in alphabet) for doc in corpus]


def sp_model(corpus, vocab_size):
    """A SentencePiece-like BPE vocabulary: <unk> <s> </s>, the 256 <0xXX> byte tokens, then
    merges learned on "▁"-joined words; rare characters are left out (limit_alphabet) so the
    byte fallback is exercised."""
    # The alphabet: the 150 most frequent characters; the others are left out of training.
    corpus = keep_frequent_chars(corpus, 150)
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=["<unk>"],
                                  show_progress=False)
    trainer_tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for token, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        if token not in vocab:
            vocab[token] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in trained["merges"]]
    return vocab, merges


def sp_tokenizer(vocab, merges, metaspace: bool):
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    if metaspace:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return tok


def make_splits(corpus):
    """Every Split behaviour, Digits, invert, and the Strip / regex Replace normalizers, in front
    of a byte-level model."""
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[,;]"), behavior="merged_with_previous"),
        pre_tokenizers.Split(" ", behavior="removed"),
        pre_tokenizers.Digits(individual_digits=False),
        pre_tokenizers.Split(Regex(r"[!?.]"), behavior="contiguous"),
        pre_tokenizers.Split(Regex(r"-"), behavior="merged_with_next"),
        pre_tokenizers.Split(Regex(r"\p{Lu}+"), behavior="isolated", invert=True),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok = train_bytelevel(corpus, 300, pre, ["<|endoftext|>"])
    tok.normalizer = normalizers.Sequence([normalizers.Strip(left=True, right=True),
                                           normalizers.Replace(Regex(r"\s{2,}"), " ")])
    return tok


def make_unk_bpe(corpus, metaspace: bool):
    """A BPE without byte fallback: characters outside the vocabulary become <unk> (not fused).
    Metaspace with prepend_scheme "always" and split, or HF's Whitespace pre-tokenizer with no
    decoder (decode joins tokens with spaces)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=False))
    if metaspace:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Whitespace()])
    small = keep_frequent_chars(corpus, 70)
    trainer = trainers.BpeTrainer(vocab_size=300, min_frequency=2, special_tokens=["<unk>", "<s>"], show_progress=False)
    tok.train_from_iterator(small, trainer=trainer, length=len(small))
    return tok


def build(out_dir: str) -> dict:
    corpus = read_fortunes(TRAIN_FILES) + MULTILINGUAL * 5
    vocab, merges = sp_model(corpus, 600)
    toks = {
        "gpt2": make_gpt2(corpus),
        "llama3": make_llama3(corpus),
        "roberta": make_roberta(corpus),
        "llama2": sp_tokenizer(vocab, merges, metaspace=False),
        "metaspace": sp_tokenizer(vocab, merges, metaspace=True),
        "splits": make_splits(corpus),
        "metaspace_unk": make_unk_bpe(corpus, metaspace=True),
        "whitespace": make_unk_bpe(corpus, metaspace=False),
        "qwen2": make_qwen2(corpus),
        "nfkc": make_nfkc(corpus),
    }
    strings = test_strings()
    files = {}
    cases = {"generated_by": f"scripts/make_tokenizer_fixtures.py with tokenizers {tokenizers.__version__}",
             "strings": strings, "tokenizers": {}}
    for name, tok in toks.items():
        text = json.dumps(json.loads(tok.to_str()), ensure_ascii=False, separators=(",", ":"))
        files[f"{name}.json"] = text + "\n"
        enc = [tok.encode(s, add_special_tokens=False).ids for s in strings]
        enc_special = [tok.encode(s, add_special_tokens=True).ids for s in strings[:N_SPECIAL]]
        rng = random.Random(sum(map(ord, name)))
        V = tok.get_vocab_size(with_added_tokens=True)
        random_ids = [[rng.randrange(V) for _ in range(rng.randrange(1, 12))] for _ in range(40)]
        cases["tokenizers"][name] = {
            "file": f"{name}.json",
            "vocab_size": V,
            "encode": enc,
            "encode_special": enc_special,
            "decode": [tok.decode(ids, skip_special_tokens=False) for ids in enc],
            "decode_skip": [tok.decode(ids, skip_special_tokens=True) for ids in enc_special],
            "random_ids": random_ids,
            "random_decode": [tok.decode(ids, skip_special_tokens=False) for ids in random_ids],
        }
    files["cases.json"] = json.dumps(cases, ensure_ascii=False, separators=(",", ":")) + "\n"
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--check", action="store_true", help="compare a fresh build with the files in --out")
    args = ap.parse_args()
    if not os.path.isdir(FORTUNES):
        raise SystemExit(f"{FORTUNES} not found (Debian: apt-get install fortunes)")
    files = build(args.out)
    if args.check:
        bad = [n for n, t in files.items()
               if not os.path.exists(os.path.join(args.out, n)) or open(os.path.join(args.out, n), encoding="utf-8").read() != t]
        if bad:
            print("CHECK FAILED: " + ", ".join(bad) + " differ from a fresh build")
            return 1
        print(f"check ok: {len(files)} files in {args.out}")
        return 0
    os.makedirs(args.out, exist_ok=True)
    total = 0
    for name, text in files.items():
        with open(os.path.join(args.out, name), "w", encoding="utf-8") as f:
            f.write(text)
        total += len(text.encode("utf-8"))
        print(f"  {name}: {len(text.encode('utf-8'))} bytes")
    print(f"wrote {len(files)} files, {total} bytes, to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
