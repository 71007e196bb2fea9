"""The attention kernels' alternative paths on CPU (TRITON_INTERPRET=1, fp32) against refimpl.model.ops.attention.

test_accel_ops.py covers the default configurations; here: decode attention's two ways of combining its splits
(in the split kernel by the last-arriving program, whose counters must be back at zero for the next launch; or a
second reduce kernel), and the flash kernel's other tile sizes. Tolerance as in test_accel_ops.py (fp32, 1e-5).
"""
import os

import numpy as np
import pytest
import torch

from refimpl.model import ops as R

# CPU tensors through the interpreter; on a GPU, test_accel_ops_gpu.py covers both combine paths and E=128's tiles
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU-interpreter coverage; the GPU's is in test_accel_ops_gpu.py")

from accel.kernels import decode_attn, flash_attn  # noqa: E402


def filled_caches(rng, K, S, E, n):
    k = np.full((K, S, E), np.nan, np.float32)  # NaN past the written slots: a stray read would show
    v = np.full((K, S, E), np.nan, np.float32)
    k[:, :n] = rng.standard_normal((K, n, E))
    v[:, :n] = rng.standard_normal((K, n, E))
    return k, v


def reference(q, cache_k, cache_v, positions):
    """Attention of q [T, H, E] at `positions` over caches already holding slots 0..max(positions)."""
    k = cache_k[:, positions].transpose(1, 0, 2)  # re-write the slots the op itself would write: [T, K, E]
    v = cache_v[:, positions].transpose(1, 0, 2)
    return R.attention(q, k, v, cache_k.copy(), cache_v.copy(), np.asarray(positions))


@pytest.mark.parametrize("fused", [True, False])
def test_decode_combine_paths_repeated(fused):
    rng = np.random.default_rng(0)
    H, K, E, S = 8, 2, 16, 96
    cache_k, cache_v = filled_caches(rng, K, S, E, S)
    for p in (95, 3, 40, 17):  # several launches in a row reuse the fused path's arrival counters
        q = rng.standard_normal((1, H, E)).astype(np.float32)
        want = reference(q, cache_k, cache_v, [p])
        got = decode_attn.decode_attention_fwd(torch.from_numpy(q), torch.from_numpy(cache_k),
                                               torch.from_numpy(cache_v), torch.tensor([p]), split_len=16,
                                               config=dict(FUSED=fused))
        torch.testing.assert_close(got, torch.from_numpy(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 32)])
def test_flash_other_tiles(block_m, block_n):
    rng = np.random.default_rng(1)
    H, K, E, T = 4, 2, 32, 37
    cache_k, cache_v = filled_caches(rng, K, 48, E, T)
    q = rng.standard_normal((T, H, E)).astype(np.float32)
    want = reference(q, cache_k, cache_v, np.arange(T))
    got = flash_attn.flash_attention_fwd(torch.from_numpy(q), torch.from_numpy(cache_k), torch.from_numpy(cache_v),
                                         torch.arange(T), config=dict(BLOCK_M=block_m, BLOCK_N=block_n,
                                                                      num_warps=4, num_stages=2, USE_DESC=False))
    torch.testing.assert_close(got, torch.from_numpy(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_decode_late_query(fused):
    """LATE_Q (q loaded by the first iteration of either loop: the whole blocks', or the partial one's when a
    split has only that) at positions around the blocks and the splits: 0, inside / at the end of a split's first
    block, right after it, a split's last and first slot, the last slot. The slots past the position are NaN: a
    read of one would show. 32-slot splits of 16-slot blocks, GQA 4."""
    rng = np.random.default_rng(2)
    H, K, E, S = 8, 2, 16, 96
    for p in (0, 5, 15, 16, 31, 32, 95):
        cache_k, cache_v = filled_caches(rng, K, S, E, p + 1)
        q = rng.standard_normal((1, H, E)).astype(np.float32)
        want = reference(q, cache_k, cache_v, [p])
        got = decode_attn.decode_attention_fwd(torch.from_numpy(q), torch.from_numpy(cache_k),
                                               torch.from_numpy(cache_v), torch.tensor([p]), split_len=32,
                                               config=dict(LATE_Q=True, FUSED=fused))
        torch.testing.assert_close(got, torch.from_numpy(want), atol=1e-5, rtol=1e-5, msg=f"position {p}")
