"""`llama32 diff`: two engines in lockstep on any checkpoint; table, first divergence, dump and plot."""
import types

import numpy as np
import pytest
from click.testing import CliRunner

from refimpl.model import ops
from refimpl.formats.checkpoint import load_checkpoint
from refimpl.generate import RefEngine
from refimpl.model.llama import forward_steps
from refimpl.formats.safetensors_io import SafetensorsFile
from tools.cli import diff as diff_cmd
from tools.cli import main
from tools.debug.diff import diff_engines
from tools.debug.golden_record import DEFAULT_DIR
from tools.debug.lockstep import first_divergence

MODEL = DEFAULT_DIR / "toy-gqa"
PROMPT = "the tides of the sea"


class FaultyEngine(RefEngine):
    """The refimpl with layer 1's mlp.down_proj output scaled by 1.001: a 1e-3 relative error in one op."""

    backend = "faulty"

    def steps(self, ids, positions, cache, last_logits_only=False):
        target = self.params["model.layers.1.mlp.down_proj.weight"]
        faulty = types.SimpleNamespace(**{n: getattr(ops, n) for n in dir(ops) if not n.startswith("_")})
        faulty.linear = lambda x, w: ops.linear(x, w) * np.float32(1.001 if w is target else 1.0)
        return forward_steps(faulty, self.params, self.config, np.asarray(ids), np.asarray(positions), cache,
                             last_logits_only)


def run(*args):
    result = CliRunner().invoke(main, list(map(str, args)))
    return result, result.output


def test_refimpl_vs_refimpl_agrees_with_dump(tmp_path):
    dump = tmp_path / "both.safetensors"
    result, out = run("diff", "--model", MODEL, "--a", "refimpl", "--b", "refimpl", PROMPT, "--steps", 3,
                      "--dump", dump)
    assert result.exit_code == 0, out
    assert "all 192 activations within fp32 tolerance" in out  # 48 names × (prefill + 3 decode steps)
    f = SafetensorsFile(dump)
    n_prompt = len(load_checkpoint(MODEL).tokenizer.encode(PROMPT))
    assert f.tensors["a/prefill/layers.2.attn.q"].shape == (n_prompt, 4, 16)
    assert f.tensors["b/decode2/logits"].shape == (1, 288)
    assert len(f.names()) == 2 * 192
    for name in ("prefill/embed", "decode1/layers.0.attn.out", "decode2/logits"):
        np.testing.assert_array_equal(f.load(f"a/{name}"), f.load(f"b/{name}"))


def test_injected_divergence_is_named_and_plotted(tmp_path, monkeypatch):
    Image = pytest.importorskip("PIL.Image")
    pytest.importorskip("matplotlib")
    real = diff_cmd.engine_for
    monkeypatch.setattr(diff_cmd, "engine_for", lambda ckpt, backend, device=None, dtype=None:
                        FaultyEngine(ckpt) if backend == "accel" else real(ckpt, backend, device, dtype))
    png = tmp_path / "err.png"
    result, out = run("diff", "--model", MODEL, "--b", "accel", PROMPT, "--plot", png)  # b: the faulty engine
    assert result.exit_code == 1, out
    assert "first divergence: prefill/layers.1.mlp.down:" in out
    assert "prefill   layer 0        15      0" in out and "Traceback" not in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    with Image.open(png) as im:
        im.verify()
        assert im.size == (1100, 450)


def test_isolate_names_only_the_faulty_op():
    ckpt = load_checkpoint(MODEL)
    ids = ckpt.tokenizer.encode(PROMPT)
    rows, dtype = diff_engines(RefEngine(ckpt), FaultyEngine(ckpt), ids, 1, isolate=True)
    assert dtype == "fp32"
    assert [r.key for r in rows if not r.cmp.ok] == ["prefill/layers.1.mlp.down", "decode0/layers.1.mlp.down"]
    rows, _ = diff_engines(RefEngine(ckpt), FaultyEngine(ckpt), ids, 1)
    assert first_divergence(rows).key == "prefill/layers.1.mlp.down"
    assert all(r.cmp.ok for r in rows if r.cmp.name.startswith("layers.0."))


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    monkeypatch.setitem(__import__("sys").modules, "matplotlib.figure", None)
    monkeypatch.setitem(__import__("sys").modules, "matplotlib.backends.backend_agg", None)
    result, out = run("diff", "--model", MODEL, "--b", "refimpl", PROMPT, "--plot", tmp_path / "x.png")
    assert result.exit_code == 2 and "--plot needs matplotlib" in out and "Traceback" not in out


def test_bad_arguments(tmp_path):
    result, out = run("diff", "--model", MODEL, "--b", "refimpl", "--dtype", "bf16", PROMPT)
    assert result.exit_code == 2 and "refimpl backend computes in fp32 only" in out
    result, out = run("diff", "--model", tmp_path / "nope", "--b", "refimpl", PROMPT)
    assert result.exit_code == 2 and "no such file or directory" in out
    result, out = run("diff", "--model", MODEL, "--b", "refimpl", "x" * 200, "--steps", 1000)
    assert result.exit_code == 2 and "exceeds the context of 128 positions" in out
