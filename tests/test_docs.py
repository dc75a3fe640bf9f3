"""The documentation site builds with warnings as errors (every API page resolves)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_docs_build_strict(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "api" / "index.html").is_file()
