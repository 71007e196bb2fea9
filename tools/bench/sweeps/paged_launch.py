"""The batched engine's paged decode attention kernel (accel/kernels/paged_attn.py) alone, per KV block size and per
launch config: the sweep behind the engine's block size and the kernel's GPU launch config.

    python3 -m tools.bench.sweeps.paged_launch OUT_DIR [--models 1b]

Per model shape (heads, kv heads, head dim), batch B and context (CASES): one call over B sequences of `context`
tokens in randomly placed blocks, captured in a CUDA graph (common.graph_us: the kernels' time, not the host's
launches). First per block size (16, 64, 256) with the kernel's default launch, then per launch config (BLOCK_N,
warps, stages) at blocks of 16. Prints a line per case; writes OUT_DIR/paged_launch.json (the record of
tools.bench.common).
"""
from __future__ import annotations

from pathlib import Path

from tools.bench.common import graph_us, model_config, parser, record, require_cuda, write_record

CASES = ((1, 4096), (64, 512), (64, 2048), (256, 512))  # (B, context)
BLOCK_SIZES = (16, 64, 256)
CONFIGS = ({"BLOCK_N": 32}, {"BLOCK_N": 64, "num_warps": 4}, {"BLOCK_N": 64, "num_stages": 3},
           {"BLOCK_N": 128}, {"BLOCK_N": 128, "num_stages": 3}, {"BLOCK_N": 64, "num_warps": 2},
           {"BLOCK_N": 128, "num_warps": 8})


def paged_us(cfg, block_size: int, batch: int, context: int, config: dict | None = None) -> float:
    """µs of one paged decode attention call (bf16, cfg's heads) over `batch` sequences of `context` tokens in
    randomly placed blocks, captured in a CUDA graph."""
    import torch

    from accel.kernels.paged_attn import paged_decode_attention_fwd
    width = -(-context // block_size)
    H, K, E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = torch.randn(batch, H, E, device="cuda", dtype=torch.bfloat16)
    pool = torch.randn(K, batch * width * block_size, E, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(batch * width, device="cuda").view(batch, width).to(torch.int32)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    return graph_us([lambda: paged_decode_attention_fwd(q, pool, pool, tables, lens, block_size, config=config)])


def sweep(cfg) -> list[dict]:
    """The kernel per KV block size (its default launch config), then per launch config at blocks of 16."""
    cases = [(bs, None, b, c) for bs in BLOCK_SIZES for b, c in CASES]
    cases += [(16, config, b, c) for config in CONFIGS for b, c in CASES[1:]]
    rows = []
    for bs, config, b, c in cases:
        rows.append({"block_size": bs, "config": config, "batch": b, "context": c,
                     "us": paged_us(cfg, bs, b, c, config)})
        print(render_row(rows[-1]), flush=True)
    return rows


def render_row(p: dict) -> str:
    return (f"paged attention, blocks of {p['block_size']:>3}, B {p['batch']:>3}, {p['context']:>4} tokens, "
            f"{p['config'] or 'default launch'}: {p['us']:.1f} µs")


def main(argv: list[str] | None = None) -> None:
    ap = parser("tools.bench.sweeps.paged_launch", __doc__, models="1b", json_out=False)
    ap.add_argument("out_dir", type=Path)
    args = ap.parse_args(argv)
    require_cuda("python3 -m tools.bench.sweeps.paged_launch")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"model": key, **row} for key in args.models for row in sweep(model_config(key))]
    write_record(args.out_dir / "paged_launch.json", record(rows=rows))


if __name__ == "__main__":
    main()
