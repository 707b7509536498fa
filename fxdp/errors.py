"""Errors and the refusal records that ``fxdp.validate`` lists."""
from __future__ import annotations

import dataclasses

__all__ = ["Problem", "UnsupportedError", "format_problems"]


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing fxdp cannot make per-sample.

    Attributes:
        op: The canonical ATen op (or other target) at fault, as text.
        module_path: Dotted path of the module that called it ("" at top level).
        parameter: Name of the trainable parameter it concerns, or "" if none; the
            names joined by ", " when it concerns a value computed from several
            (``linear(h, W_hh, b_hh)`` used where it cannot be made per-sample).
        reason: What goes wrong and what to do about it.
        source: The line of the model's code it comes from (``"file:line: code"``), or ""
            where there is none (the loss, the outputs).
    """

    op: str
    module_path: str
    parameter: str
    reason: str
    source: str = dataclasses.field(default="", compare=False)

    @property
    def parameters(self) -> tuple[str, ...]:
        """Every parameter name in ``parameter``."""
        return tuple(name for name in self.parameter.split(", ") if name)

    def __str__(self) -> str:
        where = self.module_path or "<top level>"
        param = f", parameter {self.parameter!r}" if self.parameter else ""
        at = f" (at {self.source})" if self.source else ""
        return f"{self.op} in {where}{param}{at}: {self.reason}"


def format_problems(problems: list[Problem]) -> str:
    """One line per problem; problems alike in every field, source included (the copies
    of a loop Dynamo unrolled), once, with how many there are."""
    lines = [str(p) for p in problems]
    return "\n".join(f"  - {line}" + (f" ({lines.count(line)} times)" if lines.count(line) > 1 else "")
                     for line in dict.fromkeys(lines))


class UnsupportedError(RuntimeError):
    """Raised when a model (or a step) cannot be made differentially private exactly.

    Attributes:
        problems: Every ``Problem`` found, not just the first.
        notes: What may have led to them (how the size rule read an input).
    """

    def __init__(self, message: str, problems: list[Problem] | None = None, notes: list[str] | None = None):
        self.problems = list(problems or [])
        self.notes = list(notes or [])
        if self.problems:
            message = f"{message}\n{format_problems(self.problems)}"
        if self.notes:
            message = message + "".join(f"\nNote: {note}" for note in self.notes)
        super().__init__(message)
