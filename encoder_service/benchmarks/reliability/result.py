"""What a scenario returns: named figures (printed, recorded, tabulated) and pass/fail checks."""

from __future__ import annotations

from dataclasses import dataclass, field


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank; nan for no values (so a table shows it)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100.0 * len(ordered) + 0.5) - 1))
    return ordered[rank]


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class ScenarioResult:
    name: str
    figures: dict[str, float] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # lines worth printing (per-interval rates, ...)

    def figure(self, key: str, value: float) -> float:
        self.figures[key] = float(value)
        return value

    def latency(self, prefix: str, seconds: list[float]) -> None:
        """p50/p99/max of a list of latencies, in milliseconds."""
        self.figure(f"{prefix}_n", len(seconds))
        for q in (50, 99):
            self.figure(f"{prefix}_p{q}_ms", percentile(seconds, q) * 1000.0)
        self.figure(f"{prefix}_max_ms", max(seconds, default=float("nan")) * 1000.0)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, bool(ok), detail))
        return bool(ok)

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.checks)

    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def report(self) -> str:
        lines = [f"== {self.name}: {'PASS' if self.passed else 'FAIL'}"]
        lines += [f"   {k} = {_fmt(v)}" for k, v in self.figures.items()]
        lines += [f"   {line}" for line in self.notes]
        lines += [f"   [{'ok' if c.ok else 'FAIL'}] {c.name}{': ' + c.detail if c.detail else ''}"
                  for c in self.checks]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"name": self.name, "passed": self.passed, "figures": self.figures, "notes": self.notes,
                "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks]}


def _fmt(v: float) -> str:
    if v != v:  # nan
        return "n/a"
    if abs(v) >= 100 or v == int(v):
        return f"{v:.0f}"
    return f"{v:.3g}"
