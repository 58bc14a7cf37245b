#!/usr/bin/env python3
"""Tokenize a text corpus into llm.c-format token shards for keel.

Shard format (what keel's data/ reads): a header of 256 little-endian int32
  [0] magic, [1] version, [2] number of tokens, [3..255] zero
followed by the tokens:
  magic 20240520, version 1, uint16 tokens   when the vocabulary has < 65536 ids
  magic 20240801, version 7, uint32 tokens   otherwise

Sources (pick one; the default is --fortunes):
  --fortunes [DIR]   Debian `fortunes` files (default /usr/share/games/fortunes): entries are
                     separated by lines holding only "%"; *.dat, *.u8, symlinks and the
                     `off/` directory are skipped; overstrike sequences (X<BS>Y) are reduced
                     to the overstruck character unless --keep-overstrike.
  --text FILE...     plain text; one document per file, or per blank-line separated
                     paragraph / per line with --doc-split.
  --jsonl FILE...    one JSON object per line; the document is obj[--text-key], or with
                     --loss-mask prompt the pair obj[--prompt-key], obj[--response-key].

Tokenizer: --tokenizer PATH/tokenizer.json uses an existing HF `tokenizers` file; otherwise a
byte-level BPE (--vocab-size, default 2048) is trained on the training documents and saved to
OUT/tokenizer.json. An end-of-text token follows every document (--eot-token; by default
<|endoftext|>, or the first of </s>, <|end_of_text|>, <|eot_id|> the tokenizer has). With
--add-special-tokens each document (or prompt) is encoded with the tokenizer's post-processor,
e.g. Llama's <s> / <|begin_of_text|> in front. With --split-special-tokens the text of a special
token inside a document ("<|endoftext|>" on a web page) is encoded as ordinary text, not as the
token (the tokenizers library's encode_special_tokens; llm.c's encode_ordinary). Without the `tokenizers` package (or with --bytes)
the tokens are raw UTF-8 bytes, id 256 = end of text.

Instruction data (--loss-mask prompt): each JSONL record holds a prompt and a response; the
document is the tokens of prompt + response encoded as one text, then end of text, and a
loss-mask sidecar beside each shard says which tokens count in the loss: the response and the
end of text, not the prompt. (The response encoded on its own would differ from what the model
sees: a SentencePiece-style tokenizer, Llama 2's, starts every text with "▁", so
"A:" + " 4" would get two.) The response's tokens start after the longest prefix the joined
tokens share with the prompt's own encoding, so a token straddling the join is in the loss.
Sidecar format
(data/loss_mask.h; keel's sampler picks it up and turns masked targets into -1):
  OUT/train_000.mask: 256 x int32 header ([0] magic 20240917, [1] version 1, [2] number of
  tokens, the shard's), then one uint8 per token: 1 = token i, as a target, is in the loss.
(Not train_000.mask.bin: a glob like train_*.bin would pick the masks up as token shards.)

Documents are shuffled with --seed and --val-fraction of them held out. Outputs:
  OUT/train_000.bin [train_001.bin ...]  (at most --shard-tokens tokens each; past 1000
                                          shards the names get more digits, train_0000.bin)
  OUT/val_000.bin
  OUT/train_000.mask ...                  (--loss-mask prompt: one sidecar per shard)
  OUT/meta.json                           vocab size, token counts, tokenizer, source
  OUT/tokenizer.json                      (BPE only)
  OUT/val_choices.jsonl                   (--choice-items) multiple-choice items from held-out
                                          documents, for keel train's choice_eval / keel eval
The same inputs and arguments give byte-identical outputs.
`keel tokenize` (C++, no Python) writes the same token files and masks for the same inputs and an
existing tokenizer (--jsonl/--text, not --fortunes; no BPE training, no choice items).

Choice items (--choice-items N, default 200; 0: none): from held-out documents of 6 to 60 words,
"which ending finishes this document": the context is the document up to the word boundary
nearest its middle, the endings its own rest and the rests of three other such documents, in a
random order. A model that learned the corpus picks its own rest more often than chance (0.25).

Examples:
  python3 scripts/prepare_data.py                        # fortunes -> data/fortunes
  python3 scripts/prepare_data.py --text book.txt --doc-split paragraph --out data/book
  python3 scripts/prepare_data.py --jsonl a.jsonl b.jsonl --tokenizer data/fortunes/tokenizer.json --out data/mix
  python3 scripts/prepare_data.py --jsonl sft.jsonl --loss-mask prompt --tokenizer llama/tokenizer.json \
      --add-special-tokens --out data/sft
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import sys
import time

import numpy as np

try:
    import tokenizers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    HAVE_TOKENIZERS = True
except ImportError:  # fall back to raw bytes
    HAVE_TOKENIZERS = False

DEFAULT_FORTUNES = "/usr/share/games/fortunes"
DEFAULT_OUT = os.path.join("data", "fortunes")
EOT_TOKEN = "<|endoftext|>"
HEADER_INTS = 256
MAGIC_U16, VERSION_U16 = 20240520, 1
MAGIC_U32, VERSION_U32 = 20240801, 7
MASK_MAGIC, MASK_VERSION = 20240917, 1
EOT_FALLBACKS = ["</s>", "<|end_of_text|>", "<|eot_id|>"]


# ----------------------------------------------------------------------------
# Reading documents
# ----------------------------------------------------------------------------

_OVERSTRIKE = re.compile(r"[^\n]\x08")


def strip_overstrike(text: str) -> str:
    """'X<BS>Y' prints Y over X (bold, underline, accents): keep Y."""
    while "\x08" in text:
        new = _OVERSTRIKE.sub("", text)
        if new == text:  # a backspace at a line start: drop it
            new = text.replace("\x08", "")
        text = new
    return text


def read_text_file(path: str, stats: dict) -> str:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        stats["files_with_bad_utf8"] = stats.get("files_with_bad_utf8", 0) + 1
    return text.replace("\r\n", "\n")


def fortune_files(root: str) -> list:
    """Regular fortune files under root (sorted), skipping indexes, links and off/."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "off")
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if name.endswith((".dat", ".u8")) or name.startswith(".") or os.path.islink(path):
                continue
            if not os.path.isfile(path):
                continue
            out.append(path)
    return sorted(out)


def read_fortunes(root: str, keep_overstrike: bool, stats: dict) -> tuple:
    if not os.path.isdir(root):
        raise SystemExit(f"fortunes directory {root!r} not found (Debian/Ubuntu: apt-get install fortunes)")
    files = fortune_files(root)
    if not files:
        raise SystemExit(f"no fortune files found in {root!r}")
    docs = []
    for path in files:
        text = read_text_file(path, stats)
        if not keep_overstrike and "\x08" in text:
            stats["overstrike_backspaces"] = stats.get("overstrike_backspaces", 0) + text.count("\x08")
            text = strip_overstrike(text)
        entry = []
        for line in text.split("\n"):
            if line.rstrip() == "%":
                add_doc(docs, "\n".join(entry))
                entry = []
            else:
                entry.append(line)
        add_doc(docs, "\n".join(entry))
    return docs, files


def add_doc(docs: list, text: str) -> None:
    text = text.strip("\n").rstrip()
    if text.strip():
        docs.append(text)


def read_text(paths: list, split: str, stats: dict) -> list:
    docs = []
    for path in paths:
        text = read_text_file(path, stats)
        if split == "file":
            add_doc(docs, text)
        elif split == "paragraph":
            for para in re.split(r"\n\s*\n", text):
                add_doc(docs, para)
        elif split == "line":
            for line in text.split("\n"):
                add_doc(docs, line)
        else:
            raise ValueError(split)
    return docs


def parse_jsonl_line(line: str, path: str, lineno: int):
    """One JSONL record; refused as keel tokenize refuses it (a \\ud800 escape without its pair
    is no text: JSON allows it, UTF-8 cannot hold it)."""
    try:
        obj = json.loads(line)
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except json.JSONDecodeError as e:
        raise SystemExit(f"{path}:{lineno}: invalid JSON ({e})")
    except UnicodeEncodeError:
        raise SystemExit(f"{path}:{lineno}: invalid JSON (a \\u escape of a UTF-16 surrogate without its pair, "
                         "which is no character)")
    return obj


def read_jsonl(paths: list, key: str, stats: dict) -> list:
    docs = []
    for path in paths:
        with open(path, "r", encoding="utf-8-sig", errors="replace") as f:  # a BOM, as keel tokenize
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                obj = parse_jsonl_line(line, path, lineno)
                val = obj.get(key) if isinstance(obj, dict) else None
                if not isinstance(val, str):
                    stats["jsonl_skipped"] = stats.get("jsonl_skipped", 0) + 1
                    continue
                if val.strip():
                    docs.append(val)
    return docs


def read_jsonl_pairs(paths: list, prompt_key: str, response_key: str, stats: dict) -> list:
    """(prompt, response) pairs for --loss-mask prompt; records without both strings are skipped."""
    pairs = []
    for path in paths:
        with open(path, "r", encoding="utf-8-sig", errors="replace") as f:  # a BOM, as keel tokenize
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                obj = parse_jsonl_line(line, path, lineno)
                p = obj.get(prompt_key) if isinstance(obj, dict) else None
                r = obj.get(response_key) if isinstance(obj, dict) else None
                if not isinstance(p, str) or not isinstance(r, str) or not r.strip():
                    stats["jsonl_skipped"] = stats.get("jsonl_skipped", 0) + 1
                    continue
                pairs.append((p, r))
    return pairs


# ----------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------

class ByteTokenizer:
    """Raw UTF-8 bytes; id 256 is end of text."""

    kind = "bytes"

    def __init__(self):
        self.vocab_size = 257
        self.eot_id = 256

    def encode_docs(self, docs, add_special_tokens: bool = False):
        return [np.frombuffer(d.encode("utf-8"), dtype=np.uint8).astype(np.uint32) for d in docs]

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, tok, kind: str, eot_token: str, eot_explicit: bool = True):
        self.tok = tok
        self.kind = kind
        self.eot_token = eot_token
        self.eot_id = tok.token_to_id(eot_token)
        if self.eot_id is None and not eot_explicit:
            # Llama 2 ends documents with </s>, Llama 3 with <|end_of_text|>.
            for alt in EOT_FALLBACKS:
                if tok.token_to_id(alt) is not None:
                    self.eot_token, self.eot_id = alt, tok.token_to_id(alt)
                    break
        if self.eot_id is None:
            raise SystemExit(f"tokenizer has no {eot_token!r} token; pass --eot-token")
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def encode_docs(self, docs, add_special_tokens: bool = False, batch: int = 2048):
        out = []
        for i in range(0, len(docs), batch):
            encs = self.tok.encode_batch(docs[i:i + batch], add_special_tokens=add_special_tokens)
            out += [np.asarray(e.ids, dtype=np.uint32) for e in encs]
        return out

    def decode(self, ids):
        return self.tok.decode(list(map(int, ids)), skip_special_tokens=False)


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The number of leading tokens a and b share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def train_bpe(docs: list, vocab_size: int, eot_token: str):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[eot_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


# ----------------------------------------------------------------------------
# Shards
# ----------------------------------------------------------------------------

def shard_format(vocab_size: int):
    if vocab_size < 65536:
        return MAGIC_U16, VERSION_U16, np.dtype("<u2")
    return MAGIC_U32, VERSION_U32, np.dtype("<u4")


def write_shard(path: str, tokens: np.ndarray, vocab_size: int) -> dict:
    magic, version, dtype = shard_format(vocab_size)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = magic, version, len(tokens)
    if len(tokens) >= 2**31:
        raise SystemExit("shard too large for an int32 token count; lower --shard-tokens")
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise SystemExit(f"token id {int(tokens.max())} >= vocab size {vocab_size}")
    body = tokens.astype(dtype, copy=False)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(body.tobytes())
    os.replace(tmp, path)
    h = hashlib.sha256()
    h.update(header.tobytes())
    h.update(body.tobytes())
    return {"file": os.path.basename(path), "tokens": int(len(tokens)), "sha256": h.hexdigest()}


def mask_path_of(shard_path: str) -> str:
    """train_000.bin -> train_000.mask (data/loss_mask.h)."""
    return shard_path[:-4] + ".mask" if shard_path.endswith(".bin") else shard_path + ".mask"


def write_mask(path: str, mask: np.ndarray) -> dict:
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MASK_MAGIC, MASK_VERSION, len(mask)
    body = mask.astype(np.uint8, copy=False)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(body.tobytes())
    os.replace(tmp, path)
    return {"file": os.path.basename(path), "tokens": int(len(mask)), "in_loss": int(body.sum())}


def read_shard_header(path: str):
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(HEADER_INTS * 4), dtype="<i4")
    return int(header[0]), int(header[1]), int(header[2])


class ShardWriter:
    """Concatenates token arrays and cuts them into shards of at most shard_tokens; with
    with_mask, a loss mask travels with the tokens and each shard gets its sidecar."""

    def __init__(self, out_dir: str, prefix: str, shard_tokens: int, vocab_size: int, with_mask: bool = False):
        self.out_dir, self.prefix = out_dir, prefix
        self.shard_tokens, self.vocab_size = shard_tokens, vocab_size
        self.with_mask = with_mask
        self.pending, self.pending_mask, self.n_pending = [], [], 0
        self.shards = []

    def add(self, arr: np.ndarray, mask: np.ndarray = None) -> None:
        if self.with_mask:
            assert mask is not None and len(mask) == len(arr)
            self.pending_mask.append(mask)
        self.pending.append(arr)
        self.n_pending += len(arr)
        while self.n_pending >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def _flush(self, n: int) -> None:
        buf = np.concatenate(self.pending) if self.pending else np.zeros(0, np.uint32)
        head, rest = buf[:n], buf[n:]
        path = os.path.join(self.out_dir, f"{self.prefix}_{len(self.shards):03d}.bin")
        info = write_shard(path, head, self.vocab_size)
        if self.with_mask:
            mbuf = np.concatenate(self.pending_mask) if self.pending_mask else np.zeros(0, np.uint8)
            info["mask"] = write_mask(mask_path_of(path), mbuf[:n])
            self.pending_mask = [mbuf[n:]] if len(rest) else []
        self.shards.append(info)
        self.pending = [rest] if len(rest) else []
        self.n_pending = len(rest)

    def close(self) -> list:
        if self.n_pending or not self.shards:
            self._flush(self.n_pending)
        if len(self.shards) > 1000:
            # Names that sort in the order of the data: train_0000 ... train_1234 (keel tokenize too).
            width = len(str(len(self.shards) - 1))
            for k, info in enumerate(self.shards):
                path = os.path.join(self.out_dir, f"{self.prefix}_{k:0{width}d}.bin")
                os.replace(os.path.join(self.out_dir, info["file"]), path)
                info["file"] = os.path.basename(path)
                if self.with_mask:
                    os.replace(os.path.join(self.out_dir, info["mask"]["file"]), mask_path_of(path))
                    info["mask"]["file"] = os.path.basename(mask_path_of(path))
        return self.shards


# ----------------------------------------------------------------------------

def choice_items(docs: list, n: int, seed: int) -> list:
    """Up to n "which ending finishes this document" items (see the top) from held-out documents."""
    def halves(doc: str):
        words = list(re.finditer(r"\S+", doc))
        if not 6 <= len(words) <= 60:
            return None
        # split before the word whose start is nearest the middle of the text
        mid = min(range(1, len(words)), key=lambda i: abs(words[i].start() - len(doc) / 2))
        cut = words[mid].start()
        return doc[:cut].rstrip(), " " + doc[cut:].strip()
    pairs, seen = [], set()
    for d in docs:
        h = halves(d)
        if h and h[1] not in seen:  # no two items share an ending
            seen.add(h[1])
            pairs.append(h)
    if len(pairs) < 4:
        return []
    rng = random.Random(seed)
    items = []
    for i in range(min(n, len(pairs))):
        context, right = pairs[i]
        others = [j for j in rng.sample(range(len(pairs)), 4) if j != i][:3]
        endings = [pairs[j][1] for j in others]
        label = rng.randrange(4)
        endings.insert(label, right)
        items.append({"context": context, "endings": endings, "label": label})
    return items


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--fortunes", nargs="?", const=DEFAULT_FORTUNES, metavar="DIR",
                     help=f"Debian fortunes directory (default {DEFAULT_FORTUNES}); the default source")
    src.add_argument("--text", nargs="+", metavar="FILE", help="plain text files")
    src.add_argument("--jsonl", nargs="+", metavar="FILE", help="JSON-lines files")
    ap.add_argument("--text-key", default="text", help="JSONL field holding the document (default: text)")
    ap.add_argument("--doc-split", choices=["file", "paragraph", "line"], default="file",
                    help="--text: what makes one document (default: file)")
    ap.add_argument("--keep-overstrike", action="store_true",
                    help="--fortunes: keep backspace overstrike sequences as they are")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    ap.add_argument("--tokenizer", metavar="PATH", help="existing tokenizer.json (HF tokenizers)")
    ap.add_argument("--vocab-size", type=int, default=2048, help="BPE vocab size to train (default 2048)")
    ap.add_argument("--bytes", action="store_true", help="use raw UTF-8 bytes (vocab 257) instead of BPE")
    ap.add_argument("--eot-token", default=None,
                    help=f"end-of-text token (default {EOT_TOKEN}, else {', '.join(EOT_FALLBACKS)})")
    ap.add_argument("--seed", type=int, default=1337, help="document shuffle seed (default 1337)")
    ap.add_argument("--val-fraction", type=float, default=0.05, help="documents held out (default 0.05)")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 1e8)")
    ap.add_argument("--add-special-tokens", action="store_true",
                    help="encode each document (prompt) with the tokenizer's post-processor (e.g. Llama's BOS)")
    ap.add_argument("--split-special-tokens", action="store_true",
                    help="encode special tokens' text inside documents as ordinary text (with data.document_masking "
                         "a mentioned <|endoftext|> would cut its document in two)")
    ap.add_argument("--loss-mask", choices=["none", "prompt"], default="none",
                    help="'prompt': --jsonl records are prompt/response pairs; only the response (and the "
                         "end of text) count in the loss, recorded in a .mask sidecar per shard")
    ap.add_argument("--choice-items", type=int, default=200,
                    help="multiple-choice items from held-out documents to write to OUT/val_choices.jsonl "
                         "(default 200; 0: none)")
    ap.add_argument("--prompt-key", default="prompt", help="JSONL prompt field for --loss-mask prompt")
    ap.add_argument("--response-key", default="response", help="JSONL response field for --loss-mask prompt")
    args = ap.parse_args(argv)
    if not (args.fortunes or args.text or args.jsonl):
        args.fortunes = DEFAULT_FORTUNES
    if not 0.0 <= args.val_fraction < 1.0:
        ap.error("--val-fraction must be in [0, 1)")
    if args.shard_tokens < 1:
        ap.error("--shard-tokens must be positive")
    if args.loss_mask == "prompt" and not args.jsonl:
        ap.error("--loss-mask prompt needs --jsonl (records with --prompt-key and --response-key)")
    args.eot_explicit = args.eot_token is not None
    if args.eot_token is None:
        args.eot_token = EOT_TOKEN
    if args.choice_items < 0:
        ap.error("--choice-items must be >= 0")
    if args.tokenizer and args.bytes:
        ap.error("--tokenizer and --bytes exclude each other")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    stats: dict = {}

    # 1. documents
    if args.fortunes:
        docs, files = read_fortunes(args.fortunes, args.keep_overstrike, stats)
        source = {"kind": "fortunes", "dir": os.path.abspath(args.fortunes),
                  "files": [os.path.relpath(p, args.fortunes) for p in files],
                  "overstrike": "kept" if args.keep_overstrike else "stripped"}
    elif args.text:
        docs = read_text(args.text, args.doc_split, stats)
        source = {"kind": "text", "files": args.text, "doc_split": args.doc_split}
    elif args.loss_mask == "prompt":
        # documents are (prompt, response) pairs
        docs = read_jsonl_pairs(args.jsonl, args.prompt_key, args.response_key, stats)
        source = {"kind": "jsonl prompt/response pairs", "files": args.jsonl, "prompt_key": args.prompt_key,
                  "response_key": args.response_key}
    else:
        docs = read_jsonl(args.jsonl, args.text_key, stats)
        source = {"kind": "jsonl", "files": args.jsonl, "text_key": args.text_key}
    source.update({k: v for k, v in stats.items()})
    if not docs:
        raise SystemExit("no documents found" + (f" (records need string fields {args.prompt_key!r} and "
                                                 f"{args.response_key!r})" if args.loss_mask == "prompt" else ""))
    masked = args.loss_mask == "prompt"
    n_chars = sum(len(d[0]) + len(d[1]) if masked else len(d) for d in docs)
    print(f"read {len(docs)} documents ({n_chars} characters) from {source['kind']} "
          f"in {time.time() - t0:.2f}s")

    # 2. shuffle and split by document
    order = list(range(len(docs)))
    random.Random(args.seed).shuffle(order)
    n_val = 0
    if args.val_fraction > 0:
        if len(docs) < 2:
            raise SystemExit("only one document: nothing to hold out (try --doc-split paragraph "
                             "or --val-fraction 0)")
        n_val = min(len(docs) - 1, max(1, round(len(docs) * args.val_fraction)))
    val_docs = [docs[i] for i in order[:n_val]]
    train_docs = [docs[i] for i in order[n_val:]]

    # 3. tokenizer
    os.makedirs(args.out, exist_ok=True)
    t1 = time.time()
    if args.bytes or (not args.tokenizer and not HAVE_TOKENIZERS):
        if not args.bytes:
            print("NOTE: the `tokenizers` package is not importable: falling back to raw bytes "
                  "(vocab 257, end of text = 256)")
        tok = ByteTokenizer()
        tok_meta = {"kind": "bytes", "eot_id": tok.eot_id}
    elif args.tokenizer:
        if not HAVE_TOKENIZERS:
            raise SystemExit("--tokenizer needs the `tokenizers` package (pip install tokenizers)")
        tok = HFTokenizer(Tokenizer.from_file(args.tokenizer), "file", args.eot_token, args.eot_explicit)
        dst = os.path.join(args.out, "tokenizer.json")
        if os.path.abspath(args.tokenizer) != os.path.abspath(dst):
            shutil.copyfile(args.tokenizer, dst)
        tok_meta = {"kind": "file", "source": os.path.abspath(args.tokenizer), "path": "tokenizer.json",
                    "eot_token": tok.eot_token}
    else:
        bpe = train_bpe([d[0] + d[1] for d in train_docs] if masked else train_docs, args.vocab_size, args.eot_token)
        bpe.save(os.path.join(args.out, "tokenizer.json"))
        tok = HFTokenizer(bpe, "bpe", args.eot_token)
        tok_meta = {"kind": "byte-level BPE trained on the train split", "path": "tokenizer.json",
                    "vocab_size_requested": args.vocab_size, "eot_token": args.eot_token,
                    "tokenizers_version": tokenizers.__version__}
        print(f"trained byte-level BPE: vocab {tok.vocab_size} in {time.time() - t1:.2f}s")
    tok_meta["vocab_size"] = tok.vocab_size
    tok_meta["eot_id"] = tok.eot_id
    if args.split_special_tokens:
        if isinstance(tok, ByteTokenizer):
            print("NOTE: --split-special-tokens changes nothing for raw bytes (they have no special tokens)")
        else:
            tok.tok.encode_special_tokens = True

    # 4. encode + shard (remove stale shards of an earlier run first)
    for name in sorted(os.listdir(args.out)):
        if re.fullmatch(r"(train|val)_\d{3,}\.(bin|mask)", name):
            os.remove(os.path.join(args.out, name))
    t2 = time.time()
    eot = np.array([tok.eot_id], dtype=np.uint32)
    splits = {}
    for split, split_docs in (("train", train_docs), ("val", val_docs)):
        if not split_docs:
            splits[split] = {"documents": 0, "tokens": 0, "shards": []}
            continue
        writer = ShardWriter(args.out, split, args.shard_tokens, tok.vocab_size, with_mask=masked)
        total = 0
        for i in range(0, len(split_docs), 8192):
            chunk = split_docs[i:i + 8192]
            if masked:
                # The joined text's tokens; prompt tokens are context (mask 0), response and end of
                # text are learned (1), from the first token where the joined encoding departs
                # from the prompt's own (see the top).
                prompts = tok.encode_docs([p for p, _ in chunk], add_special_tokens=args.add_special_tokens)
                wholes = tok.encode_docs([p + r for p, r in chunk], add_special_tokens=args.add_special_tokens)
                for p_ids, w_ids in zip(prompts, wholes):
                    n = shared_prefix(p_ids, w_ids)
                    ids = np.concatenate([w_ids, eot])
                    mask = np.concatenate([np.zeros(n, np.uint8), np.ones(len(ids) - n, np.uint8)])
                    writer.add(ids, mask)
                    total += len(ids)
            else:
                for ids in tok.encode_docs(chunk, add_special_tokens=args.add_special_tokens):
                    writer.add(np.concatenate([ids, eot]))
                    total += len(ids) + 1
        shards = writer.close()
        assert sum(s["tokens"] for s in shards) == total
        splits[split] = {"documents": len(split_docs), "tokens": total, "shards": shards}
    print(f"encoded in {time.time() - t2:.2f}s")

    # 5. verify what was written: headers, sizes, and a decode round trip
    magic, version, dtype = shard_format(tok.vocab_size)
    for split in splits.values():
        for s in split["shards"]:
            path = os.path.join(args.out, s["file"])
            m, v, n = read_shard_header(path)
            assert (m, v, n) == (magic, version, s["tokens"]), (path, m, v, n)
            assert os.path.getsize(path) == HEADER_INTS * 4 + n * dtype.itemsize, path
            if masked:
                mpath = os.path.join(args.out, s["mask"]["file"])
                m, v, n = read_shard_header(mpath)
                assert (m, v, n) == (MASK_MAGIC, MASK_VERSION, s["tokens"]), (mpath, m, v, n)
                assert os.path.getsize(mpath) == HEADER_INTS * 4 + n, mpath
    probe = [d[1] for d in train_docs[:50]] if masked else train_docs[:50]
    for d, ids in zip(probe, tok.encode_docs(probe)):
        back = tok.decode(ids)
        if back != d:
            print(f"WARNING: decode(encode(doc)) differs from the document: {d[:60]!r}")
            break

    # 6. multiple-choice items from held-out documents (plain documents only)
    choices_path = os.path.join(args.out, "val_choices.jsonl")
    items = choice_items(val_docs, args.choice_items, args.seed + 1) if args.choice_items and not masked else []
    if items:
        with open(choices_path, "w") as f:
            for it in items:
                f.write(json.dumps(it, ensure_ascii=False) + "\n")
    elif os.path.exists(choices_path):
        os.remove(choices_path)

    meta = {
        "format": "llm.c token shards: 256 x int32 header (magic, version, n_tokens), then tokens",
        "magic": magic,
        "version": version,
        "token_dtype": "uint16" if dtype.itemsize == 2 else "uint32",
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "eot_placement": "after every document",
        "tokenizer": tok_meta,
        "source": source,
        "split": {"seed": args.seed, "val_fraction": args.val_fraction,
                  "unit": "document", "shuffled": True},
        "shard_tokens": args.shard_tokens,
        "train": splits["train"],
        "val": splits["val"],
        "train_tokens": splits["train"]["tokens"],
        "val_tokens": splits["val"]["tokens"],
        "loss_mask": None if not masked else {
            "kind": "prompt: prompt tokens are out of the loss, response and end of text in",
            "format": "sidecar <shard>.mask: 256 x int32 header (magic 20240917, version 1, n_tokens), "
                      "then one uint8 per token (1 = in the loss as a target)",
            "train_in_loss": sum(s["mask"]["in_loss"] for s in splits["train"]["shards"]),
            "val_in_loss": sum(s["mask"]["in_loss"] for s in splits["val"]["shards"]),
        },
        "add_special_tokens": args.add_special_tokens,
        "split_special_tokens": args.split_special_tokens,
        "choices": {"file": "val_choices.jsonl", "items": len(items),
                    "kind": "which ending finishes this held-out document (context: its first half; "
                            "endings: its rest and three other documents' rests)"} if items else None,
        "generated_by": "scripts/prepare_data.py"
                        + (f" with tokenizers {tokenizers.__version__}" if HAVE_TOKENIZERS else "")
                        + f", numpy {np.__version__}",
    }
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        f.write(json.dumps(meta, indent=2) + "\n")

    print(f"vocab {tok.vocab_size} (eot id {tok.eot_id}), {meta['token_dtype']} tokens")
    for name in ("train", "val"):
        sp = splits[name]
        files = ", ".join(s["file"] for s in sp["shards"]) or "-"
        print(f"{name}: {sp['documents']} documents, {sp['tokens']} tokens  [{files}]")
    if items:
        print(f"choices: {len(items)} items from held-out documents [val_choices.jsonl]")
    if splits["train"]["tokens"]:
        print(f"{n_chars / (splits['train']['tokens'] + splits['val']['tokens']):.2f} characters per token")
    print(f"wrote {args.out}/ in {time.time() - t0:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
