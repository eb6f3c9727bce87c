"""The CPU backend (nanopaged/cpu/, its C kernels in kernels.c) against the
plain-PyTorch reference: its attention, fused element-wise functions and sampling, its
packed linear layers, how the kernels are built, and the process settings it makes."""

import ctypes
import itertools
import math
import mmap
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from conftest import HEAD_DIM, metadata, paged_cache, random_prompts, relative_error

from nanopaged import LLM, SamplingParams, cpu
from nanopaged.core import layers, sampler
from nanopaged.core.attention import (
    BACKENDS,
    TORCH,
    decode_torch,
    prefill_torch,
    store_kvcache_torch,
)
from nanopaged.core.layers import LinearMethod
from nanopaged.cpu import kernels as cpu_kernels

CONTEXT_LENS = [1, 17, 300, 64, 129, 130, 31]
KV_DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn]


@pytest.fixture
def no_library(monkeypatch):
    """The process as on a machine without a C compiler."""
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)


def test_the_kernels_build_here():
    """CI has a C compiler: every kernel test below runs the C code, not the
    fallback."""
    assert cpu_kernels.library() is not None


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 5, 100])
def test_decode_matches_the_reference(
    kv_dtype, block_size, num_heads, num_kv_heads, window
):
    k_cache, v_cache, tables = paged_cache(
        block_size, CONTEXT_LENS, num_kv_heads, seed=block_size
    )
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    q = torch.randn(len(CONTEXT_LENS), num_heads, HEAD_DIM)
    meta = metadata(CONTEXT_LENS, tables)
    out = cpu_kernels.paged_attention(
        q, k_cache, v_cache, tables, meta.context_lens, None, 0.25, window
    )
    assert (
        relative_error(out, decode_torch(q, k_cache, v_cache, meta, 0.25, window))
        < 1e-6
    )
    assert torch.equal(cpu.decode(q, k_cache, v_cache, meta, 0.25, window), out)


# the kernel's two unrolled sizes, another
@pytest.mark.parametrize("head_dim", [64, 128, 24])
def test_decode_matches_the_reference_at_each_head_size(head_dim):
    _, _, tables = paged_cache(16, CONTEXT_LENS, 2, seed=head_dim)
    k_cache, v_cache = torch.randn(2, int(tables.max()) + 1, 16, 2, head_dim).unbind(0)
    q = torch.randn(len(CONTEXT_LENS), 4, head_dim)
    meta = metadata(CONTEXT_LENS, tables)
    out = cpu_kernels.paged_attention(
        q, k_cache, v_cache, tables, meta.context_lens, None, head_dim**-0.5, 50
    )
    expected = decode_torch(q, k_cache, v_cache, meta, head_dim**-0.5, 50)
    assert relative_error(out, expected) < 1e-6


def test_bfloat16_queries_come_back_in_bfloat16():
    k_cache, v_cache, tables = paged_cache(16, CONTEXT_LENS, 2, seed=5)
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    q = torch.randn(len(CONTEXT_LENS), 4, HEAD_DIM).bfloat16()
    meta = metadata(CONTEXT_LENS, tables)
    out = cpu.decode(q, k_cache, v_cache, meta, 0.25)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, decode_torch(q, k_cache, v_cache, meta, 0.25)) < 1e-2


def test_shapes_over_the_kernels_limits_take_the_reference(monkeypatch):
    """65 query heads (the C file's MAX_HEADS is 64): the kernel declines, decode still
    answers."""
    k_cache, v_cache, tables = paged_cache(16, [20, 3], 1, seed=6)
    q = torch.randn(2, 65, HEAD_DIM)
    meta = metadata([20, 3], tables)
    assert (
        cpu_kernels.paged_attention(
            q, k_cache, v_cache, tables, meta.context_lens, None, 0.25, None
        )
        is None
    )
    assert torch.equal(
        cpu.decode(q, k_cache, v_cache, meta, 0.25),
        decode_torch(q, k_cache, v_cache, meta, 0.25),
    )


def test_without_a_compiler_decode_is_the_reference(no_library):
    k_cache, v_cache, tables = paged_cache(16, CONTEXT_LENS, 2, seed=2)
    meta = metadata(CONTEXT_LENS, tables)
    q = torch.randn(len(CONTEXT_LENS), 4, HEAD_DIM)
    assert torch.equal(
        cpu.decode(q, k_cache, v_cache, meta, 0.25),
        decode_torch(q, k_cache, v_cache, meta, 0.25),
    )


# (new query tokens, whole context): fresh prompts, prefix hits, a chunk, one token
PREFILLS = {
    "many": [(40, 40), (7, 39), (33, 290), (1, 18), (16, 16)],
    "few": [(16, 16), (7, 39), (3, 290), (1, 18), (16, 100)],
}


@pytest.mark.parametrize("queries", ["many", "few"])
@pytest.mark.parametrize("window", [None, 3, 32])
def test_prefill_matches_the_reference_with_cached_prefixes(
    queries, window, monkeypatch
):
    """At most KERNEL_QUERIES a sequence: the C kernel a query at a time (which `few`
    must reach); more: in tiles of matrix products."""
    shapes = PREFILLS[queries]
    context_lens = [c for _, c in shapes]
    k_cache, v_cache, tables = paged_cache(16, context_lens, 2, seed=7)
    q_lens = [n for n, _ in shapes]
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), 4, HEAD_DIM)
    meta = metadata(context_lens, tables, cu_seqlens_q=cu, max_seqlen_q=max(q_lens))
    tiled = []
    kernel = cpu_kernels.paged_attention
    monkeypatch.setattr(
        cpu_kernels,
        "paged_attention",
        lambda *a, **k: tiled.append(k["tiled"]) or kernel(*a, **k),
    )
    out = cpu.prefill(q, k_cache, v_cache, meta, 0.25, window)
    assert (
        relative_error(out, prefill_torch(q, k_cache, v_cache, meta, 0.25, window))
        < 1e-6
    )
    assert tiled == [max(q_lens) > cpu.KERNEL_QUERIES] == [queries == "many"]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (8, 1), (2, 1)])
@pytest.mark.parametrize("window", [None, 5, 100])
def test_tiled_prefill_matches_the_reference(
    kv_dtype, block_size, num_heads, num_kv_heads, window
):
    """Tiles of 16 (token, head) rows: a sequence's last tile part empty, tiles across
    tokens, blocks part masked (causal, window) or not at all, prompts with a cached
    prefix."""
    shapes = [(40, 40), (7, 39), (33, 290), (1, 18), (17, 17), (130, 200)]
    context_lens = [c for _, c in shapes]
    k_cache, v_cache, tables = paged_cache(
        block_size, context_lens, num_kv_heads, seed=3
    )
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    q_lens = [n for n, _ in shapes]
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), num_heads, HEAD_DIM)
    meta = metadata(context_lens, tables, cu_seqlens_q=cu, max_seqlen_q=max(q_lens))
    out = cpu_kernels.paged_attention(
        q, k_cache, v_cache, tables, meta.context_lens, cu, 0.25, window, tiled=True
    )
    assert (
        relative_error(out, prefill_torch(q, k_cache, v_cache, meta, 0.25, window))
        < 1e-6
    )


# 24: not whole panels of 16, the reference
@pytest.mark.parametrize("head_dim", [64, 128, 24])
def test_tiled_prefill_at_each_head_size(head_dim):
    shapes = [(40, 40), (33, 290)]
    _, _, tables = paged_cache(16, [c for _, c in shapes], 2, seed=head_dim)
    k_cache, v_cache = torch.randn(2, int(tables.max()) + 1, 16, 2, head_dim).unbind(0)
    cu = torch.tensor([0, 40, 73], dtype=torch.int32)
    q = torch.randn(73, 4, head_dim)
    meta = metadata([40, 290], tables, cu_seqlens_q=cu, max_seqlen_q=40)
    expected = prefill_torch(q, k_cache, v_cache, meta, head_dim**-0.5, 50)
    out = cpu_kernels.paged_attention(
        q,
        k_cache,
        v_cache,
        tables,
        meta.context_lens,
        cu,
        head_dim**-0.5,
        50,
        tiled=True,
    )
    assert (out is None) == (head_dim % 16 != 0)
    assert (
        relative_error(
            cpu.prefill(q, k_cache, v_cache, meta, head_dim**-0.5, 50), expected
        )
        < 1e-6
    )


def elementwise_cases() -> list:
    """(kernel, the core's function it replaces, float32 arguments)."""
    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, 7, 96, generator=g), torch.randn(2, 7, 96, generator=g)
    weight = torch.rand(96, generator=g) + 0.5
    qkv = torch.randn(7, 8 * 16, generator=g) * 3
    q, k = qkv[:, :64].view(7, 4, 16), qkv[:, 64:96].view(7, 2, 16)
    positions, cos_sin = torch.tensor([0, 5, 9, 100, 3, 3, 511]), torch.randn(512, 16)
    gate_up = torch.randn(7, 80, generator=g)
    return [
        (cpu_kernels.rms_norm, layers.rms_norm, (x, weight, 1e-6)),
        (cpu_kernels.add_rms_norm, layers.add_rms_norm, (x, residual, weight, 1e-6)),
        (cpu_kernels.apply_rotary, layers.apply_rotary, (q, k, positions, cos_sin)),
        (cpu_kernels.silu_and_mul, layers.silu_and_mul, (gate_up,)),
    ]


@pytest.mark.parametrize("default", [torch.float64, torch.float16, torch.bfloat16])
def test_the_kernels_write_float32_whatever_torchs_default_dtype(default):
    """The C code writes float32: its output buffers are float32 under any default
    dtype (a float64 buffer read garbage, a float16 one was written past its end)."""
    cases = elementwise_cases()
    expected = [function(*args) for _, function, args in cases]
    weight = torch.randn(48, 40)
    x = torch.randn(3, 40)
    panels = cpu_kernels.pack_panels(weight)
    k_cache, v_cache, tables = paged_cache(16, [40, 7], 2, seed=1)
    meta = metadata([40, 7], tables)
    q = torch.randn(2, 4, HEAD_DIM)
    reference = decode_torch(q, k_cache, v_cache, meta, 0.125)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        got = [kernel(*args) for kernel, _, args in cases]
        matmul = cpu_kernels.panel_matmul(x, panels)
        attention = cpu.decode(q, k_cache, v_cache, meta, 0.125)
    finally:
        torch.set_default_dtype(saved)
    for out, want in zip(got, expected):
        for a, b in zip(*(v if isinstance(v, tuple) else (v,) for v in (out, want))):
            assert a.dtype == torch.float32 and relative_error(a, b) < 1e-6
    assert matmul.dtype == torch.float32
    assert relative_error(matmul, F.linear(x, weight)) < 1e-6
    assert (
        attention.dtype == torch.float32 and relative_error(attention, reference) < 1e-6
    )


def test_fused_kernels_match_the_functions_they_replace():
    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, 7, 96, generator=g), torch.randn(2, 7, 96, generator=g)
    weight = torch.rand(96, generator=g) + 0.5
    qkv = torch.randn(7, 8 * 16, generator=g) * 3
    # views, as in the model
    q, k = qkv[:, :64].view(7, 4, 16), qkv[:, 64:96].view(7, 2, 16)
    positions, cos_sin = torch.tensor([0, 5, 9, 100, 3, 3, 511]), torch.randn(512, 16)
    gate_up = torch.linspace(-120, 120, 7 * 2 * 40).view(7, 80)  # far into exp's tails
    cases = [
        (cpu_kernels.rms_norm, layers.rms_norm, (x, weight, 1e-6)),
        (cpu_kernels.rms_norm, layers.rms_norm, (q, weight[:16], 1e-6)),
        (cpu_kernels.add_rms_norm, layers.add_rms_norm, (x, residual, weight, 1e-6)),
        (cpu_kernels.apply_rotary, layers.apply_rotary, (q, k, positions, cos_sin)),
        (cpu_kernels.silu_and_mul, layers.silu_and_mul, (gate_up,)),
    ]
    for kernel, function, args in cases:
        got, expected = kernel(*args), function(*args)
        for a, b in zip(
            *(v if isinstance(v, tuple) else (v,) for v in (got, expected))
        ):
            assert a.shape == b.shape and relative_error(a, b) < 1e-6, function.__name__
    for kernel, function, args in cases:  # other dtypes: the function as written
        args = tuple(
            a.bfloat16() if torch.is_tensor(a) and a.is_floating_point() else a
            for a in args
        )
        got, expected = kernel(*args), function(*args)
        for a, b in zip(
            *(v if isinstance(v, tuple) else (v,) for v in (got, expected))
        ):
            assert torch.equal(a, b)


ELEMENTWISE = ("rms_norm", "add_rms_norm", "rotary", "silu_and_mul")


def test_a_model_built_for_the_backend_runs_its_kernels():
    kernels = BACKENDS["cpu"].kernels()
    assert {
        name: getattr(kernels, name) for name in ELEMENTWISE
    } == cpu_kernels.ELEMENTWISE
    norm = layers.RMSNorm(8, 1e-6, kernels)
    assert (
        norm.norm is cpu_kernels.rms_norm and norm.add_norm is cpu_kernels.add_rms_norm
    )


def test_without_a_compiler_the_backend_keeps_the_cores_functions(no_library):
    kernels, plain = BACKENDS["cpu"].kernels(), BACKENDS["torch"].kernels()
    assert all(getattr(kernels, name) is getattr(plain, name) for name in ELEMENTWISE)


def test_a_torch_engine_beside_a_cpu_engine_runs_no_c_kernel(
    qwen3_path, hf_greedy, monkeypatch
):
    """The kernels belong to the engine's backend, not to the process: once a
    cpu-backend engine has loaded them, a "torch" engine in the same process still runs
    PyTorch's code."""
    prompt = [5, 6, 7, 8]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    LLM(qwen3_path, attention_backend="cpu").generate([prompt], params, use_tqdm=False)
    torch_engine = LLM(qwen3_path, attention_backend="torch")

    class Refusing:
        def __getattr__(self, name):
            raise AssertionError(f"the torch backend called the C kernel {name}")

    monkeypatch.setattr(cpu_kernels, "library", lambda: Refusing())
    [output] = torch_engine.generate([prompt], params, use_tqdm=False)
    assert output.outputs[0].token_ids == hf_greedy(qwen3_path, [prompt], 6)[0]


def test_a_cache_folder_that_cannot_be_written_means_no_kernels(
    monkeypatch, tmp_path, caplog
):
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    monkeypatch.setattr(cpu_kernels, "CACHE_DIR", str(blocked / "nanopaged"))
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is None
        assert "could not be built or loaded" in caplog.text
    finally:
        cpu_kernels.library.cache_clear()


def test_the_library_is_built_once_per_compiler_and_reused(
    monkeypatch, tmp_path, caplog
):
    monkeypatch.setattr(cpu_kernels, "CACHE_DIR", str(tmp_path))
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is not None
        assert "building the CPU backend's C kernels" in caplog.text
        built = list(tmp_path.iterdir())
        assert len(built) == 1 and built[0].name.startswith("cpu_kernels-")
        cpu_kernels.library.cache_clear()
        monkeypatch.setattr(
            cpu_kernels, "_compile", lambda *args: pytest.fail("built again")
        )
        assert cpu_kernels.library() is not None
        cpu_kernels.library.cache_clear()
        monkeypatch.undo()
        monkeypatch.setattr(cpu_kernels, "CACHE_DIR", str(tmp_path))
        # another compiler (one that fails): another key
        monkeypatch.setenv("CC", "false")
        assert cpu_kernels.library() is None
        assert "C kernels could not be built" in caplog.text
        assert list(tmp_path.iterdir()) == built  # nothing half-written left behind
    finally:
        cpu_kernels.library.cache_clear()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("tokens", [4, 600])  # 600: over the kernel's one-thread size
def test_store_writes_each_token_to_its_slot(kv_dtype, tokens):
    """K and V as the model passes them: views of a token's fused q/k/v row."""
    k_cache, v_cache, _ = paged_cache(16, [700], 2, seed=3)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    qkv = torch.randn(tokens, 8 * HEAD_DIM)
    k, v = (
        qkv[:, i * 2 * HEAD_DIM : (i + 1) * 2 * HEAD_DIM].view(tokens, 2, HEAD_DIM)
        for i in (2, 3)
    )
    slots = torch.randperm(700)[:tokens]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kvcache_torch(k, v, expected_k, expected_v, slots)
    cpu.store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.float(), expected_k.float())
    assert torch.equal(v_cache.float(), expected_v.float())
    assert cpu_kernels.store_kv(k, v, k_cache, v_cache, slots)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("kernel", [True, False])
def test_the_store_skips_slots_below_zero(kv_dtype, kernel, monkeypatch):
    """A step graph's padding rows have slot -1: the C kernel and the PyTorch path
    without it both write no slot for them."""
    if not kernel:
        monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    k_cache, v_cache, _ = paged_cache(16, [64], 2, seed=4)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    k, v = torch.randn(2, 3, 2, HEAD_DIM).unbind(0)
    cpu.store_kvcache(k, v, k_cache, v_cache, torch.tensor([5, -1, 9]))
    untouched = torch.ones(k_cache.numel() // (2 * HEAD_DIM), dtype=torch.bool)
    untouched[[5, 9]] = False
    for cache, before, new in ((k_cache, before_k, k), (v_cache, before_v, v)):
        rows, rows_before = cache.view(-1, 2, HEAD_DIM), before.view(-1, 2, HEAD_DIM)
        assert torch.equal(rows[[5, 9]].float(), new[[0, 2]].to(kv_dtype).float())
        assert torch.equal(rows[untouched].float(), rows_before[untouched].float())


@pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch without oneDNN"
)
def test_a_packed_linear_multiplies_as_f_linear_and_frees_the_projections_weight():
    from nanopaged.core.layers import ParallelLMHead, RowParallelLinear

    projection = RowParallelLinear(64, 48, True, cpu.PackedLinear())
    head = ParallelLMHead(500, 64, cpu.PackedLinear())
    for layer in (projection, head):
        for param in layer.parameters():
            param.data.normal_()
    weights = [projection.weight.data.clone(), head.weight.data]
    for layer in (projection, head):
        layer.method = layer.method.process_weights(layer)
    x = torch.randn(3, 7, 64)
    assert torch.allclose(
        projection(x), F.linear(x, weights[0], projection.bias), atol=1e-5
    )
    assert torch.allclose(head(x), F.linear(x, weights[1]), atol=1e-5)
    assert projection.weight is None and head.weight is not None  # the embedding's too


# tiles of at most 6 rows, as even as can be (27: 6 6 5 5 5); 1 to 3 rows keep more sums
# a row; 2000 rows of 40: x in 2 blocks of 1000 (the kernel's blocks are 256 KB of x); K
# of 1000: a panel of 64 KB, whose next page the kernel asks for before each tile
@pytest.mark.parametrize(
    "rows, k",
    [
        (1, 40),
        (2, 40),
        (3, 40),
        (5, 40),
        (6, 40),
        (7, 40),
        (13, 40),
        (27, 40),
        (40, 40),
        (2000, 40),
        (1, 1000),
        (27, 1000),
        (300, 1000),
    ],
)
def test_the_panel_matmul_is_f_linear(rows, k):
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(48, k, generator=g), torch.randn(48, generator=g)
    panels = cpu_kernels.pack_panels(weight)
    x = torch.randn(2, rows, 2 * k, generator=g)[..., ::2]  # 3-D, rows not contiguous
    assert (
        relative_error(cpu_kernels.panel_matmul(x, panels), F.linear(x, weight)) < 1e-6
    )
    from nanopaged.core.layers import ColumnParallelLinear

    layer = ColumnParallelLinear(k, 48, True, cpu.PackedLinear())
    layer.weight.data.copy_(weight)
    layer.bias.data.copy_(bias)
    layer.method = layer.method.process_weights(layer)
    assert type(layer.method) is cpu.PanelLinear and layer.weight is None
    assert relative_error(layer(x), F.linear(x, weight, bias)) < 1e-6


def test_float32_projections_multiply_in_panels_and_others_as_onednn_packs_them():
    """Every float32 weight goes to the library's matmul (on its own threads); another
    dtype to oneDNN's prepacked GEMM where oneDNN packs it, else stays plain."""
    from nanopaged.core.layers import ColumnParallelLinear

    methods = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        layer = ColumnParallelLinear(32, 48, False, cpu.PackedLinear()).to(dtype)
        methods[dtype] = type(layer.method.process_weights(layer))
    assert methods[torch.float32] is cpu.PanelLinear
    packed = torch.backends.mkldnn.is_available() and (
        torch.bfloat16 in cpu.packable_dtypes()
    )
    assert methods[torch.bfloat16] is (cpu.PackedLinear if packed else LinearMethod)
    assert methods[torch.float16] is LinearMethod


def pool_threads() -> int:
    """The library's threads alive in this process (named by the C file)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    return names.count("nanopaged-cpu")


def big_norm(threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A norm over enough rows to run on `threads` threads, and its reference."""
    g = torch.Generator().manual_seed(threads)
    x, weight = torch.randn(512, 256, generator=g), torch.randn(256, generator=g)
    return kernel_norm(x, weight, threads), layers.rms_norm(x, weight, 1e-6)


def kernel_norm(x: torch.Tensor, weight: torch.Tensor, threads: int) -> torch.Tensor:
    """The C kernel's RMSNorm of x (rows of 256) on `threads` threads."""
    out = torch.empty_like(x)
    cpu_kernels.library().rms_norm(
        x.data_ptr(),
        256,
        1,
        None,
        weight.data_ptr(),
        x.shape[0],
        256,
        1e-6,
        out.data_ptr(),
        None,
        threads,
    )
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux's /proc")
def test_the_kernels_run_on_threads_of_their_own_that_sleep_when_idle():
    """No OpenMP runtime: a kernel on 3 threads runs on the caller and 2 of the
    library's; once no kernel has come for a while they sleep (the process uses no
    CPU), and the next kernel wakes them."""
    assert "-fopenmp" not in cpu_kernels.FLAGS
    out, want = big_norm(3)
    assert relative_error(out, want) < 1e-6
    assert pool_threads() >= 2
    time.sleep(0.1)  # past the longest spin (2 ms)
    start = time.process_time()
    time.sleep(0.3)
    assert time.process_time() - start < 0.05  # asleep, not spinning
    out, want = big_norm(3)
    assert relative_error(out, want) < 1e-6


def test_the_threads_notice_when_other_work_takes_their_cores():
    """Alone on its cores a thread waits up to 2 ms for the next kernel, spinning; once
    other threads keep taking its core (here a busy process per core) the pool counts
    its cores shared, and spins only about a wake-up's time (50 us) before it sleeps."""
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(cpu.usable_cores())
    ]
    try:
        x, weight = torch.randn(512, 256), torch.randn(256)
        deadline = time.monotonic() + 30
        while not cpu_kernels.library().cores_shared() and time.monotonic() < deadline:
            kernel_norm(x, weight, 2)
            time.sleep(0.0005)
        assert cpu_kernels.library().cores_shared()
    finally:
        for process in busy:
            process.kill()
            process.wait()


def test_kernels_called_from_two_threads_at_once_are_each_right():
    """A second caller, while the pool runs the first's kernel, runs its own alone."""
    import concurrent.futures

    def norms(threads: int) -> float:
        return max(relative_error(*big_norm(threads)) for _ in range(50))

    with concurrent.futures.ThreadPoolExecutor(2) as callers:
        errors = list(callers.map(norms, [2, 3, 2, 3]))
    assert max(errors) < 1e-6


def test_a_kernel_returns_only_once_every_helper_is_done():
    """More helpers than cores, kernel after kernel with other helper counts (threads
    descheduled between two kernels, late to see which one runs): each kernel's output
    is whole when it returns, equal to the one-thread kernel's, bit for bit."""
    g = torch.Generator().manual_seed(7)
    x, weight = torch.randn(256, 256, generator=g), torch.randn(256, generator=g)
    want = kernel_norm(x, weight, 1)
    wrong, deadline = 0, time.monotonic() + 3
    while time.monotonic() < deadline:
        for threads in (4 * cpu.usable_cores(), 2, 3 * cpu.usable_cores(), 3, 1):
            wrong += not torch.equal(kernel_norm(x, weight, threads), want)
    assert wrong == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_runs_the_kernels_on_threads_of_its_own():
    """A child of fork has none of its parent's threads: its pool starts anew (a
    data-parallel replica, a bench engine) rather than wait for threads that are not
    there."""
    big_norm(2)  # the parent's pool has a thread
    pid = os.fork()
    if pid == 0:  # the child: exit 0 once its kernel is right
        torch.set_num_threads(1)  # OpenMP's threads (the reference's) do not fork
        out, want = big_norm(2)
        os._exit(0 if relative_error(out, want) < 1e-6 else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    raise AssertionError("the child's kernel never returned")


def vm_flags(address: int) -> set[str]:
    """Linux's flags for the mapping that holds `address` (its VmFlags in
    /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split()[0]
            if not first.endswith(":"):  # a mapping's first line: "start-end perms ..."
                start, end = (int(bound, 16) for bound in first.split("-"))
                inside = start <= address < end
            elif inside and first == "VmFlags:":
                return set(line.split()[1:])
    return set()


@pytest.mark.skipif(
    not os.path.exists("/proc/self/smaps") or not hasattr(mmap, "MADV_HUGEPAGE"),
    reason="Linux's transparent huge pages",
)
def test_the_kv_cache_and_the_panels_ask_for_huge_pages_and_start_zeroed(
    qwen3_path,
):
    runner = LLM(qwen3_path).engine.runner
    assert "hg" in vm_flags(runner.kv_cache.data_ptr())  # hg: madvise(MADV_HUGEPAGE)
    assert not runner.kv_cache.any()
    assert "hg" in vm_flags(
        runner.model.model.layers[0].mlp.down_proj.panels.data_ptr()
    )
    reference = LLM(qwen3_path, attention_backend="torch").engine.runner
    # torch.zeros: the core's own
    assert "hg" not in vm_flags(reference.kv_cache.data_ptr())


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_huge_zeros_are_zeros_also_where_huge_pages_are_missing_or_refused(
    dtype, monkeypatch
):
    class Refusing(mmap.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    def check():
        x = cpu.huge_zeros((3, 5), dtype)
        assert x.shape == (3, 5) and x.dtype == dtype and not x.float().any()
        x[1, 2] = 1  # writable
        assert x.float().sum() == 1

    check()
    monkeypatch.setattr(mmap, "mmap", Refusing)
    check()
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)  # macOS: torch.zeros
    check()


def test_a_width_that_is_not_whole_panels_keeps_onednn():
    assert cpu_kernels.pack_panels(torch.randn(50, 8)) is None  # 50 features: not 16s
    assert cpu_kernels.pack_panels(torch.randn(48, 8).bfloat16()) is None


def test_half_weights_keep_f_linear():
    """oneDNN packs float32 and bfloat16; other dtypes multiply as before."""
    from nanopaged.core.layers import RowParallelLinear

    layer = RowParallelLinear(8, 4, False, cpu.PackedLinear()).half()
    layer.method = layer.method.process_weights(layer)
    assert type(layer.method) is LinearMethod and layer.weight is not None


@pytest.mark.parametrize("bf16", [True, False])
def test_bfloat16_weights_are_packed_only_where_the_cpu_has_its_instructions(
    bf16, monkeypatch
):
    """oneDNN's bfloat16 path needs AVX-512 (or AVX-NE-CONVERT): without, it raises."""
    from nanopaged.core.layers import RowParallelLinear

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: bf16)
    cpu.packable_dtypes.cache_clear()
    monkeypatch.setattr(
        torch.ops.mkldnn, "_reorder_linear_weight", lambda w, _: w.clone()
    )
    layer = RowParallelLinear(8, 4, False, cpu.PackedLinear()).bfloat16()
    layer.method = layer.method.process_weights(layer)
    assert (type(layer.method) is cpu.PackedLinear) == bf16
    cpu.packable_dtypes.cache_clear()


def test_auto_picks_the_cpu_backend_on_a_cpu_and_torch_stays_the_reference(qwen3_path):
    llm = LLM(qwen3_path)
    assert (
        llm.config.attention_backend == "cpu"
        and llm.engine.runner.sampler.sample is cpu.sample
    )
    runner = LLM(qwen3_path, attention_backend="torch").engine.runner
    assert runner.sampler.sample is sampler.sample
    modules = list(runner.model.modules())
    assert all(type(m.method) is LinearMethod for m in modules if hasattr(m, "method"))
    # after the cpu engine loaded its C kernels: none in the torch engine's layers
    kernels = set(cpu_kernels.ELEMENTWISE.values()) | {cpu.store_kvcache, cpu.decode}
    used = [f for m in modules for f in vars(m).values() if callable(f)]
    used += [f for m in modules for f in getattr(m, "kernels", ())]
    assert used and not set(used) & kernels
    assert all(m.kernels == TORCH for m in modules if hasattr(m, "kernels"))


def cdf_bounds(logits, temperatures, tokens):
    """The cumulative probability before and after each row's token, in float64."""
    probs = torch.softmax(logits.double() / temperatures.double()[:, None], dim=-1)
    cdf = probs.cumsum(dim=-1)
    after = cdf.gather(1, tokens[:, None]).squeeze(1)
    return after - probs.gather(1, tokens[:, None]).squeeze(1), after


@pytest.mark.parametrize("vocab_size", [4096, 1000])  # 1000: no whole chunks, so one
def test_sample_inverts_the_cumulative_distribution_as_the_sampler_does(vocab_size):
    g = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(256, vocab_size, generator=g) * 4
    temperatures = torch.rand(256, generator=g) + 0.05
    uniform = torch.rand(256, generator=g)
    tokens = cpu.sample(logits, temperatures, uniform)
    before, after = cdf_bounds(logits, temperatures, tokens)
    # the token's interval of the distribution holds the uniform number, up to float32
    # rounding
    assert ((before <= uniform + 1e-5) & (uniform <= after + 1e-5)).all()
    agree = tokens == sampler.sample(logits, temperatures, uniform)
    assert agree.float().mean() > 0.99


def test_sample_never_picks_a_token_of_probability_zero():
    """Targets at and next to every chunk's boundary, and uniform numbers next to 1,
    over rows whose allowed tokens sit at the ends of chunks."""
    allowed = [0, 127, 128, 255, 300, 383, 511]
    logits = torch.full((1, 512), float("-inf"))
    logits[0, allowed] = torch.randn(len(allowed))
    probs = torch.softmax(logits, dim=-1)
    cuts = probs.cumsum(dim=-1)[0, allowed].tolist()
    targets = (
        [0.0, 1 - 2**-24] + [math.nextafter(c, d) for c in cuts for d in (0, 1)] + cuts
    )
    uniform = torch.tensor([t for t in targets if t < 1])
    rows = len(uniform)
    tokens = cpu.sample(logits.expand(rows, -1), torch.ones(rows), uniform)
    assert set(tokens.tolist()) <= set(allowed)


def test_a_row_with_no_weight_anywhere_still_gets_a_valid_token():
    """All -inf (a mask that allows nothing) or NaN logits: token 0, beside a normal
    row."""
    logits = torch.stack(
        [
            torch.full((300,), float("-inf")),
            torch.full((300,), float("nan")),
            torch.zeros(300),
        ]
    )
    tokens = cpu.sample(logits, torch.ones(3), torch.tensor([0.5, 0.5, 0.5]))
    assert tokens[:2].tolist() == [0, 0] and 0 <= tokens[2] < 300


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_matches_transformers_with_chunks_preemption_and_prefix_hits(
    arch, model_path, hf_greedy
):
    from test_models import mixed_run

    mixed_run(model_path(arch), hf_greedy, attention_backend="cpu")


def test_without_a_compiler_the_backend_still_gives_transformers_tokens(
    qwen3_path, hf_greedy, no_library, monkeypatch
):
    from test_models import mixed_run

    mixed_run(qwen3_path, hf_greedy, attention_backend="cpu")


def test_seeded_samples_equal_the_reference_backends(qwen3_path):
    prompts = random_prompts([5, 40, 300], seed=4)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=12)
    tokens = [
        [
            o.outputs[0].token_ids
            for o in LLM(qwen3_path, attention_backend=backend).generate(
                prompts, params, use_tqdm=False
            )
        ]
        for backend in ("cpu", "torch")
    ]
    assert tokens[0] == tokens[1]


def test_usable_cores_are_the_affinity_capped_by_the_cgroup_quota(
    monkeypatch, tmp_path
):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    quota = tmp_path / "cpu.max"
    real_open = open

    def fake_open(path, *args, **kwargs):
        if path == "/sys/fs/cgroup/cpu.max":
            return real_open(quota, *args, **kwargs)
        if str(path).startswith("/sys/fs/cgroup"):
            raise OSError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    for limit, cores in (
        ("max 100000", 6),
        ("250000 100000", 3),
        ("50000 100000", 1),
        ("900000 100000", 6),
    ):
        quota.write_text(limit)
        assert cpu.usable_cores.__wrapped__() == cores


def test_the_kernels_threads_are_torchs_count_never_more_than_the_usable_cores(
    monkeypatch,
):
    """The program's choice of threads (torch's count) holds for the kernels too, but
    no more than the cores this process may use; torch's own count is left as it is."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    for usable, threads in ((2, 2), (16, 8)):
        monkeypatch.setattr(cpu_kernels, "usable_cores", lambda usable=usable: usable)
        assert cpu_kernels.threads() == threads


PROCESS_STATE = """
import ctypes, os, sys
first = sys.argv[1]
__import__(first)
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
                "keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def state():
    import torch
    block = libc.malloc(64 << 20)  # glibc maps it on its own unless told otherwise
    mapped = libc.mallinfo2().hblkhd >= 64 << 20
    libc.free(block)
    return dict(os.environ), torch.get_num_threads(), mapped

import torch
from nanopaged import LLM, SamplingParams
before = state()
llm = LLM(sys.argv[2], attention_backend="cpu", max_model_len=128)
tokens = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0),
                      use_tqdm=False)[0].outputs[0].token_ids
assert state() == before, (before, state())
print(tokens)
"""


@pytest.mark.skipif(
    not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc 2.33's mallinfo2"
)
def test_an_engine_changes_nothing_in_its_process_whatever_is_imported_first(
    qwen3_path,
):
    """Importing nanopaged and running a CPU engine leave the process as they found it
    (its environment, torch's thread count, glibc's allocator settings), and torch
    imported first or after makes no difference, to that or to the tokens."""
    outputs = []
    for first in ("torch", "nanopaged"):
        result = subprocess.run(
            [sys.executable, "-c", PROCESS_STATE, first, qwen3_path],
            capture_output=True,
            text=True,
            env={k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"},
        )
        assert result.returncode == 0, result.stderr[-3000:]
        outputs.append(result.stdout)
    assert outputs[0] == outputs[1]


def test_the_library_is_keyed_by_what_the_compiler_targets_here(monkeypatch):
    """Another CPU's instruction sets (or another compiler version) make another key, on
    every platform (ARM's /proc/cpuinfo has no `flags` line): a shared cache never hands
    a library built for another CPU."""
    here = cpu_kernels.library_path()
    assert "#define" in cpu_kernels._target(os.environ.get("CC", "cc"))
    for other in ("#define __ARM_FEATURE_SVE 1", "#define __AVX512F__ 1\ngcc 99"):
        monkeypatch.setattr(cpu_kernels, "_target", lambda compiler, o=other: o)
        assert cpu_kernels.library_path() != here


def test_a_rows_matmul_is_the_same_bits_in_any_batch():
    """Batch invariance: row 0's product is the same alone or among any rows."""
    g = torch.Generator().manual_seed(8)
    weight, x = torch.randn(96, 80, generator=g), torch.randn(40, 80, generator=g)
    panels = cpu_kernels.pack_panels(weight)
    alone = cpu_kernels.panel_matmul(x[:1].contiguous(), panels)
    for rows in (2, 3, 4, 5, 6, 7, 13, 40):
        assert torch.equal(cpu_kernels.panel_matmul(x[:rows], panels)[:1], alone)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_querys_attention_is_the_same_bits_from_either_kernel(kv_dtype):
    """The decode kernel (a query at a time) and the tiled prefill kernel give a query
    the same bits, whatever its neighbours in the tile: a token's attention never
    depends on how its step was formed."""
    block_size, lens = 16, [37, 70]
    k_cache, v_cache, tables = paged_cache(block_size, lens, 2, seed=9)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    g = torch.Generator().manual_seed(10)
    queries = torch.randn(sum(lens), 4, HEAD_DIM, generator=g)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    context = torch.tensor(lens, dtype=torch.int32)

    def attend(q, cu_seqlens, context_lens, table, tiled):
        return cpu_kernels.paged_attention(
            q, k_cache, v_cache, table, context_lens, cu_seqlens, 0.25, None, tiled
        )

    tiled = attend(queries, cu, context, tables, True)  # whole prompts
    for seq, length in enumerate(lens):
        for position in (0, length // 2, length - 1):  # one query, as a decode step
            token = int(cu[seq]) + position
            one = attend(
                queries[token : token + 1],
                None,
                torch.tensor([position + 1], dtype=torch.int32),
                tables[seq : seq + 1],
                False,
            )
            assert torch.equal(one[0], tiled[token])
