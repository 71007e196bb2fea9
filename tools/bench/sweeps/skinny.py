"""The batched decode step's GEMMs: accel/kernels/matmul.py's weight-streaming kernel against cuBLAS (F.linear), per
weight shape and row count: the sweep that regenerates accel/kernels/tuning.py's MATMUL table.

    python3 -m tools.bench.sweeps.skinny OUT_DIR [--models 1b,3b] [--rows 64,32,128,8,256] [--budget S]

For each row count M (in the order given: the first gets the whole budget first), each model's five linear layers
(qkv, o, gate_up, down, lm_head: [M, K] activations against the [N, K] weight as accel's Weights hold it) are timed
    cublas       F.linear(x, w);
    matmul[cfg]  matmul_fwd(x, w, MatmulConfig) over `candidates` (tiles, split-K, warps, pipeline depth), each
                 checked first against a float64 product (bf16 tolerance, and no worse than 2x cuBLAS's error) and
                 for bitwise-equal repeats; a config that fails either check (or to compile) is not timed.
Rates: GB/s of weight bytes, and % of the copy bandwidth (read + write, measured in the same run: common.
copy_bandwidth), the batched step's roofline counting each weight byte once. Writes OUT_DIR/skinny_sweep.json after
every row (a run cut short keeps what it measured) and OUT_DIR/matmul_table.txt, the MATMUL rows where the kernel
beat cuBLAS by more than MARGIN: copy them into accel/kernels/tuning.py by hand, the numbers into docs/performance.md.
--budget S: past S seconds only cuBLAS and the first candidate are timed.
--swiglu: the gate_up weights only, the GEMM with SwiGLU in its epilogue (swiglu_matmul_fwd, over
`swiglu_candidates`) against the path it would replace (the GEMM as MATMUL lists it, else cuBLAS, then the SwiGLU
kernel; cuBLAS + SwiGLU timed too), each config checked bitwise against the same config's GEMM then SwiGLU:
OUT_DIR/swiglu_sweep.json and swiglu_table.txt, the SWIGLU_MATMUL rows.
Timing: common.graph_us, one CUDA graph holding one call per weight copy, >= 256 MB of copies (> the L2, as a
decode step's layers are), replayed 10 times; median per call in µs.
"""
from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from accel.kernels.common import sm_count
from accel.kernels.matmul import matmul_fwd, row_bucket, swiglu_matmul_fwd
from accel.kernels.swiglu import swiglu_gate_up_fwd
from accel.kernels.tuning import MATMUL, MatmulConfig
from tools.bench.common import (copy_bandwidth, decode_gemv_shapes, graph_us, model_config, parser, record,
                                require_cuda, write_record)

# (BLOCK_N, BLOCK_K, warps, stages): 64-256 weight rows on the tensor core's M side (one or two warpgroups), 64-256
# K columns a tile, the pipeline as deep as the shared memory allows (fit_stages); (64, 64, 4, 3) takes a quarter of
# an SM's shared memory (several programs an SM), 256 rows halve the activation tiles' reads against 128
TILES = [(64, 128, 4, 4), (64, 64, 4, 6), (128, 64, 8, 4), (128, 128, 8, 3), (64, 256, 4, 3), (64, 64, 4, 3),
         (256, 64, 8, 3)]
SMEM = 200 * 1024  # bytes of shared memory the pipeline may take (228 KB a block on sm_90, less Triton's own)
MARGIN = 0.03  # the kernel goes into the table where it beat cuBLAS by more than this
DEADLINE = float("inf")  # time.time() past which only cuBLAS and the first candidate are timed (main's budget)


def shapes(model: str) -> dict:
    """The batched step's linear layers: name -> (N, K)."""
    return {name: (N, K) for name, (N, K, _) in decode_gemv_shapes(model_config(model)).items()}


def fit_stages(bn: int, bk: int, bm: int, stages: int) -> int:
    """The pipeline depth, lowered until its tiles fit SMEM (at least 2)."""
    while stages > 2 and stages * (bn + bm) * bk * 2 > SMEM:
        stages -= 1
    return stages


def candidates(N: int, K: int, M: int, sms: int) -> list[MatmulConfig]:
    """Per tile of TILES: all rows of x in one block (up to 128; 256 rows also as one 256-row block, 8 warps, the
    64-column tiles), the smallest split-K in 1, 2, 4, 8 (dividing K's tiles) that gives (nearly) every SM a program, and up to 128 rows
    twice it."""
    out = []
    bms = [min(max(16, row_bucket(M)), 128)] + ([256] if M > 128 else [])
    for bm in bms:
        for bn, bk, warps, stages in TILES if bm < 256 else TILES[1:3]:
            if bk > K or K % bk:
                continue
            tiles = -(-N // bn) * -(-M // bm)
            split = 1
            while split < 8 and tiles * split < 0.9 * sms and (K // bk) % (split * 2) == 0:
                split *= 2
            more = split > 1 and M <= 128 and (K // bk) % (split * 2) == 0
            for s in dict.fromkeys([split, split * 2 if more else split]):
                out.append(MatmulConfig(bn, bk, bm, s, 8 if bm == 256 else warps, fit_stages(bn, bk, bm, stages)))
    out = list(dict.fromkeys(out))
    return out if time.time() < DEADLINE else out[:1]


def swiglu_candidates(N: int, K: int, M: int, sms: int) -> list[MatmulConfig]:
    """The fused gate_up + SwiGLU's configs for the [N = 2F, K] weight (block_n: gate rows, 2·block_n weight rows a
    program): MATMUL's row for the shape and bucket with half its rows (the same programs and bytes each), the
    8-warp 128-row tiles as 64 gate + 64 up rows, then `candidates` over the F gate rows up to 128 of them a program, the pipeline refit to the two weight tiles (those
    that do not fit at two stages left out)."""
    out = []
    table = MATMUL.get((N, K, row_bucket(M)))
    if table is not None and table.block_n >= 32:
        out.append(table._replace(block_n=table.block_n // 2))
    cands = candidates(N // 2, K, M, sms)
    # the 128-row tiles of the plain GEMM's best (8 warps) as 64 gate + 64 up rows, first
    halves = [c._replace(block_n=64) for c in candidates(N, K, M, sms) if c.block_n == 128 and c.warps == 8]
    for c in halves + cands:
        if c.block_n > 128:  # 512 weight rows and two [256, BM] fp32 accumulators a program: registers spill
            continue
        c = c._replace(stages=fit_stages(2 * c.block_n, c.block_k, c.block_m, c.stages))
        if c.stages * (2 * c.block_n + c.block_m) * c.block_k * 2 <= SMEM:  # two stages may not fit either
            out.append(c)
    out = list(dict.fromkeys(out))
    return out if time.time() < DEADLINE else out[:1]


def _weights(N: int, K: int, M: int, dtype, dev, min_bytes: int):
    copies = max(2, -(-min_bytes // (N * K * 2)))
    g = torch.Generator(device=dev).manual_seed(N + K + M)
    ws = [(torch.randn(N, K, device=dev, generator=g) * K ** -0.5).to(dtype) for _ in range(copies)]
    return ws, torch.randn(M, K, device=dev, generator=g).to(dtype)


def sweep_swiglu_case(N: int, K: int, M: int, dtype=torch.bfloat16, device: str = "cuda", timer=graph_us,
                      min_bytes: int = 256 * 2**20, configs: list[MatmulConfig] | None = None) -> dict:
    """Times the unfused paths (cuBLAS then SwiGLU; the MATMUL row's config then SwiGLU, where listed) and the fused
    kernel over `configs` (default: `swiglu_candidates`) at one (2F = N, K, M); a config whose output is not the
    bits of its own GEMM then SwiGLU is reported with its time under "failed", never chosen."""
    dev = torch.device(device)
    ws, x = _weights(N, K, M, dtype, dev, min_bytes)
    table = MATMUL.get((N, K, row_bucket(M)))
    row = {"N": N, "K": K, "M": M, "copies": len(ws), "mb": N * K * 2 / 1e6, "configs": {}, "failed": {},
           "cublas_us": timer([lambda w=w: swiglu_gate_up_fwd(F.linear(x, w)) for w in ws])}
    row["unfused_us"] = row["cublas_us"]
    if table is not None:
        row["table_us"] = timer([lambda w=w: swiglu_gate_up_fwd(matmul_fwd(x, w, table)) for w in ws])
        row["unfused_us"] = row["table_us"]
    for cfg in configs if configs is not None else swiglu_candidates(N, K, M, sm_count(dev)):
        key = json.dumps(list(cfg))
        try:
            got = [swiglu_matmul_fwd(x, ws[0], cfg) for _ in range(2)]
            want = swiglu_gate_up_fwd(matmul_fwd(x, ws[0], cfg))
            us = timer([lambda w=w, cfg=cfg: swiglu_matmul_fwd(x, w, cfg) for w in ws])
            if not (torch.equal(got[0], want) and torch.equal(got[1], want)):  # timed, never chosen
                diff = (got[0].float() - want.float()).abs().max().item()
                row["failed"][key] = f"not its GEMM then SwiGLU: max diff {diff:.3g}, {us:.1f} us"
                continue
            row["configs"][key] = us
        except Exception as e:
            row["failed"][key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            if dev.type == "cuda":
                torch.cuda.synchronize()
    del ws
    return _best(row, row["unfused_us"], dev)


def sweep_case(N: int, K: int, M: int, dtype=torch.bfloat16, device: str = "cuda", timer=graph_us,
               min_bytes: int = 256 * 2**20, configs: list[MatmulConfig] | None = None) -> dict:
    """Times cuBLAS and `configs` (default: `candidates`) at one (N, K, M)."""
    dev = torch.device(device)
    ws, x = _weights(N, K, M, dtype, dev, min_bytes)
    copies = len(ws)
    want = x.double() @ ws[0].double().T  # [M, K] @ [K, N] -> [M, N], float64
    cublas_err = (F.linear(x, ws[0]).double() - want).abs().max().item()
    row = {"N": N, "K": K, "M": M, "copies": copies, "mb": N * K * 2 / 1e6, "cublas_max_err": cublas_err,
           "cublas_us": timer([lambda w=w: F.linear(x, w) for w in ws]), "configs": {}, "failed": {}}
    for cfg in configs if configs is not None else candidates(N, K, M, sm_count(dev)):
        key = json.dumps(list(cfg))
        try:
            outs = [matmul_fwd(x, ws[0], cfg).double() for _ in range(3)]
            err = (outs[0] - want).abs()
            ok = bool((err <= 2e-2 + 2e-2 * want.abs()).all()) and err.max().item() <= 2 * cublas_err + 1e-6
            same = all(torch.equal(outs[0], o) for o in outs[1:])
            if not (ok and same):
                row["failed"][key] = f"max err {err.max().item():.3g} (cuBLAS {cublas_err:.3g}) repeat-equal {same}"
                continue
            row["configs"][key] = timer([lambda w=w, cfg=cfg: matmul_fwd(x, w, cfg) for w in ws])
        except Exception as e:  # a config that does not compile (resources) or launch: reported, not timed
            row["failed"][key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            if dev.type == "cuda":
                torch.cuda.synchronize()
    del ws
    return _best(row, row["cublas_us"], dev)


def _best(row: dict, baseline_us: float, dev) -> dict:
    """row with its fastest config ('best_config', 'best_us') and whether it beats baseline_us by MARGIN
    ('matmul_faster'); the case's weights (freed by the caller) given back to the device."""
    if row["configs"]:
        best = min(row["configs"], key=row["configs"].get)
        row["best_config"], row["best_us"] = json.loads(best), row["configs"][best]
        row["matmul_faster"] = row["best_us"] < (1 - MARGIN) * baseline_us
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def rates(row: dict, copy_tb_s: float) -> dict:
    """GB/s of weight bytes and % of the copy bandwidth, cuBLAS's and the best config's."""
    out = {}
    for tag in ("cublas", "best"):
        us = row.get(f"{tag}_us")
        if us:
            gb_s = row["N"] * row["K"] * 2 / (us * 1e-6) / 1e9
            out[f"{tag}_gb_s"], out[f"{tag}_pct_copy"] = gb_s, 100 * gb_s / (copy_tb_s * 1e3)
    return out


def table_source(rows: list[dict]) -> str:
    """The MATMUL (SWIGLU_MATMUL) rows, tuning.py's spelling, of the (N, K, M) where the kernel won by more than
    MARGIN."""
    lines = []
    for r in rows:
        if r.get("matmul_faster"):
            cfg = ", ".join(str(v) for v in r["best_config"])
            M = row_bucket(r["M"])
            lines.append(f"    ({r['N']}, {r['K']}, {M}): MatmulConfig({cfg}),  # {r['model'].upper()} {r['proj']}")
    return "\n".join(lines)


def row_counts(text: str) -> list[int]:
    import argparse
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        out = []
    if not out or any(m < 1 or m > 4096 for m in out):
        raise argparse.ArgumentTypeError(f"--rows {text}: expected comma-separated row counts in 1..4096")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = parser("tools.bench.sweeps.skinny", __doc__, models="1b,3b", json_out=False)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--rows", type=row_counts, default=row_counts("64,32,128,8,256"), help="row counts M, in order")
    ap.add_argument("--budget", type=float, default=float("inf"), help="seconds; past them only the first candidate")
    ap.add_argument("--swiglu", action="store_true", help="gate_up with SwiGLU in its epilogue against GEMM + SwiGLU")
    args = ap.parse_args(argv)
    require_cuda("python3 -m tools.bench.sweeps.skinny")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    global DEADLINE
    t0 = time.time()
    DEADLINE = t0 + args.budget
    copy_tb_s = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {copy_tb_s:.3f} TB/s (read + write)", flush=True)
    print(f"{'M':>4} {'shape':<12}{'MB':>7}{'cuBLAS us':>10}{'%copy':>6}{'best us':>9}{'%copy':>6}  best cfg", flush=True)
    rows = []
    case, name_of = (sweep_swiglu_case, "swiglu") if args.swiglu else (sweep_case, "skinny")
    for M in args.rows:
        for model in args.models:
            for name, (N, K) in shapes(model).items():
                if args.swiglu and name != "gate_up":
                    continue
                try:
                    r = case(N, K, M)
                except Exception:
                    traceback.print_exc()
                    continue
                r.update(model=model, proj=name, **rates(r, copy_tb_s))
                rows.append(r)
                print(f"{M:>4} {model + ' ' + name:<12}{r['mb']:>7.1f}{r['cublas_us']:>10.1f}"
                      f"{r['cublas_pct_copy']:>6.1f}{r.get('best_us', float('nan')):>9.1f}"
                      f"{r.get('best_pct_copy', float('nan')):>6.1f}  {r.get('best_config')}"
                      f"{'  WIN' if r.get('matmul_faster') else ''}  failed {len(r['failed'])}"
                      f"  [{time.time() - t0:.0f} s]", flush=True)
                if args.swiglu:
                    print(f"        unfused path {r['unfused_us']:.1f} us (cuBLAS + SwiGLU {r['cublas_us']:.1f})")
                for k, v in sorted(r["configs"].items(), key=lambda kv: kv[1])[1:4]:
                    print(f"        {v:8.1f}  {k}")
                for k, v in list(r["failed"].items())[:2]:
                    print(f"        FAILED {k}: {v}")
                write_record(args.out_dir / f"{name_of}_sweep.json", record(copy_tb_s=copy_tb_s, rows=rows))
                table = "swiglu_table.txt" if args.swiglu else "matmul_table.txt"
                (args.out_dir / table).write_text(table_source(rows) + "\n")
    print(f"sweep {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
