"""The project's own files keep their promises: README commands, CI, requirements, API surface."""

import importlib
import pkgutil
import re
import subprocess
import sys

import tomllib
from project import ROOT  # noqa: E402

import colab_kit

README = (ROOT / "README.md").read_text()


def readme_commands() -> list[str]:
    block = README.split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_readme_first_screen_has_exactly_two_setup_commands():
    first_screen = "\n".join(README.splitlines()[:30])
    assert "```bash" in first_screen
    commands = readme_commands()
    assert len(commands) == 2
    assert commands[0].endswith("-m colab_kit demo") or " run notebooks/" in commands[0]
    assert commands[1] == "scripts/test"
    # The script is the whole set-up (fuse3, the venv, the requirements), then pytest with its arguments.
    script = (ROOT / "scripts" / "test").read_text().splitlines()
    assert script[-1] == 'exec .venv/bin/python -m pytest -q "$@"'
    assert '.venv/bin/pip install -q torch==2.13.0 -e ".[test]"' in script


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_commands()[1] in [line.strip() for line in ci.splitlines()]


def test_requirements_are_lower_bounds_only_and_colab_friendly():
    lines = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    reqs = [line for line in lines if line]
    assert reqs
    for req in reqs:
        assert re.fullmatch(r"[A-Za-z0-9_.\-]+>=[0-9.]+", req), f"{req}: use a lower bound only"
    widgets = [r for r in reqs if r.startswith("ipywidgets")]
    assert widgets == ["ipywidgets>=7.7"]  # Colab ships 7.7.1: never require 8


def test_repository_url_is_kept_in_one_place_and_used_by_the_readme():
    url = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    assert f"git+{url}" in README
    for notebook in (ROOT / "notebooks").glob("*.ipynb"):
        text = notebook.read_text()
        if "pip install" in text and "git+" in text:
            assert f"git+{url}" in text, notebook.name


def test_public_api_is_exactly_the_exported_names():
    expected = {
        "start_run", "Run", "CheckpointStore", "drive_check", "is_oom_error", "free_memory", "MicroBatcher", "OutOfMemoryError",
        "Gauges", "plot_history", "memory_args", "preflight", "read_events", "detect_runtime", "in_colab", "in_kaggle", "in_notebook",
        "ColabKitError", "ColabKitWarning", "DriveError", "LeaseHeldError", "LeaseLostError", "ResumeMismatchError",
        "CheckpointError", "RankFailedError", "TimeLimitReached", "DriveApi", "plan_memory", "MemoryPlan",
    }
    assert set(colab_kit.__all__) == expected
    import types

    public = {name for name, value in vars(colab_kit).items()
              if not name.startswith("_") and not isinstance(value, types.ModuleType)}
    assert public - {"annotations"} == expected


def test_every_public_module_declares_all():
    modules = [info for info in pkgutil.walk_packages(colab_kit.__path__, "colab_kit.")
               if not info.name.rsplit(".", 1)[1].startswith("_") and not info.ispkg]
    assert len(modules) >= 40
    for info in modules:
        module = importlib.import_module(info.name)
        assert hasattr(module, "__all__"), f"{info.name} has no __all__"
        for name in module.__all__:
            assert hasattr(module, name), f"{info.name}.__all__ names missing {name}"


def test_module_paths_of_notebooks_saved_before_the_rooms_still_import():
    # The RNA notebook's install cell imported colab_kit.versions; notebooks imported colab_kit.rna's names
    # and called ck.recipes.freeze_layers.
    from colab_kit.rna import nucleotide_tokenizer  # noqa: F401
    from colab_kit.text import tokenize_and_group  # noqa: F401
    from colab_kit.versions import check_multimolecule, multimolecule_install  # noqa: F401

    assert callable(colab_kit.recipes.freeze_layers) and colab_kit.rna.resolve_settings is not None


def test_import_is_light_and_needs_no_gpu_widgets_or_colab():
    code = ("import sys, colab_kit\n"
            "heavy = [m for m in ('torch', 'transformers', 'ipywidgets', 'google.colab', 'pynvml') if m in sys.modules]\n"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
