"""The batch engine's logprobs and OpenAI's presence / frequency penalties (CPU fp32) against HF transformers: the
logprobs are log-softmax of HF's logits at each generated position; the penalised greedy tokens are those of a plain
loop over HF's logits with OpenAI's formula applied in NumPy."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from accel.batch import BatchEngine, SamplingParams  # noqa: E402
from refimpl.errors import GenerationError  # noqa: E402
from tests.test_batch_engine import build  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build(tmp_path_factory.mktemp("lp"), 8, 2, False)


def engine(ckpt):
    return BatchEngine.from_checkpoint(ckpt, device="cpu", dtype="fp32", max_num_seqs=8)


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].double().numpy()


def test_logprobs_are_the_models_log_softmax(pair):
    model, ckpt = pair
    prompt = [5, 17, 33, 90, 4, 61]
    out = engine(ckpt).generate([prompt, [7, 7, 8]], [SamplingParams(max_tokens=6, logprobs=3, ignore_eos=True),
                                                      SamplingParams(max_tokens=4, ignore_eos=True)])
    assert out[1].logprobs is None  # only asked-for rows carry them
    ids = list(prompt)
    assert len(out[0].logprobs) == 6
    for token, (tid, lp, top) in zip(out[0].token_ids, out[0].logprobs):
        z = hf_logits(model, ids)
        ref = z - np.log(np.exp(z - z.max()).sum()) - z.max()
        assert tid == token
        assert lp == pytest.approx(ref[token], abs=1e-4)
        assert [i for i, _ in top] == list(np.argsort(-ref)[:3])
        assert [v for _, v in top] == pytest.approx(sorted(ref)[::-1][:3], abs=1e-4)
        ids.append(token)


def test_presence_and_frequency_penalties_follow_openai(pair):
    model, ckpt = pair
    prompt, presence, frequency = [3, 9, 27, 81, 50], 0.7, 0.9
    out = engine(ckpt).generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=presence,
                                                         frequency_penalty=frequency))[0]
    ids, gen = list(prompt), []
    for _ in range(12):
        z = hf_logits(model, ids)
        for t in set(gen):
            z[t] -= presence + frequency * gen.count(t)
        gen.append(int(np.argmax(z)))
        ids.append(gen[-1])
    assert out.token_ids == gen
    plain = engine(ckpt).generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert plain.token_ids != gen  # the penalties changed the answer: the test can fail


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("logprobs", 21),
                                          ("logprobs", -1)])
def test_out_of_range_values_are_clear_errors(field, value):
    with pytest.raises(GenerationError, match=field):
        SamplingParams(**{field: value})
