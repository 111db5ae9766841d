"""`sinkflow status RUN`: where a run is, whether it is alive, and what it has on disk.

Reads only files (``status.json`` heartbeat, ``metrics.jsonl`` (its last 64 MiB), ``checkpoints/``), so it
works while the run is going, after it finished, and after it died. A run is

* ``finished``: the heartbeat says so;
* ``running``: the heartbeat is younger than ``stale_after`` and its pid is alive (when on this host);
* ``stale``: the heartbeat is older than ``stale_after`` (hung: a training phase beats every minute of steps);
* ``dead``: the pid of the heartbeat is not alive on this host, or is but no process holds the run's lock (the pid
  was reused after a kill -9), or the heartbeat was written on another host for another folder (a copy of a run
  made there) and nothing here holds the copy's lock, and the run did not finish.
* ``stopped``: a signal or the time limit stopped it after its checkpoint was written (``sinkflow train --resume`` continues).
* ``unknown``: no readable heartbeat, but checkpoints, pool arrays or metrics on disk (status.json lost: it said
  "not started", with no resume command, for a run halfway through);
* ``failed``: it stopped on an error (a non-finite step, out of memory, bad data...), which the heartbeat keeps:
  a plain resume would meet it again, so the line says what to fix first.

The ETA is the current phase's; the phases still to come after it are listed with their size (from the run's
``config.yaml`` and its method's phase list, ``config.schema.METHOD_REGISTRY``), and where one trains the current
phase's network with its training settings (its step count apart), with the time it takes at the current rate
(NSGF++'s nsf phase ran at its velocity phase's rate on an H100: 174.5 and 174.4 steps/s, RESULTS.md, 2026-11-27).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import zipfile
from pathlib import Path

import yaml

from sinkflow import config as config_mod
from sinkflow.config import schema
from sinkflow.errors import SinkflowError
from sinkflow.eval.records import OPTIONAL_SETTINGS
from sinkflow.processes import pid_alive
from sinkflow.runtime.lock import held
from sinkflow.runtime.relaunch import read_heartbeat, resume_for
from sinkflow.runtime.signals import stop_reason

STALE_AFTER_S = 300.0
FINAL_STATES = ("finished", "stopped", "failed")  # a heartbeat written as the run ended: no lock to look for


def tail_jsonl(path: Path, max_bytes: int = 1 << 26) -> list[dict]:
    """The records in the last ``max_bytes`` of a JSONL file (a torn last line is skipped). 64 MiB: a whole run's
    file in practice (the mnist preset's, at log_every 100, is about 0.6 MB); its last 64 KiB lost an early phase's
    records in a long run (its "did not learn" line and its last metrics)."""
    if not path.is_file():
        return []
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - max_bytes))
        lines = f.read().decode(errors="replace").splitlines()
    if size > max_bytes:
        lines = lines[1:]
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def dir_bytes(path: Path) -> int:
    if not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def read_status(run_dir: Path, stale_after: float = STALE_AFTER_S, now: float | None = None) -> dict:
    """Everything `sinkflow status` prints, as a dict."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        if run_dir.name == "config.yaml" and run_dir.is_file():
            raise SinkflowError(f"{run_dir} is a run's config file, not its folder", f"pass the folder: {run_dir.parent}")
        raise SinkflowError(f"{run_dir} is not a sinkflow run folder (no config.yaml)",
                            "pass the folder `sinkflow train` printed when it started")
    now = time.time() if now is None else now
    out: dict = {"run": str(run_dir)}
    hb = read_heartbeat(run_dir)  # {} where damaged, as where unreadable
    out["heartbeat"] = hb
    age = now - hb["time"] if "time" in hb else None
    out["heartbeat_age_s"] = age
    here = socket.gethostname()
    same_host = hb.get("host", here) == here
    alive = pid_alive(int(hb["pid"])) if "pid" in hb and same_host else None
    if alive and hb.get("state") not in FINAL_STATES and held(run_dir) is False:
        # its pid now names another process (reused after a kill -9; a container restarted): the run's lock died
        # with it (status said RUNNING of a killed run while its pid lived on in another process)
        alive, out["pid_reused"] = False, True
        if isinstance(hb.get("dir"), str) and Path(hb["dir"]) != run_dir.resolve():  # a copy of a live run (cp -r):
            out["copied_from"] = hb["dir"]  # its pid trains the original, not "another process now"
    written_for = hb.get("dir")
    if (not same_host and isinstance(written_for, str) and Path(written_for) != run_dir.resolve()
            and hb.get("state") not in FINAL_STATES and held(run_dir) is not True):
        # a copy of a run made on another machine (a notebook's output downloaded mid-training, a kill -9 there): its
        # heartbeat is that host's pid writing that host's folder. Nothing trains this folder (nothing here holds its
        # lock), and status said RUNNING of it for up to 5 minutes, then STALE, "hung"
        out["copied_from"], out["copied_from_host"] = written_for, hb["host"]
        alive = False
    out["pid_alive"] = alive
    if hb.get("state") == "finished":
        state = "finished"
    elif hb.get("state") == "evaluating":  # training finished; the final report is being written, or never was
        gone = alive is False or (alive is None and age is not None and age > stale_after)
        state = "finished" if gone else "evaluating"
        if gone:
            out["report"] = "not written"
    # final states, whatever the pid: a notebook's kernel lives on after its run stopped or failed (RUNNING, then
    # STALE, was said of it); a new run of the folder rewrites the heartbeat first
    elif hb.get("state") == "stopped":  # by a signal or the time limit, after its checkpoint was written
        state = "stopped"
        if hb.get("signal") and not hb.get("at_once"):  # --json: the heartbeat's code alone read 10 (SIGUSR1) for a
            out["stopped"] = stop_reason(int(hb["signal"]))  # callback's request_stop(); said as the line says it
    elif hb.get("state") == "failed":  # by an error, recorded before the process ended
        state = "failed"
    elif not hb:  # no heartbeat: a run that never started, or one whose status.json was lost (decided below)
        state = "not started"
    elif alive is False:
        state = "dead"
    elif age is not None and age > stale_after:
        state = "stale"
    else:
        state = "running"
    out["state"] = state
    out["resume"] = resume_for(run_dir, hb)
    records = tail_jsonl(run_dir / "metrics.jsonl")
    latest: dict[str, dict] = {}
    for r in records:  # each key's newest value: a flow's last record (its drift report) holds no loss
        phase = r.get("phase", "?")
        prev = latest.get(phase, {})
        if "n" in r:  # an evaluation that says how it was made: an earlier one's split: val or sample.* is not its
            prev = {k: v for k, v in prev.items() if k not in OPTIONAL_SETTINGS}
        latest[phase] = {**prev, **r}
    out["latest_metrics"] = latest
    ckdir = run_dir / "checkpoints"
    ckpts: dict[str, list] = {}
    if ckdir.is_dir():
        for phase_dir in sorted(p for p in ckdir.iterdir() if p.is_dir()):
            files = sorted(p for p in phase_dir.iterdir() if p.is_file() and p.suffix == ".pt")
            ckpts[phase_dir.name] = [(f.name, f.stat().st_size, f.stat().st_mtime) for f in files]
    out["checkpoints"] = ckpts
    try:  # a pool's finished chunks live in pool/progress.json, not in a step checkpoint: a resume goes on from them
        chunks = json.loads((run_dir / "pool" / "progress.json").read_text()).get("chunks")
        out["pool_chunks"] = len(chunks) if isinstance(chunks, list) else 0
    except (OSError, ValueError, AttributeError):
        out["pool_chunks"] = 0
    if state == "not started" and (any(ckpts.values()) or records or (run_dir / "pool").is_dir()):
        state = out["state"] = "unknown"  # status.json lost: it said "not started", with no resume command
    out["disk"] = {name: dir_bytes(run_dir / name) for name in ("pool", "checkpoints", "tb")}
    out["disk"]["total"] = dir_bytes(run_dir)
    eta = hb.get("eta_s")
    out["eta_s"] = max(0.0, eta - (age or 0.0)) if eta is not None and state == "running" else None
    if hb.get("report") == "stopped":
        out["report"] = "not written"
    if state in ("finished", "evaluating"):  # status.json says so; the final checkpoints must say so too
        missing = [item["phase"] for item in phases_left(run_dir, {}, ckpts)]
        # a torch checkpoint is a zip archive: a cut one lacks its end record (read without torch, in microseconds)
        finals = {phase: run_dir / "checkpoints" / phase / "final.pt" for phase in ckpts if phase not in missing}
        damaged = [f"checkpoints/{phase}/final.pt" for phase, final in finals.items()
                   if final.is_file() and not zipfile.is_zipfile(final)]
        if missing or damaged:  # `sample` refused it ("has not finished", "corrupt") while status said FINISHED
            state = out["state"] = "incomplete"
            out["missing"] = [f"checkpoints/{phase}/final.pt" for phase in missing]
            out["damaged"] = damaged
    out["phases_left"] = [] if state in ("finished", "evaluating") else phases_left(run_dir, hb, ckpts)
    if state in ("dead", "stale"):
        out["resumes_from"] = resumes_from(hb, ckpts)
    refusal = config_refusal(run_dir)
    if refusal is not None and state not in ("running", "evaluating"):
        out["state"], out["config_error"] = "damaged", refusal
    return out


def resumes_from(hb: dict, ckpts: dict) -> dict | None:
    """Where a resume of a killed training phase goes on: its newest step checkpoint (step 0 with none), which the
    heartbeat's step is not. That step is the last beat's (a log step, or a minute of steps, old), and a kill -9
    lost every step since the checkpoint: status said "velocity step 700/100000" of a run that resumes from 600.
    None where the heartbeat counts kept work (the pool's recorded batches, NSGF++'s states) or no phase."""
    phase = hb.get("phase")
    files = [name for name, *_ in ckpts.get(phase) or []]
    if not isinstance(phase, str) or phase in ("done", "pool") or hb.get("of") or "final.pt" in files:
        return None
    steps = [int(m[1]) for name in files if (m := re.fullmatch(r"step_(\d+)\.pt", name))]
    return {"phase": phase, "step": max(steps, default=0), "heartbeat_step": hb.get("step")}


def _resumes_from(st: dict) -> str:
    """``resumes_from`` in words, after the resume command."""
    at = st.get("resumes_from")
    if not at:
        return ""
    if not at["step"]:
        return f", which trains {at['phase']} from step 0 (it had no step checkpoint yet)"
    beat = at["heartbeat_step"]
    beat = f"; step {beat} below is the last heartbeat's" if isinstance(beat, int) and beat > at["step"] else ""
    return f", which goes on from {at['phase']} step {at['step']}, its newest checkpoint{beat}"


def config_refusal(run_dir: Path) -> str | None:
    """The one line every command that reads the run (--resume, sample, eval, tune...) refuses its config.yaml with,
    read as they read it (``config.read_run_file``, without torch), else None: a copy cut short, or a hand edit
    (an unknown key, a bad value, broken YAML). Only a cut copy was seen: a finished run with ``lr: fast`` said
    FINISHED (exit 0) while sample and eval refused it, a stopped one a resume command that refused it."""
    try:
        config_mod.validate(config_mod.read_run_file(run_dir / "config.yaml"))
    except SinkflowError as exc:
        return str(exc)
    except OSError:
        return None  # unreadable now: the rest of the status still stands
    return None


def phases_left(run_dir: Path, hb: dict, ckpts: dict) -> list[dict]:
    """The method's phases after the heartbeat's, not finished: name, size, and (the current phase's network and
    training settings, the step count apart) the seconds they take at the current rate."""
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        spec = schema.METHOD_REGISTRY[cfg["experiment"]["method"]]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return []  # a config this version cannot read: the rest of the status still stands
    train, model = cfg.get("train", {}), cfg.get("model", {})
    current, rate = hb.get("phase"), hb.get("rate")
    order = list(spec.phases)
    after = order[order.index(current) + 1:] if current in order else order
    out = []
    for name in after:
        if any(f[0] == "final.pt" for f in ckpts.get(name, [])):
            continue
        item: dict = {"phase": name}
        if name in train:
            item["steps"] = int(train[name]["iters"])
            same = current in train and model.get(name) == model.get(current) and \
                {**train[name], "iters": 0} == {**train[current], "iters": 0}
            if same and rate:
                item["eta_s"] = item["steps"] / rate
        elif name == "pool" and "pool" in cfg:
            item["batches"] = int(cfg["pool"]["batches"])
        out.append(item)
    return out


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _size(b: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= k:
            return f"{b / k:.1f} {unit}"
    return f"{int(b)} B"


def _left(item: dict, current: str | None) -> str:
    size = f" {item['steps']:,} steps" if "steps" in item else (f" {item['batches']:,} batches" if "batches" in item
                                                                 else "")
    eta = f" (~{_dur(item['eta_s'])} at {current}'s rate)" if "eta_s" in item else ""
    return f"{item['phase']}{size}{eta}"


def _position(hb: dict) -> str:
    """Where a stopped or failed heartbeat's phase stood: the pool in its batches (as its bar counts), else a step."""
    return f"batch {hb.get('done')}/{hb['of']}" if hb.get("of") else f"step {hb.get('step')}"


def format_status(st: dict) -> str:
    hb = st["heartbeat"]
    lines = [f"run          {st['run']}"]
    state = st["state"]
    age = st["heartbeat_age_s"]
    why = ""
    if state == "dead":
        gone = (f"on {st['copied_from_host']} trained {st['copied_from']} there, the run this folder was copied from "
                "(whether it still does, this machine cannot see); nothing trains this copy" if
                st.get("copied_from_host") else
                f"trains {st['copied_from']}, the run this folder was copied from" if st.get("copied_from") else
                "is another process now" if st.get("pid_reused") else "is not running")
        why = f" (pid {hb.get('pid')} {gone}; resume with `{st['resume']}`{_resumes_from(st)})"
    elif state == "stopped" and hb.get("at_once"):
        by = f"a second signal, {hb['signal']}," if hb.get("signal") else "a KeyboardInterrupt"
        why = (f" (at once by {by} in {hb.get('phase')}: the work since its last "
               f"checkpoint is lost; resume from that checkpoint with `{st['resume']}`)")
    elif state == "stopped":
        why = (f" ({stop_reason(int(hb.get('signal') or 0))} at {hb.get('phase')} {_position(hb)}, "
               f"checkpoint saved; "
               f"resume with `{st['resume']}`)")
    elif state == "failed":
        step = f" {_position(hb)}" if hb.get("of") or hb.get("step") is not None else ""
        kept = ("the checkpoints before it are intact" if st["checkpoints"].get(hb.get("phase")) else
                f"the pool's {st['pool_chunks']} finished chunk(s) are kept (pool/progress.json): the build goes on "
                "from them" if hb.get("phase") == "pool" and st.get("pool_chunks") else
                "the phase had no checkpoint yet: it starts again")  # "intact" with none there read as a promise
        why = (f" (stopped at {hb.get('phase')}{step}: {hb.get('error')}; {kept}: fix that, then `{st['resume']}` "
               "continues)")
    elif state == "stale":
        why = f" (no heartbeat for {_dur(age)}, where a training phase writes one every minute: hung, or one step or " \
            "pool chunk takes longer than that"
        # its pid cannot be seen from here (a heartbeat without a host, written before hosts were, is this one's, as
        # read_status takes it: its live pid said hung, not gone)
        if hb.get("host", socket.gethostname()) != socket.gethostname():
            why += (f"; or nothing trains it any more (a session that ended on {hb['host'] or 'another machine'}, "
                    f"its folder restored here): then resume with `{st['resume']}`{_resumes_from(st)}")
        why += ")"
    elif state == "incomplete" and st.get("damaged"):
        why = (f" (status.json says finished, but {', '.join(st['damaged'])} is damaged (not a whole checkpoint): "
               f"delete it, then `{st['resume']}` trains that phase again from its last step checkpoint)")
    elif state == "incomplete":
        why = (f" (status.json says finished, but {', '.join(st['missing'])} is missing: `{st['resume']}` trains "
               "what is missing from the checkpoints left)")
    elif state == "damaged" and "is cut short" not in st.get("config_error", "is cut short"):
        why = f" (--resume, sample and eval refuse the run's config.yaml: {st['config_error']})"
    elif state == "damaged":
        why = (" (config.yaml is cut short: it lacks its last line, '...'; --resume, sample and eval refuse the run: "
               "copy the run folder again from where it was made)")
    elif state == "evaluating":
        why = f" (training finished; pid {hb.get('pid')} is writing the final report: evaluation and plots)"
    elif state == "finished" and st.get("report"):
        why = f" (the final report was not written: the process stopped during it; `sinkflow eval {st['run']}` reports it)"
    elif state == "unknown":
        why = (f" (status.json is missing or damaged, but the run has checkpoints or metrics: if no process is "
               f"training it, resume with `{st['resume']}`)")
    host = f" on {hb['host']}" if hb.get("host") else ""
    lines.append(f"state        {state.upper()}{why}")
    if hb:
        lines.append(f"heartbeat    {_dur(age)} ago, pid {hb.get('pid')}{host}")
        phase, step, total, unit = hb.get("phase"), hb.get("step"), hb.get("total"), "step"
        if hb.get("unit") and hb.get("of"):  # the pool: batches, as its bar counts, in every state (a dead or
            # stale build showed its chunks, "step 5/6", beside the batch rate labelled steps/s); its batches were
            # recorded before the heartbeat said them; NSGF++'s states count in states
            unit, step, total = str(hb["unit"]), hb.get("done"), hb["of"]
        prog = f"{unit} {step}/{total} ({100 * step / total:.1f}%)" if step is not None and total else \
            (f"{unit} {step}" if step is not None else "")
        rate = f"{hb['rate']:.2f} {'steps' if unit == 'step' else unit}/s" if hb.get("rate") else ""
        eta = f"ETA {_dur(st['eta_s'])}" if st["eta_s"] is not None else ""
        lines.append("phase        " + "  ".join(x for x in (str(phase), prog, rate, eta) if x))
    if st.get("phases_left"):
        lines.append("then         " + ", ".join(_left(item, hb.get("phase")) for item in st["phases_left"]))
    for phase, rec in st["latest_metrics"].items():
        vals = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in rec.items()
                         if k not in ("time", "phase", "step"))
        lines.append(f"metrics      {phase} step {rec.get('step')}: {vals}")
    for phase, rec in st["latest_metrics"].items():  # LearningCheck's record: its console warning, kept after the run
        if rec.get("learned") is False and isinstance(rec.get("probe_loss_start"), (int, float)):
            start, end = rec["probe_loss_start"], rec.get("probe_loss_end")
            share = f"{end:.4g}: {100 * end / start:.0f}%" if isinstance(end, (int, float)) and start else f"{end}"
            lines.append(f"learning     {phase}: the loss did not fall ({start:.4g} on a fixed batch at the phase "
                         f"start, {share}): the phase may not have learned; check train.{phase}.lr")
    if st["checkpoints"]:
        lines.append("checkpoints")
        for phase, files in st["checkpoints"].items():
            desc = ", ".join(f"{name} {_size(size)}" for name, size, _ in files) or "(none)"
            lines.append(f"  {phase:<11}{desc}")
    d = st["disk"]
    lines.append(f"disk         {_size(d['total'])} (pool {_size(d['pool'])}, checkpoints {_size(d['checkpoints'])}, "
                 f"tb {_size(d['tb'])})")
    return "\n".join(lines)
