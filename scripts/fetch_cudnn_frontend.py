#!/usr/bin/env python3
"""Fetch NVIDIA's cuDNN frontend headers (Apache-2.0 / MIT) into third_party/cudnn-frontend.

keel's cuDNN attention (KEEL_ATTENTION=cudnn, kernels/cuda/attention_cudnn.cpp) is built on the
frontend's graph API. The frontend is header-only but not packaged by Debian; PyPI ships its
headers inside the `nvidia-cudnn-frontend` wheels, so this takes one pinned wheel from PyPI,
checks its SHA-256, and unpacks `include/` and the licence files. Only the standard library is
used. CMake picks the headers up from there; without them keel builds without cuDNN attention.

    scripts/fetch_cudnn_frontend.py [--dest DIR]     (scripts/setup.sh runs it when nvcc is found)

Nothing is fetched when DEST already holds this version. Exit status 1 (with the reason) when
the wheel cannot be fetched or does not match its checksum; nothing is left half-written.
"""
import argparse
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import urllib.request
import zipfile

VERSION = "1.32.0"
# Any of the release's wheels carries the same headers; this one is pinned by name and hash.
WHEEL = f"nvidia_cudnn_frontend-{VERSION}-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
SHA256 = "c6006556017a4d1c914c52a556c71b1267f2d6a0500f742e7b4edef539878df0"
INDEX = os.environ.get("KEEL_PYPI_SIMPLE", "https://pypi.org/simple") + "/nvidia-cudnn-frontend/"


def wheel_url():
    req = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    for f in files:
        if f["filename"] == WHEEL:
            return f["url"]
    raise RuntimeError(f"{WHEEL} is not listed at {INDEX}")


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", default=os.path.join(root, "third_party", "cudnn-frontend"))
    args = ap.parse_args()
    stamp = os.path.join(args.dest, "VERSION")
    if os.path.exists(stamp) and open(stamp).read().strip() == VERSION:
        print(f"fetch_cudnn_frontend: {args.dest} has {VERSION}")
        return 0
    try:
        url = wheel_url()
        with urllib.request.urlopen(url, timeout=300) as r:
            blob = r.read()
    except Exception as e:  # no network, no index: keel builds without cuDNN attention
        print(f"fetch_cudnn_frontend: cannot fetch {WHEEL}: {e}", file=sys.stderr)
        return 1
    digest = hashlib.sha256(blob).hexdigest()
    if digest != SHA256:
        print(f"fetch_cudnn_frontend: {WHEEL} has SHA-256 {digest}, expected {SHA256}: not used", file=sys.stderr)
        return 1
    parent = os.path.dirname(os.path.abspath(args.dest))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".cudnn-frontend-", dir=parent)
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            for name in z.namelist():
                if name.endswith("/"):
                    continue
                if name.startswith("include/"):
                    target = name
                elif "/licenses/" in name and ".dist-info/" in name:
                    target = os.path.join("licenses", os.path.basename(name))
                else:
                    continue
                path = os.path.join(tmp, target)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with z.open(name) as src, open(path, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        with open(os.path.join(tmp, "VERSION"), "w") as f:
            f.write(VERSION + "\n")
        if os.path.exists(args.dest):
            shutil.rmtree(args.dest)
        os.rename(tmp, args.dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"fetch_cudnn_frontend: cuDNN frontend {VERSION} headers in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
