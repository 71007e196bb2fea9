"""Chat templates that loop for hours or build gigabytes inside Jinja's sandbox: each stops with one clear error,
in bounded time and memory, and real templates render exactly as HF's own renderer renders them (the oracle).
"""
import json
import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _badinput import assert_clean_error, generate_args, make_model, run_cli
from refimpl.errors import Llama32Error
from refimpl.text import template_sandbox as ts
from refimpl.text.tokenizer import LLAMA3_TEMPLATE

MEMORY = 256 * 2 ** 20  # traced peak: the budgets allow 16 Mi characters, so a few of those strings at most
SECONDS = ts.MAX_SECONDS + 5


def render(source, **variables):
    def raise_exception(message):
        raise Llama32Error(f"chat template: {message}")
    return ts.render(ts.sandbox(raise_exception), source, messages=[{"role": "user", "content": "hi"}],
                     add_generation_prompt=True, bos_token="<s>", **variables)


HOSTILE = {  # source -> words of the expected message
    "nested empty loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                           "steps"),
    "loops over a list": ("{% set xs = range(100000)|list %}{% for a in xs %}{% for b in xs %}{% endfor %}"
                          "{% endfor %}", "steps"),
    "recursive loop": ("{% for x in range(100000) recursive %}{{ loop(range(100000)) }}{% endfor %}",
                       "recursion"),
    "center": ("{{ 'x' | center(10**10) }}", "center"),
    "center kwarg": ("{{ 'x' | center(width=10**9) }}", "center"),
    "center in map": ("{{ range(100000)|map('center', 99999)|join }}", "join"),
    "tojson indent": ("{{ range(100000)|list|tojson(indent=10**6) }}", "indent"),
    "tojson nested indent": ("{% set x = [[[[[[[[1]]]]]]]] %}{{ (range(1000)|map('string')|list * 9000)"
                             "|tojson(indent=64) }}", "limit"),
    "format filter": ("{{ '%999999999d'|format(1) }}", "width"),
    "format star": ("{{ '%*d'|format(999999999, 1) }}", "'*' width"),
    "percent operator": ("{{ '%0999999999d' % 1 }}", "width"),
    "str.format width": ("{{ '{:>999999999}'.format(1) }}", "width"),
    "str.format nested": ("{{ '{0:{1}}'.format('x', 999999999) }}", "nested"),
    "list repeat huge": ("{{ ((range(10000)|map('string')|list) * 1000) | join }}", "too large"),
    "str.join": ("{{ ''.join(range(100000)|map('center', 99999)) }}", "join"),
    "ljust": ("{{ 'x'.ljust(10**9) }}", "ljust"),
    "zfill": ("{{ '1'.zfill(10**9) }}", "zfill"),
    "expandtabs": ("{{ ('\\t' * 1000).expandtabs(10**6) }}", "expandtabs"),
    "replace filter": ("{{ ('x' * 1000000)|replace('x', 'y' * 100) }}", "replace"),
    "replace method": ("{{ ('x' * 1000000).replace('', 'y' * 100) }}", "replace"),
    "indent": ("{{ ('a\\n' * 500000)|indent(100) }}", "indent"),
    "indent string": ("{{ ('a\\n' * 500000)|indent(' ' * 100) }}", "indent"),
    "batch": ("{{ [1]|batch(10**9, 'x')|list }}", "batch"),
    "slice": ("{{ [1]|slice(10**8)|list }}", "slice"),
    "concat doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}", "'~'"),
    "plus doubling": ("{% set ns = namespace(s=['a']) %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
                      "{% endfor %}", "'+'"),
    "list repeat": ("{{ [1, 2] * 10**9 }}", "too large"),
    "int product": ("{% set x = 10**1000 %}{% set ns = namespace(v=x) %}{% for i in range(100) %}"
                    "{% set ns.v = ns.v * ns.v %}{% endfor %}", "too large"),
    "output": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "rendered prompt"),
    "lipsum": ("{{ lipsum(10**6) }}", "undefined"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_template_stops(case, monkeypatch):
    source, words = HOSTILE[case]
    monkeypatch.setattr(ts, "MAX_STEPS", 100_000)  # tracemalloc slows Python down ~10x; the real budget is below
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(Exception) as info:
            render(source)
        elapsed, peak = time.perf_counter() - t0, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert words in str(info.value), str(info.value)
    assert elapsed < SECONDS and peak < MEMORY, (elapsed, peak)


@pytest.mark.parametrize("case", ["nested empty loops", "center", "str.format width", "concat doubling"])
def test_hostile_template_through_cli(tmp_path, case):
    model = make_model(tmp_path / "m")
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": HOSTILE[case][0]}))
    t0 = time.perf_counter()
    message = assert_clean_error(run_cli(generate_args(model, "--chat")), "chat template")
    assert time.perf_counter() - t0 < SECONDS and len(message) <= 300


@pytest.mark.parametrize("case", ["nested empty loops", "loops over a list"])
def test_step_budget_at_full_size(case):
    t0 = time.perf_counter()
    with pytest.raises(Exception, match=f"more than {ts.MAX_STEPS} steps"):
        render(HOSTILE[case][0])
    assert time.perf_counter() - t0 < SECONDS


def test_time_budget(monkeypatch):
    """The wall-clock budget stops what the step budget would let run (here: a slow filter on few steps)."""
    monkeypatch.setattr(ts, "MAX_SECONDS", 0.2)
    t0 = time.perf_counter()
    with pytest.raises(Exception, match="seconds"):
        render("{% for i in range(20000) %}{{ range(100000)|sum }}{% endfor %}")
    assert time.perf_counter() - t0 < 5


# ---- valid templates: the same text as HF's renderer ----
REAL = {
    "llama3 fallback": LLAMA3_TEMPLATE,
    "tojson tools": "{{ bos_token }}{% for m in messages %}{{ m | tojson(indent=4) }}{{ m.content | tojson }}"
                    "{% endfor %}",
    "loop vars": "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ m['role'] | upper }}: "
                 "{{ m['content'] | trim | center(20) }}{% if not loop.last %}\n{% endif %}{% endfor %}",
    "namespace and concat": "{% set ns = namespace(t='') %}{% for m in messages %}{% set ns.t = ns.t ~ m.role ~ "
                            "':' ~ m.content %}{% endfor %}{{ ns.t | replace(':', ' = ') | indent(2, true) }}",
    "format and join": "{{ '%s-%05d' | format('x', 42) }} {{ '{}|{:>6}'.format('a', 'b') }} "
                       "{{ messages | map(attribute='role') | join(', ') }} {{ [1, 2] * 3 }} {{ 'ab' + 'cd' }}",
    "recursive": "{% for x in [[1, [2, 3]], 4] recursive %}{% if x is iterable %}[{{ loop(x) }}]{% else %}"
                 "{{ x }}{% endif %}{% endfor %}",
    "loop controls": "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i > 5 %}{% break %}"
                     "{% endif %}{{ i }}{% endfor %}{{ 7 ** 3 }}{{ 17 % 5 }}",
}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi \u00e9\u4e2d  "},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "again"}]


@pytest.mark.parametrize("case", list(REAL))
def test_real_templates_render_as_hf(case):
    transformers = pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import _compile_jinja_template
    variables = dict(messages=MESSAGES, add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    want = _compile_jinja_template(REAL[case]).render(**variables)
    got = ts.render(ts.sandbox(None), REAL[case], **variables)
    assert got == want
    assert transformers  # imported for the oracle


def test_long_conversation_fits_the_budget():
    messages = [{"role": "user" if i % 2 else "assistant", "content": f"message {i} " * 20} for i in range(5000)]
    text = ts.render(ts.sandbox(None), LLAMA3_TEMPLATE, messages=messages, add_generation_prompt=True,
                     bos_token="<s>")
    assert text.count("<|eot_id|>") == 5000


# ---- fuzz: templates assembled from hostile pieces finish or fail cleanly, in time and memory ----
NUMBERS = st.sampled_from([0, 1, 7, 999, 10 ** 5, 10 ** 6, 10 ** 9, 2 ** 64, -5])
PIECES = [
    lambda n: f"{{{{ 'ab' * {n} }}}}", lambda n: f"{{{{ 'x' | center({n}) }}}}",
    lambda n: f"{{{{ range({min(n, 10 ** 5)})|list|tojson(indent={n % 100}) }}}}",
    lambda n: f"{{% for i in range({min(n, 10 ** 5)}) %}}{{% for j in range({min(n, 10 ** 5)}) %}}{{% endfor %}}"
              f"{{% endfor %}}",
    lambda n: f"{{{{ '%{n}d' | format(3) }}}}", lambda n: f"{{{{ '{{:>{n}}}'.format(3) }}}}",
    lambda n: f"{{{{ ('x' * {min(n, 10 ** 6)}) | replace('x', 'yyyy') | length }}}}",
    lambda n: f"{{{{ range({min(n, 10 ** 5)}) | map('string') | join(',') | length }}}}",
    lambda n: f"{{{{ 'a'.rjust({n}) | length }}}}", lambda n: f"{{{{ [0] | batch({n}, 1) | list | length }}}}",
    lambda n: f"{{% set ns = namespace(s='ab') %}}{{% for i in range({min(n, 64)}) %}}{{% set ns.s = ns.s ~ ns.s %}}"
              f"{{% endfor %}}{{{{ ns.s | length }}}}",
]


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(st.tuples(st.integers(0, len(PIECES) - 1), NUMBERS), min_size=1, max_size=3))
def test_fuzz_templates(monkeypatch, pieces):
    monkeypatch.setattr(ts, "MAX_STEPS", 100_000)  # as above: tracemalloc's slowdown
    source = "".join(PIECES[i](n) for i, n in pieces)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        render(source)
    except Exception as e:  # noqa: BLE001 - any failure is fine as long as it is bounded and reported by the caller
        assert not isinstance(e, (MemoryError, RecursionError)), e
    finally:
        elapsed, peak = time.perf_counter() - t0, tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert elapsed < SECONDS and peak < MEMORY, (source, elapsed, peak)
