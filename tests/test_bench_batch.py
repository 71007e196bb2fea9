"""The batched-decoding benchmark (tools/bench/batch.py) without a GPU: its arguments, its workload and roofline
arithmetic, its measuring loops on a toy model through accel.batch on CPU, and `llama32 bench --batch`'s clean
refusal. (--help and the one-line refusal of the script itself: tests/test_bench_scripts.py.)"""
import argparse
import sys

import pytest

torch = pytest.importorskip("torch")
from click.testing import CliRunner  # noqa: E402

from tools.bench import batch  # noqa: E402


def test_batch_sizes_argument(capsys):
    assert batch.batch_sizes("1,8, 32") == [1, 8, 32]
    for bad in ("", "0,8", "a,b", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            batch.batch_sizes(bad)
    with pytest.raises(SystemExit) as e:
        batch.main(["--batch-sizes", "8,x"])
    assert e.value.code == 2 and "--batch-sizes 8,x: expected positive integers" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        batch.main(["--decode-steps", "0"])
    assert e.value.code == 2 and "--decode-steps must be >= 1" in capsys.readouterr().err


def test_workload_is_fixed_by_its_seed_and_in_range():
    a, b, c = batch.workload(1000, seed=0), batch.workload(1000, seed=0), batch.workload(1000, seed=1)
    assert a == b and a != c and len(a) == 1000
    prompts = [len(p) for p, _ in a]
    outputs = [n for _, n in a]
    assert min(prompts) >= 32 and max(prompts) <= 1024 and min(outputs) >= 32 and max(outputs) <= 512
    assert 500 < sum(prompts) / 1000 < 560 and 250 < sum(outputs) / 1000 < 295  # uniform: means near 528 and 272
    assert all(0 <= t < 128000 for p, _ in a[:10] for t in p)


def test_roofline_counts_weights_once_and_kv_per_sequence():
    from tools.bench.common import model_config
    cfg = model_config("1b")  # 16 layers, 8 KV heads of 64
    assert batch.kv_bytes(cfg, 512) == 2 * 16 * 8 * 64 * 512 * 2  # 16 MiB of bf16 K and V
    weights = 2_471_000_000
    one = batch.roofline_tok_s(weights, cfg, 1, 512, copy_tb_s=3.0)
    assert one == pytest.approx(3e12 / (weights + 16 * 2**20))
    many = batch.roofline_tok_s(weights, cfg, 64, 512, copy_tb_s=3.0)
    assert many == pytest.approx(64 * 3e12 / (weights + 64 * 16 * 2**20))


@pytest.fixture(scope="module")
def toy_engine():
    pytest.importorskip("accel.batch")
    from accel.batch import BatchEngine
    from refimpl.formats.checkpoint import load_checkpoint
    from tools.toy import TOYS, write_toy_checkpoint
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        ckpt = load_checkpoint(write_toy_checkpoint(TOYS[0], d))
    return BatchEngine.from_checkpoint(ckpt, device="cpu", dtype="fp32", max_num_seqs=8)


def test_measuring_loops_on_a_toy_model(toy_engine, monkeypatch):
    """decode_rate times exactly B tokens a step once every prompt is in; the workload makes every request's full
    count (eos ignored); the engine is left empty for the next measurement."""
    cfg = toy_engine.config
    prompts = batch.decode_prompts(cfg, 5, 12, seed=3)
    assert prompts == batch.decode_prompts(cfg, 5, 12, seed=3) and all(len(p) == 12 for p in prompts)
    r = batch.decode_rate(toy_engine, prompts, steps=4)
    assert r["tokens"] == 5 * 4 and r["tok_s"] > 0
    assert r["replay_ms"] is None and batch.decode_graph(toy_engine, 5) is None  # no CUDA graphs on CPU
    assert not toy_engine.has_unfinished() and toy_engine.stats()["blocks_used"] == 0
    jobs = batch.workload(6, seed=2, vocab=cfg.vocab_size, prompt=(3, 40), output=(2, 20))
    result = batch.workload_run(toy_engine, jobs)
    assert result["output_tokens"] == sum(n for _, n in jobs) and result["output_tok_s"] > 0
    assert not toy_engine.has_unfinished() and toy_engine.blocks.cached  # the prompts' full blocks, reusable
    matched, real = [], toy_engine.blocks.match_prefix
    monkeypatch.setattr(toy_engine.blocks, "match_prefix", lambda seq: matched.append(real(seq)) or matched[-1])
    again = batch.workload_run(toy_engine, jobs)  # timed again (HF's share): computed again, not found cached
    assert again["output_tokens"] == result["output_tokens"] and len(matched) == len(jobs) and sum(matched) == 0


def test_render_table():
    rec = {"device": "Test GPU", "date": "2026-11-26 18:00 UTC", "copy_tb_s": 3.0, "models": [{
        "model": "llama-3.2-1b", "context": 512, "decode_steps": 64, "block_size": 64, "copy_tb_s": 2.99,
        "decode": [{"batch": 64, "decode_tok_s": 20000.0, "roofline_tok_s": 25000.0, "roofline_pct": 80.0,
                    "hf_tok_s": 2000.0, "speedup_vs_hf": 10.0, "replay_tok_s": 22500.0, "replay_roofline_pct": 90.0,
                    "eager_tok_s": 5000.0, "invariant_tok_s": 15000.0, "invariant_cost_pct": 25.0},
                   {"batch": 1, "decode_tok_s": 900.0, "roofline_tok_s": 1100.0, "roofline_pct": 81.8}],
        "workload": {"requests": 1000, "prompt_tokens": 528000, "ours": {"seconds": 20.0, "output_tok_s": 13600.0},
                     "hf_requests": 200, "ours_on_hf_requests": {"seconds": 5.0, "output_tok_s": 11000.0},
                     "hf": {"seconds": 46.0, "output_tok_s": 1180.0}, "speedup_vs_hf": 9.3}}]}
    text = batch.render(rec)
    assert "batched decode — Test GPU — 2026-11-26 18:00 UTC" in text
    assert "llama-3.2-1b: 512-token contexts, 64 decode steps timed, KV blocks of 64" in text
    assert "copy bandwidth before its rows 2.99 TB/s (its roofline's)" in text
    assert ("   64      20000      25000    80.0       2000   10.0      22500    90.0       5000      15000"
            "    25.0") in text
    assert "    1        900       1100    81.8" + "          -      -          -       -" + "          -" * 2 + "       -" in text
    assert "workload: 1000 requests, 528000 prompt tokens; ours 20.0 s, 13600 output tok/s" in text
    assert "its first 200 requests: ours 5.0 s, 11000 output tok/s" in text
    assert "HF on 200 requests: 46.0 s, 1180 output tok/s (ours x9.3)" in text


def test_llama32_bench_batch_refuses_without_cuda_and_calls_the_benchmark(monkeypatch, tmp_path):
    from tools.cli import main
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    r = CliRunner().invoke(main, ["bench", "--batch"])
    assert r.exit_code == 2 and r.output.strip() == ("error: llama32 bench needs a CUDA GPU "
                                                     "(torch.cuda.is_available() is False here)")
    calls = []
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(batch, "run", lambda args, command=None: calls.append((args, command)))
    argv = ["bench", "--batch", "--models", "3b", "--skip-hf", "--json-out", str(tmp_path / "b.json")]
    monkeypatch.setattr(sys, "argv", ["llama32", *argv])
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0, r.output
    (args, command), = calls
    assert args.models == ["3b"] and args.skip_hf and args.batch_sizes == [1, 8, 32, 64, 128, 256]
    assert (args.context, args.requests, str(args.json_out)) == (512, 1000, str(tmp_path / "b.json"))
    assert (args.eager, args.skip_invariant, args.profile_batch, args.device) == (False, False, None, "cuda")
    assert (args.hf_requests, args.hf_cuda_graphs) == (200, "on")
    assert command == f"llama32 bench --batch --models 3b --skip-hf --json-out {tmp_path / 'b.json'}"


def test_llama32_bench_serve_calls_the_serving_benchmark(monkeypatch):
    """`llama32 bench --serve`: tools.bench.serve with its defaults, the 1B shape unless --models names others."""
    from tools.bench import serve
    from tools.cli import main
    calls = []
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(serve, "run", lambda args, command=None: calls.append((args, command)))
    for argv, models in ((["bench", "--serve"], ["1b"]), (["bench", "--serve", "--models", "3b", "--skip-hf"], ["3b"])):
        monkeypatch.setattr(sys, "argv", ["llama32", *argv])
        r = CliRunner().invoke(main, argv)
        assert r.exit_code == 0, r.output
        args, command = calls.pop()
        assert args.models == models and args.skip_hf == ("--skip-hf" in argv) and args.device == "cuda"
        assert (args.requests, args.rates, args.hf_args) == (serve.REQUESTS, serve.rates_arg(serve.RATES), serve.HF_ARGS)
        assert command == "llama32 " + " ".join(argv)


def test_variant_rates_build_their_own_engine(monkeypatch):
    """The invariant (and eager) columns: each row's B decoded again on an engine built with the variant's options."""
    from accel.weights import random_weights
    from tools.toy import TOYS
    cfg = TOYS[0].config
    built, real = [], batch.new_engine
    monkeypatch.setattr(batch, "new_engine", lambda *a, **k: built.append(k) or real(*a, **k))
    args = argparse.Namespace(device="cpu", batch_sizes=[1, 3], context=5, seed=0, decode_steps=2)
    rows = [{"batch": 1}, {"batch": 3}]
    batch.variant_rates(cfg, random_weights(cfg, "cpu", torch.bfloat16, seed=0), args, rows, "invariant_tok_s",
                        batch_invariant=True)
    assert built == [{"batch_invariant": True}] and all(r["invariant_tok_s"] > 0 for r in rows)


def test_block_size_reaches_every_engine(monkeypatch, capsys):
    """--block-size: the KV pool's block size of the run's engines (the variants' too); below 1 an argparse error."""
    from accel.weights import random_weights
    from tools.toy import TOYS
    with pytest.raises(SystemExit) as e:
        batch.main(["--block-size", "0"])
    assert e.value.code == 2 and "--block-size must be >= 1" in capsys.readouterr().err
    args = batch.arg_parser().parse_args(["--block-size", "8", "--device", "cpu", "--batch-sizes", "2",
                                          "--context", "5", "--decode-steps", "2"])
    cfg = TOYS[0].config
    built, real = [], batch.new_engine
    monkeypatch.setattr(batch, "new_engine", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    rows = [{"batch": 2}]
    batch.variant_rates(cfg, random_weights(cfg, "cpu", torch.bfloat16, seed=0), args, rows, "eager_tok_s")
    assert [e.blocks.block_size for e in built] == [8] and rows[0]["eager_tok_s"] > 0
