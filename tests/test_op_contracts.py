"""The written contracts beside the op interface (tests/test_interface.py): accel's fused ops
(accel.ops.fused_interface.FusedOps) and the engine contract (refimpl.engine_protocol.Engine), which
RefEngine and AccelEngine must both satisfy: by signature, and by behaviour on the golden toy model."""
import inspect
from pathlib import Path

import numpy as np
import pytest

from refimpl.engine_protocol import Engine
from refimpl.formats.checkpoint import load_checkpoint
from refimpl.generate import RefEngine, Sampling
from refimpl.model.names import activation_names

torch = pytest.importorskip("torch")
from accel import ops  # noqa: E402
from accel.engine import AccelEngine  # noqa: E402
from accel.ops.fused_interface import FUSED_OP_NAMES, FusedOps  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "toy-gqa"


def _members(protocol) -> set[str]:
    return {name for name, member in vars(protocol).items() if callable(member) and not name.startswith("_")}


def _signature(fn, drop_self: bool):
    params = list(inspect.signature(fn).parameters.values())[1 if drop_self else 0:]
    return [(p.name, p.default, p.kind) for p in params]


def test_fused_op_names_match_the_protocol():
    assert _members(FusedOps) == set(FUSED_OP_NAMES)


@pytest.mark.parametrize("op", FUSED_OP_NAMES)
def test_accel_ops_has_each_fused_op_with_the_protocol_signature(op):
    assert isinstance(ops, FusedOps)
    assert _signature(getattr(ops, op), drop_self=False) == _signature(getattr(FusedOps, op), drop_self=True)


@pytest.mark.parametrize("engine_cls", [RefEngine, AccelEngine])
@pytest.mark.parametrize("method", sorted(_members(Engine)))
def test_engine_methods_have_the_protocol_signature(engine_cls, method):
    assert _signature(getattr(engine_cls, method), True) == _signature(getattr(Engine, method), True), \
        f"{engine_cls.__name__}.{method}"


@pytest.fixture(scope="module")
def engines():
    ckpt = load_checkpoint(GOLDEN, with_tokenizer=False)
    return RefEngine(ckpt), AccelEngine.from_checkpoint(ckpt, device="cpu", dtype="fp32", use_triton=False)


def test_both_engines_behave_as_the_protocol_says(engines):
    ids = [5, 17, 42, 8]
    per_engine = []
    for engine in engines:
        assert isinstance(engine, Engine) and engine.backend in ("refimpl", "accel")
        cache = engine.new_cache(16)
        names, values = [], {}
        for name, value in engine.steps(ids, np.arange(len(ids)), cache):
            names.append(name)
            values[name] = engine.to_numpy(value)
        assert names == activation_names(engine.config.num_hidden_layers)
        logits = values["logits"]
        assert logits.dtype == np.float32 and logits.shape == (len(ids), engine.config.vocab_size)
        back = engine.to_numpy(engine.from_numpy(logits))
        np.testing.assert_array_equal(back, logits)  # fp32 round trip is exact
        tokens = list(engine.generate(ids, Sampling(max_new_tokens=4)))
        assert len(tokens) == 4 and all(isinstance(t, int) for t in tokens)
        per_engine.append((logits, tokens))
    (ref_logits, ref_tokens), (acc_logits, acc_tokens) = per_engine
    np.testing.assert_allclose(acc_logits, ref_logits, rtol=1e-4, atol=1e-4)  # fp32, summation order only
    assert acc_tokens == ref_tokens
