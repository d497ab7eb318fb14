"""Where staged data goes, and creating that place safely.

Resolution order (first that applies): ``--dest``, ``$STAGER_DEST``, ``/scratch/$SLURM_JOB_ID``
inside a job, else ``${TMPDIR:-/tmp}/stager-$USER/local``. The job directory is created with
mode 0700 and refused if it is a symlink or owned by someone else: on a shared node another
user could pre-create it to read or swap our data.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from stager.errors import DestinationError, UnsafePath
from stager.slurm import SlurmEnv

__all__ = ["resolve_dest_root", "ensure_private_dir", "scratch_root", "SCRATCH_ROOT"]

SCRATCH_ROOT = "/scratch"


def _user(env: Mapping[str, str]) -> str:
    user = env.get("USER") or env.get("LOGNAME")
    if user:
        return user
    import getpass  # (rarely needed: $USER is set)

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def scratch_root(env: Mapping[str, str] | None = None) -> Path:
    """Where jobs' scratch directories live (``ROOT/<job id>``): ``$STAGER_SCRATCH_ROOT`` or
    ``/scratch``. stage-in stages under ``ROOT/$SLURM_JOB_ID``; ``stager ls/du/clean`` look here."""
    env = os.environ if env is None else env
    return Path(env.get("STAGER_SCRATCH_ROOT") or SCRATCH_ROOT)


def resolve_dest_root(
    dest: str | None = None, *, env: Mapping[str, str] | None = None, slurm: SlurmEnv | None = None
) -> Path:
    """The directory under which datasets are staged as ``<root>/<name>/``."""
    env = os.environ if env is None else env
    if dest:
        return Path(dest)
    if env.get("STAGER_DEST"):
        return Path(env["STAGER_DEST"])
    slurm = slurm or SlurmEnv.from_environ(env)
    if slurm.in_slurm:
        return scratch_root(env) / slurm.job_id
    tmp = env.get("TMPDIR") or "/tmp"
    return Path(tmp) / f"stager-{_user(env)}" / "local"


def vet_private_dir(path: Path, info: os.stat_result, flag: str = "--dest") -> None:
    """Refuse ``path`` (its ``lstat`` is ``info``) unless it is a directory of ours, not a
    symlink: what :func:`ensure_private_dir` checks, for a path that already exists."""
    if stat.S_ISLNK(info.st_mode):
        raise UnsafePath(
            f"{path} is a symlink; refusing to stage through it (remove it or pass another {flag})"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise DestinationError(
            f"{path} exists and is not a directory; remove it or pass another {flag}"
        )
    if info.st_uid != os.geteuid():
        raise UnsafePath(
            f"{path} is owned by uid {info.st_uid}, not by you; refusing (another user may have "
            "pre-created it)"
        )


def ensure_private_dir(path: str | os.PathLike[str], flag: str = "--dest") -> Path:
    """Create ``path`` (and parents) if needed, the leaf with mode 0700, and vet it.

    Refuses (:class:`UnsafePath`) a leaf that is a symlink or not owned by us; wraps other
    failures in :class:`DestinationError` naming the path. An existing directory keeps its
    mode: ``--dest /tmp`` must not turn ``/tmp`` into a private directory. ``flag``: the option
    that named ``path``, which the messages tell the user to change.
    """
    path = Path(path)
    created = False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
            created = True
        except FileExistsError:
            pass
        info = os.lstat(path)
    except PermissionError as exc:
        raise DestinationError(
            f"cannot create {path}: permission denied; pass {flag} to a writable directory"
        ) from exc
    except OSError as exc:
        raise DestinationError(
            f"cannot create {path}: {exc.strerror or exc}; pass {flag} to a usable directory"
        ) from exc
    vet_private_dir(path, info, flag)
    if created and stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, 0o700)  # a umask can't widen it, but a default ACL may have
    return path
