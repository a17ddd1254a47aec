"""One stage's test results from its JUnit XML: a count line, then each failure's name and first error
lines, so a device run cut short or read only by its tail still says what failed and why.

    python -m pagedserve.benchmarks.gpu.junit_summary STAGE FILE.xml [--lines N]
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field


@dataclass
class StageResult:
    passed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)  # "name: first lines of the error"


def _first_lines(text: str | None, lines: int) -> str:
    kept = [line.strip() for line in (text or "").splitlines() if line.strip()]
    # pytest's long report starts with the source; its "E   " lines say what went wrong.
    errors = [line for line in kept if line.startswith("E ")] or kept
    return " | ".join(errors[:lines])[:600]


def read_junit(path: str, lines: int = 3) -> StageResult:
    result = StageResult()
    for case in ET.parse(path).getroot().iter("testcase"):
        result.seconds += float(case.get("time") or 0.0)
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        problem = case.find("failure")
        problem = problem if problem is not None else case.find("error")
        if problem is not None:
            message = _first_lines(problem.get("message"), 1)
            result.failures.append(f"{name}: {message} | {_first_lines(problem.text, lines)}")
        elif case.find("skipped") is not None:
            result.skipped += 1
        else:
            result.passed += 1
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("stage")
    parser.add_argument("junit")
    parser.add_argument("--lines", type=int, default=3, help="error lines kept per failure")
    args = parser.parse_args()
    result = read_junit(args.junit, args.lines)
    for failure in result.failures:
        print(f"FAILED {failure}")
    print(f"stage {args.stage}: {result.passed} passed, {len(result.failures)} failed, "
          f"{result.skipped} skipped ({result.seconds:.0f} s of test time)")


if __name__ == "__main__":
    main()
