"""The paged decode attention (accel/kernels/paged_attn.py under the interpreter, and its torch version) against a
plain reference: each sequence's keys gathered one position at a time through its block table, then softmax
attention per query head over its kv head. Odd shapes: GQA ratios 1, 4 and MQA, lengths not multiples of the block
size, a length-0 padding row, tables wider than every sequence."""
import math

import pytest

torch = pytest.importorskip("torch")

from accel.kernels import paged_attn  # noqa: E402
from accel.kernels.paged_attn import paged_decode_attention_fwd  # noqa: E402
from accel.ops.dispatch import INTERPRET  # noqa: E402
from accel.ops.paged import torch_paged_decode_attention  # noqa: E402


def reference(q, cache_k, cache_v, tables, lens, block_size):
    B, H, E = q.shape
    K = cache_k.shape[0]
    out = torch.zeros(B, H, E, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            continue
        slots = [int(tables[b, p // block_size]) * block_size + p % block_size for p in range(n)]
        for h in range(H):
            kh = h // (H // K)
            k = cache_k[kh, slots].double()  # [n, E]
            v = cache_v[kh, slots].double()
            w = torch.softmax(k @ q[b, h].double() / math.sqrt(E), dim=0)  # [n]
            out[b, h] = w @ v
    return out


def case(H, K, E, lens, block_size, dtype=torch.float32, num_blocks=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    q = torch.randn(B, H, E, generator=g).to(dtype)
    cache_k = torch.randn(K, num_blocks * block_size, E, generator=g).to(dtype)
    cache_v = torch.randn(K, num_blocks * block_size, E, generator=g).to(dtype)
    width = max(1, max(-(-n // block_size) for n in lens)) + 1  # one spare column: never read
    perm = torch.randperm(num_blocks, generator=g)  # blocks scattered over the pool, none shared
    tables = perm[: B * width].view(B, width).to(torch.int32).contiguous()
    return q, cache_k, cache_v, tables, torch.tensor(lens, dtype=torch.int32)


SHAPES = [  # (H, K, E, lens, block_size)
    (4, 4, 16, [1, 17, 5], 16),  # MHA
    (8, 2, 16, [33, 7, 0, 64], 16),  # GQA 4, a padding row (length 0)
    (4, 1, 24, [3, 50, 16], 8),  # MQA, E not a power of two, block 8
    (6, 2, 32, [29, 1], 4),  # GQA 3, block smaller than the tile
    (8, 2, 16, [70, 33, 0, 5], 32),  # blocks of two or more tiles: a tile's keys consecutive slots of one block
]


@pytest.mark.parametrize("H,K,E,lens,block_size", SHAPES)
@pytest.mark.parametrize("impl", ["triton", "triton_even", "torch"])
def test_paged_decode_matches_reference(H, K, E, lens, block_size, impl):
    if impl != "torch" and not INTERPRET:
        pytest.skip("the kernel on CPU tensors needs TRITON_INTERPRET=1 (on a GPU machine: test_paged_decode_gpu)")
    q, ck, cv, tables, lens_t = case(H, K, E, lens, block_size)
    fn = paged_decode_attention_fwd if impl != "torch" else torch_paged_decode_attention
    kw = {"triton": {"split_len": 16},  # several splits per sequence at these lengths
          "triton_even": {"even": True}, "torch": {}}[impl]  # split_count's splits: several at these batch sizes
    got = fn(q, ck, cv, tables, lens_t, block_size, **kw)
    want = reference(q, ck, cv, tables, lens_t, block_size)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not INTERPRET, reason="the kernel on CPU tensors needs TRITON_INTERPRET=1")
def test_paged_decode_ignores_slots_past_the_length():
    """Garbage (NaN) in the pool outside each sequence's positions changes nothing."""
    q, ck, cv, tables, lens = case(8, 2, 16, [9, 20], 16)
    clean = paged_decode_attention_fwd(q, ck, cv, tables, lens, 16, split_len=16)
    used = {int(tables[b, p // 16]) * 16 + p % 16 for b, n in enumerate(lens.tolist()) for p in range(n)}
    for s in range(ck.shape[1]):
        if s not in used:
            ck[:, s], cv[:, s] = float("nan"), float("nan")
    for fn in (paged_decode_attention_fwd, torch_paged_decode_attention):
        torch.testing.assert_close(fn(q, ck, cv, tables, lens, 16), clean, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])  # bf16: inputs round to 8 bits
@pytest.mark.parametrize("block_size", [16, 64, 128])  # rows gathered per block; a tile one block; a tile half a block
def test_paged_decode_gpu(dtype, tol, block_size):
    lens = [1, 15, 16, 17, 300, 1000, 2049, 0]
    q, ck, cv, tables, lens_t = case(32, 8, 64, lens, block_size, dtype=dtype, num_blocks=19200 // block_size)
    want = reference(q, ck, cv, tables, lens_t, block_size)
    for even in (False, True):
        got = paged_decode_attention_fwd(q.cuda(), ck.cuda(), cv.cuda(), tables.cuda(), lens_t.cuda(), block_size,
                                         even=even)
        torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol)
    via_torch = torch_paged_decode_attention(q.cuda(), ck.cuda(), cv.cuda(), tables.cuda(), lens_t.cuda(),
                                             block_size)
    torch.testing.assert_close(via_torch.cpu().double(), want, rtol=tol, atol=tol)


@pytest.mark.skipif(not INTERPRET, reason="the kernel on CPU tensors needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("block_n", [16, 32])
def test_paged_decode_combines_every_group_launch_after_launch(block_n):
    """Several splits a sequence: the group's last split combines them (one split: written directly); run twice, the
    second into a NaN-filled output (the arrival counts must be back at zero for the second launch to combine every
    group)."""
    for H, K, E, lens, block_size in SHAPES:
        q, ck, cv, tables, lens_t = case(H, K, E, lens, block_size)
        want = reference(q, ck, cv, tables, lens_t, block_size)
        for out in (None, torch.full_like(q, float("nan"))):
            got = paged_decode_attention_fwd(q, ck, cv, tables, lens_t, block_size, split_len=32, out=out,
                                             config={"BLOCK_N": block_n})
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not INTERPRET, reason="the kernel on CPU tensors needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("programs", [1, 64, 4096])
def test_even_splits_match_the_reference_at_every_split_count(programs, monkeypatch):
    """even=True: 1 split a sequence, a few, and as many as the tiles (split_count's bounds), launched twice (the
    arrival counts back at zero)."""
    monkeypatch.setattr(paged_attn, "SPLIT_PROGRAMS", programs)
    H, K, E, lens, block_size = 8, 2, 16, [33, 7, 0, 64, 50, 1], 16
    q, ck, cv, tables, lens_t = case(H, K, E, lens, block_size, num_blocks=60)
    want = reference(q, ck, cv, tables, lens_t, block_size)
    for out in (None, torch.full_like(q, float("nan"))):
        got = paged_decode_attention_fwd(q, ck, cv, tables, lens_t, block_size, out=out, even=True)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not INTERPRET, reason="the kernel on CPU tensors needs TRITON_INTERPRET=1")
def test_rows_do_not_depend_on_the_batch_or_the_tables_width():
    """A sequence's output bits are the same alone (its table just wide enough) and in a batch whose tables are
    wider (more splits launched, past its length): what the batch-invariant mode relies on."""
    q, ck, cv, tables, lens = case(8, 2, 16, [33, 7, 0, 64, 50], 16, num_blocks=60)
    wide = torch.zeros(5, 12, dtype=torch.int32)  # 12 blocks: 6 splits of 32, most past every length
    wide[:, :tables.shape[1]] = tables
    batch = paged_decode_attention_fwd(q, ck, cv, wide, lens, 16, split_len=32)
    for b, n in enumerate(lens.tolist()):
        alone = paged_decode_attention_fwd(q[b:b + 1], ck, cv, tables[b:b + 1, :max(1, -(-n // 16))], lens[b:b + 1],
                                           16, split_len=32)
        assert torch.equal(alone[0], batch[b]), b
