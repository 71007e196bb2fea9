"""Loading a llama.cpp GGUF file: metadata -> LlamaConfig, tensors -> float32 in HF's names and layout, and
tokenizer.ggml.* -> a `tokenizers` byte-level BPE (refimpl.formats.gguf_tokenizer).

A GGUF differs from an HF checkpoint in four ways, each undone here:
    * names: `blk.3.attn_q.weight` is `model.layers.3.self_attn.q_proj.weight` (`hf_name`);
    * dims are listed fastest-first (ne0, ne1), the reverse of a NumPy shape: [576, 1536] is a [1536, 576] array;
    * weights are quantized in blocks; `gguf.quants.dequantize` widens every type the library knows to fp32;
    * llama.cpp's converter permutes the rows of attn_q/attn_k within each head for its interleaved RoPE
      (pairs (x0, x1), (x2, x3), ...); `unpermute_rows` restores HF's half-split layout (x_i with x_{i+E/2}), as
      transformers' own GGUF loader does.
The file is bounds-checked by `refimpl.formats.gguf_check.validate_gguf` before the gguf library reads it.
"""
from __future__ import annotations

import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from refimpl.formats.gguf_tokenizer import build_tokenizer
from refimpl.formats.params import Checkpoint, check_params
from refimpl.model.config import LlamaConfig, RopeScaling
from refimpl.errors import CheckpointError, ConfigError
from refimpl.progress import Progress
from refimpl.quant.gguf_blocks import dequantize_ggml

_REQUIRED = object()

# GGUF tensor name -> HF name. Layer tensors are `blk.{i}.<key>.weight`.
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+: per-frequency divisors of llama3 rope scaling

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) -> how the text is split before byte-level BPE.
# Llama 3's split is refimpl.text.tokenizer.LLAMA3_SPLIT; "smollm" splits digits one by one first, as
# SmolLM2's tokenizer.json (Digits(individual_digits) + ByteLevel) and llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM do.
_FLOAT_TYPES = {0: np.float32, 1: np.float16}  # ggml F32, F16: typed data that a byte-swapped file stores swapped


# ---------------------------------------------------------------- metadata

class Metadata:
    """Typed access to a GGUF header's key/value fields (gguf_check.GGUFHeader.fields: key -> (type codes,
    value)); a wrong type or a missing key names the key."""

    def __init__(self, fields: dict, source: str):
        from gguf import GGUFValueType as T
        self.fields, self.source = fields, source
        ints = {T.UINT8, T.INT8, T.UINT16, T.INT16, T.UINT32, T.INT32, T.UINT64, T.INT64}
        self._kinds = {"int": ints, "float": ints | {T.FLOAT32, T.FLOAT64}, "str": {T.STRING}, "bool": {T.BOOL}}
        self._array = T.ARRAY

    def get(self, key: str, kind: str, default=_REQUIRED):
        """kind: 'int', 'float', 'str', 'bool', or 'int[]' / 'str[]' for arrays of those."""
        field = self.fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise ConfigError(f"{self.source}: missing GGUF metadata key {key!r}")
            return default
        is_array = kind.endswith("[]")
        types, value = field
        ok = (len(types) == 2 and types[0] == self._array and types[1] in self._kinds[kind[:-2]]) if is_array \
            else (len(types) == 1 and types[0] in self._kinds[kind])
        if not ok:
            from gguf import GGUFValueType
            names = "/".join(GGUFValueType(t).name for t in types)
            raise ConfigError(f"{self.source}: GGUF metadata {key!r} has type {names}, expected {kind}")
        if is_array:
            return value.tolist() if isinstance(value, np.ndarray) else value
        if kind == "int":
            return int(value)
        return float(value) if kind == "float" else value


def _positive(meta: Metadata, key: str, default=_REQUIRED) -> int:
    value = meta.get(key, "int", default)
    if value is not None and value <= 0:
        raise ConfigError(f"{meta.source}: GGUF metadata {key!r} must be a positive integer, got {value}")
    return value


def rope_scaling_from(meta: Metadata, rope_freqs: np.ndarray | None, head_dim: int,
                      theta: float) -> RopeScaling | None:
    """Llama 3 files carry no rope-scaling keys: the converter stores the per-frequency divisors as the
    `rope_freqs` tensor [E/2] (1 for short wavelengths, `factor` for long ones, smooth between). GGUF keeps no
    record of low/high_freq_factor, so we take Llama 3's published 1 and 4 (and the file's original context,
    else 8192), and accept them only if they reproduce every divisor; anything else is refused, not guessed."""
    from refimpl.model.ops import llama3_inv_freq
    kind = meta.get("llama.rope.scaling.type", "str", None)
    if kind not in (None, "none"):
        raise ConfigError(f"{meta.source}: llama.rope.scaling.type {kind!r} is not supported (only Llama 3's "
                          f"rope_freqs scaling or none)")
    if rope_freqs is None:
        return None
    rope_freqs = rope_freqs.reshape(-1).astype(np.float64)
    if rope_freqs.shape != (head_dim // 2,) or not np.all(rope_freqs >= 1):
        raise ConfigError(f"{meta.source}: tensor {ROPE_FREQS!r} must hold {head_dim // 2} divisors >= 1, got "
                          f"shape {list(rope_freqs.shape)}")
    factor = meta.get("llama.rope.scaling.factor", "float", float(rope_freqs.max()))
    original = _positive(meta, "llama.rope.scaling.original_context_length", 8192)
    scaling = RopeScaling(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=original)
    implied = llama3_inv_freq(head_dim, theta, None) / llama3_inv_freq(head_dim, theta, scaling)  # [E/2]
    if not np.allclose(implied, rope_freqs, rtol=1e-4, atol=0):
        raise ConfigError(f"{meta.source}: tensor {ROPE_FREQS!r} does not match llama3 rope scaling (factor "
                          f"{factor:g}, low_freq_factor 1, high_freq_factor 4, original context {original}); "
                          f"this scaling is not supported")
    return scaling


def config_from_gguf(meta: Metadata, shapes: dict[str, tuple[int, ...]], rope_freqs: np.ndarray | None,
                     vocab_size: int | None, stop: tuple[int, ...]) -> LlamaConfig:
    """`shapes`: GGUF tensor name -> NumPy shape. vocab_size from the token list, when the file has one."""
    arch = meta.get("general.architecture", "str")
    if arch != "llama":
        raise ConfigError(f"{meta.source}: general.architecture is {arch!r}; only 'llama' is supported")
    hidden = _positive(meta, "llama.embedding_length")
    heads = _positive(meta, "llama.attention.head_count")
    kv_heads = _positive(meta, "llama.attention.head_count_kv", heads)
    head_dim = _positive(meta, "llama.attention.key_length", None)
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(f"{meta.source}: llama.attention.head_count ({heads}) must divide "
                              f"llama.embedding_length ({hidden}) when no key_length is given")
        head_dim = hidden // heads
    for key in ("llama.attention.value_length", "llama.rope.dimension_count"):
        value = _positive(meta, key, head_dim)
        if value != head_dim:
            raise ConfigError(f"{meta.source}: {key} is {value} but the head size is {head_dim}; only full-width "
                              f"RoPE with equal key/value heads is supported")
    declared = _positive(meta, "llama.vocab_size", None)
    embed = shapes.get("token_embd.weight", (None,))
    vocab = vocab_size or declared or embed[0]
    if declared is not None and declared != vocab:
        raise ConfigError(f"{meta.source}: llama.vocab_size is {declared} but the token list holds {vocab}")
    if vocab is None:
        raise CheckpointError(f"{meta.source}: no token list, llama.vocab_size or token_embd.weight to size the "
                              f"vocabulary")
    theta = meta.get("llama.rope.freq_base", "float", 10000.0)  # llama.cpp's default when the key is absent
    bos = meta.get("tokenizer.ggml.bos_token_id", "int", None)
    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=_positive(meta, "llama.feed_forward_length"),
        num_hidden_layers=_positive(meta, "llama.block_count"), num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, rope_theta=theta,
        rope_scaling=rope_scaling_from(meta, rope_freqs, head_dim, theta),
        rms_norm_eps=meta.get("llama.attention.layer_norm_rms_epsilon", "float"),
        tie_word_embeddings="output.weight" not in shapes, bos_token_id=bos, eos_token_ids=stop,
        max_position_embeddings=_positive(meta, "llama.context_length"),
        extra={"gguf_file_type": meta.get("general.file_type", "int", None),
               "names": recorded_names(meta)},
    )


def recorded_names(meta: Metadata) -> list[str]:
    """The names the file records for its model (general.name, .basename, .finetune): metadata, so one of another
    type is skipped rather than refused."""
    names = []
    for key in ("general.name", "general.basename", "general.finetune"):
        try:
            name = meta.get(key, "str", None)
        except ConfigError:
            continue
        names += [name] if name else []
    return names


def stop_ids_from(meta: Metadata) -> tuple[int, ...]:
    """eos, then end-of-turn / end-of-message where the file names them (Llama 3 Instruct: <|eot_id|>)."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = [meta.get(key, "int", None) for key in keys]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


# ---------------------------------------------------------------- tensors

def hf_name(gguf_name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for a name we do not map."""
    stem, dot, kind = gguf_name.rpartition(".")
    if kind == "weight" and stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.weight"
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{int(m.group(1))}.{_LAYER_NAMES[m.group(2)]}.weight"
    return None


@dataclass(frozen=True)
class FileTensor:
    """One tensor of the file: its header entry and its bytes (a view of the read-only file mapping)."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    dims: tuple[int, ...]  # GGUF order, ne0 first
    data: np.ndarray  # uint8 [n_bytes]
    byte_order: str = "<"


def file_tensors(path: Path, header) -> list[FileTensor]:
    """The header's tensors over one read-only memory map of the file (nothing is read until dequantized)."""
    from gguf import GGMLQuantizationType
    raw = np.memmap(path, np.uint8, mode="r")
    return [FileTensor(t.name, GGMLQuantizationType(t.type_code), t.dims,
                       raw[t.start:t.start + t.n_bytes].view(np.ndarray), header.order) for t in header.tensors]


def numpy_shape(tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.dims))  # GGUF lists ne0 (the fastest dim) first


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's `permute` of attn_q/attn_k rows: GGUF row 2i+j of a head is HF row
    j·E/2 + i. w [n_head·E, Din] -> [n_head·E, Din]."""
    rows, cols = w.shape
    half = rows // n_head // 2
    w = w.reshape(n_head, half, 2, cols)  # [n_head·E, Din] -> [heads, E/2, 2, Din]: llama.cpp's interleaved pairs
    return w.swapaxes(1, 2).reshape(rows, cols)  # -> [heads, 2, E/2, Din] -> [n_head·E, Din]: HF's halves


def dequantize(tensor, source: str) -> np.ndarray:
    """One tensor as a float32 array in NumPy order; a type gguf cannot dequantize names tensor and type."""
    import gguf
    qtype = tensor.tensor_type
    try:
        if tensor.byte_order == ">" and qtype in _FLOAT_TYPES:  # a big-endian writer's floats (as GGUFReader)
            values = tensor.data.view(np.dtype(_FLOAT_TYPES[qtype]).newbyteorder(">")).astype(np.float32)
        else:
            values = dequantize_ggml(tensor.data, qtype)
            if values is None:
                values = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise CheckpointError(f"{source}: tensor {tensor.name!r} is stored as {qtype.name}, which the gguf "
                              f"library cannot dequantize; re-export the model as F32/F16/BF16 or a Q type") from None
    shape = numpy_shape(tensor)
    if values.size != int(np.prod(shape)):
        raise CheckpointError(f"{source}: tensor {tensor.name!r} dequantizes to {values.size} values, but its "
                              f"dims {list(shape)} need {int(np.prod(shape))}")
    # own, writable, fp32 memory: an F32 tensor comes back as a view of the read-only file mapping (the other
    # types come back freshly computed, and copying 135M values again would cost a tenth of a second)
    values = values.reshape(shape)
    return np.array(values, np.float32) if not values.flags.writeable else values.astype(np.float32, copy=False)


def kept_blocks(tensor, shape: tuple[int, ...]):
    """A Q8_0/Q4_0/Q4_1 tensor as its raw blocks (refimpl.quant), or None for another type (dequantized)."""
    from refimpl.quant.schemes import GGUF_FORMATS, QuantizedLinear
    fmt = tensor.tensor_type.name.lower()
    if fmt not in GGUF_FORMATS:
        return None
    data = np.array(tensor.data.view(np.uint8).reshape(shape[0], -1))  # [N, K/32 · bytes a block], owned
    return QuantizedLinear(fmt, shape, data, None, None, 32)


def unpermute_order(rows: int, n_head: int) -> np.ndarray:
    """`unpermute_rows` as a row order: HF row r is GGUF row order[r] (for tensors kept as blocks)."""
    return unpermute_rows(np.arange(rows)[:, None], n_head)[:, 0]


def load_params(tensors: list[FileTensor], cfg: LlamaConfig, source: str, pool=None,
                keep_blocks: frozenset = frozenset()) -> dict:
    """Map names, check shapes against the config, then dequantize (and unpermute q/k) tensor by tensor, on the
    threads of `pool` when given (NumPy releases the GIL in the block arithmetic).

    Names in `keep_blocks` stored as Q8_0/Q4_0/Q4_1 stay as their blocks (refimpl.quant.QuantizedLinear)."""
    by_name = {hf_name(t.name): t for t in tensors if hf_name(t.name) is not None}
    extra = check_params({n: numpy_shape(t) for n, t in by_name.items()}, cfg, source)
    unknown = [t.name for t in tensors if hf_name(t.name) is None and t.name != ROPE_FREQS]
    if unknown or extra:
        print(f"warning: {source}: ignoring {len(unknown) + len(extra)} unknown tensor(s), e.g. "
              f"{(unknown + extra)[0]!r}", file=sys.stderr)
    def load(name: str):
        tensor = by_name[name]
        w = kept_blocks(tensor, numpy_shape(tensor)) if name in keep_blocks else None
        if w is None:
            w = dequantize(tensor, source)
        heads = {"self_attn.q_proj.weight": cfg.num_attention_heads,
                 "self_attn.k_proj.weight": cfg.num_key_value_heads}.get(name.split(".", 3)[-1])
        if heads and isinstance(w, np.ndarray):
            w = unpermute_rows(w, heads)
        elif heads:
            w = w.take_rows(unpermute_order(w.shape[0], heads))
        return w

    names = [name for name in by_name if name not in extra]
    params = {}
    with Progress(f"loading {Path(source).name}", len(names)) as bar:
        for name, w in zip(names, map(load, names) if pool is None else pool.map(load, names)):
            params[name] = w
            bar.advance()
    if "lm_head.weight" in keep_blocks and cfg.tie_word_embeddings:  # the tied lm_head reads the embedding's blocks
        head = kept_blocks(by_name["model.embed_tokens.weight"], numpy_shape(by_name["model.embed_tokens.weight"]))
        if head is not None:
            params["lm_head.weight"] = head
    return params


# ---------------------------------------------------------------- entry point

def load_gguf(path: str | Path, with_tokenizer: bool = True, keep_blocks: bool = False,
              keep_lm_head_blocks: bool = True) -> Checkpoint:
    """A llama-architecture GGUF file -> Checkpoint with float32 HF-named params, tokenizer and stop ids.

    keep_blocks (`--quant gguf`): linear layers (and the lm_head, with keep_lm_head_blocks) stored as Q8_0,
    Q4_0 or Q4_1 stay quantized as QuantizedLinear records of their blocks."""
    from refimpl.formats.gguf_check import validate_gguf
    path = Path(path)
    source = str(path)
    header = validate_gguf(path)  # the bounds-checked walk keeps what it read: no second parse
    meta = Metadata(header.fields, source)
    tensors = file_tensors(path, header)
    tokens = header.fields.get("tokenizer.ggml.tokens")
    shapes = {t.name: numpy_shape(t) for t in tensors}
    rope = next((dequantize(t, source) for t in tensors if t.name == ROPE_FREQS), None)
    stop = stop_ids_from(meta)
    cfg = config_from_gguf(meta, shapes, rope, len(tokens[1]) if tokens is not None else None, stop)
    keep = frozenset()
    if keep_blocks:
        from refimpl.quant.apply import quantized_names
        keep = frozenset(quantized_names(cfg, keep_lm_head_blocks))
    # dequantizing is most of the start-up: spread it over the cores, and build the tokenizer meanwhile
    with ThreadPoolExecutor(max_workers=min(4, len(os.sched_getaffinity(0)))) as pool:
        tokenizer = pool.submit(build_tokenizer, meta, source) if with_tokenizer else None
        params = load_params(tensors, cfg, source, pool, keep)
        tokenizer = tokenizer.result() if tokenizer is not None else None
    return Checkpoint(path, cfg, params, tokenizer, stop)
