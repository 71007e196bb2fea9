"""`llama32 step`: scripted sessions on a toy checkpoint, checked against a direct refimpl forward and NumPy.

Two-backend behaviour is tested refimpl-vs-refimpl: the second engine is a RefEngine whose rms_norm uses a
1000x eps for layer 1's MLP norm only, so exactly one op (layers.1.mlp_norm) computes something different.
"""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from refimpl.model import ops as ref_ops
from refimpl.formats.checkpoint import load_checkpoint
from refimpl.generate import RefEngine
from refimpl.model.interface import OP_NAMES
from refimpl.model.llama import collect, forward, forward_steps
from refimpl.model.names import activation_names
from refimpl.formats.safetensors_io import SafetensorsFile
from tools.cli import main
from tools.debug.step_values import CommandError, parse_index
from tools.debug.step_script import run_script, split_commands
from tools.debug.stepper import StepSession
from tools.toy import TOYS, write_toy_checkpoint

PROMPT = "the cat sat"
DIVERGENT = "layers.1.mlp_norm"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_toy_checkpoint(TOYS[0], tmp_path_factory.mktemp("step"))  # 3 layers: 48 ops


@pytest.fixture(scope="module")
def ckpt(model_dir):
    return load_checkpoint(model_dir)


class PatchedEngine(RefEngine):
    """refimpl with one wrong op: layer 1's MLP rms_norm uses eps × 1000."""

    backend = "patched"

    def steps(self, ids, positions, cache, last_logits_only=False):
        target = self.params["model.layers.1.post_attention_layernorm.weight"]

        def rms_norm(x, weight, eps):
            return ref_ops.rms_norm(x, weight, eps * 1000 if weight is target else eps)

        ops = SimpleNamespace(**{name: getattr(ref_ops, name) for name in OP_NAMES})
        ops.rms_norm = rms_norm
        return forward_steps(ops, self.params, self.config, np.asarray(ids, np.int64),
                             np.asarray(positions, np.int64), cache, last_logits_only)


def direct(ckpt, ids, position):
    """The stepped token's activations from a plain refimpl forward: prefill, then collect the one token."""
    cfg = ckpt.config
    cache = RefEngine(ckpt).new_cache(position + 1)
    if position:
        forward(ref_ops, ckpt.params, cfg, np.array(ids[:position]), np.arange(position), cache)
    acts, _ = collect(ref_ops, ckpt.params, cfg, np.array(ids[position:position + 1]), np.array([position]), cache)
    return acts


def session(ckpt, commands, engines=None, position=None, **kw):
    lines = []
    ids = ckpt.tokenizer.encode(PROMPT)
    s = StepSession(engines or [RefEngine(ckpt)], ids, len(ids) - 1 if position is None else position,
                ckpt.tokenizer, out=lines.append, **kw)
    run_script(s, split_commands(commands))
    return s, lines


def cli(model_dir, *args, input=None):
    result = CliRunner().invoke(main, ["step", "--model", str(model_dir), PROMPT, *args], input=input)
    return result.exit_code, result.output


def stops(lines):
    return [lines[i + 1].split()[2] for i, line in enumerate(lines) if line.startswith("stopped:")]


# ---- breakpoints, where, list ----
def test_breakpoints_stop_at_matching_names_in_order(model_dir):
    code, out = cli(model_dir, "--commands", "where; b layers.1.attn.k*; b *.mlp.act; c; c; c; c; where; q")
    assert code == 0, out
    lines = out.splitlines()
    assert "before op 1/48 (embed); nothing has run yet" in lines
    assert stops(lines) == ["layers.0.mlp.act", "layers.1.attn.k", "layers.1.attn.k_rot", "layers.1.mlp.act"]
    names = activation_names(3)
    assert f"at op {names.index('layers.1.mlp.act') + 1}/48 (layers.1.mlp.act); next: layers.1.mlp.down" in lines


def test_session_stops_before_the_first_op_and_n_runs_one_op(ckpt):
    s, lines = session(ckpt, "where; n; n 2; list layers.0.attn.*")
    assert s.done == 3 and lines[1] == "before op 1/48 (embed); nothing has run yet"
    assert lines[3] == "op 1/48 embed [1, 64]"
    assert lines[5:7] == ["op 2/48 layers.0.attn_norm [1, 64]", "op 3/48 layers.0.attn.q [1, 4, 16]"]
    listing = lines[8:]
    assert listing[0] == ">    3 layers.0.attn.q" and listing[1] == "     4 layers.0.attn.k" and len(listing) == 7


def test_run_to_end_then_n_is_an_error_and_the_session_goes_on(ckpt):
    s, lines = session(ckpt, "c; n; where")
    assert s.finished and lines[2].startswith("end of the forward (48 ops)")
    assert lines[5].startswith("error: the forward has finished")
    assert lines[-1] == "at op 48/48 (logits); the forward has finished"


# ---- values against NumPy and a direct forward ----
def parse_stats(lines, name, label):
    i = lines.index(next(line for line in lines if line.startswith(f"{name} [{label}] shape")))
    nums = dict(re.findall(r"(\w+) (\S+)", lines[i + 1] + " " + lines[i + 2].split("first")[0]))
    first = [float(x) for x in lines[i + 2].split("first [")[1].rstrip("]").split()]
    return {k: float(v) for k, v in nums.items()}, first


@pytest.mark.parametrize("position", [0, 3, 6])
def test_p_stats_equal_numpy_on_a_direct_forward(ckpt, position):
    _, lines = session(ckpt, "b layers.1.mlp.act; c; p; p embed", position=position)
    ref = direct(ckpt, ckpt.tokenizer.encode(PROMPT), position)
    for name in ("layers.1.mlp.act", "embed"):
        stats, first = parse_stats(lines, name, "refimpl")
        v = ref[name].astype(np.float64)
        want = {"min": v.min(), "max": v.max(), "mean": v.mean(), "std": v.std(), "norm": np.linalg.norm(v),
                "nan": 0, "inf": 0}
        assert stats.keys() == want.keys()
        for k, w in want.items():
            assert stats[k] == pytest.approx(w, rel=1e-6, abs=1e-12), (name, k)
        assert first == pytest.approx(ref[name].reshape(-1)[:8].tolist(), rel=1e-6)


def test_show_slice_and_top_match_the_direct_forward(ckpt):
    ids = ckpt.tokenizer.encode(PROMPT)
    _, lines = session(ckpt, "c; show layers.2.attn.q [0, 1, -3:]; top 3")
    ref = direct(ckpt, ids, len(ids) - 1)
    i = lines.index("layers.2.attn.q[0, 1, -3:] [refimpl] [3]:")
    shown = [float(x) for x in lines[i + 1].strip(" []").split()]
    assert shown == pytest.approx(ref["layers.2.attn.q"][0, 1, -3:].tolist(), abs=1e-5)
    logits = ref["logits"][-1].astype(np.float64)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    j = lines.index("top 3 [refimpl]:")
    for rank, t in enumerate(np.argsort(-p)[:3], 1):
        token, text, prob = re.match(r"  \d+\. (\d+) (.*) p (\S+)$", lines[j + rank]).groups()
        assert int(token) == t and text == repr(ckpt.tokenizer.decode([int(t)]))
        assert float(prob) == pytest.approx(p[t], rel=1e-6)


def test_dump_reloads_with_backend_keys_and_the_right_values(ckpt, tmp_path):
    path = tmp_path / "d.safetensors"
    s, lines = session(ckpt, f"b layers.1.attn.out; c; dump {path}", engines=[RefEngine(ckpt), PatchedEngine(ckpt)])
    f = SafetensorsFile(path)
    names = activation_names(3)[:names_upto("layers.1.attn.out")]
    assert sorted(f.names()) == sorted(f"{side}/{n}" for side in ("refimpl", "patched") for n in names)
    ref = direct(ckpt, ckpt.tokenizer.encode(PROMPT), s.position)
    for n in names:
        np.testing.assert_array_equal(f.load(f"refimpl/{n}"), ref[n])
        np.testing.assert_array_equal(f.load(f"patched/{n}"), s.sides[1].values[n])
    assert lines[-1] == f"dumped {2 * len(names)} tensors to {path}"


def names_upto(name):
    return activation_names(3).index(name) + 1


# ---- two backends: bd in lockstep and inherited mode ----
def test_bd_lockstep_flags_only_the_divergent_op(ckpt):
    s, lines = session(ckpt, "bd 0; c; diff; c", engines=[RefEngine(ckpt), PatchedEngine(ckpt)])
    assert "mode: lockstep" in s.banner()[1]
    assert stops(lines) == [DIVERGENT]
    assert s.finished and any(line.startswith("end of the forward") for line in lines)
    nonzero = [n for n in s.names if s.diffs[n].max_abs > 0]
    assert nonzero == [DIVERGENT]
    # diff reports the worst element and both values there, which really are the stored outputs
    a, b = s.sides[0].values[DIVERGENT], s.sides[1].values[DIVERGENT]
    worst = [int(i) for i in np.unravel_index(np.argmax(np.abs(a.astype(np.float64) - b)), a.shape)]
    d = lines[lines.index(next(x for x in lines if x.startswith(f"{DIVERGENT} [1, 64]: patched vs refimpl"))) + 1]
    assert f"max abs {np.abs(a.astype(np.float64) - b).max():.3e}" in d and f"worst {worst}" in d


def test_bd_inherited_stops_at_the_same_op_and_everything_after_differs(ckpt):
    s, lines = session(ckpt, "bd 0; c; bd off; c", engines=[RefEngine(ckpt), PatchedEngine(ckpt)], lockstep=False)
    assert "mode: inherited" in s.banner()[1]
    assert stops(lines) == [DIVERGENT]
    i = s.names.index(DIVERGENT)
    assert all(s.diffs[n].max_abs == 0 for n in s.names[:i])
    assert all(s.diffs[n].max_abs > 0 for n in s.names[i:])


def test_bd_tolerance_above_the_difference_does_not_stop(ckpt):
    s, _ = session(ckpt, "n 30", engines=[RefEngine(ckpt), PatchedEngine(ckpt)])
    d = s.diffs[DIVERGENT].max_abs
    s2, lines = session(ckpt, f"bd {d * 1.01}; c", engines=[RefEngine(ckpt), PatchedEngine(ckpt)])
    assert stops(lines) == [] and s2.finished


# ---- fault injection ----
def test_inject_nan_shows_in_later_activations(model_dir, tmp_path):
    path = tmp_path / "nan.safetensors"
    code, out = cli(model_dir, "--inject", "layers.0.mlp.act=nan", "--commands",
                    f"b layers.0.mlp.down; c; p; c; dump {path}; q")
    assert code == 0, out
    assert "inject: layers.0.mlp.act = nan in refimpl" in out
    assert "  nan 64  inf 0  first [nan nan nan" in out  # mlp.down [1, 64] all NaN
    f = SafetensorsFile(path)
    assert np.isnan(f.load("refimpl/layers.0.mlp.act")).all()
    for n in ("layers.0.resid_post", "layers.1.attn.q", "logits"):
        assert np.isnan(f.load(f"refimpl/{n}")).any(), n
    assert np.isfinite(f.load("refimpl/layers.0.mlp.up")).all()  # ops before the fault are untouched


def test_inject_zero_in_lockstep_reaches_the_second_backend_too(ckpt):
    s, _ = session(ckpt, "c", engines=[RefEngine(ckpt), RefEngine(ckpt)], inject=("layers.1.mlp.act", "zero"))
    for side in s.sides:  # the second side was fed the zeroed act, so its mlp.down is zero as well
        np.testing.assert_array_equal(side.values["layers.1.mlp.down"], 0)
        np.testing.assert_array_equal(side.values["layers.1.resid_post"], side.values["layers.1.resid_mid"])
    assert [n for n in s.names if s.diffs[n].max_abs > 0] == ["layers.1.mlp.act"]  # the injected op only


# ---- errors ----
def test_command_errors_are_one_line_and_the_session_goes_on(ckpt):
    s, lines = session(ckpt, "frob; b nothing.*; p nope; p layers.2.attn.q; show embed; n; show embed [0,,1]; "
                             "show embed [0, x]; show embed [0, 0, 0]; n 0; bd 1; diff; top; dump; p")
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 13, errors
    assert errors[0] == "error: unknown command 'frob' (h for help)"
    assert "matches no activation name" in errors[1] and "unknown activation 'nope'" in errors[2]
    assert "layers.2.attn.q has not run yet" in errors[3] and "embed has not run yet" in errors[4]
    assert "bad slice" in errors[5] and "bad slice" in errors[6] and "does not fit shape" in errors[7]
    assert s.done == 1 and any(line.startswith("embed [refimpl] shape [1, 64]") for line in lines)


@pytest.mark.parametrize("commands, first", [("top 3", "top 3"), ("b nothing.*; c", "b nothing.*"),
                                             ("frob", "frob"), ("n; p nope; q", "p nope")])
def test_a_script_whose_command_fails_exits_2(model_dir, commands, first):
    """Scripted (--commands or stdin): every command runs and reports as before, then the exit status is 2."""
    for args, stdin in ((["--commands", commands], None), ([], commands.replace("; ", "\n"))):
        code, out = cli(model_dir, *args, input=stdin)
        assert code == 2, out
        assert out.rstrip().endswith(f"scripted command(s) failed, the first: {first!r}") and "Traceback" not in out
    code, out = cli(model_dir, "--commands", "c; top 3; q")
    assert code == 0, out


def test_parse_index_is_safe_and_numpy_like():
    assert parse_index("[0, :8]") == (0, slice(None, 8))
    assert parse_index("[..., -1]") == (Ellipsis, -1)
    assert parse_index("[1:5:2]") == (slice(1, 5, 2),)
    for bad in ("0, 1", "[]", "[__import__('os')]", "[1:2:3:4]", "[::0]", "[1.5]"):
        with pytest.raises(CommandError):
            parse_index(bad)


@pytest.mark.parametrize("args, message", [
    (["--position", "7"], "--position 7: the prompt has 7 tokens"),
    (["--position", "-1"], "--position -1"),
    (["--inherited"], "--inherited compares two backends"),
    (["--inject", "layers.0.attn.q=boom"], "expected NAME=nan, NAME=zero or NAME=noise"),
    (["--inject", "layers.9.attn.q=nan"], "'layers.9.attn.q' is not an activation name"),
])
def test_bad_cli_arguments_are_one_line_errors(model_dir, args, message):
    code, out = cli(model_dir, *args, "--commands", "q")
    assert code == 2 and out.startswith("error: ") and message in out and out.count("\n") == 1, out


def test_commands_from_stdin_when_not_a_terminal(model_dir):
    code, out = cli(model_dir, "--position", "0", input="n\nwhere\nq\nn\n")
    assert code == 0, out
    assert "(llama32) where\nat op 1/48 (embed); next: layers.0.attn_norm\n(llama32) q\n" in out
    assert out.endswith("(llama32) q\n")  # q ends the session: the last n never ran


# ---- accel (CPU fp32) in lockstep with refimpl ----
def accel_engine(ckpt):
    try:
        from accel.engine import AccelEngine
    except ImportError as e:
        pytest.skip(f"accel.engine is not importable yet ({e})")
    return AccelEngine.from_checkpoint(ckpt, device="cpu", dtype="fp32")


def test_accel_cpu_fp32_agrees_with_refimpl_at_every_op(ckpt):
    s, lines = session(ckpt, "bd 1e-4; c; top 1", engines=[RefEngine(ckpt), accel_engine(ckpt)])
    assert stops(lines) == [] and s.finished, lines
    assert s.sides[1].label == "accel"
    assert max(d.max_abs for d in s.diffs.values()) < 1e-4


def test_accel_cli_both_inherited(model_dir, ckpt):
    accel_engine(ckpt)
    code, out = cli(model_dir, "--backend", "both", "--device", "cpu", "--dtype", "fp32", "--inherited",
                    "--commands", "c; diff logits; q")
    assert code == 0, out
    assert "mode: inherited" in out and "logits [1, 288]: accel vs refimpl (each fed its own inputs)" in out
    max_abs = float(re.search(r"max abs (\S+)", out.split("diff logits")[1]).group(1))
    assert max_abs < 1e-3, out
