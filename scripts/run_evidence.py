"""Check a finished `pipelinerl run` directory as the end-to-end tests do: every attempt final, and
each trained one in the final weights exactly once; with BUDGET, also that the run dispatched
exactly that many attempts. Prints one JSON line of the dispositions.

    python -m scripts.run_evidence RUN_DIR [BUDGET]

from the repository root (the check is the end-to-end tests' own, `tests/e2e/evidence.py`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.e2e.evidence import assert_trained_exactly_once, journal_rows

if __name__ == "__main__":
    run_dir = Path(sys.argv[1])
    attempts = int(sys.argv[2]) if len(sys.argv) > 2 else len(journal_rows(run_dir))
    dispositions = assert_trained_exactly_once(run_dir, attempts)
    print(json.dumps({"attempts": attempts, "trained_exactly_once": True, **dispositions}))
