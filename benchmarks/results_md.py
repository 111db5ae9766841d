"""Replace one generated section of benchmarks/RESULTS.md (between ``<!-- name:begin -->`` and
``<!-- name:end -->``), or append it under ``heading`` the first time, so a script rerun updates its own table
and nothing else. Written atomically: a killed write leaves the old file."""

from __future__ import annotations

from pathlib import Path

from sinkflow.data.atomic_write import atomic_write_text

RESULTS = Path(__file__).with_name("RESULTS.md")


def write_section(name: str, body: str, heading: str, path: Path = RESULTS) -> None:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    section = f"{begin}\n{body}{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text += f"\n## {heading}\n\n{section}\n"
    atomic_write_text(path, text)
