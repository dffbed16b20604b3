"""Another user on the machine can neither read nor change this user's records, and records
that another user leaves where this user's live are ignored, not trusted.

Runs as root (CI does): a forked child drops to the ``nobody`` user and tries, through
kvcached's own functions and ``kvctl``, what a curious or hostile neighbour would. The
records live in the machine's shared directory (``/dev/shm``), where every user can create
files, under a namespace of this test's own.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pwd
import traceback
import uuid
from pathlib import Path

import pytest

from kvcached_core.cli import kvctl
from kvcached_core.errors import IPCError
from kvcached_core.ipc import budget as bud
from kvcached_core.ipc import shm

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")


def _nobody() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' user on this machine")


def as_other_user(fn) -> str:
    """Run ``fn()`` in a child that became ``nobody``; its result (or error) as text."""
    user = _nobody()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            text = repr(fn())
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            text = f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, (IPCError, OSError, SystemExit)):
                text += "\n" + traceback.format_exc()
        os.write(w, text.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


def run_kvctl(*args: str) -> tuple[int, str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = kvctl.main(list(args))
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue() + err.getvalue()


@pytest.fixture
def public_shm(monkeypatch):
    """The machine's shared directory, as engines use it by default."""
    monkeypatch.delenv("KVCACHED_SHM_DIR", raising=False)
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    return Path("/dev/shm")


def test_another_user_cannot_see_or_change_a_pool_record(public_shm):
    ns = f"ou-{uuid.uuid4().hex[:8]}"
    seg = shm.PoolSegment.create(ns, "kv0", capacity=1 << 30)
    try:
        seg.update(used=4 << 20, reserved=0, mapped=4 << 20)
        path = shm.segment_path(ns, "kv0")
        assert oct(path.stat().st_mode & 0o777) == "0o600"

        assert as_other_user(lambda: shm.list_pools(ns)) == "[]"
        opened = as_other_user(lambda: shm.open_pool(ns, "kv0").read())
        assert opened.startswith(("IPCError", "PermissionError")), opened
        changed = as_other_user(lambda: shm.set_limit(ns, "kv0", 1 << 20))
        assert changed.startswith(("IPCError", "PermissionError")), changed
        raw = as_other_user(lambda: open(path, "r+b").write(b"\0" * 8))
        assert raw.startswith("PermissionError"), raw
        said = as_other_user(lambda: run_kvctl("limit", ns, "kv0", "1M"))
        assert said.startswith("(2,") and "kvctl limit:" in said and "Traceback" not in said, said

        (mine,) = shm.list_pools(ns)  # nothing changed for the owner
        assert mine.limit == shm.NO_LIMIT and mine.used == 4 << 20
    finally:
        seg.close()


def test_another_user_cannot_open_this_users_budget_and_keeps_its_own(public_shm):
    key = bud.device_key("host", 0)
    mine = bud.BudgetRecord.open(key)
    try:
        theirs = as_other_user(lambda: bud.BudgetRecord.open_path(mine.path).read())
        assert theirs.startswith(("IPCError", "PermissionError")), theirs
        # Their own record for the same device is a different file, named for their uid.
        other_path = as_other_user(lambda: str(bud.budget_path(key)))
        assert other_path.strip("'") != str(mine.path)
        assert f".u{_nobody().pw_uid}." in other_path
    finally:
        mine.close()


def test_a_record_another_user_planted_in_a_namespace_is_ignored(public_shm):
    ns = f"ou-{uuid.uuid4().hex[:8]}"
    seg = shm.PoolSegment.create(ns, "kv0", capacity=1 << 30)
    planted = shm.segment_path(ns, "kv1")
    try:
        kept: list = []  # the child exits holding it: the file stays, as after a kill -9
        made = as_other_user(lambda: kept.append(shm.PoolSegment.create(ns, "kv1", capacity=1 << 40)) or 1)
        assert made == "1" and planted.stat().st_uid == _nobody().pw_uid  # left as it exited
        assert [p.pool for p in shm.list_pools(ns)] == ["kv0"]  # not trusted, not shown
        with pytest.raises(IPCError):
            shm.set_limit(ns, "kv1", 1 << 20)  # never written to
        code, text = run_kvctl("list", "--json")
        assert code == 0, text
        shown = [(p["namespace"], p["pool"]) for p in json.loads(text)["pools"]]
        assert (ns, "kv0") in shown and (ns, "kv1") not in shown
    finally:
        seg.close()
        planted.unlink(missing_ok=True)
