"""The batch engine with Llama 3.2 Vision requests on the GPU: bf16 rows of a mixed batch (image and text-only
requests) against each request alone (logits within bf16 tolerance), decode-only text steps in CUDA graphs beside
eager image steps, and fp32 GPU ids against the CPU engine's (which tests/test_batch_vision.py checks against
refimpl and HF). Not yet run on a GPU when written."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from accel.batch import BatchEngine, SamplingParams  # noqa: E402
from tests._batch_runs import nmse, run_recording  # noqa: E402
from tests.test_batch_vision import checkpoint, requests  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt():
    return checkpoint(kv_heads=2)


def run(eng, reqs):
    """-> ([tokens per request], [[logits of each step] per request])."""
    return run_recording(eng, [(p, PARAMS, {"images": im}) for p, im in reqs])


def test_bf16_batch_rows_match_each_request_alone(ckpt):
    reqs = requests(ckpt.config)
    batch_tokens, batch_logits = run(BatchEngine.from_checkpoint(ckpt, dtype="bf16", gpu_memory=1 << 26), reqs)
    worst = 0.0
    for r, toks, logits in zip(reqs, batch_tokens, batch_logits):
        alone_tokens, alone_logits = run(BatchEngine.from_checkpoint(ckpt, dtype="bf16", gpu_memory=1 << 26), [r])
        for step, (a, b) in enumerate(zip(logits, alone_logits[0])):
            worst = max(worst, nmse(a, b))
            if toks[:step] != alone_tokens[0][:step]:
                break  # a bf16 near-tie went the other way: later steps see other tokens
    print(f"worst logits NMSE, vision batch row vs alone (bf16): {worst:.2e}")
    assert worst < 1e-3


def test_text_decode_steps_take_graphs_image_steps_do_not(ckpt):
    reqs = requests(ckpt.config)
    text = [r for r in reqs if r[1] is None]
    eng = BatchEngine.from_checkpoint(ckpt, dtype="bf16", gpu_memory=1 << 26)
    graphed, _ = run(eng, text)
    assert eng.runner.graphs.graphs, "no text decode step ran as a graph"
    eager, _ = run(BatchEngine.from_checkpoint(ckpt, dtype="bf16", gpu_memory=1 << 26, cuda_graphs=False), text)
    assert graphed == eager
    images = BatchEngine.from_checkpoint(ckpt, dtype="bf16", gpu_memory=1 << 26)
    run(images, [r for r in reqs if r[1] is not None])
    assert not images.runner.graphs.graphs  # every step had image rows: eager


def test_fp32_gpu_ids_match_the_cpu_engine(ckpt):
    reqs = requests(ckpt.config)
    gpu, _ = run(BatchEngine.from_checkpoint(ckpt, dtype="fp32", gpu_memory=1 << 26), reqs)
    cpu, _ = run(BatchEngine.from_checkpoint(ckpt, device="cpu"), reqs)
    assert gpu == cpu
