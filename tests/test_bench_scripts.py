"""The GPU sweeps (tools/bench/) import on any machine, and their CPU-side logic passes configs explicitly: the
runtime's launch tables (accel/kernels/tuning.py) are read-only data that no sweep rewrites."""
import json

import pytest

pytest.importorskip("torch")
from accel.kernels import tuning  # noqa: E402
from accel.kernels.tuning import GemvConfig, QkvConfig  # noqa: E402
from tools.bench import (attn_sweep, decode_variants, gemv_sweep, gpu, prefill_profile, qgemv_sweep,  # noqa: E402, F401
                         quant_prefill)


def test_launch_tables_are_read_only():
    with pytest.raises(TypeError):
        tuning.GEMV[(1, 1)] = GemvConfig("split", 8, 1024, 4)
    with pytest.raises(TypeError):
        tuning.QKV_ROPE[(1, 1)] = QkvConfig(2, 8)


def test_gemv_candidates_include_the_table_row_and_the_rule():
    for (N, K), row in tuning.GEMV.items():
        cands = gemv_sweep.candidates(N, K, 132)
        assert row in cands and len(cands) == len(set(cands))
        assert all(isinstance(c, GemvConfig) for c in cands)


def test_swept_winners_become_a_tuning_not_a_table_edit():
    before = dict(tuning.GEMV)
    rows = [{"N": 2048, "K": 2048, "best_config": ["split", 16, 1024, 4, None, 3]}]
    t = gemv_sweep.swept_tuning(rows)
    assert t.gemv[(2048, 2048)] == GemvConfig("split", 16, 1024, 4, None, 3)
    assert t.gemv[(16384, 2048)] == tuning.GEMV[(16384, 2048)] and t.qkv_rope is tuning.QKV_ROPE
    assert dict(tuning.GEMV) == before


def test_winner_rules_keep_the_table_unless_one_percent_faster():
    (N, K), row = next(iter(tuning.GEMV.items()))
    json_key = json.dumps(list(row))
    key = (N, K)
    other = ["split", 32, 512, 4, None, 3]
    slow = {"N": N, "K": K, "configs": {json_key: 10.0}, "best_config": other, "best_us": 9.95}
    fast = dict(slow, best_us=9.8)
    assert decode_variants.gemv_winner(slow) == {}
    assert decode_variants.gemv_winner(fast) == {key: GemvConfig(*other)}


def test_qgemv_candidates_include_the_table_row_and_the_rule():
    from accel.kernels.qgemv import qgemv_config
    for key, row in tuning.QGEMV.items():
        N, K, bits, group = key[:4]
        rope = key[4:] == ("rope",)
        for focus in (False, True):
            cands = qgemv_sweep.candidates(N, K, bits, group, 132, rope, focus)
            assert cands[0] == qgemv_config(N, K, bits, group, 132, rope, table={}) and row in cands
            assert len(cands) == len(set(cands)) and all(not rope or c.split_k == 1 for c in cands)


def test_qgemv_table_source_is_the_table_with_winners_past_the_margin():
    """qgemv_table.txt: the QGEMV body as tuning.py spells it, a row replaced only where its winner beat the
    config the table gives now by more than 2% (both timed in the same sweep)."""
    from accel.kernels.tuning import QGemvConfig
    src = open(tuning.__file__).read()
    assert qgemv_sweep.table_source({"rows": []}, 132) in src  # the same text: a splice is a pure data change
    (N, K, bits, group), now = next((k, c) for k, c in tuning.QGEMV.items() if len(k) == 4)
    other = [now.block_n * 2, now.block_k, now.warps, now.split_k, now.stages]
    row = {"model": "1b", "gemv": "o", "N": N, "K": K, "bits": bits, "group": group,
           "configs": [{"config": list(now), "us": 10.0}, {"config": other, "us": 9.9}],
           "best": {"config": other, "us": 9.9}}

    def table(r):
        return eval("{" + qgemv_sweep.table_source({"rows": [r]}, 132) + "}", {"QGemvConfig": QGemvConfig})
    assert table(row) == dict(tuning.QGEMV)  # 1% faster: kept
    row["configs"][1]["us"] = row["best"]["us"] = 9.7
    assert table(row) == {**tuning.QGEMV, (N, K, bits, group): QGemvConfig(*other)}


def test_qgemv_probe_persistent_candidates_are_launchable_and_deal_row_blocks_evenly():
    """tools.bench.qgemv_probe's persistent configs: one tile a row (the launcher's check), no repeats, and a
    program count that leaves fewer idle slots in the last round than one program's share."""
    from accel.kernels.qgemv import _launch_checks
    from tools.bench import qgemv_probe
    for N, K, paired in [(16384, 2048, True), (2048, 8192, False), (128256, 3072, False), (3072, 3072, False)]:
        cands = qgemv_probe.persistent_candidates(N, K, 4, 132, paired)
        assert cands and len(cands) == len(set(cands))
        for c in cands:
            _launch_checks(c, 4, 64, False, K)
            blocks = -(-N // c.block_n)  # paired: block_n / 2 rows of each half, the same count
            rounds = -(-blocks // c.programs)
            assert 0 < c.programs <= blocks and c.programs * rounds - blocks < rounds, (N, K, c)


def _reporting_ops(monkeypatch):
    """accel.quant_ops' ops of the decode step, each answering (the mode it would launch with, the MLP layout)."""
    from accel import quant_ops
    from tools.bench import quant_roles
    for name in quant_roles.OPS:
        monkeypatch.setattr(quant_ops, name, lambda *a: (quant_ops._DECODE_PDL.get(),
                                                         quant_ops._SWIGLU_IN_GATE_UP.get()))


def _step_calls(cfg, gate_up_swiglu: bool) -> dict:
    """The accel.quant_ops call each role of a decode step makes (placeholders for tensors; weights by shape)."""
    from types import SimpleNamespace
    D, F, qkv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size + 2 * cfg.kv_size
    w = lambda N, K: SimpleNamespace(shape=(N, K))  # noqa: E731
    return {"qkv": ("quant_qkv_rope", ("x", "nw", w(qkv, D), 1e-5)),
            "o": ("quant_linear_add", ("a", w(D, cfg.q_size), "r")),
            "gate_up": ("quant_norm_swiglu", ("x", "nw", w(2 * F, D), 1e-5)) if gate_up_swiglu
            else ("quant_norm_linear", ("x", "nw", w(2 * F, D), 1e-5)),
            "down": ("quant_linear_add", ("a", w(D, F), "r")) if gate_up_swiglu
            else ("quant_swiglu_linear_add", ("gu", w(D, F), "r")),
            "lm_head": ("quant_norm_linear", ("x", "nw", w(cfg.vocab_size, D), 1e-5))}


@pytest.mark.parametrize("gate_up_swiglu", [True, False])
def test_quant_roles_route_each_kernel_its_own_mode_and_config(monkeypatch, gate_up_swiglu):
    """tools.bench.quant_roles.per_role: each op of the step (o and down told apart by K, gate_up's norm GEMV and
    the lm_head by rows; with the SwiGLU in gate_up's epilogue or in down's prologue) launches with its role's mode
    (a role left out: plain launches), the MLP layout is the one asked for, and the launch table gets the variant's
    int8 rows; outside, the kernels' defaults."""
    from types import SimpleNamespace

    from accel import quant_ops
    from accel.kernels import qgemv
    from accel.kernels.qgemv import PdlMode
    from accel.kernels.tuning import QGemvConfig
    from tools.bench import quant_roles
    _reporting_ops(monkeypatch)
    cfg = SimpleNamespace(q_size=32, kv_size=8, hidden_size=32, intermediate_size=64, vocab_size=100)
    calls = _step_calls(cfg, gate_up_swiglu)
    seen = lambda: {r: getattr(quant_ops, n)(*a) for r, (n, a) in calls.items()}  # noqa: E731
    modes = {"o": PdlMode("wait", 1), "down": PdlMode("late", 0)}
    with quant_roles.per_role(cfg, "1b", modes, {("1b", "down"): (4, 64, 1, 2, 2), ("3b", "o"): (2, 32, 1, 1, 1)},
                              gate_up_swiglu):
        assert seen() == {r: (modes.get(r), gate_up_swiglu) for r in calls}
        assert qgemv.qgemv_config(32, 64, 8, 64, 132) == QGemvConfig(4, 64, 1, 2, 2)  # down's row, this model's
        assert qgemv.qgemv_config(32, 32, 8, 32, 132) == qgemv.qgemv_config(32, 32, 8, 32, 132, table={})
    for only in quant_roles.ROLES:  # the one-role set's shape: the mode on one kernel, plain on the others
        with quant_roles.per_role(cfg, "1b", {only: modes["o"]}, {}, gate_up_swiglu):
            assert seen() == {r: (modes["o"] if r == only else None, gate_up_swiglu) for r in calls}
    assert qgemv.qgemv_config(32, 64, 8, 64, 132) == qgemv.qgemv_config(32, 64, 8, 64, 132, table={})
    assert seen() == {r: ("default", True) for r in calls}


@pytest.mark.parametrize("gate_up_swiglu", [True, False])
def test_quant_roles_reach_every_kernel_of_a_real_quantized_step(monkeypatch, gate_up_swiglu):
    """Inside per_role, a tiny int8 engine's prefill and greedy decode (CPU, torch path): every quantized product
    launches with the mode of the matrix it multiplies by (told by the matrix itself here, not by its shape), and
    the MLP runs in the layout asked for."""
    from accel import quant_ops
    from accel.engine import AccelEngine
    from accel.kernels.qgemv import PdlMode
    from refimpl.formats.params import Checkpoint, random_params
    from refimpl.quant.schemes import QuantSpec
    from test_gguf import tiny_config
    from tools.bench import quant_roles
    cfg = tiny_config(tied=False)
    eng = AccelEngine.from_checkpoint(Checkpoint(None, cfg, random_params(cfg, seed=1, std=0.1)), device="cpu",
                                      dtype="fp32", quant=QuantSpec.parse("int8"), use_triton=False)
    role = {id(eng.weights.lm_head): "lm_head"}
    role.update({id(getattr(lw, r)): r for lw in eng.weights.layers for r in ("qkv", "o", "gate_up", "down")})
    seen = set()

    def spy(name, f):
        def op(*args):
            w = next(a for a in args if id(a) in role)
            seen.add((name, role[id(w)], quant_ops._DECODE_PDL.get(), quant_ops._SWIGLU_IN_GATE_UP.get()))
            return f(*args)
        return op
    for name in quant_roles.OPS:
        monkeypatch.setattr(quant_ops, name, spy(name, getattr(quant_ops, name)))
    modes = {r: PdlMode("wait", i) for i, r in enumerate(quant_roles.ROLES)}
    with quant_roles.per_role(cfg, "1b", modes, {}, gate_up_swiglu):
        sess = eng.session(8)
        eng.decode_greedy(sess, eng.prefill([1, 2, 3], sess), 3, 3)
    assert {r for _, r, _, _ in seen} == set(quant_roles.ROLES)
    assert all(mode == modes[r] and layout == gate_up_swiglu for _, r, mode, layout in seen), seen
    down_op = "quant_linear_add" if gate_up_swiglu else "quant_swiglu_linear_add"
    assert {n for n, r, _, _ in seen if r == "down"} == {down_op}


def test_quant_roles_times_each_variant_inside_its_own_context(monkeypatch):
    """tools.bench.quant_roles.compare: bf16 first, then per format every variant of the set (with reverse, the set
    again backwards), each engine built and timed inside the variant's context — the ops of the step see its modes
    and the MLP layout asked for, the engine gets its decode-attention options — and each row says whether its
    greedy tokens equal the first variant's."""
    from refimpl.model.config import PRESETS
    from tools.bench import quant_roles
    _reporting_ops(monkeypatch)
    from accel import quant_ops
    cfg = PRESETS["llama-3.2-1b"]
    monkeypatch.setattr(quant_roles, "random_weights", lambda *a, **k: "bf16 weights")
    monkeypatch.setattr(quant_roles, "quantize_weights", lambda w, spec: f"{spec.format} weights")
    timed = []

    def rate_within(cfg_, weights, context, tuning=None, warm=False):
        assert cfg_ is cfg and not warm
        with context:
            layout = quant_ops._SWIGLU_IN_GATE_UP.get()
            seen = {r: getattr(quant_ops, n)(*a)[0] for r, (n, a) in _step_calls(cfg, layout).items()}
        timed.append((weights, layout, seen, dict(tuning.decode_attention) if tuning else {}))
        return 100.0 * len(timed), [7, 7, len(timed) % 2]  # tokens: every other run differs from the first
    monkeypatch.setattr(quant_roles, "rate_within", rate_within)
    variants = quant_roles.MODES[:2] + quant_roles.MODES[-1:]
    rows = quant_roles.compare("1b", ["int8", "int4:64"], variants, reverse=True, gate_up_swiglu=False)
    order = [v.name for v in variants + variants[::-1]]
    assert [(r["quant"], r["variant"]) for r in rows] == [("bf16", "plain")] + [
        (q, n) for q in ("int8", "int4:64") for n in order]
    assert timed[0][0] == "bf16 weights" and [t[0] for t in timed[1:]] == ["int8 weights"] * 6 + ["int4 weights"] * 6
    for (weights, layout, seen, attention), row in zip(timed[1:], rows[1:]):
        v = next(v for v in variants if v.name == row["variant"])
        assert not layout and seen == {r: v.modes.get(r) for r in quant_roles.ROLES} and attention == v.attention
    assert [r["tokens_equal_first"] for r in rows[1:7]] == [True, False, True, False, True, False]
    assert rows[2]["x_bf16"] == 3.0 and rows[2]["modes"]["down"] == {"trigger": "wait", "prefetch": 0}


@pytest.mark.parametrize("script, flag", [("quant_swiglu", "--specs"), ("quant_roles", "--specs"),
                                          ("qgemv_probe", "--quant"), ("quant_mlp", "--specs"),
                                          ("attn_o", "--specs")])
def test_quant_decode_benchmarks_answer_help_and_refuse_without_cuda(script, flag, capsys, monkeypatch, tmp_path):
    """--help works without a GPU; bad names are argparse errors (exit 2); no CUDA is one error line, no traceback."""
    import importlib
    main = importlib.import_module(f"tools.bench.{script}").main
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and f"python3 -m tools.bench.{script}" in capsys.readouterr().out
    for bad, message in [("--models=1b,8b", "--models 1b,8b: expected names of 1b, 3b"), (f"{flag}=int5", f"{flag}:")]:
        with pytest.raises(SystemExit) as e:
            main([str(tmp_path), bad])
        assert e.value.code == 2 and message in capsys.readouterr().err
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), "--models=1b", f"{flag}=int8"])
    assert e.value.code == (f"error: python3 -m tools.bench.{script} needs a CUDA GPU "
                            "(torch.cuda.is_available() is False here)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_quant_gemv_table_times_the_steps_mlp_layout(monkeypatch):
    """`llama32 bench --quant`'s per-GEMV table: a quantized gate_up through the norm + gate_up + SwiGLU kernel
    the step runs (quant_ops.quant_norm_swiglu), down as a plain GEMV of F inputs with the residual."""
    from refimpl.model.config import PRESETS
    from tools.bench import quant_gpu
    cfg = PRESETS["llama-3.2-1b"]
    shapes = qgemv_sweep.shapes(cfg)
    seen, fused = [], []
    orig_time, orig_swiglu = qgemv_sweep.Case.time_us, quant_gpu.quant_norm_swiglu
    monkeypatch.setattr(qgemv_sweep.Case, "time_us", lambda self, c: seen.append((self.fusion, self.x.shape[1]))
                        or orig_time(self, c))
    monkeypatch.setattr(quant_gpu, "quant_norm_swiglu", lambda *a: fused.append(a[2].shape) or orig_swiglu(*a))
    us, nbytes = quant_gpu.quant_step_us("gate_up", *shapes["gate_up"], "int4:64", cfg)
    assert us > 0 and seen == [] and fused and set(fused) == {shapes["gate_up"][:2]}
    us, nbytes = quant_gpu.quant_step_us("down", *shapes["down"], "int4:64", cfg)
    assert us > 0 and seen == [("residual", cfg.intermediate_size)]


@pytest.mark.parametrize("config", [(4, 128, 1, 1, 2), (4, 128, 1, 2, 1), (8, 256, 1, 1, 1, 2)])
def test_qgemv_probe_stream_reads_each_scale_once(config):
    """The stream probe's xor (codes words, then scales and minima as int16 bits) over a row of 2 tiles, of 2
    split-K slices of one tile, and of one persistent tile: every group's scale and minimum read once, in place.
    On the GPU where there is one, else in the interpreter."""
    import numpy as np
    import torch

    from accel.kernels.tuning import QGemvConfig
    from accel.quant_ops import quantize
    from refimpl.quant.schemes import QuantSpec
    from tools.bench import qgemv_probe
    cfg = QGemvConfig(*config)
    N, K = 6, 256  # 4 groups of 64 a row; 6 rows: a ragged last row block
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(0))
    t = quantize(w.to(dev), QuantSpec.parse("int4:64"))
    bits16 = lambda x: x.view(torch.int16).cpu().numpy().astype(np.int32)  # noqa: E731  sign-extended, as the kernel
    want_codes = np.bitwise_xor.reduce(t.q.cpu().numpy().view(np.int32), axis=1)  # [N, K/8] words -> [N]
    want = want_codes ^ np.bitwise_xor.reduce(bits16(t.scale) ^ bits16(t.low), axis=1)
    for scales, expect in ((False, want_codes), (True, want)):
        out = torch.zeros(16 * N, dtype=torch.int32, device=dev)
        qgemv_probe.stream_call(t, cfg, scales, out)
        got = np.bitwise_xor.reduce(out.cpu().numpy().reshape(16, N), axis=0)  # the split-K slices' rows
        np.testing.assert_array_equal(got, expect)
