"""The `jaxdisagg` console script, run as a user would, in subprocesses."""

import json
import os
import subprocess
import sys
from pathlib import Path

from hf_util import make_hf_model, write_tokenizer_json

from jaxdisagg.model import ReferenceGenerator, SamplingParams
from jaxdisagg.model.weights import load_hf_checkpoint

SCRIPT = Path(sys.executable).parent / "jaxdisagg"


def run(*args, timeout=180):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_console_script_installed():
    assert SCRIPT.exists(), "pip install -e . should put the jaxdisagg script beside python"
    out = run("--help")
    assert out.returncode == 0 and "convert" in out.stdout and "generate" in out.stdout


def test_cli_starts_jax_with_the_devices_its_configs_name():
    """Not a blanket 8: XLA:CPU gives a process max(cores, host devices) threads, so
    spare virtual devices would oversubscribe the cores. Without XLA_FLAGS (as a user
    runs it), a command building two deployments gets the larger one's count."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    code = ("from jaxdisagg import cli; cli._host_devices({!r}, {!r}); "
            "import jax; print(jax.device_count())")
    root = Path(__file__).parents[1] / "configs"
    for pair, want in [(("cpu-smollm2.yaml", "cpu-smollm2-colocated.yaml"), 4),
                       (("cpu-2proc.yaml", "cpu-hetero.yaml"), 6)]:
        out = subprocess.run([sys.executable, "-c", code.format(*(str(root / c) for c in pair))],
                             capture_output=True, text=True, env={**env, "JAX_PLATFORMS": "cpu"},
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[-1] == str(want), (pair, out.stdout)


def test_generate_default_preset_streams_text():
    out = run("generate", "--max-tokens", "5", "Hello")
    assert out.returncode == 0, out.stderr
    assert "tiny: 1 prompt(s), 5 tokens" in out.stderr


def test_convert_then_generate_matches_library(tmp_path):
    hf, _ = make_hf_model(tmp_path, heads=4, kv_heads=2)
    write_tokenizer_json(hf)
    out = run("convert", str(hf), str(tmp_path / "orbax"))
    assert out.returncode == 0, out.stderr
    assert "with its tokenizer" in out.stdout
    assert (tmp_path / "orbax" / "state").is_dir()

    gen = run("generate", "--model", str(tmp_path / "orbax"), "--token-ids", "--max-tokens", "6",
              "1 5 9 13")
    assert gen.returncode == 0, gen.stderr
    want = ReferenceGenerator(load_hf_checkpoint(hf)).generate(
        [[1, 5, 9, 13]], SamplingParams(max_tokens=6))[0]
    assert gen.stdout.split() == [str(t) for t in want]

    text = run("generate", "--model", str(tmp_path / "orbax"), "--max-tokens", "3", "w1 w2")
    assert text.returncode == 0, text.stderr


def test_errors_are_clear_and_exit_2(tmp_path):
    cases = [
        (("generate", "--model", "nope", "hi"), "unknown model preset 'nope'"),
        (("generate", "--max-tokens", "0", "hi"), "SamplingParams.max_tokens"),
        (("generate", "--token-ids", "1 x"), "expected integers"),
        (("convert", str(tmp_path), str(tmp_path / "o")), "config.json: not found"),
    ]
    for args, message in cases:
        out = run(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert message in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr


def test_demo_serves_both_engines_and_compares(tmp_path):
    env_flags = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the CLI sets them
    out = subprocess.run([str(SCRIPT), "demo", "--model", "tiny", "--requests", "4",
                          "--max-tokens", "4", "--max-prompt", "100"], capture_output=True,
                         text=True,
                         env={**env_flags, "JAX_PLATFORMS": "cpu"}, timeout=400)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "disaggregated: streaming request 0" in text
    assert "disaggregated: per request" in text and "colocated: per request" in text
    assert "KV moved:" in text and "pool peaks:" in text
    table = text[text.index("same workload, side by side:"):]
    assert "TTFT p50 ms" in table and "TBT p99 ms" in table and "tok/s" in table
    assert "\r" not in out.stderr  # progress bars draw only on a terminal, not into logs
    rows = [line.split() for line in text.splitlines() if line.strip().startswith("demo-")]
    assert len(rows) == 8 and all(row[2] == "4" for row in rows)  # 4 new tokens each


def test_demo_bad_config_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: disaggregated\nprefill: {devices: [0, 1], tp: 2}\n")
    out = run("demo", "--config", str(bad), "--no-compare")
    assert out.returncode == 2 and "decode: missing" in out.stderr


def test_serve_and_bench_take_model_over_the_config(tmp_path):
    """--model replaces the config's model: the `small` preset runs through bench on the
    colocated layout, and SmolLM2's 9 heads on cpu-1p1d's tp=4 are refused with the fix."""
    configs = Path(__file__).resolve().parents[1] / "configs"
    out = run("bench", "--model", "small", "--config", str(configs / "cpu-colocated.yaml"),
              "--requests", "2", "--prompt-len", "fixed:8", "--output-len", "fixed:2",
              "--warmup", "0", "--json", str(tmp_path / "b.json"), timeout=600)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "b.json").read_text())["results"]["engine"]["completed"] == 2
    for cmd in (("serve", "--port", "0"), ("bench", "--requests", "1")):
        out = run(*cmd, "--model", "smollm2", "--config", str(configs / "cpu-1p1d.yaml"))
        assert out.returncode == 2, out.stderr
        assert "tp" in out.stderr and "9 query heads" in out.stderr and "valid" in out.stderr
