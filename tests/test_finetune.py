"""`llama32 finetune` against HF transformers + PEFT (the oracle), all built in the test, fp32 on the CPU.

One `--optimizer sgd --max-steps 1` step from a PEFT adapter with nonzero A and B must land every LoRA matrix where
PEFT lands it when HF computes the same loss (labels from HF's own apply_chat_template, sum over label tokens divided
by the step's count via num_items_in_batch) and the test applies p -= lr·grad. Relative error is measured against the
size of the step itself (p_after - p_before), so a trainer that moved nothing, or moved the wrong way, cannot pass.
"""
import json

import numpy as np
import pytest

from _badinput import run_cli
from tools.toy import CHAT_TEMPLATE, VOCAB_SIZE, build_tokenizer, special_id

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.numpy import load_file  # noqa: E402

CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "Answer in one line."},
                  {"role": "user", "content": "where is the cat"}, {"role": "assistant", "content": "on the mat"}]},
    {"query": "the water and the sea", "response": "are wet and cold"},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
                  {"role": "user", "content": "and then?"}, {"role": "assistant", "content": "then the end, it is"}]},
    {"query": "is it red", "response": "no", "system": "Be short."},
]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CI machine's cores are shared; oversubscribed threads are 10x slower here
    yield
    torch.set_num_threads(threads)


def hf_chat_model(path, seed=0, kv_heads=2, layers=2, hidden=32):
    torch.manual_seed(seed)
    eos = [special_id(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=hidden * 3 // 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.1,
        bos_token_id=special_id("<|begin_of_text|>"), eos_token_id=eos, attn_implementation="eager",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))  # HF starts norms at exactly 1: a skipped multiply would hide
        # logits of std ~6 at any width: with std 0.1 the tied lm_head caps every logit near 3 and no adapter fits
        model.model.embed_tokens.weight.normal_(0.0, (32 / hidden) ** 0.5)
    model.save_pretrained(path)
    build_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return model


def init_adapter(base, path, targets, seed=1, **kw):
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                                                      task_type="CAUSAL_LM", **kw))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)  # PEFT starts B at zero, where dL/dA is zero: every gradient must matter
    model.save_pretrained(path)
    return model


def hf_labels(tok, messages):
    """Label ids from HF's own chat-template rendering: the tokens after the prompt with its generation header."""
    prompt = tok.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True)
    full = tok.apply_chat_template(messages, tokenize=True)
    prompt, full = list(getattr(prompt, "input_ids", prompt)), list(getattr(full, "input_ids", full))
    assert full[:len(prompt)] == prompt
    return full, [-100] * len(prompt) + full[len(prompt):]


def as_messages(record):
    if "messages" in record:
        return record["messages"]
    return ([{"role": "system", "content": record["system"]}] if "system" in record else []) + [
        {"role": "user", "content": record["query"]}, {"role": "assistant", "content": record["response"]}]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def lora_tensors(model):
    """PEFT's LoRA parameters under the adapter file's key names."""
    return {n.replace(".default", ""): p.detach().numpy().copy() for n, p in model.named_parameters() if "lora_" in n}


def peft_sgd_step(model, batches, lr) -> float:
    """HF + PEFT's side of one step: each of `batches` (model keyword arguments with labels and num_items_in_batch)
    forward and backward, then p -= lr·grad on every LoRA matrix; returns the summed loss."""
    model.train()
    loss = 0.0
    for kw in batches:
        out = model(**kw)
        out.loss.backward()
        loss += float(out.loss.detach())
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p -= lr * p.grad
    return loss


def finetune_args(base, data, out, *extra):
    return ["finetune", "--model", base, "--data", data, "--out", out, "--device", "cpu", "--dtype", "fp32",
            *map(str, extra)]


def sgd_step_errors(tmp_path, kv_heads, targets, hidden=32, device="cpu", dropout=("--dropout", 0)):
    """Run one SGD step through the CLI and through HF + PEFT; per LoRA matrix: (|got - want|, |step|, |want|)."""
    base = hf_chat_model(tmp_path / "base", kv_heads=kv_heads, hidden=hidden)
    model = init_adapter(base, tmp_path / "init", targets)
    data = write_jsonl(tmp_path / "train.jsonl", CONVERSATIONS)
    lr = 0.5
    # 4 samples = batch 2 × 2 accumulated micro-batches: one step sees all of them, in whatever order
    result = run_cli(finetune_args(tmp_path / "base", data, tmp_path / "out", "--init-adapter", tmp_path / "init",
                                   "--optimizer", "sgd", "--max-steps", "1", "--lr", lr, "--batch-size", 2,
                                   "--grad-accum", 2, *dropout, "--json", "--device", device))
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]

    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "base")
    encoded = [hf_labels(tok, as_messages(r)) for r in CONVERSATIONS]
    n_items = sum(sum(1 for t in labels[1:] if t != -100) for _, labels in encoded)
    before = lora_tensors(model)
    loss = peft_sgd_step(model, [dict(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]),
                                      num_items_in_batch=n_items) for ids, labels in encoded], lr)
    want = lora_tensors(model)
    got = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))

    assert records[0]["step"] == 1 and records[0]["loss"] == pytest.approx(loss, rel=1e-4)
    assert records[-1]["done"] and records[-1]["steps"] == 1
    assert got.keys() == want.keys() and len(got) == 2 * len(targets) * 2
    return {key: (np.linalg.norm(got[key] - want[key]), np.linalg.norm(want[key] - before[key]),
                  np.linalg.norm(want[key])) for key in want}


@pytest.mark.parametrize("kv_heads,targets", [(2, TARGETS), (1, ["q_proj", "v_proj", "down_proj"])])
def test_one_sgd_step_equals_hf_peft(tmp_path, kv_heads, targets):
    for key, (err, step, size) in sgd_step_errors(tmp_path, kv_heads, targets).items():
        assert step > 1e-3 * size, key  # the step really moves this matrix
        assert err <= 1e-4 * size and err <= 1e-3 * step, (key, err, step)


def test_init_adapter_keeps_its_own_lora_dropout(tmp_path):
    """No --dropout: the adapter's lora_dropout (0, as PEFT reads it from adapter_config.json) is what trains, so
    the step is PEFT's; the adapter written records it too."""
    for key, (err, step, size) in sgd_step_errors(tmp_path, 2, ["q_proj", "v_proj", "up_proj"], dropout=()).items():
        assert step > 1e-3 * size, key
        assert err <= 1e-4 * size and err <= 1e-3 * step, (key, err, step)
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["lora_dropout"] == 0


def test_adamw_halves_loss_and_adapter_loads_in_peft_and_generate(tmp_path):
    base = hf_chat_model(tmp_path / "base")
    data = write_jsonl(tmp_path / "train.jsonl", CONVERSATIONS[:3])
    out = tmp_path / "out"
    result = run_cli(finetune_args(tmp_path / "base", data, out, "--max-steps", 30, "--lr", "1e-2",
                                   "--batch-size", 3, "--rank", 8, "--alpha", 16, "--save-every", 10,
                                   "--eval-data", data, "--json"))
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    assert all(set(r) == {"step", "loss", "lr", "tokens", "tokens_per_s"} for r in steps)
    assert steps[-1]["loss"] < 0.5 * steps[0]["loss"], (steps[0]["loss"], steps[-1]["loss"])
    assert (out / "checkpoint-10" / "adapter_model.safetensors").exists()
    assert (out / "checkpoint-20" / "adapter_config.json").exists()

    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM" and cfg["r"] == 8
    assert sorted(cfg["target_modules"]) == sorted(TARGETS)
    loaded = peft.PeftModel.from_pretrained(base, out).eval()
    assert lora_tensors(loaded).keys() == load_file(str(out / "adapter_model.safetensors")).keys()

    # the trained adapter lowers PEFT's own loss on the data as the trainer reported (eval loss, no dropout)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "base")
    total = count = 0.0
    with torch.no_grad():
        for ids, labels in (hf_labels(tok, as_messages(r)) for r in CONVERSATIONS[:3]):
            n = sum(1 for t in labels[1:] if t != -100)
            total += float(loaded(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss) * n
            count += n
    assert records[-1]["eval_loss"] == pytest.approx(total / count, rel=1e-4)

    gen = run_cli(["generate", "where is the cat", "--chat", "--model", tmp_path / "base", "--backend", "refimpl",
                   "--lora", out, "--max-new-tokens", 5, "--json"])
    assert gen.exit_code == 0, gen.output
    ids = json.loads(gen.stdout)["prompt_ids"]
    with torch.no_grad():
        want = [int(loaded(input_ids=torch.tensor([ids])).logits[0, -1].argmax())]
    assert json.loads(gen.stdout)["generated_ids"][0] == want[0]


def test_ctrl_c_saves_the_adapter_as_it_stands(tmp_path):
    from accel.train.loop import TrainSettings
    from accel.train.session import TrainSession, TrainSessionSettings
    hf_chat_model(tmp_path / "base")
    data = write_jsonl(tmp_path / "train.jsonl", CONVERSATIONS)
    session = TrainSession.open(tmp_path / "base", data, None, "cpu", "fp32", print,
                                TrainSessionSettings(rank=4, alpha=8, dropout=0.0, targets=("q_proj", "v_proj")))
    seen = []

    def on_step(record):
        seen.append(record["step"])
        if record["step"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        session.train(TrainSettings(lr=1e-2, max_steps=10), tmp_path / "out", on_step)
    saved = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert seen == [1, 2] and len(saved) == 2 * 2 * 2
    for m in session.model.lora.values():  # the file holds the state after step 2, B moved off its zero start
        b = saved[f"base_model.model.{m.name}.lora_B.weight"]
        assert np.array_equal(b, m.b.detach().numpy()) and np.abs(b).max() > 0
