"""Per-file pass / fail / skip / error counts from run.sh's JUnit files, and every non-pass with
the first line of its message (the raw material for the README's grouped reasons).

    python summarize.py RESULTS_DIR            # table + failures, as Markdown, on stdout
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def outcomes(xml: Path):
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        kind, msg = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                kind = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                msg = (child.get("message") or (child.text or "")).strip().splitlines()
                msg = msg[0][:300] if msg else ""
                if kind != "skipped":
                    break  # an error in teardown after a failure: keep the failure
        yield name, kind, msg


def main() -> None:
    out = Path(sys.argv[1])
    rows, bad, total = [], [], dict(passed=0, failed=0, skipped=0, error=0)
    for xml in sorted(out.glob("*.xml")):
        counts = dict(passed=0, failed=0, skipped=0, error=0)
        for name, kind, msg in outcomes(xml):
            counts[kind] += 1
            if kind != "passed":
                bad.append((kind, name, msg))
        for k in total:
            total[k] += counts[k]
        rows.append((xml.stem.replace("__", "/"), counts))
    print("| file | passed | failed | skipped | error |\n|---|---|---|---|---|")
    for name, c in rows:
        print(f"| {name} | {c['passed']} | {c['failed']} | {c['skipped']} | {c['error']} |")
    print(f"| **total** | **{total['passed']}** | **{total['failed']}** | **{total['skipped']}** | "
          f"**{total['error']}** |\n")
    for kind, name, msg in bad:
        print(f"- {kind}: `{name}`: {msg}")


if __name__ == "__main__":
    main()
