"""The roofline model against values worked out by hand from the article's formulas,
for an MHA and a GQA model on several hardware entries; and the CLI and plot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxdisagg import roofline as rl
from jaxdisagg.model.config import get_preset

SCRIPT = Path(sys.executable).parent / "jaxdisagg"
L2_PARAMS, L3_PARAMS = 6_738_415_616, 8_030_261_248  # published counts


def test_kv_bytes_per_token_mha_and_gqa():
    l2 = rl.Model.from_config(get_preset("llama2-7b"))
    l3 = rl.Model.from_config(get_preset("llama3-8b"))
    assert (l2.params, l3.params) == (L2_PARAMS, L3_PARAMS)
    assert l2.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 == 512 * 1024  # the article's 512 KiB
    assert l3.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 128 * 1024  # GQA: 4x less
    assert rl.Model.from_config(get_preset("llama3-8b"), 4).kv_bytes_per_token == 256 * 1024


def test_decode_and_prefill_intensity():
    l2 = rl.Model.from_config(get_preset("llama2-7b"))
    # I = 2*P*B / (2*P + K_tok*L*B) at B=32, L=512: 431258599424 / 22066765824
    p = rl.decode_point(l2, 32, 512)
    assert p.flops == 431_258_599_424
    assert p.bytes == 13_476_831_232 + 8_589_934_592
    assert p.intensity == pytest.approx(19.5433, rel=1e-4)
    assert rl.decode_point(l2, 1, 0).intensity == pytest.approx(1.0)  # I ~ T at short context
    assert rl.prefill_point(l2, 2048, 0).intensity == pytest.approx(2048.0)
    # C=2048 over S=32768: 2P*2048 / (2P + 524288*32768)
    assert rl.prefill_point(l2, 2048, 32768).intensity == pytest.approx(
        2 * L2_PARAMS * 2048 / (2 * L2_PARAMS + 524288 * 32768))


def test_crossover_and_batch_cancelling():
    l2 = rl.Model.from_config(get_preset("llama2-7b"))
    l3 = rl.Model.from_config(get_preset("llama3-8b"))
    assert rl.crossover_tokens(l2) == pytest.approx(2 * L2_PARAMS / 524288)
    assert rl.crossover_tokens(l2) / 32 == pytest.approx(803.3, abs=0.1)  # L at B = 32
    assert rl.crossover_tokens(l3) / 32 == pytest.approx(2 * L3_PARAMS / 131072 / 32)
    # Far past the crossover, B cancels: I ~ 2P / (K_tok * L) whatever the batch.
    far = [rl.decode_point(l2, b, 1_000_000).intensity for b in (32, 128, 512)]
    assert far[0] == pytest.approx(far[2], rel=0.02)
    assert far[0] == pytest.approx(2 * L2_PARAMS / (524288 * 1_000_000), rel=0.03)


@pytest.mark.parametrize("name,ridge", [("h100-sxm", 500 / 3.35), ("h200", 500 / 4.8),
                                        ("a100-sxm", 250 / 2.0), ("cpu-2core", 153 / 26.4)])
def test_ridge_regimes_and_step_time(name, ridge):
    hw = rl.HARDWARE[name]
    assert hw.ridge == pytest.approx(ridge)
    l3 = rl.Model.from_config(get_preset("llama3-8b"))
    decode, prefill = rl.decode_point(l3, 1, 2048), rl.prefill_point(l3, 2048, 0)
    assert decode.regime(hw) == "bandwidth" and prefill.regime(hw) == "compute"
    assert decode.time(hw) == pytest.approx((2 * L3_PARAMS + 131072 * 2048) / hw.bandwidth)
    # A CPU's ridge is so low that a decode batch of 8 is already compute-bound there.
    b8 = rl.decode_point(l3, 8, 512)
    assert b8.regime(hw) == ("compute" if name == "cpu-2core" else "bandwidth")
    assert prefill.time(hw) == pytest.approx(2 * L3_PARAMS * 2048 / hw.flops)


def test_transfer_time_per_fabric():
    l2 = rl.Model.from_config(get_preset("llama2-7b"))
    assert 4096 * l2.kv_bytes_per_token == 2 * 1024**3  # the article's 2 GiB
    assert rl.transfer_seconds(l2, 4096, rl.FABRICS["nvlink"]) == pytest.approx(
        2 * 1024**3 / 450e9)
    assert rl.transfer_seconds(l2, 4096, rl.FABRICS["pcie5"]) == pytest.approx(
        2 * 1024**3 / 50e9)


def run(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([str(SCRIPT), "roofline", *map(str, args)], capture_output=True,
                          text=True, env={**env, "JAX_PLATFORMS": "cpu"}, timeout=timeout)


def test_cli_tables_and_plot(tmp_path):
    png = tmp_path / "roofline.png"
    out = run("--model", "llama3-8b", "--hardware", "h200", "--plot", png)
    assert out.returncode == 0, out.stderr
    for text in ("ridge R = 104", "crossover", "prefill of a chunk", "nvlink", "loopback"):
        assert text in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_takes_your_own_cases_counts_prefix_attention_and_writes_json(tmp_path):
    """The article's own cases: B=32 at 1k and 64k of context, a chunk over a long prefix."""
    out = run("--model", "llama2-7b", "--batch", "32", "--context", "1024,65536", "--chunk",
              "2048", "--prefix", "0,32768", "--json", tmp_path / "r.json")
    assert out.returncode == 0, out.stderr
    assert "500 TFLOP/s sustained" in out.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert [(r["batch"], r["context"]) for r in data["decode"]] == [(32, 1024), (32, 65536)]
    assert [r["fits"] for r in data["decode"]] == [True, False]  # 1.1 TB of KV at 64k
    short, long = data["prefill"]
    assert short["step_s"] == long["step_s"]  # the headline formula: compute-bound either way
    # ... but the chunk's attention over 32k cached tokens more than doubles it
    assert long["step_with_attention_s"] > 2 * short["step_with_attention_s"]
    bad = run("--batch", "8,x")
    assert bad.returncode == 2 and "--batch: comma-separated positive integers" in bad.stderr


def test_cli_reads_an_hf_config_and_rejects_bad_names(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_key_value_heads"] == 2
    out = run("--model", tmp_path, "--hardware", "a100-sxm")
    assert out.returncode == 0, out.stderr
    assert f"K_tok = {2 * 4 * 2 * 32 * 2 / 1000:.3g} kB/token" in out.stdout
    bad = run("--hardware", "tpu-v9")
    assert bad.returncode == 2 and "--hardware: one of" in bad.stderr
    bad = run("--model", tmp_path / "nope")
    assert bad.returncode == 2 and "neither a preset" in bad.stderr


def test_calibrate_measures_and_compares(tmp_path):
    out = run("--calibrate", "--calibrate-preset", "tiny", "--plot", tmp_path / "cal.png")
    assert out.returncode == 0, out.stderr
    assert "measured ceilings" in out.stdout and "refined, M-rate" in out.stdout
    assert "prefill C=512 S=0" in out.stdout and "decode B=8 L=512" in out.stdout
    assert (tmp_path / "cal.png").exists()
    assert " 0 B memory" not in out.stdout and "unknown memory" not in out.stdout
    assert "fits?" in out.stdout and "   NO" not in out.stdout.split("crossover")[0]


def test_served_cost_refines_the_article():
    """Embedding gathered, head only where logits are needed, attention pairs counted."""
    cfg = get_preset("small")  # untied, vocab 32000, hidden 512, 8 layers, 8 heads of 64
    m = rl.Model.from_config(cfg, 4)
    head = 32000 * 512
    assert (m.head_params, m.embed_params) == (head, head)
    assert m.dense_params == cfg.num_params() - 2 * head
    assert m.attn_flops_per_pair == 4 * 8 * 8 * 64
    p = rl.refined(m, rl.prefill_point(m, 512, 0))
    assert p.flops == 2 * m.dense_params * 512 + 2 * head + 4 * 8 * 8 * 64 * 512 * 513 / 2
    assert p.bytes == 4 * (m.dense_params + head) + m.kv_bytes_per_token * 512
    d = rl.refined(m, rl.decode_point(m, 8, 512))
    assert d.flops == 2 * m.dense_params * 8 + 2 * head * 8 + 4 * 8 * 8 * 64 * 8 * 512
    assert d.bytes == 4 * (m.dense_params + head) + m.kv_bytes_per_token * 8 * 512
    tied = rl.Model.from_config(get_preset("llama3.2-1b"))
    assert tied.embed_params == 0 and tied.head_params == 128256 * 2048
