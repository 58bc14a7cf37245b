"""The last step of a fixture script: write the fixture, or with --check compare a fresh build
with the committed file (exit 1 when it differs)."""
import os


def write_or_check(path: str, text: str, check: bool) -> int:
    name = os.path.basename(path)
    if check:
        with open(path, encoding="utf-8") as f:
            same = f.read() == text
        print(name + (" matches" if same else " DIFFERS"))
        return 0 if same else 1
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {path} ({len(text.encode('utf-8'))} bytes)")
    return 0
