"""The README's quickstart is what CI runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quickstart_commands():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Quickstart.*?```(?:bash|sh)?\n(.*?)```", text, re.S)
    assert block, "README.md needs a Quickstart section with a code block"
    return [line for line in block.group(1).splitlines() if line and not line.startswith("#")]


def test_quickstart_is_two_commands_and_ci_runs_the_second():
    commands = quickstart_commands()
    assert len(commands) == 2, commands
    run_cmd, test_cmd = commands
    assert "pip install" in run_cmd and "jaxdisagg " in run_cmd
    assert "pip install" in test_cmd and "pytest" in test_cmd
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci, ".ci/run must run the README's test command verbatim"
