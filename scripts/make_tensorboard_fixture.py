#!/usr/bin/env python3
"""Build test/fixtures/tensorboard_events.bin: a TensorBoard event file written by the
`tensorboard` package's own protobuf classes and record writer, so test/train/test_tensorboard.cpp
can check keel's encoder (train/tensorboard.h) byte for byte.

The events cover what keel writes: the file-version event that opens every file, scalar
summaries (one event per metrics record, several values each), a step of 0 (proto3 leaves it
out), a step above 2^32 and a tag above 127 bytes (multi-byte varints), NaN and infinities,
a UTF-8 tag, and the SessionLog START that keel writes at a resume.

The same list is spelled out in the C++ test; change both together.

Usage:
  python3 scripts/make_tensorboard_fixture.py           # writes the fixture
  python3 scripts/make_tensorboard_fixture.py --check   # compares a fresh build with it
"""

from __future__ import annotations

import argparse
import io
import os
import sys

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.record_writer import RecordWriter

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "test", "fixtures", "tensorboard_events.bin")


def scalars(wall_time: float, step: int, values: list[tuple[str, float]]) -> event_pb2.Event:
    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=t, simple_value=v) for t, v in values])
    return event_pb2.Event(wall_time=wall_time, step=step, summary=summary)


def events() -> list[event_pb2.Event]:
    inf = float("inf")
    return [
        event_pb2.Event(wall_time=1700000000.25, file_version="brain.Event:2"),
        scalars(1700000001.5, 1, [("train/loss", 7.65625), ("train/lr", 3e-4), ("train/zero", 0.0),
                                  ("train/negative", -2.5)]),
        scalars(1700000002.0, 0, [("val/loss", 7.5)]),
        scalars(1700000003.125, 2**40 + 5, [("train/nan", float("nan")), ("train/inf", inf), ("train/-inf", -inf),
                                             ("layer/" + "x" * 200, 1.0), ("train/\u03b5", 1e-30)]),
        event_pb2.Event(wall_time=1700000100.0, step=600,
                        session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)),
        scalars(1700000101.0, 601, [("train/loss", 4.25)]),
    ]


def build() -> bytes:
    buf = io.BytesIO()
    writer = RecordWriter(buf)
    for e in events():
        writer.write(e.SerializeToString())
    return buf.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare a fresh build with the committed file")
    args = ap.parse_args()
    data = build()
    if args.check:
        with open(FIXTURE, "rb") as f:
            if f.read() != data:
                print(f"check FAILED: {FIXTURE} differs from a fresh build", file=sys.stderr)
                return 1
        print(f"check ok: {FIXTURE} ({len(data)} bytes)")
        return 0
    with open(FIXTURE, "wb") as f:
        f.write(data)
    print(f"wrote {FIXTURE} ({len(data)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
