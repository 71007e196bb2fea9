"""The README's step-debugger transcripts are run as written and must print what the README shows: every word,
integer and layout character exactly, every printed float within fp32 tolerance (OpenBLAS picks different kernels
on different CPUs, so the last printed digit is not portable)."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from refimpl.compare import TOLERANCES

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```\n(\$ llama32 step .*?)```", (ROOT / "README.md").read_text(), re.S)
# a float has a point or an exponent; integers (token ids, op counts, shapes, indices) stay in the text
FLOAT = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?\d+[eE][-+]?\d+")
# fp32 max_rel from refimpl/compare.py, relative to each printed value; the absolute floor covers printed
# differences between backends (max|d| ~4e-6), which are rounding noise of any size below it
RTOL, ATOL = TOLERANCES["fp32"].max_rel, 1e-5


def split_transcript(block: str) -> tuple[list[str], str]:
    """'$ llama32 step ... \\\n   more args' + output lines -> (argv after 'llama32', expected output)."""
    lines = block.splitlines()
    command = lines[0][2:]
    i = 1
    while command.endswith("\\"):
        command = command[:-1] + " " + lines[i].strip()
        i += 1
    return shlex.split(command)[1:], "\n".join(lines[i:]).strip()


def split_floats(text: str) -> tuple[list[str], list[float]]:
    """Each line with its floats replaced by '<f>' (and runs of spaces squeezed: column padding follows the
    width of the printed number), plus the floats in order."""
    lines, values = [], []
    for line in text.splitlines():
        values += [float(m) for m in FLOAT.findall(line)]
        lines.append(re.sub(r" +", " ", FLOAT.sub("<f>", line)))
    return lines, values


def assert_same_transcript(got: str, expected: str) -> None:
    got_lines, got_values = split_floats(got)
    exp_lines, exp_values = split_floats(expected)
    assert got_lines == exp_lines  # all text, integers included, exactly
    bad = [(i, g, e) for i, (g, e) in enumerate(zip(got_values, exp_values)) if abs(g - e) > ATOL + RTOL * abs(e)]
    assert not bad, f"printed floats outside fp32 tolerance (index, got, README): {bad}"


def test_readme_has_step_transcripts():
    assert len(BLOCKS) >= 2


def test_transcript_comparison_checks_text_exactly_and_floats_loosely():
    expected = "op 27/48 layers.1.mlp.gate [1, 192]\n  first [0.385043 -0.4853185]  max|d| 3.815e-06"
    assert_same_transcript("op 27/48 layers.1.mlp.gate [1, 192]\n  first [0.3850428 -0.4853183]  max|d| 3.9e-06",
                           expected)  # the SkylakeX digits
    for wrong in ("op 28/48 layers.1.mlp.gate [1, 192]\n  first [0.385043 -0.4853185]  max|d| 3.815e-06",
                  "op 27/48 layers.1.mlp.up [1, 192]\n  first [0.385043 -0.4853185]  max|d| 3.815e-06",
                  "op 27/48 layers.1.mlp.gate [1, 192]\n  first [0.3851 -0.4853185]  max|d| 3.815e-06",
                  "op 27/48 layers.1.mlp.gate [1, 192]\n  first [0.385043 -0.4853185]  max|d| 3.815e-04"):
        with pytest.raises(AssertionError):
            assert_same_transcript(wrong, expected)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.splitlines()[0][:60])
def test_transcript_runs_as_written(block):
    argv, expected = split_transcript(block)
    if "--backend" in argv and argv[argv.index("--backend") + 1] != "refimpl":
        pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user's shell has it
    out = subprocess.run([sys.executable, "-m", "tools.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert_same_transcript(out.stdout.strip(), expected)
