"""versions.py: multimolecule's undeclared need for transformers >= 5.2, and the RNA notebook's install cell."""

import json
import subprocess
import sys
import types

import pytest
from project import NOTEBOOKS

import colab_kit as ck
from colab_kit.tasks import versions

RNA = NOTEBOOKS / "rna_bert_classification.ipynb"


@pytest.mark.parametrize("found", ["4.57.6", "5.0.0", "5.1.0"])
def test_too_old_a_transformers_stops_with_the_command_to_run(found):
    with pytest.raises(ck.ColabKitError, match=rf'transformers {found}\. Run: pip install -U "transformers>=5.2"'):
        versions.check_multimolecule(found)


@pytest.mark.parametrize("found", ["5.2.0", "5.24.0", "6.0.0.dev0"])
def test_a_recent_enough_transformers_passes(found):
    versions.check_multimolecule(found)


@pytest.mark.parametrize("installed, wanted", [
    ({"transformers": "4.57.6"}, ["multimolecule", "transformers>=5.2"]),  # Colab before transformers 5
    ({"transformers": "5.24.0"}, ["multimolecule"]),
    ({"transformers": "5.1.0", "multimolecule": "0.2.2"}, ["transformers>=5.2"]),
    ({"transformers": "5.2.0", "multimolecule": "0.2.2"}, []),
])
def test_the_install_brings_what_is_missing(monkeypatch, installed, wanted):
    monkeypatch.setattr(versions, "_installed", installed.get)
    assert versions.multimolecule_install() == wanted


def test_the_notebooks_install_cell_upgrades_transformers_with_multimolecule(monkeypatch):
    cells = json.loads(RNA.read_text())["cells"]
    source = next("".join(c["source"]) for c in cells if c["cell_type"] == "code" and "pip" in "".join(c["source"]))
    calls = []
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr(subprocess, "check_call", lambda cmd: calls.append(cmd[cmd.index("-q") + 1:]))
    monkeypatch.setattr(versions, "_installed", {"transformers": "4.57.6"}.get)
    exec(compile(source, "install cell", "exec"), {})
    assert calls == [["multimolecule", "transformers>=5.2"]]  # the kit is importable here: not reinstalled
