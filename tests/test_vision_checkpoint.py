"""Llama 3.2 Vision checkpoints: a 90B-shaped header validates from the headers alone, mismatches and bad config
fields fail with one clear line naming the tensor or field."""
import json
import struct

import numpy as np
import pytest

from refimpl.errors import CheckpointError, ConfigError
from refimpl.formats import safetensors_io
from refimpl.formats.checkpoint import load_checkpoint, save_checkpoint
from refimpl.formats.vision_checkpoint import check_vision_dir, expected_vision_shapes
from refimpl.formats.safetensors_io import save_safetensors
from refimpl.model.vision_config import MllamaConfig

CONFIG_90B = {  # meta-llama/Llama-3.2-90B-Vision-Instruct's config.json, the fields that set shapes
    "model_type": "mllama", "image_token_index": 128256,
    "text_config": {"vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 100,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "rope_theta": 500000.0,
                    "cross_attention_layers": list(range(3, 100, 5)),
                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "vision_config": {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
                      "num_global_layers": 8, "attention_heads": 16, "image_size": 560, "patch_size": 14,
                      "max_num_tiles": 4, "vision_output_dim": 7680,
                      "intermediate_layers_indices": [3, 7, 15, 23, 30]},
}


def write_sparse_shards(model_dir, shapes: dict, shards: int = 3):
    """Real safetensors headers (BF16) over data sections that are holes in sparse files: 170+ GB, no disk used."""
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(CONFIG_90B))
    names = list(shapes)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        header, offset = {}, 0
        for name in part:
            size = int(np.prod(shapes[name])) * 2
            header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header).encode()
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        with open(model_dir / file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)
        weight_map.update({name: file for name in part})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.fixture
def no_data_reads(monkeypatch):
    def refuse(self, name):
        raise AssertionError(f"tensor data of {name} was read")
    monkeypatch.setattr(safetensors_io.SafetensorsFile, "load", refuse)


def test_90b_header_validates_without_reading_data(tmp_path, no_data_reads):
    cfg = MllamaConfig.from_hf(CONFIG_90B)
    shapes = expected_vision_shapes(cfg)
    assert shapes["language_model.model.embed_tokens.weight"] == (128264, 8192)
    assert shapes["language_model.model.layers.98.cross_attn.q_norm.weight"] == (128,)
    assert shapes["vision_model.gated_positional_embedding.tile_embedding.weight"] == (9, 4 * 1601 * 1280)
    total = sum(int(np.prod(s)) for s in shapes.values())
    assert 87e9 < total < 90e9
    newer = {newer_name(k): v for k, v in shapes.items()}  # as newer transformers versions write them
    assert "lm_head.weight" in newer and "model.vision_model.class_embedding" in newer
    write_sparse_shards(tmp_path / "ok", newer)
    got, located = check_vision_dir(tmp_path / "ok")
    assert got == cfg and set(located) == set(shapes)


def newer_name(hub: str) -> str:
    if hub == "language_model.lm_head.weight":
        return "lm_head.weight"
    if hub.startswith("language_model.model."):
        return "model.language_model." + hub[len("language_model.model."):]
    return "model." + hub


@pytest.mark.parametrize("fault", ["shape", "missing"])
def test_90b_header_mismatch_is_one_line(tmp_path, no_data_reads, fault):
    shapes = dict(expected_vision_shapes(MllamaConfig.from_hf(CONFIG_90B)))
    victim = "language_model.model.layers.43.cross_attn.k_proj.weight"
    if fault == "shape":
        shapes[victim] = (8192, 1024)
    else:
        del shapes[victim]
    write_sparse_shards(tmp_path / "bad", shapes)
    with pytest.raises(CheckpointError) as e:
        check_vision_dir(tmp_path / "bad")
    msg = str(e.value)
    assert victim in msg and "\n" not in msg
    assert ("[8192, 1024]" in msg and "[1024, 8192]" in msg) if fault == "shape" else "missing" in msg


def tiny_config():
    return {"model_type": "mllama", "image_token_index": 40,
            "text_config": {"vocab_size": 40, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
                            "num_attention_heads": 2, "num_key_value_heads": 1, "cross_attention_layers": [1],
                            "bos_token_id": 1, "eos_token_id": 2},
            "vision_config": {"hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 2,
                              "num_global_layers": 1, "attention_heads": 2, "image_size": 14, "patch_size": 7,
                              "vision_output_dim": 16, "intermediate_layers_indices": [1]}}


def test_load_checkpoint_dispatches_and_names_a_wrong_tensor(tmp_path):
    cfg = MllamaConfig.from_hf(tiny_config())
    rng = np.random.default_rng(0)
    params = {n: rng.standard_normal(s).astype(np.float32) for n, s in expected_vision_shapes(cfg).items()}
    save_checkpoint(tmp_path, cfg, params)
    ckpt = load_checkpoint(tmp_path, with_tokenizer=False)
    assert ckpt.config == cfg and all(np.array_equal(ckpt.params[n], params[n]) for n in params)
    params["multi_modal_projector.bias"] = np.zeros(15, np.float32)
    save_safetensors(tmp_path / "model.safetensors", params)
    with pytest.raises(CheckpointError, match=r"'multi_modal_projector.bias' has shape \[15\], but config.json "
                                              r"implies \[16\]"):
        load_checkpoint(tmp_path, with_tokenizer=False)


@pytest.mark.parametrize("edit,field", [
    (("vision_config", "vision_output_dim", 24), "vision_output_dim"),
    (("text_config", "cross_attention_layers", [2]), "cross_attention_layers"),
    (("vision_config", "intermediate_layers_indices", [5]), "intermediate_layers_indices"),
    (("vision_config", "hidden_act", "relu"), "hidden_act"),
    (("vision_config", "patch_size", 5), "patch_size"),
    ((None, "image_token_index", 48), "image_token_index"),  # past vocab_size 40 + 8 rows (7 is a valid row)
    (("text_config", "num_attention_heads", "two"), "num_attention_heads"),
])
def test_bad_config_fields_are_named(edit, field):
    d = tiny_config()
    section, key, value = edit
    (d[section] if section else d)[key] = value
    with pytest.raises(ConfigError, match=field) as e:
        MllamaConfig.from_hf(d, source="model/config.json")
    assert str(e.value).startswith("model/config.json") and "\n" not in str(e.value)


def test_to_hf_round_trips_and_hf_builds_the_same_shapes():
    """config.json as written by to_hf: read back equal, and HF's MllamaForConditionalGeneration built from it has
    exactly the tensors (names and shapes) the config implies here."""
    torch = pytest.importorskip("torch")
    from transformers import MllamaConfig as HFConfig
    from transformers import MllamaForConditionalGeneration

    from refimpl.formats.vision_checkpoint import hub_name

    cfg = MllamaConfig.from_hf(tiny_config())
    d = cfg.to_hf()
    assert MllamaConfig.from_hf(json.loads(json.dumps(d))) == cfg
    d["text_config"]["pad_token_id"] = None  # HF's default pad id (128004) lies outside this tiny vocabulary
    torch.manual_seed(0)
    model = MllamaForConditionalGeneration(HFConfig(**{k: v for k, v in d.items() if k != "model_type"}))
    hf_shapes = {hub_name(k): tuple(v.shape) for k, v in model.state_dict().items()}
    assert hf_shapes == expected_vision_shapes(cfg)


def test_loading_a_vision_directory_reads_config_json_once(monkeypatch):
    """load_checkpoint tells a Vision directory by its config.json and hands that one read to the Vision loader."""
    from pathlib import Path

    from refimpl.formats import hf_dir, jsonfile
    reads = []
    read = jsonfile.read_json_object

    def counting(path, *args, **kwargs):
        reads.append(Path(path).name)
        return read(path, *args, **kwargs)
    for module in (jsonfile, hf_dir):
        monkeypatch.setattr(module, "read_json_object", counting)
    ckpt = load_checkpoint(Path(__file__).resolve().parent.parent / "golden" / "toy-vision", with_tokenizer=False)
    assert isinstance(ckpt.config, MllamaConfig) and ckpt.params
    assert reads.count("config.json") == 1, reads
