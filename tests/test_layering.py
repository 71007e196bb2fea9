"""Dependencies point one way: tools -> accel -> refimpl. refimpl never imports torch, accel or tools."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"refimpl": {"torch", "triton", "accel", "tools"}, "accel": {"tools"}}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package):
    offenders = {str(p.relative_to(ROOT)): sorted(imported_modules(p) & FORBIDDEN[package])
                 for p in sorted((ROOT / package).rglob("*.py"))}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_refimpl_runs_without_torch_loaded():
    code = ("import sys, refimpl.formats.checkpoint, refimpl.generate, refimpl.formats.gguf_loader,"
            " refimpl.formats.lora, refimpl.compare;"
            "import refimpl.generate_vision, refimpl.formats.vision_checkpoint;"
            "bad = [m for m in ('torch', 'triton', 'accel', 'tools') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
