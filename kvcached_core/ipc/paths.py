"""Where kvcached's sockets live, and the checks that keep them private.

Layout::

    <base>/                       owner-only (0700) directory
        <namespace>/              one per engine instance, also 0700
            pp<stage>-tp<rank>.sock

``<base>`` is the first of ``$KVCACHED_IPC_DIR``, ``$XDG_RUNTIME_DIR/kvcached``
and ``/tmp/kvcached-<uid>``. Each directory is created with mode 0700 and,
whether new or old, must be a real directory (not a link) owned by this user
with no group or world permission bits; anything else is refused with
:class:`~kvcached_core.errors.IPCError` rather than trusted.

``<namespace>`` separates engine instances on one machine: it is
``$KVCACHED_IPC_NAME`` when set, else derived from an instance id the engine
adapter passes (for example the engine's port or its run id). It is never
guessed from process groups: two processes agree on it only when they are told
the same thing.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import stat
from pathlib import Path

from kvcached_core.errors import IPCError, KVCachedConfigError

__all__ = [
    "MAX_SOCKET_PATH_BYTES",
    "MAX_NAME_BYTES",
    "base_dir",
    "private_dir",
    "check_private_dir",
    "check_name",
    "process_start",
    "namespace",
    "namespace_dir",
    "socket_path",
    "check_socket_path",
]

#: ``sun_path`` holds 108 bytes on Linux, one of which is the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107
#: Longest namespace or pool name (it becomes part of file names).
MAX_NAME_BYTES = 64

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_UNSAFE_RE = re.compile(r"[^A-Za-z0-9_.-]+")


def _label(path: Path, setting: str | None) -> str:
    """How an error names a directory: by the variable that chose it, if any."""
    return f"{setting}={path}: the directory" if setting else f"IPC directory {path}"


def check_private_dir(path: Path, setting: str | None = None) -> Path:
    """Check that ``path`` is a directory only this user can enter.

    Args:
        path: The directory.
        setting: The environment variable that named it, if any; errors name it.

    Raises:
        IPCError: ``path`` is a symbolic link or not a directory, belongs to
            another user, or grants any permission to group or others.
    """
    label = _label(path, setting)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise IPCError(f"{label} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise IPCError(f"{label} is a symbolic link; refusing to use it")
    if not stat.S_ISDIR(st.st_mode):
        raise IPCError(f"{label} is not a directory")
    uid = os.getuid()
    if st.st_uid != uid:
        raise IPCError(
            f"{label} belongs to uid {st.st_uid}, not to this user (uid {uid}); "
            f"refusing to use it (set {setting or 'KVCACHED_IPC_DIR'} to a directory of your own)"
        )
    if st.st_mode & 0o077:
        raise IPCError(
            f"{label} has mode {stat.S_IMODE(st.st_mode):04o}; it must not be "
            f"accessible to group or others (fix with: chmod 700 {path})"
        )
    return path


def private_dir(path: str | os.PathLike[str], setting: str | None = None) -> Path:
    """Create ``path`` (and missing parents) with mode 0700 if needed, then check ``path``.

    An existing directory is never loosened or tightened: if its permissions
    are wrong it is refused, since someone else may already have used it.
    ``setting`` is the environment variable that named ``path``, if any:
    errors name it.
    """
    path = Path(path)
    missing = []
    for p in (path, *path.parents):
        if os.path.lexists(p):
            break
        missing.append(p)
    for p in reversed(missing):  # parents too are made 0700, not left to the umask
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            what = f"{setting}={path}: cannot create directory" if setting else (
                "cannot create IPC directory")
            raise IPCError(f"{what} {p}: {exc.strerror or exc}") from exc
    return check_private_dir(path, setting)


def base_dir() -> Path:
    """The checked base directory of kvcached's sockets (see the module doc)."""
    explicit = os.environ.get("KVCACHED_IPC_DIR", "").strip()
    if explicit:
        return private_dir(os.path.abspath(explicit), "KVCACHED_IPC_DIR")
    runtime = os.environ.get("XDG_RUNTIME_DIR", "").strip()
    if runtime and os.path.isdir(runtime):
        return private_dir(os.path.join(runtime, "kvcached"))
    return private_dir(f"/tmp/kvcached-{os.getuid()}")


def check_name(name: str, what: str = "name") -> str:
    """Return ``name`` if it is usable as a namespace or pool name, else raise.

    A name is 1 to 64 bytes of letters, digits, ``_``, ``.`` and ``-``, not
    starting with a punctuation mark.

    Raises:
        KVCachedConfigError: the name is empty, too long or has other characters.
    """
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise KVCachedConfigError(
            f"{what} {name!r} is not valid: use letters, digits, '_', '.' and '-', "
            "starting with a letter or digit"
        )
    if len(name) > MAX_NAME_BYTES:
        raise KVCachedConfigError(f"{what} {name!r} is longer than {MAX_NAME_BYTES} characters")
    return name


def _derive(instance_id: str) -> str:
    """A valid name for an arbitrary instance id, distinct for distinct ids."""
    if _NAME_RE.match(instance_id) and len(instance_id) <= 32:
        return instance_id
    digest = hashlib.sha256(instance_id.encode("utf-8", "surrogatepass")).hexdigest()[:10]
    readable = _UNSAFE_RE.sub("_", instance_id).strip("_.-")[:32]
    return f"{readable}-{digest}" if readable else f"i-{digest}"


def namespace(instance_id: str | None = None) -> str:
    """The IPC namespace of this engine instance.

    Args:
        instance_id: Something every process of the instance knows and no other
            instance on the machine shares (an engine port, a run id). Used when
            ``KVCACHED_IPC_NAME`` is unset; ids that are not valid names are
            mapped to a readable prefix plus a hash.

    Raises:
        KVCachedConfigError: ``KVCACHED_IPC_NAME`` is set but invalid, or neither
            it nor ``instance_id`` is given.
    """
    explicit = os.environ.get("KVCACHED_IPC_NAME", "").strip()
    if explicit:
        return check_name(explicit, "KVCACHED_IPC_NAME")
    if instance_id is None or str(instance_id) == "":
        raise KVCachedConfigError(
            "no IPC namespace: set KVCACHED_IPC_NAME or pass the engine instance id"
        )
    return _derive(str(instance_id))


def namespace_dir(name: str, base: str | os.PathLike[str] | None = None) -> Path:
    """The private directory of namespace ``name`` (created if missing)."""
    check_name(name, "IPC namespace")
    root = base_dir() if base is None else private_dir(base)
    return private_dir(root / name)


def socket_path(
    name: str, rank: int, pp_stage: int = 0, base: str | os.PathLike[str] | None = None
) -> Path:
    """The socket of the worker at ``(pp_stage, rank)`` in namespace ``name``.

    Creates and checks the directories on the way.

    Raises:
        IPCError: the path would exceed the 107-byte limit of Unix socket paths
            (the message says which variable shortens it), or a directory is unsafe.
        KVCachedConfigError: ``rank`` or ``pp_stage`` is negative.
    """
    if rank < 0 or pp_stage < 0:
        raise KVCachedConfigError(f"rank {rank} and pipeline stage {pp_stage} must be >= 0")
    path = namespace_dir(name, base) / f"pp{pp_stage}-tp{rank}.sock"
    check_socket_path(path)
    return path


def accepts_connections(path: str | os.PathLike[str]) -> bool:
    """Whether a process accepts connections on the socket at ``path`` now (no waiting, no handshake)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(os.fspath(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def check_socket_path(path: str | os.PathLike[str]) -> Path:
    """Return ``path`` as a :class:`Path` if it fits in ``sun_path``, else raise :class:`IPCError`."""
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH_BYTES:
        raise IPCError(
            f"socket path {os.fspath(path)} is {size} bytes, over the {MAX_SOCKET_PATH_BYTES}-byte "
            "limit of Unix socket paths; point KVCACHED_IPC_DIR at a shorter directory or use a "
            "shorter KVCACHED_IPC_NAME"
        )
    return Path(path)


def process_start(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks since boot; 0 when unknown), ``None`` when
    it is gone: with the pid, it tells a live owner from a reused pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return 0
        return 0  # no /proc: alive, start time unknown
    try:
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return 0
