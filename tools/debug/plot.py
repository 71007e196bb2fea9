"""Error per layer as a PNG: x the layer index, y NMSE and max rel (log scale), one line per activation kind.

matplotlib is an optional dependency (llama32[plot]); it is imported only when a plot is asked for, and drawn on
an Agg canvas directly (no pyplot, no display, no global backend switch).
"""
from __future__ import annotations

from pathlib import Path

from refimpl.compare import TOLERANCES
from refimpl.errors import Llama32Error
from refimpl.model.names import split_name

# The kinds that tell the story of a layer: norm in, projections, attention, MLP, and the residual out.
KINDS = ("attn_norm", "attn.q", "attn.k_rot", "attn.out", "attn.o_proj", "mlp.act", "mlp.down", "resid_post")


class PlotError(Llama32Error):
    """A plot cannot be drawn (matplotlib missing, unwritable path)."""


def floor(rows, metric: str, limit: float) -> float:
    """Where exact agreement (0, which a log axis cannot show) is drawn: 1000× below the smallest nonzero error
    or the tolerance, so the axis spans only what was measured."""
    nonzero = [getattr(r.cmp, metric) for r in rows if getattr(r.cmp, metric) > 0]
    return min(nonzero + [limit]) / 1e3


def per_layer(rows, metric: str, zero: float) -> dict[str, dict[int, float]]:
    """{kind: {layer: worst value over the steps}} for the kinds in KINDS; 0 drawn at `zero`."""
    out: dict[str, dict[int, float]] = {}
    for row in rows:
        layer, kind = split_name(row.cmp.name)
        if layer is None or kind not in KINDS:
            continue
        value = max(getattr(row.cmp, metric), zero)
        layers = out.setdefault(kind, {})
        layers[layer] = max(layers.get(layer, 0.0), value)
    return {k: out[k] for k in KINDS if k in out}


def require_matplotlib() -> None:
    """Fail before the work whose result would be plotted, not after it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError("--plot needs matplotlib: pip install matplotlib (or pip install -e '.[plot]' from a "
                        "checkout)") from None


def plot_errors(rows, path: str | Path, dtype: str, title: str) -> Path:
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    tol = TOLERANCES[dtype]
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    first = next((r for r in rows if not r.cmp.ok), None)
    for ax, metric, limit, label in zip(fig.subplots(1, 2), ("nmse", "max_rel"), (tol.nmse, tol.max_rel),
                                        ("NMSE  Σ(b−a)² / Σa²", "max rel  max|b−a| / max|a|")):
        zero = floor(rows, metric, limit)
        for kind, layers in per_layer(rows, metric, zero).items():
            xs = sorted(layers)
            ax.plot(xs, [layers[x] for x in xs], marker="o", label=kind)
        ax.axhline(limit, color="red", linestyle="--", linewidth=1, label=f"{dtype} tolerance")
        ax.axhline(zero, color="grey", linestyle=":", linewidth=1, label="exact (0)")
        layer = split_name(first.cmp.name)[0] if first else None
        if layer is not None:
            ax.axvline(layer, color="black", linewidth=0.8, alpha=0.5)
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel(label)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(True, which="major", alpha=0.3)
    fig.axes[1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    where = f"first divergence: {first.key}" if first else "no divergence"
    fig.suptitle(f"{title}   ({where}; worst over steps)", fontsize=10)
    path = Path(path)
    try:
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise PlotError(f"{path}: cannot write the plot ({e.strerror or e})") from None
    return path
