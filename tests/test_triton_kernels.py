"""Every Triton kernel against the plain-PyTorch reference (TRITON_INTERPRET=1 without a GPU)."""
import pytest
import torch

triton_attention = pytest.importorskip("nanopaged.core.triton_attention")
from nanopaged.core.attention import (AttentionMetadata, decode_torch, prefill_torch,  # noqa: E402
                                 store_kvcache_torch)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEAD_DIM = 16


def paged_cache(block_size: int, context_lens: list[int], num_kv_heads: int, seed: int):
    """A random KV cache and block tables that scatter each sequence over shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(context_lens), max(blocks_per_seq)), -1, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)])
    shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(DEVICE) for _ in range(2))
    return k_cache, v_cache, tables.to(DEVICE)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def metadata(context_lens: list[int], tables: torch.Tensor, **ragged) -> AttentionMetadata:
    """A decode step's metadata, or a ragged step's with `cu_seqlens_q` and `max_seqlen_q`."""
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    return AttentionMetadata(ragged=bool(ragged), slot_mapping=torch.empty(0, device=DEVICE),
                             context_lens=lens, block_tables=tables,
                             max_seqlen_k=max(context_lens), **ragged)


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("split_tokens", [64, 128, 512])
def test_decode_matches_reference(block_size, num_heads, num_kv_heads, split_tokens):
    context_lens = [1, 17, 300, 64, 129]
    k_cache, v_cache, tables = paged_cache(block_size, context_lens, num_kv_heads, seed=block_size)
    q = torch.randn(len(context_lens), num_heads, HEAD_DIM, device=DEVICE)
    meta = metadata(context_lens, tables)
    out = triton_attention.decode_paged(q, k_cache, v_cache, tables, meta.context_lens,
                                        meta.max_seqlen_k, 0.25, split_tokens=split_tokens)
    ref = decode_torch(q, k_cache, v_cache, meta, 0.25)
    assert relative_error(out, ref) < 1e-5


def test_decode_result_does_not_depend_on_empty_splits():
    """A CUDA graph launches splits for max_model_len; eager only for the longest context."""
    context_lens = [3, 200, 130]
    k_cache, v_cache, tables = paged_cache(16, context_lens, 2, seed=4)
    q = torch.randn(len(context_lens), 4, HEAD_DIM, device=DEVICE)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    outs = [triton_attention.decode_paged(q, k_cache, v_cache, tables, lens, max_seqlen_k, 0.25,
                                          split_tokens=64) for max_seqlen_k in (200, 1024)]
    assert torch.equal(outs[0], outs[1])


def test_decode_padding_rows_with_no_context_are_finite():
    k_cache, v_cache, tables = paged_cache(16, [20, 5], 2, seed=1)
    q = torch.randn(2, 4, HEAD_DIM, device=DEVICE)
    meta = AttentionMetadata(ragged=False, slot_mapping=torch.empty(0, device=DEVICE),
                             context_lens=torch.tensor([20, 0], dtype=torch.int32, device=DEVICE),
                             block_tables=tables, max_seqlen_k=20)
    first = AttentionMetadata(ragged=False, slot_mapping=meta.slot_mapping,
                              context_lens=meta.context_lens[:1], block_tables=tables[:1],
                              max_seqlen_k=20)
    ref = decode_torch(q[:1], k_cache, v_cache, first, 0.25)
    for split_tokens in (64, 16):
        out = triton_attention.decode_paged(
            q, k_cache, v_cache, tables, meta.context_lens, 20, 0.25, split_tokens=split_tokens
        )
        assert torch.isfinite(out).all()
        assert relative_error(out[:1], ref) < 1e-5


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (2, 2)])
def test_prefill_matches_reference_with_cached_prefixes(block_size, num_heads, num_kv_heads):
    # (new query tokens, whole context): a fresh prompt, prefix hits, a chunk, one token
    shapes = [(40, 40), (7, 39), (33, 290), (1, 18)]
    context_lens = [c for _, c in shapes]
    k_cache, v_cache, tables = paged_cache(block_size, context_lens, num_kv_heads, seed=7)
    q_lens = [n for n, _ in shapes]
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), num_heads, HEAD_DIM, device=DEVICE)
    meta = metadata(context_lens, tables, cu_seqlens_q=cu.to(DEVICE), max_seqlen_q=max(q_lens))
    out = triton_attention.prefill_paged(q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens,
                                         tables, max(q_lens), 0.25)
    ref = prefill_torch(q, k_cache, v_cache, meta, 0.25)
    assert relative_error(out, ref) < 1e-5


def test_store_kvcache_matches_reference_and_skips_padding():
    num_kv_heads, block_size = 2, 16
    k_cache, v_cache, _ = paged_cache(block_size, [64], num_kv_heads, seed=3)
    qkv = torch.randn(5, (4 + 2 * num_kv_heads) * HEAD_DIM, device=DEVICE)  # k, v are strided views
    _, k, v = qkv.split([4 * HEAD_DIM, num_kv_heads * HEAD_DIM, num_kv_heads * HEAD_DIM], dim=-1)
    k, v = k.view(5, num_kv_heads, HEAD_DIM), v.view(5, num_kv_heads, HEAD_DIM)
    slots = torch.tensor([3, 70, -1, 17, 0], device=DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kvcache_torch(k, v, expected_k, expected_v, slots)
    triton_attention.store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
