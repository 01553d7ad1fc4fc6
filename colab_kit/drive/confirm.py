"""How `start_run(confirm=...)` learns that a checkpoint is in the cloud.

    "auto"        DriveFS's upload attributes where the mount reports them; otherwise written,
                  upload not confirmed (and the rate-independent ladder of `retention.py` is kept)
    "attributes"  the attributes only: an error where the mount does not report them
    "api"         Drive's API: every file's size and md5 as Drive's servers hold them
                  (`driveapi.py`). In Colab it asks for consent once per runtime; elsewhere it
                  needs COLAB_KIT_DRIVE_API (and COLAB_KIT_DRIVE_ROOT), or a `ck.DriveApi(...)`
                  passed as `confirm=`
A refused consent or a missing package turns "api" into "auto" with one message: the run goes on,
confirmed the way the mount allows. An API that does not answer at the start (403, 5xx, no network
for a moment) keeps "api": nothing is confirmed or pruned until it answers, and the kit keeps asking.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import DriveError
from .driveapi import COLAB_ROOT, ApiRefused, ApiUnavailable, DriveApi, unavailable_message
from .drivefs import API, DRIVEFS, describe_kind

__all__ = ["CONFIRM_MODES", "check_confirm", "choose_confirmation"]

CONFIRM_MODES = ("auto", "attributes", "api")
CONSENT = ("colab_kit: confirm='api' asks Google for access to your Drive through its API (a consent prompt of "
           "its own, apart from the mount's). The kit uses it to read each checkpoint's size and md5 as Drive's "
           "servers hold them, before it calls a checkpoint safe, and to delete the checkpoints it prunes for good "
           "(no Trash). Nothing else is read or changed.")


def check_confirm(confirm) -> None:
    """Refuse a bad `confirm=` before anything is started."""
    if isinstance(confirm, DriveApi) or confirm in CONFIRM_MODES:
        return
    raise ValueError(f"confirm={confirm!r}: use 'auto' (the default), 'attributes', 'api', or a ck.DriveApi(...)")


def choose_confirmation(confirm, drive_dir: Path, kind: str, *, colab: bool, say) -> tuple[str, DriveApi | None]:
    """(kind, api) for the run folder `drive_dir` whose mount is of `kind`; `say(text)` tells the user.

    Raises:
        DriveError: "attributes" on a folder without them; an API root that does not hold the folder.
        AmbiguousFolder: two folders of one name on the way to the run folder (never guessed).
    """
    check_confirm(confirm)
    if confirm == "auto":
        return kind, None
    if confirm == "attributes":
        if kind != DRIVEFS:
            raise DriveError(f"confirm='attributes', but {drive_dir} does not report DriveFS's upload attributes "
                             f"({describe_kind(kind)}). Use confirm='auto' to go on without them, or "
                             f"confirm='api' to confirm uploads through Drive's API")
        return kind, None
    api = confirm if isinstance(confirm, DriveApi) else DriveApi.from_environment()
    if api is None and not colab:
        say(f"confirm='api': no Drive API is given here (set COLAB_KIT_DRIVE_API and COLAB_KIT_DRIVE_ROOT, or pass "
            f"confirm=ck.DriveApi(endpoint, root)); going on as confirm='auto': {describe_kind(kind)}")
        return kind, None
    if api is None and Path(COLAB_ROOT) not in [Path(drive_dir), *Path(drive_dir).parents]:
        say(f"confirm='api': {drive_dir} is not in Google Drive ({COLAB_ROOT}), so Drive's API cannot confirm it; "
            f"going on as confirm='auto': {describe_kind(kind)}")
        return kind, None
    if api is None:
        print(CONSENT, flush=True)
        try:
            from google.colab import auth

            auth.authenticate_user()
        except Exception as exc:  # noqa: BLE001 - refused, closed, or no google.colab: the mount decides
            say(f"confirm='api': access to the Drive API was not granted ({unavailable_message(exc)}); going on "
                f"as confirm='auto': {describe_kind(kind)}")
            return kind, None
        api = DriveApi(root=COLAB_ROOT)
    try:
        api.folder_id(drive_dir)  # the package, the credentials and the network, asked once now
    except FileNotFoundError:
        pass  # the API answers; the folder, just made, has not reached Drive yet
    except DriveError:  # an AmbiguousFolder among them: refused, never a fallback
        raise
    except ApiRefused as exc:  # no permission: asking again will not help
        say(f"confirm='api': {api.describe()} cannot be used: {exc}; going on as confirm='auto': "
            f"{describe_kind(kind)}")
        return kind, None
    except ApiUnavailable as exc:  # a 403 or a 5xx now says nothing of the next minute: stay, and ask again
        say(f"confirm='api': {api.describe()} did not answer now ({exc}); the kit keeps asking it. Until it "
            f"answers, no checkpoint is called in the cloud and none is pruned")
    except Exception as exc:  # noqa: BLE001 - no package, refused credentials
        say(f"confirm='api': {api.describe()} cannot be used ({unavailable_message(exc)}); going on as "
            f"confirm='auto': {describe_kind(kind)}")
        return kind, None
    return API, api
