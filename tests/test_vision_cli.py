"""`llama32 generate --image` and the vision golden record: HF's processor and model as the oracle on the checked-in
toy (golden/toy-vision), and every kind of bad input as one `error:` line with exit 2."""
import json
import shutil
import struct
import zlib

import numpy as np
import pytest

from refimpl.compare import TOLERANCES, compare
from refimpl.formats.safetensors_io import SafetensorsFile
from tests._badinput import assert_clean_error, run_cli
from tools.debug.golden_record import DEFAULT_DIR, MANIFEST
from tools.debug.vision_golden import load_vision_golden, make_vision_golden

TOY = DEFAULT_DIR / "toy-vision"
IMAGE = TOY / "image.png"
BOS, IMG = 282, 288


def generate(*args, prompt="Look at this picture: <|image|> and tell me about the sea in it.", tokens=6):
    result = run_cli(["generate", prompt, "--model", TOY, "--backend", "refimpl", "--max-new-tokens", tokens,
                      "--json", *args])
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def hf():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.disable_progress_bar()
    model = transformers.MllamaForConditionalGeneration.from_pretrained(TOY, dtype=torch.float32).eval()
    # the PIL image backend, which refimpl reproduces (torchvision's fast backend resizes a few pixels differently)
    return transformers.AutoProcessor.from_pretrained(TOY, use_fast=False), model, torch


def hf_greedy(hf, inputs, n):
    processor, model, torch = hf
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_generate_with_image_equals_hf(hf):
    prompt = "Look at this picture: <|image|> and tell me about the sea in it."
    record = generate("--image", IMAGE, prompt=prompt, tokens=12)
    inputs = hf[0](text=prompt, images=[[str(IMAGE)]], return_tensors="pt")
    assert record["prompt_ids"] == inputs["input_ids"][0].tolist()
    assert record["generated_ids"] == hf_greedy(hf, inputs, 12)
    assert record["images"] == [{"path": str(IMAGE), "num_tiles": 3, "aspect_ratio_id": 3}]


def test_image_changes_the_answer(tmp_path):
    flipped = tmp_path / "flipped.png"
    from PIL import Image, ImageOps
    ImageOps.invert(Image.open(IMAGE).convert("RGB")).save(flipped)
    a = generate("--image", IMAGE, tokens=4)
    b = generate("--image", flipped, tokens=4)
    assert a["prompt_ids"] == b["prompt_ids"] and a["generated_ids"] != b["generated_ids"]


def test_chat_puts_the_image_in_the_user_turn(hf):
    record = generate("--image", IMAGE, "--chat", prompt="What is this?", tokens=6)
    messages = [{"role": "user", "content": [{"type": "image", "path": str(IMAGE)},
                                             {"type": "text", "text": "What is this?"}]}]
    inputs = hf[0].apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                       return_tensors="pt")
    assert record["prompt_ids"] == inputs["input_ids"][0].tolist()
    assert record["prompt_ids"].count(IMG) == 1 and record["prompt_ids"][0] == BOS
    assert record["generated_ids"] == hf_greedy(hf, inputs, 6)


def test_raw_prompt_without_image_token_gets_it_first():
    record = generate("--image", IMAGE, prompt="Tell me about it.", tokens=1)
    assert record["prompt_ids"][:3] == [BOS, IMG, BOS]  # HF: "<|image|><|begin_of_text|>..." plus the tokenizer's BOS


def test_two_images_pair_with_their_tokens(tmp_path, hf):
    from PIL import Image
    tall = tmp_path / "tall.png"
    Image.open(IMAGE).convert("RGB").transpose(Image.Transpose.ROTATE_90).resize((20, 70)).save(tall)
    prompt = "First <|image|> then <|image|> compare."
    record = generate("--image", IMAGE, "--image", tall, prompt=prompt, tokens=5)
    assert [im["num_tiles"] for im in record["images"]] == [3, 3]
    assert [im["aspect_ratio_id"] for im in record["images"]] == [3, 7]  # 1×3 wide, 3×1 tall
    inputs = hf[0](text=prompt, images=[[str(IMAGE), str(tall)]], return_tensors="pt")
    assert record["prompt_ids"] == inputs["input_ids"][0].tolist()
    assert record["generated_ids"] == hf_greedy(hf, inputs, 5)


# ---- bad input ----

def bomb_png(path, width=60000, height=60000):
    """A PNG header claiming 3.6 gigapixels over a few bytes of data."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


def cli_error(*args, prompt="<|image|> hi", model=TOY):
    return run_cli(["generate", prompt, "--model", model, "--backend", "refimpl", "--max-new-tokens", 2, *args])


def test_image_with_text_only_checkpoint():
    assert_clean_error(cli_error("--image", IMAGE, model=DEFAULT_DIR / "toy-gqa"), "--image",
                       "toy-gqa is a text-only checkpoint")


def test_not_an_image(tmp_path):
    path = tmp_path / "config.png"
    shutil.copy(TOY / "config.json", path)
    assert_clean_error(cli_error("--image", path), "config.png: not an image")


def test_truncated_image(tmp_path):
    path = tmp_path / "cut.png"
    path.write_bytes(IMAGE.read_bytes()[:3000])
    assert_clean_error(cli_error("--image", path), "cut.png: damaged or truncated")


def test_decompression_bomb(tmp_path):
    assert_clean_error(cli_error("--image", bomb_png(tmp_path / "bomb.png")), "bomb.png", "pixels")


def test_missing_image(tmp_path):
    assert_clean_error(cli_error("--image", tmp_path / "nope.jpg"), "nope.jpg: not found")


@pytest.mark.parametrize("prompt,n", [("<|image|><|image|> two", 1), ("<|image|> one", 2)])
def test_image_count_mismatch(prompt, n):
    msg = assert_clean_error(cli_error(*["--image", IMAGE] * n, prompt=prompt), f"but {n} image(s)")
    assert f"has {prompt.count('<|image|>')} <|image|> token(s)" in msg


def test_image_token_without_image():
    assert_clean_error(cli_error(prompt="<|image|> where is it?"), "1 <|image|> token(s) but 0 image(s)")


def test_accel_backend_gives_the_refimpl_tokens():
    """The CLI's accel path for vision (CPU, fp32) picks the refimpl's greedy tokens."""
    pytest.importorskip("torch")
    ids = {}
    for backend in ("refimpl", "accel"):
        extra = ["--device", "cpu", "--dtype", "fp32"] if backend == "accel" else []
        result = run_cli(["generate", "a photo of", "--model", TOY, "--image", IMAGE, "--no-chat", "--json",
                          "--max-new-tokens", "6", "--backend", backend, *extra])
        assert result.exit_code == 0, result.output
        ids[backend] = json.loads(result.stdout.strip().splitlines()[-1])["generated_ids"]
    assert ids["accel"] == ids["refimpl"] and len(ids["refimpl"]) > 0


def test_preprocessor_mismatching_the_encoder(tmp_path):
    model = shutil.copytree(TOY, tmp_path / "toy")
    settings = json.loads((model / "preprocessor_config.json").read_text())
    settings["size"] = {"height": 56, "width": 56}
    (model / "preprocessor_config.json").write_text(json.dumps(settings))
    assert_clean_error(cli_error("--image", IMAGE, model=model), "preprocessor_config.json: size is 56",
                       "vision_config.image_size is 28")


# ---- the golden record ----

def test_golden_check_covers_vision():
    result = run_cli(["golden", "check", "--golden", TOY, "--backend", "refimpl"])
    assert result.exit_code == 0, result.output
    assert "inputs    vision          2      0" in result.output and "all 235 activations" in result.output
    rec = load_vision_golden(TOY)
    assert rec.manifest["num_tiles"] == [3] and rec.manifest["hf_check"]["prompt_ids_equal"]
    ids = rec.steps[0].ids
    first_image = ids.index(IMG)
    assert 3 < first_image < len(ids) - 3  # text before and after the image token
    # HF's logits agreed when the record was made (fp32; summation order only)
    assert rec.manifest["hf_check"]["max_abs_logits"] < 1e-4 * rec.manifest["hf_check"]["max_abs_ref_logits"]


def test_golden_check_names_a_changed_pixel(tmp_path):
    model = shutil.copytree(TOY, tmp_path / "toy-vision")
    from PIL import Image
    img = np.array(Image.open(model / "image.png"))
    img[5, 7] = 255 - img[5, 7]
    Image.fromarray(img).save(model / "image.png")
    result = run_cli(["golden", "check", "--golden", model, "--backend", "refimpl"])
    assert result.exit_code == 1 and "first divergence: inputs/pixel_values" in result.output


def test_make_reproduces_the_vision_record(tmp_path):
    new = make_vision_golden(tmp_path, with_hf=False, log=lambda *a: None)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "preprocessor_config.json", "generation_config.json", "image.png"):
        assert (new / f).read_bytes() == (TOY / f).read_bytes(), f
    m_new, m_old = json.loads((new / MANIFEST).read_text()), json.loads((TOY / MANIFEST).read_text())
    assert m_new.pop("hf_check") is None
    m_old.pop("hf_check")
    assert m_new == m_old
    a, b = SafetensorsFile(new / "golden.safetensors"), SafetensorsFile(TOY / "golden.safetensors")
    assert a.names() == b.names()
    # byte-identical in practice; BLAS summation order may move the last bits: then the fp32 tolerance applies
    bad = [n for n in a.names() if not compare(n, a.load(n), b.load(n), TOLERANCES["fp32"]).ok]
    assert not bad, bad


# ---- diff and step ----

def test_diff_with_image_covers_the_encoder():
    result = run_cli(["diff", "Look: <|image|> the sea.", "--model", TOY, "--image", IMAGE, "--a", "refimpl",
                      "--b", "refimpl", "--steps", "1", "--filter", "vision.*", "--filter", "layers.1.xattn*"])
    assert result.exit_code == 0, result.output
    assert "prefill   vision" in result.output and "prefill   layer 1" in result.output


def test_step_breaks_in_the_encoder_and_a_cross_attention_layer():
    prompt = "Look: <|image|> the sea."
    result = run_cli(["step", prompt, "--model", TOY, "--image", IMAGE,
                      "--commands", "b vision.out; c; b layers.3.xattn.out; c; c; top 1; q"])
    assert result.exit_code == 0, result.output
    assert "op 55/119 vision.out [1, 4, 5, 96]" in result.output  # 1 image, 4 tile slots, 5 tokens, 32·3 features
    assert "layers.3.xattn.out [1, 4, 16]" in result.output
    first = generate("--image", IMAGE, prompt=prompt, tokens=1)["generated_ids"][0]
    assert f"  1. {first} " in result.output  # the stepped forward predicts what generate produces


def test_step_image_with_text_only_checkpoint():
    result = run_cli(["step", "hi", "--model", DEFAULT_DIR / "toy-gqa", "--image", IMAGE])
    assert_clean_error(result, "text-only checkpoint")
