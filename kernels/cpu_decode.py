"""The CPU decode library (kernels/cpu_decode.cpp): built on first use, called by ctypes.

A decode step's attention on CPU through torch is a gather of the sequence's blocks and four or
five more ops, each with a fixed cost that at the model sizes served on a CPU (a 135M model's 30
layers) makes up most of a short context's token (benchmarks/RESULTS.md, "The CPU decode
kernel"). The kernel attends every
decode of a step in one call per layer, reading each position's K and V where it lies in the
pool, in float32 throughout (benchmarks/decode_attention.py measures it against the torch path).
The same library takes the rest of a CPU token's small ops where a call beats a handful of torch
ops: the int8 LM head (`int8_rows`), the KV write (`write_kv`), and in 16 bits the RMSNorm
(`rms_norm`) and the rotary embedding (`rotary`).

It is compiled by the machine's C++ compiler ($CXX, else c++ or g++) with -march=native into
the cache folder ($PAGEFLEET_CACHE_DIR, else ~/.cache/pagefleet; `kernels/` under it), named by
a digest of its source, the flags, the compiler and the CPU's features, so a shared folder
never hands one machine another's build. Without a compiler, or on a build that fails, the
torch path serves (logged once). PAGEFLEET_CPU_DECODE=0 turns the kernel off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
# Reassociation lets the compiler vectorize the dot products and sums (each sequence's result
# still depends only on its own inputs: the same bits alone or in a batch); no other fast-math.
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",  # (the process's OpenMP runtime, torch's: one pool of threads for both)
    "-shared",
    "-fPIC",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
)
HEAD_DIMS = (32, 64, 96, 128, 256)  # the sizes the kernel is instantiated for
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_BUILD_TIMEOUT_S = 120

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def enabled() -> bool:
    """Whether the kernel may serve (PAGEFLEET_CPU_DECODE is not 0)."""
    return os.environ.get("PAGEFLEET_CPU_DECODE", "1") != "0"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_features() -> str:
    """What -march=native builds for: the CPU's feature flags (Linux), else the platform."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build(cache_dir: str | os.PathLike | None = None) -> Path:
    """The kernel's shared library, compiled unless a build of the same source, flags, compiler
    and CPU is cached; raises if it cannot be built."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(), _cpu_features().encode()]))
    root = Path(cache_dir or os.environ.get("PAGEFLEET_CACHE_DIR") or "~/.cache/pagefleet").expanduser()
    target = root / "kernels" / f"cpu_decode-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed into place: processes building at once (a node's
    # ranks) each load a whole library, never another's half-written one.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [cxx, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def library() -> ctypes.CDLL | None:
    """The loaded kernel, built on the first call; None when it is off or cannot be built."""
    global _lib, _tried
    if not enabled():
        return None
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                lib = ctypes.CDLL(str(build()))
                fn = lib.pagefleet_decode
                p, i, n = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
                fn.argtypes = [i, i, p, n, p, p, p, n, p, p, i, i, i, i, ctypes.c_float, p, n, p, i]
                fn.restype = i
                lib.pagefleet_decode_scratch.argtypes = [i, i, i, i]
                lib.pagefleet_decode_scratch.restype = n
                lib.pagefleet_int8_rows.argtypes = [i, p, n, i, p, p, i, i, p, n, p, i]
                lib.pagefleet_int8_rows.restype = i
                lib.pagefleet_rms_norm.argtypes = [p, n, i, i, p, ctypes.c_float, p, n, i]
                lib.pagefleet_rms_norm.restype = i
                lib.pagefleet_write_kv.argtypes = [p, n, p, n, p, p, n, p, i, n]
                lib.pagefleet_write_kv.restype = i
                lib.pagefleet_rotary.argtypes = [p, n, i, i, i, p, p, p]
                lib.pagefleet_rotary.restype = i
                _lib = lib
            except Exception as e:  # (no compiler, a failed build, an unloadable file)
                log.warning("the CPU kernel library is unavailable (%s); decoding through torch", e)
            _tried = True
    return _lib


def supports(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, quantized: bool) -> bool:
    """Whether the kernel takes this layer's decodes: a CPU bfloat16 or float32 cache of the
    query's dtype (not an 8-bit one), a head size it was built for, whole query heads per KV
    head, the layouts it reads (each query and output row's heads side by side, whole caches)."""
    d = query.shape[-1]
    return (
        not quantized
        and _fits(query.dtype, key_cache.dtype, value_cache.dtype, d, query.shape[-2], key_cache.shape[2], enabled())
        and query.is_cpu
        and query.stride(2) == 1
        and query.stride(1) == d
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
    )


@functools.lru_cache(maxsize=2)
def _built(on: bool) -> bool:
    """Whether the library serves: turned on (`enabled`) and built."""
    return on and library() is not None


@functools.lru_cache(maxsize=64)
def _fits(dtype, k_dtype, v_dtype, head_dim: int, heads: int, kv_heads: int, on: bool) -> bool:
    return (
        dtype in _DTYPES
        and k_dtype == v_dtype == dtype
        and head_dim in HEAD_DIMS
        and heads % kv_heads == 0
        and _built(on)
    )


def scratch_size(heads: int, longest: int, head_dim: int, threads: int) -> int:
    """Floats of scratch a call needs for its longest row on `threads` threads: per query head
    its scaled query, its scores (to 16 positions) and its values' partial sums (a span of 256
    positions each), once per thread (the short rows are spread over them), and 16 to align
    them; kernels/cpu_decode.cpp's `scratch_for`, which tests/test_cpu_decode.py holds equal."""
    padded, spans = -(-longest // 16) * 16, -(-longest // 256)
    return (heads * (head_dim + padded + spans * head_dim) + -(-heads // 16) * 16) * max(threads, 1) + 16


def decode(
    query: torch.Tensor,  # (tokens, heads, d)
    key_cache: torch.Tensor,  # (num_blocks, block_size, kvh, d)
    value_cache: torch.Tensor,
    tables: torch.Tensor,  # (n, max_blocks) int32: each decode's block table
    rows: Sequence[int],  # each decode's query row
    lens: list[int],  # each decode's cached positions, its own included
    scale: float,
    out: torch.Tensor,  # (tokens, heads, d), rows of heads side by side: each decode's row written
    scratch: torch.Tensor,  # float32, >= scratch_size(heads, max(lens), d, torch threads) elements
) -> None:
    """Attend decode i's query row rows[i] over its first lens[i] positions through block
    table row i, into the same row of `out` (`supports` said yes)."""
    _, heads, d = query.shape
    _, block_size, kvh, _ = key_cache.shape
    n, longest, threads = len(rows), max(lens), torch.get_num_threads()
    if (
        tables.dtype != torch.int32
        or tables.stride(1) != 1
        or out.stride(2) != 1
        or out.stride(1) != d
        or min(lens) < 1
    ):
        raise ValueError("the CPU decode kernel takes int32 block tables, output rows of whole heads, lengths >= 1")
    if longest > tables.shape[1] * block_size or scratch.numel() < scratch_size(heads, longest, d, threads):
        raise ValueError(f"a decode of {longest} positions does not fit its block table or the scratch")
    status = library().pagefleet_decode(
        _DTYPES[query.dtype],
        d,
        query.data_ptr(),
        query.stride(0),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        tables.data_ptr(),
        tables.stride(0),
        (ctypes.c_int32 * n)(*rows),
        (ctypes.c_int32 * n)(*lens),
        n,
        block_size,
        kvh,
        heads,
        scale,
        out.data_ptr(),
        out.stride(0),
        scratch.data_ptr(),
        threads,
    )
    if status != 0:
        raise RuntimeError(f"the CPU decode kernel refused head size {d}")


def int8_supports(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether `int8_rows` takes x (m, in) times this int8 weight (out, in): CPU, bfloat16 or
    float32 activations with scales of their dtype, rows of x whole, in a multiple of 32."""
    return (
        x.is_cpu
        and x.dim() == 2
        and x.stride(1) == 1
        and qweight.is_contiguous()
        and _int8_fits(x.dtype, scales.dtype, qweight.dtype, qweight.shape[1], enabled())
    )


@functools.lru_cache(maxsize=16)
def _int8_fits(dtype, scales_dtype, weight_dtype, in_features: int, on: bool) -> bool:
    return (
        dtype in _DTYPES
        and scales_dtype == dtype
        and weight_dtype == torch.int8
        and in_features % 32 == 0
        and _built(on)
    )


def int8_rows(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, xf: torch.Tensor) -> torch.Tensor:
    """x (m, in) @ (qweight (out, in) int8 * scales (out,))^T -> (m, out) in x's dtype, summed in
    float32 and rounded once; each row of x the same whatever the others (`int8_supports` said
    yes). xf: float32 scratch of at least m * in + 16 elements."""
    m, in_features = x.shape
    out_features = qweight.shape[0]
    if xf.dtype != torch.float32 or xf.numel() < m * in_features + 16 or qweight.shape[1] != in_features:
        raise ValueError("int8_rows: the scratch or the weight does not fit x")
    out = torch.empty(m, out_features, dtype=x.dtype)
    status = library().pagefleet_int8_rows(
        _DTYPES[x.dtype],
        x.data_ptr(),
        x.stride(0),
        m,
        qweight.data_ptr(),
        scales.contiguous().data_ptr(),
        out_features,
        in_features,
        out.data_ptr(),
        out.stride(0),
        xf.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"the CPU int8 kernel refused {in_features} input features")
    return out


def norm_supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` takes x: CPU bfloat16 rows, whole, of a multiple of 16, and a
    bfloat16 weight (float32 keeps torch's rms_norm, which transformers' equals bit for bit)."""
    return (
        x.is_cpu
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.dim() == 2
        and x.stride(1) == 1
        and x.shape[1] % 16 == 0
        and weight.is_contiguous()
        and _built(enabled())
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (m, n) bfloat16 as transformers computes it in 16 bits (`norm_supports`
    said yes): a new (m, n) tensor."""
    m, n = x.shape
    out = torch.empty(m, n, dtype=x.dtype)
    status = library().pagefleet_rms_norm(
        x.data_ptr(), x.stride(0), m, n, weight.data_ptr(), eps, out.data_ptr(), n, torch.get_num_threads()
    )
    if status != 0:
        raise RuntimeError(f"the CPU norm kernel refused rows of {n}")
    return out


def write_kv(
    key: torch.Tensor,  # (tokens, kvh, d)
    value: torch.Tensor,
    key_cache: torch.Tensor,  # (num_blocks, block_size, kvh, d)
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (tokens,) int64, -1 to skip
) -> bool:
    """Copy each token's K and V into its slot of a 16-bit or float32 CPU pool of their dtype, in
    one call (a torch scatter is a handful of ops and a host sync for the skipped slots); False,
    with nothing written, where the kernel does not take them (the caller's torch path does)."""
    if not (
        key.is_cpu
        and key.dtype == value.dtype == key_cache.dtype == value_cache.dtype
        and key.dtype in _DTYPES
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and key.stride(2) == value.stride(2) == 1
        and key.stride(1) == value.stride(1) == key.shape[2]
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and _built(enabled())
    ):
        return False
    num_blocks, block_size, kvh, d = key_cache.shape
    size = key.element_size()
    status = library().pagefleet_write_kv(
        key.data_ptr(),
        key.stride(0) * size,
        value.data_ptr(),
        value.stride(0) * size,
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        num_blocks * block_size,
        slot_mapping.data_ptr(),
        slot_mapping.shape[0],
        kvh * d * size,
    )
    if status != 0:
        raise IndexError(f"a KV slot lies past the pool's {num_blocks * block_size} slots")
    return True


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x (T, heads, d) bfloat16 on CPU rotated by cos and the signed sin (T, 1, d) as
    worker/model/layers/rotary.py's `apply_rotary` computes it, rounding for rounding, in one
    call: a new (T, heads, d) tensor; None where the kernel does not take them."""
    if not (
        x.is_cpu
        and x.dtype == cos.dtype == sin.dtype == torch.bfloat16
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.shape[0] == sin.shape[0] == x.shape[0]
        and cos.shape[-1] == sin.shape[-1] == x.shape[2]
        and x.shape[2] % 2 == 0
        and _built(enabled())
    ):
        return None
    tokens, heads, d = x.shape
    out = torch.empty(tokens, heads, d, dtype=x.dtype)
    library().pagefleet_rotary(
        x.data_ptr(), x.stride(0), tokens, heads, d, cos.data_ptr(), sin.data_ptr(), out.data_ptr()
    )
    return out
