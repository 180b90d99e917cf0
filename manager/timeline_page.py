"""The timeline page, from one template (`manager/static/timeline/timeline.html`) two ways: as the manager serves
it (its scripts and style fetched from the manager) and as one self-contained file (everything inline, the
data too) that opens from disk with no server and no network.

Data put into the page is JSON inside `<script type="application/json">`, with `<`, `>` and `&` escaped, so
no text from a trial can close the element or start markup. The file carries a Content-Security-Policy that
allows only its own inline scripts (by hash) and no connection at all: what a bug report's attachment does
is show its log, nothing else.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from core.event_store import StoredEvent, decode_entry, stream_position
from manager.projection import metric_record
from manager.replay import describe
from manager.timeline import Timeline
from schemas.events import TrialMetricReported
from schemas.trial import metric_score

STATIC = Path(__file__).resolve().parent / "static"
TEMPLATE = STATIC / "timeline" / "timeline.html"
ASSETS = {  # what the page loads, by the name it is served under
    "echarts.min.js": STATIC / "vendor" / "echarts" / "echarts.min.js",
    "timeline.js": STATIC / "timeline" / "timeline.js",
    "timeline.css": STATIC / "timeline" / "timeline.css",
}
_PLACEHOLDER = re.compile(r"\{\{(HEAD|CONFIG|DATA|SCRIPTS)\}\}")
FILE_MARKERS = 200_000  # trial markers the file keeps (a 2,000-trial experiment's metrics); more: zoom shows none
SERVED_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)


def attempt_detail(
    timeline: Timeline, trial_id: str, number: int, entries: Iterable[tuple[str, dict[str, str]]], output: Any
) -> dict[str, Any]:
    """What the page shows of one attempt: the trial's history (as `trials show --history`, from `entries`, the
    ones `Timeline.entry_ids` names), the attempt's metrics, and `output` as the caller could read it."""
    timeline.attempt(trial_id, number)  # LookupError for an unknown one
    history: list[dict[str, Any]] = []
    metrics: list[dict[str, Any]] = []
    for entry_id, fields in entries:
        entry = decode_entry(entry_id, fields, timeline.experiment_id)
        line = describe(entry)
        history.append(
            {"id": line.id, "time": line.time_ms, "type": line.type, "attempt": line.attempt}
            | {"source": line.source, "summary": line.summary}
        )
        if isinstance(entry, StoredEvent) and isinstance(entry.event, TrialMetricReported):
            event = entry.event
            if event.attempt == number:
                metrics.append(
                    {"id": entry_id, "time": stream_position(entry_id)[0], "type": event.metric_type}
                    | {"sequence": event.sequence, "value": _score(event), "data": event.data}
                )
    return {"trial": trial_id, "attempt": number, "history": history, "metrics": metrics, "output": output}


def _score(event: TrialMetricReported) -> float | None:
    try:
        return metric_score(metric_record(event).value)
    except ValueError:
        return None


def file_data(
    experiment_id: str,
    entries: list[tuple[str, dict[str, str]]],
    log_text: str,
    outputs: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """What the file holds: the fold's whole span (never clusters: no server to ask per zoom), the views, the
    log itself, gzipped (the page reads an attempt's history from it when clicked, and `trialstream import`
    takes it back), and the attempts' `outputs` that could be read."""
    timeline = Timeline(experiment_id)
    timeline.feed(entries)
    log = base64.b64encode(gzip.compress(log_text.encode("utf-8"), compresslevel=6, mtime=0)).decode("ascii")
    whole = timeline.window(cluster=False, max_markers=FILE_MARKERS)
    return {"timeline": whole, "views": timeline.views(), "log": log, "outputs": outputs}


def script_json(value: Any) -> str:
    """JSON that is safe inside a `<script>` element, whatever strings it holds."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").replace("\u2028", "\\u2028")


def served_page(config: dict[str, Any], assets: str) -> str:
    """The page as the manager serves it: assets from `assets` (a path ending in /), the data fetched."""
    return _fill(
        head=f'<link rel="stylesheet" href="{assets}timeline.css">',
        config=config,
        data=None,
        scripts=f'<script src="{assets}echarts.min.js"></script>\n<script src="{assets}timeline.js"></script>',
    )


def file_page(config: dict[str, Any], data: dict[str, Any]) -> str:
    """One file holding the page, its scripts and `data`: it opens offline and asks nothing of any server."""
    scripts = [ASSETS["echarts.min.js"].read_text(encoding="utf-8"), ASSETS["timeline.js"].read_text(encoding="utf-8")]
    hashes = " ".join(f"'sha256-{_digest(script)}'" for script in scripts)
    csp = (
        f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; img-src data: blob:; "
        "connect-src 'none'; base-uri 'none'; form-action 'none'"
    )
    style = ASSETS["timeline.css"].read_text(encoding="utf-8")
    return _fill(
        head=f'<meta http-equiv="Content-Security-Policy" content="{csp}">\n<style>{_inline(style, "style")}</style>',
        config=config,
        data=data,
        scripts="\n".join(f"<script>{_inline(script, 'script')}</script>" for script in scripts),
    )


def _fill(head: str, config: dict[str, Any], data: dict[str, Any] | None, scripts: str) -> str:
    """One pass over the template: a value (trial text in the data) is never searched for a placeholder."""
    template = TEMPLATE.read_text(encoding="utf-8")
    parts = {"HEAD": head, "CONFIG": script_json(config), "DATA": script_json(data), "SCRIPTS": scripts}
    missing = [name for name in parts if template.count("{{" + name + "}}") != 1]
    if missing:
        raise RuntimeError(f"{TEMPLATE} must hold each placeholder once, not so: {', '.join(missing)}")
    return _PLACEHOLDER.sub(lambda match: parts[match.group(1)], template)


def _inline(text: str, element: str) -> str:
    """A vendored script or style put inline must not end its element early."""
    if f"</{element}" in text.lower():
        raise RuntimeError(f"cannot inline a {element} that holds '</{element}'")
    return text


def _digest(script: str) -> str:
    return base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode()
