"""Every example runs, with tiny settings."""

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_finetune_loop_reduces_loss():
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "finetune_loop.py"), "--steps", "25"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    first, last = out.stdout.split("loss ")[1].split(" over")[0].split(" -> ")
    assert float(last) < 0.7 * float(first)
