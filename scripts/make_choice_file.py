#!/usr/bin/env python3
"""Turn HellaSwag's own JSONL (hellaswag_val.jsonl: "ctx", "endings", "label") into the items
keel eval reads: {"context": ctx, "endings": [" " + ending, ...], "label": label}.

Each ending gets a leading space because keel encodes it on its own and it continues the
context's last word with a space between (llm.c and lm-evaluation-harness score HellaSwag the
same way). The file itself is not shipped: download it once where you have network access.

Usage:
  python3 scripts/make_choice_file.py hellaswag_val.jsonl data/hellaswag_val.jsonl
  build/keel eval --checkpoint out/gpt2-124m/checkpoints --choices data/hellaswag_val.jsonl
"""

import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="HellaSwag JSONL (ctx, endings, label)")
    ap.add_argument("dst", help="keel eval choice file to write")
    args = ap.parse_args()
    n = 0
    with open(args.src, encoding="utf-8") as f, open(args.dst, "w", encoding="utf-8") as out:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            ex = json.loads(line)
            for key in ("ctx", "endings", "label"):
                if key not in ex:
                    sys.exit(f"{args.src}:{line_no}: no \"{key}\" field (is this HellaSwag's JSONL?)")
            item = {"context": ex["ctx"], "endings": [" " + e for e in ex["endings"]], "label": int(ex["label"])}
            out.write(json.dumps(item, ensure_ascii=False) + "\n")
            n += 1
    print(f"wrote {n} items to {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
