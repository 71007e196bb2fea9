"""HF transformers with attn_implementation="llama32" (accel.hf) against "sdpa" (and "flash_attention_2" where
flash_attn is importable), on the GPU.

    python -m tools.bench.hf_attention [--models 1b,3b,11b-vision] [--json-out F] [--steps 12] [--layers N]
                                       [--kinds train,prefill,image] [--patches none,kernels,kernels+lora]
                                       [--rows sdpa:none,llama32:kernels+lora,llama32:kernels+lora+offload]

Random bf16 weights at the Llama 3.2 1B / 3B / 11B-Vision shapes (common.hf_random_model; nothing downloaded). For
each model, attention implementation and module patch ("none"; "kernels": accel.hf.apply with RMSNorm, SwiGLU
MLP, RoPE in Triton and the fused lm_head + cross-entropy; "kernels+lora", training only: apply(lora=True) as
well: PEFT's LoRA linears, each MLP and (under "llama32") each self-attention's q, k, v + RoPE as one autograd
Function each, the LoRA branch in bf16; "kernels+lora+offload", training only: apply(offload_checkpoints=True) as
well: each checkpointed decoder layer's input in pinned host memory until its backward, accel/hf/offload.py):
  train    HF + PEFT LoRA (r 16 on every linear of the text decoder), gradient checkpointing, one sequence of
           --tokens (2048) tokens (11B-Vision: with one 4-tile image): tokens/s and peak memory (GiB)
  prefill  generate(max_new_tokens=1) over --prefill-tokens (8192) tokens: ms
  image    11B-Vision only: one no-grad forward over 512 text tokens and a 4-tile image: ms
  memory   the training step of each training configuration, after two untimed steps: memory allocated before it
           (weights, adapters, AdamW states), the peak of its forward, backward and optimizer step, then one
           more step under torch.cuda.memory._record_memory_history: the allocations alive at its peak grouped by
           where they were made (--memory-top groups; tools.debug.memory_trace.peak_allocations)
Each row's `vs_sdpa` is its speed over the unpatched sdpa row of the same model and kind (the issue's targets on 3B
and 11B-Vision: the attention alone >= 1.05, with the patch >= 1.3 at <= 0.7x sdpa's peak memory), `fallbacks`
what the llama32 attention handed to SDPA (accel.hf.fallback_counts(): should be empty), `host_gib` the peak of the
layer inputs held on the host (offload rows) and `pinned_gib` what the process's pinned allocator held after the
row's steps (its blocks are powers of two, and cached). --layers N cuts every model to N decoder layers
(11B-Vision keeps a cross-attention layer among them) for a quick run. Prints a table; writes JSON.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys

import torch

from tools.bench.common import (hf_image_inputs, hf_random_model, hf_text_inputs, median_ms, parser, record,
                                require_cuda, write_record)
from tools.debug.memory_trace import peak_allocations

LORA_TARGETS = r".*(language_model|model\.layers).*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$"
MODELS = ("1b", "3b", "11b-vision")
KINDS = ("train", "prefill", "image", "memory")
IMAGE_TEXT_TOKENS = 512


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser("tools.bench.hf_attention", __doc__)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--impls", default="sdpa,llama32,flash_attention_2",
                    help="attention implementations (flash_attention_2 is skipped where flash_attn is missing)")
    ap.add_argument("--tokens", type=int, default=2048, help="training sequence length")
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=12,
                    help=f"timed training rounds (after {WARMUP_ROUNDS} warm-up rounds; a round = one step of each row)")
    ap.add_argument("--layers", type=int, default=None, help="cut every model to this many decoder layers")
    ap.add_argument("--kinds", default="train,prefill,image", help="some of train, prefill, image, memory")
    ap.add_argument("--memory-top", type=int, default=15, help="memory: groups of allocations listed per row")
    ap.add_argument("--patches", default="none,kernels,kernels+lora",
                    help="module patches to run each implementation with: none, kernels, kernels+lora, "
                         "kernels+lora+offload (the last two: training)")
    ap.add_argument("--rows", default=None, help="impl:patch pairs to run instead of every --impls with every "
                    "--patches, sdpa:none among them (e.g. sdpa:none,llama32:kernels+lora)")
    args = ap.parse_args(argv)
    if args.rows is not None:
        pairs = [tuple(r.strip().split(":")) for r in args.rows.split(",") if r.strip()]
        args.rows = [(p[0], "" if p[-1] == "none" else p[-1]) for p in pairs]
        if (any(len(p) != 2 for p in pairs) or ("sdpa", "") not in args.rows
                or any(patch not in PATCH_ROWS for _, patch in args.rows)):
            fail("--rows: expected impl:patch pairs, sdpa:none among them, patches of none, "
                 + ", ".join(PATCH_ROWS)[2:])
        args.impls = ",".join(dict.fromkeys(i for i, _ in args.rows))
        args.patches = ",".join(dict.fromkeys(p or "none" for _, p in args.rows))
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        fail(f"--models: {', '.join(bad)} not one of {', '.join(MODELS)}")
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if set(args.kinds) - set(KINDS):
        fail(f"--kinds: expected some of {', '.join(KINDS)}, got {','.join(args.kinds)}")
    args.patches = ["" if p.strip() == "none" else p.strip() for p in args.patches.split(",") if p.strip()]
    if "" not in args.patches or set(args.patches) - set(PATCH_ROWS):
        fail("--patches: expected none (every row is compared with it) and some of kernels, kernels+lora, "
             "kernels+lora+offload")
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    if "sdpa" not in args.impls:
        fail("--impls: sdpa must be among them (every row is compared with it)")
    for name, value in (("--tokens", args.tokens), ("--prefill-tokens", args.prefill_tokens),
                        ("--steps", args.steps), ("--layers", args.layers or 1)):
        if value < 1:
            fail(f"{name}: expected a positive integer, got {value}")
    return args


PATCH_ROWS = {"": None, "kernels": dict(fused_linear_cross_entropy=True),  # row label -> accel.hf.apply flags
              "kernels+lora": dict(fused_linear_cross_entropy=True, lora=True),
              "kernels+lora+offload": dict(fused_linear_cross_entropy=True, lora=True, offload_checkpoints=True)}


def configurations(impls, patches, kind: str, rows=None):
    """(attention implementation, patch) pairs: every implementation unpatched, then with the kernels (RMSNorm,
    SwiGLU, RoPE, and the fused lm_head + cross-entropy), then (training) with the LoRA branch in bf16 as well,
    then with the offloaded checkpoints; only those in `rows` where given."""
    return [(impl, patch) for patch in patches if "lora" not in patch or kind in ("train", "memory")
            for impl in impls if rows is None or (impl, patch) in rows]


def host_gib() -> dict:
    """{"host_gib": the peak of the layer inputs held on the host since offload.reset_host_peak(), "pinned_gib":
    what the pinned allocator holds now (None where this torch does not say)}."""
    from accel.hf import offload
    try:
        stats = torch.cuda.host_memory_stats()
    except Exception:  # noqa: BLE001 - a torch without the pinned allocator's statistics: not reported
        stats = {}
    pinned = stats.get("allocated_bytes.current")
    return dict(host_gib=offload.host_bytes()["peak"] / 2**30, pinned_gib=None if pinned is None else pinned / 2**30)


def switch(model, impl: str, patch: str) -> None:
    import accel.hf
    model.set_attn_implementation(impl)
    accel.hf.revert(model)
    if PATCH_ROWS[patch] is not None:
        accel.hf.apply(model, **PATCH_ROWS[patch])
    accel.hf.reset_fallbacks()


def measure(rows: list, model_name: str, kind: str, impl: str, patch: str, model, make_fn) -> None:
    """Switch `model` to (impl, patch), run make_fn()() -> dict of measurements into one row; an exception
    (an implementation the model refuses, out of memory) becomes the row's error."""
    import accel.hf
    row = dict(model=model_name, kind=kind, attention=impl, patch=patch)
    try:
        switch(model, impl, patch)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        row.update(make_fn()())
    except Exception as e:  # noqa: BLE001 - a row that cannot run says why, the rest still run
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    if impl == "llama32":
        row["fallbacks"] = accel.hf.fallback_counts()
    rows.append(row)
    print(format_row(row), flush=True)


WARMUP_ROUNDS = 3  # rounds before timing: every path compiled, and past the slow steps after a first use


def train_rows(rows: list, model_name: str, model, lora, inputs: dict, configs: list, steps: int, tokens: int):
    """Training rows measured round-robin: each round runs one step of every (impl, patch) configuration in turn,
    so the rows share any drift of the host's speed (an HF + PEFT step at batch 1 is mostly host time, and one
    host varied by 30-50% over seconds); WARMUP_ROUNDS untimed rounds first, then `steps` timed ones -> per row the
    median step (CUDA events around it), tokens/s and the peak memory of its steps. A configuration that raises
    (out of memory, an implementation the model refuses) becomes its row's error and leaves the rounds."""
    import accel.hf
    from accel.hf import offload
    params = [p for p in lora.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    times = {c: [] for c in configs}
    peaks = dict.fromkeys(configs, 0.0)
    hosts = dict.fromkeys(configs, {})
    fallbacks = {c: {} for c in configs}
    errors = {}
    lora.train()
    for r in range(WARMUP_ROUNDS + steps):
        for c in configs:
            if c in errors:
                continue
            try:
                switch(model, *c)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                offload.reset_host_peak()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                lora(**inputs, labels=inputs["input_ids"]).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                end.record()
                end.synchronize()
            except Exception as e:  # noqa: BLE001 - a row that cannot run says why, the rest still run
                errors[c] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                opt.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                continue
            for reason, n in accel.hf.fallback_counts().items():
                fallbacks[c][reason] = fallbacks[c].get(reason, 0) + n
            if r >= WARMUP_ROUNDS:
                times[c].append(start.elapsed_time(end))
                peaks[c] = max(peaks[c], torch.cuda.max_memory_allocated() / 2**30)
                hosts[c] = host_gib()  # the same layer inputs every step
    for impl, patch in configs:
        row = dict(model=model_name, kind="train", attention=impl, patch=patch)
        if (impl, patch) in errors:
            row["error"] = errors[(impl, patch)]
        else:
            ms = statistics.median(times[(impl, patch)])
            row.update(ms=ms, tokens_per_s=tokens / ms * 1e3, peak_gib=peaks[(impl, patch)], **hosts[(impl, patch)],
                       steps_ms=[round(t, 2) for t in times[(impl, patch)]])
        if impl == "llama32":
            row["fallbacks"] = fallbacks[(impl, patch)]
        rows.append(row)
        print(format_row(row), flush=True)


def memory_rows(rows: list, model_name: str, model, lora, inputs: dict, configs: list, top: int) -> None:
    """Per training configuration: two untimed steps (AdamW states, cached casts, compiled kernels), then a step
    with the peak memory of its forward, backward and optimizer step, then one under the CUDA allocator's history
    -> a row with what was allocated before that step (GiB), those peaks, and the allocations alive at the
    recorded step's peak grouped by where they were made (the `top` largest)."""
    from accel.hf import offload
    params = [p for p in lora.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    lora.train()
    gib = 2**30

    def step(phases: dict | None = None) -> None:
        """One training step; with `phases`, the peak allocated (GiB) of its forward, backward and optimizer step."""
        loss = None

        def forward():
            nonlocal loss
            loss = lora(**inputs, labels=inputs["input_ids"]).loss
        for name, run in (("forward", forward), ("backward", lambda: loss.backward()), ("optimizer", opt.step)):
            if phases is not None:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            run()
            if phases is not None:
                torch.cuda.synchronize()
                phases[name] = round(torch.cuda.max_memory_allocated() / gib, 3)
        opt.zero_grad(set_to_none=True)

    for c in configs:
        row = dict(model=model_name, kind="memory", attention=c[0], patch=c[1])
        try:
            switch(model, *c)
            step(), step()
            torch.cuda.synchronize()
            row["resident_gib"] = torch.cuda.memory_allocated() / gib
            phases: dict = {}
            offload.reset_host_peak()
            step(phases)
            row.update(host_gib())
            row["phase_peak_gib"] = phases
            row["peak_gib"] = max(phases.values())
            start = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(context="alloc", stacks="python")
            step()
            torch.cuda.synchronize()
            trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
            torch.cuda.memory._record_memory_history(enabled=None)
            found = peak_allocations(trace, start, top)
            row.update(recorded_peak_gib=found["peak_bytes"] / gib, before_gib=found["before_bytes"] / gib,
                       at_peak=found["at_peak"],
                       groups=[[label, round(n / gib, 4), count] for label, n, count in found["groups"]])
        except Exception as e:  # noqa: BLE001 - a row that cannot run says why, the rest still run
            torch.cuda.memory._record_memory_history(enabled=None)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            opt.zero_grad(set_to_none=True)
        rows.append(row)
        print(format_memory_row(row), flush=True)


def format_memory_row(r: dict) -> str:
    head = f"{r['model']:<11} {r['kind']:<8} {r['attention']:<18} {r['patch'] or '-':<20}"
    if "error" in r:
        return f"{head} error: {r['error']}"
    phases = ", ".join(f"{k} {v:.2f}" for k, v in r["phase_peak_gib"].items())
    lines = [f"{head} resident {r['resident_gib']:.3f} GiB; peaks: {phases}; recorded step's peak "
             f"{r['recorded_peak_gib']:.3f} = {r['before_gib']:.3f} allocated before it + the step's own:{host(r)}"]
    lines += [f"    {n:>8.4f} GiB {count:>5} x  {label}" for label, n, count in r["groups"]]
    lines.append(f"    the allocation that reached the peak: {r['at_peak']}")
    return "\n".join(lines)


def prefill_fn(model, tokens: int):
    inputs = hf_text_inputs(tokens)

    def run():
        with torch.no_grad():
            ms = median_ms(lambda: model.generate(**inputs, max_new_tokens=1, min_new_tokens=1, do_sample=False,
                                                pad_token_id=0), 3, warmup=1)
        return dict(ms=ms, peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    return run


def image_fn(model):
    inputs = hf_image_inputs(model, IMAGE_TEXT_TOKENS)

    def run():
        with torch.no_grad():
            ms = median_ms(lambda: model(**inputs, logits_to_keep=1), 5)
        return dict(ms=ms, peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    return run


def bench_model(name: str, args, impls, rows: list) -> None:
    import peft
    model = hf_random_model(name, args.layers)
    vision = name == "11b-vision"
    for kind in ("prefill", "image"):
        if kind not in args.kinds or (kind == "image" and not vision):
            continue
        for impl, patch in configurations(impls, args.patches, kind, args.rows):
            make = ((lambda: prefill_fn(model, args.prefill_tokens)) if kind == "prefill" else
                    (lambda: image_fn(model)))
            measure(rows, name, kind, impl, patch, model, make)
    if "train" in args.kinds or "memory" in args.kinds:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lora = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                          target_modules=LORA_TARGETS))
        inputs = (hf_image_inputs(model, args.tokens) if vision else hf_text_inputs(args.tokens))
        if "memory" in args.kinds:
            memory_rows(rows, name, model, lora, inputs, configurations(impls, args.patches, "memory", args.rows),
                        args.memory_top)
        if "train" in args.kinds:
            train_rows(rows, name, model, lora, inputs, configurations(impls, args.patches, "train", args.rows),
                       args.steps, args.tokens)
    del model
    torch.cuda.empty_cache()


def add_ratios(rows: list) -> None:
    """vs_sdpa (speed over the unpatched sdpa row of the same model and kind: median step over median step) and
    mem_vs_sdpa; for training rows also paired_vs_sdpa, the median over rounds of sdpa's step over this row's step
    in the same round (the host's speed drifts over seconds: a round's rows share its drift)."""
    base = {(r["model"], r["kind"]): r for r in rows if r["attention"] == "sdpa" and not r["patch"] and "ms" in r}
    for r in rows:
        b = base.get((r["model"], r["kind"]))
        if b and "ms" in r:
            r["vs_sdpa"] = b["ms"] / r["ms"]
            r["mem_vs_sdpa"] = r["peak_gib"] / b["peak_gib"]
            if len(r.get("steps_ms", ())) == len(b.get("steps_ms", ())) > 0:
                r["paired_vs_sdpa"] = statistics.median(t0 / t for t0, t in zip(b["steps_ms"], r["steps_ms"]))


def format_row(r: dict) -> str:
    head = f"{r['model']:<11} {r['kind']:<8} {r['attention']:<18} {r['patch'] or '-':<20}"
    if "error" in r:
        return f"{head} error: {r['error']}"
    tps = f"{r['tokens_per_s']:>9.0f}" if "tokens_per_s" in r else f"{'':>9}"
    ratio = f"{r['vs_sdpa']:>6.2f}x {r['mem_vs_sdpa']:>5.2f}x" if "vs_sdpa" in r else ""
    if "paired_vs_sdpa" in r:
        ratio += f"  paired {r['paired_vs_sdpa']:.2f}x"
    fb = f" fallbacks {r['fallbacks']}" if r.get("fallbacks") else ""
    return f"{head} {r['ms']:>10.2f} {tps} {r['peak_gib']:>7.2f} {ratio}{fb}{host(r)}"


def host(r: dict) -> str:
    """The host memory an offload row used: its layer inputs' peak, and what the pinned allocator held."""
    if not r.get("host_gib"):
        return ""
    pinned = "" if r.get("pinned_gib") is None else f" (pinned allocator {r['pinned_gib']:.2f} GiB)"
    return f"  host {r['host_gib']:.3f} GiB{pinned}"


def main(argv=None) -> None:
    args = parse_args(argv)
    require_cuda("python3 -m tools.bench.hf_attention")
    import accel.hf
    accel.hf.register()
    impls = [i for i in args.impls if i != "flash_attention_2" or importlib.util.find_spec("flash_attn")]
    print(f"{'model':<11} {'kind':<8} {'attention':<18} {'patch':<20} {'ms':>10} {'tokens/s':>9} {'peak GiB':>7}"
          f" {'vs sdpa (speed, memory; training: paired by round)'}")
    rows: list = []
    for name in args.models:
        bench_model(name, args, impls, rows)
    add_ratios(rows)
    print("\nwith ratios:")
    for r in rows:
        if r["kind"] != "memory":
            print(format_row(r))
    write_record(args.json_out, record(transformers=__import__("transformers").__version__, rows=rows))


if __name__ == "__main__":
    main()
