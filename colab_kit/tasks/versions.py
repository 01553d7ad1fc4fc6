"""Version needs that pip does not enforce: said before an import fails with a riddle.

multimolecule (RNA-FM for the RNA notebook's `full` preset) imports names that appeared in
transformers 5.2 but does not declare it, so `pip install multimolecule` leaves an older
transformers in place, and `from multimolecule import ...` then fails: on 4.57.6 with
"cannot import name 'initialization' from 'transformers'", on 5.0.0 and 5.1.0 with "cannot
import name 'merge_with_config_defaults'" (measured on multimolecule 0.2.2; 5.2.0 works).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

from ..errors import ColabKitError

__all__ = ["MULTIMOLECULE_NEEDS", "multimolecule_install", "check_multimolecule"]

MULTIMOLECULE_NEEDS = "transformers>=5.2"
_MINIMUM = (5, 2)


def _installed(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _too_old(installed: str | None) -> bool:
    from packaging.version import Version

    return installed is None or Version(installed).release[:2] < _MINIMUM


def multimolecule_install(installed: Callable[[str], str | None] | None = None) -> list[str]:
    """The pip requirements that make `from multimolecule import ...` work here ([] when it does).
    `installed` says a package's version (None: not installed); default: this runtime's."""
    installed = installed or _installed
    wanted = [] if installed("multimolecule") else ["multimolecule"]
    if _too_old(installed("transformers")):
        wanted.append(MULTIMOLECULE_NEEDS)
    return wanted


def check_multimolecule(transformers_version: str | None = None) -> None:
    """Stop with the command to run when transformers is too old for multimolecule.

    Raises:
        ColabKitError: transformers older than 5.2 (the version found, and what to run).
    """
    found = transformers_version or _installed("transformers")
    if _too_old(found):
        raise ColabKitError(
            f"RNA-FM comes from multimolecule, which needs {MULTIMOLECULE_NEEDS}; this runtime has transformers "
            f"{found}. Run: pip install -U \"{MULTIMOLECULE_NEEDS}\" multimolecule, then restart the runtime "
            f"(Runtime -> Restart session) and run all cells again")
