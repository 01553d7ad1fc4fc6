"""The Hugging Face token, found in the foreground where the user keeps it.

`huggingface_hub.get_token()` finds it as every Hugging Face library in the notebook does, in the client's
order (huggingface_hub 2.x: `$HF_TOKEN` or the older `$HUGGING_FACE_HUB_TOKEN`, the token saved by
`hf auth login` / `huggingface_hub.login()`, Colab's secrets: the key icon, `google.colab.userdata`, asked once
a session). The kit adds only what the client does not know: Kaggle's secrets (Add-ons -> Secrets,
`kaggle_secrets`), before a saved login. Colab answers `userdata.get` only from a cell the user runs (it asks for notebook access there), never
from a background thread, so the token is found once, on the main thread, by `start_run`, and handed to the
uploader.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ..errors import ColabKitError

__all__ = ["find_token", "TOKEN_NAME"]

TOKEN_NAME = "HF_TOKEN"  # the secret's name in Colab and Kaggle, and the environment variable


def _from_kaggle() -> str | None:
    if not os.environ.get("KAGGLE_KERNEL_RUN_TYPE"):
        return None
    try:
        from kaggle_secrets import UserSecretsClient
    except ImportError:
        return None
    try:
        return UserSecretsClient().get_secret(TOKEN_NAME) or None
    except Exception:  # noqa: BLE001 - no such secret, or not attached to this notebook
        return None


def _source(token: str) -> str:
    """Where `get_token()`'s answer came from, for the one line that says it."""
    from huggingface_hub import constants

    if token in (os.environ.get(TOKEN_NAME, "").strip(), os.environ.get("HUGGING_FACE_HUB_TOKEN", "").strip()):
        return "$HF_TOKEN"
    try:
        if Path(constants.HF_TOKEN_PATH).read_text().strip() == token:
            return "a saved login"
    except OSError:
        pass
    return "Colab secrets"


def find_token(token: str | None = None) -> tuple[str, str]:
    """(the token, where it was found). `token` given wins.

    Raises:
        ColabKitError: called off the main thread (Colab's secrets answer only there), or no token anywhere,
            with where to put one.
    """
    if token:
        return token, "given"
    if threading.current_thread() is not threading.main_thread():
        raise ColabKitError("the Hugging Face token is looked for on the notebook's main thread only (Colab's "
                            "secrets answer only there): call ck.start_run from a cell")
    from huggingface_hub import get_token

    found = get_token()
    source = _source(found) if found else None
    if found and source != "a saved login":
        return found, source
    kaggle = _from_kaggle()  # a notebook's own secret before a login saved on the machine
    if kaggle:
        return kaggle, "Kaggle secrets"
    if found:
        return found, source
    raise ColabKitError(
        "a Hub store needs a Hugging Face token with write access (huggingface.co/settings/tokens), and none was "
        "found. In Colab: the key icon on the left -> add a secret named HF_TOKEN, allow this notebook. On Kaggle: "
        "Add-ons -> Secrets -> HF_TOKEN, attached to this notebook. Elsewhere: export HF_TOKEN=hf_... or "
        "`hf auth login`")
