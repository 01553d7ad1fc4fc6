"""The README's test command sets up a fresh machine (issue 45): scripts/test installs fuse3 where it can, says
why where it cannot, and nothing that needs no FUSE imports it (the simulator, the emulated Drive API)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from project import ROOT

SCRIPT = ROOT / "scripts" / "test"


def _without_libfuse(tmp_path: Path) -> dict:
    """An environment whose `import mfusepy` fails as it does where libfuse is absent."""
    stub = tmp_path / "no_libfuse"
    stub.mkdir()
    (stub / "mfusepy.py").write_text("raise OSError('Unable to find libfuse')  # as mfusepy says without libfuse\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COLAB_KIT_REQUIRE"))}
    env["PYTHONPATH"] = os.pathsep.join([str(stub), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def test_the_whole_suite_collects_where_libfuse_cannot_load(tmp_path):
    # 20 errors in 5 modules on a machine without fuse3 before issue 45: the simulator's among them.
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider",
                           "tests"], cwd=ROOT, env=_without_libfuse(tmp_path), capture_output=True, text=True,
                          timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "error" not in out.splitlines()[-1].lower(), out[-4000:]
    for module in ("tests/drive/test_simulation.py", "tests/drive/test_drive_api.py", "tests/drive/test_cloud_e2e.py"):
        assert module in out


def test_the_simulator_and_the_drive_api_run_where_libfuse_cannot_load(tmp_path):
    tests = ["tests/drive/test_simulation.py::test_no_invariant_breaks_with_the_run_on_a_faulty_hub[0]",
             "tests/drive/test_drive_api.py"]
    env = _without_libfuse(tmp_path) | {"COLAB_KIT_HUB_SIMULATIONS": "100"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *tests], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert " passed" in out and "skipped" not in out.splitlines()[-1], out[-2000:]


def _plan(tmp_path: Path, *, uid: int, apt: bool, fuse: bool) -> str:
    """What scripts/test --plan says on a machine with this user, apt-get and fusermount3 (stand-ins on PATH)."""
    bin_dir = tmp_path / f"bin-{uid}-{apt}-{fuse}"
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))
    (bin_dir / "python3").symlink_to(sys.executable)  # not a pyenv shim, which needs pyenv on PATH
    stubs = {"id": f"echo {uid}"} | ({"apt-get": "exit 0"} if apt else {}) | ({"fusermount3": "exit 0"} if fuse else {})
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    done = subprocess.run(["/bin/bash", str(SCRIPT), "--plan"], env={"PATH": str(bin_dir)}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_test_command_installs_fuse3_as_root_where_apt_is_and_says_why_not_elsewhere(tmp_path):
    assert _plan(tmp_path, uid=0, apt=True, fuse=False) == "fuse3: install"
    assert _plan(tmp_path, uid=1000, apt=True, fuse=False) == "fuse3: absent, not root"
    assert _plan(tmp_path, uid=0, apt=False, fuse=False) == "fuse3: absent, no apt-get"


def test_the_test_command_counts_fuse3_present_only_with_its_library(tmp_path):
    import ctypes.util

    # fusermount3 alone is not enough: mfusepy loads libfuse3, so where it is missing the plan installs it.
    expected = "fuse3: present" if ctypes.util.find_library("fuse3") else "fuse3: install"
    assert _plan(tmp_path, uid=0, apt=True, fuse=True) == expected

