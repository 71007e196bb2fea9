"""Top-1 agreement of an engine's logits with the oracle's where the engine rounds more (bf16): a greedy choice may
differ from the oracle's only where the oracle's own top two are a near-tie, within the noise that separates the two
engines' logits. The noise is measured (the row's RMS difference), not assumed, and the gap is the oracle's alone."""
import numpy as np

NOISE = 4.0  # two logits each off by about the RMS difference σ swap when their gap is under ~2.8 σ (√2 σ · 2)


def rms(got, want) -> float:
    return float(np.sqrt(np.mean((np.asarray(got, np.float64) - np.asarray(want, np.float64)) ** 2)))


def near_tie(want, chosen: int, noise: float) -> bool:
    """The oracle's logits [V] rank `chosen` within `noise` of their best."""
    want = np.asarray(want, np.float64)
    return float(want.max() - want[chosen]) <= noise


def unexplained_flips(got, want) -> list[str]:
    """Rows of logits [..., V] whose argmax differs from the oracle's without the oracle's best and the engine's
    choice being a near-tie (gap <= NOISE × the row's RMS difference): one line per such row, empty if none."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    got, want = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
    out = []
    for row, (g, w) in enumerate(zip(got, want)):
        chosen, noise = int(g.argmax()), NOISE * rms(g, w)
        if chosen != int(w.argmax()) and not near_tie(w, chosen, noise):
            out.append(f"row {row}: chose {chosen}, the oracle {int(w.argmax())} by {w.max() - w[chosen]:.3g} "
                       f"(near-tie bound {noise:.3g})")
    return out
