"""Every fenced `python` and `bash` block of README.md and docs/*.md runs as pasted.

Each block runs in a fresh process, in a scratch directory, with the repository's
configs and the `jaxdisagg` command at hand: what a new user gets after the README's
install line. A block that cannot run here says so right above it, with its reason:

    <!-- docs-test: skip: starts a server that runs until stopped (tests/test_server.py) -->

A bash block runs line by line (comment lines skipped, `\\` continuations joined),
each line under a time limit, and must exit 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"<!--\s*docs-test:\s*skip:\s*(.+?)\s*-->")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
TIMEOUT_S = 600


def blocks():
    """(id, language, code, skip reason or None) for every python/bash block."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            lang = m.group(1)
            if lang not in ("python", "bash"):
                continue
            before = text[:m.start()].rstrip().splitlines()[-1:] or [""]
            skip = MARK.search(before[0])
            line = text[:m.start()].count("\n") + 1
            out.append((f"{page.name}:{line}", lang, m.group(2),
                        skip.group(1) if skip else None))
    return out


def bash_lines(code: str) -> list[str]:
    joined = code.replace("\\\n", " ")
    return [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.startswith("#")]


def run(cmd: list[str], cwd: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)  # the snippets must not depend on an environment trick
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (f"{cmd[-1][:200]!r} exited {proc.returncode}\n"
                                  f"--- stdout\n{proc.stdout[-3000:]}\n"
                                  f"--- stderr\n{proc.stderr[-3000:]}")


@pytest.fixture
def scratch(tmp_path):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    return tmp_path


BLOCKS = blocks()


def test_every_block_is_run_or_says_why_not():
    assert len(BLOCKS) >= 10
    for name, _, _, reason in BLOCKS:
        assert reason is None or len(reason) > 10, f"{name}: give the reason for skipping"


@pytest.mark.parametrize("name,lang,code,reason", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_block_runs_as_pasted(name, lang, code, reason, scratch):
    if reason:
        pytest.skip(reason)
    if lang == "python":
        run([sys.executable, "-c", code], scratch)
    else:
        for line in bash_lines(code):
            run(["bash", "-c", line], scratch)
