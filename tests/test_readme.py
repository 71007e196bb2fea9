"""The README and docs/ as a user reads them: the step-debugger transcripts are run as written and must print what
they show (every word, integer and layout character exactly, every printed float within fp32 tolerance: OpenBLAS
picks different kernels on different CPUs, so the last printed digit is not portable); every `llama32` command and
benchmark they cite exists with the options they give it; every docs/ link resolves; the README stays the way in."""
import contextlib
import fnmatch
import importlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import click
import pytest

from refimpl.compare import TOLERANCES

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = {p.name: p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}
PAGES = {"README.md": README, **{f"docs/{name}": text for name, text in DOCS.items()}}


def transcripts(text: str) -> list[str]:
    """The fenced blocks that start with `$ llama32 step`, indented (inside a list item) or not, dedented."""
    found = re.findall(r"^( *)```\n(\1\$ llama32 step .*?)^\1```", text, re.S | re.M)
    return [textwrap.dedent(block) for _, block in found]


BLOCKS = [block for text in PAGES.values() for block in transcripts(text)]
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


def test_readme_and_debugging_page_have_step_transcripts():
    assert len(transcripts(README)) >= 1 and len(transcripts(DOCS["debugging.md"])) >= 2
    assert any("--backend both" in b and "--inject" in b for b in transcripts(DOCS["debugging.md"]))  # lockstep


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


# ---- the commands the pages cite ----

def cited(text: str) -> list[str]:
    """Command lines a page gives: inline code spans and lines of fenced blocks that run `llama32 ...` or
    `python3 -m tools.bench...` (after a `&&` or a `|`; `\\` continuations joined)."""
    commands = re.findall(r"`(llama32 [^`]+|python3? -m tools\.bench[^`]*)`", text)
    for _, block in re.findall(r"^( *)```(?:bash)?\n(.*?)^\1```", text, re.S | re.M):
        block = textwrap.dedent(block)
        if block.lstrip().startswith("$"):
            continue  # a transcript: run above
        # a synopsis continues on indented lines; a shell line with a trailing backslash
        for line in re.sub(r"\\?\n(?=\s)", " ", block).splitlines():
            for part in re.split(r"&&|\s\|\s", line):
                part = part.strip()
                if part.startswith(("llama32 ", "python3 -m tools.bench", "python -m tools.bench")):
                    commands.append(part)
    return commands


CITED = [(page, c) for page, text in PAGES.items() for c in cited(text)]
GLOBAL = {"--help", "-h", "--debug", "--version"}


def options_of(command: click.Command) -> set[str]:
    return {o for p in command.params for o in [*p.opts, *p.secondary_opts]} | GLOBAL


def test_pages_cite_commands():
    assert len([c for page, c in CITED if page == "README.md" and c.startswith("llama32 ")]) >= 10
    assert {c.split()[1] for _, c in CITED if c.startswith("llama32 ")} >= {
        "generate", "chat", "fetch", "quantize", "finetune", "lora", "diff", "step", "golden", "bench"}


@pytest.mark.parametrize("page, command", [pc for pc in CITED if pc[1].startswith("llama32 ")],
                         ids=lambda x: x[:70])
def test_cited_llama32_commands_exist_with_their_options(page, command):
    from tools.cli import main
    words = command.split()[1:]
    cmd, path = main, ["llama32"]
    while isinstance(cmd, click.Group) and words and not words[0].startswith("-"):
        assert words[0] in cmd.commands, f"{page}: `{command}`: {' '.join(path)} has no command {words[0]!r}"
        cmd, path = cmd.commands[words[0]], path + [words[0]]
        words = words[1:]
    unknown = set(re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", " ".join(words))) - options_of(cmd)
    assert not unknown, f"{page}: `{command}`: {' '.join(path)} has no option {sorted(unknown)}"


@pytest.mark.parametrize("page, command", [pc for pc in CITED if pc[1].startswith("python")], ids=lambda x: x[:70])
def test_cited_benchmarks_exist_with_their_options(page, command):
    pytest.importorskip("torch")
    module = command.split()[2]
    assert importlib.util.find_spec(module), f"{page}: `{command}`: no module {module}"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    given = set(re.findall(r"(?<![\w-])--[a-zA-Z][\w-]*", command.split(module, 1)[1]))
    unknown = {o for o in given if o not in out.getvalue()}
    assert not unknown, f"{page}: `{command}`: {module} has no option {sorted(unknown)}"


# ---- the pages themselves ----

def test_readme_is_the_way_in():
    """At most 250 lines; the install line and the test command as CI runs them; every docs/ page linked."""
    assert len(README.splitlines()) <= 250
    assert 'pip install -e . && llama32 generate "What is the capital of France?"' in README
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = re.search(r"python3 -m pytest -q -n 2 tests", README)
    assert test_command and test_command.group(0) in ci
    assert "-n 6" in README  # the GPU suite's worker count on an 80 GB card
    assert {f"docs/{name}" for name in DOCS} <= set(re.findall(r"\]\((docs/[\w.-]+\.md)\)", README))


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve(page):
    base = ROOT if page == "README.md" else ROOT / "docs"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", PAGES[page]):
        if not re.match(r"https?://", target):
            assert (base / target).exists(), f"{page}: link to {target} does not resolve"


def test_cited_files_exist():
    """Paths the pages name in code spans (a file or folder of the repository) are there."""
    for page, text in PAGES.items():
        for path in re.findall(r"`((?:refimpl|accel|tools|tests|golden|docs)/[\w./-]*\w)`", text):
            if "*" not in path and "<" not in path:
                assert (ROOT / path).exists(), f"{page}: {path} does not exist"


def test_results_kept_are_the_ones_the_docs_cite():
    """tools/bench/results/ holds the records the pages cite, and only those."""
    results = ROOT / "tools" / "bench" / "results"
    cited = {name for text in PAGES.values()
             for name in re.findall(r"\b(?:h100|h200|cpu2core|cpu)-20\d\d-[\w.*-]+\.json", text)}
    kept = {p.name for p in results.glob("*.json")}
    matched = {name: {k for k in kept if fnmatch.fnmatch(k, name)} for name in cited}
    assert all(matched.values()), [name for name, files in matched.items() if not files]
    assert kept == set().union(*matched.values())


def test_no_session_wording_anywhere():
    """How the work was organised is git's business: no numbered or dated
    'session' in code, docs or data."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    pattern = re.compile(r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+th|this|"
                         r"that|earlier|previous|next) session", re.I)
    hits = []
    for name in files:
        path = ROOT / name
        if path.suffix in {".py", ".md", ".txt", ".toml", ".json", ".cfg", ".yml", ".yaml"} and path.is_file():
            hits += [f"{name}: {m.group(0)}" for m in pattern.finditer(path.read_text(errors="replace"))]
    assert not hits, hits[:10]
