"""The Hugging Face token, found in the foreground where the user keeps it.

Looked for, in order: `$HF_TOKEN` (and the older `$HUGGING_FACE_HUB_TOKEN`); Colab's secrets (the key
icon, `google.colab.userdata`); Kaggle's secrets (Add-ons -> Secrets, `kaggle_secrets`); a token saved
by `huggingface-cli login` / `huggingface_hub.login()`. Colab answers `userdata.get` only from a cell the
user runs (it asks for notebook access there), never from a background thread, so the token is found
once, on the main thread, by `start_run`, and handed to the uploader.
"""

from __future__ import annotations

import os
import threading

from ..errors import ColabKitError

__all__ = ["find_token", "TOKEN_NAME"]

TOKEN_NAME = "HF_TOKEN"  # the secret's name in Colab and Kaggle, and the environment variable


def _from_env() -> str | None:
    return os.environ.get(TOKEN_NAME) or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None


def _from_colab() -> str | None:
    try:
        from google.colab import userdata
    except ImportError:
        return None
    try:
        return userdata.get(TOKEN_NAME) or None
    except Exception:  # noqa: BLE001 - SecretNotFoundError, NotebookAccessError (access not granted): not there
        return None


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


def _from_login() -> str | None:
    try:
        from huggingface_hub import get_token
    except ImportError:
        return None
    return get_token() or None


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
    for source, look in (("$HF_TOKEN", _from_env), ("Colab secrets", _from_colab), ("Kaggle secrets", _from_kaggle),
                         ("huggingface-cli login", _from_login)):
        found = look()
        if found:
            return found, source
    raise ColabKitError(
        "a Hub store needs a Hugging Face token with write access (huggingface.co/settings/tokens), and none was "
        "found. In Colab: the key icon on the left -> add a secret named HF_TOKEN, allow this notebook. On Kaggle: "
        "Add-ons -> Secrets -> HF_TOKEN, attached to this notebook. Elsewhere: export HF_TOKEN=hf_... or "
        "`huggingface-cli login`")
