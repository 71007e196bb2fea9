"""Sampling rules (refimpl.generate.sample) checked against distributions computed independently in the test."""
import numpy as np
import pytest

from refimpl.errors import GenerationError
from refimpl.generate import Sampling, sample

LOGITS = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15]))  # probabilities at temperature 1


def frequencies(s, n=4000, seed=0):
    rng = np.random.default_rng(seed)
    counts = np.bincount([sample(LOGITS, s, rng) for _ in range(n)], minlength=5)
    return counts / n


def test_greedy_is_argmax():
    assert sample(LOGITS, Sampling(temperature=0), np.random.default_rng(0)) == 1


def test_temperature_one_follows_softmax():
    assert np.abs(frequencies(Sampling(temperature=1.0)) - np.exp(LOGITS)).max() < 0.03


def test_top_k_keeps_k_most_likely():
    f = frequencies(Sampling(temperature=1.0, top_k=2))
    assert f[[0, 2, 4]].sum() == 0
    assert abs(f[1] - 0.4 / 0.7) < 0.03


def test_top_p_keeps_smallest_prefix_reaching_p():
    # sorted: 0.4, 0.3, 0.15, 0.1, 0.05; cumulative 0.4, 0.7, 0.85 -> top_p 0.75 keeps {1, 3, 4}
    f = frequencies(Sampling(temperature=1.0, top_p=0.75))
    assert f[[0, 2]].sum() == 0 and abs(f[4] - 0.15 / 0.85) < 0.03


def test_same_seed_same_tokens():
    s = Sampling(temperature=0.9, top_p=0.95, seed=7)

    def draws():
        rng = np.random.default_rng(s.seed)
        return [sample(LOGITS, s, rng) for _ in range(50)]

    assert draws() == draws() and len(set(draws())) > 1


@pytest.mark.parametrize("kwargs, flag", [({"max_new_tokens": 0}, "--max-new-tokens"),
                                          ({"temperature": -1.0}, "--temperature"),
                                          ({"top_p": 0.0}, "--top-p"), ({"top_p": 1.5}, "--top-p"),
                                          ({"top_k": -1}, "--top-k")])
def test_bad_settings_name_the_flag(kwargs, flag):
    with pytest.raises(GenerationError, match=flag):
        Sampling(**kwargs)
