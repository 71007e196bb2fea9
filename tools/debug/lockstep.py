"""The one lockstep driver: a tested engine's forward advanced beside a reference stream, op by op, and the
per-activation comparison rows it produces. Behind `llama32 golden check` (the reference: recorded activations),
`llama32 diff` (another engine's forward) and `llama32 step` (the first backend's forward).

The reference is any iterator of (name, fp32 NumPy) in refimpl.model.names' order; the tested side is the
engine's `steps()` generator (refimpl.engine_protocol). Feeding the reference's value back (send) after each op
makes every op run on the reference's inputs, so a difference belongs to the op that made it; not feeding it
shows how a difference grows downstream.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from refimpl.compare import TOLERANCES, Comparison, Tolerance, compare
from refimpl.model.names import split_name


def reference_stream(engine, steps) -> Iterator[tuple[str, np.ndarray]]:
    """An engine's forward generator as (name, fp32 NumPy) pairs: the reference side of a lockstep."""
    return ((name, engine.to_numpy(value)) for name, value in steps)


def lockstep(reference: Iterator[tuple[str, np.ndarray]], engine, steps,
             feed_reference: bool = False) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """Drive `steps` (the engine's forward generator) beside `reference`, yielding (name, reference value, the
    engine's value as fp32 NumPy) per op; with `feed_reference` the engine continues from the reference's value
    instead of its own. Both streams must name the same ops in the same order."""
    sent = None
    while True:
        try:
            name, value = steps.send(sent)
        except StopIteration:
            missing = next(reference, (None,))[0]
            if missing is not None:
                raise RuntimeError(f"{engine.backend} engine stopped before {missing!r}")
            return
        ref_name, ref = next(reference, (None, None))
        if ref_name != name:
            raise RuntimeError(f"{engine.backend} engine yielded {name!r} where the reference has {ref_name!r}; "
                               f"both must follow refimpl.model.names.activation_names")
        yield name, ref, engine.to_numpy(value)
        sent = engine.from_numpy(ref, like=value) if feed_reference else None


@dataclass(frozen=True)
class Row:
    step: str
    cmp: Comparison

    @property
    def key(self) -> str:
        return f"{self.step}/{self.cmp.name}"


def dtype_name(value) -> str:
    """'bf16' for a bfloat16/float16 array or tensor, else 'fp32' (what picks the tolerance)."""
    return "bf16" if "float16" in str(getattr(value, "dtype", "")) else "fp32"


def compare_rows(reference: Iterator[tuple[str, np.ndarray]], engine, steps, tol: Tolerance,
                 keep: Callable[[str], bool] = lambda key: True, isolate: bool = False, step: str = "",
                 sink: Callable | None = None) -> list[Row]:
    """`lockstep` with a comparison row per activation whose key ("<step>/<name>") `keep` accepts. With
    `isolate`, every op gets the reference's input, so each row measures one op alone instead of the error so
    far. `sink(step, name, ref, got)` sees every pair (for --dump)."""
    rows = []
    for name, ref, got in lockstep(reference, engine, steps, feed_reference=isolate):
        if keep(f"{step}/{name}" if step else name):
            rows.append(Row(step, compare(name, got, ref, tol)))
        if sink is not None:
            sink(step, name, ref, got)
    return rows


def engine_dtype(engine) -> str:
    """The dtype an engine computes in, read off one token's embedding (the forward stops right there)."""
    steps = engine.steps([0], [0], engine.new_cache(1))
    _, value = next(steps)
    steps.close()
    return dtype_name(value)


# ---------------------------------------------------------------- reporting

def _group(row: Row) -> str:
    layer, kind = split_name(row.cmp.name)
    return f"layer {layer}" if layer is not None else ("embed" if kind == "embed" else "head")


def _verdict(c: Comparison) -> str:
    return "ok" if c.ok else f"FAIL ({c.problem})" if c.problem else "FAIL"


def format_row(row: Row) -> str:
    c = row.cmp
    return (f"{row.key:<34} {str(list(c.shape)):<14} {c.max_abs:>9.2e} {c.max_rel:>9.2e} {c.nmse:>9.2e}  "
            f"{_verdict(c)}")


def first_divergence(rows: list[Row]) -> Row | None:
    return next((r for r in rows if not r.cmp.ok), None)


def report(rows: list[Row], dtype: str, verbose: bool = False) -> list[str]:
    """The table: every row (verbose), or one line per step and layer plus the failing rows; then the verdict."""
    tol = TOLERANCES[dtype]
    header = f"{'name':<34} {'shape':<14} {'max abs':>9} {'max rel':>9} {'NMSE':>9}  verdict"
    lines = [f"tolerance {dtype}: NMSE <= {tol.nmse:.0e} and max rel <= {tol.max_rel:.0e} (max rel = max abs / "
             f"max |reference|)"]
    if verbose:
        lines += [header] + [format_row(r) for r in rows]
    else:
        lines.append(f"{'step':<9} {'group':<9} {'checked':>7} {'failed':>6} {'worst NMSE':>10} {'worst rel':>9}")
        groups: dict[tuple[str, str], list[Row]] = {}
        for r in rows:
            groups.setdefault((r.step, _group(r)), []).append(r)
        for (step, group), rs in groups.items():
            lines.append(f"{step:<9} {group:<9} {len(rs):>7} {sum(not r.cmp.ok for r in rs):>6} "
                         f"{max(r.cmp.nmse for r in rs):>10.2e} {max(r.cmp.max_rel for r in rs):>9.2e}")
        failing = [r for r in rows if not r.cmp.ok]
        if failing:
            lines += ["failing rows:", header] + [format_row(r) for r in failing]
    first = first_divergence(rows)
    if first is None:
        lines.append(f"all {len(rows)} activations within {dtype} tolerance")
    else:
        c = first.cmp
        why = c.problem or (f"max rel {c.max_rel:.2e} (limit {tol.max_rel:.0e}), NMSE {c.nmse:.2e} "
                            f"(limit {tol.nmse:.0e}), worst at index {list(c.worst)}")
        lines.append(f"first divergence: {first.key}: {why}")
    return lines
