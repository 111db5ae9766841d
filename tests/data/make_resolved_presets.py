"""Snapshot every preset x method as resolved on main@d6ad35e (before the config schema), model sections
as build_model saw them (kind defaults + the section's own keys). Run once on that commit:
    python tests/data/make_resolved_presets.py > tests/data/resolved_presets.json
Kept to show how tests/test_config.py's snapshot was made; it imports names that commit had."""
import json
from sinkflow import config
from sinkflow.models import MODEL_KEYS
from sinkflow.flows import FLOW_DEFAULTS

out = {}
for preset in config.preset_names():
    for method in config.METHODS:
        cfg = config.resolve(preset, [], {"method": method})
        for phase, sec in cfg["model"].items():
            kind = sec["kind"]
            if kind == "flow":
                eff = {"kind": kind, **FLOW_DEFAULTS, **{k: v for k, v in sec.items() if k != "kind"}}
            else:
                eff = {"kind": kind, **MODEL_KEYS[kind],
                       **{k: v for k, v in sec.items() if k in MODEL_KEYS[kind] and v is not None}}
            cfg["model"][phase] = eff
        out[f"{preset} --method {method}"] = cfg
print("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in out.items()) + "\n}")
