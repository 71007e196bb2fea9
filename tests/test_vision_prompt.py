"""Prompt ids and cross-attention masks against HF's MllamaProcessor (toy tokenizer with <|image|>, toy images)."""
import numpy as np
import pytest

from refimpl.errors import GenerationError
from refimpl.text.tokenizer import TextTokenizer
from refimpl.vision.processor import ImageProcessorConfig, preprocess
from refimpl.vision.prompt import build_vision_prompt, chat_messages, image_spans
from tools.toy import build_tokenizer
from tools.vision_toy import VISION_CHAT_TEMPLATE, build_vision_tokenizer, preprocessor_config

Image = pytest.importorskip("PIL.Image")
transformers = pytest.importorskip("transformers")

BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"
SETTINGS = preprocessor_config(tile_size=14)
# (height, width) -> 1, 2, 4 and 3 tiles: each image's mask row shows its own tile count
IMAGE_SIZES = [(10, 10), (14, 28), (30, 30), (10, 40)]


@pytest.fixture(scope="module")
def ours():
    return TextTokenizer(build_vision_tokenizer(), VISION_CHAT_TEMPLATE, BOS, EOS, source="toy tokenizer.json")


@pytest.fixture(scope="module")
def hf():
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=build_vision_tokenizer(), bos_token=BOS,
                                               eos_token=EOS)
    images = MllamaImageProcessorPil(**{k: v for k, v in SETTINGS.items() if not k.endswith("_class")
                                        and k != "image_processor_type"})
    return transformers.MllamaProcessor(images, tok, chat_template=VISION_CHAT_TEMPLATE)


def images(n):
    rng = np.random.default_rng(n)
    return [Image.fromarray(rng.integers(0, 256, (*IMAGE_SIZES[i % 4], 3), dtype=np.uint8)) for i in range(n)]


def ours_for(tokenizer, prompt, imgs, chat=False):
    batch = preprocess(imgs, ImageProcessorConfig.from_dict(SETTINGS))
    return build_vision_prompt(tokenizer, prompt, batch.num_tiles, SETTINGS["max_image_tiles"], chat=chat)


def assert_same(mine, theirs):
    assert mine.ids == list(theirs["input_ids"][0])
    np.testing.assert_array_equal(mine.cross_attention_mask, np.asarray(theirs["cross_attention_mask"])[0])


PROMPTS = [
    "<|image|>If I had to write a haiku for this one, it would be:",  # image first: moved before BOS
    "Look at this: <|image|> and describe it.",  # text before the image sees nothing (and HF keeps two BOS)
    "<|image|><|image|>Compare these, then <|image|> this one.",  # consecutive images attend together
    "A<|image|>B<|image|>C",
    "<|begin_of_text|>Already has a BOS <|image|> here",
    "Ends with the image <|image|>",
    "<|image|>",
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_raw_prompt_equals_hf(prompt, ours, hf):
    imgs = images(prompt.count("<|image|>"))
    assert_same(ours_for(ours, prompt, imgs), hf(text=prompt, images=imgs, return_tensors="np"))


def test_prompt_without_image_token_gets_them_first(ours, hf):
    imgs = images(2)
    mine = ours_for(ours, "What differs?", imgs)
    assert_same(mine, hf(text="<|image|><|image|>What differs?", images=imgs, return_tensors="np"))


def test_mask_rules_spelled_out(ours):
    image_id = ours.tok.token_to_id("<|image|>")
    mine = ours_for(ours, "x <|image|><|image|>y <|image|>z", images(3))
    ids, mask = mine.ids, mine.cross_attention_mask
    first = ids.index(image_id)
    assert mask[:first].sum() == 0  # text before the first image sees no image
    assert image_spans(ids, image_id) == [(first, len(ids) - 2), (first + 1, len(ids) - 2),
                                          (len(ids) - 2, len(ids))]
    assert mask.shape == (len(ids), 3, 4) and mask[-1, 2].tolist() == [1, 1, 1, 1]  # image 3 has 4 tiles
    assert mask[first, 0].tolist() == [1, 0, 0, 0] and mask[first, 1].sum() == 0  # image 2 from its own token
    assert mask[first + 1, 1].tolist() == [1, 1, 0, 0] and mask[first + 1, 0].tolist() == [1, 0, 0, 0]


@pytest.mark.parametrize("n_images", [1, 2])
def test_chat_equals_hf(n_images, ours, hf):
    imgs = images(n_images)
    messages = chat_messages("What is in the picture?", n_images, system="Answer briefly.")
    mine = build_vision_prompt(ours, "What is in the picture?", preprocess(
        imgs, ImageProcessorConfig.from_dict(SETTINGS)).num_tiles, 4, chat=True, system="Answer briefly.")
    with_images = [m if isinstance(m["content"], str) else dict(m, content=[dict(p, image=img) for p, img in zip(
        [p for p in m["content"] if p["type"] == "image"], imgs)] + [p for p in m["content"] if p["type"] != "image"])
        for m in messages]
    theirs = hf.apply_chat_template(with_images, add_generation_prompt=True, tokenize=True, return_dict=True,
                                    return_tensors="np")
    assert hf.tokenizer.decode(theirs["input_ids"][0]).count("<|image|>") == n_images
    assert_same(mine, theirs)


def test_chat_prompt_placing_its_own_image(ours, hf):
    imgs = images(1)
    prompt = "Before <|image|> after"
    mine = ours_for(ours, prompt, imgs, chat=True)
    text = hf.apply_chat_template(chat_messages(prompt, 1), add_generation_prompt=True, tokenize=False)
    assert text.count("<|image|>") == 1
    assert_same(mine, hf(text=text, images=imgs, add_special_tokens=False, return_tensors="np"))


@pytest.mark.parametrize("prompt,n_images", [("<|image|><|image|>two", 1), ("<|image|>one", 2),
                                             ("a <|image|> b <|image|> c <|image|>", 2)])
def test_count_mismatch(prompt, n_images, ours, hf):
    imgs = images(n_images)
    with pytest.raises(ValueError):  # HF refuses too
        hf(text=prompt, images=imgs)
    with pytest.raises(GenerationError, match=f"has {prompt.count('<|image|>')} <\\|image\\|> token\\(s\\) but "
                                              f"{n_images} image\\(s\\)"):
        ours_for(ours, prompt, imgs)
    with pytest.raises(GenerationError, match="the chat prompt has"):
        ours_for(ours, prompt, imgs, chat=True)


def test_tokenizer_without_image_token():
    text_only = TextTokenizer(build_tokenizer(), VISION_CHAT_TEMPLATE, BOS, EOS, source="text/tokenizer.json")
    with pytest.raises(GenerationError, match="text/tokenizer.json: the tokenizer has no <\\|image\\|> token"):
        ours_for(text_only, "<|image|>hi", images(1))


def test_chat_template_json_and_fallback(tmp_path, ours):
    """A processor's chat_template.json is read (vision checkpoints ship one); without any template the Llama 3
    fallback gets the images as <|image|> text at the start of the user turn."""
    import json
    build_vision_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    plain = TextTokenizer.from_dir(tmp_path)
    assert plain.chat_template is None
    fallback = ours_for(plain, "Hi", images(1), chat=True)
    bos, img = plain.tok.token_to_id(BOS), plain.tok.token_to_id("<|image|>")
    header_end = plain.tok.token_to_id("<|end_header_id|>")
    assert fallback.ids[0] == bos and fallback.ids.count(bos) == 1
    assert fallback.ids[fallback.ids.index(header_end) + 2] == img  # after "\n\n"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": VISION_CHAT_TEMPLATE}))
    from_json = TextTokenizer.from_dir(tmp_path)
    assert from_json.chat_template == VISION_CHAT_TEMPLATE
    assert ours_for(from_json, "Hi", images(1), chat=True).ids == ours_for(ours, "Hi", images(1), chat=True).ids
