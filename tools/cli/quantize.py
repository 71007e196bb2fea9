"""`llama32 quantize`: quantize a model offline (optionally calibrated on a text) and write a quantized checkpoint
that `generate`, `diff` and `step` load as it is, in either engine (refimpl.formats.quant_checkpoint: the layout).

The default calibration text, tools/data/calibration-en.txt (about 2,700 tokens), mixes public-domain English
(Lincoln, the Declaration of Independence, Genesis, Melville, Austen, Carroll, Doyle, Aesop) with short chats,
code and everyday prose written for this repository; it shares no text with tools/bench/quant_quality.py's
evaluation passage (Dickens).
"""
from __future__ import annotations

from pathlib import Path

import click

from refimpl.errors import GenerationError
from tools.cli.outdir import check_out_dir
from tools.cli.options import MODEL_OPTION, QUANT_HELP, UserPath

CALIBRATION = Path(__file__).resolve().parent.parent / "data" / "calibration-en.txt"
MAX_CALIB_BYTES = 16 * 1024 * 1024


def _calibration_text(path: Path) -> str:
    from refimpl.formats.safe_open import read_bytes
    raw = read_bytes(path, "--calib: a UTF-8 text file", GenerationError, limit=MAX_CALIB_BYTES)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GenerationError(f"--calib {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


@click.command()
@MODEL_OPTION
@click.option("--quant", required=True, metavar="FORMAT",
              help=QUANT_HELP)
@click.option("--method", type=click.Choice(["rtn", "search", "gptq", "awq", "awq-gptq"]), default="gptq",
              show_default=True,
              help="rtn: round to nearest on min/max ranges; search: error-minimizing ranges (weighted by the "
                   "calibration inputs); gptq: GPTQ with error feedback on the calibration Hessians; awq / awq-gptq: "
                   "activation-aware input scales folded into the norms and v/up rows, then search / gptq.")
@click.option("--rotate", is_flag=True,
              help="Rotate the residual stream and each head's values first (norm weights folded into the matrices): "
                   "the same model with other weights, an ordinary Llama checkpoint with its own lm_head. Measured "
                   "to help int8 with gptq and to hurt int4 (README).")
@click.option("--calib", type=UserPath(), default=None,
              help="Calibration text for search/gptq (default: the checked-in tools/data/calibration-en.txt).")
@click.option("--out", required=True, type=UserPath(output=True), help="New directory for the quantized checkpoint.")
def quantize(model, quant, method, rotate, calib, out):
    """Quantize MODEL's linear layers and write a quantized checkpoint to OUT."""
    from refimpl.formats.checkpoint import load_checkpoint, weight_dtype, write_side_files
    from refimpl.formats.quant_checkpoint import quantization_config, save_quantized_weights
    from refimpl.quant.apply import refuse_quantized
    from refimpl.quant.calibrate import calibration_sequences, quantize_model
    from refimpl.quant.rotate import ROTATION_SEED, record, rotate_model
    from tools.chat_session import source_name
    from tools.engines import parse_quant, resolve_model

    spec = parse_quant(quant)
    if spec.format == "gguf":
        raise GenerationError("--quant gguf keeps a GGUF file's blocks at load time; `quantize` writes int8 or int4")
    check_out_dir(out)
    if method == "rtn" and calib is not None:
        raise GenerationError("--calib is used by --method search or gptq; rtn needs no calibration")
    text = None if method == "rtn" else _calibration_text(calib or CALIBRATION)
    path = resolve_model(model)
    ckpt = load_checkpoint(path, text_only=True)  # a Vision checkpoint refused before its 20 GB are read
    # before rotating, which reads plain arrays only
    refuse_quantized(ckpt.params, "--model", "quantize the original checkpoint")
    seqs = None if text is None else calibration_sequences(ckpt.tokenizer, text)
    params, cfg = ckpt.params, ckpt.config
    rotation = record(ROTATION_SEED, values=True) if rotate else None
    if rotation:
        params, cfg = rotate_model(params, cfg, rotation["seed"], rotation["values"])
        ckpt.params = {}  # the unrotated model's last reference: only its config and tokenizer are used below
    params = quantize_model(params, cfg, spec, method, seqs)
    dtype = weight_dtype(path) if path.is_dir() else "F32"  # a GGUF's dequantized values are fp32
    save_quantized_weights(out, params, dtype)
    note = None if seqs is None else f"{(calib or CALIBRATION).name}, {sum(len(s) for s in seqs)} tokens"
    qcfg = quantization_config(spec, method, note, rotation)
    write_side_files(ckpt, out, cfg.to_hf() | {"quantization_config": qcfg, "_name_or_path": source_name(ckpt)})
    size = sum(f.stat().st_size for f in out.iterdir())
    click.echo(f"wrote {out}: {spec} by {method}{', rotated' if rotate else ''}{' on ' + note if note else ''}, "
               f"{size / 1e6:.1f} MB", err=True)
