"""Quantized checkpoints as `llama32 quantize` writes them: a Hugging Face-style directory whose linear layers are
stored as codes, scales and minima, read back into refimpl.quant.schemes.QuantizedLinear records unchanged.

    config.json              the model's config plus
                             "quantization_config": {"quant_method": "llama32", "version": 1, "format": "int8" |
                             "int4", "group_size": G (int4), "bits": 8 | 4, "lm_head": true | false,
                             "method": "rtn" | "search" | "gptq" | "awq" | "awq-gptq",
                             "calibration": "<file, tokens>" | null,
                             "int8_matrices": ["mlp.down_proj", ...] (int4 only, optional: those in int8;
                             q/k/v and gate/up all or none),
                             "rotation": {"residual": true, "values": true | false, "seed": 0,
                             "construction": "hadamard-kron-haar"} (optional: quantized after refimpl.quant.rotate,
                             rotate.record's; a record only: the weights are an ordinary Llama's)}
    model.safetensors        for each quantized matrix W [N, K] named `<base>.weight`:
                               <base>.qweight   I8 [N, K] (int8)  |  U8 [N, K/2], two codes a byte, low nibble first
                               <base>.scales    BF16 [N, 1] (int8) | BF16 [N, ceil(K/G)] (int4)
                               <base>.mins      BF16 [N, ceil(K/G)] (int4 only)
                             W ≈ codes · scale (int8), codes · scale + min (int4) (refimpl.quant.schemes' module doc);
                             every other tensor under its own name, in the source's float dtype
    tokenizer.json, tokenizer_config.json (chat_template, bos/eos tokens), generation_config.json (eos ids)

Which matrices are quantized follows from the config: every linear layer of every block, and `lm_head` (a tied
model's head as its own tensor: `lm_head.qweight`, the embedding stays as it is) when "lm_head" is true.
"""
from __future__ import annotations

import sys
from pathlib import Path

from refimpl.errors import CheckpointError, ConfigError, quote
from refimpl.formats.params import check_params, expected_shapes
from refimpl.formats.safetensors_io import save_safetensors
from refimpl.formats.shards import read_headers
from refimpl.model.config import LlamaConfig
from refimpl.progress import Progress
from refimpl.quant.apply import LM_HEAD, quantized_names
from refimpl.quant.schemes import INT4_GROUPS, QuantizedLinear, QuantSpec, int8_keys_of

QUANT_METHOD, VERSION = "llama32", 1
_PARTS = ("qweight", "scales", "mins")


def _base(name: str) -> str:
    return name.removesuffix(".weight")


def quantization_config(spec: QuantSpec, method: str, calibration: str | None, rotation: dict | None = None) -> dict:
    d = {"quant_method": QUANT_METHOD, "version": VERSION, "format": spec.format,
         "bits": 8 if spec.format == "int8" else 4, "lm_head": spec.lm_head, "method": method,
         "calibration": calibration}
    d = d | {"int8_matrices": list(spec.int8_keys)} if spec.int8_keys else d
    d = d if rotation is None else d | {"rotation": rotation}
    return d | {"group_size": spec.group} if spec.format == "int4" else d


def save_quantized_weights(out_dir: str | Path, params: dict, dtype: str = "F32") -> Path:
    """model.safetensors: the quantized matrices (QuantizedLinear records) as codes, scales and minima, the other
    tensors as `dtype` (F32, BF16). The config and tokenizer files are refimpl.formats.checkpoint.write_side_files'
    job, with quantization_config(...) added to the config."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors, bf16 = {}, {}
    for name, value in params.items():
        if isinstance(value, QuantizedLinear):
            tensors[_base(name) + ".qweight"] = value.data
            for part, array in (("scales", value.scales), ("mins", value.mins)):
                if array is not None:  # bf16 values held in fp32: stored as BF16 exactly
                    tensors[f"{_base(name)}.{part}"], bf16[f"{_base(name)}.{part}"] = array, "BF16"
        else:
            tensors[name] = value
    save_safetensors(out / "model.safetensors", tensors, dtype=dtype, metadata={"format": "pt"}, dtype_of=bf16)
    return out


def declares_quantization(d: dict) -> bool:
    """config.json's dict carries a quantization_config (a checkpoint `llama32 quantize` wrote, or another tool's)."""
    return d.get("quantization_config") is not None


def parse_quantization_config(d: dict, source: str) -> tuple[QuantSpec, dict]:
    """config.json's quantization_config -> (QuantSpec, the config without it); anything else is refused."""
    q = d.get("quantization_config")
    where = f"{source}: quantization_config"
    if not isinstance(q, dict) or q.get("quant_method") != QUANT_METHOD:
        got = q.get("quant_method") if isinstance(q, dict) else q
        raise ConfigError(f"{where}: quant_method {got!r} is not supported (llama32 reads the checkpoints "
                              f"`llama32 quantize` writes, quant_method {QUANT_METHOD!r})")
    if q.get("version") != VERSION:
        raise ConfigError(f"{where}: version {q.get('version')!r}, expected {VERSION}")
    if q.get("format") not in ("int8", "int4"):
        raise ConfigError(f"{where}: format {q.get('format')!r}, expected 'int8' or 'int4'")
    group = q.get("group_size") if q["format"] == "int4" else None
    if q["format"] == "int4" and group not in INT4_GROUPS:
        raise ConfigError(f"{where}: group_size {group!r}, expected one of {list(INT4_GROUPS)}")
    if not isinstance(q.get("lm_head"), bool):
        raise ConfigError(f"{where}: lm_head must be true or false, got {q.get('lm_head')!r}")
    int8 = int8_keys_of(q.get("int8_matrices", []), f"{where}: int8_matrices", ConfigError)
    if int8 and q["format"] != "int4":
        raise ConfigError(f"{where}: int8_matrices {int8!r}: only format 'int4' keeps some matrices in int8")
    return (QuantSpec(q["format"], group, q["lm_head"], int8),
            {k: v for k, v in d.items() if k != "quantization_config"})


def _expected_parts(spec: QuantSpec, shape: tuple[int, int]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{part: (safetensors dtype, shape)} of one quantized [N, K] matrix."""
    N, K = shape
    if spec.format == "int8":
        return {"qweight": ("I8", (N, K)), "scales": ("BF16", (N, 1))}
    groups = -(-K // spec.group)
    return {"qweight": ("U8", (N, K // 2)), "scales": ("BF16", (N, groups)), "mins": ("BF16", (N, groups))}


def load_quantized_params(model_dir: Path, d: dict, source: str) -> tuple[LlamaConfig, dict, QuantSpec]:
    """config.json's dict (with quantization_config) -> (config, params with QuantizedLinear records, spec).
    Every tensor's presence, dtype and shape is checked from the headers before any data is read."""
    spec, plain = parse_quantization_config(d, source)
    cfg = LlamaConfig.from_hf(plain, source=source)
    holder, shapes = read_headers(model_dir)
    stored = expected_shapes(cfg)
    quantized = quantized_names(cfg, spec.lm_head)
    want = stored | {LM_HEAD: stored["model.embed_tokens.weight"]} if spec.lm_head else stored  # tied: its own
    parts = {}
    for name in quantized:
        parts[name] = _expected_parts(spec.for_matrix(name), want[name])
        if spec.for_matrix(name).format == "int4" and want[name][1] % 2:
            raise CheckpointError(f"{model_dir}: {name} has an odd input dimension {want[name][1]}; int4 packs two")
    plain_shapes = {n: shape for n, shape in shapes.items() if not n.endswith(tuple("." + p for p in _PARTS))}
    extra = check_params(plain_shapes | {n: stored[n] for n in quantized if n in stored}, cfg, str(model_dir))
    for name, expected in parts.items():
        for part, (dtype, shape) in expected.items():
            key = f"{_base(name)}.{part}"
            if key not in holder:
                raise CheckpointError(f"{model_dir}: missing tensor {quote(key)} (a {spec} checkpoint stores "
                                      f"{', '.join(_base(name) + '.' + p for p in expected)})")
            info = holder[key].tensors[key]
            if info.dtype != dtype or tuple(info.shape) != shape:
                raise CheckpointError(f"{model_dir}: tensor {quote(key)} is {info.dtype} {list(info.shape)}, "
                                      f"expected {dtype} {list(shape)} for {spec} of a {list(want[name])} matrix")
    if extra:
        print(f"warning: {model_dir}: ignoring {len(extra)} unknown tensor(s), e.g. {extra[0]!r}", file=sys.stderr)
    params = {}
    with Progress(f"loading {model_dir.name}", len(want)) as bar:
        for name in want:
            if name in parts:  # each part from its own shard
                load = lambda part: holder[f"{_base(name)}.{part}"].load(f"{_base(name)}.{part}")  # noqa: E731
                one = spec.for_matrix(name)
                params[name] = QuantizedLinear(one.format, want[name], load("qweight"), load("scales"),
                                               load("mins") if one.format == "int4" else None,
                                               one.group if one.format == "int4" else want[name][1])
            else:
                params[name] = holder[name].load_weight(name)
            bar.advance()
    return cfg, params, spec
