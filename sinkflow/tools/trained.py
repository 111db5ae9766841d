"""A trained run opened for one call: `sinkflow sample` / `eval` / `tune` and the Python API's ``open_run`` /
``Run.sample`` / ``Run.evaluate`` alike, so the CLI and the API share them and neither imports the other.

For this call only, config.yaml unchanged: the device its networks run on, and ``sample.key=value`` settings; and
the warning of an evaluation whose scores could not be recorded in a folder that cannot be written.
"""

from __future__ import annotations

import errno

from sinkflow import config
from sinkflow.errors import SinkflowError


def open_trained(run_dir, device: str | None = None, **kwargs):
    """The trained run folder ``run_dir`` (``RunFolder.open``'s ``kwargs``), its networks on ``device`` for this call
    (None: its experiment.device): nothing is written, so config.yaml keeps the device it was trained on."""
    from sinkflow.runtime.run_folder import RunFolder

    return RunFolder.open(run_dir, shorthands=None if device is None else {"device": device}, **kwargs)


def with_sample_overrides(run_, overrides: list[str], command: str, run_dir: str, flags: dict | None = None):
    """``run_`` sampling with ``sample.key=value`` for this call only (``RunFolder.variant``: config.yaml stays as
    trained), refused in one line before any work when the key is not a sampling key, is out of its range, or is a
    key this method never reads (as `train` refuses them). ``flags``: the command's own flag for a key it takes
    another way (`eval`'s ``{"eval.n": "--n"}``), named in that key's refusal."""
    bad = [o for o in overrides if not o.startswith("sample.")]
    if bad:
        key, _, value = bad[0].partition("=")
        flag = (flags or {}).get(key.strip())
        raise SinkflowError(f"`sinkflow {command}` only takes sample.* overrides, not '{bad[0]}'",
                            f"use {flag} {value.strip() or 'N'} for this call" if flag else
                            f"change other keys with `sinkflow train --resume {run_dir} ...`")
    cfg = config.apply_overrides(run_.cfg, overrides)
    config.validate(cfg)
    config.check_read(cfg, config.override_keys(overrides))
    return run_.variant(sample=cfg["sample"])


def unrecorded(path, exc: OSError) -> str:
    """The warning of an evaluation whose scores were printed but could not be recorded in the run (a read-only
    mount, another owner's folder): os_error_line's fix points experiment.runs_dir elsewhere, which an existing run's
    evaluation cannot use."""
    code = errno.errorcode.get(exc.errno, "") if exc.errno else ""
    return (f"could not record the scores in {path} ({code + ' ' if code else ''}{exc.strerror or exc}); the scores "
            "above are complete: to keep them with the run, copy its folder somewhere you can write and evaluate the "
            "copy")
