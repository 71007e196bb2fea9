"""`llama32 lora merge`: bake a PEFT LoRA adapter into the base weights and write a complete HF checkpoint.

The merge is W + scale · B @ A in fp32 (refimpl.formats.lora), then stored in the base's own dtype (bf16 stays
bf16), sharded with an index as HF does; config, tokenizer and generation files are copied alongside.
"""
from __future__ import annotations

from pathlib import Path

import click

from refimpl.errors import GenerationError
from tools.cli.outdir import check_out_dir

DTYPE_TAGS = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}


def _size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9}
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            try:
                return int(float(text[:-2]) * factor)
            except ValueError:
                break
    raise GenerationError(f"--max-shard-size: expected e.g. 5GB, 500MB or 100KB, got {text!r}")


@click.group()
def lora():
    """LoRA adapter tools."""


@lora.command()
# not MODEL_OPTION: an adapter merges into the base it was trained on, so the base is named, never a default
@click.option("--model", "model", required=True, type=click.Path(path_type=Path), help="Base model dir or .gguf.")
@click.option("--adapter", required=True, type=click.Path(path_type=Path), help="PEFT adapter directory.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Directory for the merged checkpoint.")
@click.option("--dtype", type=click.Choice(sorted(DTYPE_TAGS)), default=None,
              help="Stored dtype (default: the base checkpoint's; fp32 for GGUF).")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest safetensors shard.")
def merge(model, adapter, out, dtype, max_shard_size):
    """Merge ADAPTER into MODEL and write a Hugging Face checkpoint to OUT."""
    from refimpl.formats.checkpoint import load_checkpoint, save_sharded, weight_dtype, write_side_files
    from refimpl.formats.jsonfile import read_config_json
    from refimpl.formats.lora import load_lora, merge_lora
    from tools.chat_session import source_name

    shard_bytes = _size(max_shard_size)
    check_out_dir(out)
    ckpt = load_checkpoint(model)
    merged = merge_lora(ckpt.params, ckpt.config, load_lora(adapter, ckpt.config))
    gguf = not Path(model).is_dir()
    tag = DTYPE_TAGS[dtype] if dtype else ("F32" if gguf else weight_dtype(Path(model)))
    out.mkdir(parents=True, exist_ok=True)
    files = save_sharded(out, merged, tag, shard_bytes)
    # a GGUF holds its config and tokenizer inside: written out as the HF files transformers reads; a directory's
    # config.json is kept as it is, with the source's name recorded (tools.chat_session.source_name)
    config = ckpt.config.to_hf() if gguf else read_config_json(Path(model) / "config.json")
    write_side_files(ckpt, out, config | {"_name_or_path": source_name(ckpt)})
    click.echo(f"wrote {out}: {len(files)} safetensors file(s) in {tag}", err=True)
