"""Golden files: the refimpl passes its own record, a one-op fault is named exactly, bad records fail clearly,
`golden make` reproduces the checked-in files, and the records agree with HF transformers (the independent oracle).
"""
import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from refimpl.model import ops
from refimpl.formats.checkpoint import load_checkpoint
from refimpl.compare import TOLERANCES, compare
from refimpl.model.config import LlamaConfig
from refimpl.generate import RefEngine
from refimpl.formats.safetensors_io import SafetensorsFile, save_safetensors
from tools.cli import main
from tools.debug.golden import check_golden, hf_check, load_golden, make_golden
from tools.debug.golden_record import ACTIVATIONS, DEFAULT_DIR, MANIFEST, find_golden_dirs
from tools.debug.lockstep import first_divergence
from tools.debug.vision_golden import is_vision_golden
from tools.toy import SPECIAL_TOKENS, TOYS, build_tokenizer, special_id

GQA = DEFAULT_DIR / "toy-gqa"


def run(*args):
    result = CliRunner().invoke(main, list(map(str, args)))
    return result, result.output  # click >= 8.2: stdout and stderr interleaved, as a terminal shows them


# ---------------------------------------------------------------- the checked-in data

def text_golden_dirs():
    """The text toys' records (toy-vision has its own tests in tests/test_vision_cli.py)."""
    return [d for d in find_golden_dirs(DEFAULT_DIR) if not is_vision_golden(d)]


def test_golden_dir_holds_llama32_structure_at_toy_size():
    dirs = text_golden_dirs()
    assert [d.name for d in dirs] == sorted(t.name for t in TOYS)
    total = sum(p.stat().st_size for p in DEFAULT_DIR.rglob("*") if p.is_file())
    assert total < 5 * 2**20, f"golden/ is {total} bytes"  # text toys ~2.7 MB, toy-vision ~2 MB
    ratios, explicit_head_dim = set(), False
    for d in dirs:
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "generation_config.json", MANIFEST, ACTIVATIONS):
            assert (d / f).is_file(), d / f
        cfg = LlamaConfig.from_file(d / "config.json")
        ratios.add(cfg.gqa_group)
        explicit_head_dim |= cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads
        assert cfg.tie_word_embeddings and cfg.rope_scaling is not None
        assert json.loads((d / "tokenizer_config.json").read_text())["chat_template"]
        rec = load_golden(d)
        assert [s.name for s in rec.steps] == ["prefill", "decode0", "decode1"]
        # positions run well past original_max_position_embeddings, where llama3 scaling matters
        assert rec.steps[-1].positions[-1] > 1.5 * cfg.rope_scaling.original_max_position_embeddings
        assert [p for s in rec.steps for p in s.positions] == list(range(rec.steps[-1].positions[-1] + 1))
    assert {2, 4} <= ratios and explicit_head_dim


def test_toy_tokenizer_is_byte_level_bpe_with_llama3_specials():
    tok = load_checkpoint(GQA).tokenizer
    text = "the sea, naïve café 🌊 and\n\ntides"
    ids = tok.encode(text)
    assert ids[0] == special_id("<|begin_of_text|>") and ids.count(ids[0]) == 1  # post-processor adds one BOS
    assert tok.decode(ids) == text  # byte-level: any UTF-8 round-trips
    assert len(ids) < len(text.encode()) + 1  # the merges do merge ("the", " sea" ...)
    assert [tok.tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(282, 288))
    chat = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert chat.count(special_id("<|begin_of_text|>")) == 1  # the template's BOS, not a second one
    assert chat[-2:] == [special_id("<|end_header_id|>"), tok.tok.token_to_id("ĊĊ")]  # "\n\n" is one merge
    assert load_checkpoint(GQA).stop_ids == tuple(special_id(t) for t in SPECIAL_TOKENS[1:2] + SPECIAL_TOKENS[4:])


def test_toy_tokenizer_agrees_with_transformers():
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(GQA)
    ours = load_checkpoint(GQA).tokenizer
    for text in ("Write one line about the sea.", "ü ñ 中文 'll 123456"):
        assert hf(text)["input_ids"] == ours.encode(text)
    assert build_tokenizer().to_str() == ours.tok.to_str()


def test_golden_logits_agree_with_hf_transformers():
    pytest.importorskip("transformers")
    for d in text_golden_dirs():
        rec = load_golden(d)
        acts = {f"{s.name}/logits": rec.get(s.name, "logits") for s in rec.steps}
        check = hf_check(d, rec.steps, acts)  # HF's uncached full-sequence forward vs our cached steps
        # fp32 both sides; summation order moves logits of magnitude ~60 by ~2e-5 (3e-7 relative)
        assert check["max_abs_logits"] < 1e-4 * check["max_abs_ref_logits"], check
        assert rec.manifest["hf_check"]["max_abs_logits"] < 1e-4 * check["max_abs_ref_logits"]


# ---------------------------------------------------------------- checking

def test_refimpl_passes_its_own_golden_check():
    result, out = run("golden", "check", "--backend", "refimpl")
    assert result.exit_code == 0, out
    assert "all 144 activations within fp32 tolerance" in out and "all 99 activations" in out


def layer1_attn_norm_fault(monkeypatch):
    """Wrap refimpl.model.ops.rms_norm so that only layer 1's attn_norm of toy-gqa uses a wrong eps."""
    target = SafetensorsFile(GQA / "model.safetensors").load("model.layers.1.input_layernorm.weight")
    real = ops.rms_norm

    def rms_norm(x, weight, eps):
        hit = weight.shape == target.shape and np.array_equal(weight, target)
        return real(x, weight, 0.1 if hit else eps)

    monkeypatch.setattr(ops, "rms_norm", rms_norm)


def test_perturbed_op_is_named_as_the_first_divergence(monkeypatch):
    layer1_attn_norm_fault(monkeypatch)
    result, out = run("golden", "check", "--golden", GQA)
    assert result.exit_code == 1, out
    assert "first divergence: prefill/layers.1.attn_norm:" in out
    assert "prefill   layer 0        15      0" in out  # nothing before it failed
    assert "Traceback" not in out


def test_isolate_fails_only_the_perturbed_op(monkeypatch):
    layer1_attn_norm_fault(monkeypatch)
    rec = load_golden(GQA)
    rows, dtype = check_golden(rec, RefEngine(load_checkpoint(GQA)), isolate=True)
    assert dtype == "fp32"
    assert [r.key for r in rows if not r.cmp.ok] == [f"{s}/layers.1.attn_norm" for s in ("prefill", "decode0",
                                                                                          "decode1")]
    free, _ = check_golden(rec, RefEngine(load_checkpoint(GQA)))  # without isolation the error propagates
    assert first_divergence(free).key == "prefill/layers.1.attn_norm"
    assert sum(not r.cmp.ok for r in free) > 30


def test_filter_restricts_rows():
    result, out = run("golden", "check", "--golden", GQA, "--filter", "decode0/layers.2.mlp.*", "-v")
    assert result.exit_code == 0, out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith("decode0/")]
    assert rows == [f"decode0/layers.2.mlp.{k}" for k in ("gate", "up", "act", "down")]
    result, out = run("golden", "check", "--golden", GQA, "--filter", "nothing.*")
    assert result.exit_code == 2 and "matches no activation" in out


# ---------------------------------------------------------------- bad records

@pytest.fixture
def copy(tmp_path):
    return shutil.copytree(GQA, tmp_path / "toy-gqa")


def edit_manifest(d, **changes):
    m = json.loads((d / MANIFEST).read_text())
    m.update(changes)
    (d / MANIFEST).write_text(json.dumps(m))


def rewrite_activations(d, change):
    f = SafetensorsFile(d / ACTIVATIONS)
    tensors = {n: np.array(f.load(n)) for n in f.names()}
    change(tensors)
    save_safetensors(d / ACTIVATIONS, tensors)


def drop_last_row(key):
    def change(tensors):
        tensors[key] = tensors[key][:-1]
    return change


@pytest.mark.parametrize("damage, message", [
    (lambda d: edit_manifest(d, version=0), "golden format version 0, but this llama32 reads version 1"),
    (lambda d: edit_manifest(d, format="other-tool"), "not a llama32 golden manifest (format 'other-tool'"),
    (lambda d: rewrite_activations(d, lambda t: t.pop("decode1/layers.2.mlp.up")),
     "missing tensor 'decode1/layers.2.mlp.up'"),
    (lambda d: rewrite_activations(d, drop_last_row("prefill/layers.0.attn.q")),
     "tensor 'prefill/layers.0.attn.q' has shape [50, 4, 16], but config.json and the 51 recorded tokens imply "
     "[51, 4, 16]"),
    (lambda d: (d / "config.json").write_text((d / "config.json").read_text().replace('"rms_norm_eps": 1e-05',
                                                                                     '"rms_norm_eps": 1e-06')),
     "now gives"),
    (lambda d: (d / MANIFEST).unlink(), "no golden.json here"),
], ids=["version", "foreign", "missing-tensor", "shape", "fingerprint", "no-manifest"])
def test_bad_golden_record_gives_one_clear_line(copy, damage, message):
    damage(copy)
    result, out = run("golden", "check", "--golden", copy)
    assert result.exit_code == 2, out
    assert message in out and "llama32 golden make" in out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1


def test_no_golden_dir_is_a_clear_error(tmp_path):
    result, out = run("golden", "check", "--golden", tmp_path)
    assert result.exit_code == 2 and "no golden.json" in out and "llama32 golden make --out" in out


# ---------------------------------------------------------------- regeneration

def assert_same_record(new, old):
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json"):
        assert (new / f).read_bytes() == (old / f).read_bytes(), f
    m_new, m_old = json.loads((new / MANIFEST).read_text()), json.loads((old / MANIFEST).read_text())
    m_new.pop("hf_check"), m_old.pop("hf_check")  # HF's verdict depends on the installed transformers
    assert m_new == m_old
    if (new / ACTIVATIONS).read_bytes() != (old / ACTIVATIONS).read_bytes():
        # Byte-identical on the machine that made them; another CPU's BLAS kernels (OpenBLAS picks them per core
        # type) or NumPy's SIMD reductions move the last bits (128 of 144 tensors, <= 1.6e-5, seen): fp32 tolerance.
        a, b = SafetensorsFile(new / ACTIVATIONS), SafetensorsFile(old / ACTIVATIONS)
        assert a.names() == b.names()
        bad = [n for n in a.names() if not compare(n, a.load(n), b.load(n), TOLERANCES["fp32"]).ok]
        assert not bad, bad


def test_make_reproduces_the_checked_in_files(tmp_path):
    made = make_golden(tmp_path, with_hf=False, log=lambda *a: None)
    assert [d.name for d in made] == [t.name for t in TOYS] + ["toy-vision"]
    made = made[:-1]  # toy-vision: tests/test_vision_cli.py
    for new in made:
        assert json.loads((new / MANIFEST).read_text())["hf_check"] is None  # --no-hf-check
        assert_same_record(new, DEFAULT_DIR / new.name)


def test_make_cli_writes_a_checkable_record(tmp_path):
    result, out = run("golden", "make", "--out", tmp_path, "--no-hf-check")
    assert result.exit_code == 0, out
    assert "51 prefill tokens + 2 decode steps (positions 0..52)" in out
    result, out = run("golden", "check", "--golden", tmp_path)
    assert result.exit_code == 0, out


def test_accel_passes_golden_check():
    torch = pytest.importorskip("torch")
    try:
        import accel.engine  # noqa: F401
    except ImportError as e:
        pytest.skip(f"accel engine not importable: {e}")
    # Without CUDA the kernels run in Triton's interpreter (~6 s per toy): fp32 on the smaller toy only, since
    # the interpreter has no bf16 arithmetic. On a GPU, both toys in both dtypes.
    cuda = torch.cuda.is_available()
    for dtype in ("fp32", "bf16") if cuda else ("fp32",):
        result, out = run("golden", "check", "--backend", "accel", "--dtype", dtype,
                          "--golden", DEFAULT_DIR if cuda else DEFAULT_DIR / "toy-mqa")
        assert result.exit_code == 0, out
        assert f"within {dtype} tolerance" in out

