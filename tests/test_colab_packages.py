"""Installing the kit into Colab changes none of Colab's preinstalled packages (constraints-colab.txt,
generated from Colab's published list by scripts/colab_packages.py)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import pytest
from packaging.requirements import Requirement
from project import ROOT

from colab_kit.tasks import versions

_spec = importlib.util.spec_from_file_location("colab_packages", ROOT / "scripts" / "colab_packages.py")
colab_packages = sys.modules["colab_packages"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(colab_packages)

COLAB_LIST = ROOT.parent / "shared" / "data" / "colab" / "pip-freeze.gpu.txt"
COLAB = colab_packages.read_constraints()


def notebook_extras() -> list[str]:
    """What the notebooks' install cells add in Colab beyond the kit: the RNA notebook's multimolecule, and
    the LoRA notebook's bitsandbytes (on a GPU runtime, for 4-bit weights)."""
    return [*versions.multimolecule_install(COLAB.version), *lora_install_cell_adds()]


def lora_install_cell_adds() -> list[str]:
    """The packages the LoRA notebook's install cell names besides the kit (read from the cell itself)."""
    import json
    import re

    cells = json.loads((ROOT / "notebooks" / "lora_finetune.ipynb").read_text())["cells"]
    install = next("".join(c["source"]) for c in cells if c["cell_type"] == "code" and "pip" in "".join(c["source"]))
    return re.findall(r'wanted\.append\("([^"]+)"\)', install)


@pytest.mark.skipif(not COLAB_LIST.is_file(), reason=f"Colab's published list is not at {COLAB_LIST}")
def test_the_constraints_are_generated_from_colabs_published_list():
    assert colab_packages.generate(COLAB_LIST.read_text()) == colab_packages.CONSTRAINTS.read_text(), (
        "constraints-colab.txt differs from what scripts/colab_packages.py generates: regenerate it")


def test_the_constraints_hold_colabs_versions_of_what_the_kit_touches():
    assert COLAB.python.startswith("3.13.") and COLAB.glibc == "2.35"
    assert COLAB.version("torch") == "2.11.0+cu128" and "torch" in COLAB.held  # a CUDA build: not on PyPI
    for name, version in {"transformers": "5.15.0", "ipywidgets": "7.7.1", "ipykernel": "6.17.1",
                          "jupyter_client": "7.4.9", "huggingface-hub": "1.27.0", "psutil": "5.9.5"}.items():
        assert COLAB.version(name) == version, name


def test_every_requirement_of_the_kit_is_preinstalled_in_colab_and_satisfied_by_its_torch():
    names = colab_packages.requirement_names(ROOT / "requirements.txt")
    assert "torch" in names and "transformers" in names
    assert colab_packages.missing_from_colab(names, COLAB) == []
    assert colab_packages.missing_from_colab([*names, "tqdm-joblib"], COLAB) == ["tqdm-joblib"]
    torch = next(Requirement(line.split("#")[0]) for line in (ROOT / "requirements.txt").read_text().splitlines()
                 if line.startswith("torch"))
    assert torch.specifier.contains(COLAB.version("torch"))


def test_a_change_to_colabs_cuda_stack_or_its_own_packages_counts_as_a_change():
    def item(name, version):
        return {"metadata": {"name": name, "version": version}}

    verdict = colab_packages.judge([item("colab-kit", "0.3.0"), item("transformers", "5.15.0"), item("triton", "3.7.0"),
                                    item("google-colab", "1.0.0"), item("nvidia-cublas", "13.1.0.3"),
                                    item("jedi", "0.20.1")], COLAB, ["transformers"])
    assert verdict.changed == ["google-colab (from an address) -> 1.0.0", "triton 3.6.0 -> 3.7.0"], verdict.changed
    assert verdict.unchanged == ["transformers 5.15.0"]
    assert verdict.added == ["jedi 0.20.1", "nvidia-cublas 13.1.0.3"] and not verdict.ok


def test_the_notebooks_install_cells_add_multimolecule_and_bitsandbytes_in_colab():
    assert notebook_extras() == ["multimolecule", "bitsandbytes"]  # Colab's transformers 5.15 is new enough


@pytest.mark.slow(60)
@pytest.mark.skipif(not os.environ.get("COLAB_KIT_FULL_E2E"), reason=(
    "pip resolving the kit into Colab's whole package set, about 80 s: .ci/run runs it in every run "
    "(COLAB_KIT_FULL_E2E=1) and installs that set in its Colab matrix; the test command checks a raised "
    "requirement against Colab's versions (the test below)"))
def test_installing_the_kit_and_the_notebooks_additions_into_colab_changes_nothing():
    verdict = colab_packages.check(extras=notebook_extras())
    print(verdict.summary())
    assert verdict.ok, verdict.summary()
    assert verdict.kit.startswith("colab-kit ")
    assert {"transformers 5.15.0", "torch 2.11.0+cu128", "ipywidgets 7.7.1", "numpy 2.1.3"} <= set(verdict.unchanged)
    assert any(item.startswith("multimolecule ") for item in verdict.added)
    assert any(item.startswith("bitsandbytes ") for item in verdict.added)


@pytest.mark.slow(30)
def test_a_requirement_raised_past_colabs_version_fails_the_check(tmp_path):
    for name in ("pyproject.toml", "README.md", "requirements-test.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "colab_kit").mkdir()
    (tmp_path / "colab_kit" / "__init__.py").write_text("")
    requirements = (ROOT / "requirements.txt").read_text()
    assert "transformers>=4.57\n" in requirements
    (tmp_path / "requirements.txt").write_text(requirements.replace("transformers>=4.57\n", "transformers>=5.16\n"))
    with pytest.raises(colab_packages.Conflict) as raised:
        colab_packages.check(tmp_path)
    assert "transformers>=5.16" in str(raised.value) and "transformers==5.15.0" in str(raised.value), raised.value
