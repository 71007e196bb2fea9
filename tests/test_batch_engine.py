"""The batch engine (accel.batch) on CPU in fp32 against its oracles: HF transformers' greedy ids
(LlamaForCausalLM.generate) and each request run alone through the same engine.

A batch mixes prompt lengths 3-40, prompts sharing a prefix, chunked prefills, preemption under a tiny pool and seeded
sampling; every request's tokens must be exactly those it gets alone (and, greedy, exactly HF's). fp32 GEMMs of
different row counts may round differently, which could flip a near-tie; these random models have no such ties at
these lengths (an exact-ids oracle, as the issue asks).
"""
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from accel.batch import BatchEngine, RequestOutput, SamplingParams  # noqa: E402
from refimpl.errors import GenerationError  # noqa: E402
from refimpl.formats.checkpoint import load_checkpoint  # noqa: E402

V = 211
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}  # prompts reach past 16: the scaling matters


pytestmark = pytest.mark.usefixtures("torch_one_thread")  # tests/conftest.py


def build(tmp_path, heads, kv_heads, tied, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=256, rope_theta=500000.0, rope_scaling=ROPE,
        tie_word_embeddings=tied, rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
        attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norm weights start at exactly 1; move them so a wrong weight use would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    return model, load_checkpoint(tmp_path, with_tokenizer=False)


@pytest.fixture(scope="module", params=[(8, 2, False), (4, 1, True)], ids=["gqa4", "mqa"])
def pair(request, tmp_path_factory):
    return build(tmp_path_factory.mktemp(request.param_index.__str__()), *request.param)


def hf_greedy(model, prompt, n, **kw):
    ids = torch.tensor([prompt])
    model.generation_config.eos_token_id = None  # as ignore_eos: n tokens, eos among them
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, **kw)  # the mask given: none inferred from pad ids in the prompt
    return out[0, len(prompt):].tolist()


def prompts_mixed(seed=0):
    rng = random.Random(seed)
    shared = [rng.randrange(V) for _ in range(20)]
    lengths = [3, 40, 11, 27, 5, 16, 33]
    prompts = [[rng.randrange(V) for _ in range(n)] for n in lengths]
    prompts += [shared + [rng.randrange(V) for _ in range(k)] for k in (1, 7, 13)]  # a common 20-token prefix
    return prompts


def engine(ckpt, **kw):
    return BatchEngine.from_checkpoint(ckpt, device="cpu", **{"block_size": 4, **kw})


def alone(ckpt, prompt, params):
    return engine(ckpt).generate([prompt], params)[0].token_ids


GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def test_batch_greedy_equals_alone_and_hf(pair):
    model, ckpt = pair
    prompts = prompts_mixed()
    outs = engine(ckpt).generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert isinstance(out, RequestOutput) and out.finished and out.finish_reason == "length"
        assert out.num_prompt_tokens == len(prompt)
        assert out.token_ids == hf_greedy(model, prompt, 8), f"prompt of {len(prompt)} tokens"
        assert out.token_ids == alone(ckpt, prompt, GREEDY)


def test_prefix_sharing_reuses_blocks_and_keeps_tokens(pair):
    model, ckpt = pair
    prompts = prompts_mixed()[-3:]  # 20 shared tokens = 5 full blocks of 4
    eng = engine(ckpt)
    first = eng.add_request(prompts[0], GREEDY)
    eng.step()  # the first prompt's blocks are computed and registered
    rest = [eng.add_request(p, GREEDY) for p in prompts[1:]]
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    assert eng.stats()["prefix_cached_tokens"] == 2 * 20
    for rid, prompt in zip([first] + rest, prompts):
        assert done[rid] == hf_greedy(model, prompt, 8)


def test_chunked_prefill_gives_the_same_tokens(pair):
    _, ckpt = pair
    prompts = prompts_mixed()
    want = engine(ckpt).generate(prompts, GREEDY)
    chunked = engine(ckpt, max_num_batched_tokens=7).generate(prompts, GREEDY)  # 40 tokens: 6 chunks
    assert [o.token_ids for o in chunked] == [o.token_ids for o in want]


def test_preemption_recomputes_the_same_tokens(pair):
    _, ckpt = pair
    prompts = prompts_mixed()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [alone(ckpt, p, params) for p in prompts]
    eng = engine(ckpt, num_blocks=14)  # 56 slots: the 40-token prompt alone needs 13 blocks with its output
    got = eng.generate(prompts, params)
    stats = eng.stats()
    assert stats["num_preemptions"] > 0
    assert [o.token_ids for o in got] == want
    assert stats["blocks_used"] == 0 and stats["running"] == 0 and stats["waiting"] == 0


def test_seeded_sampling_is_independent_of_the_batch(pair):
    _, ckpt = pair
    prompts = prompts_mixed()
    sampled = [SamplingParams(max_tokens=10, temperature=0.9, top_k=k, top_p=p, repetition_penalty=r, seed=s,
                              ignore_eos=True)
               for k, p, r, s in [(0, 1.0, 1.0, 1), (20, 0.9, 1.0, 2), (0, 0.8, 1.3, 3), (5, 1.0, 1.0, 4)]]
    want = [alone(ckpt, prompts[i], sp) for i, sp in enumerate(sampled)]
    # the same requests among greedy ones and each other, in another order, and under a tiny pool
    mixed = [prompts[3], prompts[0], prompts[5], prompts[2], prompts[1]]
    mixed_params = [sampled[3], sampled[0], GREEDY, sampled[2], sampled[1]]
    for eng in (engine(ckpt), engine(ckpt, num_blocks=14, max_num_batched_tokens=9)):
        got = eng.generate(mixed, mixed_params)
        assert [got[1].token_ids, got[4].token_ids, got[3].token_ids, got[0].token_ids] == want
    other_seed = SamplingParams(**{**sampled[0].__dict__, "seed": 99})
    assert alone(ckpt, prompts[0], other_seed) != want[0]


def test_repetition_penalty_matches_hf(pair):
    model, ckpt = pair
    prompt = prompts_mixed()[3]
    params = SamplingParams(max_tokens=10, repetition_penalty=1.5, ignore_eos=True)
    assert alone(ckpt, prompt, params) == hf_greedy(model, prompt, 10, repetition_penalty=1.5)


def test_stop_ids_and_eos(pair):
    _, ckpt = pair
    prompt = prompts_mixed()[1]
    free = alone(ckpt, prompt, GREEDY)
    stop = SamplingParams(max_tokens=8, stop_token_ids=(free[2],), ignore_eos=True)
    out = engine(ckpt).generate([prompt], stop)[0]
    assert out.finish_reason == "stop" and out.token_ids == free[:free.index(free[2]) + 1]
    eos = BatchEngine.from_checkpoint(ckpt, device="cpu", block_size=4)
    eos.stop_ids = frozenset({free[1]})  # as a checkpoint whose generation config lists this id
    out = eos.generate([prompt], SamplingParams(max_tokens=8))[0]
    assert out.finish_reason == "stop" and out.token_ids == free[:free.index(free[1]) + 1]


def test_incremental_outputs_and_abort(pair):
    _, ckpt = pair
    prompts = prompts_mixed()
    eng = engine(ckpt)
    a = eng.add_request(prompts[0], SamplingParams(max_tokens=6, ignore_eos=True), request_id="a")
    b = eng.add_request(prompts[1], SamplingParams(max_tokens=50, ignore_eos=True))
    seen = {a: [], b: []}
    for _ in range(3):
        for out in eng.step():
            seen[out.request_id] += out.new_token_ids
            assert out.token_ids == seen[out.request_id]
    eng.abort(b)
    finals = {}
    while eng.has_unfinished() or not finals.get(b):
        for out in eng.step():
            seen[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
        if b in finals and a in finals:
            break
    assert finals[b].finish_reason == "abort" and len(finals[b].token_ids) == 3
    assert finals[a].finish_reason == "length" and seen[a] == alone(ckpt, prompts[0], SamplingParams(
        max_tokens=6, ignore_eos=True))
    assert eng.stats()["blocks_used"] == 0


def test_triton_kernels_under_the_interpreter_give_the_same_tokens(pair):
    from accel import ops
    if not ops.triton_available(torch.device("cpu")):
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")
    _, ckpt = pair
    if ckpt.config.num_key_value_heads == 1:
        pytest.skip("slow under the interpreter: the GQA model covers the engine's kernel paths (MQA: "
                    "tests/test_batch_paged_attn.py)")
    prompts = [prompts_mixed()[i] for i in (0, 6)]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    eng = engine(ckpt, use_triton=True, max_num_batched_tokens=16)  # prefill chunks after a prefix, and decodes
    assert [o.token_ids for o in eng.generate(prompts, params)] == [alone(ckpt, p, params) for p in prompts]


@pytest.mark.parametrize("prompt,params,message", [
    ([], GREEDY, "the prompt is empty"),
    ([5, V], GREEDY, f"token id {V} is outside the vocabulary"),
    ([5] * 250, GREEDY, "exceed the model's context of 256"),
    ([5] * 100, SamplingParams(max_tokens=40), "need 35 KV blocks but the pool holds 20"),
])
def test_bad_requests_are_refused(pair, prompt, params, message):
    _, ckpt = pair
    eng = engine(ckpt, num_blocks=20)
    with pytest.raises(GenerationError, match=message):
        eng.add_request(prompt, params)
    eng.add_request([1, 2], GREEDY, request_id="x")
    with pytest.raises(GenerationError, match="already in the engine"):
        eng.add_request([1, 2], GREEDY, request_id="x")


def test_bad_options_are_refused(pair):
    _, ckpt = pair
    with pytest.raises(GenerationError, match="dense bf16/fp32 weights only"):
        BatchEngine.from_checkpoint(ckpt, device="cpu", quant="int8")
    with pytest.raises(GenerationError, match="gpu_memory"):
        BatchEngine.from_checkpoint(ckpt, device="cpu", gpu_memory=-1)
    with pytest.raises(GenerationError, match="temperature"):
        SamplingParams(temperature=-1)


def test_nonfinite_logits_name_the_request(pair):
    _, ckpt = pair
    eng = engine(ckpt)
    eng.add_request([5, 6, 7], GREEDY, request_id="fine")
    eng.add_request([8, 9], GREEDY, request_id="broken")
    eng.step()
    layer = eng.runner.w.layers[0]
    layer.attn_norm = layer.attn_norm.clone()  # fp32 on CPU: the weights are views of the read-only checkpoint map
    layer.attn_norm[0] = float("nan")  # every row's next step turns NaN: the first is named
    with pytest.raises(GenerationError, match=r"request 'fine': the logits of generated token 1 hold NaN or Inf"):
        eng.step()


def test_graph_padded_decode_inputs_give_the_same_logits(pair):
    """The inputs a CUDA graph replays (rows padded to a bucket, tables to a width, padding rows writing to the spare
    slot and attending to nothing), run eagerly on CPU, give the unpadded step's logits."""
    from accel.batch.graphs import DecodeGraphs
    _, ckpt = pair
    eng = engine(ckpt)
    for p in prompts_mixed()[:3]:
        eng.add_request(p, GREEDY)
    eng.step()  # the prefills
    batch = eng.scheduler.schedule()  # three decode rows
    plain = eng.runner.prepare(batch)
    eng.runner.graphs = DecodeGraphs(eng.runner)
    padded = eng.runner.prepare(batch)
    assert plain.graph_key is None and padded.graph_key == (4, 64) and padded.tables.shape == (4, 64)
    assert padded.slots[3] == eng.runner.pad_slot and padded.lens[3] == 0
    padded.sample_rows = torch.arange(4)  # as the graph is captured: every row's logits
    with torch.inference_mode():
        want = eng.runner.forward(plain)
        got = eng.runner.forward(padded)
    assert got.shape[0] == 4 and not torch.isnan(got).any()
    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
