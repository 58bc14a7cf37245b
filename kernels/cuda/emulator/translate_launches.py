#!/usr/bin/env python3
"""Rewrites a .cu file's kernel launches for the CUDA emulator (kernels/cuda/emulator).

    kernel<T, V><<<grid, block, smem, stream>>>(a, b);
becomes
    ::keel_emu::config(grid, block, smem, stream).run(kernel<T, V>, a, b);

which is plain C++ that g++ compiles; everything else is copied unchanged (the line count too,
so compiler messages point at the .cu file's lines: a #line directive names it).

Usage: translate_launches.py IN.cu OUT.cpp
"""
import os
import sys

IDENT = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


def match_back(text, end, open_ch, close_ch):
    """Index of the open_ch matching the close_ch at text[end], walking back over nested () and <>."""
    depth = 0
    i = end
    while i >= 0:
        c = text[i]
        if c in ")>":
            depth += 1
        elif c in "(<":
            depth -= 1
            if depth == 0:
                if c != open_ch:
                    raise ValueError(f"unbalanced {close_ch} before offset {end}")
                return i
        i -= 1
    raise ValueError(f"no {open_ch} for the {close_ch} at offset {end}")


def callee_start(text, end):
    """Start of the kernel expression (qualified name, template arguments) ending just before `end`."""
    i = end - 1
    while True:
        while i >= 0 and text[i].isspace():
            i -= 1
        if text[i] == ">":
            i = match_back(text, i, "<", ">") - 1
            while i >= 0 and text[i].isspace():
                i -= 1
        if not (i >= 0 and text[i] in IDENT):
            raise ValueError(f"no kernel name before offset {end}")
        while i >= 0 and text[i] in IDENT:
            i -= 1
        j = i
        while j >= 0 and text[j].isspace():
            j -= 1
        if j >= 1 and text[j - 1:j + 1] == "::":
            i = j - 2
            continue
        return i + 1


def match_forward(text, start):
    """Index of the ')' closing the '(' at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"no ) for the ( at offset {start}")


def translate(text):
    out = []
    pos = 0
    while True:
        k = text.find("<<<", pos)
        if k < 0:
            out.append(text[pos:])
            return "".join(out)
        name_at = callee_start(text, k)
        cfg_end = text.find(">>>", k)
        open_paren = cfg_end + 3
        while text[open_paren].isspace():
            open_paren += 1
        if text[open_paren] != "(":
            raise ValueError(f"no argument list after the launch at offset {k}")
        close_paren = match_forward(text, open_paren)
        name = text[name_at:k].strip()
        cfg = text[k + 3:cfg_end]
        args = text[open_paren + 1:close_paren]
        call = f"::keel_emu::config({cfg}).run({name}" + (f", {args}" if args.strip() else "") + ")"
        # Keep the line count: the launch's newlines go after the call.
        lines = text[name_at:close_paren + 1].count("\n") - call.count("\n")
        out.append(text[pos:name_at])
        out.append(call + "\n" * max(lines, 0))
        pos = close_paren + 1


def main():
    src, dst = sys.argv[1], sys.argv[2]
    with open(src) as f:
        text = f.read()
    try:
        body = translate(text)
    except ValueError as e:
        sys.exit(f"{src}: {e}")
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    with open(dst, "w") as f:
        f.write(f'#line 1 "{src}"\n' + body)


if __name__ == "__main__":
    main()
