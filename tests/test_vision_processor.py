"""Image preprocessing against HF's MllamaImageProcessor (PIL backend, the one without torchvision): pixel values
within 1e-6, aspect_ratio_ids / aspect_ratio_mask / num_tiles equal; image files of every mode; bad files."""
import io

import numpy as np
import pytest
from packaging.version import Version

from refimpl.errors import ConfigError, ImageError
from refimpl.vision.image_io import load_image, open_image, to_rgb
from refimpl.vision.processor import ImageProcessorConfig, optimal_canvas, preprocess, supported_aspect_ratios
from tools.vision_toy import preprocessor_config

Image = pytest.importorskip("PIL.Image")
mllama = pytest.importorskip("transformers.models.mllama.image_processing_pil_mllama")
transformers = pytest.importorskip("transformers")


def hf_processor(settings: dict):
    keep = {k: v for k, v in settings.items() if k not in ("image_processor_type", "processor_class")}
    return mllama.MllamaImageProcessorPil(**keep)


def noise(height, width, seed=0, mode="RGB"):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "CMYK": 4, "LA": 2}.get(mode, 1)
    data = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    if channels == 1:
        return Image.fromarray(data[..., 0], mode="L")
    return Image.frombytes(mode, (width, height), data.tobytes())


def assert_same(ours, hf):
    """ours: ImageBatch for one prompt; hf: BatchFeature for a batch of one prompt."""
    n = len(ours.num_tiles)
    assert hf["pixel_values"].shape == (1, n) + ours.pixel_values.shape[1:]
    np.testing.assert_allclose(ours.pixel_values, hf["pixel_values"][0], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(ours.aspect_ratio_ids, hf["aspect_ratio_ids"][0])
    np.testing.assert_array_equal(ours.aspect_ratio_mask, hf["aspect_ratio_mask"][0])
    assert ours.num_tiles == hf["num_tiles"][0]


SETTINGS = preprocessor_config(tile_size=28)

# (height, width): tiny, exactly one tile, wide and tall, beyond 4 tiles (downscale), slivers, upscale-in-between
SIZES = [(5, 7), (28, 28), (30, 60), (100, 20), (13, 90), (200, 200), (57, 29), (1, 300), (300, 2), (29, 84),
         (56, 56), (40, 41)]


@pytest.mark.parametrize("height,width", SIZES)
def test_single_image_equals_hf(height, width):
    image = noise(height, width, seed=height * 1000 + width)
    assert_same(preprocess([image], ImageProcessorConfig.from_dict(SETTINGS)),
                hf_processor(SETTINGS)(images=[[image]], return_tensors="np"))


def test_tile_counts_cover_one_to_four():
    cfg = ImageProcessorConfig.from_dict(SETTINGS)
    tiles = {preprocess([noise(h, w)], cfg).num_tiles[0] for h, w in SIZES}
    assert tiles == {1, 2, 3, 4}


@pytest.mark.parametrize("max_tiles", [1, 2, 6])
def test_other_tile_budgets_and_filters(max_tiles):
    settings = {**preprocessor_config(tile_size=14, max_image_tiles=max_tiles), "resample": 3,
                "image_mean": 0.25, "image_std": [0.5, 0.25, 2.0]}
    for height, width in [(9, 50), (70, 15), (33, 33)]:
        image = noise(height, width, seed=max_tiles)
        assert_same(preprocess([image], ImageProcessorConfig.from_dict(settings)),
                    hf_processor(settings)(images=[[image]], return_tensors="np"))


def test_rescale_and_normalize_switched_off():
    settings = {**SETTINGS, "do_normalize": False, "do_rescale": False}
    image = noise(20, 45, seed=3)
    assert_same(preprocess([image], ImageProcessorConfig.from_dict(settings)),
                hf_processor(settings)(images=[[image]], return_tensors="np"))


def test_several_images_of_one_prompt():
    images = [noise(30, 60, 1), noise(10, 10, 2), noise(120, 50, 3)]
    ours = preprocess(images, ImageProcessorConfig.from_dict(SETTINGS))
    assert ours.pixel_values.shape == (3, 4, 3, 28, 28)
    assert_same(ours, hf_processor(SETTINGS)(images=[images], return_tensors="np"))


def test_real_tile_size_560():
    settings = preprocessor_config(tile_size=560)
    image = noise(600, 800, seed=5)
    ours = preprocess([image], ImageProcessorConfig.from_dict(settings))
    assert ours.num_tiles == [4] and ours.pixel_values.shape == (1, 4, 3, 560, 560)
    assert_same(ours, hf_processor(settings)(images=[[image]], return_tensors="np"))


def test_canvas_choice_examples():
    assert supported_aspect_ratios(4) == [(1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (3, 1), (4, 1)]
    assert optimal_canvas(300, 400, 4, 560) == (560, 560)  # upscaling to one tile beats any larger canvas
    assert optimal_canvas(600, 800, 4, 560) == (1120, 1120)  # too big for one tile: least downscale
    assert optimal_canvas(100, 1000, 4, 100) == (100, 400)  # wide: one row


# ---- image modes: in memory (HF's convert_to_rgb) and from files (HF's load_image) ----

FILE_FORMATS = {"L": "PNG", "LA": "PNG", "P": "PNG", "P-transparent": "PNG", "RGBA": "PNG", "CMYK": "JPEG",
                "I;16": "PNG", "1": "PNG"}


def mode_images():
    rgba = noise(40, 70, 1, "RGBA")
    palette = noise(33, 50, 2).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    keyed = palette.copy()
    keyed.info["transparency"] = 3
    wide16 = np.random.default_rng(4).integers(0, 65536, (30, 45), dtype=np.uint16)
    return {"L": noise(50, 31, 3, "L"), "LA": noise(25, 60, 5, "LA"), "P": palette, "P-transparent": keyed,
            "RGBA": rgba, "CMYK": noise(61, 20, 6, "CMYK"), "I;16": Image.fromarray(wide16),
            "1": noise(20, 20, 7, "L").convert("1")}


@pytest.mark.parametrize("name", sorted(FILE_FORMATS))
def test_modes_in_memory_equal_hf(name):
    image = mode_images()[name]
    assert_same(preprocess([image], ImageProcessorConfig.from_dict(SETTINGS)),
                hf_processor(SETTINGS)(images=[[image]], return_tensors="np"))


def test_alpha_is_composited_on_white_in_memory():
    clear = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    assert np.asarray(to_rgb(clear)).tolist() == [[[255, 255, 255]] * 4] * 4


@pytest.mark.parametrize("name", sorted(FILE_FORMATS))
def test_modes_from_files_equal_hf(name, tmp_path):
    if name == "P-transparent" and Version(transformers.__version__) < Version("5.18"):
        pytest.skip("transformers < 5.18 ignores the tRNS colour key that load_image's RGB image keeps")
    path = tmp_path / f"image.{FILE_FORMATS[name].lower()}"
    mode_images()[name].save(path, format=FILE_FORMATS[name])
    assert_same(preprocess([load_image(path)], ImageProcessorConfig.from_dict(SETTINGS)),
                hf_processor(SETTINGS)(images=[[str(path)]], return_tensors="np"))


def test_exif_orientation_applied_like_hf(tmp_path):
    path = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # stored landscape, shown rotated 90° clockwise (portrait)
    noise(30, 80, 8).save(path, format="JPEG", exif=exif.tobytes())
    upright = load_image(path)
    assert upright.size == (30, 80)  # (width, height): portrait once the tag is applied
    ours = preprocess([upright], ImageProcessorConfig.from_dict(SETTINGS))
    assert_same(ours, hf_processor(SETTINGS)(images=[[str(path)]], return_tensors="np"))
    stored = preprocess([open_image(path)], ImageProcessorConfig.from_dict(SETTINGS))
    assert stored.aspect_ratio_ids[0] != ours.aspect_ratio_ids[0]  # the tag changed the tiling: it mattered


# ---- bad input: one ImageError naming the file ----

def png_bytes(image):
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_not_an_image(tmp_path):
    path = tmp_path / "notes.png"
    path.write_text("just some text\n")
    with pytest.raises(ImageError, match="notes.png: not an image"):
        load_image(path)


def test_missing_file(tmp_path):
    with pytest.raises(ImageError, match="nothing.png: not found"):
        load_image(tmp_path / "nothing.png")
    with pytest.raises(ImageError, match="not a file"):
        load_image(tmp_path)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated(tmp_path, fmt):
    buf = io.BytesIO()
    noise(64, 64, 9).save(buf, format=fmt)
    path = tmp_path / f"cut.{fmt.lower()}"
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) * 2 // 3])
    with pytest.raises(ImageError, match=f"cut.{fmt.lower()}: damaged or truncated"):
        load_image(path)


def test_decompression_bomb_refused_before_decoding(tmp_path, monkeypatch):
    path = tmp_path / "bomb.png"
    path.write_bytes(png_bytes(Image.new("L", (100, 100))))
    with pytest.raises(ImageError, match="bomb.png: 100x100 pixels is over the limit of 5000"):
        load_image(path, max_pixels=5000)
    # Pillow's own limit: its warning zone (1x..2x) is an error too, and its error zone stays one
    for limit in (6000, 4000):
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
        with pytest.raises(ImageError, match="bomb.png: .*(over the limit|too many pixels)"):
            load_image(path)


def test_mode_without_rgb_conversion():
    with pytest.raises(ImageError, match="mode La cannot be converted"):
        to_rgb(Image.new("La", (3, 3)), "odd.tiff")


def test_non_rgb_with_convert_off():
    cfg = ImageProcessorConfig.from_dict({**SETTINGS, "do_convert_rgb": False})
    with pytest.raises(ImageError, match="image 1 has mode L"):
        preprocess([noise(10, 10, 0, "L")], cfg)


@pytest.mark.parametrize("change,field", [({"do_pad": False}, "do_pad"), ({"do_resize": False}, "do_resize"),
                                          ({"size": {"height": 28, "width": 56}}, "size"),
                                          ({"max_image_tiles": 0}, "max_image_tiles"),
                                          ({"image_std": [0.5, 0.0, 0.5]}, "image_std"),
                                          ({"image_mean": [0.5, 0.5]}, "image_mean"),
                                          ({"rescale_factor": "1/255"}, "rescale_factor")])
def test_bad_preprocessor_config(change, field):
    with pytest.raises(ConfigError, match=f"preprocessor_config.json: {field}"):
        ImageProcessorConfig.from_dict({**SETTINGS, **change})


def test_preprocessing_runs_without_torch():
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    code = ("import sys; from refimpl.vision.image_io import load_image;"
            "from refimpl.vision.processor import ImageProcessorConfig, preprocess;"
            "cfg = ImageProcessorConfig.from_dir('golden/toy-vision');"
            "batch = preprocess([load_image('golden/toy-vision/image.png')], cfg);"
            "print(batch.num_tiles, [m for m in ('torch', 'transformers', 'accel', 'tools') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[3] []", out.stdout + out.stderr
