"""The metrics docs/observability.md documents, by section (`gRPC, every service`, `Inference`,
`Trainer`, `Coordinator`, `Reward`), as they appear in an exposition (counters with `_total`)."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "observability.md"


def documented_metrics() -> dict[str, set[str]]:
    sections: dict[str, set[str]] = {}
    section = ""
    for line in DOC.read_text().splitlines():
        if line.startswith("### "):
            section = line.removeprefix("### ").strip()
        elif match := re.match(r"\| `(pipelinerl_\w+)` \|", line):
            sections.setdefault(section, set()).add(match.group(1))
    return sections
