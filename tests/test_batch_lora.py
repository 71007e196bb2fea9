"""LoRA adapters per request in the batch engine (accel/lora_stack.py's stacked adapters through the segmented product
of accel/ops/lora_batch.py), unmerged, several in one batch, against the NumPy reference engine (refimpl) over the
checkpoint with that adapter merged (refimpl.formats.lora.merge_lora): greedy ids exactly equal, fp32 on CPU, with
the torch product and with the Triton kernels under the interpreter. Also: the same prompt under two adapters shares
no cached K/V."""
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from accel.batch import BatchEngine, SamplingParams  # noqa: E402
from refimpl.errors import GenerationError  # noqa: E402
from refimpl.formats.lora import merge_lora  # noqa: E402
from refimpl.formats.params import Checkpoint, random_params  # noqa: E402
from refimpl.generate import RefEngine, Sampling  # noqa: E402
from refimpl.model.config import LlamaConfig  # noqa: E402

CFG = LlamaConfig(vocab_size=151, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=12, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_ids=(2,), max_position_embeddings=128)
N = 6


pytestmark = pytest.mark.usefixtures("torch_one_thread")  # tests/conftest.py


def random_adapter(seed, projections, rank=4, scale=2.0):
    rng = np.random.default_rng(seed)
    shapes = {"q": (CFG.q_size, CFG.hidden_size), "k": (CFG.kv_size, CFG.hidden_size),
              "v": (CFG.kv_size, CFG.hidden_size), "o": (CFG.hidden_size, CFG.q_size),
              "gate": (CFG.intermediate_size, CFG.hidden_size), "up": (CFG.intermediate_size, CFG.hidden_size),
              "down": (CFG.hidden_size, CFG.intermediate_size)}
    out = []
    for layer in range(CFG.num_hidden_layers):
        for p in projections:
            d_out, d_in = shapes[p]
            part = "self_attn" if p in "qkvo" else "mlp"
            out.append((f"model.layers.{layer}.{part}.{p}_proj.weight",
                        (0.3 * rng.standard_normal((rank, d_in))).astype(np.float32),
                        (0.3 * rng.standard_normal((d_out, rank))).astype(np.float32), scale))
    return out


ADAPTERS = {"all": random_adapter(1, ["q", "k", "v", "o", "gate", "up", "down"]),
            "vd": random_adapter(2, ["v", "down"])}


@pytest.fixture(scope="module")
def ckpt():
    return Checkpoint("random", CFG, random_params(CFG, seed=5, std=0.1))


def reference(ckpt, prompt, adapter):
    params = ckpt.params if adapter is None else merge_lora(ckpt.params, CFG, ADAPTERS[adapter])
    return list(RefEngine(Checkpoint("merged", CFG, params)).generate(prompt, Sampling(max_new_tokens=N)))


def engine(ckpt, **kw):
    eng = BatchEngine.from_checkpoint(ckpt, device="cpu", block_size=4, **kw)
    for name, adapter in ADAPTERS.items():
        eng.add_adapter(name, adapter)
    return eng


@pytest.mark.parametrize("overlap", [False, True])  # True: each step launched before the last one is read back
def test_adapters_per_request_in_one_batch_match_the_merged_reference(ckpt, overlap):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, CFG.vocab_size) for _ in range(n)] for n in (4, 19, 9, 30, 13, 7)]
    names = [None, "all", "vd", "all", None, "vd"]
    outs = engine(ckpt, max_num_batched_tokens=24, overlap=overlap).generate(
        prompts, SamplingParams(max_tokens=N, ignore_eos=True), names)
    want = [reference(ckpt, p, a) for p, a in zip(prompts, names)]
    assert [o.token_ids for o in outs] == want
    base = [reference(ckpt, p, None) for p in prompts]
    assert sum(w != b for w, b, a in zip(want, base, names) if a) >= 3  # the adapters change what is generated


def test_triton_segmented_product_under_the_interpreter(ckpt):
    """The engine's Triton kernels (the SGMV shrink/expand among them) on CPU under the interpreter."""
    from accel.ops import INTERPRET
    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, CFG.vocab_size) for _ in range(n)] for n in (5, 11, 8)]
    names = ["vd", None, "all"]
    eng = engine(ckpt, use_triton=True)
    outs = eng.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True), names)
    assert [o.token_ids for o in outs] == [reference(ckpt, p, a)[:3] for p, a in zip(prompts, names)]


def test_a_prefix_is_shared_only_under_the_same_adapter(ckpt):
    prompt = list(range(3, 23))  # 5 full blocks
    params = SamplingParams(max_tokens=N, ignore_eos=True)
    eng = engine(ckpt)
    first = eng.add_request(prompt, params, adapter="all")
    eng.step()
    others = [eng.add_request(prompt, params, adapter=a) for a in ("vd", None, "all")]
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    assert eng.stats()["prefix_cached_tokens"] == 16  # only the second "all" request reuses blocks (4 of 5)
    for rid, a in zip([first] + others, ("all", "vd", None, "all")):
        assert done[rid] == reference(ckpt, prompt, a)


def test_unknown_or_duplicate_adapters_are_refused(ckpt):
    eng = engine(ckpt)
    with pytest.raises(GenerationError, match="no adapter named 'x'"):
        eng.add_request([5, 6], SamplingParams(), adapter="x")
    with pytest.raises(GenerationError, match="already loaded"):
        eng.add_adapter("vd", ADAPTERS["vd"])
    with pytest.raises(GenerationError, match="q/k/v/o/gate/up/down_proj only"):
        eng.add_adapter("emb", [("model.embed_tokens.weight", np.zeros((2, 48), np.float32),
                                 np.zeros((151, 2), np.float32), 1.0)])
