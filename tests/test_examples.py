"""Every example runs, with tiny settings, and shows what it claims."""

import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "examples"


def _run(script: str, *args: str, cwd=None) -> str:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def _losses(stdout: str) -> tuple[float, float]:
    first, last = re.search(r"loss ([\d.]+) -> ([\d.]+)", stdout).groups()
    return float(first), float(last)


def test_load_and_generate(tmp_path):
    out = _run("load_and_generate.py", "--max-new-tokens", "8", cwd=tmp_path)
    greedy = re.search(r"^greedy: +(.*)$", out, re.MULTILINE).group(1).split()
    streamed = re.search(r"^streamed: +(.*)$", out, re.MULTILINE).group(1).split()
    assert len(greedy) == 8 and streamed == greedy
    assert "batched row 0 equals greedy: True" in out


def test_sharded_inference_equals_one_device(tmp_path):
    out = _run("sharded_inference.py", cwd=tmp_path)
    assert "{'dp': 1, 'fsdp': 2, 'tp': 2, 'sp': 2} over 8 devices" in out
    difference = float(re.search(r"logits = (\S+)", out).group(1))
    assert difference < 1e-5
    assert "sharded greedy tokens equal single-device tokens: True" in out


def test_lora_finetune_loop_reduces_loss_and_saves_the_adapter(tmp_path):
    out = _run("finetune_loop.py", "--steps", "25", "--output", str(tmp_path / "adapter"))
    first, last = _losses(out)
    assert last < 0.8 * first
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


def test_custom_model_is_checked_sharded_and_trained():
    out = _run("custom_model.py", "--steps", "20")
    assert "shape check caught: TypeCheckError" in out
    assert "the new gate parameter went to P(('fsdp', 'sp'),)" in out
    assert float(re.search(r"logits = (\S+)", out).group(1)) < 1e-5
    first, last = _losses(out)
    assert last < 0.5 * first


def test_two_processes_equal_one():
    out = _run("multiprocess.py", "--steps", "2")
    assert "process 0 of 2" in out and "process 1 of 2" in out and "process 0 of 1" in out
    assert float(re.search(r"loss = (\S+)", out).group(1)) < 1e-5
