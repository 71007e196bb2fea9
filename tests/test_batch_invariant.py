"""The batch engine's batch-invariant mode: a request's logits are the same bits alone and in any batch (other
requests, another token budget and so other prefill chunks, a tiny pool's preemptions), on CPU fp32 with the torch
ops and, under the Triton interpreter, with the kernels (accel/kernels/matmul.py, paged_attn.py's ordered combine).
The default mode is not (the first test shows the difference is there to catch), and the mode's greedy ids are still
HF's."""
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from accel import ops  # noqa: E402
from accel.batch import BatchEngine, SamplingParams  # noqa: E402
from accel.kernels.matmul import invariant_matmul_fwd  # noqa: E402
from refimpl.formats.checkpoint import load_checkpoint  # noqa: E402

V = 211
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("torch_one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=500000.0, tie_word_embeddings=False,
        rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("inv")
    model.save_pretrained(path)
    return model, load_checkpoint(path, with_tokenizer=False)


def prompts():
    rng = random.Random(1)
    shared = [rng.randrange(V) for _ in range(12)]
    return [[rng.randrange(V) for _ in range(n)] for n in (23, 3, 40, 9)] + [shared + [7, 8], shared + [9]]


def logits_of(ckpt, batch, target, **kw):
    """The logits target's tokens were drawn from, step by step, with `batch` in the engine."""
    eng = BatchEngine.from_checkpoint(ckpt, device="cpu", block_size=4, **kw)
    eng.record_logits = True
    ids = [eng.add_request(p, PARAMS) for p in batch]
    rows = []
    while eng.has_unfinished():
        eng.step()
        if ids[target] in eng.last_logits:
            rows.append(eng.last_logits[ids[target]].clone())
    return torch.stack(rows)


def compositions(ckpt, target_prompt, **kw):
    ps = prompts()
    yield logits_of(ckpt, [target_prompt], 0, **kw)
    yield logits_of(ckpt, ps[:3] + [target_prompt] + ps[3:], 3, **kw)
    yield logits_of(ckpt, [target_prompt] + ps, 0, max_num_batched_tokens=11, **kw)  # other chunks
    yield logits_of(ckpt, ps + [target_prompt], len(ps), num_blocks=22, **kw)  # preemptions


def test_the_default_mode_is_not_bitwise_invariant(pair):
    _, ckpt = pair
    runs = list(compositions(ckpt, prompts()[0]))
    assert any(not torch.equal(runs[0], r) for r in runs[1:])  # else the invariant test below proves nothing


def test_batch_invariant_logits_are_bitwise_equal(pair):
    model, ckpt = pair
    target = prompts()[0]
    runs = list(compositions(ckpt, target, batch_invariant=True))
    for r in runs[1:]:
        assert torch.equal(runs[0], r), f"max difference {(runs[0] - r).abs().max().item():.3g}"
    ids = torch.tensor([target])
    model.generation_config.eos_token_id = None
    hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert runs[0].argmax(-1).tolist() == hf[0, len(target):].tolist()


@pytest.mark.skipif(not ops.triton_available(torch.device("cpu")), reason="needs TRITON_INTERPRET=1")
def test_batch_invariant_kernels_under_the_interpreter(pair):
    _, ckpt = pair
    target = prompts()[1]
    alone = logits_of(ckpt, [target], 0, batch_invariant=True, use_triton=True)
    mixed = logits_of(ckpt, [prompts()[3], target], 1, batch_invariant=True, use_triton=True,
                      max_num_batched_tokens=6)
    assert torch.equal(alone, mixed)


@pytest.mark.skipif(not ops.triton_available(torch.device("cpu")), reason="needs TRITON_INTERPRET=1")
def test_invariant_matmul_rows_do_not_depend_on_the_row_count():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 70, generator=g)
    w = torch.randn(45, 70, generator=g)
    full = invariant_matmul_fwd(x, w)
    torch.testing.assert_close(full, x @ w.t(), rtol=1e-5, atol=1e-5)
    for lo, hi in ((0, 1), (5, 22), (36, 37)):
        assert torch.equal(invariant_matmul_fwd(x[lo:hi].contiguous(), w), full[lo:hi])
