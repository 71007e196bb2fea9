"""What limits the 4-bit decode GEMVs (accel/kernels/qgemv.py), and the persistent launch configs, on a CUDA GPU.

`python3 -m tools.bench.qgemv_probe [OUT_DIR] [--models=1b,3b] [--quant=int4:64] [--budget=S] [--no-probes]`
For each decode GEMV as the step runs it (qkv + RoPE + cache write, o + residual, norm + gate_up + SwiGLU, down +
residual, norm + lm_head), µs a call inside one CUDA graph over >= 256 MB of weight copies
(tools.bench.gemv_sweep.graph_us), each config checked against float64 first:
  kernel        the launch table's config (what the engine runs);
  no_scales     the same kernel and config without the group scales / minima: the launcher's one-scale-a-row
                path (the row's first scale, applied once after the sum), so the math alone;
  stream        a kernel reading the same bytes (codes, then scales and minima) over the same grid, tiles, warps
                and pipeline depth that does no math (an xor a word): the ceiling of that launch shape;
  stream_codes  the same without the scales and minima;
  persist       persistent configs (QGemvConfig.programs > 0: a program loops over row blocks; and EXTRA's), then
                the stream probe at the fastest of them (--no-probes: only the table's config and these).
The stream probes read contiguous row blocks (the paired kernels read two half blocks: the same bytes).
Past --budget seconds only the probes of the table's config run. Writes OUT_DIR/qgemv_probe.json and
OUT_DIR/qgemv_table.txt (tools.bench.qgemv_sweep.table_source: tuning.QGEMV with the rows whose fastest timed
config beat the table's by > 2%; to copy by hand once the engine is measured with it).
"""
from __future__ import annotations

import json
import time

import torch
import triton
import triton.language as tl

from accel.kernels.common import sm_count
from accel.kernels.qgemv import qgemv_config, qgemv_fwd
from accel.kernels.qgemv_fused import gate_up_swiglu_qfwd, qkv_rope_qfwd
from accel.kernels.tuning import QGemvConfig
from refimpl.model.config import PRESETS
from tools.bench.decode_variants import run_record
from tools.bench.gemv_sweep import graph_us
from tools.bench.qgemv_sweep import NAMES, Case, shapes, table_source, timed_entry
from tools.bench.quant_roles import bench_args, bench_parser

# the step's kernel for each GEMV: the fusion Case builds inputs for, and how the step calls it
STEP = {"qkv": "rope", "o": "residual", "gate_up": "norm", "down": "residual", "lm_head": "norm"}
ORDER = ["gate_up", "down", "lm_head", "o"]  # persistent candidates, most time a token first (qkv: none)
# gate_up's step kernel (+ SwiGLU) spills at the table's 32 rows (its row came from the norm GEMV's sweep): half
EXTRA = {"gate_up": [QGemvConfig(16, 1024, 2, 1, 3), QGemvConfig(16, 1024, 1, 1, 3)]}


@triton.jit
def _stream_tile(Qw, S, M, rows_c, kb0, kb_hi, stride_q, stride_s, n_groups, BLOCK_N: tl.constexpr,
                 BYTES: tl.constexpr, GBYTES: tl.constexpr, GPT: tl.constexpr, SCALES: tl.constexpr,
                 HAS_MIN: tl.constexpr):
    """The xor of a [BLOCK_N, BYTES] tile's words (and of its GPT scales / minima a row: GBYTES code bytes a
    group, so the tile at byte kb0 starts at group kb0 / GBYTES) -> [BLOCK_N] int32."""
    jw = kb0 // 4 + tl.arange(0, BYTES // 4)
    w = tl.load(Qw + rows_c[:, None] * (stride_q // 4) + jw[None, :], mask=jw[None, :] < kb_hi // 4, other=0)
    acc = tl.xor_sum(w, axis=1)
    if SCALES:
        g = kb0 // GBYTES + tl.arange(0, GPT)
        inside = g[None, :] < n_groups
        s = tl.load(S + rows_c[:, None] * stride_s + g[None, :], mask=inside, other=0.0)
        acc ^= tl.xor_sum(s.to(tl.int16, bitcast=True).to(tl.int32), axis=1)
        if HAS_MIN:
            m = tl.load(M + rows_c[:, None] * stride_s + g[None, :], mask=inside, other=0.0)
            acc ^= tl.xor_sum(m.to(tl.int16, bitcast=True).to(tl.int32), axis=1)
    return acc


@triton.jit
def _stream_kernel(Q, S, M, Y, N, KB, stride_q, stride_s, n_groups, kb_split, BLOCK_N: tl.constexpr,
                   BYTES: tl.constexpr, GBYTES: tl.constexpr, GPT: tl.constexpr, STAGES: tl.constexpr,
                   SCALES: tl.constexpr, HAS_MIN: tl.constexpr, PERSIST: tl.constexpr):
    """The quantized GEMV's loads without its math: program (row block, K slice) as `_qgemv_kernel`'s, or
    (PERSIST) row blocks b, b + programs, ... of one tile a row; one int32 a row to Y so nothing is dropped."""
    Qw = Q.to(tl.pointer_type(tl.int32), bitcast=True)
    b = tl.program_id(0)
    if PERSIST:
        for blk in tl.range(b, tl.cdiv(N, BLOCK_N), tl.num_programs(0), num_stages=STAGES):
            rows = blk * BLOCK_N + tl.arange(0, BLOCK_N)
            rows_c = tl.minimum(rows, N - 1).to(tl.int64)
            acc = _stream_tile(Qw, S, M, rows_c, 0, KB, stride_q, stride_s, n_groups, BLOCK_N, BYTES, GBYTES, GPT,
                               SCALES, HAS_MIN)
            tl.store(Y + rows, acc, mask=rows < N)
    else:
        sp = tl.program_id(1)
        rows = b * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_c = tl.minimum(rows, N - 1).to(tl.int64)
        kb_lo = sp * kb_split
        kb_hi = tl.minimum(kb_lo + kb_split, KB)
        acc = tl.zeros([BLOCK_N], dtype=tl.int32)
        for kb0 in tl.range(kb_lo, kb_hi, BYTES, num_stages=STAGES):
            acc ^= _stream_tile(Qw, S, M, rows_c, kb0, kb_hi, stride_q, stride_s, n_groups, BLOCK_N, BYTES,
                                GBYTES, GPT, SCALES, HAS_MIN)
        tl.store(Y + sp * N + rows, acc, mask=rows < N)


def stream_call(t, cfg: QGemvConfig, scales: bool, out: torch.Tensor):
    """One stream probe launch over QuantTensor t with cfg's grid and tiles (out: int32, >= split·N)."""
    N, K = t.shape
    nbytes = cfg.block_k * t.bits // 8
    kb = t.q.shape[1]
    k_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k * t.bits // 8
    blocks = triton.cdiv(N, cfg.block_n)
    grid = (min(cfg.programs, blocks), 1) if cfg.programs else (blocks, triton.cdiv(kb, k_split))
    _stream_kernel[grid](t.q, t.scale, t.low if t.low is not None else t.scale, out, N, kb, t.q.stride(0),
                         t.scale.stride(0), t.scale.shape[1], k_split, BLOCK_N=cfg.block_n, BYTES=nbytes,
                         GBYTES=t.group * t.bits // 8, GPT=max(1, cfg.block_k // t.group), STAGES=cfg.stages,
                         SCALES=scales, HAS_MIN=t.low is not None, PERSIST=cfg.programs > 0, num_warps=cfg.warps,
                         num_stages=cfg.stages)


class StepCase(Case):
    """Case with the step's own kernel for gate_up (norm + GEMV + SwiGLU) and a "no scales" variant."""

    def __init__(self, what: str, N: int, K: int, spec: str, cfg):
        super().__init__(what, N, K, STEP[what], spec, cfg)
        self.stream_out = torch.empty(16 * N, dtype=torch.int32, device="cuda")

    def call(self, t, config, out=None, scales: bool = True):
        low, group = (t.low, t.group) if scales else (None, t.K)  # group = K, no minima: the one-scale-a-row path
        if self.what == "gate_up":
            return gate_up_swiglu_qfwd(t.q, t.scale, low, t.bits, t.offset, group, t.K, self.x, self.nw, 1e-5,
                                       out=None if out is None else out[:, :self.N // 2], config=config)
        if scales:
            return super().call(t, config, out)
        args = (t.q, t.scale, None, t.bits, t.offset, t.K, t.K, self.x)
        if self.fusion == "rope":
            return qkv_rope_qfwd(*args, self.nw, 1e-5, self.cos, self.sin, self.pos, self.ck, self.cv, config=config)
        if self.fusion == "norm":
            return qgemv_fwd(*args, norm_weight=self.nw, eps=1e-5, config=config, out=out)
        r = self.r.clone() if out is None else out
        return qgemv_fwd(*args, residual=r, out=r, config=config)

    def check(self, config) -> float:
        if self.what != "gate_up":
            return super().check(config)
        return self.gate_up_swiglu_error(self.call(self.t, config))

    def stream_us(self, config, scales: bool) -> float:
        return graph_us([lambda t=t: stream_call(t, config, scales, self.stream_out) for t in self.copies])


def persistent_candidates(N: int, K: int, bits: int, sms: int, paired: bool) -> list[QGemvConfig]:
    """One tile a row (block_k = K rounded up to a power of 2), tiles of 4-32 KB, 2-4 warps, 3 stages, 2-6
    programs an SM, each count rounded so that the row blocks deal evenly (a program count is a launch argument:
    no compile of its own). paired: the gate_up kernel, whose row block is block_n / 2 rows of N / 2."""
    bk = triton.next_power_of_2(K)
    row = bk * bits // 8
    tiles = {1024: [(8, 2), (16, 2), (16, 4), (32, 4)], 2048: [(8, 2), (8, 4), (16, 4)],
             4096: [(4, 2), (4, 4), (8, 4)]}
    out = []
    for bn, warps in tiles.get(row, [(max(2, 16384 // row), 4)]):
        blocks = triton.cdiv(N // 2, bn // 2) if paired else triton.cdiv(N, bn)
        for per_sm in (2, 3, 4, 6):
            programs = triton.cdiv(blocks, triton.cdiv(blocks, per_sm * sms))  # the same row blocks each
            c = QGemvConfig(bn, bk, warps, 1, 3, programs)
            if c not in out:
                out.append(c)
    return out



def probe(models: list[str], spec: str, budget: float, path: str | None = None, probes: bool = True) -> dict:
    """probes False: only the table's config and the persistent candidates (no no-scales / stream probes)."""
    deadline = time.time() + budget
    sms = sm_count(torch.device("cuda"))
    result = run_record(triton=triton.__version__, quant=spec, rows=[])

    def save():  # after every row: a run cut short keeps what it measured
        if path:
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
    cases = {}
    for m in models:  # the probes at the table's config, every GEMV
        cfg = PRESETS[NAMES[m]]
        for what, (N, K, _) in shapes(cfg).items():
            case = StepCase(what, N, K, spec, cfg)
            t = case.t
            table = qgemv_config(N, K, t.bits, t.group, sms, what == "qkv")
            row = {"model": m, "gemv": what, "N": N, "K": K, "quant": spec, "bits": t.bits, "group": t.group,
                   "bytes": t.nbytes, "codes_bytes": t.q.nbytes, "table": list(table),
                   "kernel": timed_entry(case, table, t.nbytes)}
            row["configs"] = [row["kernel"]]
            if probes:
                row["no_scales_us"] = case.time_us(table, scales=False)
            if probes and what != "qkv":  # the stream probe's grid is _qgemv_kernel's (qkv's: head pairs)
                row["stream_us"] = case.stream_us(table, True)
                row["stream_codes_us"] = case.stream_us(table, False)
            print(f"{m} {what:<8} table {table}: kernel {row['kernel'].get('us', float('nan')):7.2f} µs, no scales "
                  f"{row.get('no_scales_us', float('nan')):7.2f}, stream {row.get('stream_us', float('nan')):7.2f}, "
                  f"codes only {row.get('stream_codes_us', float('nan')):7.2f}", flush=True)
            result["rows"].append(row)
            save()
            cases[(m, what)] = (case, row)
    for what in ORDER:  # then the persistent configs, by the time they take a token
        for m in models:
            case, row = cases[(m, what)]
            t = case.t
            others = EXTRA.get(what, []) + persistent_candidates(row["N"], row["K"], t.bits, sms, what == "gate_up")
            for c in others:
                if time.time() > deadline:
                    break
                row["configs"].append(timed_entry(case, c, t.nbytes))
            timed = [e for e in row["configs"][1:] if "us" in e]
            if timed:
                best = min(timed, key=lambda e: e["us"])
                row["best"] = best
                row["best_stream_us"] = case.stream_us(QGemvConfig(*best["config"]), True)
                print(f"{m} {what:<8} best other {best['config']}: {best['us']:7.2f} µs ({best['tb_s']:.2f} TB/s;"
                      f" table {row['kernel'].get('us', float('nan')):7.2f}), its stream {row['best_stream_us']:7.2f}",
                      flush=True)
            save()
    for (m, what), (case, row) in cases.items():
        if "best" not in row and "us" in row["kernel"]:
            row["best"] = row["kernel"]
    return result


def main(argv=None) -> None:
    ap = bench_parser("tools.bench.qgemv_probe", __doc__, specs="int4:64", flag="--quant")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; past it only the table's probes run")
    ap.add_argument("--no-probes", action="store_true", help="only the table's config and the persistent ones")
    args, models, specs, _ = bench_args(ap, argv)
    if len(specs) != 1:
        ap.error(f"--quant {args.specs}: expected one format")
    result = probe(models, specs[0], args.budget, f"{args.out_dir}/qgemv_probe.json", not args.no_probes)
    with open(f"{args.out_dir}/qgemv_table.txt", "w") as f:
        f.write(table_source(result, sm_count(torch.device("cuda"))) + "\n")


if __name__ == "__main__":
    main()
