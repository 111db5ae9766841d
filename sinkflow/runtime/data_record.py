"""RUN/data_split.json: what a run trains and is scored on, recorded at its start and checked before a resume or an
evaluation reads the data again.

An image set's splits (MNIST's t10k-only split: seed and index hashes; an image folder: the hashes of its train and
test file lists), a point file's path, rows and a hash of its points. Built-in 2D distributions record nothing
(their samples come from the seed). A resume on changed data would not continue the run it promises, and an
evaluation on a changed test split would score against other data than the run's: both are refused.
"""

from __future__ import annotations

import json

from sinkflow.data.atomic_write import atomic_write_text
from sinkflow.errors import SinkflowError

RECORD = "data_split.json"


def split_record(source, target) -> dict:
    """The record of a run's data (empty for built-in 2D distributions); a point-file source goes under ``source``."""
    info = dict(target.split_info or {})
    if source.split_info:
        info["source"] = source.split_info
    return info


def record_split(run, source, target) -> None:
    """Write RUN/data_split.json; rewritten identically on resume, which ``check_split`` makes sure of first."""
    info = split_record(source, target)
    if info:
        atomic_write_text(run.dir / RECORD, json.dumps(info, indent=1))


# Compared beside the hashes: a split's size (CIFAR-10 and MNIST record no hash of their files: a test_batch of 30
# images where the run recorded 20 was scored without a word)
COUNTS = ("n_train", "n_test")


def _hashes(info: dict, where: str = "") -> dict:
    out = {}
    for k, v in info.items():
        if isinstance(v, dict):
            out.update(_hashes(v, f"{where}{k}."))
        elif k.endswith("sha256") or k in COUNTS:
            out[where + k] = v
    return out


def _recorded(run) -> dict | None:
    """The record, None where there is none (built-in 2D data, a run made before it existed). A damaged one is a
    one-line refusal: read as none, it let a resume continue on changed data and wrote the new data's hashes over
    it, the one record of what the finished phases trained on."""
    path = run.dir / RECORD
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        recorded = json.loads(text)
    except ValueError:
        recorded = None
    if not isinstance(recorded, dict):
        raise SinkflowError(f"{path} is damaged (not a JSON object), so the run's data cannot be checked against it; "
                            "nothing was changed", "restore it from a copy of the run folder, or, if the data is "
                            "the one the run trained on, delete it: the next resume records it again")
    return recorded


def check_split_files(run, target_info: dict, doing: str = "resume") -> None:
    """``check_split`` on what an image target's files say before they are decoded (``data.target_split_info``):
    the hashes that info holds are compared, so a changed image folder is refused before its decoded cache under
    data.root is rewritten for a run that will not use it."""
    recorded = _recorded(run)
    if recorded is not None and target_info:
        new = _hashes(target_info)
        _refuse_changed(run, recorded, sorted(k for k, v in _hashes(recorded).items() if k in new and new[k] != v),
                        doing, target_info)


def check_split(run, source, target, doing: str = "resume") -> None:
    """Refuse to ``doing`` (resume, evaluate) a run whose data changed since it started: a point file rewritten, an
    image folder with files added, removed or replaced, another split. Every hash the record holds is compared;
    one it lacks (a record written before sinkflow hashed that data) is not."""
    recorded = _recorded(run)
    if recorded is None:
        return
    now = split_record(source, target)
    old, new = _hashes(recorded), _hashes(now)
    _refuse_changed(run, recorded, sorted(k for k in old if old.get(k) != new.get(k)), doing, now)


def check_source(run_dir, source) -> None:
    """Refuse to sample a run whose source point file changed since it trained (``data.source=pts.csv``): sampling
    pushes the source's points through the flow, and a rewritten file gave samples of other data without a word, where
    eval and a resume refused it. Only the source's hashes are compared: sampling never reads the target's data."""
    from types import SimpleNamespace

    info = source.split_info
    run = SimpleNamespace(dir=run_dir)
    recorded = _recorded(run) if info else None
    if recorded is None or not isinstance(recorded.get("source"), dict):
        return
    old, new = _hashes(recorded["source"], "source."), _hashes(info, "source.")
    _refuse_changed(run, recorded, sorted(k for k in old if old.get(k) != new.get(k)), "sample", {"source": info})


def _where(info: dict, changed: str) -> str | None:
    """The file or folder of a record whose hash ``changed`` names: the source's record is nested under "source"."""
    src = info.get("source") if isinstance(info.get("source"), dict) else {}
    return (src.get("points") if changed.startswith("source.") else info.get("points")) or info.get("path")


def _refuse_changed(run, recorded: dict, changed: list[str], doing: str, now: dict | None = None) -> None:
    if changed:  # name the data read now, and the place the record was made for when that differs (moved data)
        was, what = _where(recorded, changed[0]), _where(now or {}, changed[0])
        what = (f"{what}, not the data recorded for {was}" if what and was and what != was else what or was
                or "the data")
        fix = ("restore the data the run was trained on, or start a new run" if doing == "resume" else
               "restore the source points the run was trained on (the flow would carry other points), or train a new "
               "run" if doing == "sample" else
               "restore the data the run was trained on (its scores would be against other data), or train a new run")
        raise SinkflowError(f"cannot {doing} {run.dir}: its data changed since the run started ({what}: "
                            f"{', '.join(changed)} differ from {RECORD})", fix)
