"""What one of `volunteer doctor`'s checks says (volunteer_cli/commands/doctor.py and doctor_memory.py)."""

from __future__ import annotations

from dataclasses import dataclass

OK, WARN, FAIL, INFO, NOT_HERE = "ok", "warn", "fail", "info", "n/a"
MARKS = {OK: "ok  ", WARN: "WARN", FAIL: "FAIL", INFO: "    ", NOT_HERE: " -- "}
GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Check:
    section: str
    name: str
    status: str  # OK, WARN, FAIL, INFO or NOT_HERE
    detail: str
