"""Fault injection: make the n-th map, handle create or IPC call fail, stall or die.

Off unless ``KVCACHED_FAULTS`` is set; the variable is read once, when this
module is first imported (the native module imports it as it loads)::

    KVCACHED_FAULTS="map:3:fail,ipc:5-9:stall=2.0,create:10+:fail,ipc:40:kill"

Each rule is ``SITE:CALLS:ACTION``, rules are separated by commas:

==========  ========================================================  ======================
site        counted calls (per process, from 1)                       where
==========  ========================================================  ======================
``map``     each map call of a native page mapper (a worker's page    ``csrc/page_mapper.cpp``
            request makes one per buffer it serves)
``create``  each physical handle the mapper creates (not a recycled   ``csrc/page_mapper.cpp``
            one from its pool)
``ipc``     each page request a worker's native page server answers   ``csrc/page_server.cpp``
            on its socket
``call``    each request a scheduler's :class:`~kvcached_core.ipc.    ``ipc/broadcast.py``
            WorkerGroup` sends to its workers
==========  ========================================================  ======================

``CALLS`` is ``N`` (the n-th call only), ``N-M`` (calls N to M) or ``N+``
(call N and every later one). ``ACTION`` is

- ``fail``: ``map`` and ``create`` raise the out-of-memory error a full device
  raises (:class:`~kvcached_core.errors.DeviceOutOfMemoryError`; the allocator
  turns it into "no space"); ``ipc`` drops the connection without a reply, as
  a crashed worker's socket would; ``call`` breaks the scheduler's connections
  (:class:`~kvcached_core.errors.WorkerError`);
- ``stall=SECONDS``: the call waits that long first (0..86400), then proceeds;
- ``kill``: the process sends itself ``SIGKILL`` (a worker that dies).

The first matching rule of a site wins. When the variable is unset, every
native site costs one relaxed atomic load and the Python site one
module-level ``None`` check (:data:`ACTIVE`). A malformed value is a
:class:`~kvcached_core.errors.KVCachedConfigError` naming the variable.

Tests and ``scripts/reliability.py`` re-arm a process with :func:`configure`.
"""

from __future__ import annotations

import math
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvcached_core.env import shown
from kvcached_core.errors import KVCachedConfigError

__all__ = ["ACTIVE", "ENV", "FaultPlan", "Rule", "configure", "counts", "parse"]

ENV = "KVCACHED_FAULTS"
NATIVE_SITES = ("map", "create", "ipc")
PYTHON_SITES = ("call",)
SITES = NATIVE_SITES + PYTHON_SITES
ACTIONS = ("fail", "stall", "kill")
_MAX_STALL_S = 86400.0
_NEVER = (1 << 63) - 1
_RULE_RE = re.compile(
    r"^(?P<site>[a-z]+):(?P<first>\d{1,18})(?:(?P<plus>\+)|-(?P<last>\d{1,18}))?"
    r":(?P<action>[a-z]+)(?:=(?P<arg>[^,]*))?$"
)


@dataclass(frozen=True)
class Rule:
    """One rule: calls ``first..last`` (1-based, inclusive) of ``site`` get ``action``."""

    site: str
    first: int
    last: int
    action: str
    seconds: float = 0.0

    def matches(self, site: str, call: int) -> bool:
        return self.site == site and self.first <= call <= self.last

    def __str__(self) -> str:
        calls = (str(self.first) if self.first == self.last
                 else f"{self.first}+" if self.last == _NEVER else f"{self.first}-{self.last}")
        action = f"stall={self.seconds:g}" if self.action == "stall" else self.action
        return f"{self.site}:{calls}:{action}"


def parse(text: str, name: str = ENV) -> tuple[Rule, ...]:
    """The rules of a ``KVCACHED_FAULTS`` value (empty text: no rules).

    Raises:
        KVCachedConfigError: naming ``name``, the bad rule and what is wrong.
    """
    rules = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue

        def bad(why: str, part: str = part) -> KVCachedConfigError:
            return KVCachedConfigError(
                f"{name}: rule {shown(part, quote=True)} {why} "
                "(rules are SITE:CALLS:ACTION, e.g. map:3:fail, ipc:5-9:stall=2.0, create:10+:kill)"
            )

        m = _RULE_RE.match(part.lower())
        if m is None:
            raise bad("is malformed")
        site, action, arg = m["site"], m["action"], m["arg"]
        if site not in SITES:
            raise bad(f"names no fault site (one of {', '.join(SITES)})")
        if action not in ACTIONS:
            raise bad(f"names no action (one of fail, stall=SECONDS, kill)")
        first = int(m["first"])
        last = _NEVER if m["plus"] else int(m["last"]) if m["last"] else first
        if first < 1 or last < first:
            raise bad("counts calls from 1 and needs N <= M in N-M")
        seconds = 0.0
        if action == "stall":
            try:
                seconds = float(arg) if arg is not None else math.nan
            except ValueError:
                seconds = math.nan
            if not (math.isfinite(seconds) and 0.0 <= seconds <= _MAX_STALL_S):
                raise bad(f"needs stall=SECONDS with 0..{_MAX_STALL_S:g} seconds")
        elif arg is not None:
            raise bad(f"gives {action} a value it does not take")
        if action == "kill" and site == "call":
            raise bad("kills at native sites only (map, create, ipc)")
        rules.append(Rule(site, first, last, action, seconds))
    return tuple(rules)


class FaultPlan:
    """Armed rules and, for the Python sites, their call counters."""

    def __init__(self, rules: tuple[Rule, ...]) -> None:
        self.rules = rules
        self._counts = dict.fromkeys(PYTHON_SITES, 0)
        self._lock = threading.Lock()

    def hit(self, site: str) -> str | None:
        """Count a call of Python ``site``; stall here, or return ``"fail"``."""
        with self._lock:
            self._counts[site] += 1
            call = self._counts[site]
        for rule in self.rules:
            if rule.matches(site, call):
                if rule.action == "stall":
                    time.sleep(rule.seconds)
                    return None
                if rule.action == "kill":  # pragma: no cover - parse() refuses it
                    os.kill(os.getpid(), signal.SIGKILL)
                return "fail" if rule.action == "fail" else None
        return None

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def __repr__(self) -> str:
        return f"<FaultPlan {','.join(map(str, self.rules))}>"


#: The armed plan of the Python sites, ``None`` when fault injection is off.
ACTIVE: FaultPlan | None = None
_native_module: Any = None
_rules: tuple[Rule, ...] = ()


def _native_rules(rules: tuple[Rule, ...]) -> list[tuple[str, int, int, str, float]]:
    return [(r.site, r.first, r.last, r.action, r.seconds) for r in rules if r.site in NATIVE_SITES]


def _arm_native(module: Any) -> None:
    """Called by ``kvcached_core._native`` as it loads: arm its sites from the rules."""
    global _native_module
    _native_module = module
    module._arm_faults(_native_rules(_rules))


def configure(spec: str | None) -> tuple[Rule, ...]:
    """Arm ``spec`` (a ``KVCACHED_FAULTS`` value) in this process, or disarm with ``None``/``""``.

    Resets every call counter. The environment variable is not changed.
    """
    global ACTIVE, _rules
    rules = parse(spec or "")
    _rules = rules
    ACTIVE = FaultPlan(rules) if any(r.site in PYTHON_SITES for r in rules) else None
    if _native_module is None and any(r.site in NATIVE_SITES for r in rules):
        from kvcached_core import _native  # arms itself through _arm_native
    elif _native_module is not None:
        _native_module._arm_faults(_native_rules(rules))
    return rules


def rules() -> tuple[Rule, ...]:
    """The rules armed in this process."""
    return _rules


def counts() -> dict[str, int]:
    """Calls counted at every site since the rules were armed (0 where not loaded)."""
    out = dict.fromkeys(SITES, 0)
    if _native_module is not None:
        out.update(_native_module._fault_counts())
    if ACTIVE is not None:
        out.update(ACTIVE.counts())
    return out


_rules = parse(os.environ.get(ENV, ""))
ACTIVE = FaultPlan(_rules) if any(r.site in PYTHON_SITES for r in _rules) else None
