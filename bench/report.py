"""docs/benchmarks.md, written from the figures of one run."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from pathlib import Path

from bench.harness import Figure, Section


def _value(figure: Figure) -> str:
    if figure.value is None:
        return "n/a"
    return f"{figure.value:,.0f}" if abs(figure.value) >= 100 else f"{figure.value:.3g}"


def _verdict(figure: Figure) -> str:
    return {None: "", True: "met", False: "**missed**"}[figure.met]


def _row(figure: Figure) -> str:
    target = f"{figure.target} {figure.unit}" if figure.target else ""
    return f"| {figure.name} | {_value(figure)} {figure.unit} | {target} | {_verdict(figure)} | {figure.detail} |"


def render(sections: Sequence[Section], machine: Sequence[str], runs: int, elapsed_s: float, command: str) -> str:
    lines = [
        "# Benchmarks",
        "",
        f"Written by `{command}` on {datetime.date.today().isoformat()}; the whole run took "
        f"{elapsed_s / 60:.1f} min. Each figure is the median over {runs} runs unless its row says otherwise "
        "(a p99 is the median of the runs' p99s). Targets are those of issue 4. The benchmarks are not part of "
        "the test run. What profiling found, what was changed, and the figures before and after: "
        "[bench/FINDINGS.md](../bench/FINDINGS.md).",
        "",
        "## Machine",
        "",
        *[f"- {line}" for line in machine],
        "",
        "## Targets at a glance",
        "",
        "| figure | measured | target | | |",
        "| --- | --- | --- | --- | --- |",
        *[_row(figure) for section in sections for figure in section.figures if figure.target],
    ]
    for section in sections:
        lines += [
            "",
            f"## {section.title}",
            "",
            f"Reproduce: `{section.command}`",
            "",
            "| figure | measured | target | | how |",
            "| --- | --- | --- | --- | --- |",
            *[_row(figure) for figure in section.figures],
        ]
        if section.notes:
            lines += ["", *section.notes]
    return "\n".join(lines) + "\n"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
