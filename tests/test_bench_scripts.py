"""The benchmarks (tools/bench/) on a machine without a GPU: each is a leaf over tools.bench.common, answers --help,
refuses bad names and a missing GPU in one line, and writes its record as JSON; the sweeps' CPU-side logic passes
configs explicitly (the runtime's launch tables in accel/kernels/tuning.py are read-only data no sweep rewrites);
`llama32 bench` says in one line where it runs; the installed package leaves the benchmarks out."""
import ast
import importlib
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
from click.testing import CliRunner  # noqa: E402

from accel.kernels import tuning  # noqa: E402
from accel.kernels.tuning import GemvConfig, QkvConfig  # noqa: E402
from tools.bench import common  # noqa: E402
from tools.bench.sweeps import gemv as gemv_sweep, qgemv as qgemv_sweep, skinny as skinny_sweep  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tools" / "bench"
LIVE = ["agreement", "batch", "cpu", "gpu", "hf_attention", "load", "quant_gpu", "quant_quality", "serve", "startup",
        "tp", "tp_batch", "tp_vision", "train", "vision"]
SWEEPS = ["sweeps.gemv", "sweeps.paged", "sweeps.qgemv", "sweeps.skinny"]
SCRIPTS = ["agreement", "batch", "cpu", "hf_attention", "load", "quant_quality", "serve", "startup", "tp", "tp_batch",
           "tp_vision", "vision", *SWEEPS]  # those with a main()
GPU_ONLY = ["batch", "hf_attention", "serve", "tp", "tp_batch", "tp_vision", "vision", *SWEEPS]


def bench_imports(module: str) -> set[str]:
    """The tools.bench modules a benchmark's source imports (anywhere in the file, lazily too)."""
    tree = ast.parse((BENCH / (module.replace(".", "/") + ".py")).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tools.bench"):
            found |= ({f"{node.module}.{a.name}" for a in node.names} if node.module == "tools.bench"
                      else {node.module})
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("tools.bench")}
    return found


def test_the_benchmarks_are_these_files():
    """A new script is added to LIVE or SWEEPS (and so to these checks) on purpose."""
    on_disk = {str(p.relative_to(BENCH).with_suffix("")).replace("/", ".") for p in BENCH.rglob("*.py")}
    common = {f"common.{m}" for m in ("__init__", "cli", "timing", "runs", "hf")}  # the one helper, a package
    assert on_disk == {"__init__", *common, "sweeps.__init__", *LIVE, *SWEEPS}


@pytest.mark.parametrize("module", LIVE)
def test_live_benchmarks_are_leaves_over_common(module):
    assert bench_imports(module) <= {"tools.bench.common"}, module


@pytest.mark.parametrize("module", SWEEPS)
def test_sweeps_import_only_common_and_the_live_case_they_time(module):
    assert bench_imports(module) <= {"tools.bench.common", "tools.bench.quant_gpu"}, module


def test_model_map_and_gemv_shapes():
    assert common.MODELS == {"1b": "llama-3.2-1b", "3b": "llama-3.2-3b"}
    cfg = common.model_config("1b")
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (2048, 16)
    assert common.decode_gemv_shapes(cfg) == {"qkv": (3072, 2048, "rope"), "o": (2048, 2048, "residual"),
                                              "gate_up": (16384, 2048, "norm"), "down": (2048, 8192, "swiglu"),
                                              "lm_head": (128256, 2048, "norm")}
    assert gemv_sweep.shapes("3b") == {"qkv": (5120, 3072, "norm"), "o": (3072, 3072, "residual"),
                                       "gate_up": (16384, 3072, "norm"), "down": (3072, 8192, "swiglu")}


def test_table_aligns_cells_by_their_spec_and_writes_text_cells_as_they_are():
    lines = common.table([("model", "<6"), ("tok/s", ">8.1f"), ("x", ">6")], [["a", 1.26, "1.50x"], ["bb", "-", "-"]])
    assert lines == ["model    tok/s     x",
                     "a          1.3 1.50x",
                     "bb           -     -"]


def test_record_names_command_device_date_and_versions(tmp_path, monkeypatch):
    import torch
    monkeypatch.setattr(sys, "argv", ["tools/bench/load.py", "--preset", "llama-3.2-1b"])
    rec = common.record("cpu", rows=[1, 2])
    assert set(rec) == {"command", "device", "date", "torch", "triton", "rows"} and rec["rows"] == [1, 2]
    assert rec["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert rec["command"].endswith("--preset llama-3.2-1b") and "CPU" in rec["device"]
    assert len(rec["date"]) == len("2026-11-26 12:00 UTC") and rec["date"].endswith(" UTC")
    assert common.record("cpu", command="llama32 bench --models 1b")["command"] == "llama32 bench --models 1b"
    common.write_record(tmp_path / "r.json", rec)
    assert json.loads((tmp_path / "r.json").read_text()) == rec
    common.write_record(None, rec)  # no path: nothing written, no error


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmarks_answer_help(script, capsys):
    main = importlib.import_module(f"tools.bench.{script}").main
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and f"python3 -m tools.bench.{script}" in out
    assert ("--json-out" in out) == (script not in SWEEPS)


@pytest.mark.parametrize("script", GPU_ONLY)
def test_gpu_benchmarks_refuse_bad_names_and_a_missing_gpu_in_one_line(script, capsys, monkeypatch, tmp_path):
    """Bad model names are argparse errors (exit 2, one line naming the option); without CUDA one error line and
    no file written."""
    main = importlib.import_module(f"tools.bench.{script}").main
    out = [str(tmp_path)] if script in SWEEPS else ["--json-out", str(tmp_path / "r.json")]
    if script in SWEEPS:
        with pytest.raises(SystemExit) as e:
            main([*out, "--models", "1b,8b"])
        assert e.value.code == 2 and "--models 1b,8b: expected names of 1b, 3b" in capsys.readouterr().err
    if script == "sweeps.qgemv":
        with pytest.raises(SystemExit) as e:
            main([*out, "--quant", "int5"])
        assert e.value.code == 2 and "--quant int5:" in capsys.readouterr().err
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        main(out)
    assert e.value.code == 2 and capsys.readouterr().err.strip() == (
        f"error: python3 -m tools.bench.{script} needs a CUDA GPU (torch.cuda.is_available() is False here)")
    assert list(tmp_path.iterdir()) == []


def test_agreement_writes_its_record(tmp_path, capsys):
    """tools.bench.agreement on the tiny vision model, CPU, fp32: the table, and the record with the results."""
    out = tmp_path / "agreement.json"
    from tools.bench import agreement
    agreement.main(["--vision", "--device", "cpu", "--dtype", "fp32", "--weights", "fp32", "--steps", "6",
                    "--prompt-tokens", "8", "--json-out", str(out)])
    rec = json.loads(out.read_text())
    assert rec["command"] and "CPU" in rec["device"] and rec["model"] == "vision-tiny" and rec["steps"] == 6
    assert rec["top1_agreement"] == 1.0  # both fp32: only summation order differs
    assert "vision-tiny" in capsys.readouterr().out


def test_llama32_bench_refuses_without_cuda_and_unknown_models(monkeypatch):
    from tools.cli import main
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    r = CliRunner().invoke(main, ["bench", "--models", "1b"])
    assert r.exit_code == 2 and r.output.strip() == ("error: llama32 bench needs a CUDA GPU "
                                                     "(torch.cuda.is_available() is False here)")
    r = CliRunner().invoke(main, ["bench", "--models", "1b,8b"])
    assert r.exit_code == 2 and r.output.strip() == ("error: --models: unknown model '8b' (expected a list of 1b, 3b, "
                                                     "11b-vision, 90b-vision)")


def test_llama32_bench_tp_refuses_what_it_does_not_measure_in_one_line(monkeypatch):
    from tools.cli import main
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    for args, says in [(["--batch"], "drop --batch"), (["--models", "3b,11b-vision"], "drop --models 11b-vision"),
                       (["--quant", "int8"], "drop --quant")]:
        r = CliRunner().invoke(main, ["bench", "--tp", "2", *args])
        assert r.exit_code == 2 and r.output.strip() == ("error: --tp 2 benchmarks batch-1 decode of the text models "
                                                         f"for now; {says}"), r.output
    r = CliRunner().invoke(main, ["bench", "--tp", "4"])
    assert r.exit_code == 2 and r.output.strip() == "error: --tp 4 needs 4 GPUs; this machine has 2"


def test_llama32_bench_writes_the_common_record(monkeypatch, tmp_path):
    """The table and the JSON record of `llama32 bench` (the measurements replaced: they need a GPU): the command as
    typed, the device, the date and versions, then the rows the measurements returned."""
    from tools.bench import gpu
    from tools.cli import main
    row = {"model": "llama-3.2-1b", "decode_tok_s": 900.0, "roofline_tok_s": 1000.0, "roofline_pct": 90.0,
           "decode_tok_s_torch_ops": 300.0, "prefill_ms": 9.0, "prefill_gpu_ms": 6.0, "prefill_tflop_s": 400.0,
           "peak_gpu_mem_gb": 2.7, "prefill_tokens": 2048}
    calls = []
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(common.cli, "device_name", lambda device="cuda": "Test GPU")  # what common.record reads
    monkeypatch.setattr(common, "copy_bandwidth", lambda device: 3.0)
    monkeypatch.setattr(common, "gemm_tflops", lambda device: 700.0)
    monkeypatch.setattr(gpu, "model_bench", lambda name, cfg, *a, **k: calls.append((name, cfg.hidden_size)) or row)
    out = tmp_path / "bench.json"
    argv = ["bench", "--models", "1b", "--skip-hf", "--skip-attention", "--json-out", str(out)]
    monkeypatch.setattr(sys, "argv", ["/usr/bin/llama32", "--debug", *argv])
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0, r.output
    assert calls == [("llama-3.2-1b", 2048)]
    assert "\nllama32 bench — Test GPU — " in "\n" + r.output and "llama-3.2-1b" in r.output
    rec = json.loads(out.read_text())
    assert rec["command"] == f"llama32 bench --models 1b --skip-hf --skip-attention --json-out {out}"
    assert (rec["device"], rec["copy_tb_s"], rec["gemm_tflop_s"], rec["models"]) == ("Test GPU", 3.0, 700.0, [row])
    assert rec["date"].endswith(" UTC") and rec["torch"]


def test_llama32_bench_without_the_benchmarks_says_to_run_from_a_checkout(monkeypatch):
    """As installed from a wheel (tools.bench excluded): one error line, exit 2."""
    from tools.cli import main
    for name in [m for m in sys.modules if m == "tools.bench" or m.startswith("tools.bench.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tools.bench", None)  # import of tools.bench fails as if it were absent
    r = CliRunner().invoke(main, ["bench"])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1
    assert r.output.startswith("error: llama32 bench runs from a checkout of the repository")


def test_package_leaves_the_benchmarks_out():
    import setuptools
    tomllib = pytest.importorskip("tomllib")
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = setuptools.find_packages(str(ROOT), include=find["include"], exclude=find.get("exclude", ()))
    assert {"tools", "tools.cli", "accel", "refimpl"} <= set(packages)
    assert not [p for p in packages if p.startswith("tools.bench")]


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


def test_skinny_candidates_fit_and_spread_over_the_sms():
    """Every candidate tiles K evenly and fits the pipeline's shared memory; a weight of few row blocks (the 1B o)
    is split along K until nearly every SM has a program; a wide one (the lm_head) is not."""
    for model in ("1b", "3b"):
        for N, K in skinny_sweep.shapes(model).values():
            for M in (8, 64, 256):
                cands = skinny_sweep.candidates(N, K, M, 132)
                assert cands and len(cands) == len(set(cands)) <= 16
                for c in cands:
                    assert K % (c.block_k * c.split_k) == 0 and c.block_m >= min(M, 128)
                    assert c.stages * (c.block_n + c.block_m) * c.block_k * 2 <= skinny_sweep.SMEM
    assert {c.split_k for c in skinny_sweep.candidates(2048, 2048, 64, 132) if c.block_n == 64} == {4, 8}
    assert {c.split_k for c in skinny_sweep.candidates(128256, 2048, 64, 132)} == {1}


def test_skinny_table_source_lists_the_wins_only():
    from accel.kernels.tuning import MatmulConfig
    row = {"model": "1b", "proj": "o", "N": 2048, "K": 2048, "M": 64, "best_config": [64, 128, 64, 4, 4, 4],
           "best_us": 5.0, "cublas_us": 6.0, "matmul_faster": True}
    lost = {**row, "M": 32, "matmul_faster": False}
    table = eval("{\n" + skinny_sweep.table_source([row, lost]) + "\n}", {"MatmulConfig": MatmulConfig})
    assert table == {(2048, 2048, 64): MatmulConfig(64, 128, 64, 4, 4, 4)}


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


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_quant_gemv_table_times_the_steps_mlp_layout(monkeypatch):
    """`llama32 bench --quant`'s per-GEMV table: a quantized gate_up through the norm + gate_up + SwiGLU kernel
    the step runs (QuantTensor.norm_swiglu), down as a plain GEMV of F inputs with the residual."""
    from tools.bench import quant_gpu
    cfg = common.model_config("1b")
    shapes = common.decode_gemv_shapes(cfg)
    seen, fused = [], []
    orig_time, orig_swiglu = quant_gpu.QuantGemvCase.time_us, quant_gpu.QuantTensor.norm_swiglu
    monkeypatch.setattr(quant_gpu.QuantGemvCase, "time_us",
                        lambda self, c: seen.append((self.fusion, self.x.shape[1])) or orig_time(self, c))
    monkeypatch.setattr(quant_gpu.QuantTensor, "norm_swiglu", lambda t, *a: fused.append(t.shape) or orig_swiglu(t, *a))
    us, nbytes = quant_gpu.quant_step_us("gate_up", *shapes["gate_up"], "int4:64", cfg)
    assert us > 0 and seen == [] and fused and set(fused) == {shapes["gate_up"][:2]}
    us, nbytes = quant_gpu.quant_step_us("down", *shapes["down"], "int4:64", cfg)
    assert us > 0 and seen == [("residual", cfg.intermediate_size)]


def test_swiglu_candidates_start_at_the_matmul_row_and_fit():
    """The fused gate_up + SwiGLU's candidates: MATMUL's row for the bucket with half its rows first (where it lists
    one), each pipeline refit to two weight tiles and one activation tile, at most 128 gate rows a program."""
    from accel.kernels.tuning import MATMUL
    for model in ("1b", "3b"):
        N, K = skinny_sweep.shapes(model)["gate_up"]
        for M in (1, 8, 64, 256):
            cands = skinny_sweep.swiglu_candidates(N, K, M, 132)
            assert cands and len(cands) == len(set(cands))
            table = MATMUL.get((N, K, M))
            if table is not None:
                assert cands[0] == table._replace(block_n=table.block_n // 2)
            for c in cands:
                assert K % (c.block_k * c.split_k) == 0 and c.block_n <= 128
                assert c.stages * (2 * c.block_n + c.block_m) * c.block_k * 2 <= skinny_sweep.SMEM
