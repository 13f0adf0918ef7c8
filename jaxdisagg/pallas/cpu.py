"""The CPU decode attention: one XLA FFI custom call per layer (`cpu_decode.cc`).

The source ships with the package and is compiled on first use with the machine's C++
compiler against the FFI headers jaxlib ships, into a per-user cache keyed by the
source, jaxlib's version and the compiler command, so it is built once per machine,
not per process. Without a compiler `available()` says why and the `auto` backend
keeps the jnp reference; asking for `cpu` explicitly then fails with that reason.

The kernel reads fp32 pages (the CPU pools' dtype) with head dims in multiples of 16
(every real model's); `attention.decode_attention` sends anything else to the
reference. q of any dtype is computed in fp32 and cast back.
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

_SOURCE = Path(__file__).with_name("cpu_decode.cc")
_TARGET = "jaxdisagg_paged_decode_f32"
_SYMBOL = "JaxdisaggPagedDecodeF32"
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-Wno-attributes",
          "-Wno-return-type")


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
    key = hashlib.sha256(_SOURCE.read_bytes())
    key.update(" ".join((cxx, jax.lib.__version__, *_FLAGS)).encode())
    out = _cache_dir() / f"cpu_decode-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed: processes building at once never see a
    # half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cxx, *_FLAGS, f"-I{include}", str(_SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {_SOURCE.name} failed: {done.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the CPU decode attention kernel: %s", out)
    return out


@functools.cache
def _load() -> str | None:
    """Builds and registers the kernel; returns None when ready, else why it is not."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build()))
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(getattr(lib, _SYMBOL)),
                                    platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("CPU decode attention kernel unavailable, using the jnp reference: %s", e)
        return str(e)
    return None


def available() -> bool:
    return _load() is None


def unavailable_reason() -> str | None:
    return _load()


def supports(page_dtype, head_dim: int) -> bool:
    """What the kernel reads: fp32 pages and head dims in whole 16-lane vectors."""
    return jnp.dtype(page_dtype) == jnp.float32 and head_dim % 16 == 0


def paged_decode_attention_cpu(q, k_pages, v_pages, block_tables, seq_lens, *, scale):
    """One query per slot [B, N, H] over each slot's pages -> [B, N, H] (q's dtype).

    Same contract as `reference.decode_attention_ref`.
    """
    if (why := _load()) is not None:
        raise RuntimeError(f"the cpu attention backend is unavailable: {why}")
    if not supports(k_pages.dtype, q.shape[-1]) or v_pages.dtype != k_pages.dtype:
        raise TypeError(f"the cpu decode kernel reads float32 pages and head dims that are "
                        f"multiples of 16, not {k_pages.dtype} and {q.shape[-1]}")
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q.astype(jnp.float32), k_pages, v_pages, block_tables.astype(jnp.int32),
               seq_lens.astype(jnp.int32), scale=np.float32(scale))
    return out.astype(q.dtype)
