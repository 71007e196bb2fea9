"""The README's step-debugger transcripts are run as written and must print exactly what the README shows."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```\n(\$ llama32 step .*?)```", (ROOT / "README.md").read_text(), re.S)


def split_transcript(block: str) -> tuple[list[str], str]:
    """'$ llama32 step ... \\\n   more args' + output lines -> (argv after 'llama32', expected output)."""
    lines = block.splitlines()
    command = lines[0][2:]
    i = 1
    while command.endswith("\\"):
        command = command[:-1] + " " + lines[i].strip()
        i += 1
    return shlex.split(command)[1:], "\n".join(lines[i:]).strip()


def test_readme_has_step_transcripts():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.splitlines()[0][:60])
def test_transcript_runs_as_written(block):
    argv, expected = split_transcript(block)
    if "--backend" in argv and argv[argv.index("--backend") + 1] != "refimpl":
        pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user's shell has it
    out = subprocess.run([sys.executable, "-m", "tools.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected
