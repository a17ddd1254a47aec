"""The docs site: its generated reference pages are what the code says now, and it builds with no
warning (mkdocs --strict: a broken link or anchor, or a page left out of the nav, fails)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(*command: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_reference_pages_are_up_to_date() -> None:
    result = run(sys.executable, "scripts/docs_reference.py", "--check")
    assert result.returncode == 0, result.stderr


def test_the_site_builds_without_a_warning(tmp_path: Path) -> None:
    result = run(sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"))
    assert result.returncode == 0, result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    assert (tmp_path / "site" / "reference" / "serve" / "index.html").is_file()


def test_the_readme_stays_a_short_page() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 120, len(lines)
    assert "make serve" in "\n".join(lines) and "make test" in "\n".join(lines)
