"""AccelEngine against the NumPy reference (the oracle), tiny random configs built here.

On a CPU-only machine (CI) the engine runs fp32 with its Triton kernels under the interpreter (conftest sets
TRITON_INTERPRET=1), so the fast path's wiring (fused weights, fused ops, static cache, decode over the cache) is
what is checked; GPU-only tests add bf16 and the CUDA graph.

Tolerances: refimpl.compare.TOLERANCES (fp32: NMSE 1e-9, max_rel 1e-4; bf16: NMSE 1e-3, max_rel 6e-2), whose
docstring says why.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from accel import engine as accel_engine  # noqa: E402
from accel.engine import AccelEngine  # noqa: E402
from accel.sampling import make_generator, probabilities, sample  # noqa: E402
from refimpl.formats.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from refimpl.formats.params import Checkpoint, random_params  # noqa: E402
from refimpl.compare import TOLERANCES, compare  # noqa: E402
from refimpl.model.config import LlamaConfig, RopeScaling  # noqa: E402
from refimpl.errors import GenerationError, NonFiniteError  # noqa: E402
from refimpl.generate import RefEngine, Sampling  # noqa: E402
from refimpl.model.llama import collect  # noqa: E402
from refimpl.model.names import activation_names  # noqa: E402
from tests._logits import unexplained_flips  # noqa: E402

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
PROMPT = [3, 17, 42, 5, 88, 61, 7]

# llama3 rope scaling with a tiny original length, so that the scaled bands are crossed at these positions
CONFIGS = {
    "gqa_tied": LlamaConfig(vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8),
                            max_position_embeddings=256, tie_word_embeddings=True),
    "mqa_untied_hd24": LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=24,
                                   max_position_embeddings=256, tie_word_embeddings=False),
}


def checkpoint(tmp_path, name, seed=0):
    """Written and read back through safetensors, as a user's model directory would be."""
    cfg = CONFIGS[name]
    # std 0.15: far from uniform logits, so greedy argmax margins dwarf fp32 summation-order differences
    save_checkpoint(tmp_path / name, cfg, random_params(cfg, seed=seed, std=0.15))
    return load_checkpoint(tmp_path / name, with_tokenizer=False)


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    ckpt = checkpoint(tmp_path_factory.mktemp("ckpt"), request.param)
    return RefEngine(ckpt), AccelEngine.from_checkpoint(ckpt, device="cpu", dtype="fp32"), ckpt


def torch_only(acc):
    """The same weights through accel.ops' torch fallbacks (a CPU without the interpreter): fast under CI."""
    return AccelEngine(acc.config, acc.weights, acc.device, acc.dtype_name, use_triton=False)


def test_greedy_tokens_match_refimpl(pair):
    ref, acc, _ = pair
    s = Sampling(max_new_tokens=20)
    expected = list(ref.generate(PROMPT, s))
    assert list(acc.generate(PROMPT, s)) == expected
    assert list(torch_only(acc).generate(PROMPT, s)) == expected
    # a second, shorter request reuses the session (cache + decoder) and must not see the first one's state
    assert list(acc.generate(PROMPT[:3], Sampling(max_new_tokens=5))) == list(ref.generate(PROMPT[:3],
                                                                                          Sampling(max_new_tokens=5)))


def test_stop_ids_end_generation(pair):
    ref, acc = pair[0], torch_only(pair[1])
    full = list(ref.generate(PROMPT, Sampling(max_new_tokens=8)))
    stop = full[3]
    got = list(acc.generate(PROMPT, Sampling(max_new_tokens=8), stop_ids=(stop,)))
    assert got == full[: full.index(stop) + 1]


def _trace(engine, ids, cache):
    out = {}
    steps = engine.steps(ids, np.arange(len(ids)), cache)
    while True:
        try:
            name, value = next(steps)
        except StopIteration as stop:
            return out, stop.value
        out[name] = engine.to_numpy(value)


def test_trace_names_and_values_match_refimpl(pair):
    ref, acc, ckpt = pair
    cfg = ckpt.config
    got, logits = _trace(acc, PROMPT, acc.new_cache(16))
    assert list(got) == activation_names(cfg.num_hidden_layers)
    from refimpl.model import ops as np_ops
    want, want_logits = collect(np_ops, ckpt.params, cfg, np.asarray(PROMPT), np.arange(len(PROMPT)),
                                ref.new_cache(16))
    bad = [c for c in (compare(n, got[n], want[n], TOLERANCES["fp32"]) for n in want) if not c.ok]
    assert not bad, f"{len(bad)} activations differ, first {bad[0]}"
    assert compare("logits", acc.to_numpy(logits), want_logits, TOLERANCES["fp32"]).ok


def test_prefill_past_the_session_is_an_error(pair):
    """A chunk that would run past the session's cache slots: a one-line GenerationError before any launch, not a
    short RoPE slice failing inside a kernel (or a broadcast error on the torch path)."""
    _, acc, _ = pair
    sess = acc.session(8)
    with pytest.raises(GenerationError, match="do not fit the session's"):
        acc.prefill(PROMPT + [1] * (sess.cache.capacity + 1 - len(PROMPT)), sess)
    with pytest.raises(GenerationError, match="after 5 do not fit"):
        acc.prefill([1] * (sess.cache.capacity - 4), sess, start=5)


def test_fast_prefill_chunks_match_refimpl(pair):
    """accel.model.prefill (the last layer on the last row only; the residual add in the o/down GEMMs' epilogue):
    a prompt, then a chunk continuing it in the same cache, each chunk's last-token logits against refimpl's
    forward over the whole sequence so far; every cache slot written as refimpl's."""
    from refimpl.model import ops as np_ops
    ref, acc, ckpt = pair
    cfg, more = ckpt.config, [9, 2, 77, 30]
    sess = acc.session(16)
    got = [acc.to_numpy(acc.prefill(PROMPT, sess)), acc.to_numpy(acc.prefill(more, sess, start=len(PROMPT)))]
    for ids, logits in ((PROMPT, got[0]), (PROMPT + more, got[1])):
        cache = ref.new_cache(16)
        _, want = collect(np_ops, ckpt.params, cfg, np.asarray(ids), np.arange(len(ids)), cache)
        assert compare("logits", logits[-1], want[-1], TOLERANCES["fp32"]).ok
    n = len(PROMPT) + len(more)
    for layer in range(cfg.num_hidden_layers):
        for got_c, want_c in ((sess.cache.k_all, cache.k), (sess.cache.v_all, cache.v)):
            assert compare("cache", acc.to_numpy(got_c[layer][:, :n]), want_c[layer][:, :n], TOLERANCES["fp32"]).ok


def test_trace_send_replaces_a_value(pair):
    """The debugger's substitution: a value sent back replaces the activation for the rest of the forward."""
    _, acc, ckpt = pair
    steps = acc.steps(PROMPT, np.arange(len(PROMPT)), acc.new_cache(16))
    name, value = next(steps)
    assert name == "embed"
    name, value = steps.send(acc.from_numpy(np.zeros(acc.to_numpy(value).shape, np.float32), like=value))
    assert name == "layers.0.attn_norm" and not acc.to_numpy(value).any()  # norm of zeros is zeros


def test_fused_weights_are_the_originals(pair):
    _, acc, ckpt = pair
    for name, array in ckpt.params.items():
        got = acc.params[name]
        np.testing.assert_array_equal(acc.to_numpy(got), array, err_msg=name)
    w, cfg = acc.weights, ckpt.config
    layer = w.layers[0]
    q = acc.params["model.layers.0.self_attn.q_proj.weight"]
    up = acc.params["model.layers.0.mlp.up_proj.weight"]
    # views into the fused tensors, not copies
    assert q.untyped_storage().data_ptr() == layer.qkv.untyped_storage().data_ptr()
    assert up.data_ptr() == layer.gate_up.data_ptr() + cfg.intermediate_size * cfg.hidden_size * up.element_size()
    assert layer.qkv.shape == (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)
    assert (w.lm_head is w.embed) == cfg.tie_word_embeddings


def test_seeded_sampling_is_reproducible(pair):
    acc = torch_only(pair[1])  # the sampler is the same on either path
    s = Sampling(max_new_tokens=20, temperature=1.5, top_k=40, top_p=0.95, seed=1234)
    first = list(acc.generate(PROMPT, s))
    assert list(acc.generate(PROMPT, s)) == first
    other = list(acc.generate(PROMPT, Sampling(20, 1.5, 40, 0.95, seed=99)))
    assert other != first  # 20 draws from ~40 likely tokens: equal sequences would mean the seed is ignored


LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


@pytest.mark.parametrize("top_k, top_p, expected", [
    (0, 1.0, [0.5, 0.3, 0.15, 0.05]),
    (3, 1.0, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),  # top-k: the three largest, renormalized
    (0, 0.7, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),  # 0.5 < 0.7 <= 0.5 + 0.3: the first two
    (0, 0.8, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),  # mass exactly reaching top_p stops there (refimpl's searchsorted)
    (0, 0.3, [1.0, 0.0, 0.0, 0.0]),
])
def test_sampling_distribution(top_k, top_p, expected):
    s = Sampling(max_new_tokens=1, temperature=1.0, top_k=top_k, top_p=top_p, seed=0)
    np.testing.assert_allclose(probabilities(LOGITS, s).numpy(), expected, atol=1e-6)
    g = make_generator(torch.device("cpu"), 0)
    draws = np.bincount([int(sample(LOGITS, s, g)) for _ in range(3000)], minlength=4) / 3000
    np.testing.assert_allclose(draws, expected, atol=0.035)  # 3000 draws: binomial sd <= 0.0092, so ~4 sd


def test_temperature_scales_logits():
    s = Sampling(max_new_tokens=1, temperature=0.5)
    p = probabilities(LOGITS, s).numpy()
    q = np.array([0.5, 0.3, 0.15, 0.05]) ** 2
    np.testing.assert_allclose(p, q / q.sum(), atol=1e-6)  # softmax(log p / 0.5) ∝ p²
    assert int(sample(LOGITS, Sampling(max_new_tokens=1), make_generator(torch.device("cpu"), 0))) == 0  # greedy


@pytest.mark.parametrize("device", ["nonsense", "tpu", "cuda:7" if CUDA else "cuda"])
def test_bad_device_is_a_generation_error(tmp_path, device):
    ckpt = checkpoint(tmp_path, "gqa_tied")
    with pytest.raises(GenerationError, match="--device"):
        AccelEngine.from_checkpoint(ckpt, device=device)


def test_bad_dtype_is_a_generation_error(tmp_path):
    with pytest.raises(GenerationError, match="--dtype"):
        AccelEngine.from_checkpoint(checkpoint(tmp_path, "gqa_tied"), device="cpu", dtype="fp8")


def test_cache_too_large_is_refused_before_allocating(tmp_path, monkeypatch):
    acc = AccelEngine.from_checkpoint(checkpoint(tmp_path, "gqa_tied"), device="cpu")
    monkeypatch.setattr(accel_engine, "free_bytes", lambda device: 1000)  # pretend 1000 bytes are free
    with pytest.raises(GenerationError, match=r"needs .* GiB .* only .* GiB is free"):
        acc.new_cache(200)


def test_nan_names_the_first_nonfinite_activation(tmp_path):
    ckpt = checkpoint(tmp_path, "mqa_untied_hd24")
    params = dict(ckpt.params)
    params["model.layers.1.mlp.up_proj.weight"] = params["model.layers.1.mlp.up_proj.weight"].copy()
    params["model.layers.1.mlp.up_proj.weight"][3, :] = np.nan
    acc = AccelEngine.from_checkpoint(Checkpoint(ckpt.path, ckpt.config, params), device="cpu")
    with pytest.raises(NonFiniteError, match=r"'layers\.1\.mlp\.up' at position 0"):
        list(acc.generate(PROMPT, Sampling(max_new_tokens=3)))


# ---- GPU only ----

@gpu
def test_gpu_fp32_greedy_matches_refimpl(tmp_path):
    ckpt = checkpoint(tmp_path, "gqa_tied")
    s = Sampling(max_new_tokens=20)
    acc = AccelEngine.from_checkpoint(ckpt, device="cuda", dtype="fp32")
    assert list(acc.generate(PROMPT, s)) == list(RefEngine(ckpt).generate(PROMPT, s))


@gpu
def test_gpu_bf16_top1_agrees_with_fp32_refimpl(tmp_path):
    """Teacher-forced on the refimpl's own greedy sequence: bf16 logits at each step vs the fp32 oracle's."""
    ckpt = checkpoint(tmp_path, "gqa_tied")
    ref, acc = RefEngine(ckpt), AccelEngine.from_checkpoint(ckpt, device="cuda", dtype="bf16")
    n = 24
    seq = PROMPT + list(ref.generate(PROMPT, Sampling(max_new_tokens=n)))
    ref_cache = ref.new_cache(len(seq))
    want = [ref.logits(PROMPT, np.arange(len(PROMPT)), ref_cache)]
    want += [ref.logits([t], [p], ref_cache) for p, t in enumerate(seq[len(PROMPT):-1], start=len(PROMPT))]
    sess = acc.session(len(seq))
    got = [acc.prefill(PROMPT, sess)]
    got += [sess.decoder.step(torch.tensor([t], device="cuda"), p).clone()
            for p, t in enumerate(seq[len(PROMPT):-1], start=len(PROMPT))]
    got = [acc.to_numpy(g)[0] for g in got]
    flips = unexplained_flips(np.stack(got), np.stack(want))  # every step's top-1, but a near-tie of the oracle's
    assert not flips, f"bf16 top-1 differs from fp32 beyond a near-tie: {flips}"
    worst = max(compare("logits", g, w, TOLERANCES["bf16"]).nmse for g, w in zip(got, want))
    assert worst <= TOLERANCES["bf16"].nmse, f"logits NMSE {worst:.2e}"


@gpu
def test_gpu_graph_decode_equals_eager_decode(tmp_path):
    ckpt = checkpoint(tmp_path, "gqa_tied")
    graphed = AccelEngine.from_checkpoint(ckpt, device="cuda", dtype="bf16")
    eager = AccelEngine(graphed.config, graphed.weights, graphed.device, "bf16", use_graph=False)
    assert graphed.session(64).decoder.graph is not None and eager.session(64).decoder.graph is None
    outs = []
    for engine in (graphed, eager):
        sess = engine.session(64)
        logits = engine.prefill(PROMPT, sess)
        steps = []
        for p, t in enumerate([5, 9, 11, 2, 77, 31], start=len(PROMPT)):
            steps.append(sess.decoder.step(torch.tensor([t], device="cuda"), p).float().cpu().clone())
        outs.append(torch.stack([logits.float().cpu()] + steps))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)  # same kernels, same order: bit-identical
    s = Sampling(max_new_tokens=20)
    assert list(graphed.generate(PROMPT, s)) == list(eager.generate(PROMPT, s))


@gpu
def test_gpu_cache_larger_than_memory_is_refused(tmp_path):
    ckpt = checkpoint(tmp_path, "gqa_tied")
    cfg = LlamaConfig(**{**{f: getattr(ckpt.config, f) for f in ("vocab_size", "hidden_size",
                                                                 "intermediate_size", "num_hidden_layers",
                                                                 "num_attention_heads", "num_key_value_heads")},
                         "max_position_embeddings": 2**31 - 1})
    acc = AccelEngine.from_checkpoint(Checkpoint(ckpt.path, cfg, ckpt.params), device="cuda")
    with pytest.raises(GenerationError, match="is free"):
        acc.new_cache(2**31 - 1)


@pytest.mark.parametrize("V", [7, 512, 1000, 1536, 5000, 3093])
def test_argmax_row_is_the_first_maximum(V):
    from accel.ops import argmax_row
    g = torch.Generator().manual_seed(V)
    for _ in range(50):
        x = torch.randint(-3, 3, (1, V), generator=g).float()  # many ties: the first maximum must win
        assert int(argmax_row(x)) == int(np.argmax(x.numpy()))


@pytest.mark.parametrize("V", [7, 1000, 1024, 3093, 5000])
def test_argmax_kernel_is_the_first_maximum_and_advances(V):
    """accel/kernels/argmax.py (under TRITON_INTERPRET on CPU, compiled on CUDA): np.argmax's first-maximum rule
    on tie-heavy rows over 1-5 programs, NaN winning as in torch.argmax, and the greedy bookkeeping."""
    import os
    dev = "cuda" if CUDA else "cpu"
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors reach the kernel only under TRITON_INTERPRET=1")
    from accel.kernels.argmax import argmax_fwd
    g = torch.Generator().manual_seed(V)
    for _ in range(5):
        x = torch.randint(-3, 3, (1, V), generator=g).float()
        assert int(argmax_fwd(x.to(dev))) == int(np.argmax(x.numpy()))
    x[0, V // 2] = float("nan")
    assert int(argmax_fwd(x.to(dev))) == int(torch.argmax(x)) == V // 2
    token, pos, step = (torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(3))
    pos += 40
    hist = torch.full((4,), -1, dtype=torch.int64, device=dev)
    for i in range(3):
        x = torch.randn(V, generator=g)
        argmax_fwd(x.to(dev), token, pos, hist, step)
        assert int(token) == int(hist[i]) == int(np.argmax(x.numpy())) and int(step) == i + 1 and int(pos) == 41 + i
    assert int(hist[3]) == -1


@pytest.mark.parametrize("which", ["kernels", "torch ops"])
def test_decode_greedy_matches_refimpl(pair, which):
    """The benchmark's loop (greedy step with the argmax, history and position kept on the device)."""
    ref, acc, _ = pair
    acc = acc if which == "kernels" else torch_only(acc)
    sess = acc.session(len(PROMPT) + 12)
    tokens = acc.decode_greedy(sess, acc.prefill(PROMPT, sess), len(PROMPT), 12)
    assert tokens.tolist() == list(ref.generate(PROMPT, Sampling(max_new_tokens=12)))
    with pytest.raises(GenerationError, match="do not fit"):  # (the session may be an earlier, larger one)
        acc.decode_greedy(sess, acc.prefill(PROMPT, sess), len(PROMPT), sess.capacity - len(PROMPT) + 2)


@gpu
def test_gpu_greedy_decode_loop_never_syncs_with_the_host(tmp_path):
    ckpt = checkpoint(tmp_path, "gqa_tied")
    acc = AccelEngine.from_checkpoint(ckpt, device="cuda", dtype="bf16")
    sess = acc.session(40)
    logits = acc.prefill(PROMPT, sess)
    acc.decode_greedy(sess, logits, len(PROMPT), 2)  # the first call captures the greedy graph (capture syncs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call (.item(), a blocking copy) raises
    try:
        tokens = acc.decode_greedy(sess, logits, len(PROMPT), 12)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    s = Sampling(max_new_tokens=12)
    assert tokens.tolist() == list(acc.generate(PROMPT, s))
