"""The documentation: the site builds with warnings as errors, every public name is in the
API reference with a docstring, and the quickstart's code blocks run as written."""

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import griffe

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"
PUBLIC_MODULES = (
    "eqdel",
    "eqdel.axes",
    "eqdel.nn",
    "eqdel.models",
    "eqdel.attention",
    "eqdel.train",
    "eqdel.checkpoint",
    "eqdel.evaluate",
)


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


def _public_members(package: griffe.Module):
    """`(public path, object)` for every public name of the public modules."""
    for module_path in PUBLIC_MODULES:
        module = package if module_path == "eqdel" else package[module_path[len("eqdel.") :]]
        exported = module.exports
        for name, member in module.members.items():
            if name.startswith("_") or (exported is not None and name not in exported):
                continue
            if member.is_alias:
                try:
                    member = member.final_target
                except griffe.AliasResolutionError:
                    continue  # imported from another package
            if not member.is_module:
                yield f"{module_path}.{name}", member


def test_every_public_name_is_documented():
    package = griffe.load("eqdel", search_paths=[str(ROOT)], resolve_aliases=True)
    api = (DOCS / "api.md").read_text()
    entries = re.findall(r"^::: (\S+)", api, re.MULTILINE)
    members = list(_public_members(package))
    documented = set()
    for entry in entries:
        target = package[entry[len("eqdel.") :]]
        target = target.final_target if target.is_alias else target
        documented.add(target.path)
        if target.is_module:  # a whole module's public members are rendered
            documented.update(m.path for _, m in members if m.parent is target)
    missing = [p for p, m in members if m.path not in documented]
    undocumented = [p for p, m in members if not (m.docstring and m.docstring.value.strip())]
    assert not missing, f"not in docs/api.md: {missing}"
    assert not undocumented, f"no docstring: {undocumented}"


def _blocks(markdown: str) -> list[re.Match]:
    """Every fenced code block: `group(1)` its language, `group(2)` its code."""
    return list(re.finditer(r"^```(\w+)\n(.*?)^```\n", markdown, re.MULTILINE | re.DOTALL))


def test_quickstart_runs_as_written(tmp_path):
    """Consecutive Python blocks run as one script (later blocks use earlier names); shell
    blocks run as they are, except the install line, which is what this suite runs in."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    steps: list[tuple[str, str]] = []
    for block in _blocks((DOCS / "quickstart.md").read_text()):
        language, code = block.groups()
        if language not in ("python", "bash") or "pip install" in code:
            continue
        if steps and language == "python" == steps[-1][0]:
            steps[-1] = ("python", steps[-1][1] + code)
        else:
            steps.append((language, code))
    assert [lang for lang, _ in steps] == ["bash", "python", "bash"]
    outputs = []
    for language, code in steps:
        command = [sys.executable, "-c", code] if language == "python" else ["bash", "-ec", code]
        out = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert out.returncode == 0, f"{code}\n{out.stderr[-3000:]}"
        outputs.append(out.stdout)
    demo, python, cli = outputs
    assert "assistant: I am Quill" in demo  # the demo's fine-tuning took
    assert "The capital of France is Paris." in python
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", python).groups())
    assert last < 0.5 * first
    assert "The lighthouse keeper" in python  # the fine-tuned model learned the notes
    assert (tmp_path / "quickstart" / "notes-cli" / "adapter" / "adapter_config.json").is_file()
    assert "The lighthouse keeper" in cli
    assert re.search(r"perplexity \d+\.\d+ .* over \d+ tokens of perplexity.txt", cli)


def _shown_outputs() -> list[tuple[str, str, str]]:
    """`(page, code, output)` for every Python block followed at once by a text block."""
    pairs = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        blocks = _blocks(text)
        for code, shown in itertools.pairwise(blocks):
            adjacent = text[code.end() : shown.start()].strip() == ""
            if adjacent and (code.group(1), shown.group(1)) == ("python", "text"):
                pairs.append((page.name, code.group(2), shown.group(2)))
    return pairs


def test_shown_outputs_are_what_the_code_prints():
    pairs = _shown_outputs()
    assert pairs, "no page shows the output of its code"
    for page, code, output in pairs:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, f"{page}\n{out.stderr[-3000:]}"
        assert out.stdout == output, f"{page}: the code now prints\n{out.stdout}"
