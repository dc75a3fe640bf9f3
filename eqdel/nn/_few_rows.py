"""Products of a few rows with a weight on CPU, a decode step's attention on its cache
as stored, float32 products of many rows through OpenBLAS and the lookup of a bfloat16
embedding table, by the kernels of `few_rows.cc` (the same library holds `adamw.cc`'s
optimizer step, see `eqdel.train.AdamW`).

A decode step multiplies one row per sequence by every weight. XLA's CPU backend reads
a 16-bit or quantized weight there only as a float32 copy it makes once, before the
decode loop, so bfloat16, int8 and 4-bit models decode no faster than float32. The
kernels read each weight as stored and convert in registers (bfloat16 weights, on a CPU
with AVX-512 BF16, are multiplied as stored, two inputs per instruction). They are opt-in
(`EQDEL_CPU_KERNELS=1`): compiled on first use with the system's C++ compiler into
eqdel's cache folder; without the variable, or without a compiler, every product stays
with XLA. Products of more float32 rows (prefill, a training step's forward pass) run
through OpenBLAS's single-threaded kernels on XLA's threads where the `scipy-openblas32`
package is installed (`pip install "eqdel[cpu]"`): on a transformer's shapes they reach
more of the CPU's float32 peak than XLA's own.
"""

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, BFloat16, Bool, Float, Int, Int8, UInt8

MAX_ROWS = 16
"""The most rows a product may have to run through a kernel."""

_FOLDER = Path(__file__).parent
_SOURCES = ("kernels.h", "few_rows.cc", "adamw.cc")
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-fno-math-errno", "-shared", "-fPIC", "-w")
_TARGETS = {
    "eqdel_few_rows_f32": "EqdelFewRowsF32",
    "eqdel_few_rows_bf16": "EqdelFewRowsBF16",
    "eqdel_few_rows_int8": "EqdelFewRowsInt8",
    "eqdel_few_rows_int8_transposed": "EqdelFewRowsInt8Transposed",
    "eqdel_few_rows_int4": "EqdelFewRowsInt4",
    "eqdel_few_rows_nf4": "EqdelFewRowsNF4",
    "eqdel_attention": "EqdelAttention",
    "eqdel_gemm": "EqdelGemm",
    "eqdel_gather_bf16": "EqdelGatherBF16",
    "eqdel_adamw_f32": "EqdelAdamWF32",
    "eqdel_adamw_bf16": "EqdelAdamWBF16",
}

PRODUCT_NAME = "eqdel_product"
"""The name (`jax.ad_checkpoint.checkpoint_name`) of the outputs of the products that the
dots remat policies do not recognise as products (custom calls, products with a custom
gradient), so that the policies that save matrix products save these too."""


def _compiled(compiler: str) -> Path:
    """The kernels' shared library, compiled once per set of sources, compiler flags,
    jaxlib and host, and written in place atomically."""
    from .._smollm2 import cache_dir

    include = jax.ffi.include_dir()
    key = hashlib.sha256()
    for source in _SOURCES:
        key.update((_FOLDER / source).read_bytes())
    key.update(" ".join(_FLAGS).encode())
    key.update(include.encode())
    key.update(f"{jax.__version__} {platform.uname()}".encode())
    target = cache_dir() / "kernels" / f"few_rows-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            sources = [str(_FOLDER / name) for name in _SOURCES if name.endswith(".cc")]
            command = [compiler, *_FLAGS, f"-I{include}", *sources, "-o", str(built)]
            subprocess.run(command, check=True, capture_output=True, text=True)
            os.replace(built, target)
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The kernels' library, compiled and its kernels registered with XLA's CPU backend
    once per process; `None` when not asked for, or after warning once that it cannot
    be built."""
    if os.environ.get("EQDEL_CPU_KERNELS") != "1" or jax.default_backend() != "cpu":
        return None
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    try:
        if compiler is None:
            raise OSError("no C++ compiler found (set CXX)")
        library = ctypes.cdll.LoadLibrary(str(_compiled(compiler)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", None) or error
        message = f"eqdel's CPU kernels are unavailable, XLA runs every product: {detail}"
        warnings.warn(message, stacklevel=3)
        return None
    for name, symbol in _TARGETS.items():
        jax.ffi.register_ffi_target(
            name, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu"
        )
    return library


def available() -> bool:
    """Whether the kernels are asked for (`EQDEL_CPU_KERNELS=1`), compiled and registered
    with XLA's CPU backend (once per process; a failure warns once and leaves every
    product with XLA)."""
    return _library() is not None


@functools.cache
def gemm_available() -> bool:
    """Whether float32 products of many rows may run through OpenBLAS: the kernels are
    available and the `scipy-openblas32` package is installed. Its library is loaded
    once, kept to one thread (XLA's threads each run a block of a product), and handed
    to the kernels."""
    library = _library()
    if library is None:
        return False
    try:
        import scipy_openblas32
    except ImportError:
        return False
    name = f"lib{scipy_openblas32.get_library()}"
    found = sorted(Path(scipy_openblas32.get_lib_dir()).glob(f"{name}.*"))
    shared = [path for path in found if path.suffix in (".so", ".dylib", ".dll")]
    if not shared:
        return False
    blas = ctypes.CDLL(str(shared[0]))
    blas.scipy_openblas_set_num_threads(1)
    sgemm = ctypes.cast(blas.scipy_cblas_sgemm, ctypes.c_void_p)
    library.eqdel_set_sgemm(sgemm)
    return True


def usable(rows: Array, weight: Array) -> bool:
    """Whether `rows @ weight` may run through a kernel: a 2-D weight, float32 rows, at
    most `MAX_ROWS` of them, and compiled kernels."""
    return (
        rows.ndim == 2
        and 1 <= rows.shape[0] <= MAX_ROWS
        and rows.dtype == jnp.float32
        and weight.ndim == 2
        and available()
    )


def gemm_usable(rows: Array, weight: Array) -> bool:
    """Whether `rows @ weight` runs through OpenBLAS: more than `MAX_ROWS` float32 rows,
    a 2-D float32 weight, and OpenBLAS available (`gemm_available`)."""
    return (
        rows.ndim == 2
        and rows.shape[0] > MAX_ROWS
        and rows.dtype == weight.dtype == jnp.float32
        and weight.ndim == 2
        and gemm_available()
    )


def batched_gemm_usable(a: Array, b: Array) -> bool:
    """Whether a product of two float32 batches of matrices (any leading dimensions) runs
    through OpenBLAS where it is not differentiated (`batched_gemm`)."""
    return a.ndim == b.ndim >= 3 and a.dtype == b.dtype == jnp.float32 and gemm_available()


def _ffi(target: str, shape: tuple[int, ...], *operands, dtype=jnp.float32, **attributes) -> Array:
    """Kernel `target`'s result of `shape` and `dtype`; float attributes pass as float32,
    the others as int64."""
    if not available():
        raise RuntimeError("eqdel's CPU kernels are not available here; see `usable`.")
    result = jax.ShapeDtypeStruct(shape, dtype)
    attributes = {
        name: np.float32(value) if isinstance(value, float) else np.int64(value)
        for name, value in attributes.items()
    }
    call = jax.ffi.ffi_call(target, result, vmap_method="sequential")
    return call(*operands, **attributes)


def _call(target: str, rows: Array, out_features: int, *operands, **attributes) -> Array:
    return _ffi(target, (rows.shape[0], out_features), rows, *operands, **attributes)


def _with_reference_gradient(kernel, reference, *, kernel_when_differentiated: bool = True):
    """`kernel`, differentiated as `reference` (the same product written in XLA); under
    differentiation its forward pass is `reference` too unless `kernel_when_differentiated`."""

    @jax.custom_vjp
    def product(*operands):
        return kernel(*operands)

    def forward(*operands):
        return (kernel if kernel_when_differentiated else reference)(*operands), operands

    def backward(operands, grad):
        return jax.vjp(reference, *operands)[1](grad)

    product.defvjp(forward, backward)
    return product


def dense(
    rows: Float[Array, "rows in_features"],
    weight: Float[Array, "in_features out_features"] | Float[Array, "out_features in_features"],
    transposed: bool,
    reference,
) -> Float[Array, "rows out_features"]:
    """`rows @ weight` (`rows @ weight.T` when `transposed`) for a float32 or bfloat16
    weight, accumulated and returned in float32 (the kernel rounds the rows to bfloat16
    first for a bfloat16 weight), differentiated as `reference(rows, weight)`."""

    def kernel(rows, weight):
        bfloat16 = weight.dtype == jnp.bfloat16
        target = "eqdel_few_rows_bf16" if bfloat16 else "eqdel_few_rows_f32"
        out_features = weight.shape[0 if transposed else 1]
        return _call(target, rows, out_features, weight, transposed=transposed)

    return _with_reference_gradient(kernel, reference)(rows, weight)


def int8(
    rows: Float[Array, "rows in_features"],
    codes: Int8[Array, "in_features out_features"],
    scales: Float[Array, " out_features"] | Float[Array, "groups out_features"],
    group_size: int | None,
    reference,
) -> Float[Array, "rows out_features"]:
    """`rows @ (codes * scales)`, with one scale per output (`group_size` `None`) or per
    `group_size` inputs of an output, differentiated as `reference(rows, codes, scales)`."""

    def kernel(rows, codes, scales):
        scales = scales.astype(jnp.float32)
        target = "eqdel_few_rows_int8"
        return _call(target, rows, codes.shape[1], codes, scales, group=group_size or 0)

    return _with_reference_gradient(kernel, reference)(rows, codes, scales)


def int8_transposed(
    rows: Float[Array, "rows in_features"],
    codes: Int8[Array, "out_features in_features"],
    scales: Float[Array, "out_features groups"],
    group_size: int,
    reference,
) -> Float[Array, "rows out_features"]:
    """`rows @ weight.T` for the `[out, in]` weight `codes * scale`, one scale per
    `group_size` consecutive inputs of an output (an `Int8Embedding` as a tied head),
    differentiated as `reference(rows, codes, scales)`."""

    def kernel(rows, codes, scales):
        scales = scales.astype(jnp.float32)
        target = "eqdel_few_rows_int8_transposed"
        return _call(target, rows, codes.shape[0], codes, scales, group=group_size)

    return _with_reference_gradient(kernel, reference)(rows, codes, scales)


def gemm(
    rows: Float[Array, "rows in_features"],
    weight: Float[Array, "in_features out_features"] | Float[Array, "out_features in_features"],
    transposed: bool,
) -> Float[Array, "rows out_features"]:
    """`rows @ weight` (`rows @ weight.T` when `transposed`) in float32 through OpenBLAS,
    differentiated as XLA's product, the output named `PRODUCT_NAME` for the remat
    policies."""

    def kernel(rows, weight):
        out_features = weight.shape[0 if transposed else 1]
        return _call("eqdel_gemm", rows, out_features, weight, transposed=transposed)

    def reference(rows, weight):
        return rows @ (weight.T if transposed else weight)

    product = _with_reference_gradient(kernel, reference)
    return checkpoint_name(product(rows, weight), PRODUCT_NAME)


def batched_gemm(
    a: Float[Array, "*batch rows depth"],
    b: Float[Array, "*batch depth columns"] | Float[Array, "*batch columns depth"],
    transpose_b: bool,
    reference,
) -> Float[Array, "*batch rows columns"]:
    """`a @ b` (`a @ bᵀ` when `transpose_b`) for each matrix of the leading dimensions, in
    float32 through OpenBLAS where it is not differentiated; under differentiation,
    forward and gradient are `reference(a, b)`, the same product in XLA (with
    OpenBLAS's forward, attention's backward pass ran slower)."""

    def kernel(a, b):
        columns = b.shape[-2 if transpose_b else -1]
        flat = _ffi(
            "eqdel_gemm",
            (math.prod(a.shape[:-2]), a.shape[-2], columns),
            a.reshape(-1, *a.shape[-2:]),
            b.reshape(-1, *b.shape[-2:]),
            transposed=transpose_b,
        )
        return flat.reshape(*a.shape[:-1], columns)

    product = _with_reference_gradient(kernel, reference, kernel_when_differentiated=False)
    return product(a, b)


def _padded(rows: Array, columns: int) -> Array:
    return jnp.pad(rows, [(0, 0), (0, columns - rows.shape[1])])


def int4(
    rows: Float[Array, "rows in_features"],
    codes: UInt8[Array, "packed out_features"],
    scales: Float[Array, "groups out_features"],
    offsets: Float[Array, "groups out_features"],
    group_size: int,
    reference,
) -> Float[Array, "rows out_features"]:
    """The product with an `Int4Linear`'s weight, differentiated as `reference`."""

    def kernel(rows, codes, scales, offsets):
        return _call(
            "eqdel_few_rows_int4",
            _padded(rows, 2 * codes.shape[0]),
            codes.shape[1],
            codes,
            scales.astype(jnp.float32),
            offsets.astype(jnp.float32),
            group=group_size,
        )

    return _with_reference_gradient(kernel, reference)(rows, codes, scales, offsets)


def nf4(
    rows: Float[Array, "rows in_features"],
    codes: UInt8[Array, "half_in out_features"],
    scales: Float[Array, "groups out_features"],
    levels: Float[Array, "16"],
    group_size: int,
    reference,
) -> Float[Array, "rows out_features"]:
    """The product with an `NF4Linear`'s weight (`levels` its 16 values),
    differentiated as `reference(rows, codes, scales)`."""

    def kernel(rows, codes, scales):
        return _call(
            "eqdel_few_rows_nf4",
            _padded(rows, 2 * codes.shape[0]),
            codes.shape[1],
            codes,
            scales.astype(jnp.float32),
            levels,
            group=group_size,
        )

    return _with_reference_gradient(kernel, reference)(rows, codes, scales)


ATTENTION_TOKENS = 4
"""The most query tokens per sequence an attention call may have to run through the
kernel (a decode step has one)."""


def gather_usable(table: Array) -> bool:
    """Whether rows of `table` may be looked up by the kernel: a 2-D bfloat16 table and
    compiled kernels."""
    return table.ndim == 2 and table.dtype == jnp.bfloat16 and available()


def gather(
    table: BFloat16[Array, "vocab dim"], ids: Int[Array, "*ids"]
) -> BFloat16[Array, "*ids dim"]:
    """`jnp.take(table, ids, axis=0)` for a bfloat16 table, copied as stored by a kernel
    where it is not differentiated (in a decode loop XLA's gather converted the whole
    table to float32 once per call); under differentiation, XLA's gather."""

    def reference(table, ids):
        return jnp.take(table, ids, axis=0)

    def kernel(table, ids):
        flat = ids.reshape(-1).astype(jnp.int32)
        shape = (flat.shape[0], table.shape[1])
        rows = _ffi("eqdel_gather_bf16", shape, table, flat, dtype=table.dtype)
        return rows.reshape(*ids.shape, table.shape[1])

    return _with_reference_gradient(kernel, reference, kernel_when_differentiated=False)(
        table, ids
    )


def attention_usable(query: Array, key: Array, soft_cap: float | None) -> bool:
    """Whether attention of `query` over `key` may run through the kernel: float32
    queries of at most `ATTENTION_TOKENS` tokens, a float32 cache (with a bfloat16 cache
    the kernel was slower than XLA), no soft cap, and compiled kernels."""
    return (
        query.ndim == 4
        and query.shape[1] <= ATTENTION_TOKENS
        and query.dtype == key.dtype == jnp.float32
        and soft_cap is None
        and available()
    )


def attention(
    query: Float[Array, "batch q_len heads head_dim"],
    key: Float[Array, "batch kv_len kv_heads head_dim"],
    value: Float[Array, "batch kv_len kv_heads head_dim"],
    allowed: Bool[Array, "batch q_len kv_len"],
    scale: float,
    masked: float,
    reference,
) -> Float[Array, "batch q_len heads head_dim"]:
    """Grouped-query attention on a float32 cache as stored: masked scores become
    `masked`, softmax in float32, differentiated as `reference(query, key, value)`."""

    def kernel(query, key, value):
        operands = (query, allowed, key, value)
        attributes = dict(scale=float(scale), masked=float(masked))
        return _ffi("eqdel_attention", query.shape, *operands, **attributes)

    return _with_reference_gradient(kernel, reference)(query, key, value)
