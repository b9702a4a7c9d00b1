"""The one resume mechanism of the sharded stages (sf-regen, sf-capture).

An output folder holds `<stage>_config.json` (the resolved config of the run that last wrote
it), the shards, and beside each finished shard a done mark `<shard>.done.json` (its checksum
and what the stage records about it). The mechanism guarantees:

- the first run records its config; a rerun whose settings differ is refused, naming each
  differing setting with its old and new value (settings marked `resume=False`, such as the
  device, may change);
- a shard is written under `.partial-<name>`, renamed into place, then marked done: a reader
  trusts only marked shards whose checksum matches, so a kill at any moment leaves either a
  shard that is redone on the rerun or one that is kept;
- a rerun with the same settings skips the marked shards and redoes the rest, so, shards being
  fixed units of a deterministic order, it ends byte-identical to an uninterrupted run;
- a shard's done mark records what it was made from, so a rerun redoes a shard whose source changed;
- one run at a time writes into a folder (output_lock, held by each command for the run's life).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from specfoundry.common.files import atomic_write_json, checksum, remove_temporaries
from specfoundry.common.settings import (
    SettingsGroup,
    as_before,
    config_dict,
    recorded_forms,
    resume_settings,
)

PARTIAL = ".partial-"


class OutputFolderError(ValueError):
    """The output folder cannot take this run (another run's settings, not a folder, ...)."""


def settings_diff(old: dict, new: dict, prefix: str = "", as_before: dict | None = None) -> list[str]:
    """'key: old -> new' for every key of `new` whose value differs in `old` (nested dicts by dotted key).
    A key `old` lacks is no difference while `new` holds its 'as before' value (`as_before`'s, from
    common.settings.as_before; None where it names none): a setting added to the config after that
    run began, set to do what the run did, so the run still resumes. A whole group it lacks is
    compared setting by setting the same way."""
    diffs, as_before = [], as_before or {}
    for key, value in new.items():
        yardstick = as_before.get(key)
        group = yardstick if isinstance(yardstick, SettingsGroup) else None
        missing = isinstance(old, dict) and key not in old
        if missing and group is None and value == yardstick:
            continue
        before = old.get(key, "<unset>") if isinstance(old, dict) else "<unset>"
        if isinstance(value, dict) and (isinstance(before, dict) or (missing and group is not None)):
            diffs += settings_diff(before if isinstance(before, dict) else {}, value, f"{prefix}{key}.", group)
        elif before != value:
            diffs.append(f"{prefix}{key}: {before!r} -> {value!r}")
    return diffs


def remove(path: Path) -> None:
    """Remove a file or a folder, if there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def output_inside_source(source: str | None, output: str | None) -> str | None:
    """The refusal of an output folder inside (or equal to) its source folder, or None: a rerun
    would read the output's own files as new input."""
    if not source or not output or not Path(source).is_dir():
        return None
    src, out = Path(source).resolve(), Path(output).resolve()
    if out == src or src in out.parents:
        return (f"--output {output} is inside the source folder {source}: a rerun would read the output's own "
                "files as new input; choose an output folder outside it")
    return None


def writable_folder(root: Path) -> None:
    """Refuse an output path that is a file, a symlink to nothing, or whose nearest existing folder
    cannot be written."""
    if root.exists() and not root.is_dir():
        raise OutputFolderError(f"{root} is a file, not an output folder")
    for p in (root, *root.parents):
        if p.is_symlink() and not p.exists():  # mkdir would fail with a bare "File exists"
            raise OutputFolderError(f"{p} is a symlink to {os.readlink(p)}, which does not exist: create that "
                                    f"folder, or choose another output")
        if p.exists():
            break
    existing = next(p for p in (root, *root.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputFolderError(f"{root}: cannot write in {existing} (permission denied, or a read-only filesystem)")


def check_output_folder(root: Path, stage: str, cfg) -> Path:
    """Refuse `root` for a run of `cfg` before any long work: not a writable folder, another
    stage's or another run's output. Returns the path of the config record."""
    root = Path(root)
    writable_folder(root)
    path = root / f"{stage}_config.json"
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError:
            old = {}  # a config file is written atomically; an unreadable one is not ours to trust
        new = resume_settings(cfg)
        # settings compare in their recorded forms: a path recorded relative (by an earlier version, or
        # by a config built in code) is read from the current directory
        for record in (old, new):
            if isinstance(record, dict):
                record.update({k: form(record[k]) for k, form in recorded_forms(cfg).items()
                               if isinstance(record.get(k), str)})
        diffs = settings_diff(old, new, as_before=as_before(cfg))
        if diffs:
            raise OutputFolderError(f"{root} holds an earlier {stage} run with other settings ({'; '.join(diffs)}); "
                                    "rerun with the same settings to resume, or choose a new folder")
    elif stage in STAGE_PARTS and (root / STAGE_PARTS[stage]).is_dir():
        raise OutputFolderError(lost_record(root, stage))
    elif root.is_dir() and any(not p.name.startswith(".") for p in root.iterdir()):  # another rank's temporaries
        raise OutputFolderError(f"{root} is not empty and holds no {stage} run; choose a new or empty folder")
    return path


STAGE_PARTS = {"regen": "data", "capture": "shards", "train": "checkpoints"}
"""The folder of a stage's output that shows a run wrote there."""


def lost_record(root: Path, stage: str) -> str:
    """What to say of a folder holding a stage's output without its config record: what is
    missing, and how to go on (sf-train keeps a copy of the record in each checkpoint)."""
    record = root / f"{stage}_config.json"
    copies = sorted(root.glob(f"{STAGE_PARTS[stage]}/*/{record.name}"))
    how = (f"copy {copies[-1]} back to {record} and rerun the same command to resume" if copies else
           f"restore {record} (the settings the run began with) and rerun the same command to resume")
    return (f"{root} holds the {STAGE_PARTS[stage]}/ of an sf-{stage} run but not {record.name}, the record of its "
            f"settings, so no rerun can tell whether it may continue it: {how}, or choose a new folder")


LOCK = ".lock"


@contextmanager
def output_lock(root: Path, stage: str):
    """Hold the output folder for a run's life: a second run into it is refused in one line. The
    lock is the operating system's (flock, through filelock) on <root>/.lock, so the lock of a
    killed run ends with its process and the file it leaves never blocks a rerun. The file is
    removed when the run ends, and so are the folders the run made if it wrote nothing in them.
    Under torchrun, rank 0 holds it for every rank of the launch."""
    if int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    root = Path(root)
    writable_folder(root)
    made = []  # the folders this run makes: root and the missing folders above it
    for p in (root, *root.parents):
        if p.exists():
            break
        made.append(p)
    root.mkdir(parents=True, exist_ok=True)
    try:
        with held(root / LOCK, f"{root}: another sf-{stage} run is writing into this folder"):
            yield
    finally:
        for p in made:  # a run refused before it wrote anything leaves nothing behind
            try:
                p.rmdir()
            except OSError:
                break


@contextmanager
def sibling_lock(dest: Path, stage: str):
    """Hold `dest` for a command that writes it whole and renames it into place (sf-export), where a
    lock inside it would be replaced with it: the operating system's lock on <parent>/.<name>.lock,
    a second run refused in one line, the file removed when the run ends."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with held(dest.with_name(f".{dest.name}{LOCK}"), f"{dest}: another sf-{stage} run is writing it"):
        yield


@contextmanager
def held(path: Path, busy: str):
    """The operating system's lock (flock, through filelock) on `path` while the block runs: a second
    holder is refused in one line (`busy`, then the lock's path); the lock of a killed run ends with
    its process, and the file is removed when the block ends."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(path), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise OutputFolderError(f"{busy} (it holds {path}); wait for it to end, or choose another folder") from None
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # while held: a run opening it now finds the file gone and tries again
        lock.release()


def record_config(root: Path, stage: str, cfg) -> None:
    """Check the folder as check_output_folder does, then record `cfg` as the run's config."""
    path = check_output_folder(root, stage, cfg)
    Path(root).mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, config_dict(cfg))


class ShardedOutput:
    """The shards of one output folder: which are finished, and writing one so that it appears whole.

    `made_from`: per shard, a hash of the input records it is made from (the stage's own choice of
    what to hash). Each done mark records it; a finished shard whose mark records another (its
    source changed since: an edited record, an inserted line) is no longer finished, so a rerun
    writes it again, saying so. A mark without one (written before hashes were recorded) is kept."""

    def __init__(self, root: Path, made_from: dict[str, str] | None = None, source: str | None = None):
        self.root = Path(root)
        self.made_from = dict(made_from or {})
        self.source = source  # what the records come from, for the message

    def mark_path(self, rel: str) -> Path:
        return self.root / (rel + ".done.json")

    def finished(self, rel: str) -> dict | None:
        """The done mark of shard `rel` if the shard is there and its checksum matches, else None."""
        mark = self.mark_path(rel)
        if not mark.is_file() or not (self.root / rel).exists():
            return None
        try:
            entry = json.loads(mark.read_text())
        except json.JSONDecodeError:
            return None
        return entry if checksum(self.root / rel) == entry.get("sha256") else None

    def changed(self, rel: str, mark: dict) -> bool:
        """Whether finished shard `rel` was made from other input records than it is made from now."""
        want = self.made_from.get(rel)
        return want is not None and mark.get("source_sha256", want) != want

    def pending(self, rels: list[str], holds=None) -> list[str]:
        """The shards of `rels` still to write; a stale mark of one (its shard damaged or gone, made
        from other input records, or, with `holds(rel, mark)`, not holding what the plan puts
        there) is dropped."""
        todo, changed = [], []
        for rel in rels:
            mark = self.finished(rel)
            if mark is not None and self.changed(rel, mark):
                changed.append(rel)
            if mark is None or rel in changed[-1:] or (holds and not holds(rel, mark)):
                todo.append(rel)
        if changed:
            more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
            print(f"{self.root}: {self.source or 'the source'} changed since {changed[0]}{more} "
                  f"{'were' if more else 'was'} written: writing {'them' if more else 'it'} again", file=sys.stderr)
        for rel in todo:
            self.mark_path(rel).unlink(missing_ok=True)
        return todo

    def commit(self, rel: str, write: Callable[[Path], str], mark: dict) -> dict:
        """Write shard `rel` through `write(partial_path) -> checksum`, rename it into place
        (replacing an unmarked or damaged one), then write its done mark; returns the mark."""
        final = self.root / rel
        partial = final.parent / f"{PARTIAL}{final.name}"
        final.parent.mkdir(parents=True, exist_ok=True)
        self.mark_path(rel).unlink(missing_ok=True)  # the shard is not done until marked again
        remove(partial)
        try:
            digest = write(partial)
        except OSError as e:
            if e.filename is not None or e.errno is None:
                raise
            # a failed write() (a full disk) names no file: name the shard being written
            raise OSError(e.errno, e.strerror, str(final)) from e
        remove(final)
        os.replace(partial, final)
        made_from = {"source_sha256": self.made_from[rel]} if rel in self.made_from else {}
        entry = {**mark, **made_from, "path": rel, "sha256": digest}
        atomic_write_json(self.mark_path(rel), entry)
        return entry

    def marks(self, rels: list[str]) -> list[dict]:
        """The done marks present, in the order of `rels`."""
        out = []
        for rel in rels:
            path = self.mark_path(rel)
            if path.is_file():
                out.append(json.loads(path.read_text()))
        return out

    def remove_unlisted(self, folder: str, listed: list[str]) -> None:
        """Remove the shards in `folder` (files named shard-*, with their done marks) that `listed`
        (relative paths, the finished run's) does not hold: an earlier run's, of a longer source. A
        reader of the folder as a dataset (every file of it) would read them as data."""
        keep = set(listed) | {rel + ".done.json" for rel in listed}
        for p in (self.root / folder).glob("shard-*"):
            if f"{folder}/{p.name}" not in keep:
                remove(p)

    def remove_partials(self, folder: str) -> None:
        """Remove leftovers of killed runs (call once every shard is done): partial shards, and
        the temporary files of done marks, manifests or configs being written (atomic_write_bytes'
        `.<name>.*.tmp`) in `folder` and the output folder."""
        for p in (self.root / folder).glob(f"{PARTIAL}*"):
            remove(p)
        remove_temporaries(self.root / folder)
        remove_temporaries(self.root)
