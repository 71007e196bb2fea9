"""The batch engine on the GPU: bf16 rows in a batch against the same request alone (logits within bf16 tolerance),
CUDA-graph steps against eager ones, and fp32 GPU ids against the CPU engine's (which tests/test_batch_engine.py checks
against HF). Random weights at a small Llama shape."""
import random

import pytest

torch = pytest.importorskip("torch")

from accel.batch import BatchEngine, SamplingParams  # noqa: E402
from tests._batch_runs import nmse, run_recording  # noqa: E402
from refimpl.formats.params import Checkpoint, random_params  # noqa: E402
from refimpl.model.config import LlamaConfig, RopeScaling  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CFG = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=32, rope_theta=500000.0, rms_norm_eps=1e-5,
                  rope_scaling=RopeScaling(32.0, 1.0, 4.0, 64), tie_word_embeddings=False, bos_token_id=1,
                  eos_token_ids=(2,), max_position_embeddings=2048)
LENGTHS = [5, 37, 120, 300, 64, 9, 200, 17, 1, 700]


@pytest.fixture(scope="module")
def ckpt():
    return Checkpoint("random", CFG, random_params(CFG, seed=3, std=0.05))


def prompts():
    rng = random.Random(0)
    return [[rng.randrange(CFG.vocab_size) for _ in range(n)] for n in LENGTHS]


def run(eng, prompts, params):
    """-> ([tokens per request], [[logits of each step] per request])."""
    return run_recording(eng, [(p, params, {}) for p in prompts])


PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def test_bf16_batch_rows_match_each_request_alone(ckpt):
    batch_tokens, batch_logits = run(BatchEngine.from_checkpoint(ckpt, dtype="bf16", gpu_memory=1 << 28), prompts(),
                                     PARAMS)
    worst = 0.0
    for p, toks, logits in zip(prompts(), batch_tokens, batch_logits):
        alone_tokens, alone_logits = run(BatchEngine.from_checkpoint(ckpt, dtype="bf16", gpu_memory=1 << 28), [p],
                                         PARAMS)
        for step, (a, b) in enumerate(zip(logits, alone_logits[0])):
            worst = max(worst, nmse(a, b))
            if toks[:step] != alone_tokens[0][:step]:
                break  # a bf16 near-tie went the other way: later steps see other tokens
    print(f"worst logits NMSE, batch row vs alone (bf16): {worst:.2e}")
    assert worst < 1e-3  # llama.cpp grades < 1e-2 "good", < 1e-4 "excellent"


def test_cuda_graphs_match_eager_and_survive_preemption(ckpt):
    eager, _ = run(BatchEngine.from_checkpoint(ckpt, dtype="bf16", gpu_memory=1 << 28, cuda_graphs=False), prompts(),
                   PARAMS)
    graphs_eng = BatchEngine.from_checkpoint(ckpt, dtype="bf16", gpu_memory=1 << 28)
    graphed, _ = run(graphs_eng, prompts(), PARAMS)
    assert graphs_eng.runner.graphs.graphs, "no decode step ran as a graph"
    assert graphed == eager
    tiny = BatchEngine.from_checkpoint(ckpt, dtype="bf16", num_blocks=60, block_size=16, max_num_batched_tokens=256)
    tight, _ = run(tiny, prompts(), PARAMS)
    assert tiny.stats()["num_preemptions"] > 0
    assert sum(a == b for a, b in zip(tight, eager)) >= len(eager) - 1  # bf16: another chunking may flip a near-tie


def test_fp32_gpu_ids_match_the_cpu_engine(ckpt):
    gpu, _ = run(BatchEngine.from_checkpoint(ckpt, dtype="fp32", gpu_memory=1 << 28), prompts(), PARAMS)
    cpu, _ = run(BatchEngine.from_checkpoint(ckpt, device="cpu"), prompts(), PARAMS)
    assert gpu == cpu


def test_bf16_batch_invariant_mode_is_bitwise(ckpt):
    """Not yet run on a GPU when written (CPU: tests/test_batch_invariant.py, torch ops and the interpreter)."""
    target = prompts()[3]

    def logits(batch, index, **kw):
        _, rows = run(BatchEngine.from_checkpoint(ckpt, dtype="bf16", gpu_memory=1 << 28, batch_invariant=True,
                                                  **kw), batch, PARAMS)
        return torch.stack(rows[index])
    alone = logits([target], 0)
    assert torch.equal(alone, logits(prompts(), 3))
    assert torch.equal(alone, logits(prompts(), 3, max_num_batched_tokens=100))


def test_overlapped_steps_give_the_tokens_of_steps_read_back_in_turn(ckpt):
    """overlap (the default on CUDA: each step launched before the previous one's tokens are read back, its decode
    rows' input ids taken on the device, stop tokens learned a step late) against steps read back one at a time:
    the same ids, finish reasons and logprobs for greedy, penalised, seeded, logprobs and stop-id requests (fp32)
    under a pool small enough to preempt."""
    kinds = [dict(), dict(repetition_penalty=1.3), dict(presence_penalty=0.5, frequency_penalty=0.5),
             dict(temperature=0.9, top_k=20, top_p=0.9, seed=7), dict(logprobs=3), dict()]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, **kinds[i % len(kinds)]) for i in range(len(LENGTHS))]
    free = BatchEngine.from_checkpoint(ckpt, dtype="fp32", gpu_memory=1 << 28, overlap=False).generate(prompts(),
                                                                                                       params)
    for i in range(5, len(LENGTHS), len(kinds)):  # greedy requests that stop on their 4th token
        params[i] = SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(free[i].token_ids[3],))

    def outputs(overlap):
        eng = BatchEngine.from_checkpoint(ckpt, dtype="fp32", num_blocks=60, block_size=16,  # 960 slots: preempts
                                          max_num_batched_tokens=256, overlap=overlap)
        outs = eng.generate(prompts(), params)
        assert eng.stats()["num_preemptions"] > 0 and eng.stats()["blocks_used"] == 0
        return outs
    want, got = outputs(False), outputs(True)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    assert any(o.finish_reason == "stop" for o in got)
    for a, b in zip(got, want):
        if b.logprobs is not None:
            assert [t for t, _, _ in a.logprobs] == [t for t, _, _ in b.logprobs]
            assert [lp for _, lp, _ in a.logprobs] == pytest.approx([lp for _, lp, _ in b.logprobs], abs=1e-4)
