"""The wheel a user installs holds every module: build it, install it apart, import everything.

The suite itself runs the editable install, which finds any package in the checkout whether setup.py
lists it or not; a wheel holds only what setup.py packages (megatron_sp.moe was once missing from
it). So: copy the sources (setup.py, pyproject.toml, megatron_sp/, models/, data/) to a temporary
folder, `pip wheel` them there without build isolation (offline, the setuptools at hand), install the
wheel with `pip install --target` into another folder, and import every module from a third folder
with the editable install's finder taken off sys.meta_path: each module must come from the wheel.
"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = ("setup.py", "pyproject.toml", "README.md", "megatron_sp", "models", "data")


def _modules_in_checkout():
    """Every module the checkout ships, by its installed name (megatron_sp.models.gpt, ...)."""
    names = set()
    for folder, prefix in (("megatron_sp", "megatron_sp"), ("models", "megatron_sp.models"),
                           ("data", "megatron_sp.data")):
        for root, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            rel = os.path.relpath(root, os.path.join(ROOT, folder))
            package = prefix if rel == "." else prefix + "." + rel.replace(os.sep, ".")
            if "__init__.py" not in files:
                continue
            for name in files:
                if name.endswith(".py"):
                    names.add(package if name == "__init__.py" else f"{package}.{name[:-3]}")
    return sorted(names)


@pytest.mark.timeout(240)
def test_wheel_installs_and_imports_every_module(tmp_path):
    src, wheels, target, elsewhere = (tmp_path / n for n in ("src", "wheels", "site", "elsewhere"))
    src.mkdir()
    elsewhere.mkdir()
    for name in SOURCES:
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), "."],
                   cwd=src, check=True, capture_output=True, timeout=180)
    (wheel,) = list(wheels.glob("megatron_sp-*.whl"))
    subprocess.run(pip + ["install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=180)

    modules = _modules_in_checkout()
    assert "megatron_sp.moe.dispatch" in modules and "megatron_sp.models.gpt" in modules
    script = textwrap.dedent(f"""
        import importlib, sys
        # The editable install's finder would serve any module from the checkout: take it away.
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
        sys.path.insert(0, {str(target)!r})
        bad = []
        for name in {modules!r}:
            try:
                module = importlib.import_module(name)
            except Exception as exc:
                bad.append(f"{{name}}: {{type(exc).__name__}}: {{exc}}")
                continue
            if not module.__file__.startswith({str(target)!r}):
                bad.append(f"{{name}}: imported from {{module.__file__}}, not the wheel")
        print("\\n".join(bad))
        sys.exit(1 if bad else 0)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"modules not importable from the wheel:\n{proc.stdout}{proc.stderr}"
