"""Write every Python standard-library source file as one JSONL document: a bigger
offline corpus than `prepare_data.py --demo` (its docstrings only).

Usage:
    python bench/stdlib_corpus.py OUT.jsonl
    python prepare_data.py OUT.jsonl --db DIR --table stdlib --score-field score
"""

import json
import os
import sys
import sysconfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from prepare_data import DEMO_SKIP_DIRS  # noqa: E402  (the demo's skip list: no site-packages, no tests)


def stdlib_sources() -> list[str]:
    """The stdlib's .py files in sorted path order, so the corpus is the same on every run."""
    paths = []
    for root, dirs, files in os.walk(sysconfig.get_paths()["stdlib"]):
        dirs[:] = [d for d in dirs if d not in DEMO_SKIP_DIRS]
        paths += [os.path.join(root, name) for name in files if name.endswith(".py")]
    return sorted(paths)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("error: usage: python bench/stdlib_corpus.py OUT.jsonl", file=sys.stderr)
        sys.exit(2)
    out, paths = argv[0], stdlib_sources()
    tmp = f"{out}.tmp{os.getpid()}"  # temp + rename: OUT is complete or absent
    with open(tmp, "w") as f:
        for path in paths:
            with open(path, "rb") as src:
                text = src.read().decode("utf-8", errors="replace")
            f.write(json.dumps({"text": text, "score": 2.0}) + "\n")
    os.replace(tmp, out)
    print(f"wrote {len(paths):,} stdlib source files to {out}")


if __name__ == "__main__":
    main()
