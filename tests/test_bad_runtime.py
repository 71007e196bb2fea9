"""Run-time bad input: sampling arguments, prompts, context, devices, memory, chat templates, NaN/Inf activations."""
import json
import time
import tracemalloc
import warnings

import numpy as np
import pytest

from _badinput import (assert_clean_error, edit_config, first_nonfinite_name, generate_args, make_model, run_cli,
                       tiny_config)
from refimpl.formats.checkpoint import load_checkpoint
from refimpl.formats.params import random_params
from refimpl.errors import GenerationError
from refimpl.generate import RefEngine, Sampling, check_prompt


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("runtime") / "m")


@pytest.mark.parametrize("args, expected", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be a positive integer, got 0"),
    (["--max-new-tokens", "-5"], "--max-new-tokens must be a positive integer, got -5"),
    (["--temperature", "-0.5"], "--temperature must be a number >= 0"),
    (["--temperature", "nan"], "--temperature must be a number >= 0"),
    (["--temperature", "inf"], "--temperature must be a number >= 0"),
    (["--top-p", "0"], "--top-p must be a number in (0, 1], got 0.0"),
    (["--top-p", "1.5"], "--top-p must be a number in (0, 1], got 1.5"),
    (["--top-p", "nan"], "--top-p must be a number in (0, 1]"),
    (["--top-k", "-1"], "--top-k must be an integer >= 0"),
    (["--seed", "-1"], "--seed must be an integer in [0, 2^64)"),
    (["--backend", "refimpl", "--device", "cuda:0"], "--device 'cuda:0': the refimpl backend runs on the CPU only"),
])
def test_bad_generate_argument(model, args, expected):
    assert_clean_error(run_cli(generate_args(model, *args)), expected)


def test_max_new_tokens_past_the_context(model):
    """Lowered to what fits, with a notice; a prompt that alone fills the context is an error."""
    result = run_cli(generate_args(model, "--max-new-tokens", "62"))
    assert result.exit_code == 0, result.output
    assert "--max-new-tokens 62 lowered to 61" in result.output
    assert_clean_error(run_cli(generate_args(model, prompt="x " * 70)), "fills the model's context of 64 positions")


@pytest.mark.parametrize("prompt", ["", "   "])
def test_empty_prompt(model, prompt):
    assert_clean_error(run_cli(generate_args(model, prompt=prompt)), "the prompt is empty")


def test_valid_arguments_still_work(model):
    """The guards above must not refuse the edges of the valid ranges."""
    result = run_cli(generate_args(model, "--max-new-tokens", "61", "--top-p", "1", "--top-k", "0",
                                   "--temperature", "0.7", "--seed", "0", "--json"))
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["generated_ids"]) >= 1


def test_token_ids_outside_vocabulary(model):
    engine = RefEngine(load_checkpoint(model))
    for ids, bad in (([1, 64], 64), ([-1, 2], -1)):
        with pytest.raises(GenerationError, match=f"token id {bad} is outside the vocabulary"):
            next(engine.generate(ids, Sampling(max_new_tokens=1)))


def test_prompt_beyond_kv_cache_capacity():
    """Engines with a fixed cache pass its capacity as the context: the check names it."""
    with pytest.raises(GenerationError, match="exceeds the context of 16 positions"):
        check_prompt([1] * 10, vocab_size=64, max_new_tokens=7, context=16)
    check_prompt([1] * 10, vocab_size=64, max_new_tokens=6, context=16)  # exactly full is fine


def test_refimpl_cache_larger_than_memory(tmp_path):
    """2^46 positions is a 2 PB cache: more than any address space, so the allocation fails on every machine."""
    model = make_model(tmp_path / "m")
    edit_config(model, max_position_embeddings=2 ** 47)
    assert_clean_error(run_cli(generate_args(model, "--max-new-tokens", str(2 ** 46))), "KV cache",
                       "more memory than is available")


def _accel_importable():
    try:
        import accel.engine  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _accel_importable(), reason="accel backend (torch + triton) not importable")
def test_accel_device_that_does_not_exist(model):
    import torch
    if torch.cuda.is_available() and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    assert_clean_error(run_cli(generate_args(model, "--backend", "accel", "--device", "cuda:7")), "cuda:7")


@pytest.mark.skipif(not _accel_importable(), reason="accel backend (torch + triton) not importable")
def test_accel_device_name_nonsense(model):
    assert_clean_error(run_cli(generate_args(model, "--backend", "accel", "--device", "gpu-please")), "gpu-please")


@pytest.mark.gpu
@pytest.mark.skipif(not _accel_importable(), reason="accel backend (torch + triton) not importable")
def test_accel_cache_larger_than_gpu_memory(tmp_path):
    import torch
    if not torch.cuda.is_available():
        pytest.skip("accel checks free memory on CUDA devices only")
    model = make_model(tmp_path / "m")
    edit_config(model, max_position_embeddings=2 ** 40)
    t0 = time.perf_counter()
    assert_clean_error(run_cli(generate_args(model, "--backend", "accel", "--device", "cuda",
                                             "--max-new-tokens", str(2 ** 39))), "memory")
    assert time.perf_counter() - t0 < 60


# ---- chat templates from strangers ----
TEMPLATES = {
    "python internals": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe operation"),
    "globals via a function": ("{{ raise_exception.__globals__['os'] }}", "unsafe operation"),
    "mutating a list": ("{% set xs = [] %}{{ xs.append(1) }}{{ xs }}", "unsafe operation"),
    "mutating a dict": ("{% set d = {} %}{{ d.update({'a': 1}) }}", "unsafe operation"),
    "gigabyte string": ("{{ 'a' * 10**10 }}", "too large"),
    "huge power": ("{{ 7 ** 1000000000 > 1 }}", "too large"),  # hours of bignum work without the guard
    "division by zero": ("{{ 1 / 0 }}", "ZeroDivisionError"),
    "endless recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "chat template failed to render"),
    "syntax error": ("{% for m in messages %}{{ m.content }}", "chat template failed to render"),
    "raise_exception": ("{{ raise_exception('only user and assistant roles') }}", "only user and assistant roles"),
}


@pytest.mark.parametrize("case", list(TEMPLATES))
def test_hostile_chat_template(tmp_path, case):
    template, expected = TEMPLATES[case]
    model = make_model(tmp_path / "m")
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tracemalloc.start()
    t0 = time.perf_counter()
    result = run_cli(generate_args(model, "--chat"))
    elapsed, peak = time.perf_counter() - t0, tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert_clean_error(result, "chat template", expected)
    assert elapsed < 10 and peak < 200 * 2 ** 20, (elapsed, peak)


def test_benign_chat_template_still_renders(tmp_path):
    model = make_model(tmp_path / "m")
    template = ("{% for m in messages %}{{ m['content'] }}{{ ' w0' * 2 }}{% endfor %}"
                "{% set ns = namespace(n=0) %}{{ ' w%d' % (2 ** 3) }}")
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    result = run_cli(generate_args(model, "--chat", "--json", prompt="w1"))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["prompt_ids"] == [1, 0, 0, 8]


# ---- NaN / Inf in activations ----
def _poisoned_model(tmp_path, name, index=None):
    cfg = tiny_config()
    params = random_params(cfg, seed=3)
    if index is None:
        params[name][...] = np.inf
    else:
        params[name][index] = np.inf
    return make_model(tmp_path / "m", cfg, params), cfg, params


def _expected_first_nonfinite(model, prompt_ids):
    """The test's own scan of the forward (the engine's detection is what is under test)."""
    engine = RefEngine(load_checkpoint(model))
    steps = engine.steps(prompt_ids, np.arange(len(prompt_ids)), engine.new_cache(len(prompt_ids)),
                         last_logits_only=True)
    return first_nonfinite_name(steps)


@pytest.mark.parametrize("param, index, analytic", [
    # an inf weight in layer 1's down projection: everything before layers.1.mlp.down is finite
    ("model.layers.1.mlp.down_proj.weight", (3, 5), "layers.1.mlp.down"),
    ("model.layers.0.self_attn.v_proj.weight", None, "layers.0.attn.v"),
    ("model.embed_tokens.weight", (2,), "embed"),  # token 2's row only: 'w2' is in the prompt
    ("model.norm.weight", (0,), "final_norm"),
])
def test_nonfinite_activation_is_named(tmp_path, param, index, analytic):
    model, _, _ = _poisoned_model(tmp_path, param, index)
    with np.errstate(all="ignore"):
        expected = _expected_first_nonfinite(model, [1, 2, 3])
    assert expected == analytic
    with warnings.catch_warnings(record=True) as caught:  # NumPy's RuntimeWarnings would be extra stderr lines
        warnings.simplefilter("always")
        result = run_cli(generate_args(model))
    assert_clean_error(result, "NaN or Inf", f"activation {expected!r}", "position 0")
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
