"""Llama 3.2 Vision in the batch engine (accel.batch) on CPU in fp32 against its oracles: the NumPy oracle's greedy
ids (refimpl.generate_vision.VisionEngine) and each request run alone through the same engine.

Batches mix requests with images (different images, 1 to 4 tiles, two images in one prompt, the image first or
after some text), text-only requests on the vision model and prompts of different lengths, under chunked prefill
and a tiny pool that preempts; every gate is nonzero (tests/_mllama_hf.py), so the image changes the tokens.
"""
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from accel import ops  # noqa: E402
from accel.batch import BatchEngine, SamplingParams  # noqa: E402
from refimpl.errors import GenerationError  # noqa: E402
from refimpl.formats.checkpoint import load_checkpoint  # noqa: E402
from refimpl.formats.params import Checkpoint  # noqa: E402
from refimpl.generate import Sampling  # noqa: E402
from refimpl.generate_vision import VisionEngine  # noqa: E402
from refimpl.model.vision_config import MllamaConfig  # noqa: E402
from refimpl.vision.inputs import ImageInputs  # noqa: E402
from tests._mllama_hf import IMAGE, cross_mask, hf_config, hf_model, image_arrays, ref_params  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
N = 8  # tokens per request

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # tests/conftest.py


def checkpoint(seed=0, **kw) -> Checkpoint:
    cfg = MllamaConfig.from_hf({"model_type": "mllama", **hf_config(**kw)})
    return Checkpoint(None, cfg, ref_params(hf_model(seed, **kw)))


def images_for(cfg, ids, grids, seed):
    if grids is None:
        return None
    pixels, ar_ids, ar_mask = image_arrays(grids, seed, tile=cfg.vision.image_size)
    return ImageInputs.from_arrays(cfg.vision, pixels, ar_ids, ar_mask, cross_mask(ids, [r * c for r, c in grids]))


def requests(cfg):
    """[(prompt ids, image inputs or None)]: lengths 5-37, images of 1-4 tiles, the same tokens beside two
    different images, text-only prompts, a long run of text before the image."""
    rng = np.random.default_rng(7)
    text = lambda n: [int(t) for t in rng.integers(4, 100, n)]  # noqa: E731
    shared = [1, 5, 7, IMAGE, 9, 11, 13, 40, 41, 42]
    specs = [
        (shared, [(1, 1)], 0),
        (shared, [(2, 2)], 1),  # the same tokens, another image with 4 tiles
        ([IMAGE, 1] + text(20), [(1, 2)], 2),  # the image first
        ([1] + text(5), None, 0),  # text only
        ([1, 6, IMAGE] + text(6) + [IMAGE, 3, 5], [(1, 3), (2, 1)], 3),  # two images
        ([1] + text(28) + [IMAGE] + text(7), [(4, 1)], 4),  # 29 text rows before the image
        ([1] + text(33), None, 0),
    ]
    return [(ids, images_for(cfg, ids, grids, seed)) for ids, grids, seed in specs]


def engine(ckpt, **kw) -> BatchEngine:
    kw.setdefault("num_blocks", 128)
    return BatchEngine.from_checkpoint(ckpt, device="cpu", dtype="fp32", block_size=4, **kw)


def greedy(eng, reqs, params=None):
    params = params or SamplingParams(max_tokens=N, ignore_eos=True)
    outs = eng.generate([ids for ids, _ in reqs], params, images=[im for _, im in reqs])
    return [o.token_ids for o in outs]


def oracle(ckpt, reqs):
    ref = VisionEngine(ckpt)
    return [list(ref.generate(ids, Sampling(max_new_tokens=N), images=im)) for ids, im in reqs]


MODELS = {"gqa-cross-1-3": dict(kv_heads=2), "mqa-cross-layer-first": dict(kv_heads=1, cross_layers=(0, 2))}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    ckpt = checkpoint(**MODELS[request.param])
    reqs = requests(ckpt.config)
    return ckpt, reqs, oracle(ckpt, reqs)


def hf_greedy(hf, ids, images):
    """HF MllamaForConditionalGeneration.generate's greedy ids (eos off, as ignore_eos)."""
    kw = {}
    if images is not None:
        kw = dict(pixel_values=torch.from_numpy(images.pixel_values)[None],
                  aspect_ratio_ids=torch.from_numpy(images.aspect_ratio_ids)[None],
                  aspect_ratio_mask=torch.from_numpy(images.aspect_ratio_mask)[None],
                  cross_attention_mask=torch.from_numpy(images.cross_attention_mask)[None])
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=N, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()


def test_batch_equals_hf_generate():
    """HF's own generate as the independent oracle of a mixed batch (the refimpl oracle's agreement with HF's
    logits: tests/test_vision_hf.py)."""
    kw = MODELS["gqa-cross-1-3"]
    hf = hf_model(0, **kw)
    ckpt = Checkpoint(None, MllamaConfig.from_hf({"model_type": "mllama", **hf_config(**kw)}), ref_params(hf))
    reqs = requests(ckpt.config)
    want = [hf_greedy(hf, ids, im) for ids, im in reqs]
    assert greedy(engine(ckpt, max_num_batched_tokens=8), reqs) == want


@pytest.mark.parametrize("budget", [512, 6])  # 6: prefills chunked, image rows in the middle of chunks
def test_mixed_batch_equals_refimpl_and_each_request_alone(model, budget):
    ckpt, reqs, want = model
    eng = engine(ckpt, max_num_batched_tokens=budget)
    assert greedy(eng, reqs) == want
    alone = [greedy(engine(ckpt), [r])[0] for r in reqs]
    assert alone == want
    assert eng.blocks.num_used == 0 and not eng.seqs


def test_the_image_matters(model):
    """Nonzero gates: the same tokens beside another image, or without their image, give other tokens."""
    ckpt, reqs, want = model
    assert want[0] != want[1]  # the same prompt tokens, different images
    text_only = [t for t in reqs[0][0] if t != IMAGE]
    assert greedy(engine(ckpt), [(text_only, None)])[0] != want[0]


def test_same_tokens_other_image_shares_no_prefix(model):
    """A request whose tokens repeat a finished one's but beside another image must not take its cached blocks."""
    ckpt, reqs, want = model
    eng = engine(ckpt)
    assert greedy(eng, [reqs[0]]) == [want[0]]
    assert greedy(eng, [reqs[1]]) == [want[1]]
    assert eng.scheduler.prefix_cached_tokens == 0
    assert greedy(eng, [reqs[0]]) == [want[0]]  # the same tokens and image: shared
    assert eng.scheduler.prefix_cached_tokens > 0


def test_preemption_under_a_tiny_pool_gives_the_same_tokens(model):
    ckpt, reqs, want = model
    eng = engine(ckpt, num_blocks=14, max_num_batched_tokens=16)  # 14 blocks of 4: two or three requests at once
    assert greedy(eng, reqs) == want
    assert eng.scheduler.num_preemptions > 0
    assert eng.blocks.num_used == 0 and not eng.seqs


def test_abort_frees_blocks_and_image_buffers(model):
    ckpt, reqs, want = model
    eng = engine(ckpt)
    ids = [eng.add_request(p, SamplingParams(max_tokens=N, ignore_eos=True), images=im) for p, im in reqs[:3]]
    eng.step()
    seq = eng.seqs[ids[0]]
    assert seq.image_kv is not None and seq.block_table
    eng.abort(ids[0])
    assert seq.image_kv is None and not seq.block_table
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert done[ids[0]].finish_reason == "abort"
    assert [done[r].token_ids for r in ids[1:]] == want[1:3]
    assert eng.blocks.num_used == 0 and not eng.seqs


def run_counting_image_bytes(eng, reqs):
    """-> (each request's tokens, the most bytes the running requests' image buffers held after a step), counted
    from the buffers themselves."""
    ids = [eng.add_request(p, SamplingParams(max_tokens=N, ignore_eos=True), images=im) for p, im in reqs]
    done, most = {}, 0
    while eng.has_unfinished():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
        kvs = [s.image_kv for s in eng.seqs.values() if s.image_kv is not None]
        most = max(most, sum(t.nbytes for kv in kvs for t in (kv.xk_all, kv.xv_all, kv.visible, kv.has_image)))
    return [done[r] for r in ids], most


def test_image_memory_admits_requests_with_images_only_while_theirs_fit(model):
    """The bytes kept for image keys/values (image_memory) hold the largest request's alone: the requests with images
    wait for room (the text ones run beside them) and give the same tokens; what the running ones hold never passes
    the budget, where without it they all run at once; a request whose images alone pass it is refused up front."""
    from accel.batch.vision import image_kv_bytes
    ckpt, reqs, want = model
    sizes = [image_kv_bytes(ckpt.config, im, len(ids), torch.float32) for ids, im in reqs if im is not None]
    tokens, most = run_counting_image_bytes(engine(ckpt), reqs)
    assert tokens == want and most == sum(sizes)
    eng = engine(ckpt, image_memory=max(sizes))
    tokens, most = run_counting_image_bytes(eng, reqs)
    assert tokens == want and most == max(sizes) < sum(sizes)
    assert eng.scheduler.image_bytes == 0 and eng.blocks.num_used == 0
    small = engine(ckpt, image_memory=min(sizes) - 1)
    prompt, images = next(r for r in reqs if r[1] is not None)
    with pytest.raises(GenerationError, match=r"request 'big': its images' cross-attention keys/values need"):
        small.add_request(prompt, images=images, request_id="big")


def test_seeded_sampling_is_the_same_whatever_shares_the_batch(model):
    ckpt, reqs, _ = model
    params = SamplingParams(max_tokens=N, temperature=0.9, top_k=20, seed=5, ignore_eos=True)
    together = greedy(engine(ckpt, max_num_batched_tokens=9), reqs, params)
    assert together == [greedy(engine(ckpt), [r], params)[0] for r in reqs]
    overlapped = engine(ckpt, max_num_batched_tokens=9, num_blocks=14, overlap=True)  # steps launched ahead
    assert greedy(overlapped, reqs, params) == together and overlapped.scheduler.num_preemptions > 0


@pytest.mark.skipif(not ops.triton_available(torch.device("cpu")), reason="needs Triton's interpreter")
def test_triton_kernels_in_a_mixed_batch(model):
    """The kernels (under the interpreter on CPU) over image rows sliced out of the flat step: a decode row takes
    the split cross-attention kernel, a prefill chunk the flash one."""
    ckpt, reqs, want = model
    pick = [0, 3, 4]
    got = greedy(engine(ckpt, max_num_batched_tokens=6, use_triton=True), [reqs[i] for i in pick])
    assert got == [want[i] for i in pick]


def test_bad_images_name_the_request():
    ckpt = checkpoint()
    eng = engine(ckpt)
    ids = [1, 5, IMAGE, 9]
    with pytest.raises(GenerationError, match=r"request 'a'.*1 <\|image\|> token\(s\) but 0 image"):
        eng.add_request(ids, request_id="a")
    two = images_for(ckpt.config, [1, IMAGE, IMAGE], [(1, 1), (1, 1)], 0)
    with pytest.raises(GenerationError, match=r"request 'b'.*1 <\|image\|> token\(s\) but 2 image"):
        eng.add_request(ids, request_id="b", images=two)
    with pytest.raises(GenerationError, match=r"request 'c'.*cross_attention_mask has 3 rows"):
        eng.add_request(ids, request_id="c", images=images_for(ckpt.config, [1, IMAGE, 9], [(1, 1)], 0))
    with pytest.raises(GenerationError, match=r"token id 128 is outside the vocabulary \[0, 128\)"):
        eng.add_request([1, 128])  # past the image token's rows
    with pytest.raises(GenerationError, match="LoRA adapters to text models only"):
        eng.add_adapter("a", [])
    assert not eng.seqs and eng.blocks.num_used == 0


def test_toy_vision_checkpoint_with_its_image():
    """golden/toy-vision: its image (through the processor's path, tools/vision_inputs.py) beside a text-only
    request and another prompt with the image, against refimpl."""
    from tools.vision_inputs import prompt_inputs
    ckpt = load_checkpoint(ROOT / "golden" / "toy-vision")
    image = ROOT / "golden" / "toy-vision" / "image.png"
    inputs = [prompt_inputs(ckpt, "describe this", [image], chat=False),
              prompt_inputs(ckpt, "a longer prompt without any picture in it at all", [], chat=False),
              prompt_inputs(ckpt, "what is in the picture? answer briefly", [image], chat=True)]
    reqs = [(p.ids, p.engine_kwargs["images"]) for p in inputs]
    assert reqs[0][1] is not None and reqs[1][1] is None
    want = oracle(ckpt, reqs)
    assert greedy(engine(ckpt, max_num_batched_tokens=7), reqs) == want
    assert greedy(engine(ckpt), [([t for t in reqs[0][0] if t != ckpt.config.image_token_index], None)])[0] \
        != want[0]  # the image matters
