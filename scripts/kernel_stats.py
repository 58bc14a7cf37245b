#!/usr/bin/env python3
"""Static statistics of CUDA kernels, for work on them without a GPU at hand.

For each kernel of one .cu file compiled for one architecture: registers, spills and (with
cuobjdump) the instructions of its main loop, the largest backward branch, by opcode. A
kernel's loop that is latency- or issue-bound shows here as instructions per tensor-core
instruction (HMMA; the wgmma kernels list their HGMMA count instead); the numbers are the code's,
not a measurement of time. The default architecture, sm_90a, is the build's for H100.

  scripts/kernel_stats.py kernels/cuda/attention_flash.cu [--arch sm_80] [--filter dkdv] [--ops 12]

With --log, the table of every kernel of a whole build instead (bench/PTXAS.md): registers,
spill stores and loads, stack frame and static shared memory, from the ptxas output of a build
configured with -DCMAKE_CUDA_FLAGS="-Xptxas -v" (its make output, saved to a file):

  scripts/kernel_stats.py --log build.log [--filter flash]

cuobjdump is not in every CUDA toolkit install; `pip install nvidia-cuda-cuobjdump` ships it
(the script looks on PATH, then in that package). Without it only registers are printed.
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile


def find_cuobjdump():
    tool = shutil.which("cuobjdump")
    if tool:
        return tool
    try:
        import nvidia  # the pip package's namespace
        for root in nvidia.__path__:
            for sub in ("cu13/bin", "cuda_cuobjdump/bin"):
                cand = os.path.join(root, sub, "cuobjdump")
                if os.path.exists(cand):
                    return cand
    except ImportError:
        pass
    return None


def demangle_short(name):
    """flash_forward_kernel<bf16,64,0> from its mangled name (types, ints and bools as arguments)."""
    m = re.search(r"\d+([a-z_]+_kernel)(I.*?EE)?Ev", name)
    if not m:
        return name[:100]
    types = {"13__nv_bfloat16": "bf16", "6__half": "f16", "f": "float"}
    args = re.findall(r"(13__nv_bfloat16|6__half|Li(\d+)E|Lb([01])E)", m.group(2) or "")
    shown = [types.get(a[0]) or a[1] or a[2] for a in args]
    return f"{m.group(1)}<{','.join(shown)}>" if shown else m.group(1)


def registers(ptxas_log):
    out = {}
    current = None
    for line in ptxas_log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(\w+)'", line)
        if m:
            current = m.group(1)
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            out.setdefault(current, {})["regs"] = int(m.group(1))
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current:
            out.setdefault(current, {})["spill"] = int(m.group(1)) + int(m.group(2))
            out[current]["stores"], out[current]["loads"] = int(m.group(1)), int(m.group(2))
            out[current]["stack"] = int(re.search(r"(\d+) bytes stack frame", line).group(1))
        m = re.search(r"(\d+) bytes smem", line)
        if m and current:
            out.setdefault(current, {})["smem"] = int(m.group(1))
    return out


def demangle_all(names):
    """Readable kernel names with template arguments (c++filt, without keel's namespaces, the
    return type and the parameter list); demangle_short's where c++filt is missing."""
    tool = shutil.which("c++filt")
    if not tool:
        return [demangle_short(n) for n in names]
    full = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    out = []
    for n in full:
        n = re.sub(r"\(anonymous namespace\)::|keel::cuda::|^void ", "", n)
        depth = 0
        for i in range(len(n) - 1, -1, -1):  # drop the parameter list: the last top-level (...)
            depth += {")": 1, "(": -1}.get(n[i], 0)
            if depth == 0 and n[i] == "(":
                n = n[:i]
                break
        out.append(n.replace("__nv_bfloat16", "bf16").replace("__half", "f16"))
    return out


def log_table(path, name_filter):
    """The markdown table of every kernel in a build's ptxas output (one row per kernel; a
    kernel compiled for several architectures shows its last)."""
    with open(path) as f:
        stats = registers(f.read())
    print("| kernel | registers | spill stores (B) | spill loads (B) | stack frame (B) | static smem (B) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    rows = sorted(zip(demangle_all(list(stats)), stats.values()), key=lambda row: row[0])
    for short, r in rows:
        if name_filter not in short:
            continue
        print(f"| {short} | {r.get('regs', '?')} | {r.get('stores', 0)} | {r.get('loads', 0)} | {r.get('stack', 0)} "
              f"| {r.get('smem', 0)} |")


def loops(sass):
    result = {}
    for chunk in sass.split("Function : ")[1:]:
        name = chunk.split("\n", 1)[0].strip()
        ins = []
        for line in chunk.split("\n"):
            m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
            if m:
                toks = m.group(2).split()
                if toks and toks[0].startswith("@"):
                    toks = toks[1:]
                ins.append((int(m.group(1), 16), toks[0] if toks else "", m.group(2)))
        best = None
        for addr, op, body in ins:
            m = re.search(r"BRA\s+(?:\S+,\s*)?0x([0-9a-f]+)", body) if op.startswith("BRA") else None
            if m and int(m.group(1), 16) < addr:
                lo = int(m.group(1), 16)
                if best is None or addr - lo > best[1] - best[0]:
                    best = (lo, addr)
        body = [op for addr, op, _ in ins if best and best[0] <= addr <= best[1]]
        result[name] = collections.Counter(op.split(".")[0] for op in body)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", nargs="?")
    ap.add_argument("--log", help="a build's ptxas -v output: tabulate every kernel in it")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--filter", default="", help="only kernels whose name contains this")
    ap.add_argument("--ops", type=int, default=10, help="opcodes listed per loop")
    args = ap.parse_args()
    if args.log:
        return log_table(args.log, args.filter)
    if not args.source:
        ap.error("name a .cu file, or a build's ptxas output with --log")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        obj = os.path.join(tmp, "k.o")
        cmd = ["nvcc", "-O3", "-std=c++20", "--expt-relaxed-constexpr", f"-arch={args.arch}", f"-I{repo}",
               "-Xptxas", "-v", "-c", args.source, "-o", obj]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(run.stderr)
        regs = registers(run.stderr)
        tool = find_cuobjdump()
        sass = subprocess.run([tool, "-sass", obj], capture_output=True, text=True).stdout if tool else ""
    body = loops(sass) if sass else {}
    if not tool:
        print("(no cuobjdump: registers only; pip install nvidia-cuda-cuobjdump)")
    for name in sorted(regs, key=demangle_short):
        short = demangle_short(name)
        if args.filter not in short:
            continue
        r = regs[name]
        line = f"{short:58s} regs {r.get('regs', '?'):>3} spill {r.get('spill', 0):>4}"
        h = body.get(name)
        if h:
            total, mma, wg = sum(h.values()), h.get("HMMA", 0), h.get("HGMMA", 0)
            per = f"{total / mma:5.1f}/HMMA" if mma else f"{wg:3d} HGMMA " if wg else ""
            line += f"  loop {total:5d} instr {per}  " + ", ".join(f"{k} {v}" for k, v in h.most_common(args.ops))
        print(line)


if __name__ == "__main__":
    main()
