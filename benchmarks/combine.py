"""Figures of separate runs in the one result file an issue names, each with its source.

    python -m benchmarks.combine DEST KEY=FILE:SRCKEY [KEY=FILE:SRCKEY ...]

DEST and FILE are result files under benchmarks/results (a name, `.json` optional, or a path); KEY
and SRCKEY are dotted key paths. DEST's KEY becomes FILE's SRCKEY (a number or a whole table), and
DEST's `sources` maps KEY to where it came from: the file and key, and that run's commit, command,
machine and date. A DEST that does not exist is created holding only the combined keys and
`sources`: it has no machine or commit of its own, each figure's is in its source. Combining never
overwrites a measurement: a KEY that DEST holds as a figure of its own run (no source) is refused
unless the value is the same (then left as its own), and so is a KEY above or below one combined
before (combine whole tables or their parts, not both), a KEY given twice, and a FILE with no
commit of its own (a combined file: combine from the run's file). Rerunning the same command
changes nothing; `combined` lists each command that wrote into DEST.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS, command
from specfoundry.common.files import atomic_write_json

PROVENANCE = ("commit", "command", "machine", "date")  # what `sources` copies from a run's file


def result_path(name: str) -> Path:
    path = Path(name if name.endswith(".json") else f"{name}.json")
    return path if path.is_absolute() else RESULTS / path


def parse(spec: str) -> tuple[str, str, str]:
    """KEY=FILE:SRCKEY -> (KEY, FILE, SRCKEY)."""
    key, _, source = spec.partition("=")
    file, _, source_key = source.rpartition(":")
    if not (key and file and source_key):
        raise SystemExit(f"{spec!r}: expected KEY=FILE:SRCKEY (dotted keys, FILE a result file)")
    return key, file, source_key


MISSING = object()


def lookup(tree: dict, dotted: str, where: str, default=MISSING):
    """tree's value at the dotted key; where it has none, `default`, or an error naming `where`."""
    value = tree
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            if default is not MISSING:
                return default
            raise SystemExit(f"{where}: no key {dotted!r}")
        value = value[part]
    return value


def place(tree: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[last] = value


def combine(dest: str, specs: list[str]) -> Path:
    path = result_path(dest)
    out = json.loads(path.read_text()) if path.exists() else {"benchmark": path.stem}
    sources = out.setdefault("sources", {})
    parsed = [parse(spec) for spec in specs]
    keys = [key for key, _, _ in parsed]
    if len(set(keys)) < len(keys):
        raise SystemExit(f"a KEY is given twice: {sorted(k for k in set(keys) if keys.count(k) > 1)}")
    for (key, file, source_key), spec in zip(parsed, specs, strict=True):
        source_path = result_path(file)
        if not source_path.exists():
            raise SystemExit(f"{spec!r}: {source_path} does not exist")
        run = json.loads(source_path.read_text())
        if not run.get("commit"):
            raise SystemExit(f"{source_path}: no commit of its own (a combined file?); combine from the run's file")
        value = lookup(run, source_key, str(source_path))
        nested = [k for k in sources if k != key and (k.startswith(key + ".") or key.startswith(k + "."))]
        if nested:
            raise SystemExit(f"{path}: {key!r} overlaps {nested[0]!r}, combined before; combine whole tables or "
                             "their parts, not both")
        held = lookup(out, key, str(path), default=None)
        if held is not None and key not in sources:
            if held == value:
                continue  # the file's own figure, left as its own
            raise SystemExit(f"{path}: {key!r} is a figure of its own run; not overwritten by {source_path}")
        place(out, key, value)
        sources[key] = {"file": source_path.name, "key": source_key, **{k: run.get(k) for k in PROVENANCE}}
    combined = out.setdefault("combined", [])
    if command() not in [c["command"] for c in combined]:
        combined.append({"command": command(), "date": time.strftime("%Y-%m-%d %H:%M:%S")})
    atomic_write_json(path, out)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", help="the result file to write into (created if missing)")
    parser.add_argument("specs", nargs="+", metavar="KEY=FILE:SRCKEY", help="a figure to copy, and from where")
    args = parser.parse_args(argv)
    print(f"wrote {combine(args.dest, args.specs)}")


if __name__ == "__main__":
    main(sys.argv[1:])
