"""Benchmark: peak memory of loading a Llama-3.2-1B-shaped bf16 checkpoint into the refimpl (target < 6.5 GB RSS).

Writes random bf16 weights at the real 1B shapes (2.47 GB) to a temporary directory one tensor at a time, then
loads them in a fresh process and reports its peak RSS next to the fp32 size of the parameters (the floor: the
refimpl computes in fp32). Prints a table and writes JSON.

    python -m tools.bench.load [--preset llama-3.2-1b] [--json-out load.json] [--keep DIR]
"""
from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from refimpl.formats.params import expected_shapes
from refimpl.model.config import PRESETS
from tools.bench.common import parser, record, write_record

CHILD = """
import resource, sys, time
t = time.perf_counter()
from refimpl.formats.checkpoint import load_checkpoint
ckpt = load_checkpoint(sys.argv[1], with_tokenizer=False)
n = sum(a.size for a in ckpt.params.values())
print(n, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def write_bf16_checkpoint(model_dir: Path, preset: str) -> None:
    """Stream random bf16 tensors to model.safetensors without holding the model in memory."""
    cfg = PRESETS[preset]
    shapes = expected_shapes(cfg)
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(0)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(cfg.to_hf()))
    with open(model_dir / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in shapes.items():
            # bf16 bits of N(0, 0.02)-ish values: sign random, exponent near 2^-6, random mantissa
            n = math.prod(shape)
            bits = (rng.integers(0, 2, n, dtype=np.uint16) << 15) | np.uint16(0x3C00) | \
                rng.integers(0, 128, n, dtype=np.uint16)
            f.write(bits.tobytes())


def main(argv=None):
    ap = parser("tools.bench.load", __doc__)
    ap.add_argument("--preset", default="llama-3.2-1b", choices=sorted(PRESETS))
    ap.add_argument("--keep", default=None, help="write the checkpoint here and keep it")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.keep or tmp) / args.preset
        t = time.perf_counter()
        write_bf16_checkpoint(model_dir, args.preset)
        write_s = time.perf_counter() - t
        out = subprocess.run([sys.executable, "-c", CHILD, str(model_dir)], capture_output=True, text=True,
                             check=True, env={"PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        n_params, load_s, peak = out.stdout.split()
        file_gb = (model_dir / "model.safetensors").stat().st_size / 1e9
    result = record("cpu", preset=args.preset, params=int(n_params), file_gb=file_gb,
                    fp32_gb=int(n_params) * 4 / 1e9, peak_rss_gb=int(peak) / 1e9, load_s=float(load_s),
                    target_peak_rss_gb=6.5, write_s=write_s)
    print(f"{'preset':<14}{'bf16 file GB':>13}{'fp32 params GB':>16}{'peak RSS GB':>13}{'load s':>8}{'target':>8}")
    print(f"{args.preset:<14}{file_gb:>13.2f}{result['fp32_gb']:>16.2f}{result['peak_rss_gb']:>13.2f}"
          f"{result['load_s']:>8.1f}{'< 6.5':>8}")
    write_record(args.json_out, result)


if __name__ == "__main__":
    main()
