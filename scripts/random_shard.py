#!/usr/bin/env python3
"""An llm.c token shard of uniform random tokens, for benchmarks and GPU checks (a step costs
the same on any tokens):

    python3 scripts/random_shard.py OUT TOKENS --config configs/llama-1b.json   # its vocab_size
    python3 scripts/random_shard.py OUT TOKENS --vocab 2048

Vocabularies up to 65536 get a GPT-2 shard (uint16 tokens, magic 20240520), larger ones a
Llama 3 shard (uint32, magic 20240801).
"""
import argparse
import json

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("tokens", type=int)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="keel run config whose model.vocab_size to draw from")
    src.add_argument("--vocab", type=int)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    vocab = a.vocab if a.vocab else json.load(open(a.config))["model"]["vocab_size"]
    header = np.zeros(256, dtype="<i4")
    if vocab <= 65536:
        header[0], header[1], dtype = 20240520, 1, "<u2"
    else:
        header[0], header[1], dtype = 20240801, 7, "<u4"
    header[2] = a.tokens
    with open(a.out, "wb") as f:
        f.write(header.tobytes())
        f.write(np.random.default_rng(a.seed).integers(0, vocab, size=a.tokens).astype(dtype).tobytes())


if __name__ == "__main__":
    main()
