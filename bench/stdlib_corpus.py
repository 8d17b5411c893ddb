"""Offline corpora for the loader benchmark, bigger than `prepare_data.py --demo`.

Usage:
    python bench/stdlib_corpus.py OUT.jsonl                # one document per stdlib source file
    python bench/stdlib_corpus.py OUT.jsonl --docstrings   # every docstring of the stdlib and
                                                           # site-packages, tests included
    python prepare_data.py OUT.jsonl --db DIR --table NAME --score-field score

Source files are long documents (~16K bytes each); docstrings are short ones (~440
bytes, like web pages in GPT-2 tokens), which is what in-loader packing is most
sensitive to. Paths are walked in sorted order, so a given installation always gives
the same corpus; site-packages makes it depend on what is installed.
"""

import argparse
import ast
import inspect
import json
import os
import sys
import sysconfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import UserError, atomic_write, check_out_dir  # noqa: E402
from prepare_data import DEMO_SKIP_DIRS, DOCUMENTED_NODES  # noqa: E402


def python_files(roots: list[str], skip: set[str]) -> list[str]:
    """The .py files under `roots` in sorted path order, skipping directories named in `skip`."""
    paths = []
    for top in roots:
        for root, dirs, files in os.walk(top):
            dirs[:] = sorted(d for d in dirs if d not in skip)
            paths += [os.path.join(root, name) for name in sorted(files) if name.endswith(".py")]
    return paths


def docstrings(path: str):
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, ValueError, OSError):
        return
    for node in ast.walk(tree):
        doc = isinstance(node, DOCUMENTED_NODES) and ast.get_docstring(node, clean=False)
        if doc:
            yield inspect.cleandoc(doc)


def source(path: str) -> str:
    """A whole source file as text; one that cannot be read is a one-line error (as an
    OSError inside the writer it would read as OUT not being writable)."""
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")
    except OSError as e:
        raise UserError(f"cannot read {path!r}: {e.strerror or e}") from None


def write_corpus(out: str, docstrings_only: bool) -> tuple[int, int]:
    """Write the corpus to `out`, complete or absent; returns (documents, files read)."""
    check_out_dir("OUT", out)  # before the walk, like the other benchmarks' outputs
    paths = sysconfig.get_paths()
    if docstrings_only:
        files = python_files([paths["stdlib"], paths["purelib"]], {"__pycache__"})
        texts = (doc for path in files for doc in docstrings(path))
    else:
        files = python_files([paths["stdlib"]], DEMO_SKIP_DIRS)
        texts = (source(path) for path in files)
    count = 0

    def write(tmp: str) -> None:
        nonlocal count
        with open(tmp, "w") as f:
            for text in texts:
                f.write(json.dumps({"text": text, "score": 2.0}) + "\n")
                count += 1

    atomic_write(out, write)
    return count, len(files)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", metavar="OUT.jsonl")
    p.add_argument("--docstrings", action="store_true",
                   help="docstrings of the stdlib and site-packages instead of whole stdlib files")
    args = p.parse_args(argv)
    try:
        count, files = write_corpus(args.out, args.docstrings)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {count:,} documents from {files:,} files to {args.out}")


if __name__ == "__main__":
    main()
