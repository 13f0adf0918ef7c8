"""The CPU decode step's kernels, as XLA FFI custom calls: paged decode attention, one
call per layer (`cpu_decode.cc`), products of a few rows by a weight
(`cpu_dense.cc`), and each row's argmax and log-normaliser for greedy sampling
(`cpu_sample.cc`).

The sources ship with the package and are compiled on first use with the machine's
C++ compiler against the FFI headers jaxlib ships, into one library in a per-user
cache keyed by the sources, jaxlib's version and the compiler command, so it is built
once per machine, not per process. Without a compiler `available()` says why and the
`auto` backend keeps the jnp reference and XLA's products; asking for `cpu`
explicitly then fails with that reason.

The attention reads fp32 pages (the CPU pools' dtype) with head dims in multiples of
16 up to 256 (every real model's); `attention.decode_attention` sends anything else to the
reference. q of any dtype is computed in fp32 and cast back. The product takes fp32,
1-16 rows and N in multiples of 16 (`small_product_fits`). The greedy kernel takes fp32
logits [B, V] of any shape.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_SOURCES = (_HERE / "cpu_decode.cc", _HERE / "cpu_dense.cc", _HERE / "cpu_sample.cc")
_HEADERS = (_HERE / "cpu_common.h",)
# FFI target name -> the handler's symbol in the library
_TARGETS = {"jaxdisagg_paged_decode_f32": "JaxdisaggPagedDecodeF32",
            "jaxdisagg_small_product_f32": "JaxdisaggSmallBatchProductF32",
            "jaxdisagg_tied_head_f32": "JaxdisaggTiedHeadF32",
            "jaxdisagg_argmax_log_norm_f32": "JaxdisaggArgmaxLogNormF32"}
_ATTENTION, _PRODUCT, _HEAD, _GREEDY = _TARGETS
SMALL_PRODUCT_ROWS = 16  # the most rows the product kernel takes (24 ran 1.05x XLA)
TIED_HEAD_ROWS = 32  # and the tied head
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-Wno-attributes", "-Wno-return-type")


def _flags() -> tuple[str, ...]:
    """The compiler's flags: for this machine's ISA, or the one JAXDISAGG_CPU_MARCH names.

    The kernels size their register blocks by the vector width the target has (16
    lanes with AVX-512, 8 without), so a host of either kind runs one of two code paths;
    `JAXDISAGG_CPU_MARCH=x86-64-v3` builds the AVX2 one on an AVX-512 host (the tests
    check both that way)."""
    return (f"-march={os.environ.get('JAXDISAGG_CPU_MARCH') or 'native'}", *_FLAGS)


def _cache_dir() -> Path:
    root = os.environ.get("JAXDISAGG_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxdisagg")
    return Path(root)


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def _build() -> Path:
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or clang++; or set CXX)")
    include = jax.ffi.include_dir()
    key = hashlib.sha256()
    for f in (*_SOURCES, *_HEADERS):
        key.update(f.read_bytes())
    flags = _flags()
    key.update(" ".join((cxx, jax.lib.__version__, *flags)).encode())
    out = _cache_dir() / f"cpu_decode-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed: processes building at once never see a
    # half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cxx, *flags, f"-I{include}", *map(str, _SOURCES), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            names = ", ".join(f.name for f in _SOURCES)
            raise RuntimeError(f"compiling the CPU kernels ({names}) failed: "
                               f"{done.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the CPU kernels: %s", out)
    return out


@functools.cache
def _load() -> str | None:
    """Builds and registers the kernels; returns None when ready, else why they are not."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build()))
        for target, symbol in _TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("CPU kernels unavailable, using the jnp reference and XLA's products: "
                    "%s", e)
        return str(e)
    return None


def set_helper_spin_us(us: int) -> None:
    """How long the kernels' helper threads spin after a call before they park
    (`cpu_common.h`; default 200 us, or the JAXDISAGG_CPU_SPIN_US environment variable)."""
    if (why := _load()) is not None:
        raise RuntimeError(f"the cpu kernels are unavailable: {why}")
    ctypes.cdll.LoadLibrary(str(_build())).JaxdisaggSetHelperSpinUs(ctypes.c_int64(us))


def available() -> bool:
    return _load() is None


def unavailable_reason() -> str | None:
    return _load()


def supports(page_dtype, head_dim: int) -> bool:
    """What the kernel reads: fp32 pages and head dims in whole 16-lane vectors, up to 256
    (every real model's)."""
    return jnp.dtype(page_dtype) == jnp.float32 and head_dim % 16 == 0 and head_dim <= 256


def paged_decode_attention_cpu(q, k_pages, v_pages, block_tables, seq_lens, *, scale):
    """One query per slot [B, N, H] over each slot's pages -> [B, N, H] (q's dtype).

    Same contract as `reference.decode_attention_ref`.
    """
    if (why := _load()) is not None:
        raise RuntimeError(f"the cpu attention backend is unavailable: {why}")
    if not supports(k_pages.dtype, q.shape[-1]) or v_pages.dtype != k_pages.dtype:
        raise TypeError(f"the cpu decode kernel reads float32 pages and head dims that are "
                        f"multiples of 16 up to 256, not {k_pages.dtype} and {q.shape[-1]}")
    call = jax.ffi.ffi_call(_ATTENTION, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q.astype(jnp.float32), k_pages, v_pages, block_tables.astype(jnp.int32),
               seq_lens.astype(jnp.int32), scale=np.float32(scale))
    return out.astype(q.dtype)


def small_product_fits(x, w) -> bool:
    """What the product kernel takes: fp32 x [M, D] with 1-16 rows, fp32 w [D, N] with N a
    multiple of 16."""
    return (x.ndim == 2 and w.ndim == 2 and 1 <= x.shape[0] <= SMALL_PRODUCT_ROWS
            and x.shape[1] == w.shape[0] and w.shape[1] % 16 == 0
            and x.dtype == jnp.float32 and w.dtype == jnp.float32)


def small_product_cpu(x, w):
    """x [M, D] @ w [D, N] -> fp32 [M, N], M <= 16: each thread streams a contiguous range
    of w's rows once (`cpu_dense.cc`). Same result as `x @ w` up to summation order."""
    if (why := _load()) is not None:
        raise RuntimeError(f"the cpu product kernel is unavailable: {why}")
    if not small_product_fits(x, w):
        raise TypeError(f"the cpu product kernel takes fp32 [M<={SMALL_PRODUCT_ROWS}, D] x "
                        f"[D, N%16==0], not {x.dtype}{list(x.shape)} x {w.dtype}{list(w.shape)}")
    call = jax.ffi.ffi_call(_PRODUCT, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]),
                                                           jnp.float32))
    return call(x, w)


def tied_head_fits(x, e) -> bool:
    """What the head kernel takes: fp32 x [M, D] with 1-32 rows and D a multiple of 16,
    fp32 e [V, D]."""
    return (x.ndim == 2 and e.ndim == 2 and 1 <= x.shape[0] <= TIED_HEAD_ROWS
            and x.shape[1] == e.shape[1] and x.shape[1] % 16 == 0
            and x.dtype == jnp.float32 and e.dtype == jnp.float32)


def tied_head_cpu(x, e):
    """x [M, D] @ e [V, D]^T -> fp32 [M, V], M <= 32: the LM head of a model whose head is
    its embedding, each thread streaming a contiguous range of e's rows once
    (`cpu_dense.cc`). Same result as `x @ e.T` up to summation order."""
    if (why := _load()) is not None:
        raise RuntimeError(f"the cpu head kernel is unavailable: {why}")
    if not tied_head_fits(x, e):
        raise TypeError(f"the cpu head kernel takes fp32 [M<={TIED_HEAD_ROWS}, D%16==0] x "
                        f"[V, D], not {x.dtype}{list(x.shape)} x {e.dtype}{list(e.shape)}")
    call = jax.ffi.ffi_call(_HEAD, jax.ShapeDtypeStruct((x.shape[0], e.shape[0]), jnp.float32))
    return call(x, e)


def argmax_log_norm_fits(logits) -> bool:
    """What the greedy kernel takes: fp32 logits [B, V]."""
    return logits.ndim == 2 and logits.shape[1] > 0 and logits.dtype == jnp.float32


def argmax_log_norm_cpu(logits):
    """fp32 logits [B, V] -> (int32 [B]: each row's first argmax, as `jnp.argmax`; fp32
    [B]: log(sum_j exp(x_j - x_max)), NaN where the row's maximum is not finite) in two
    vector passes per row (`cpu_sample.cc`). A token t's log-probability is then
    (x_t - x_max) - log_norm, as `jax.nn.log_softmax` gives it."""
    if (why := _load()) is not None:
        raise RuntimeError(f"the cpu greedy kernel is unavailable: {why}")
    if not argmax_log_norm_fits(logits):
        raise TypeError(f"the cpu greedy kernel takes fp32 logits [B, V], not "
                        f"{logits.dtype}{list(logits.shape)}")
    b = logits.shape[0]
    call = jax.ffi.ffi_call(_GREEDY, (jax.ShapeDtypeStruct((b,), jnp.int32),
                                      jax.ShapeDtypeStruct((b,), jnp.float32)))
    return call(logits)
