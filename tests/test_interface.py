"""Both backends implement every op of `refimpl.model.interface.Ops`, with the Protocol's parameter names and order."""
import inspect

import pytest

from refimpl.model import interface
from refimpl.model import ops as ref_ops


def _backends():
    yield "refimpl", ref_ops
    try:
        from accel import ops as accel_ops
    except ImportError as e:  # torch/triton missing: only the reference can be checked
        pytest.skip(f"accel needs torch and triton: {e}")
    yield "accel", accel_ops


def _params(fn, drop_self):
    names = [p.name for p in inspect.signature(fn).parameters.values()]
    defaults = [p.default for p in inspect.signature(fn).parameters.values()]
    return (names[1:], defaults[1:]) if drop_self else (names, defaults)


def test_op_names_match_the_protocol():
    declared = {name for name, member in vars(interface.Ops).items()
                if callable(member) and not name.startswith("_")}
    assert declared == set(interface.OP_NAMES)


@pytest.mark.parametrize("op", interface.OP_NAMES)
def test_each_backend_has_the_op_with_the_protocol_signature(op):
    want = _params(getattr(interface.Ops, op), drop_self=True)
    for backend, module in _backends():
        assert isinstance(module, interface.Ops), f"{backend}.ops does not satisfy refimpl.model.interface.Ops"
        assert hasattr(module, op), f"{backend}.ops lacks {op}"
        got = _params(getattr(module, op), drop_self=False)
        assert got == want, f"{backend}.ops.{op}{got} != Ops.{op}{want}"
