"""The serving benchmark (tools/bench/serve.py) on CPU: `llama32 serve` started as a subprocess on a toy checkpoint
the benchmark writes, its streamed completions timed at two rates; a server that cannot start is reported with the
end of its log and recorded as an error row while the other server's rows stand. (--help and the refusal without
CUDA: tests/test_bench_scripts.py.)"""
import dataclasses
import json
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from tools.bench import serve  # noqa: E402
from tools.toy import TOYS  # noqa: E402

FAILING = [sys.executable, "-c", "import sys; print('cannot load the model: no such thing'); sys.exit(3)"]


def test_workload_and_arguments():
    a = serve.workload(50, vocab=288, seed=0, prompt=(4, 12), output=(2, 6))
    assert a == serve.workload(50, vocab=288, seed=0, prompt=(4, 12), output=(2, 6))
    assert all(len(text.split()) == p and 4 <= p <= 12 and 2 <= o <= 6 for text, p, o in a)
    assert all(0 <= int(w[1:]) < 288 - len(serve.SPECIALS) for text, _, _ in a for w in text.split())
    assert serve.rates_arg("2, 8,inf") == [2.0, 8.0, float("inf")] and serve.length_range("32-1024") == (32, 1024)
    for bad in ("", "0", "x", "-1"):
        with pytest.raises(Exception):
            serve.rates_arg(bad)
    for bad in ("32", "0-5", "9-3", "a-b"):
        with pytest.raises(Exception):
            serve.length_range(bad)


def test_serve_benchmark_on_cpu_and_a_server_that_cannot_start(tmp_path, monkeypatch, capsys):
    commands = serve.server_commands
    monkeypatch.setattr(serve, "server_commands", lambda *a: {**commands(*a), "hf-serve": (FAILING, "m")})
    cfg = dataclasses.replace(TOYS[0].config, max_position_embeddings=256)
    out = tmp_path / "serve.json"
    rec = serve.main(["--device", "cpu", "--requests", "3", "--rates", "20,inf", "--prompt-lengths", "4-12",
                      "--output-lengths", "2-6", "--workdir", str(tmp_path), "--json-out", str(out)],
                     configs={"toy": cfg})
    ours, hf = rec["rows"][:2], rec["rows"][2]
    assert [r["rate"] for r in ours] == [20.0, "inf"] and all(r["server"] == "llama32" for r in ours)
    for r in ours:
        assert r["failed"] == 0 and r["first_error"] is None and r["requests"] == 3
        assert 0 < r["output_tokens"] <= r["max_tokens"]  # eos may end a request early
        assert r["ttft_p50_ms"] > 0 and r["tpot_p99_ms"] >= r["tpot_p50_ms"] > 0 and r["output_tok_s"] > 0
    assert hf["server"] == "hf-serve" and "exited with status 3 before answering /health" in hf["error"]
    err = capsys.readouterr().err
    assert "error: hf-serve" in err and "cannot load the model: no such thing" in err  # the log's tail
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rec["rows"]))
    assert (tmp_path / "llama32.log").read_text().count("llama32 serve: stopped") == 1


def test_against_hf_compares_the_rates_both_servers_ran():
    row = lambda server, rate, tok_s, tpot, failed=0: {  # noqa: E731
        "model": "1b", "server": server, "rate": rate, "output_tok_s": tok_s, "tpot_p99_ms": tpot, "failed": failed,
        "first_error": None, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0, "tpot_p50_ms": tpot / 2}
    rows = [row("llama32", 2.0, 500.0, 4.0), row("llama32", "inf", 9000.0, 20.0), row("llama32", 8.0, 2000.0, 5.0),
            row("hf-serve", 2.0, 250.0, 40.0), row("hf-serve", "inf", 1000.0, 80.0), row("hf-serve", 8.0, 10.0, 9.0, 3),
            {"model": "1b", "server": "hf-serve", "error": "exited with status 1 at rate 8.0"}]
    assert serve.against_hf(rows) == [{"model": "1b", "rate": 2.0, "throughput_x": 2.0, "tpot_p99_ratio": 0.1},
                                      {"model": "1b", "rate": "inf", "throughput_x": 9.0, "tpot_p99_ratio": 0.25}]
    text = serve.render({"device": "GPU", "date": "d", "requests": 3, "rows": rows[:2] + rows[3:5],
                         "against_hf": serve.against_hf(rows)})
    assert "1b rate inf: ours x9.0 HF's output tok/s, TPOT p99 0.25 of HF's" in text
