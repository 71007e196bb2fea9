"""The quantized GEMV's inner products (accel/kernels/qgemv.py): a row's codes times f(x) as integers.

Per 16-byte chunk of a row (CHUNK columns, inside one group), f(x) becomes the chunk's 22-bit fixed point F
(`fixed_point`), split into three byte planes; dp4a multiplies 4 codes by 4 bytes an instruction and sums into
int32 (`chunk_dots`, inline PTX on the GPU; the same integers with Triton ops under the interpreter), so the codes
never need converting to float. `group_param` reads a group's scale or minimum without disturbing the tile's layout.
"""
from __future__ import annotations

import triton
import triton.language as tl


def _dp4a_asm(bits: int) -> str:
    """PTX: one row's 16-byte chunk of codes (4 words, $1-$4) · f(x)'s fixed-point planes (byte p of F, 4 columns
    a word: $5-$8 plane 0 of words 0-3, $9-$12 plane 1, $13-$16 plane 2; int4: those of the even (low-nibble)
    columns, then $17-$28 the odd ones) -> $0 = float(Σ q·F), exactly Σ q·(F >> 8) · 256 + Σ q·(F & 255) with
    two roundings. dp4a: 4 byte products summed into int32, one instruction; int8 codes are signed bytes, int4
    nibbles unsigned bytes (& 0x0F0F0F0F of the word and of the word >> 4); plane 2 signed, planes 0 and 1 not."""
    ct = "s32" if bits == 8 else "u32"
    lines = ["{ .reg .b32 w<8>, a, b, t; .reg .f32 fa, fb;"]
    if bits == 8:
        words = [f"${1 + j}" for j in range(4)]
    else:
        words = [f"w{j}" for j in range(8)]
        for j in range(4):
            lines.append(f"and.b32 w{j}, ${1 + j}, 0x0F0F0F0F; shr.u32 t, ${1 + j}, 4;")
            lines.append(f"and.b32 w{4 + j}, t, 0x0F0F0F0F;")
    planes = lambda p: [f"${5 + p * 4 + j}" for j in range(4)] + (  # noqa: E731
        [f"${17 + p * 4 + j}" for j in range(4)] if bits == 4 else [])
    chain = lambda acc, p, bt, first: [  # noqa: E731
        f"dp4a.{ct}.{bt} {acc}, {w}, {x}, {first if i == 0 else acc};"
        for i, (w, x) in enumerate(zip(words, planes(p)))]
    lines += chain("a", 2, "s32", "0") + ["shl.b32 a, a, 8;"] + chain("a", 1, "u32", "a") + chain("b", 0, "u32", "0")
    lines.append("cvt.rn.f32.s32 fa, a; cvt.rn.f32.s32 fb, b; fma.rn.f32 $0, fa, 0f43800000, fb; }")
    return "\n".join(lines)


_DP4A_INT8 = tl.constexpr(_dp4a_asm(8))
_DP4A_INT4 = tl.constexpr(_dp4a_asm(4))
# F0..F3 (int32, 4 columns) -> byte 0, byte 1 and byte 2 of each, packed 4 to a word (the dp4a operands)
_PLANES = tl.constexpr("""{ .reg .b32 t, u; prmt.b32 t, $3, $4, 0x5140; prmt.b32 u, $5, $6, 0x5140;
prmt.b32 $0, t, u, 0x5410; prmt.b32 $1, t, u, 0x7632; prmt.b32 t, $3, $4, 0x0062; prmt.b32 u, $5, $6, 0x0062;
prmt.b32 $2, t, u, 0x5410; }""")
# int4: F0..F7 (8 consecutive columns: one word of nibbles) -> planes 0, 1, 2 of the even columns, then the odd
_PLANES8 = tl.constexpr("""{ .reg .b32 t, u; prmt.b32 t, $6, $8, 0x5140; prmt.b32 u, $10, $12, 0x5140;
prmt.b32 $0, t, u, 0x5410; prmt.b32 $1, t, u, 0x7632; prmt.b32 t, $6, $8, 0x0062; prmt.b32 u, $10, $12, 0x0062;
prmt.b32 $2, t, u, 0x5410; prmt.b32 t, $7, $9, 0x5140; prmt.b32 u, $11, $13, 0x5140;
prmt.b32 $3, t, u, 0x5410; prmt.b32 $4, t, u, 0x7632; prmt.b32 t, $7, $9, 0x0062; prmt.b32 u, $11, $13, 0x0062;
prmt.b32 $5, t, u, 0x5410; }""")


@triton.jit
def fixed_point(fx, NC: tl.constexpr, CHUNK: tl.constexpr):
    """f(x) [BK] fp32 -> F [NC, CHUNK] int32 and 2^-s [NC]: F = round(f(x) · 2^s) with 2^s a chunk's power of 2
    that puts its largest |f(x)| in [2^21, 2^22), so f(x) = F · 2^-s exactly for the bf16 values within 2^14 of
    that maximum (8-bit significands) and within 2^-22 of it for the rest: below an fp32 sum's own rounding for
    bf16 / fp16 f(x); for fp32 f(x) up to 2^-22 of the chunk's maximum an element. Rounded by adding 1.5·2^23 (F
    lands in the low 23 bits of the float). A NaN or ±inf in a chunk makes its 2^-s NaN: the sum is NaN, not a
    finite value (the integers cannot carry them)."""
    fc = tl.reshape(fx, [NC, CHUNK])
    # the largest |f(x)|'s bits by integer max: NaN's are above inf's, inf's above any finite value's
    amax = tl.max(tl.abs(fc).to(tl.int32, bitcast=True), axis=1)  # [NC]
    eb = (amax >> 23) & 255  # [NC] the biased exponent e + 127 (255: inf or NaN)
    scale = (tl.minimum(275 - eb, 254) << 23).to(tl.float32, bitcast=True)  # 2^(21 - e)
    F = (fc * scale[:, None] + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000
    nan = tl.full([NC], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    return F, tl.where(eb == 255, nan, 1.0 / scale)


@triton.jit
def _words4(t, LEAD: tl.constexpr, NC: tl.constexpr):
    """[LEAD, NC·4] -> its 4 columns of each group of 4 as [LEAD, NC] tensors (in-thread: no data moves)."""
    a, b = tl.split(tl.reshape(t, [LEAD, NC, 2, 2]))
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def _spread(p, NC: tl.constexpr):
    """[4·NC, 1] words of a plane (chunk-major) -> its 4 words of each chunk as [1, NC] tensors."""
    return _words4(tl.reshape(p, [1, NC * 4]), 1, NC)


@triton.jit
def _plane_words(F, NC: tl.constexpr):
    """F [NC, 16] int32 -> 12 [NC] words: planes 0, 1, 2 (byte p of F), words 0-3 of the chunk, 4 columns a word."""
    f0, f1, f2, f3 = _words4(tl.reshape(F, [NC * 4, 4]), NC * 4, 1)  # [NC·4, 1] byte b of each word
    p0, p1, p2 = tl.inline_asm_elementwise(_PLANES, "=r,=r,=r,r,r,r,r", [f0, f1, f2, f3],
                                           dtype=(tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    a0, a1, a2, a3 = _spread(p0, NC)
    b0, b1, b2, b3 = _spread(p1, NC)
    c0, c1, c2, c3 = _spread(p2, NC)
    return a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3


@triton.jit
def chunk_dots(Q, rows_c, kb0, jw, KB, stride_q, F, BITS: tl.constexpr, BLOCK_N: tl.constexpr, NC: tl.constexpr,
                CHUNK: tl.constexpr, FAST: tl.constexpr):
    """Σ q·F per row and 16-byte chunk -> [BN, NC] fp32 (Σ q·(F >> 8) · 256 + Σ q·(F & 255)), q the signed int8
    code or the nibble. FAST (the GPU): dp4a on the codes' 32-bit words; else the same integers with Triton ops."""
    if FAST:
        Qw = Q.to(tl.pointer_type(tl.int32), bitcast=True)
        wk = kb0 // 4 + jw[None, :]
        w = tl.load(Qw + rows_c[:, None] * (stride_q // 4) + wk, mask=wk < KB // 4, other=0)  # [BN, 4·NC] words
        w0, w1, w2, w3 = _words4(w, BLOCK_N, NC)
        if BITS == 8:
            a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3 = _plane_words(F, NC)
            dots = tl.inline_asm_elementwise(_DP4A_INT8, "=r" + ",r" * 16, [w0, w1, w2, w3, a0, a1, a2, a3, b0, b1,
                                             b2, b3, c0, c1, c2, c3], dtype=tl.float32, is_pure=True, pack=1)
        else:
            ga, gb = tl.split(tl.reshape(F, [NC * 4, 4, 2]))  # [word, i]: columns 8·word + 2i and 8·word + 2i + 1
            g0, g2, g4, g6 = _words4(ga, NC * 4, 1)
            g1, g3, g5, g7 = _words4(gb, NC * 4, 1)
            pa0, pa1, pa2, pb0, pb1, pb2 = tl.inline_asm_elementwise(
                _PLANES8, "=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r", [g0, g1, g2, g3, g4, g5, g6, g7],
                dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
            a0, a1, a2, a3 = _spread(pa0, NC)
            b0, b1, b2, b3 = _spread(pa1, NC)
            c0, c1, c2, c3 = _spread(pa2, NC)
            d0, d1, d2, d3 = _spread(pb0, NC)
            e0, e1, e2, e3 = _spread(pb1, NC)
            f0, f1, f2, f3 = _spread(pb2, NC)
            dots = tl.inline_asm_elementwise(_DP4A_INT4, "=r" + ",r" * 28, [w0, w1, w2, w3, a0, a1, a2, a3, b0, b1,
                                             b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3],
                                             dtype=tl.float32, is_pure=True, pack=1)
    else:
        jb = tl.arange(0, NC * 16)
        byte = tl.load(Q + rows_c[:, None] * stride_q + kb0 + jb[None, :], mask=kb0 + jb[None, :] < KB, other=0)
        q = byte.to(tl.int32)  # int8: signed; int4: the byte
        if BITS == 4:
            q = tl.reshape(tl.join(q & 15, q >> 4), [BLOCK_N, NC * 32])  # [BN, BK] nibbles in column order
        Fk = tl.reshape(F, [NC * CHUNK])
        hi = tl.sum(tl.reshape(q * (Fk >> 8)[None, :], [BLOCK_N, NC, CHUNK]), axis=2)
        lo = tl.sum(tl.reshape(q * (Fk & 255)[None, :], [BLOCK_N, NC, CHUNK]), axis=2)
        dots = hi.to(tl.float32) * 256.0 + lo.to(tl.float32)
    return dots


@triton.jit
def group_param(ptrs, inside, FAST: tl.constexpr):
    """A group's scale / minimum -> fp32. FAST: an inline-PTX load, so that Triton does not lay the whole tile's
    products out after this small [BN, NC] load (it did: rows across lanes, the codes through shared memory).
    The asm is pure, so the compiler may move it above a PDL wait: fine only because scales are read-only after
    load."""
    if FAST:
        dt: tl.constexpr = ptrs.dtype.element_ty
        if dt == tl.float32:
            v = tl.inline_asm_elementwise("""{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0;
@p ld.global.nc.b32 $0, [$1]; }""", "=r,l,r", [ptrs, inside.to(tl.int32)], dtype=tl.float32, is_pure=True, pack=1)
        elif dt == tl.float16:
            v = tl.inline_asm_elementwise("""{ .reg .pred p; .reg .b16 h; setp.ne.b32 p, $2, 0; mov.b16 h, 0;
@p ld.global.nc.b16 h, [$1]; cvt.f32.f16 $0, h; }""", "=r,l,r", [ptrs, inside.to(tl.int32)], dtype=tl.float32,
                                          is_pure=True, pack=1)
        else:
            tl.static_assert(dt == tl.bfloat16, "scales and minima: fp32, fp16 or bf16")
            v = tl.inline_asm_elementwise("""{ .reg .pred p; .reg .b16 h, z; setp.ne.b32 p, $2, 0; mov.b16 h, 0;
mov.b16 z, 0; @p ld.global.nc.b16 h, [$1]; mov.b32 $0, {z, h}; }""", "=r,l,r", [ptrs, inside.to(tl.int32)],
                                          dtype=tl.float32, is_pure=True, pack=1)
    else:
        v = tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
    return v
