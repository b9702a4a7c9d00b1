"""Where conversations come from: a file (jsonl, json, parquet), a folder of them, or an sf-regen
output, read through its manifest (conversations/regen_format.py). Loading reports every bad
record with its location (conversations/records.py) and keeps the good ones, in a deterministic
order."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from specfoundry.conversations.records import (
    BadInput,
    Conversation,
    ConversationFormatError,
    LoadResult,
    normalise,
)
from specfoundry.conversations.regen_format import FORMAT, MANIFEST_NAME, regen_files

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")

RUN_RECORDS = ("regen", "capture", "train", "eval", "export", "gate")
"""The stages whose output folder holds `<stage>_config.json`, the record of its run."""


def stage_run(folder: Path) -> str | None:
    """The stage whose output `folder` holds ('regen', 'capture', ...), or None. Such a folder is
    read through its stage's contract (a regen output through its manifest), never as loose files:
    its config, done marks and manifest are no conversations, and a partial shard is no data."""
    for stage in RUN_RECORDS:
        if (folder / f"{stage}_config.json").is_file():
            return stage
    manifest = folder / MANIFEST_NAME
    if manifest.is_file():
        try:
            record = json.loads(manifest.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        if isinstance(record, dict) and record.get("shards") is not None:
            return "regen" if record.get("format", FORMAT) == FORMAT else "capture"
    return None


def loose_files(folder: Path, partial: bool, seen: frozenset = frozenset()) -> list[Path]:
    """The data files under a folder that holds no stage's run; a sub-folder holding an sf-regen
    run adds its listed shards, one holding another stage's run adds nothing. Hidden files (partial
    shards, temporaries) and done marks are never data. A linked folder is read as a file behind a
    link is; one that leads back into a folder being read is refused (it would be read forever)."""
    seen = seen | {folder.resolve()}
    found = []
    for p in sorted(folder.iterdir()):
        if p.name.startswith("."):
            continue
        if p.is_dir():
            if p.resolve() in seen:
                raise ConversationFormatError(f"{p} links back to {p.resolve()}, a folder being read: remove the link "
                                              "or name the folders to read")
            run = stage_run(p)
            found += regen_files(p, partial) if run == "regen" else [] if run else loose_files(p, partial, seen)
        elif p.suffix in DATA_SUFFIXES and p.name != MANIFEST_NAME and not p.name.endswith(".done.json"):
            found.append(p)
    return found


def data_files(source: str | Path, partial: bool = False) -> list[Path]:
    """The data files of a source: a file, a folder of them, or a specfoundry regen output
    (refused while its run is incomplete, unless `partial`: then its finished shards)."""
    path = Path(source)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"no such file or folder: {path}")
    run = stage_run(path)
    if run == "regen":
        return regen_files(path, partial)
    if run:
        raise ConversationFormatError(f"{path} holds an sf-{run} run, not conversations")
    files = sorted(loose_files(path, partial))
    if not files:
        raise FileNotFoundError(f"{path} holds no .jsonl, .json or .parquet files")
    return files


def iter_records(path: Path) -> Iterator[tuple[str, dict | None, str | None]]:
    """Yield (location, record, error) for each record of one file.

    jsonl is read line by line so one malformed line is reported with its number instead of
    failing the whole file; parquet is streamed by row group with pyarrow (no cache copy of the
    data, unlike `datasets`); json arrays go through `datasets`.
    """
    if path.suffix == ".jsonl":
        with path.open("rb") as f:  # bytes: one line of invalid UTF-8 is that record's problem only
            for lineno, raw in enumerate(f, start=1):
                where = f"{path}:{lineno}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield where, None, f"invalid UTF-8 (byte {e.start})"
                    continue
                if not line.strip():
                    continue
                try:
                    record = json.loads(line.rstrip("\r\n"))  # with its newline, an unclosed line errs at line 2 column 1
                except json.JSONDecodeError as e:
                    yield where, None, f"malformed JSON ({e.msg} at column {e.colno})"
                    continue
                if not isinstance(record, dict):
                    yield where, None, f"expected a JSON object, got {type(record).__name__}"
                    continue
                yield where, record, None
        return
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
            row = 0
            for batch in batches:
                for record in batch.to_pylist():
                    yield f"{path}:row {row}", record, None
                    row += 1
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for damaged files
            yield f"{path}", None, f"unreadable parquet file ({type(e).__name__}: {str(e).splitlines()[0]})"
        return
    import datasets

    fmt = "json"
    try:
        ds = datasets.load_dataset(fmt, data_files=[str(path)], split="train")
    except Exception as e:  # noqa: BLE001 - datasets raises many types for unreadable files
        yield f"{path}", None, f"unreadable {fmt} file ({type(e).__name__}: {str(e).splitlines()[0]})"
        return
    for i, record in enumerate(ds):
        yield f"{path}:row {i}", record, None


def load_conversations(source: str | Path, strict: bool = False, limit: int | None = None,
                       prompt_only: bool = False, partial: bool = False, answer_open: bool = False) -> LoadResult:
    """Load and normalise every conversation of a source, in a deterministic order.

    With ``strict`` the first bad record raises ConversationFormatError naming its location;
    with ``prompt_only`` records are prompts, with ``answer_open`` a conversation may end on an
    unanswered user turn (see normalise); ``partial``: see data_files.
    """
    result = LoadResult()
    first_of: dict[str, str] = {}  # a record's own id -> where it was first used
    for path in data_files(source, partial):
        for index, (where, record, error) in enumerate(iter_records(path)):
            if limit is not None and len(result.conversations) >= limit:
                return result
            item = (
                BadInput(where, "invalid_utf8" if error.startswith("invalid UTF-8") else "malformed_json", error)
                if record is None
                else normalise(record, where, default_id=f"{path.stem}-{index}", prompt_only=prompt_only,
                               answer_open=answer_open)
            )
            if isinstance(item, Conversation) and record.get("id") is not None:
                if item.id in first_of:  # two outputs under one id: which one a later stage means is unclear
                    item = BadInput(where, "duplicate_id", f"id {item.id!r} is used already, by {first_of[item.id]}")
                else:
                    first_of[item.id] = where
            if isinstance(item, BadInput):
                if strict:
                    raise ConversationFormatError(str(item))
                result.bad.append(item)
            else:
                result.conversations.append(item)
    return result
