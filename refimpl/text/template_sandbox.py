"""The Jinja sandbox chat templates render in, with budgets: steps, seconds and characters.

Chat templates come from model files, i.e. from strangers. jinja2's ImmutableSandboxedEnvironment stops them
reaching Python internals, but not from running for hours (three nested loops over `range(100000)` stay inside its
range limit) or building gigabytes (`'x' | center(10**10)`, `tojson(indent=10**6)`, doubling a string in a loop).
So this sandbox counts and checks, deterministically:

* steps: every loop iteration (each `for` iterable is wrapped at compile time), call, attribute/item lookup,
  filter and intercepted operator costs one step; past MAX_STEPS, or past MAX_SECONDS of wall time (checked at
  every step), rendering stops;
* characters: every string-building operation is checked *before* it allocates: `*`, `+`, `~`, `%`, str.format,
  the width arguments of center/indent/wordwrap/... and of str.center/ljust/rjust/zfill/expandtabs, join (streamed,
  summed as it goes), replace (sized from a count), tojson (encoded chunk by chunk); results and the rendered
  output are capped at MAX_CHARS.

Exceeding a budget raises TemplateBudgetError (a jinja2 SecurityError), reported by the caller as one line.
"""
from __future__ import annotations

import functools
import json
import re
import time
from datetime import datetime

MAX_STEPS = 1_000_000  # real chat templates take a few steps per message; 50k messages fit
MAX_SECONDS = 10.0
MAX_CHARS = 16 * 1024 * 1024  # any one string (characters) or sequence (8 × items) a template builds; the output
MAX_WIDTH = 100_000  # width/count arguments (center, indent, truncate, batch, ljust...): real templates use < 100
MAX_INT_BITS = 64 * 1024  # integer arithmetic past 64 Kibit is seconds to hours of bignum work
MAX_JSON_INDENT = 64

# filter name -> positions (after the value) of arguments that size its output
_WIDTH_FILTERS = {"center": (0,), "indent": (0,), "batch": (0,), "slice": (0,)}
_WIDTH_METHODS = {"center", "ljust", "rjust", "zfill", "expandtabs"}  # str methods whose int argument is a width
_PERCENT_DIRECTIVE = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_FORMAT_SPEC_NUMBERS = re.compile(r"\{[^{}]*?:[^{}]*?(\d+)")
_NESTED_SPEC = re.compile(r"\{[^{}]*:[^{}]*\{")


@functools.lru_cache(maxsize=None)
def _error_class():
    from jinja2.sandbox import SecurityError

    class TemplateBudgetError(SecurityError):
        """A chat template went past one of the rendering budgets."""

    return TemplateBudgetError


def _error(message: str) -> Exception:
    return _error_class()(message)


def _size(value) -> int:
    """Characters of a string; 8 per item of a container (its pointer), so both kinds share one budget."""
    if isinstance(value, (str, bytes)):
        return len(value)
    return 8 * len(value) if isinstance(value, (list, tuple, dict)) else 0


def _check_width(value, what: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_WIDTH:
        raise _error(f"{what} {value} is past the template limit of {MAX_WIDTH}")
    if isinstance(value, str) and len(value) > MAX_WIDTH:  # indent(" " * n) takes a string width
        raise _error(f"{what} of {len(value)} characters is past the template limit of {MAX_WIDTH}")


def _check_format_string(fmt: str) -> None:
    """Widths and precisions inside %-directives and {:...} specs ('%999999999d', '{:>999999999}'); a width taken
    from the arguments ('%*d', '{0:{1}}') cannot be checked here, so it is refused."""
    for m in _PERCENT_DIRECTIVE.finditer(fmt):
        for number in m.groups():
            if number == "*":
                raise _error("a '*' width in a %-format is not allowed in templates")
            if number and int(number) > MAX_WIDTH:
                raise _error(f"format width {number[:20]} is past the template limit of {MAX_WIDTH}")
    if _NESTED_SPEC.search(fmt):
        raise _error("a nested {...} inside a format spec is not allowed in templates")
    for m in _FORMAT_SPEC_NUMBERS.finditer(fmt):
        if len(m.group(1)) > 6 or int(m.group(1)) > MAX_WIDTH:
            raise _error(f"format width {m.group(1)[:20]} is past the template limit of {MAX_WIDTH}")


def _pass_arg_offset(func) -> int:
    """Filters marked @pass_context / @pass_environment / @pass_eval_context get that object first."""
    return 1 if getattr(func, "jinja_pass_arg", None) is not None else 0


def _sandbox_class():
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BudgetCodeGenerator(CodeGenerator):
        """`~` joins through the environment, so its size is checked before the string is built."""

        def visit_Concat(self, node, frame):
            self.write("environment.bounded_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BudgetSandbox(ImmutableSandboxedEnvironment):
        code_generator_class = BudgetCodeGenerator
        intercepted_binops = frozenset({"*", "**", "+", "%"})  # also stops Jinja folding them at compile time

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.steps, self.deadline = 0, None
            self._bound_filters()

        # ---- the step and time budget ----
        def start(self) -> None:
            self.steps, self.deadline = 0, time.monotonic() + MAX_SECONDS

        def tick(self) -> None:
            self.steps += 1
            if self.steps > MAX_STEPS:
                raise _error(f"rendering took more than {MAX_STEPS} steps (a runaway loop?)")
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise _error(f"rendering took more than {MAX_SECONDS:g} seconds")

        def checked(self, value, what: str = "a value"):
            if _size(value) > MAX_CHARS:
                raise _error(f"{what} is too large ({_size(value)} characters or 8 × items; template limit "
                             f"{MAX_CHARS})")
            return value

        def loop_budget(self, iterable):
            """Every `for` iterable is wrapped in this (see _parse): one step per iteration."""
            for item in iterable:
                self.tick()
                yield item

        def _parse(self, source, name, filename):
            tree = super()._parse(source, name, filename)
            for loop in tree.find_all(nodes.For):
                loop.iter = nodes.Call(nodes.EnvironmentAttribute("loop_budget"), [loop.iter], [], None, None,
                                       lineno=loop.lineno)
            return tree

        # ---- operations the sandbox routes through the environment ----
        def bounded_concat(self, parts):
            self.tick()
            texts = [str(p) for p in parts]
            if sum(map(len, texts)) > MAX_CHARS:
                raise _error(f"joining strings with '~' past the template limit of {MAX_CHARS} characters")
            return "".join(texts)

        def call_binop(self, context, operator, left, right):
            self.tick()
            ints = isinstance(left, int) and isinstance(right, int)
            if operator == "**":
                if ints and right > 0 and abs(left) > 1 and right * abs(left).bit_length() > MAX_INT_BITS:
                    raise _error(f"{left} ** {right} is too large")
            elif operator == "*":
                if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    raise _error("integer product is too large")
                seq, count = (left, right) if isinstance(right, int) else (right, left)
                if _size(seq) and isinstance(count, int) and _size(seq) * count > MAX_CHARS:
                    raise _error(f"repeating a sequence {count} times is too large (template limit {MAX_CHARS})")
            elif operator == "+":
                if _size(left) + _size(right) > MAX_CHARS:
                    raise _error(f"'+' would build more than the template limit of {MAX_CHARS}")
            elif operator == "%" and isinstance(left, str):
                _check_format_string(left)
            return self.checked(super().call_binop(context, operator, left, right), f"'{operator}' result")

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            __self.tick()
            owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
            if isinstance(owner, str):
                if name in _WIDTH_METHODS:
                    for a in (*args, *kwargs.values()):
                        _check_width(a, f"str.{name} width")
                elif name == "join":
                    return bounded_join(__self, args[0] if args else kwargs.get("iterable", ()), owner)
                elif name == "replace" and len(args) >= 2:
                    _check_replace(owner, *args[:3])
            result = super().call(__context, __obj, *args, **kwargs)
            return __self.checked(result, f"the result of {name or 'a call'}")

        def getattr(self, obj, attribute):
            self.tick()
            if isinstance(obj, str) and attribute in ("format", "format_map"):  # the sandbox wraps these itself
                _check_format_string(obj)
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            self.tick()
            return super().getitem(obj, argument)

        # ---- filters ----
        def _bound_filters(self) -> None:
            own = {"join": bounded_join_filter, "tojson": bounded_tojson, "replace": bounded_replace,
                   "indent": bounded_indent, "format": bounded_format}
            for name, func in list(self.filters.items()):
                self.filters[name] = self._budgeted(name, own.get(name, func))

        def _budgeted(self, name: str, func):
            offset = _pass_arg_offset(func)
            width_args = _WIDTH_FILTERS.get(name, ())

            @functools.wraps(func)
            def wrapper(*args, **kwargs):
                self.tick()
                filter_args = args[offset + 1:]
                for i in width_args:
                    if i < len(filter_args):
                        _check_width(filter_args[i], f"{name} argument")
                for key in ("width", "linecount", "slices"):
                    if key in kwargs:
                        _check_width(kwargs[key], f"{name} {key}")
                return self.checked(func(*args, **kwargs), f"the result of |{name}")

            return wrapper

    def bounded_join(env, items, separator: str = "") -> str:
        """str.join, summing lengths as the items arrive instead of after building them all."""
        parts, total = [], 0
        for item in items:
            env.tick()
            text = str(item)
            total += len(text) + len(separator)
            if total > MAX_CHARS:
                raise _error(f"join would build more than the template limit of {MAX_CHARS} characters")
            parts.append(text)
        return separator.join(parts)

    from jinja2.filters import make_attrgetter
    from jinja2.utils import pass_environment

    @pass_environment
    def bounded_join_filter(env, value, d: str = "", attribute=None):
        if attribute is not None:
            value = map(make_attrgetter(env, attribute), value)
        return bounded_join(env, value, str(d))

    @pass_environment
    def bounded_tojson(env, value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        """HF's tojson (json.dumps, non-ASCII kept), encoded chunk by chunk so the size is known as it grows."""
        if indent is not None and (not isinstance(indent, int) or isinstance(indent, bool)
                                   or not 0 <= indent <= MAX_JSON_INDENT):
            raise _error(f"tojson indent {indent!r} is past the template limit of {MAX_JSON_INDENT}")
        chunks, total = [], 0
        for chunk in json.JSONEncoder(indent=indent, ensure_ascii=ensure_ascii, separators=separators,
                                                 sort_keys=sort_keys).iterencode(value):
            total += len(chunk)
            if total > MAX_CHARS:
                raise _error(f"tojson would build more than the template limit of {MAX_CHARS} characters")
            chunks.append(chunk)
        env.tick()
        return "".join(chunks)

    def _check_replace(s: str, old, new, count=-1) -> None:
        if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
            hits = len(s) + 1 if old == "" else s.count(old)
            if isinstance(count, int) and count >= 0:
                hits = min(hits, count)
            if len(s) + hits * max(0, len(new) - len(old)) > MAX_CHARS:
                raise _error(f"replace would build more than the template limit of {MAX_CHARS} characters")

    from jinja2.filters import do_format, do_indent, do_replace

    @functools.wraps(do_replace)
    def bounded_replace(eval_ctx, s, old, new, count=None):
        _check_replace(str(s), str(old), str(new), -1 if count is None else count)
        return do_replace(eval_ctx, s, old, new, count)

    def bounded_indent(s, width=4, first=False, blank=False):
        _check_width(width, "indent width")
        lines = str(s).count("\n") + 1
        if len(str(s)) + lines * (width if isinstance(width, int) else len(str(width))) > MAX_CHARS:
            raise _error(f"indent would build more than the template limit of {MAX_CHARS} characters")
        return do_indent(s, width, first, blank)

    def bounded_format(value, *args, **kwargs):
        _check_format_string(str(value))
        return do_format(value, *args, **kwargs)

    return BudgetSandbox


@functools.lru_cache(maxsize=None)
def _cached_class():
    return _sandbox_class()


def sandbox(raise_exception):
    """A fresh environment with HF's chat-template settings; `raise_exception` is the template's error hook."""
    env = _cached_class()(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(str(fmt)[:MAX_WIDTH])
    env.globals.pop("lipsum", None)  # lipsum(10**6) writes a novel; no chat template uses it
    return env


def render(env, source: str, **variables) -> str:
    """Compile and render with the budgets; the output is collected chunk by chunk and capped at MAX_CHARS."""
    template = env.from_string(source)
    env.start()
    out, total = [], 0
    for chunk in template.generate(**variables):
        env.tick()
        total += len(chunk)
        if total > MAX_CHARS:
            raise _error(f"the rendered prompt is longer than the template limit of {MAX_CHARS} characters")
        out.append(chunk)
    return "".join(out)
