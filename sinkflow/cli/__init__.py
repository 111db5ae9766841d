"""The `sinkflow` command. Each sub-command lives in its own module with ``add_parser`` and ``run``.

User errors (``SinkflowError``), operating-system errors (``OSError``: a full disk, a read-only
folder, a missing file) and a CUDA out-of-memory error (``sinkflow.tools.oom``) print one line and exit 2; a
SIGTERM/SIGINT checkpoints and exits 128+signal (under torchrun: every rank, agreed; rank 0 prints the line);
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import signal
import logging
import sys

from tqdm.contrib.logging import logging_redirect_tqdm

from sinkflow.errors import SinkflowError
from sinkflow.runtime.signals import Interrupted, stop_reason, unwind_on_sigterm

COMMANDS = ["train", "sample", "eval", "tune", "config", "presets", "preflight", "doctor", "lr_find", "status", "bench"]


class Parser(argparse.ArgumentParser):
    """argparse's own errors (a missing argument, ``--n abc``) in the one-line form of every other error,
    without the usage block (``--help`` still prints it)."""

    def error(self, message: str):
        where = "" if self.prog == "sinkflow" else f"{self.prog}: "  # a sub-command's parser names itself
        print(f"sinkflow: error: {where}{message}; see `{self.prog} --help`".replace(os.linesep, " "),
              file=sys.stderr)
        sys.exit(2)


def _versions() -> str:
    """sinkflow's version with torch's and Python's, for a bug report; read from the installed packages' metadata,
    so `--version` answers before torch loads."""
    import platform
    from importlib import metadata

    from sinkflow import __version__

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    return f"sinkflow {__version__} (torch {torch_version}, Python {platform.python_version()})"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="sinkflow", description="Optimal-transport and flow-based generative models, smoke-tested on CPU.",
        epilog="example: sinkflow train moons --train-iters 2000")
    parser.add_argument("--version", action="version", version=_versions())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"sinkflow.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"sinkflow.cli.{name}":
                continue  # command not shipped in this build
            raise
        module.add_parser(sub)
    return parser


def bars_above_logs():
    """A line logged to the console while a progress bar is open goes above the bar, not into it (tqdm's
    ``logging_redirect_tqdm``). Only where this process logs to the console: a host that captures the records
    itself (a test runner, an embedding application) keeps its handlers as they are."""
    console = any(isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.stderr)
                  for h in logging.root.handlers)
    return logging_redirect_tqdm() if console else contextlib.nullcontext()


# Path arguments read with a leading ~ as the user's home, as config files and data paths are
PATH_ARGS = ("run_dir", "resume", "out", "write")


# The commands that work (sample, score, sweep, write) as one process: under torchrun each rank did all of it
ONE_PROCESS = ("eval", "sample", "lr-find", "tune", "doctor", "preflight", "bench")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may follow options (`train moons --train-iters 5 pool.eta=0.1`): argparse leaves them over
    stray = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if stray:  # named as the sub-command's, with its --help (a key=value where it takes none: said so)
        keys = "" if hasattr(args, "overrides") or not any("=" in e for e in stray) else " (it takes no config keys)"
        sub = Parser(prog=f"sinkflow {args.command}")
        sub.error(f"unrecognized arguments: {' '.join(stray)}{keys}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    for attr in PATH_ARGS:  # `--out=~/s.npy`: the shell leaves a ~ after "=" (or in quotes) as it is, and a folder
        if isinstance(getattr(args, attr, None), str):  # named "~" was made in the working directory
            setattr(args, attr, os.path.expanduser(getattr(args, attr)))
    try:
        from sinkflow.cli.common import check_counts

        check_counts(args)  # --n, --steps, --seeds of every command: one place, one line
        for attr in PATH_ARGS:  # `train --resume "$RUN"` with the variable unset started a new run of the default
            # preset, `status ""` looked at the working folder ("`.` is not a sinkflow run folder")
            if isinstance(getattr(args, attr, None), str) and not getattr(args, attr).strip():
                name = "RUN" if attr == "run_dir" else f"--{attr}"
                example = {"out": "samples.npy", "write": "my.yaml, or a run folder"}.get(
                    attr, "runs/NAME, the folder `sinkflow train` printed")
                raise SinkflowError(f"{name} is empty (an unset shell variable?)",
                                    f"give {name} a path, e.g. {example}")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and args.command in ONE_PROCESS:  # each rank did all of it: eval's record appended once a rank
            raise SinkflowError(f"`sinkflow {args.command}` runs as one process, but torchrun started {world}",
                                f"run it without torchrun: `sinkflow {args.command} ...` (train alone runs on "
                                "several)", every_rank=True)
        unwind = contextlib.nullcontext() if args.command == "train" else unwind_on_sigterm()  # train: graceful_stop
        with bars_above_logs(), unwind:
            return args.func(args) or 0
    except SinkflowError as exc:
        if not (exc.every_rank and os.environ.get("RANK", "0") != "0"):  # torchrun: one line, not one per rank
            print(f"sinkflow: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `sinkflow status RUN | head -1`: the reader has what it wanted, not a disk error
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the last flush at exit must not fail
        except (OSError, ValueError):  # stdout without a file descriptor (an embedding host's stream)
            pass
        return 128 + signal.SIGPIPE  # what a program stopped by SIGPIPE returns
    except OSError as exc:
        run_dir = getattr(args, "run_dir_used", None) or getattr(args, "resume", None)  # train's folder, once known
        resume = (resume_as_launched(args, run_dir) if args.command == "train" and run_dir
                  and exc.errno in _RESUMABLE else None)
        print(f"sinkflow: error: {one_line(os_error_line(exc, getattr(args, 'out', None), resume))}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        torch = sys.modules.get("torch")
        ranks = importlib.import_module("sinkflow.runtime.dist") if torch is not None else None  # torch is loaded
        if ranks is not None and ranks.peer_lost(exc):
            command = resume_as_launched(args, getattr(args, "run_dir_used", None) or getattr(args, "resume", None)
                                         or "RUN")
            print(f"sinkflow: error: {ranks.PEER_LOST}, so a "
                  f"collective failed ({one_line(str(exc))[:160]}); the checkpoints written before are intact: find "
                  f"why that rank stopped (its own output), then resume with `{command}`", file=sys.stderr)
            return 2
        if torch is None or not isinstance(exc, torch.OutOfMemoryError):
            raise  # anything else is a bug: keep its traceback
        from sinkflow.tools.oom import oom_line

        run_dir = getattr(args, "run_dir_used", None) or getattr(args, "run_dir", None)
        resume = resume_as_launched(args, run_dir) if args.command == "train" and run_dir else None  # torchrun's
        line = oom_line(exc, args.command, run_dir, getattr(args, "preset", None), resume)
        print(f"sinkflow: error: {one_line(line)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # a second Ctrl+C or SIGTERM means "now": no step checkpoint, no traceback wall
        signum = getattr(exc, "signum", signal.SIGINT)  # StopNow's; a Ctrl+C outside a run is SIGINT's
        if args.command == "train":
            command = resume_as_launched(args, getattr(args, "run_dir_used", None) or "RUN")
            if os.environ.get("RANK", "0") == "0":  # torchrun passes each signal to every rank: rank 0 says it once
                print(f"sinkflow: stopped at once by a second signal: the checkpoints written before are intact; "
                      f"resume with `{command}`", file=sys.stderr)
        else:  # one signal stops any other command, its temporary files removed on the way out
            print(f"sinkflow: {args.command} stopped by signal {signum}", file=sys.stderr)
        return 128 + signum
    except Interrupted as exc:
        from sinkflow.runtime import dist

        if args.command != "train":  # bench, lr-find, doctor...: a scratch run, gone with its folder; nothing to resume
            print(f"sinkflow: {args.command} stopped {stop_reason(exc.signum)}", file=sys.stderr)
            return exc.exit_status

        # under torchrun every rank stopped at the same step: they leave together and exit like one process
        # would, and rank 0 says so once
        info = dist.leave_after_stop()
        if info.is_main:
            where = getattr(exc, "run_dir", None) or getattr(args, "run_dir_used", "RUN")
            print(f"sinkflow: {exc}; resume with `{resume_as_launched(args, where, info.world)}`", file=sys.stderr)
        return exc.exit_status
    finally:
        dist = sys.modules.get("sinkflow.runtime.dist")  # imported by the commands that join a process group
        if dist is not None:
            dist.leave()


def resume_as_launched(args, run_dir, world: int | None = None) -> str:
    """The resume command of this launch (another process count also resumes: the lr follows
    train.*.lr_scaling), with the report skipped as it was and the next session's time limit: what `sinkflow
    status` says too (``runtime.relaunch``). A plain `--resume` after a second signal or a lost peer dropped them."""
    from sinkflow.runtime import dist
    from sinkflow.runtime.relaunch import resume_command
    from sinkflow.runtime.signals import parse_duration

    limit = getattr(args, "time_limit", None)
    return resume_command(run_dir, world or int(os.environ.get("WORLD_SIZE", "1")),
                          bool(getattr(args, "no_report", False)), parse_duration(limit) if limit is not None else None,
                          dist.per_node())


def entry() -> None:
    """The ``sinkflow`` console script and ``python -m sinkflow``: ``main``'s status as the process's exit status.

    Under torchrun a rank then ends at once (``os._exit``), skipping the interpreter's teardown. DDP keeps its process
    group alive past ``destroy_process_group`` (torch 2.14: the group's gloo threads still run after ``dist.leave``),
    and a rank tearing down beside them now and then aborted ("terminate called without an active exception",
    SIGABRT with no Python frame left: 2 of 111 CPU runs under load), after its work was done: torchrun called the
    job failed and sent SIGTERM to the ranks still closing. Everything is written and closed before ``main`` returns
    (its finally blocks); the logging handlers and the standard streams are flushed here."""
    rc = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(rc)
    sys.exit(rc)


_OS_FIXES = {
    errno.ENOSPC: "free disk space or point experiment.runs_dir / data.root at a larger disk; the checkpoints "
                  "written before are intact, so `sinkflow train --resume RUN` continues from the last one",
    errno.EDQUOT: "free space under your disk quota; the checkpoints written before are intact",
    errno.EFBIG: "the file grew past the size this process may write (ulimit -f) or the filesystem allows; "
                 "raise the limit or use another disk; the checkpoints written before are intact",
    errno.EROFS: "the filesystem is read-only: point experiment.runs_dir / data.root at a writable folder",
    errno.EACCES: "you may not write there: point experiment.runs_dir / data.root at a folder you own",
    errno.EPERM: "the operation is not permitted there: use another folder",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a folder: check the path",
    errno.EISDIR: "the path is a folder, a file was expected: check the path",
}


def one_line(text: str) -> str:
    """An error is one line, whatever a value quoted in it held (a tensor's repr spans several)."""
    return " ".join(text.split())


# the fixes of a disk that filled under a run: its checkpoints are intact, and the run's own resume continues it
_RESUMABLE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_GENERIC_RESUME = ", so `sinkflow train --resume RUN` continues from the last one"


def os_error_line(exc: OSError, out: str | None = None, resume: str | None = None) -> str:
    """One line for any OSError: what failed (errno name and text), on which path, and the fix; a write under the
    command's ``--out`` names that flag (its fix named experiment.runs_dir, which `sample --out` does not write).
    ``resume``: the command that continues the run that failed (`train`, once its folder is known), named in a full
    disk's fix: the line said `sinkflow train --resume RUN` (a torchrun job then resumed on one process, without its
    --no-report and --time-limit) while `sinkflow status` named the run's own."""
    code = errno.errorcode.get(exc.errno, "") if exc.errno else ""
    what = exc.strerror or str(exc) or type(exc).__name__
    where = f" ({os.fsdecode(exc.filename)})" if exc.filename else ""  # TensorBoard's are bytes: (b'/runs/...')
    fix = _OS_FIXES.get(exc.errno, "check the path, the permissions and the free space")
    if resume and exc.errno in _RESUMABLE:
        fix = fix.replace(_GENERIC_RESUME, "") + f", so `{resume}` continues from the last one"
    if out and exc.filename and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT):
        target, failed = os.path.abspath(out), os.path.abspath(os.fsdecode(exc.filename))
        parent = os.path.dirname(target)
        if failed in (target, parent) or failed.startswith(target + os.sep) or (
                os.path.dirname(failed) == parent and os.path.basename(target) in os.path.basename(failed)):
            fix = f"--out {out} cannot be written there: name a place in a folder you own, with free space"
    label = f"{code} " if code else ""
    return f"{label}{what}{where}; {fix}".replace(os.linesep, " ")
