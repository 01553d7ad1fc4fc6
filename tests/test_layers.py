"""The kit's rooms: subpackages that are layers, imports that only point down, no circles, small modules.

The layers and the no-circles rule are import-linter contracts in pyproject.toml; `lint-imports`
checks them here, and a copy of the package with one import pointing up shows that it would fail.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from project import ROOT

import colab_kit

PACKAGE = Path(colab_kit.__file__).parent
LINT = Path(sys.executable).with_name("lint-imports")


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(cwd))  # this copy of colab_kit, ahead of the installed one
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def lint():
    if not LINT.exists():
        pytest.fail("lint-imports is missing: install the test requirements (import-linter)")
    return lint_imports


def test_imports_point_only_down_and_never_round_a_circle(lint):
    out = lint(ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Contracts: 2 kept, 0 broken." in out.stdout


def test_an_upward_import_breaks_the_layers_contract(lint, tmp_path):
    shutil.copytree(PACKAGE, tmp_path / "colab_kit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    manifest = tmp_path / "colab_kit" / "checkpoints" / "manifest.py"
    manifest.write_text(manifest.read_text() + "\nfrom ..run import start  # noqa: E402  (pointing up, on purpose)\n")
    out = lint(tmp_path)
    assert out.returncode != 0
    assert "each layer of colab_kit imports only from the layers below it BROKEN" in out.stdout
    assert "colab_kit.checkpoints is not allowed to import colab_kit.run" in out.stdout


def test_a_circle_inside_a_room_breaks_the_acyclic_contract(lint, tmp_path):
    shutil.copytree(PACKAGE, tmp_path / "colab_kit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    storage = tmp_path / "colab_kit" / "checkpoints" / "storage.py"  # manifest imports storage: now both ways
    storage.write_text(storage.read_text() + "\nfrom . import manifest  # noqa: E402  (a circle, on purpose)\n")
    out = lint(tmp_path)
    assert out.returncode != 0 and "no import circles among the modules of any room BROKEN" in out.stdout


def test_the_contract_lists_every_room_and_the_top_level_stays_small():
    import tomllib

    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    listed = {name.strip() for layer in contract["layers"] for name in layer.split("|")}
    entries = {p.stem for p in PACKAGE.iterdir() if p.name != "__init__.py" and p.name != "__pycache__"}
    assert listed == entries and contract["exhaustive"] is True
    assert len(entries) <= 18, sorted(entries)  # 14 rooms (run/ split in four, report/: round 6) and the base's files


def test_no_module_passes_350_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 350}
    assert not long, long


def test_no_room_holds_more_than_20_modules():
    crowded = {room.name: n for room in PACKAGE.iterdir() if room.is_dir() and room.name != "__pycache__"
               if (n := len([p for p in room.glob("*.py") if p.name != "__init__.py"])) > 20}
    assert not crowded, crowded
