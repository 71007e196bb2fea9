"""Adapter configs PEFT reads in its own way: which modules it adapts (target_modules as a list or a regex,
layers_to_transform / layers_pattern, exclude_modules), which configs it refuses, and hostile patterns.

Oracle: peft.PeftModel.from_pretrained on the same directory. Each adapter file holds LoRA matrices for every
linear of both layers, and the config is edited afterwards, so a loader that merged every matrix in the file would
disagree with PEFT by far more than the 1e-4 logit budget (checked per case).
"""
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from _badinput import assert_clean_error, generate_args, run_cli
from refimpl.errors import CheckpointError
from refimpl.formats.checkpoint import load_checkpoint
from refimpl.formats.lora import load_lora, merge_lora
from refimpl.formats import lora_targets
from refimpl.formats.lora import module_scale
from refimpl.formats.lora_targets import llama_modules, targeted_modules

from test_lora import hf_base, peft_adapter, refimpl_logits

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = [61, 5, 17, 33, 2, 40, 9]

EDITS = {  # adapter_config.json changes PEFT honours at load time
    "layers_to_transform int": dict(layers_to_transform=1),
    "layers_to_transform list + pattern": dict(layers_to_transform=[0], layers_pattern="layers"),
    "layers_pattern list": dict(layers_to_transform=[1], layers_pattern=["blocks", "layers"]),
    "target_modules regex": dict(target_modules=r"model\.layers\.1\.(self_attn\.(q|v)|mlp\.down)_proj"),
    "target_modules subset": dict(target_modules=["v_proj", "model.layers.0.mlp.up_proj"]),
    "exclude_modules list": dict(exclude_modules=["q_proj", "model.layers.1.mlp.gate_proj"]),
    "exclude_modules regex": dict(exclude_modules=r".*\.0\.self_attn\..*"),
    "all-linear": dict(target_modules="all-linear"),
}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """One base model and one all-linear adapter, copied by each test (building them is the slow part)."""
    root = tmp_path_factory.mktemp("lora_targets")
    peft_adapter(hf_base(root / "base", tied=True), root / "adapter", dict(r=4, lora_alpha=8, target_modules=ALL))
    return root


def edited_adapter(made, tmp_path, changes: dict):
    shutil.copytree(made / "adapter", tmp_path / "adapter")
    (tmp_path / "base").symlink_to(made / "base")
    path = tmp_path / "adapter" / "adapter_config.json"
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))
    return tmp_path / "base", tmp_path / "adapter"


def peft_logits(base_dir, adapter_dir):
    import transformers
    base = transformers.LlamaForCausalLM.from_pretrained(base_dir).eval()
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].numpy()


@pytest.mark.parametrize("case", list(EDITS))
def test_targets_match_peft(made, tmp_path, case):
    base_dir, adapter_dir = edited_adapter(made, tmp_path, EDITS[case])
    want = peft_logits(base_dir, adapter_dir)
    ckpt = load_checkpoint(base_dir, with_tokenizer=False)
    adapter = load_lora(adapter_dir, ckpt.config)
    got = refimpl_logits(merge_lora(ckpt.params, ckpt.config, adapter), ckpt.config, IDS)
    assert np.abs(got - want).max() < 1e-4
    assert 0 < len(adapter) < 14 or case == "all-linear"  # 14 = every linear of both layers


def test_merging_every_matrix_would_differ(made, tmp_path):
    """The oracle can tell: with layers_to_transform=[1], the file's layer-0 matrices must not be merged."""
    base_dir, adapter_dir = edited_adapter(made, tmp_path, dict(layers_to_transform=[1]))
    want = peft_logits(base_dir, adapter_dir)
    ckpt = load_checkpoint(base_dir, with_tokenizer=False)
    d = json.loads((adapter_dir / "adapter_config.json").read_text())
    d.pop("layers_to_transform")
    (adapter_dir / "adapter_config.json").write_text(json.dumps(d))
    all_merged = refimpl_logits(merge_lora(ckpt.params, ckpt.config, load_lora(adapter_dir, ckpt.config)),
                                ckpt.config, IDS)
    assert np.abs(all_merged - want).max() > 1e-2


REFUSED = {  # adapter_config.json changes PEFT refuses (checked against PEFT itself below)
    "no module matches": (dict(target_modules=["qkv_proj"]), "matches no module"),
    "regex matches nothing": (dict(target_modules=r".*\.attn\.c_attn"), "matches no module"),
    "layer out of range": (dict(layers_to_transform=[5]), "matches no module"),
    "regex with layers_to_transform": (dict(target_modules=".*q_proj", layers_to_transform=[0]),
                                       "cannot be used when target_modules is a regex"),
    "layers_pattern alone": (dict(layers_pattern="layers"), "layers_pattern needs layers_to_transform"),
    "norm targeted": (dict(target_modules=["input_layernorm"]), "only the Llama linears"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_where_peft_refuses(made, tmp_path, case):
    changes, message = REFUSED[case]
    base_dir, adapter_dir = edited_adapter(made, tmp_path, changes)
    with pytest.raises(Exception):  # the oracle refuses too (ValueError, or PEFT's own error types)
        peft_logits(base_dir, adapter_dir)
    ckpt = load_checkpoint(base_dir, with_tokenizer=False)
    with pytest.raises(CheckpointError, match=message):
        load_lora(adapter_dir, ckpt.config)


# exponential for Python's re against a Llama module name (each runs for minutes or more there)
EVIL = [r"([a-z_.0-9]+)+X", r"(.*)*X", r"((\w+)\.?)+X", r"(.+)+(.+)+(.+)+X", r"(([a-z_.0-9])+.)+[A-Z]([a-z])+"]


@pytest.mark.parametrize("pattern", EVIL)
def test_backtracking_patterns_finish(pattern):
    """In target_modules and rank_pattern, over a 28-layer model's module names: done in well under the budget."""
    t0 = time.perf_counter()
    try:
        targeted_modules({"target_modules": pattern}, 28, Path("adapter_config.json"))
    except CheckpointError as e:
        assert "matches no module" in str(e) or "took more than" in str(e)
    for i in range(28):
        module_scale({"rank_pattern": {pattern: 8}}, f"model.layers.{i}.mlp.down_proj", Path("adapter_config.json"))
    assert time.perf_counter() - t0 < 10


def test_matching_budget_is_enforced(monkeypatch):
    """With the budget spent, a slow pattern is refused by name instead of running on."""
    monkeypatch.setattr(lora_targets, "MATCH_SECONDS", 0.0)
    with pytest.raises(CheckpointError, match="took more than 0 s to match"):
        targeted_modules({"target_modules": EVIL[-1]}, 28, Path("adapter_config.json"))


def test_patterns_agree_with_re_where_re_finishes():
    """Same matches as PEFT's `re` for ordinary patterns (the bounded engine must not change the answer)."""
    import re
    patterns = [r"q_proj", r".*\.1\..*", r"model\.layers\.\d+\.mlp\.(up|down)_proj", r"(?i)Q_PROJ", r"[^.]+_proj",
                r"model.layers.(0|1).self_attn.[qk]_proj", r"(?:.*\.)?o_proj"]
    names = llama_modules(3)
    for p in patterns:
        want = [n for n in names if re.fullmatch(p, n)]
        if not want:
            continue
        assert targeted_modules({"target_modules": p}, 3, Path("a.json")) == want, p


def test_cli_reports_no_match_as_one_line(made, tmp_path):
    base_dir, adapter_dir = edited_adapter(made, tmp_path, dict(target_modules=["nothing_here"]))
    assert_clean_error(run_cli(generate_args(base_dir, "--lora", adapter_dir)), "matches no module")


def test_module_list_is_hf_s():
    """llama_modules() is the name list PEFT walks: HF's named_modules() of LlamaForCausalLM."""
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=3,
                                   num_attention_heads=2, num_key_value_heads=1)
    names = [n for n, _ in transformers.LlamaForCausalLM(cfg).named_modules() if n]
    assert llama_modules(3) == names


# ---- fuzz: our module choice equals PEFT's check_target_module_exists on random configs ----
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

NAMES = st.sampled_from(["q_proj", "v_proj", "down_proj", "mlp", "self_attn", "lm_head", "layers", "0", "norm",
                         "model.layers.1.self_attn.k_proj", "up_proj", "embed_tokens"])
REGEXES = st.sampled_from([r".*q_proj", r"model\.layers\.[01]\.mlp\..*", r".*\.(k|o)_proj", r"lm_head", r".*",
                           r"[^.]+"])  # no backtracking pattern: the oracle (re) would hang on it


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(targets=st.none() | st.lists(NAMES, max_size=4) | REGEXES,
       layers=st.none() | st.integers(-1, 3) | st.lists(st.integers(0, 3), max_size=3),
       pattern=st.none() | st.sampled_from(["layers", ["blocks", "layers"], "h", ""]),
       exclude=st.none() | st.lists(NAMES, max_size=2) | REGEXES)
def test_fuzz_targets_agree_with_peft(targets, layers, pattern, exclude):
    from types import SimpleNamespace
    from peft.tuners.tuners_utils import check_target_module_exists
    d = {"target_modules": targets, "layers_to_transform": layers, "layers_pattern": pattern,
         "exclude_modules": exclude}
    t0 = time.perf_counter()
    try:
        ours = targeted_modules(d, 2, Path("adapter_config.json"))
    except CheckpointError as e:
        ours = None
        assert len(str(e)) <= 300
    assert time.perf_counter() - t0 < 5
    if isinstance(targets, str) and (layers is not None or pattern is not None) or (pattern and layers is None):
        assert ours is None  # LoraConfig.__post_init__ raises for these
        return
    peft_cfg = SimpleNamespace(target_modules=["q_proj", "v_proj"] if targets is None else targets,
                               layers_to_transform=layers, layers_pattern=pattern, exclude_modules=exclude,
                               target_parameters=None, modules_to_save=None)
    theirs = [k for k in llama_modules(2)
              if check_target_module_exists(peft_cfg, k) and type(check_target_module_exists(peft_cfg, k)).__name__
              != "_ExcludedModule"]
    if ours is None:
        assert not theirs or any(k.split(".")[-1] not in lora_targets.LLAMA_LINEARS for k in theirs) or not theirs
    else:
        assert ours == theirs
