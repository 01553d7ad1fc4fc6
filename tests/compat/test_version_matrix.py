"""The lowest supported transformers: the version matrix's second leg (.ci/version_matrix), run as one
test of the README's test command so that it overlaps the rest of the suite instead of following it.

It copies this test session's venv (hard links), pins transformers to requirements.txt's lower bound
(4.57.6 measured; COLAB_KIT_LOWEST_TRANSFORMERS to choose another) with pip from PyPI, and runs the
quick presets of both notebooks, the exact out-of-memory splits, the same-numbers table and the
perplexity test there.
"""

import os
import subprocess
import sys

import pytest
from project import ROOT

pytestmark = pytest.mark.slow(200)
REQUIRE_ENV = "COLAB_KIT_REQUIRE_MATRIX"  # set by .ci/run: there the matrix must run, not skip


def test_the_lowest_supported_transformers_passes_the_matrix_tests():
    if sys.prefix == sys.base_prefix:
        why = "the version matrix copies the venv the tests run in, and this interpreter is not in a venv"
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{REQUIRE_ENV} is set, but {why}")
        pytest.skip(why)
    env = dict(os.environ, COLAB_KIT_VENV=sys.prefix, PYTHONUNBUFFERED="1")
    env.pop("COLAB_KIT_WARM_FORKSERVER", None)  # this worker's warm forkserver is not the matrix's
    proc = subprocess.run(["bash", str(ROOT / ".ci" / "version_matrix")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-6000:]
    assert "version matrix: transformers 4.57" in said or "COLAB_KIT_LOWEST_TRANSFORMERS" in os.environ, said[-2000:]
    assert " passed" in said and " failed" not in said, said[-3000:]
