"""Which modules of a Llama a PEFT LoRA config adapts, decided as PEFT decides it, with bounded regex matching.

PEFT takes the config, not the file, as the truth: it walks the base model's modules, adapts those that
`target_modules` names (a regex matched whole, or a list matched as `name == t` or `name.endswith('.' + t)`),
keeps only the layers `layers_to_transform` lists (the layer index found after `layers_pattern`), drops
`exclude_modules`, refuses a config that matches nothing, and ignores tensors in the file for modules it did not
adapt. (peft/tuners/tuners_utils.py: check_target_module_exists, inject_adapter.)

Patterns come from a stranger's adapter_config.json and Python's `re` has no time limit: `(a+)+$` against a
30-character module name backtracks for hours. Every pattern is matched with the `regex` package under a timeout,
with the same syntax and result as `re` for every pattern that finishes.
"""
from __future__ import annotations

import time
from pathlib import Path

from refimpl.errors import CheckpointError, quote

LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_DEFAULT_TARGETS = ["q_proj", "v_proj"]  # TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["llama"]
MATCH_SECONDS = 1.0  # all pattern matching for one adapter; real patterns take microseconds a match
MAX_PATTERN_CHARS = 10_000


def llama_modules(num_layers: int) -> list[str]:
    """Every module name of HF's LlamaForCausalLM, in named_modules() order (the root excluded)."""
    names = ["model", "model.embed_tokens", "model.layers"]
    for i in range(num_layers):
        p = f"model.layers.{i}"
        names += [p, f"{p}.self_attn", *(f"{p}.self_attn.{m}" for m in LLAMA_LINEARS[:4]), f"{p}.mlp",
                  *(f"{p}.mlp.{m}" for m in LLAMA_LINEARS[4:]), f"{p}.mlp.act_fn", f"{p}.input_layernorm",
                  f"{p}.post_attention_layernorm"]
    return names + ["model.norm", "model.rotary_emb", "lm_head"]


class BoundedMatcher:
    """re.match / re.fullmatch semantics; all calls together limited to MATCH_SECONDS of matching (so 400 module
    names times a slow pattern cannot add up either); errors name the config field."""

    def __init__(self, path: Path):
        self.path = path
        self._compiled: dict[str, object] = {}
        self.spent = 0.0

    def _compile(self, pattern, what: str):
        import regex

        if not isinstance(pattern, str):
            raise CheckpointError(f"{self.path}: {what} must be a string pattern, got {quote(pattern)}")
        if len(pattern) > MAX_PATTERN_CHARS:
            raise CheckpointError(f"{self.path}: {what} pattern of {len(pattern)} characters is longer than "
                                  f"{MAX_PATTERN_CHARS}")
        if pattern not in self._compiled:
            try:
                self._compiled[pattern] = regex.compile(pattern, flags=regex.VERSION0)
            except (regex.error, ValueError, OverflowError, RecursionError) as e:
                raise CheckpointError(f"{self.path}: {what} {quote(pattern)} is not a valid regular expression "
                                      f"({e})") from None
        return self._compiled[pattern]

    def _run(self, method: str, pattern: str, text: str, what: str, shown: str):
        compiled = self._compile(pattern, what)
        start = time.perf_counter()
        try:
            left = MATCH_SECONDS - self.spent
            if left <= 0:  # the budget is shared by every match of the adapter: spent is spent
                raise TimeoutError
            return getattr(compiled, method)(text, timeout=left)
        except TimeoutError:
            raise CheckpointError(f"{self.path}: {what} {quote(shown)} took more than {MATCH_SECONDS:g} s to "
                                  f"match module names such as {quote(text)} (a pattern that backtracks "
                                  f"exponentially?)") from None
        finally:
            self.spent += time.perf_counter() - start

    def fullmatch(self, pattern: str, text: str, what: str) -> bool:
        return self._run("fullmatch", pattern, text, what, pattern) is not None

    def match(self, pattern: str, text: str, what: str, shown: str | None = None):
        return self._run("match", pattern, text, what, pattern if shown is None else shown)


def _layer_index(key: str, layers_pattern, m: BoundedMatcher) -> int | None:
    """The layer index PEFT reads from a module name: the first number after `layers_pattern` (any segment when
    there is none)."""
    if not layers_pattern:
        hit = m.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key, "layers_pattern")
    else:
        hit = None
        for pattern in [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern:
            if not isinstance(pattern, str):
                raise CheckpointError(f"{m.path}: layers_pattern must be a string or a list of strings, got "
                                      f"{quote(pattern)}")
            hit = m.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key, "layers_pattern", pattern)
            if hit is not None:
                break
    return int(hit.group("idx")) if hit else None


def _check_shape(d: dict, path: Path) -> None:
    """The combinations LoraConfig.__post_init__ refuses, and the field types it expects."""
    targets, layers, pattern = d.get("target_modules"), d.get("layers_to_transform"), d.get("layers_pattern")
    if targets is not None and not isinstance(targets, (str, list)):
        raise CheckpointError(f"{path}: target_modules must be a regex string or a list of names, got "
                              f"{quote(targets)}")
    if isinstance(targets, str) and (layers is not None or pattern is not None):
        raise CheckpointError(f"{path}: layers_to_transform / layers_pattern cannot be used when target_modules is "
                              f"a regex string (PEFT refuses this config)")
    if pattern and layers is None:
        raise CheckpointError(f"{path}: layers_pattern needs layers_to_transform (PEFT refuses this config)")
    ints = [layers] if not isinstance(layers, list) else layers
    if layers is not None and not all(isinstance(i, int) and not isinstance(i, bool) for i in ints):
        raise CheckpointError(f"{path}: layers_to_transform must be an integer or a list of integers, got "
                              f"{quote(layers)}")
    exclude = d.get("exclude_modules")
    if exclude is not None and not (isinstance(exclude, str) or
                                    (isinstance(exclude, list) and all(isinstance(e, str) for e in exclude))):
        raise CheckpointError(f"{path}: exclude_modules must be a regex string or a list of names, got "
                              f"{quote(exclude)}")
    if d.get("target_parameters"):
        raise CheckpointError(f"{path}: target_parameters is not supported (only LoRA on nn.Linear modules), got "
                              f"{quote(d['target_parameters'])}")


def is_targeted(d: dict, key: str, m: BoundedMatcher) -> bool:
    """PEFT's check_target_module_exists for one module name (exclusions first)."""
    exclude = d.get("exclude_modules")
    if isinstance(exclude, str) and exclude and m.fullmatch(exclude, key, "exclude_modules"):
        return False
    if isinstance(exclude, list) and any(key == e or key.endswith(f".{e}") for e in exclude):
        return False
    targets = d.get("target_modules")
    if targets is None:
        targets = PEFT_DEFAULT_TARGETS
    if isinstance(targets, str):
        return m.fullmatch(targets, key, "target_modules")
    if key in targets:
        return True
    if not any(isinstance(t, str) and key.endswith(f".{t}") for t in targets):
        return False
    layers = d.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    index = _layer_index(key, d.get("layers_pattern"), m)
    return index is not None and (index == layers if isinstance(layers, int) else index in layers)


def targeted_modules(d: dict, num_layers: int, path: Path, m: BoundedMatcher | None = None,
                     modules: list[str] | None = None, all_linear=LLAMA_LINEARS) -> list[str]:
    """The module names PEFT adapts in a Llama of `num_layers` layers (or among `modules`, another model's module
    names, whose linears' leaf names are `all_linear`); refused where PEFT raises."""
    _check_shape(d, path)
    if isinstance(d.get("target_modules"), list) and not all(isinstance(t, str) for t in d["target_modules"]):
        raise CheckpointError(f"{path}: target_modules must list module names (strings), got "
                              f"{quote(d['target_modules'])}")
    if isinstance(d.get("target_modules"), str) and d["target_modules"].lower() == "all-linear":
        d = {**d, "target_modules": list(all_linear)}  # PEFT: every nn.Linear except the output layer
    m = m or BoundedMatcher(path)
    hits = [key for key in (llama_modules(num_layers) if modules is None else modules) if is_targeted(d, key, m)]
    if not hits:
        targets = d.get("target_modules", PEFT_DEFAULT_TARGETS)
        note = f" within layers_to_transform {quote(d['layers_to_transform'])}" \
            if d.get("layers_to_transform") not in (None, []) else ""
        raise CheckpointError(f"{path}: target_modules {quote(targets)} matches no module of the base "
                              f"model{note} (PEFT refuses such an adapter)")
    return hits
