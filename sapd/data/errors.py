"""Input errors that name the file, the record (or line) and the field, and a collector for
``--skip-invalid`` runs that counts every skipped record by reason so nothing is dropped silently."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


class InvalidRecordError(ValueError):
    """One bad input record.

    ``location`` is human-readable ("line 12", "record 3 (id=trial_T2019…)"), ``field`` the dotted path of
    the offending field ("conversations[5].value"), ``reason`` a short machine-friendly key used for
    counting ("empty_action", "unknown_role", "malformed_json", …) and ``detail`` the sentence for people.
    """

    def __init__(self, path: str, location: str, field: str, reason: str, detail: str):
        self.path = path
        self.location = location
        self.field = field
        self.reason = reason
        self.detail = detail
        where = f"{path}: {location}"
        if field:
            where += f": field {field}"
        super().__init__(f"{where}: {detail} [{reason}]")


@dataclass
class InvalidReport:
    """Counts of skipped records by reason, with the first few examples of each kept for the report."""

    max_examples: int = 3
    counts: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, err: InvalidRecordError) -> None:
        self.counts[err.reason] += 1
        shown = self.examples.setdefault(err.reason, [])
        if len(shown) < self.max_examples:
            shown.append(str(err))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> dict:
        return {"total": self.total, "by_reason": dict(sorted(self.counts.items())),
                "examples": self.examples}

    def lines(self) -> list[str]:
        out = []
        for reason, n in sorted(self.counts.items()):
            out.append(f"  {reason}: {n}")
            out.extend(f"    e.g. {ex}" for ex in self.examples.get(reason, []))
        return out
