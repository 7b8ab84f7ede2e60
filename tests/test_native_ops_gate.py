"""bench/native_ops_gate.py on each pin's real `sglang/srt/layers/utils/multi_platform.py`: the
gate becomes the first statement of MultiPlatformOp.dispatch_forward, returns forward_native only
when DDTREE_NATIVE_OPS=1, and is applied once. The patched dispatch_forward is compiled from the
file and called on an object that stands in for an op (the real class needs a device platform)."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("native_ops_gate", ROOT / "bench" / "native_ops_gate.py")
gate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gate)
from ddtree_deploy.deploy.build import pins


def _multi_platform(version: str) -> Path:
    site = pins.sglang_site(version)
    if site is None:  # the venv's own sglang is the pin's
        spec = importlib.util.find_spec("sglang")
        assert spec is not None and spec.origin
        site = Path(spec.origin).parent.parent
    path = site / "sglang" / "srt" / "layers" / "utils" / "multi_platform.py"
    if not path.exists():
        pytest.skip(f"sglang {version} is not installed here ({path})")
    return path


@pytest.mark.parametrize("version", ["0.5.13.post1", "0.5.16"])
def test_the_gate_on_the_pins_real_dispatch(version, tmp_path, monkeypatch):
    src = _multi_platform(version).read_text()
    patched = gate.gate(src)
    assert gate.gate(patched) == patched  # once only
    tree = ast.parse(patched)
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "dispatch_forward")
    first = fn.body[0]
    assert isinstance(first, ast.If) and "DDTREE_NATIVE_OPS" in ast.unparse(first.test)
    # the patched function alone, its module globals replaced by what the original path needs
    ns: dict = {"current_platform": type("P", (), {"is_out_of_tree": staticmethod(lambda: False)})(),
                "_is_cuda": True, "_is_hip": False, "_is_cpu": False, "_is_cpu_amx_available": False,
                "_is_npu": False, "_is_xpu": False, "_is_musa": False}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "multi_platform.py", "exec"), ns)  # noqa: S102  the pin's own code

    class Op:
        def forward_native(self):
            return "native"

        def forward_cuda(self):
            return "cuda"

    op = Op()
    monkeypatch.delenv("DDTREE_NATIVE_OPS", raising=False)
    assert ns["dispatch_forward"](op)() == "cuda"  # unchanged without the switch
    monkeypatch.setenv("DDTREE_NATIVE_OPS", "1")
    assert ns["dispatch_forward"](op)() == "native"
    # the command line writes the file in place; a file without the method is refused unchanged
    copy = tmp_path / "multi_platform.py"
    copy.write_text(src)
    assert subprocess.run([sys.executable, str(ROOT / "bench" / "native_ops_gate.py"), str(copy)], check=False).returncode == 0
    assert copy.read_text() == patched
    other = tmp_path / "other.py"
    other.write_text("x = 1\n")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "native_ops_gate.py"), str(other)],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 1 and "expected one `def dispatch_forward(self):`" in r.stderr
    assert other.read_text() == "x = 1\n"
