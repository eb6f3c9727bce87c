"""Every Triton kernel against the plain-PyTorch reference (TRITON_INTERPRET=1 without a
GPU)."""

import pytest
import torch

triton_attention = pytest.importorskip("nanopaged.core.triton_attention")
triton_decode_attention = pytest.importorskip("nanopaged.core.triton_decode_attention")
from conftest import DEVICE, HEAD_DIM, metadata, paged_cache, relative_error  # noqa: E402

from nanopaged.core.attention import (  # noqa: E402
    AttentionMetadata,
    decode_torch,
    prefill_torch,
    store_kvcache_torch,
)


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("split_tokens", [64, 128, 512])
def test_decode_matches_reference(block_size, num_heads, num_kv_heads, split_tokens):
    context_lens = [1, 17, 300, 64, 129]
    k_cache, v_cache, tables = paged_cache(
        block_size, context_lens, num_kv_heads, seed=block_size
    )
    q = torch.randn(len(context_lens), num_heads, HEAD_DIM, device=DEVICE)
    meta = metadata(context_lens, tables)
    out = triton_decode_attention.decode_paged(
        q,
        k_cache,
        v_cache,
        tables,
        meta.context_lens,
        meta.max_seqlen_k,
        0.25,
        split_tokens=split_tokens,
    )
    ref = decode_torch(q, k_cache, v_cache, meta, 0.25)
    assert relative_error(out, ref) < 1e-5


def test_decode_result_does_not_depend_on_empty_splits():
    """A CUDA graph launches splits for max_model_len; eager only for the longest
    context."""
    context_lens = [3, 200, 130]
    k_cache, v_cache, tables = paged_cache(16, context_lens, 2, seed=4)
    q = torch.randn(len(context_lens), 4, HEAD_DIM, device=DEVICE)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    outs = [
        triton_decode_attention.decode_paged(
            q, k_cache, v_cache, tables, lens, max_seqlen_k, 0.25, split_tokens=64
        )
        for max_seqlen_k in (200, 1024)
    ]
    assert torch.equal(outs[0], outs[1])


def test_decode_padding_rows_with_no_context_are_finite():
    k_cache, v_cache, tables = paged_cache(16, [20, 5], 2, seed=1)
    q = torch.randn(2, 4, HEAD_DIM, device=DEVICE)
    meta = AttentionMetadata(
        ragged=False,
        slot_mapping=torch.empty(0, device=DEVICE),
        context_lens=torch.tensor([20, 0], dtype=torch.int32, device=DEVICE),
        block_tables=tables,
        max_seqlen_k=20,
    )
    first = AttentionMetadata(
        ragged=False,
        slot_mapping=meta.slot_mapping,
        context_lens=meta.context_lens[:1],
        block_tables=tables[:1],
        max_seqlen_k=20,
    )
    ref = decode_torch(q[:1], k_cache, v_cache, first, 0.25)
    for split_tokens in (64, 16):
        out = triton_decode_attention.decode_paged(
            q,
            k_cache,
            v_cache,
            tables,
            meta.context_lens,
            20,
            0.25,
            split_tokens=split_tokens,
        )
        assert torch.isfinite(out).all()
        assert relative_error(out[:1], ref) < 1e-5


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (2, 2)])
def test_prefill_matches_reference_with_cached_prefixes(
    block_size, num_heads, num_kv_heads
):
    # (new query tokens, whole context): a fresh prompt, prefix hits, a chunk, one token
    shapes = [(40, 40), (7, 39), (33, 290), (1, 18)]
    context_lens = [c for _, c in shapes]
    k_cache, v_cache, tables = paged_cache(
        block_size, context_lens, num_kv_heads, seed=7
    )
    q_lens = [n for n, _ in shapes]
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), num_heads, HEAD_DIM, device=DEVICE)
    meta = metadata(
        context_lens, tables, cu_seqlens_q=cu.to(DEVICE), max_seqlen_q=max(q_lens)
    )
    out = triton_attention.prefill_paged(
        q,
        k_cache,
        v_cache,
        meta.cu_seqlens_q,
        meta.context_lens,
        tables,
        max(q_lens),
        0.25,
    )
    ref = prefill_torch(q, k_cache, v_cache, meta, 0.25)
    assert relative_error(out, ref) < 1e-5


def test_store_kvcache_matches_reference_and_skips_padding():
    num_kv_heads, block_size = 2, 16
    k_cache, v_cache, _ = paged_cache(block_size, [64], num_kv_heads, seed=3)
    # k, v are strided views
    qkv = torch.randn(5, (4 + 2 * num_kv_heads) * HEAD_DIM, device=DEVICE)
    _, k, v = qkv.split(
        [4 * HEAD_DIM, num_kv_heads * HEAD_DIM, num_kv_heads * HEAD_DIM], dim=-1
    )
    k, v = k.view(5, num_kv_heads, HEAD_DIM), v.view(5, num_kv_heads, HEAD_DIM)
    slots = torch.tensor([3, 70, -1, 17, 0], device=DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kvcache_torch(k, v, expected_k, expected_v, slots)
    triton_attention.store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("window", [1, 5, 64, 100])
def test_sliding_window_decode_and_prefill_match_the_reference(window):
    """Keys older than the window are masked, and the blocks wholly before it never
    read: here they are -1 in the block table, as the block manager leaves them."""
    context_lens = [1, 17, 300, 129]
    k_cache, v_cache, tables = paged_cache(16, context_lens, 2, seed=window)
    # given back: wholly before every query's window
    for i, n in enumerate(context_lens):
        tables[i, : max(0, (n - 40 - window) // 16)] = -1
    q = torch.randn(len(context_lens), 4, HEAD_DIM, device=DEVICE)
    meta = metadata(context_lens, tables)
    for split_tokens in (64, 512):
        out = triton_decode_attention.decode_paged(
            q,
            k_cache,
            v_cache,
            tables,
            meta.context_lens,
            meta.max_seqlen_k,
            0.25,
            split_tokens,
            window,
        )
        assert (
            relative_error(out, decode_torch(q, k_cache, v_cache, meta, 0.25, window))
            < 1e-5
        )
    q_lens = [1, 7, 40, 33]
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), 4, HEAD_DIM, device=DEVICE)
    meta = metadata(
        context_lens, tables, cu_seqlens_q=cu.to(DEVICE), max_seqlen_q=max(q_lens)
    )
    out = triton_attention.prefill_paged(
        q,
        k_cache,
        v_cache,
        meta.cu_seqlens_q,
        meta.context_lens,
        tables,
        max(q_lens),
        0.25,
        window,
    )
    assert (
        relative_error(out, prefill_torch(q, k_cache, v_cache, meta, 0.25, window))
        < 1e-5
    )
    full = prefill_torch(q, k_cache, v_cache, meta, 0.25)
    assert relative_error(out, full) > 1e-3  # the window did change something


@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k", [(1, 8, 2), (7, 6, 4), (300, 8, 2)]
)
def test_fused_experts_match_the_plain_pytorch_experts(num_tokens, num_experts, top_k):
    """Few tokens (16-row tiles, most experts idle) and many (64-row tiles); expert 0 is
    never chosen, so its tiles must not exist."""
    from nanopaged.models.moe import experts_torch, route
    from nanopaged.models.moe_triton import fused_experts

    g = torch.Generator().manual_seed(num_tokens)
    hidden, intermediate = 64, 48  # not multiples of the kernels' tiles
    x = torch.randn(num_tokens, hidden, generator=g).to(DEVICE)
    gate_up = (torch.randn(num_experts, 2 * intermediate, hidden, generator=g) / 8).to(
        DEVICE
    )
    down = (torch.randn(num_experts, hidden, intermediate, generator=g) / 8).to(DEVICE)
    router_logits = torch.randn(num_tokens, num_experts, generator=g).to(DEVICE)
    router_logits[:, 0] = -1e9
    weights, ids = route(router_logits, top_k, renormalize=num_experts == 6)
    assert not (ids == 0).any()
    expected = experts_torch(x, gate_up, down, weights, ids)
    assert (
        relative_error(fused_experts(x, gate_up, down, weights, ids), expected) < 1e-5
    )


def test_align_by_expert_gives_each_tile_one_expert_and_each_pair_one_row():
    from nanopaged.models.moe_triton import align_by_expert

    # expert 1: 4 pairs
    ids = torch.tensor([[3, 1], [1, 0], [3, 1], [1, 2]], device=DEVICE)
    sorted_ids, tile_experts, rows_in_use = align_by_expert(
        ids, num_experts=5, block_m=2
    )
    pairs = ids.flatten()
    real = sorted_ids < pairs.numel()
    assert sorted(sorted_ids[real].tolist()) == list(range(8))
    assert rows_in_use.item() == 10  # 1 + 4 + 1 + 2 pairs, each expert padded to 2 rows
    for row in range(rows_in_use.item()):
        if real[row]:
            assert pairs[sorted_ids[row]] == tile_experts[row // 2]


# 72: one group, a part-filled tile
@pytest.mark.parametrize(
    "rows, in_features, out_features, group",
    [(1, 128, 96, 32), (5, 256, 64, 128), (40, 72, 80, 72)],
)
def test_int4_matmul_equals_the_dequantized_weight(
    rows, in_features, out_features, group
):
    """AWQ's and GPTQ's 4-bit GEMM: x @ ((value - zero) x scale), each input taking its
    group's zero and scale, against the float weight they define."""
    from nanopaged.quantization.dequantize import unpack_int4
    from nanopaged.quantization.int4_triton import int4_matmul, pack_inputs

    g = torch.Generator().manual_seed(rows)
    values = torch.randint(0, 16, (in_features, out_features), generator=g)
    zeros = torch.randint(0, 16, (in_features // group, out_features), generator=g)
    scales = (torch.rand(in_features // group, out_features, generator=g) / 16).half()
    packed = pack_inputs(values)
    assert torch.equal(unpack_int4(packed, 0), values)  # the layout the kernel reads
    weight = (
        values - zeros.repeat_interleave(group, 0)
    ) * scales.float().repeat_interleave(group, 0)
    x = torch.randn(rows, in_features, generator=g)
    out = int4_matmul(
        x.to(DEVICE),
        packed.to(DEVICE),
        zeros.to(torch.uint8).to(DEVICE),
        scales.to(DEVICE),
        group,
    )
    assert relative_error(out, (x @ weight).to(DEVICE)) < 1e-5


@pytest.mark.parametrize(
    "vocab_size, dtype", [(1000, torch.float32), (5000, torch.bfloat16)]
)
def test_sampling_kernel_inverts_the_cumulative_distribution(vocab_size, dtype):
    """The token whose cumulative probability first exceeds the row's number (as
    `sampler.sample`), never one that top-k/p dropped (-inf), at the ends of [0, 1)
    too, over a vocabulary that is no multiple of the kernel's block."""
    from nanopaged.core.sampler import sample
    from nanopaged.sampling.triton_kernel import BLOCK
    from nanopaged.sampling.triton_kernel import sample as sample_kernel

    assert vocab_size % BLOCK
    g = torch.Generator().manual_seed(vocab_size)
    logits = (torch.randn(64, vocab_size, generator=g) * 3).to(dtype)
    logits[:8, 1::2] = float("-inf")  # dropped tokens
    logits[8, :-1] = float("-inf")  # one token left: the last
    temperatures = torch.rand(64, generator=g) + 0.05
    temperatures[:4] = 1e-5  # as good as greedy
    uniform = torch.rand(64, generator=g)
    uniform[[0, 4, 8, 9]], uniform[[1, 5, 10]] = 0.0, 1 - 2**-24
    tokens = sample_kernel(*(t.to(DEVICE) for t in (logits, temperatures, uniform)))
    tokens = tokens.cpu()
    weights = torch.softmax(logits.double() / temperatures.double()[:, None], dim=-1)
    cdf = weights.cumsum(dim=-1)
    below = torch.where(
        tokens > 0, cdf.gather(1, (tokens - 1).clamp(min=0)[:, None])[:, 0], 0
    )
    target = uniform.double()
    assert (weights.gather(1, tokens[:, None]) > 0).all()
    assert (below <= target + 1e-5).all()
    assert (cdf.gather(1, tokens[:, None])[:, 0] > target - 1e-5).all()
    assert tokens[8] == vocab_size - 1
    assert torch.equal(tokens[:4], logits[:4].float().argmax(dim=-1))
    inner = (uniform > 1e-3) & (uniform < 1 - 1e-3)
    assert torch.equal(tokens[inner], sample(logits, temperatures, uniform)[inner])
