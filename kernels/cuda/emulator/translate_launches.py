#!/usr/bin/env python3
"""Rewrites a .cu file for the CUDA emulator (kernels/cuda/emulator): its kernel launches

    kernel<T, V><<<grid, block, smem, stream>>>(a, b);
become
    ::keel_emu::config(grid, block, smem, stream).run(kernel<T, V>, a, b);

which is plain C++ that g++ compiles. Two more rewrites let the emulator check the limits a GPU
checks from the compiled kernel, which a C++ function does not carry:
  - every __global__ function's body starts with
        if (!::keel_emu::kernel_entry(__PRETTY_FUNCTION__, MAX)) return;
    MAX being its __launch_bounds__' first argument (0 without one): a block of more threads
    fails the launch, and the kernel's name is known to the launch's messages;
  - every `__shared__ T a[N], b;` is followed by ::keel_emu::static_shared(&a, sizeof(a)); (and
    one for b): the launch adds up its static shared memory.
Everything else is copied unchanged (the line count too, so compiler messages point at the .cu
file's lines: a #line directive names it).

Usage: translate_launches.py IN.cu OUT.cpp
"""
import os
import re
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


def code_only(text):
    """text with its comments, string and character literals and preprocessor lines blanked
    (newlines kept), so that the searches below see code alone, at the same offsets."""
    out = list(text)
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and c == "#":  # a directive, with its continuation lines
            j = i
            while j < n and (text[j] != "\n" or text[j - 1] == "\\"):
                j += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j += 1
        else:
            if c == "\n":
                line_start = True
            elif not c.isspace():
                line_start = False
            i += 1
            continue
        for k in range(i, min(j, n)):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


def kernel_entries(code):
    """(offset just after a kernel body's '{', the statement to insert there) for every
    __global__ function definition in code (as code_only gives it)."""
    edits = []
    for m in re.finditer(r"\b__global__\b", code):
        bound = "0"
        lb = re.compile(r"\b__launch_bounds__\s*\(").search(code, m.end())
        open_paren = None
        # The parameter list: the first '(' after the name, past __launch_bounds__(...) when that
        # comes first.
        i = m.end()
        while True:
            i = code.find("(", i)
            if lb and i == lb.end() - 1:
                close = match_forward(code, i)
                bound = top_level_split(code[i + 1:close])[0].strip()
                i = close + 1
                continue
            open_paren = i
            break
        close = match_forward(code, open_paren)
        j = close + 1
        while code[j].isspace():
            j += 1
        if code[j] != "{":  # a declaration
            continue
        edits.append((j + 1, f" if (!::keel_emu::kernel_entry(__PRETTY_FUNCTION__, {bound})) return;"))
    return edits


def top_level_split(s):
    """s split at the commas outside (), [], <> and {}."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(s):
        if c in "([<{":
            depth += 1
        elif c in ")]>}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


def shared_notes(code):
    """(offset just after the ';', the statements to insert there) for every static __shared__
    declaration in code (as code_only gives it)."""
    edits = []
    for m in re.finditer(r"\b__shared__\b", code):
        if re.search(r"\bextern\s+$", code[max(0, m.start() - 40):m.start()]):
            continue  # dynamic shared memory: sized by the launch
        end = code.find(";", m.end())
        notes = []
        for decl in top_level_split(code[m.end():end]):
            name = re.findall(r"[A-Za-z_]\w*", re.split(r"[\[=]", decl)[0])[-1]
            notes.append(f" ::keel_emu::static_shared(&{name}, sizeof({name}));")
        edits.append((end + 1, "".join(notes)))
    return edits


def translate(text):
    code = code_only(text)
    edits = kernel_entries(code) + shared_notes(code)
    for at, insert in sorted(edits, reverse=True):  # from the end: earlier offsets stay valid
        text = text[:at] + insert + text[at:]
    return translate_launches(text)


def translate_launches(text):
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
