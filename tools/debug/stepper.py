"""Step-through debugging of one token's forward: the session behind `llama32 step` (no click in here).

A `StepSession` drives one or two engines' `steps()` generators an op at a time (karpathy's llama2.c makes the
one-token forward the unit of debugging; so do we). With two backends it runs them in lockstep by default: after every op the
second side's output is compared with the first's and then replaced, via send(), by the first's value, so the
second side always computes on the first side's inputs and a difference belongs to the op that made it. The
`inherited` mode feeds each side its own outputs instead and shows how a difference grows downstream.

Everything printed is plain text with no timings or addresses, so a scripted session is a reproducible transcript.
"""
from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from refimpl.errors import GenerationError, Llama32Error, one_line
from refimpl.formats.safe_open import check_path
from refimpl.formats.safetensors_io import save_safetensors

from tools.debug.lockstep import lockstep as drive, reference_stream
from tools.vision_inputs import forward_names, token_rows
from tools.debug.step_values import (INT, CommandError, Diff, difference, g, injected, parse_index, softmax64,
                                     stats_lines)

HELP = """commands (separate several with ';'):
  n, next [COUNT]     run one op (or COUNT ops) and show what it produced
  c, continue         run to the next breakpoint (b, bd) or to the end of the forward
  b [PATTERN]         break after ops whose name matches a glob, e.g. b layers.7.attn.*; alone: list them
  bd [TOL|off]        break at the first op where the two backends differ by more than TOL (max abs)
  clear               remove every breakpoint (b patterns and bd)
  p [NAME]            stats of an activation on every backend (default: the current one)
  show [NAME] [SLICE] values, e.g. show layers.0.attn.q [0, :8]
  diff [NAME]         the two backends side by side: max abs, NMSE, worst index and the two values there
  top [K]             the K most likely next tokens (default 5) on every backend, once logits exist
  dump FILE           save every activation so far as safetensors, keys "<backend>/<name>"
  where               the current op and the next one
  list [PATTERN]      the ops: '*' done, '>' current, ' ' still to run
  q, quit             leave
  h, help             this text"""


# ---- the session ----
@dataclass
class Side:
    """One backend's forward of the stepped token and everything it has produced so far."""

    label: str
    engine: Any
    gen: Any = None
    pending: Any = None  # the value to send() back when resuming: a replacement, or None to keep the own value
    values: dict = field(default_factory=dict)  # name -> float32 NumPy copy of what this side produced
    dtypes: dict = field(default_factory=dict)  # name -> the backend array's dtype, as text

    def resume(self):
        pending, self.pending = self.pending, None
        return self.gen.send(pending)


def run_to_end(sides: list[Side], lockstep: bool) -> None:
    """Run every side's generator to the end (the prefill): the second side beside the first through the
    lockstep driver, fed the first's values when `lockstep`."""
    first = sides[0]
    if len(sides) == 1:
        for _ in first.gen:
            pass
        return
    second = sides[1]
    for _ in drive(reference_stream(first.engine, first.gen), second.engine, second.gen, feed_reference=lockstep):
        pass


class StepSession:
    def __init__(self, engines: list, prompt_ids: list[int], position: int, tokenizer=None,
                 lockstep: bool = True, inject: tuple[str, str] | None = None, out: Callable[[str], None] = print,
                 labels: list[str] | None = None, inputs: dict | None = None):
        cfg = engines[0].config
        # inputs: a vision engine's images, given to the prefill and again to the stepped token's forward, which
        # so re-encodes the image: the encoder and the cross-attention layers can be stepped through
        self.inputs = inputs or {}
        self.names = forward_names(cfg, self.inputs)
        self.failed: list[str] = []  # the command lines that reported an error, for a script's exit status
        if not prompt_ids:
            raise GenerationError("the prompt is empty: give some text to step through")
        bad = [t for t in prompt_ids if not 0 <= t < token_rows(cfg)]
        if bad:
            raise GenerationError(f"token id {bad[0]} is outside the vocabulary [0, {token_rows(cfg)})")
        if not 0 <= position < len(prompt_ids):
            raise GenerationError(f"--position {position}: the prompt has {len(prompt_ids)} tokens, so the "
                                  f"position must be in [0, {len(prompt_ids) - 1}]")
        labels = labels or [e.backend if i == 0 or e.backend != engines[0].backend else f"{e.backend}.{i + 1}"
                            for i, e in enumerate(engines)]
        self.sides = [Side(label, e) for label, e in zip(labels, engines)]
        self.ids, self.position, self.tokenizer, self.out = list(prompt_ids), position, tokenizer, out
        self.lockstep, self.inject = lockstep and len(engines) > 1, inject
        self.breakpoints: list[str] = []
        self.bd_tol: float | None = None
        self.done = 0  # ops run so far
        self.diffs: dict[str, Diff] = {}
        self._start()

    def _start(self) -> None:
        """Prefill the tokens before `position` (in lockstep too, so both KV caches hold the same keys), then
        create the one-token generators without starting them: the session stops before the first op."""
        caches = [s.engine.new_cache(self.position + 1) for s in self.sides]
        if self.position > 0:
            ids, pos = self.ids[:self.position], list(range(self.position))
            for s, cache in zip(self.sides, caches):
                s.gen = s.engine.steps(ids, pos, cache, last_logits_only=True, **self.inputs)
            run_to_end(self.sides, self.lockstep)
        for s, cache in zip(self.sides, caches):
            s.gen = s.engine.steps([self.ids[self.position]], [self.position], cache, **self.inputs)

    # ---- text ----
    def token_text(self, token: int) -> str:
        return repr(self.tokenizer.decode([token])) if self.tokenizer is not None else ""

    def banner(self) -> list[str]:
        token = self.ids[self.position]
        sides = " vs ".join(f"{s.label} ({describe(s.engine)})" for s in self.sides)
        if len(self.sides) == 1:
            mode = "single backend"
        elif self.lockstep:
            mode = ("lockstep: after every op the second backend's output is compared, then replaced by the "
                    "first's, so a difference belongs to the op that made it")
        else:
            mode = "inherited: each backend is fed its own outputs, so differences accumulate downstream"
        lines = [f"backends: {sides}", f"mode: {mode}",
                 f"prompt: {len(self.ids)} tokens; stepping position {self.position} (token {token} "
                 f"{self.token_text(token)}) after a prefill of {self.position} tokens",
                 f"{len(self.names)} ops; stopped before op 1 ({self.names[0]}); h for help"]
        if self.inject:
            lines.append(f"inject: {self.inject[0]} = {self.inject[1]} in {self.sides[0].label}")
        return lines

    def say(self, *lines: str) -> None:
        for line in lines:
            self.out(line)

    # ---- running ops ----
    @property
    def finished(self) -> bool:
        return self.done == len(self.names)

    def step(self) -> str:
        """Run one op on every side; returns its name."""
        outs = [s.resume() for s in self.sides]
        name = outs[0][0]
        first = self.sides[0]
        value = np.array(first.engine.to_numpy(outs[0][1]), np.float32)  # a copy: the session keeps it
        if self.inject and self.inject[0] == name:
            value = injected(value, self.inject[1])
            first.pending = first.engine.from_numpy(value, like=outs[0][1])
        for s, (n, v) in zip(self.sides, outs):
            assert n == name, f"backends disagree on the op order: {name} vs {n}"
            s.values[name] = value if s is first else np.array(s.engine.to_numpy(v), np.float32)
            s.dtypes[name] = str(getattr(v, "dtype", type(v).__name__)).replace("torch.", "")
            if s is not first and self.lockstep:
                s.pending = s.engine.from_numpy(value, like=v)
        if len(self.sides) > 1:
            self.diffs[name] = difference(value, self.sides[1].values[name])
        self.done += 1
        if self.finished:  # let the generators return (the forward is over) so nothing is left half-run
            for s in self.sides:
                try:
                    s.resume()
                except StopIteration:
                    pass
        return name

    def op_line(self, name: str) -> str:
        line = f"op {self.done}/{len(self.names)} {name} {list(self.sides[0].values[name].shape)}"
        if name in self.diffs:
            line += f"  max|d| {self.diffs[name].max_abs:.3e}"
            if self.bd_tol is not None and self.exceeds(name):
                line += f"  > bd {g(self.bd_tol)}"
        return line

    def exceeds(self, name: str) -> bool:
        d = self.diffs[name].max_abs
        return not d <= self.bd_tol  # NaN counts as exceeding

    def stop_reason(self, name: str) -> str | None:
        hit = [p for p in self.breakpoints if fnmatch.fnmatchcase(name, p)]
        if hit:
            return f"breakpoint {hit[0]}"
        if self.bd_tol is not None and name in self.diffs and self.exceeds(name):
            return f"bd: backends differ by {self.diffs[name].max_abs:.3e} > {g(self.bd_tol)}"
        return None

    def end_lines(self) -> list[str]:
        lines = [f"end of the forward ({len(self.names)} ops)"]
        for s in self.sides:
            logits = s.values["logits"][-1]
            t = int(np.nanargmax(logits)) if np.isfinite(logits).any() else 0
            lines.append(f"  next token [{s.label}]: {t} {self.token_text(t)} p {g(softmax64(logits)[t])}")
        return lines

    # ---- commands ----
    def run(self, line: str) -> bool:
        """Run one command line; False means quit. Errors are printed, never raised."""
        words = line.split()
        if not words:
            return True
        cmd, args = words[0], words[1:]
        handler = self.COMMANDS.get(cmd)
        try:
            if handler is None:
                raise CommandError(f"unknown command {cmd!r} (h for help)")
            return handler(self, args, line.strip()[len(cmd):].strip()) is not False
        except (CommandError, Llama32Error) as e:  # the session reports it and goes on
            self.say(f"error: {one_line(str(e))}")
            self.failed.append(line.strip())
            return True

    def need_running(self) -> None:
        if self.finished:
            raise CommandError("the forward has finished; p, show, diff, top, dump, list still work; q to leave")

    def cmd_next(self, args, rest):
        count = self.count(args, 1, "n")
        self.need_running()
        for _ in range(count):
            self.say(self.op_line(self.step()))
            if self.finished:
                self.say(*self.end_lines())
                break

    def cmd_continue(self, args, rest):
        self.need_running()
        while not self.finished:
            name = self.step()
            reason = self.stop_reason(name)
            if reason:
                self.say(f"stopped: {reason}", self.op_line(name), *(self.end_lines() if self.finished else ()))
                return
        self.say(self.op_line(self.names[-1]), *self.end_lines())

    def cmd_break(self, args, rest):
        if not args:
            self.say("breakpoints: " + (", ".join(self.breakpoints) or "none") +
                     (f"; bd {g(self.bd_tol)}" if self.bd_tol is not None else ""))
            return
        for pattern in args:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in self.names):
                raise CommandError(f"b {pattern}: the glob matches no activation name (e.g. layers.0.attn.*, "
                                   f"*.mlp.act; `list` shows the names)")
            if pattern not in self.breakpoints:
                self.breakpoints.append(pattern)
        self.say("breakpoints: " + ", ".join(self.breakpoints))

    def cmd_bd(self, args, rest):
        if len(self.sides) < 2:
            raise CommandError("bd compares two backends: start with --backend both")
        if not args:
            self.say(f"bd: {g(self.bd_tol) if self.bd_tol is not None else 'off'}")
            return
        if args[0] == "off":
            self.bd_tol = None
        else:
            try:
                tol = float(args[0])
            except ValueError:
                raise CommandError(f"bd {args[0]}: expected a tolerance (a number >= 0) or 'off'") from None
            if not tol >= 0:
                raise CommandError(f"bd {args[0]}: the tolerance must be >= 0")
            self.bd_tol = tol
        self.say(f"bd: {g(self.bd_tol) if self.bd_tol is not None else 'off'}")

    def cmd_clear(self, args, rest):
        self.breakpoints, self.bd_tol = [], None
        self.say("breakpoints: none")

    def current(self) -> str:
        if self.done == 0:
            raise CommandError(f"nothing has run yet (stopped before {self.names[0]}); n runs the first op")
        return self.names[self.done - 1]

    def lookup(self, name: str | None) -> str:
        if name is None:
            return self.current()
        if name not in self.names:
            raise CommandError(f"unknown activation {name!r} (names look like layers.0.attn.q; `list` shows them)")
        if name not in self.sides[0].values:
            raise CommandError(f"{name} has not run yet (at op {self.done}/{len(self.names)}; "
                               f"try: b {name}; c)")
        return name

    def cmd_print(self, args, rest):
        name = self.lookup(args[0] if args else None)
        for s in self.sides:
            self.say(*stats_lines(s.label, name, s.values[name], s.dtypes[name]))

    def cmd_show(self, args, rest):
        name_text, _, index_text = rest.partition("[")
        name = self.lookup(name_text.strip() or None)
        index = parse_index("[" + index_text) if index_text else ()
        for s in self.sides:
            try:
                part = s.values[name][index]
            except (IndexError, TypeError) as e:
                raise CommandError(f"show {name}: slice does not fit shape {list(s.values[name].shape)} ({e})")
            text = np.array2string(np.asarray(part), precision=5, threshold=64, max_line_width=110)
            self.say(f"{name}{'[' + index_text if index_text else ''} [{s.label}] {list(np.shape(part))}:",
                     *("  " + t for t in text.splitlines()))

    def cmd_diff(self, args, rest):
        if len(self.sides) < 2:
            raise CommandError("diff compares two backends: start with --backend both")
        name = self.lookup(args[0] if args else None)
        d, (a, b) = self.diffs[name], (s.values[name] for s in self.sides)
        fed = "fed the same inputs" if self.lockstep else "each fed its own inputs"
        self.say(f"{name} {list(a.shape)}: {self.sides[1].label} vs {self.sides[0].label} ({fed})",
                 f"  max abs {d.max_abs:.3e}  nmse {d.nmse:.3e}  worst {list(d.worst)}")
        if d.worst:
            self.say(f"  at {list(d.worst)}: {self.sides[0].label} {g(a[d.worst])}  "
                     f"{self.sides[1].label} {g(b[d.worst])}")

    def cmd_top(self, args, rest):
        k = self.count(args, 5, "top")
        if "logits" not in self.sides[0].values:
            raise CommandError(f"no logits yet (at op {self.done}/{len(self.names)}); c runs to the end")
        for s in self.sides:
            p = softmax64(s.values["logits"][-1])  # [V]
            order = np.argsort(-np.nan_to_num(p, nan=-1.0), kind="stable")[:k]
            self.say(f"top {k} [{s.label}]:")
            for rank, t in enumerate(order, 1):
                self.say(f"  {rank}. {int(t)} {self.token_text(int(t))} p {g(p[t])}")

    def cmd_dump(self, args, rest):
        if len(args) != 1:
            raise CommandError("dump FILE: give one file name, e.g. dump step.safetensors")
        tensors = {f"{s.label}/{n}": v for s in self.sides for n, v in s.values.items()}
        meta = {"prompt_ids": json.dumps(self.ids), "position": str(self.position),
                "mode": "single" if len(self.sides) == 1 else "lockstep" if self.lockstep else "inherited"}
        try:
            save_safetensors(check_path(args[0], "dump FILE"), tensors, metadata=meta)
        except OSError as e:
            raise CommandError(f"dump {args[0]}: {e.strerror or e}") from None
        self.say(f"dumped {len(tensors)} tensors to {args[0]}")

    def cmd_where(self, args, rest):
        total = len(self.names)
        if self.done == 0:
            self.say(f"before op 1/{total} ({self.names[0]}); nothing has run yet")
        elif self.finished:
            self.say(f"at op {total}/{total} ({self.names[-1]}); the forward has finished")
        else:
            self.say(f"at op {self.done}/{total} ({self.names[self.done - 1]}); next: {self.names[self.done]}")

    def cmd_list(self, args, rest):
        for i, name in enumerate(self.names):
            if args and not any(fnmatch.fnmatchcase(name, p) for p in args):
                continue
            mark = ">" if i == self.done - 1 else "*" if i < self.done else " "
            self.say(f"{mark} {i + 1:4d} {name}")

    def cmd_help(self, args, rest):
        self.say(HELP)

    def cmd_quit(self, args, rest):
        return False

    @staticmethod
    def count(args, default: int, cmd: str) -> int:
        if not args:
            return default
        if not INT.match(args[0]) or int(args[0]) < 1:
            raise CommandError(f"{cmd} {args[0]}: expected a positive integer")
        return int(args[0])

    COMMANDS = {"n": cmd_next, "next": cmd_next, "c": cmd_continue, "continue": cmd_continue, "b": cmd_break,
                "bd": cmd_bd, "clear": cmd_clear, "p": cmd_print, "show": cmd_show, "diff": cmd_diff,
                "top": cmd_top, "dump": cmd_dump, "where": cmd_where, "list": cmd_list, "h": cmd_help,
                "help": cmd_help, "q": cmd_quit, "quit": cmd_quit}


def describe(engine) -> str:
    """'fp32, cpu' etc.: what an engine says about itself (AccelEngine has dtype/device; RefEngine is NumPy)."""
    dtype = getattr(engine, "dtype_name", None) or getattr(engine, "dtype", None)
    device = getattr(engine, "device", None)
    if dtype is None and device is None:
        return "NumPy fp32"
    return ", ".join(str(x).replace("torch.", "") for x in (dtype, device) if x is not None)
