"""The CPU backend's native kernels (`kernels.c`), compiled once per machine with
its C compiler, and the functions that call them on torch tensors.

PyTorch on a CPU has no fused paged attention: the plain path copies every context out
of the cache (`index_select`) before it attends, and at decode sizes its small operators
(a norm is six) cost more in dispatch than in arithmetic (docs/cpu.md). The C file is
the Triton kernels' attention in a loop nest, the element-wise chains fused, sampling
and the linear layers' matmul. It is built with `$CC` (default `cc`) into
~/.cache/nanopaged the first time a process needs it (a few seconds). Its kernels run
on `threads()` threads of its own (a pool in the C file), not on the OpenMP runtime
torch has loaded: how they wait between kernels is the engine's choice, and the
program's OpenMP settings stay the program's. Where it cannot be built (no compiler:
said once), each function here returns None or runs the plain PyTorch code.
"""

import contextvars
import ctypes
import functools
import hashlib
import logging
import math
import os
import subprocess
import tempfile

import torch

from nanopaged.core import layers

SOURCE = os.path.join(os.path.dirname(__file__), "kernels.c")
CACHE_DIR = os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "nanopaged"
)
FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-shared", "-fPIC", "-pthread"]
# `#pragma omp simd` vectorizes the file's reductions; no OpenMP runtime is linked (the
# library's threads are its own): a compiler without the flag builds it without them
SIMD_FLAG = "-fopenmp-simd"
# the cache dtypes paged_attention reads (the C file's kv_kind)
KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
SIGNATURES = {  # the C functions: (return type, argument types)
    "paged_attention": (
        _I,
        [_P, _L, _P, _P, _I, _P, _P, _L, _P, _P] + [_I] * 5 + [_F, _I, _P, _I],
    ),
    "prefill_attention": (
        _I,
        [_P, _L, _P, _P, _I, _P, _P, _L, _P, _P] + [_I] * 5 + [_F, _I, _P, _I],
    ),
    "rms_norm": (None, [_P, _L, _I, _P, _P, _L, _I, _F, _P, _P, _I]),
    "rotary": (None, [_P, _L, _I, _I, _I, _P, _P, _P, _I]),
    "silu_and_mul": (None, [_P, _L, _I, _P, _I]),
    "store_kv": (None, [_P, _L, _P, _L, _L, _L, _P, _P, _P, _I]),
    "sample": (None, [_P, _P, _P, _L, _I, _P, _I]),
    "panel_matmul": (None, [_P, _L, _P, _L, _I, _L, _P, _I]),
    "cores_shared": (_I, []),
}
PANEL = 16  # output features in a panel of a packed weight (the C file's PANEL)
# the kernels' outputs: float32 like their inputs, contiguous (empty_like: 1-3 us less a
# call than torch.empty(shape, dtype=), at ~60 calls a decode step)
CONTIGUOUS = torch.contiguous_format
logger = logging.getLogger(__name__)
# the steps of the forward a step graph is capturing, if any (step_graph.py)
CAPTURE: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "capture", default=None
)


@functools.cache
def usable_cores() -> int:
    """The cores this process may run on: its affinity mask, capped by a cgroup CPU
    quota."""
    cores = (
        len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count()
    )
    for path, scale in (
        ("/sys/fs/cgroup/cpu.max", None),  # cgroup v2: "quota period"
        ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "cpu.cfs_period_us"),
    ):
        try:
            with open(path) as f:
                quota, *period = f.read().split()
            if scale:
                with open(os.path.join(os.path.dirname(path), scale)) as f:
                    period = [f.read()]
        except OSError:
            continue
        if quota not in ("max", "-1"):
            cores = min(cores, max(1, math.ceil(int(quota) / int(period[0]))))
        break
    return max(1, cores or 1)


def threads() -> int:
    """The threads a kernel runs on: torch's count, the program's choice (its
    `torch.set_num_threads`, `OMP_NUM_THREADS`), but never more than the cores this
    process may use (torch counts the machine's, which a container may not have)."""
    return min(torch.get_num_threads(), usable_cores())


@functools.cache
def _target(compiler: str) -> str:
    """What `compiler -march=native` targets here, as its predefined macros (the
    instruction sets: __AVX2__, __ARM_FEATURE_SVE...) and its version: a library built
    for another CPU, or by another compiler, gets another key, on every platform."""
    said = []
    for flags in (["-march=native", "-dM", "-E", "-x", "c", "-"], ["--version"]):
        try:
            answer = subprocess.run(
                [compiler, *flags], input=b"", capture_output=True, timeout=60
            )
            said.append(answer.stdout)
        except (OSError, subprocess.SubprocessError):
            said.append(b"")
    return b"\0".join([b"\n".join(sorted(said[0].splitlines())), said[1]]).decode(
        errors="replace"
    )


def _compile(compiler: str, path: str) -> None:
    """Builds the library at `path` (with `SIMD_FLAG` where the compiler has it).
    Raises OSError with what the compiler said."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        for flags in (FLAGS + [SIMD_FLAG], FLAGS):
            try:
                subprocess.run(
                    [compiler, *flags, SOURCE, "-o", tmp, "-lm"],
                    check=True,
                    capture_output=True,
                    timeout=120,
                )
                # atomic: a concurrent process sees all the file or none
                os.replace(tmp, path)
                return
            except (OSError, subprocess.SubprocessError) as e:
                said = (getattr(e, "stderr", b"") or b"").decode(errors="replace")[
                    -300:
                ]
                error = OSError(f"{e} {said}".strip())
        raise error
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library_path() -> str:
    """Where the library built from this source, by this compiler, for this CPU lies."""
    with open(SOURCE, "rb") as f:
        source = f.read()
    compiler = os.environ.get("CC", "cc")
    parts = [source, " ".join([compiler, *FLAGS]).encode(), _target(compiler).encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return os.path.join(CACHE_DIR, f"cpu_kernels-{key}.so")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use (said in the log, as it takes a
    while); None where they cannot be built or loaded (a missing compiler, a read-only
    or noexec cache folder): said once, in the log."""
    path = library_path()
    try:
        if not os.path.exists(path):
            os.makedirs(CACHE_DIR, exist_ok=True)
            # the first engine on a machine waits for it: said, not silent
            logger.warning(
                "nanopaged: building the CPU backend's C kernels for this CPU, once "
                "(about 10 s; kept in %s)",
                CACHE_DIR,
            )
            _compile(os.environ.get("CC", "cc"), path)
        lib = ctypes.CDLL(path)
    except OSError as error:
        logger.warning(
            "nanopaged: the CPU backend's C kernels could not be built or loaded "
            "(%s); it runs PyTorch's operators instead, slower",
            error,
        )
        return None
    for name, (restype, argtypes) in SIGNATURES.items():
        getattr(lib, name).restype = restype
        getattr(lib, name).argtypes = argtypes
    return lib


def run(kernel, *args):
    """kernel(*args), and recorded while a step graph captures (its last argument, as
    every kernel's, the thread count)."""
    steps = CAPTURE.get()
    if steps is not None:
        steps.append((kernel, args))
    return kernel(*args)


@functools.cache
def _fp8_table() -> torch.Tensor:
    """Each FP8 (e4m3) byte's value, as torch converts it."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _heads(x: torch.Tensor) -> torch.Tensor:
    """x (T, heads, n) with each token's heads contiguous (its tokens any stride
    apart)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    scale: float,
    window: int | None,
    tiled: bool = False,
) -> torch.Tensor | None:
    """q: (T, nh, hs), the queries of each sequence its last tokens (`cu_seqlens_q`;
    None: one each) -> (T, nh, hs) attended over its cached context (or its last
    `window` positions); None where the kernel does not apply (no library, a cache dtype
    or shape it does not read). `tiled`: by the C file's `prefill_attention` (matrix
    products: for many queries a sequence), else a query at a time."""
    lib, kind = library(), KV_KINDS.get(k_cache.dtype)
    if (
        lib is None
        or kind is None
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        return None
    queries = _heads(q.float())
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    cu = None if cu_seqlens_q is None else cu_seqlens_q.to(torch.int32).contiguous()
    out = torch.empty_like(queries, memory_format=CONTIGUOUS)
    failed = run(
        lib.prefill_attention if tiled else lib.paged_attention,
        queries.data_ptr(),
        queries.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        kind,
        _fp8_table().data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        None if cu is None else cu.data_ptr(),
        context_lens.data_ptr(),
        len(context_lens),
        q.shape[1],
        k_cache.shape[2],
        q.shape[2],
        k_cache.shape[1],
        scale,
        window or 0,
        out.data_ptr(),
        threads(),
    )
    return None if failed else out.to(q.dtype)


def _float32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`layers.rms_norm`; x (..., n), or (T, heads, n) as a fused projection's view."""
    if not _float32(x, weight):
        return layers.rms_norm(x, weight, eps)
    rows = x if x.dim() == 3 else x.reshape(-1, 1, x.shape[-1])
    rows = _heads(rows)
    out = torch.empty_like(x, memory_format=CONTIGUOUS)
    run(
        library().rms_norm,
        rows.data_ptr(),
        rows.stride(0),
        rows.shape[1],
        None,
        weight.contiguous().data_ptr(),
        rows.shape[0] * rows.shape[1],
        x.shape[-1],
        eps,
        out.data_ptr(),
        None,
        threads(),
    )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`layers.add_rms_norm`: (norm(x + residual), x + residual)."""
    if not _float32(x, residual, weight):
        return layers.add_rms_norm(x, residual, weight, eps)
    x, residual = x.contiguous(), residual.contiguous()
    out = torch.empty_like(x, memory_format=CONTIGUOUS)
    total = torch.empty_like(x, memory_format=CONTIGUOUS)
    n = x.shape[-1]
    run(
        library().rms_norm,
        x.data_ptr(),
        n,
        1,
        residual.data_ptr(),
        weight.contiguous().data_ptr(),
        x.numel() // n,
        n,
        eps,
        out.data_ptr(),
        total.data_ptr(),
        threads(),
    )
    return out, total


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`layers.apply_rotary`: q (T, nh, hs) and k (T, nkv, hs) rotated at
    `positions`."""
    if not _float32(q, k, cos_sin):
        return layers.apply_rotary(q, k, positions, cos_sin)
    positions, cos_sin = positions.to(torch.int64).contiguous(), cos_sin.contiguous()
    rotated = []
    for x in (_heads(q), _heads(k)):
        out = torch.empty_like(x, memory_format=CONTIGUOUS)
        run(
            library().rotary,
            x.data_ptr(),
            x.stride(0),
            x.shape[0],
            x.shape[1],
            x.shape[2],
            positions.data_ptr(),
            cos_sin.data_ptr(),
            out.data_ptr(),
            threads(),
        )
        rotated.append(out)
    return rotated[0], rotated[1]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`layers.silu_and_mul`: (..., 2n) -> (..., n)."""
    if not _float32(gate_up):
        return layers.silu_and_mul(gate_up)
    gate_up = gate_up.contiguous()
    n = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], n, dtype=torch.float32)
    run(
        library().silu_and_mul,
        gate_up.data_ptr(),
        gate_up.numel() // (2 * n),
        n,
        out.data_ptr(),
        threads(),
    )
    return out


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> bool:
    """k, v (T, nkv, hs), converted to the cache's dtype, into their slots (below 0:
    none); False where the kernel does not apply (no library, a cache not
    contiguous)."""
    if library() is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    k, v = _heads(k.to(k_cache.dtype)), _heads(v.to(v_cache.dtype))
    slots, size = slots.to(torch.int64).contiguous(), k_cache.element_size()
    run(
        library().store_kv,
        k.data_ptr(),
        k.stride(0) * size,
        v.data_ptr(),
        v.stride(0) * size,
        k.shape[0],
        k.shape[1] * k.shape[2] * size,
        slots.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        threads(),
    )
    return True


def sample(
    logits: torch.Tensor, temperatures: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor | None:
    """`sampler.sample` for logits (R, V) (see the C file's `sample`); None without the
    library."""
    if library() is None:
        return None
    logits = logits.float().contiguous()
    temperatures, uniform = (
        temperatures.float().contiguous(),
        uniform.float().contiguous(),
    )
    tokens = torch.empty(len(logits), dtype=torch.int64)
    library().sample(
        logits.data_ptr(),
        temperatures.data_ptr(),
        uniform.data_ptr(),
        len(logits),
        logits.shape[1],
        tokens.data_ptr(),
        threads(),
    )
    return tokens


def pack_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """weight (N, K) as `panel_matmul` reads it, (N / PANEL, K, PANEL); None where it
    does not apply (no library, not float32, N not a multiple of PANEL)."""
    n, k = weight.shape
    if library() is None or weight.dtype != torch.float32 or n % PANEL:
        return None
    return weight.detach().view(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def panel_matmul(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    """x (..., K) times the weight `panels` packs: (..., N), as F.linear(x, weight)."""
    flat = x.dim() == 2  # a step's rows: no reshape (microseconds, at 17 calls a step)
    rows = x if flat else x.reshape(-1, x.shape[-1])
    if rows.dtype != torch.float32 or rows.stride(-1) != 1:
        rows = rows.float().contiguous()
    (m, k), n = rows.shape, panels.shape[0] * PANEL
    out = torch.empty((m, n), dtype=torch.float32)
    run(
        library().panel_matmul,
        rows.data_ptr(),
        rows.stride(0),
        panels.data_ptr(),
        m,
        k,
        n,
        out.data_ptr(),
        threads(),
    )
    return out if flat else out.view(*x.shape[:-1], n)


# The core's element-wise functions (fields of `layers.Kernels`) by this file's kernels
ELEMENTWISE = {
    "rms_norm": rms_norm,
    "add_rms_norm": add_rms_norm,
    "rotary": apply_rotary,
    "silu_and_mul": silu_and_mul,
}
