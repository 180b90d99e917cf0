/*
 * trialstream timeline page.
 *
 * One experiment's event log drawn as a timeline: a lane per (platform, host, worker), a bar per attempt,
 * a cursor that folds the log's trial table at any point, and a detail panel per attempt.
 *
 * The page runs in two modes, read from <script id="timeline-config">:
 *   - "server": the back end answers {api}/timeline (windowed), {api}/timeline/views and
 *     {api}/timeline/attempts/{trial}/{attempt}; a live experiment is followed with EventSource.
 *   - "file": everything is in <script id="timeline-data"> and windowing is done here.
 * Both go through a data source object with the same methods (see serverSource / fileSource).
 *
 * Every string that comes from the data (trial ids, messages, summaries, output) is untrusted: it is
 * inserted with textContent only, drawn on the canvas, or escaped with echarts.format.encodeHTML in
 * tooltips. There is no inline script and no inline handler (the page's CSP forbids them).
 */
(function () {
  "use strict";

  // ------------------------------------------------------------------------------------------------
  // Constants

  const OUTCOMES = [
    "WAITING", "RUNNING", "UNKNOWN", "SUCCEEDED", "FAILED",
    "USER_CANCELED", "EARLY_STOPPED", "SYS_CANCELED", "LOST",
  ];
  const COLORS = {
    WAITING: "#c3ccd8",
    RUNNING: "#2f7de1",
    UNKNOWN: "#e0a100",
    SUCCEEDED: "#1f9d62",
    FAILED: "#d43c3c",
    USER_CANCELED: "#9aa3ae",
    EARLY_STOPPED: "#f0802a",
    SYS_CANCELED: "#8b5cf6",
    LOST: "#3d0d12",
  };
  const OTHER_COLOR = "#64748b";
  const MARKER_COLORS = {
    ExperimentCreated: "#0f766e",
    TrialsRequested: "#64748b",
    TunerNoMoreTrials: "#64748b",
    TunerDataImported: "#64748b",
    ExperimentUpdated: "#7c3aed",
    ExperimentResumed: "#2563eb",
    ExperimentStopRequested: "#b91c1c",
    ExperimentFinished: "#111827",
  };
  const FONT = 'system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif';

  // "A time T means id T-<max>": the largest sequence number of a log entry id (64 bits). Held as a
  // string for display; as a number it is only ever compared, where 1.8e19 is above any real seq.
  const MAX_SEQ = "18446744073709551615";
  const MAX_SEQ_NUM = Number(MAX_SEQ);

  const TABLE_LIMIT = 200;
  // While the cursor is dragged or played, the table shows its first rows only and is rewritten at
  // most this often (the line, the counts and the best metric follow every frame): laying out 200
  // changed rows at each frame makes the page stutter. Once the cursor stops, all 200 are there.
  const TABLE_LIMIT_MOVING = 40;
  const TABLE_INTERVAL_MS = 100;
  const ZOOM_DEBOUNCE_MS = 200;
  const LIVE_REFRESH_MS = 500; // a live page refreshes at most this often, however fast its log grows
  const EXPERIMENT_ROW = "experiment";
  // Above this many attempts in view (a file of thousands of trials, zoomed out), they are drawn as
  // one path per lane and colour instead of one item each: a few dozen canvas paths instead of tens
  // of thousands of elements. Hover and click then find the attempt under the mouse by position.
  const DENSE_ABOVE = 1500;
  const LAYOUT = { right: 28, top: 30, bottom: 72, rowMin: 22, rowMax: 38, maxRowsHeight: 620 };

  // ------------------------------------------------------------------------------------------------
  // Test hooks: present from the start so that tests can poll `ready`.

  const hooks = {
    ready: false,
    renders: 0,
    error: null,
    pixelOf: () => null,
    pixelOfTime: () => null,
    drawn: () => [],
    cursor: () => null,
  };
  window.timeline = hooks;

  // ------------------------------------------------------------------------------------------------
  // Small helpers

  const $ = (id) => document.getElementById(id);

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    if (attrs) {
      for (const [k, v] of Object.entries(attrs)) {
        if (v === null || v === undefined) continue;
        if (k === "className") node.className = v;
        else node.setAttribute(k, String(v));
      }
    }
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function esc(value) {
    return echarts.format.encodeHTML(value === null || value === undefined ? "" : String(value));
  }

  function debounce(fn, ms) {
    let timer = null;
    const wrapped = (...args) => {
      clearTimeout(timer);
      timer = setTimeout(() => fn(...args), ms);
    };
    wrapped.cancel = () => clearTimeout(timer);
    return wrapped;
  }

  /**
   * Runs fn `ms` after the first call since its last run, whatever comes meanwhile: a debounce would never run
   * while calls keep coming faster than `ms`, as a live log's entries do. A call while fn runs (it may await)
   * runs it once more after.
   */
  function throttle(fn, ms) {
    let timer = null;
    let running = false;
    let again = false;
    const run = async () => {
      timer = null;
      if (running) {
        again = true;
        return;
      }
      running = true;
      try {
        await fn();
      } finally {
        running = false;
        if (again) {
          again = false;
          wrapped();
        }
      }
    };
    const wrapped = () => {
      if (timer === null) timer = setTimeout(run, ms);
    };
    return wrapped;
  }

  /** Runs fn at most once per animation frame, with the latest call's effect (drag, play). */
  function perFrame(fn) {
    let queued = false;
    return () => {
      if (queued) return;
      queued = true;
      requestAnimationFrame(() => {
        queued = false;
        fn();
      });
    };
  }

  function clamp(v, lo, hi) {
    return Math.max(lo, Math.min(hi, v));
  }

  function outcomeColor(outcome) {
    return COLORS[outcome] || OTHER_COLOR;
  }

  function fmtTime(ms) {
    if (ms === null || ms === undefined || !isFinite(ms)) return "—";
    return new Date(ms).toISOString().replace("T", " ").replace("Z", " UTC");
  }

  function fmtDuration(ms) {
    if (ms === null || ms === undefined || !isFinite(ms)) return "";
    if (ms < 1000) return Math.round(ms) + " ms";
    const s = ms / 1000;
    if (s < 60) return s.toFixed(s < 10 ? 1 : 0) + " s";
    const m = Math.floor(s / 60);
    if (m < 60) return m + " min " + String(Math.round(s % 60)).padStart(2, "0") + " s";
    const h = Math.floor(m / 60);
    return h + " h " + String(m % 60).padStart(2, "0") + " min";
  }

  function fmtMetric(v) {
    if (v === null || v === undefined) return "";
    if (typeof v !== "number") return String(v);
    if (Number.isInteger(v)) return String(v);
    const a = Math.abs(v);
    return a !== 0 && (a < 1e-4 || a >= 1e6) ? v.toExponential(4) : String(Number(v.toPrecision(6)));
  }

  /** Only http(s) links (absolute, or paths resolved against the page) are put in an href: the
   *  config is the server's, but a javascript: URL must never get there. */
  function safeHref(url) {
    if (typeof url !== "string" || url === "") return null;
    try {
      const resolved = new URL(url, document.baseURI);
      return resolved.protocol === "http:" || resolved.protocol === "https:" ? url : null;
    } catch (_) {
      return null;
    }
  }

  // ------------------------------------------------------------------------------------------------
  // Event ids and the cursor
  //
  // An id is "<ms>-<seq>", compared as the pair. A cursor is {ms, seq, id}; a time T is the cursor
  // {T, MAX_SEQ}: everything at or before T.

  function splitId(id) {
    const s = String(id);
    const dash = s.indexOf("-");
    if (dash < 0) return [Number(s), 0];
    return [Number(s.slice(0, dash)), Number(s.slice(dash + 1))];
  }

  function idCursor(id) {
    const [ms, seq] = splitId(id);
    return { ms, seq, id: String(id), exact: true };
  }

  function timeCursor(ms) {
    const t = Math.floor(ms);
    return { ms: t, seq: MAX_SEQ_NUM, id: t + "-" + MAX_SEQ, exact: false };
  }

  function cmpCursor(a, b) {
    return a.ms - b.ms || a.seq - b.seq;
  }

  /** Parses what a person types: an event id, epoch ms, or an ISO time (UTC unless it says otherwise). */
  function parseCursorInput(text) {
    const s = text.trim();
    if (/^\d+-\d+$/.test(s)) return idCursor(s);
    if (/^\d+$/.test(s)) return timeCursor(Number(s));
    let iso = s;
    const m = /^(\d{4}-\d{2}-\d{2})(?:[T ](\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?))?$/.exec(s);
    if (m) iso = m[1] + "T" + (m[2] || "00:00:00") + "Z";
    const t = Date.parse(iso);
    return isNaN(t) ? null : timeCursor(t);
  }

  // ------------------------------------------------------------------------------------------------
  // Views: the trial table at any cursor, from change lists
  //
  // Each trial's changes are turned into two typed arrays (ms, seq) once, so that the row at a cursor
  // is one binary search per trial: 10,000 trials take a few milliseconds.

  function indexChanges(changes) {
    const n = changes.length;
    const ms = new Float64Array(n);
    const seq = new Float64Array(n);
    let sorted = true;
    for (let i = 0; i < n; i++) {
      const p = splitId(changes[i][0]);
      ms[i] = p[0];
      seq[i] = p[1];
      if (i > 0 && (ms[i] < ms[i - 1] || (ms[i] === ms[i - 1] && seq[i] < seq[i - 1]))) sorted = false;
    }
    if (sorted) return { changes, ms, seq };
    // The back end sends them in log order; sort defensively so that binary search stays right.
    const order = changes.map((c, i) => i).sort((a, b) => ms[a] - ms[b] || seq[a] - seq[b]);
    return indexChanges(order.map((i) => changes[i]));
  }

  /** Index of the last change at or before (cms, cseq), or -1. */
  function lastAtOrBefore(ix, cms, cseq) {
    let lo = 0;
    let hi = ix.ms.length - 1;
    let found = -1;
    while (lo <= hi) {
      const mid = (lo + hi) >> 1;
      const m = ix.ms[mid];
      if (m < cms || (m === cms && ix.seq[mid] <= cseq)) {
        found = mid;
        lo = mid + 1;
      } else {
        hi = mid - 1;
      }
    }
    return found;
  }

  function indexViews(views) {
    const trials = [];
    for (const [trial, changes] of Object.entries(views.trials || {})) {
      if (!Array.isArray(changes) || changes.length === 0) continue;
      trials.push(Object.assign({ trial }, indexChanges(changes)));
    }
    return {
      head: views.head || null,
      optimizeMode: views.optimizeMode || null,
      experiment: indexChanges(views.experiment || []),
      trials,
    };
  }

  /** The rows at a cursor: [{trial, status, attempt, metric, ms, seq}] (unsorted). */
  function rowsAt(vix, cursor) {
    const rows = [];
    for (const t of vix.trials) {
      const i = lastAtOrBefore(t, cursor.ms, cursor.seq);
      if (i < 0) continue;
      const c = t.changes[i];
      rows.push({ trial: t.trial, status: c[1], attempt: c[2], metric: c[3], ms: t.ms[i], seq: t.seq[i] });
    }
    return rows;
  }

  function experimentStatusAt(vix, cursor) {
    const i = lastAtOrBefore(vix.experiment, cursor.ms, cursor.seq);
    return i < 0 ? null : vix.experiment.changes[i][1];
  }

  function summarize(rows, optimizeMode) {
    const counts = new Map();
    let best = null;
    const minimize = optimizeMode === "minimize";
    for (const r of rows) {
      counts.set(r.status, (counts.get(r.status) || 0) + 1);
      if (typeof r.metric !== "number" || !isFinite(r.metric)) continue;
      if (best === null || (minimize ? r.metric < best.value : r.metric > best.value)) {
        best = { value: r.metric, trial: r.trial };
      }
    }
    return { counts, best };
  }

  // ------------------------------------------------------------------------------------------------
  // Data sources: the same four methods in both modes

  class HttpError extends Error {
    constructor(status, text) {
      super(text);
      this.status = status;
    }
  }

  async function errorText(response) {
    let text = "";
    try {
      text = await response.text();
      const parsed = JSON.parse(text);
      if (parsed && typeof parsed.detail === "string") text = parsed.detail;
      else if (parsed && typeof parsed.error === "string") text = parsed.error;
    } catch (_) {
      /* not JSON: keep the text as it is */
    }
    return (text || response.statusText || "request failed").slice(0, 500) + " (HTTP " + response.status + ")";
  }

  function serverSource(config) {
    const api = String(config.api || "").replace(/\/+$/, "");

    async function getJSON(url, signal) {
      const response = await fetch(url, { credentials: "same-origin", signal });
      if (!response.ok) throw new HttpError(response.status, await errorText(response));
      return response.json();
    }

    return {
      mode: "server",
      /** The timeline answer for [from, to] (null: the whole experiment) at px pixels. */
      timeline(from, to, px, signal) {
        const q = new URLSearchParams();
        if (from !== null && to !== null) {
          q.set("from", String(Math.floor(from)));
          q.set("to", String(Math.ceil(to)));
        }
        q.set("px", String(Math.max(1, Math.round(px))));
        return getJSON(api + "/timeline?" + q.toString(), signal);
      },
      views() {
        return getJSON(api + "/timeline/views");
      },
      attempt(trial, attempt) {
        return getJSON(api + "/timeline/attempts/" + encodeURIComponent(trial) + "/" + encodeURIComponent(attempt));
      },
      /** Opens the event stream after `head`; onLog is called per `log` event. Returns a closer. */
      follow(head, onLog) {
        const es = new EventSource(api + "/events/stream?after=" + encodeURIComponent(head));
        es.addEventListener("log", onLog);
        return () => es.close();
      },
      logDownload: null,
    };
  }

  /**
   * The log inside a file: base64 of gzipped JSON lines (`trialstream export`), read only when needed
   * (the first click on an attempt, or "download the log"). It is streamed through DecompressionStream
   * and its lines grouped by trial without ever holding the whole text in one string: a 10,000-trial
   * log is hundreds of megabytes once decompressed.
   */
  function fileLog(encoded) {
    let gz = null; // the compressed bytes, decoded from base64 once
    let byTrial = null; // trial -> its raw lines, in log order (a promise while the first pass runs)
    const parsed = new Map(); // trial -> its parsed records, once asked for

    function compressed() {
      if (gz === null) {
        const bin = atob(encoded);
        gz = new Uint8Array(bin.length);
        for (let i = 0; i < bin.length; i++) gz[i] = bin.charCodeAt(i);
      }
      return gz;
    }

    function isGzip() {
      return encoded.startsWith("H4sI"); // base64 of the gzip magic 1f 8b 08
    }

    /** A stream of the log's bytes, decompressed. */
    function bytes() {
      if (!isGzip()) return new Blob([encoded]).stream(); // a log given as plain text
      if (typeof DecompressionStream !== "function") {
        throw new Error("this browser cannot decompress the log (no DecompressionStream)");
      }
      return new Blob([compressed()]).stream().pipeThrough(new DecompressionStream("gzip"));
    }

    // The exporter writes {"id": ..., "fields": {"type": ..., "trial": ..., "json": ...}}: the trial is
    // read from the line's start; a line of another shape is parsed whole.
    const TRIAL_AT_START = /^\{"id":\s*"[^"]*",\s*"fields":\s*\{"type":\s*"(?:[^"\\]|\\.)*",\s*"trial":\s*"((?:[^"\\]|\\.)*)"/;

    function trialOf(line) {
      const m = TRIAL_AT_START.exec(line);
      if (m) return m[1].includes("\\") ? JSON.parse('"' + m[1] + '"') : m[1];
      let record;
      try {
        record = JSON.parse(line);
      } catch (_) {
        return null;
      }
      if (!record || typeof record.id !== "string" || !record.fields) return null; // the header, the trailer
      return String(record.fields.trial || "");
    }

    async function group() {
      const map = new Map();
      const add = (line) => {
        const trial = line ? trialOf(line) : null;
        if (trial === null) return;
        if (!map.has(trial)) map.set(trial, []);
        map.get(trial).push(line);
      };
      const reader = bytes().pipeThrough(new TextDecoderStream()).getReader();
      let rest = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        const chunk = rest + value;
        let from = 0;
        let nl;
        while ((nl = chunk.indexOf("\n", from)) >= 0) {
          add(chunk.slice(from, nl));
          from = nl + 1;
        }
        rest = chunk.slice(from);
      }
      add(rest);
      return map;
    }

    return {
      /** The trial's entries, parsed, in log order. */
      async entriesOf(trial) {
        if (byTrial === null) byTrial = group();
        const lines = (await byTrial).get(trial) || [];
        if (!parsed.has(trial)) {
          parsed.set(trial, lines.map((line) => {
            try {
              return JSON.parse(line);
            } catch (_) {
              return null;
            }
          }).filter((r) => r && typeof r.id === "string" && r.fields));
        }
        return parsed.get(trial);
      },
      /** The decompressed log, as a Blob. */
      blob() {
        return new Response(bytes()).blob();
      },
    };
  }

  // The event fields `trials show --history` leaves out of a line's summary (manager/replay.py).
  const HISTORY_COMMON_FIELDS = new Set(["experimentId", "time", "source", "trialId", "type", "v", "attempt"]);

  /** One field's value on one line, as replay._short writes it. */
  function shortValue(value) {
    let text = typeof value === "string" && value !== "" && !/\s/.test(value) ? value : JSON.stringify(value);
    if (text === undefined) text = String(value);
    return text.length <= 80 ? text : text.slice(0, 79) + "…";
  }

  // A metric in the log's compact form (schemas/compact.py): [v, time, source, attempt, parameterId, P|F|R,
  // sequence, data], its trial the entry's `trial` field, its experiment the log's.
  const METRIC_TYPES = { P: "PERIODICAL", F: "FINAL", R: "REQUEST_PARAMETER" };

  /** An entry's event as its JSON object (a compact metric's expanded, as schemas/compact.py does). */
  function storedEvent(fields) {
    const event = JSON.parse(fields.json);
    if (!Array.isArray(event)) return event;
    if (fields.type !== "TrialMetricReported" || event.length !== 8) throw new Error("not an object");
    const [v, time, source, attempt, parameterId, code, sequence, data] = event;
    const metricType = METRIC_TYPES[code] || code;
    return { time, source, trialId: fields.trial, type: fields.type, v, attempt, parameterId, metricType, sequence, data };
  }

  /** One history item, as the manager answers it: {id, time, type, attempt, source, summary}. */
  function historyItem(record) {
    const time = splitId(record.id)[0];
    const type = String(record.fields.type || "?");
    let event;
    try {
      event = storedEvent(record.fields);
      if (!event || typeof event !== "object") throw new Error("not an object");
    } catch (err) {
      return { item: { id: record.id, time, type, attempt: null, source: "?", summary: "unreadable: " + err.message }, event: null };
    }
    const parts = [];
    for (const [key, value] of Object.entries(event)) {
      if (HISTORY_COMMON_FIELDS.has(key) || value === null || value === undefined) continue; // exclude_none
      parts.push(key + "=" + shortValue(value));
    }
    const attempt = typeof event.attempt === "number" ? event.attempt : null;
    const source = event.source === undefined || event.source === null ? "?" : String(event.source);
    return { item: { id: record.id, time, type, attempt, source, summary: parts.join(" ") }, event };
  }

  /** A metric's value: its data as a number, or an object's numeric `default`; else null (shown as data). */
  function metricValue(data) {
    try {
      let v = JSON.parse(data);
      if (typeof v === "string") v = JSON.parse(v);
      if (typeof v === "number" && isFinite(v)) return v;
      if (v && typeof v === "object" && typeof v.default === "number" && isFinite(v.default)) return v.default;
    } catch (_) {
      /* not a number */
    }
    return null;
  }

  function fileSource(config, data) {
    const tl = data.timeline;
    const outputs = data.outputs || {};
    const log = typeof data.log === "string" && data.log !== "" ? fileLog(data.log) : null;
    const name = (config.experimentId || tl.experimentId || "experiment") + ".log.jsonl";

    function overlaps(a, from, to) {
      const lo = attemptLow(a);
      const hi = attemptHigh(a, tl.end);
      return lo <= to && hi >= from;
    }

    /** The attempt answer built from the trial's entries in the file, as the manager builds it. */
    async function attemptFromLog(trial, attempt) {
      if (!log) throw new Error("the log is not in this file");
      const history = [];
      const metrics = [];
      for (const record of await log.entriesOf(trial)) {
        const { item, event } = historyItem(record);
        history.push(item);
        if (event && item.type === "TrialMetricReported" && event.attempt === attempt) {
          metrics.push({
            id: record.id, time: item.time, type: event.metricType, sequence: event.sequence,
            value: metricValue(event.data), data: event.data,
          });
        }
      }
      const output = outputs[trial + "/" + attempt] || { error: "the output is not in this file" };
      return { trial, attempt, history, metrics, output };
    }

    return {
      mode: "file",
      timeline(from, to) {
        if (from === null || to === null) return Promise.resolve(tl);
        // The file holds the whole span: the window is filtered here (no clusters in a file).
        const windowed = Object.assign({}, tl, {
          window: { from, to },
          attempts: (tl.attempts || []).filter((a) => overlaps(a, from, to)),
          markers: (tl.markers || []).filter((m) => m.time >= from && m.time <= to),
          clusters: [],
        });
        return Promise.resolve(windowed);
      },
      views() {
        return Promise.resolve(data.views);
      },
      async attempt(trial, attempt) {
        const key = trial + "/" + attempt;
        if (data.attempts && data.attempts[key]) return data.attempts[key]; // a file that carries the answers
        if (!(tl.attempts || []).some((a) => a.key === key)) throw new Error("attempt " + key + " is not in this file");
        return attemptFromLog(trial, Number(attempt));
      },
      follow: null,
      logDownload: log ? { name, blob: () => log.blob() } : null,
    };
  }

  // ------------------------------------------------------------------------------------------------
  // Attempt geometry (shared by the chart, the hooks and file-mode windowing)

  function attemptLow(a) {
    let lo = Infinity;
    if (a.submitted !== null && a.submitted !== undefined) lo = a.submitted;
    for (const s of a.segments || []) lo = Math.min(lo, s.from);
    if (a.started !== null && a.started !== undefined) lo = Math.min(lo, a.started);
    return lo;
  }

  function attemptHigh(a, end) {
    let hi = -Infinity;
    for (const s of a.segments || []) hi = Math.max(hi, s.to === null || s.to === undefined ? end : s.to);
    if (a.ended !== null && a.ended !== undefined) hi = Math.max(hi, a.ended);
    if (hi === -Infinity) hi = a.submitted !== null && a.submitted !== undefined ? Math.max(a.submitted, end) : end;
    return hi;
  }

  // ------------------------------------------------------------------------------------------------
  // Page state

  const state = {
    config: null,
    source: null,
    span: { start: 0, end: 1 },
    view: { from: 0, to: 1 },
    head: null, // cursor of the log's head (views.head)
    status: null,
    optimizeMode: "maximize",
    lanes: [],
    rowOfLane: new Map(), // lane id -> y category index (0 is the experiment row)
    attempts: [], // prepared attempts of the current window
    byKey: new Map(),
    links: [], // retry links between drawn attempts
    clusters: [],
    markers: [],
    markersOmitted: 0,
    dense: false, // attempts drawn per lane (see DENSE_ABOVE)
    laneIndex: null, // row -> {items sorted by from, maxTo}: hit-testing in dense mode
    mouse: [0, 0], // the last mouse position over the chart (dense tooltips)
    vix: null,
    cursor: null,
    following: true,
    rowsCache: null, // {id, rows} for the cursor the table was computed at
    selectedKey: null,
    chart: null,
    layout: null,
    cursorGroup: null,
    shade: null,
    pendingRender: false,
    windowAbort: null,
    windowSeq: 0,
    closeLive: null,
    playing: false,
    dragging: false,
    tableAt: 0, // when the table was last rewritten (performance.now())
    tableTimer: null,
    detailSeq: 0,
    metricsChart: null,
  };

  function prepareAttempt(a, end) {
    const segs = (a.segments || [])
      .map((s) => ({ row: rowOf(s.lane), lane: s.lane, from: s.from, to: s.to === null || s.to === undefined ? end : s.to }))
      .filter((s) => s.row !== null);
    const started = a.started !== null && a.started !== undefined;
    return {
      a,
      key: a.key,
      segs,
      started,
      lo: attemptLow(a),
      hi: attemptHigh(a, end),
      unknown: (a.unknown || []).map((u) => [u[0], u[1] === null || u[1] === undefined ? end : u[1]]),
    };
  }

  function rowOf(laneId) {
    const r = state.rowOfLane.get(laneId);
    return r === undefined ? null : r;
  }

  function laneLabel(laneId) {
    const r = rowOf(laneId);
    return r === null ? String(laneId) : state.lanes[r - 1].label;
  }

  /** Where the retry arrow ends: the retry's first point (its waiting bar's start). */
  function firstPoint(p) {
    const a = p.a;
    const t = a.submitted !== null && a.submitted !== undefined ? a.submitted : p.lo;
    return p.segs.length ? [t, p.segs[0].row] : null;
  }

  /** Where the retry arrow starts: the end of the attempt's last segment. */
  function lastPoint(p) {
    if (!p.segs.length) return null;
    const s = p.segs[p.segs.length - 1];
    return [s.to, s.row];
  }

  function applyTimeline(answer) {
    // An experiment whose log is still empty has no span: "now" keeps the axis sane.
    const start = typeof answer.start === "number" ? answer.start : Date.now();
    const end = typeof answer.end === "number" ? answer.end : start;
    state.span = { start, end: Math.max(end, start + 1) };
    state.status = answer.status || state.status;
    state.optimizeMode = answer.optimizeMode || state.optimizeMode;
    state.lanes = answer.lanes || [];
    state.rowOfLane = new Map(state.lanes.map((l, i) => [l.id, i + 1]));
    state.attempts = (answer.attempts || []).map((a) => prepareAttempt(a, state.span.end));
    state.byKey = new Map(state.attempts.map((p) => [p.key, p]));
    state.links = [];
    for (const p of state.attempts) {
      const prev = p.a.retryOf ? state.byKey.get(p.a.retryOf) : null;
      if (!prev) continue;
      const from = lastPoint(prev);
      const to = firstPoint(p);
      if (from && to) state.links.push({ from, to, key: p.key, retryOf: prev.key });
    }
    state.laneIndex = buildLaneIndex(state.attempts);
    state.clusters = (answer.clusters || []).filter((c) => rowOf(c.lane) !== null);
    state.markers = (answer.markers || []).slice().sort((x, y) => x.time - y.time);
    state.markersOmitted = answer.markersOmitted || 0;
  }

  /** Per row, the attempts' pieces sorted by start, with a running max of their ends (for hit tests). */
  function buildLaneIndex(prepared) {
    const rows = new Map();
    const add = (row, from, to, p, kind) => {
      if (!rows.has(row)) rows.set(row, []);
      rows.get(row).push({ from, to, p, kind });
    };
    for (const p of prepared) {
      const a = p.a;
      if (!p.segs.length) continue;
      if (p.started && a.submitted !== null && a.submitted !== undefined && a.started > a.submitted) {
        add(p.segs[0].row, a.submitted, a.started, p, "wait");
      }
      p.segs.forEach((s) => add(s.row, s.from, s.to, p, p.started ? "bar" : "wait"));
    }
    const index = new Map();
    for (const [row, items] of rows) {
      items.sort((x, y) => x.from - y.from);
      const maxTo = new Float64Array(items.length);
      let m = -Infinity;
      items.forEach((it, i) => {
        m = Math.max(m, it.to);
        maxTo[i] = m;
      });
      index.set(row, { items, maxTo });
    }
    return index;
  }

  /** The attempt drawn at chart pixel (x, y), or null: a bar rather than a waiting stretch. */
  function attemptAt(x, y) {
    const g = gridRect();
    if (x < g.x || x > g.x + g.width || y < g.y || y > g.y + g.height) return null;
    const row = Math.floor(((y - g.y) / g.height) * state.layout.rows);
    const lane = state.laneIndex && state.laneIndex.get(row);
    if (!lane) return null;
    const t = xToTime(x);
    const tol = (3 * (state.view.to - state.view.from)) / g.width;
    let lo = 0;
    let hi = lane.items.length - 1;
    let last = -1;
    while (lo <= hi) {
      const mid = (lo + hi) >> 1;
      if (lane.items[mid].from <= t + tol) {
        last = mid;
        lo = mid + 1;
      } else {
        hi = mid - 1;
      }
    }
    let best = null;
    let bestScore = Infinity;
    for (let i = last; i >= 0 && lane.maxTo[i] >= t - tol; i--) {
      const it = lane.items[i];
      if (it.to < t - tol) continue;
      const dist = t < it.from ? it.from - t : t > it.to ? t - it.to : 0;
      const score = dist + (it.kind === "bar" ? 0 : tol / 2);
      if (score < bestScore) {
        best = it.p;
        bestScore = score;
      }
    }
    return best;
  }

  // ------------------------------------------------------------------------------------------------
  // Chart: layout

  function measureLabelWidth(labels) {
    const ctx = document.createElement("canvas").getContext("2d");
    ctx.font = "12px " + FONT;
    let w = 0;
    for (const l of labels) w = Math.max(w, ctx.measureText(l).width);
    return w;
  }

  function computeLayout() {
    const rows = state.lanes.length + 1;
    const labels = [EXPERIMENT_ROW].concat(state.lanes.map((l) => String(l.label)));
    const left = Math.round(clamp(measureLabelWidth(labels) + 26, 120, 340));
    const rowH = clamp(Math.floor(LAYOUT.maxRowsHeight / rows), LAYOUT.rowMin, LAYOUT.rowMax);
    return {
      left,
      right: LAYOUT.right,
      top: LAYOUT.top,
      bottom: LAYOUT.bottom,
      rowH,
      rows,
      height: LAYOUT.top + rows * rowH + LAYOUT.bottom,
    };
  }

  function gridRect() {
    const L = state.layout;
    const chart = state.chart;
    return {
      x: L.left,
      y: L.top,
      width: Math.max(1, chart.getWidth() - L.left - L.right),
      height: Math.max(1, chart.getHeight() - L.top - L.bottom),
    };
  }

  /** The plot's width in pixels before the chart exists (the first request's px). */
  function expectedPlotWidth(container, layout) {
    return Math.max(1, container.clientWidth - layout.left - layout.right);
  }

  function axisPadding() {
    // A little room on both sides so that the first and the last bars are not glued to the edges.
    return Math.max(1, (state.span.end - state.span.start) * 0.01);
  }

  // ------------------------------------------------------------------------------------------------
  // Chart: drawing (custom series, canvas)

  let hatchPattern = null;

  /** Amber diagonal stripes for UNKNOWN periods, as a canvas pattern. */
  function hatch() {
    if (hatchPattern) return hatchPattern;
    const c = document.createElement("canvas");
    c.width = 8;
    c.height = 8;
    const ctx = c.getContext("2d");
    ctx.fillStyle = "rgba(255, 214, 102, 0.55)";
    ctx.fillRect(0, 0, 8, 8);
    ctx.strokeStyle = "#b77900";
    ctx.lineWidth = 2;
    ctx.beginPath();
    ctx.moveTo(-2, 10);
    ctx.lineTo(10, -2);
    ctx.moveTo(-2, 2);
    ctx.lineTo(2, -2);
    ctx.moveTo(6, 10);
    ctx.lineTo(10, 6);
    ctx.stroke();
    hatchPattern = { image: c, repeat: "repeat" };
    return hatchPattern;
  }

  function rectBetween(api, coordSys, t1, t2, row, h) {
    const p1 = api.coord([t1, row]);
    const p2 = api.coord([t2, row]);
    let x = Math.min(p1[0], p2[0]);
    let w = Math.abs(p2[0] - p1[0]);
    if (w < 1) {
      // Bars shorter than a pixel stay visible (and clickable).
      x -= (1 - w) / 2;
      w = 1;
    }
    return echarts.graphic.clipRectByRect({ x, y: p1[1] - h / 2, width: w, height: h }, coordSys);
  }

  function segmentAt(p, t) {
    for (const s of p.segs) if (t >= s.from && t <= s.to) return s;
    return p.segs.length ? p.segs[p.segs.length - 1] : null;
  }

  // Every item is returned with emphasisDisabled: a hover highlight changes no colour here but would
  // repaint the whole bar layer at each hover (in dense mode, tens of thousands of rects).

  function renderAttempt(params, api) {
    const p = state.attempts[api.value(3)];
    if (!p || !p.segs.length) return null;
    const cs = params.coordSys;
    const band = api.size([0, 1])[1];
    const barH = Math.max(6, band * 0.58);
    const waitH = Math.max(3, band * 0.18);
    const a = p.a;
    const color = outcomeColor(a.outcome);
    const selected = p.key === state.selectedKey;
    const children = [];
    const selStroke = selected ? { stroke: "#0b1220", lineWidth: 2 } : {};

    // Zoomed far out (thousands of attempts in a file), an attempt narrower than a few pixels is one
    // rect: the waiting stretch, joins, hatches and ticks would not be seen, and each costs a node.
    const x0 = api.coord([p.lo, 0])[0];
    const x1 = api.coord([p.hi, 0])[0];
    if (x1 < cs.x || x0 > cs.x + cs.width) return null;
    if (x1 - x0 < 3 && p.segs.length === 1 && !selected) {
      const s = p.segs[0];
      const r = rectBetween(api, cs, s.from, s.to, s.row, p.started ? barH : waitH + 2);
      return r ? { type: "rect", shape: r, style: { fill: p.started ? color : COLORS.WAITING }, emphasisDisabled: true } : null;
    }

    if (!p.started) {
      // Never started: one segment in its platform's "not started" lane, drawn as a waiting bar.
      const s = p.segs[0];
      const r = rectBetween(api, cs, s.from, s.to, s.row, waitH + 2);
      if (r) {
        children.push({
          type: "rect",
          shape: r,
          style: Object.assign({ fill: a.outcome === "WAITING" ? COLORS.WAITING : color, opacity: a.outcome === "WAITING" ? 1 : 0.75 }, selStroke),
        });
      }
      return children.length ? { type: "group", children, emphasisDisabled: true } : null;
    }

    // The waiting stretch, submitted -> started, thin, in the lane of the first segment.
    if (a.submitted !== null && a.submitted !== undefined && a.started > a.submitted) {
      const r = rectBetween(api, cs, a.submitted, a.started, p.segs[0].row, waitH);
      if (r) children.push({ type: "rect", shape: r, style: { fill: COLORS.WAITING } });
    }

    // Segments: full-height bars; consecutive segments in different lanes are joined (re-attachment).
    let barPx = 0;
    p.segs.forEach((s, i) => {
      const r = rectBetween(api, cs, s.from, s.to, s.row, barH);
      if (r) {
        barPx += r.width;
        children.push({ type: "rect", shape: r, style: Object.assign({ fill: color }, selStroke) });
      }
      const next = p.segs[i + 1];
      if (next && next.row !== s.row) {
        const q1 = api.coord([s.to, s.row]);
        const q2 = api.coord([next.from, next.row]);
        children.push({
          type: "line",
          shape: { x1: q1[0], y1: q1[1], x2: q2[0], y2: q2[1] },
          style: { stroke: color, lineWidth: 1.5, lineDash: [4, 3] },
        });
      }
    });

    // UNKNOWN periods: hatched over the part of the bar they cover, in each segment's lane.
    for (const [uf, ut] of p.unknown) {
      let drawnAny = false;
      for (const s of p.segs) {
        const f = Math.max(uf, s.from);
        const t = Math.min(ut, s.to);
        if (f > t) continue;
        const r = rectBetween(api, cs, f, t, s.row, barH);
        if (r) children.push({ type: "rect", shape: r, style: { fill: hatch() } });
        drawnAny = true;
      }
      if (!drawnAny) {
        const s = segmentAt(p, uf);
        const r = rectBetween(api, cs, uf, ut, s.row, barH);
        if (r) children.push({ type: "rect", shape: r, style: { fill: hatch() } });
      }
    }

    // Trial markers on the bar: metric ticks (only where they have room), cancel and early stop.
    const events = a.events || [];
    if (events.length && barPx > 0) {
      const roomy = barPx / events.length >= 3;
      for (const [t, kind] of events) {
        if (kind === "PERIODICAL" && !roomy) continue;
        const s = segmentAt(p, t);
        const q = api.coord([t, s.row]);
        if (q[0] < cs.x || q[0] > cs.x + cs.width) continue;
        const top = q[1] - barH / 2;
        if (kind === "PERIODICAL") {
          children.push({ type: "line", shape: { x1: q[0], y1: top + barH * 0.55, x2: q[0], y2: top + barH }, style: { stroke: "rgba(255,255,255,0.85)", lineWidth: 1 } });
        } else if (kind === "FINAL") {
          children.push({ type: "line", shape: { x1: q[0], y1: top, x2: q[0], y2: top + barH }, style: { stroke: "#ffffff", lineWidth: 2 } });
        } else {
          // cancel / early stop: a small downward triangle above the bar
          const c = kind === "cancel" ? COLORS.USER_CANCELED : COLORS.EARLY_STOPPED;
          children.push({
            type: "polygon",
            shape: { points: [[q[0] - 4, top - 6], [q[0] + 4, top - 6], [q[0], top]] },
            style: { fill: c, stroke: "#1f2937", lineWidth: 0.6 },
          });
        }
      }
    }
    return children.length ? { type: "group", children, emphasisDisabled: true } : null;
  }

  function pathRect(x, y, w, h) {
    return "M" + x.toFixed(1) + " " + y.toFixed(1) + "h" + w.toFixed(1) + "v" + h.toFixed(1) + "h" + (-w).toFixed(1) + "z";
  }

  /** Dense mode: one lane's attempts as one path per colour (bars, waiting stretches, UNKNOWN hatches). */
  function renderDenseLane(params, api) {
    const row = api.value(0);
    const lane = state.laneIndex.get(row);
    if (!lane) return null;
    const cs = params.coordSys;
    const band = api.size([0, 1])[1];
    const barH = Math.max(6, band * 0.58);
    const waitH = Math.max(3, band * 0.18);
    const yc = api.coord([state.span.start, row])[1];
    // Time -> x is linear: two coordinates give it for every item of the lane.
    const xa = api.coord([state.span.start, row])[0];
    const xb = api.coord([state.span.end, row])[0];
    const k = (xb - xa) / (state.span.end - state.span.start);
    const left = cs.x;
    const right = cs.x + cs.width;
    const paths = new Map(); // fill -> [path strings]
    const push = (fill, str) => {
      if (!paths.has(fill)) paths.set(fill, []);
      paths.get(fill).push(str);
    };
    const hatches = [];
    for (const it of lane.items) {
      let x1 = xa + (it.from - state.span.start) * k;
      let x2 = xa + (it.to - state.span.start) * k;
      if (x2 < left || x1 > right) continue;
      x1 = Math.max(x1, left);
      x2 = Math.min(x2, right);
      const w = Math.max(1, x2 - x1);
      if (it.kind === "wait") {
        const fill = it.p.started || it.p.a.outcome === "WAITING" ? COLORS.WAITING : outcomeColor(it.p.a.outcome);
        push(fill, pathRect(x1, yc - waitH / 2, w, waitH));
        continue;
      }
      push(outcomeColor(it.p.a.outcome), pathRect(x1, yc - barH / 2, w, barH));
      for (const [uf, ut] of it.p.unknown) {
        const f = Math.max(uf, it.from);
        const t = Math.min(ut, it.to);
        if (f > t) continue;
        const u1 = Math.max(left, xa + (f - state.span.start) * k);
        const u2 = Math.min(right, xa + (t - state.span.start) * k);
        if (u2 >= u1) hatches.push(pathRect(u1, yc - barH / 2, Math.max(1, u2 - u1), barH));
      }
    }
    const children = [];
    for (const [fill, parts] of paths) children.push({ type: "path", shape: { pathData: parts.join("") }, style: { fill } });
    if (hatches.length) children.push({ type: "path", shape: { pathData: hatches.join("") }, style: { fill: hatch() } });
    return children.length ? { type: "group", children, emphasisDisabled: true } : null;
  }

  function renderLink(params, api) {
    const link = state.links[params.dataIndex];
    if (!link) return null;
    const p1 = api.coord(link.from);
    const p2 = api.coord(link.to);
    const dx = Math.max(18, Math.abs(p2[0] - p1[0]) / 2);
    return {
      type: "group",
      children: [
        {
          type: "bezierCurve",
          shape: { x1: p1[0], y1: p1[1], cpx1: p1[0] + dx, cpy1: p1[1], cpx2: p2[0] - dx, cpy2: p2[1], x2: p2[0] - 5, y2: p2[1] },
          style: { stroke: "#475569", lineWidth: 1.3, fill: null },
        },
        {
          type: "polygon",
          shape: { points: [[p2[0], p2[1]], [p2[0] - 7, p2[1] - 4], [p2[0] - 7, p2[1] + 4]] },
          style: { fill: "#475569" },
        },
      ],
    };
  }

  function renderCluster(params, api) {
    const c = state.clusters[params.dataIndex];
    if (!c) return null;
    const cs = params.coordSys;
    const row = rowOf(c.lane);
    const band = api.size([0, 1])[1];
    const h = Math.max(6, band * 0.58);
    const r = rectBetween(api, cs, c.from, c.to, row, h);
    if (!r) return null;
    // The cluster's bar split across its height by outcome, in the legend's order.
    const children = [];
    const total = Object.values(c.outcomes || {}).reduce((s, n) => s + n, 0) || 1;
    let y = r.y;
    const keys = Object.keys(c.outcomes || {}).sort((x, z) => OUTCOMES.indexOf(x) - OUTCOMES.indexOf(z));
    for (const k of keys) {
      const part = (c.outcomes[k] / total) * r.height;
      if (part <= 0) continue;
      children.push({ type: "rect", shape: { x: r.x, y, width: r.width, height: part }, style: { fill: outcomeColor(k) } });
      y += part;
    }
    children.push({ type: "rect", shape: r, style: { fill: null, stroke: "rgba(15,23,42,0.35)", lineWidth: 1 } });
    if (r.width > 28) {
      children.push({
        type: "text",
        style: {
          x: r.x + r.width / 2, y: r.y + r.height / 2, text: String(c.count), align: "center", verticalAlign: "middle",
          fill: "#fff", font: "600 11px " + FONT, stroke: "rgba(0,0,0,0.45)", lineWidth: 2,
        },
      });
    }
    return { type: "group", children, emphasisDisabled: true };
  }

  let markerLabelRight = -Infinity;

  function renderMarker(params, api) {
    const m = state.markers[params.dataIndex];
    if (!m) return null;
    const cs = params.coordSys;
    const q = api.coord([m.time, 0]);
    // Markers come in time order; a label is drawn only where it does not run into the previous one.
    if (params.dataIndexInside === 0) markerLabelRight = -Infinity;
    if (q[0] < cs.x - 1 || q[0] > cs.x + cs.width + 1) return null;
    const color = MARKER_COLORS[m.kind] || OTHER_COLOR;
    const children = [
      { type: "line", silent: true, shape: { x1: q[0], y1: q[1], x2: q[0], y2: cs.y + cs.height }, style: { stroke: color, lineWidth: 1, lineDash: [2, 3], opacity: 0.55 } },
      { type: "polygon", shape: { points: [[q[0], q[1] - 6], [q[0] + 6, q[1]], [q[0], q[1] + 6], [q[0] - 6, q[1]]] }, style: { fill: color, stroke: "#fff", lineWidth: 1 } },
    ];
    const full = String(m.text || m.kind || "");
    const label = full.length > 28 ? full.slice(0, 27) + "…" : full;
    const width = label.length * 6.2;
    // Right of the diamond where it fits, else left of it; never over the previous label.
    let lx = q[0] + 9;
    let align = "left";
    if (lx + width > cs.x + cs.width) {
      lx = q[0] - 9;
      align = "right";
    }
    const left = align === "left" ? lx : lx - width;
    if (label && left > markerLabelRight + 6 && left >= cs.x) {
      children.push({
        type: "text",
        silent: true,
        style: { x: lx, y: q[1], text: label, align, verticalAlign: "middle", fill: "#334155", font: "11px " + FONT },
      });
      markerLabelRight = left + width;
    }
    return { type: "group", children, emphasisDisabled: true };
  }

  // ------------------------------------------------------------------------------------------------
  // Chart: tooltips (every data string escaped)

  function tooltipFor(params) {
    if (params.seriesId === "attempts") return attemptTooltip(state.attempts[params.value[3]]);
    if (params.seriesId === "dense") return attemptTooltip(attemptAt(state.mouse[0], state.mouse[1]));
    if (params.seriesId === "clusters") return clusterTooltip(state.clusters[params.dataIndex]);
    if (params.seriesId === "markers") return markerTooltip(state.markers[params.dataIndex]);
    return "";
  }

  function tipRow(label, value) {
    return '<div class="tl-tip-row"><span class="tl-tip-k">' + esc(label) + "</span> " + esc(value) + "</div>";
  }

  function attemptTooltip(p) {
    if (!p) return "";
    const a = p.a;
    const lanes = [...new Set(p.segs.map((s) => laneLabel(s.lane)))];
    let html = '<div class="tl-tip-title"><span class="tl-tip-dot" style="background:' + outcomeColor(a.outcome) + '"></span>' +
      "trial " + esc(a.trial) + ", attempt " + esc(a.attempt) + ' <span class="tl-tip-outcome">' + esc(a.outcome) + "</span></div>";
    html += tipRow("submitted", fmtTime(a.submitted));
    if (a.started !== null && a.started !== undefined) html += tipRow("started", fmtTime(a.started) + "  (waited " + fmtDuration(a.started - a.submitted) + ")");
    if (a.ended !== null && a.ended !== undefined) html += tipRow("ended", fmtTime(a.ended) + (a.started ? "  (ran " + fmtDuration(a.ended - a.started) + ")" : ""));
    html += tipRow(lanes.length > 1 ? "lanes" : "lane", lanes.join(" → "));
    if (a.retryOf) html += tipRow("retry of", a.retryOf);
    if (p.unknown.length) html += tipRow("unknown", p.unknown.map((u) => fmtDuration(u[1] - u[0])).join(", "));
    if (a.metrics !== null && a.metrics !== undefined) html += tipRow("metrics", a.metrics);
    if (a.message) html += tipRow("message", String(a.message).slice(0, 300));
    html += '<div class="tl-tip-hint">click for the history, metrics and output</div>';
    return html;
  }

  function clusterTooltip(c) {
    if (!c) return "";
    let html = '<div class="tl-tip-title">' + esc(c.count) + " attempts · " + esc(laneLabel(c.lane)) + "</div>";
    html += tipRow("from", fmtTime(c.from));
    html += tipRow("to", fmtTime(c.to));
    for (const k of Object.keys(c.outcomes || {}).sort((x, z) => OUTCOMES.indexOf(x) - OUTCOMES.indexOf(z))) {
      html += '<div class="tl-tip-row"><span class="tl-tip-dot" style="background:' + outcomeColor(k) + '"></span>' + esc(k) + " " + esc(c.outcomes[k]) + "</div>";
    }
    html += '<div class="tl-tip-hint">click to zoom in</div>';
    return html;
  }

  function markerTooltip(m) {
    if (!m) return "";
    return '<div class="tl-tip-title">' + esc(m.kind) + "</div>" + tipRow("", m.text) + tipRow("at", fmtTime(m.time)) + tipRow("id", m.id) +
      '<div class="tl-tip-hint">click to put the cursor here</div>';
  }

  // ------------------------------------------------------------------------------------------------
  // Chart: options and redraw

  function chartOption() {
    const L = state.layout;
    const pad = axisPadding();
    const labels = [EXPERIMENT_ROW].concat(state.lanes.map((l) => String(l.label)));
    return {
      animation: false,
      useUTC: true,
      textStyle: { fontFamily: FONT },
      grid: { left: L.left, right: L.right, top: L.top, bottom: L.bottom, containLabel: false },
      tooltip: {
        trigger: "item",
        confine: true,
        transitionDuration: 0,
        backgroundColor: "#ffffff",
        borderColor: "#d5dae1",
        padding: [8, 10],
        textStyle: { color: "#1f2937", fontSize: 12 },
        extraCssText: "box-shadow: 0 4px 16px rgba(15,23,42,0.12); max-width: 420px; white-space: normal;",
        formatter: tooltipFor,
      },
      xAxis: {
        type: "time",
        min: state.span.start - pad,
        max: state.span.end + pad,
        axisLine: { lineStyle: { color: "#9aa4b2" } },
        axisLabel: { color: "#475569", hideOverlap: true },
        splitLine: { show: true, lineStyle: { color: "#eef1f5" } },
      },
      yAxis: {
        type: "category",
        inverse: true,
        data: labels,
        axisTick: { show: false },
        axisLine: { lineStyle: { color: "#9aa4b2" } },
        axisLabel: { color: "#334155", fontSize: 12, width: L.left - 16, overflow: "truncate" },
        splitLine: { show: true, interval: 0, lineStyle: { color: "#e7eaef" } },
        splitArea: { show: true, interval: 0, areaStyle: { color: ["#f4f6f9", "#ffffff"] } },
      },
      dataZoom: [
        { id: "inside", type: "inside", xAxisIndex: 0, filterMode: "none", throttle: 60 },
        {
          id: "slider", type: "slider", xAxisIndex: 0, filterMode: "none", height: 20, bottom: 12,
          borderColor: "#d5dae1", fillerColor: "rgba(47,125,225,0.12)",
          handleStyle: { color: "#ffffff", borderColor: "#64748b" },
          labelFormatter: (v) => new Date(v).toISOString().slice(11, 19),
          textStyle: { color: "#475569" },
        },
      ],
      series: seriesOptions(),
    };
  }

  function countInView() {
    let n = 0;
    for (const p of state.attempts) if (p.hi >= state.view.from && p.lo <= state.view.to) n++;
    return n;
  }

  function seriesOptions() {
    state.dense = countInView() > DENSE_ABOVE;
    const attemptItem = (p, i) => [p.lo, p.hi, p.segs.length ? p.segs[0].row : 1, i];
    let attemptData;
    if (state.dense) {
      // Only the selected attempt is its own item (outlined); the others are in the lanes' paths.
      const i = state.attempts.findIndex((p) => p.key === state.selectedKey);
      attemptData = i < 0 ? [] : [attemptItem(state.attempts[i], i)];
    } else {
      attemptData = state.attempts.map(attemptItem);
    }
    const common = { type: "custom", clip: true, progressive: 0 };
    return [
      Object.assign({ id: "markers", renderItem: renderMarker, z: 1, encode: { x: 0, y: 1 }, data: state.markers.map((m, i) => [m.time, 0, i]) }, common),
      Object.assign({ id: "clusters", renderItem: renderCluster, z: 2, encode: { x: [0, 1], y: 2 }, data: state.clusters.map((c, i) => [c.from, c.to, rowOf(c.lane), i]) }, common),
      Object.assign({
        id: "dense", renderItem: renderDenseLane, z: 2, encode: { y: 0 },
        data: state.dense ? [...state.laneIndex.keys()].map((row) => [row]) : [],
      }, common),
      Object.assign({ id: "attempts", renderItem: renderAttempt, z: 3, encode: { x: [0, 1], y: 2 }, data: attemptData }, common),
      Object.assign({
        id: "links", renderItem: renderLink, z: 4, silent: true, encode: { x: [0, 1], y: 2 },
        // Retry arrows between thousands of thin bars would only be noise: not in dense mode.
        data: state.dense ? [] : state.links.map((l, i) => [l.from[0], l.to[0], l.to[1], i]),
      }, common),
    ];
  }

  /** Draws the current state; `full` re-lays the axes (lanes or span changed). */
  function redraw(full) {
    const chart = state.chart;
    state.pendingRender = true;
    if (full) {
      const layout = computeLayout();
      const resized = !state.layout || layout.height !== state.layout.height;
      state.layout = layout;
      if (resized) {
        $("chart").style.height = layout.height + "px";
        chart.resize();
      }
      const option = chartOption();
      option.dataZoom[0].startValue = option.dataZoom[1].startValue = state.view.from;
      option.dataZoom[0].endValue = option.dataZoom[1].endValue = state.view.to;
      chart.setOption(option, { replaceMerge: ["series"] });
    } else {
      chart.setOption({ series: seriesOptions() }, { replaceMerge: ["series"] });
    }
    positionCursor();
    updateStatusLine();
  }

  function onChartFinished() {
    if (!state.pendingRender) return;
    state.pendingRender = false;
    hooks.renders += 1;
  }

  // ------------------------------------------------------------------------------------------------
  // The cursor line: zrender elements on top of the chart, dragged horizontally
  //
  // They are added to the chart's zrender instance rather than through setOption({graphic}), because
  // every setOption re-runs all series' renderItem: moving the cursor (drag, play) must not redraw
  // thousands of bars at each frame.

  function createCursor() {
    const zr = state.chart.getZr();
    const G = echarts.graphic;
    // A layer (zlevel) of their own: moving them repaints that canvas only, not the bars under it.
    state.shade = new G.Rect({ silent: true, zlevel: 1, z: 50, shape: { x: 0, y: 0, width: 0, height: 0 }, style: { fill: "rgba(255,255,255,0.42)" } });
    const group = new G.Group({ draggable: "horizontal" });
    group.add(new G.Rect({ zlevel: 1, z: 100, cursor: "ew-resize", shape: { x: -5, y: 0, width: 10, height: 1 }, style: { fill: "rgba(0,0,0,0)" } }));
    group.add(new G.Line({ zlevel: 1, z: 101, cursor: "ew-resize", shape: { x1: 0, y1: 0, x2: 0, y2: 1 }, style: { stroke: "#0f172a", lineWidth: 2 } }));
    group.add(new G.Polygon({ zlevel: 1, z: 102, cursor: "ew-resize", shape: { points: [[-7, -12], [7, -12], [7, -4], [0, 2], [-7, -4]] }, style: { fill: "#0f172a" } }));
    group.on("dragstart", () => {
      state.dragging = true;
    });
    group.on("drag", () => onCursorDrag(group, false));
    // A click (no drag) on the line goes to the bar under it, as if the line were not there.
    group.on("click", (e) => {
      const p = attemptAt(e.offsetX, e.offsetY);
      if (p) openDetail(p.a.trial, p.a.attempt);
    });
    group.on("dragend", () => {
      state.dragging = false;
      onCursorDrag(group, true);
    });
    zr.add(state.shade);
    zr.add(group);
    state.cursorGroup = group;
  }

  function timeToX(ms) {
    return state.chart.convertToPixel({ xAxisIndex: 0 }, ms);
  }

  function xToTime(x) {
    return state.chart.convertFromPixel({ xAxisIndex: 0 }, x);
  }

  function positionCursor() {
    const group = state.cursorGroup;
    if (!group || !state.cursor) return;
    const g = gridRect();
    const x = timeToX(Math.min(state.cursor.ms, state.span.end));
    const visible = isFinite(x) && x >= g.x - 0.5 && x <= g.x + g.width + 0.5;
    const [hit, line, handle] = group.children();
    hit.setShape({ y: g.y, height: g.height });
    line.setShape({ y1: g.y, y2: g.y + g.height });
    handle.attr({ y: g.y });
    group.attr({ x: visible ? x : -1000, y: 0, ignore: !visible });
    // The part of the chart after the cursor is veiled: what is drawn there has not happened yet.
    const sx = visible ? x : (state.cursor.ms < state.view.from ? g.x : g.x + g.width);
    state.shade.setShape({ x: sx, y: g.y, width: Math.max(0, g.x + g.width - sx), height: g.height });
  }

  function onCursorDrag(group, final) {
    if (state.playing) stopPlay(); // the person took the cursor
    const g = gridRect();
    const x = clamp(group.x, g.x, g.x + g.width);
    if (x !== group.x) group.attr({ x });
    const t = xToTime(x);
    if (state.head && t >= state.head.ms) setCursor(state.head, true);
    else setCursor(timeCursor(Math.max(t, state.span.start)), false);
    if (final) scheduleCursorUpdate();
  }

  // ------------------------------------------------------------------------------------------------
  // Cursor state -> label, header and table (once per frame)

  function setCursor(cursor, following) {
    state.cursor = cursor;
    state.following = !!following;
    scheduleCursorUpdate();
  }

  function setCursorHead() {
    if (state.head) setCursor(state.head, true);
  }

  const scheduleCursorUpdate = perFrame(updateCursorViews);

  function updateCursorViews() {
    if (!state.cursor || !state.vix) return;
    positionCursor();
    updateCursorLabel();
    const rows = currentRows();
    updateSummary(rows);
    scheduleTable(rows);
  }

  function scheduleTable(rows) {
    const now = performance.now();
    const moving = state.dragging || state.playing;
    if (!moving || now - state.tableAt >= TABLE_INTERVAL_MS) {
      clearTimeout(state.tableTimer);
      state.tableTimer = null;
      renderTableNow(rows);
    } else if (!state.tableTimer) {
      // A trailing rewrite, so that the table always ends up at the cursor's last position.
      state.tableTimer = setTimeout(() => {
        state.tableTimer = null;
        renderTableNow(currentRows());
      }, TABLE_INTERVAL_MS - (now - state.tableAt));
    }
  }

  function renderTableNow(rows) {
    state.tableAt = performance.now();
    renderTable(rows, state.dragging || state.playing ? TABLE_LIMIT_MOVING : TABLE_LIMIT);
    // The line, the header and the table are redrawn: tests wait on this counter as on a chart redraw.
    if (hooks.ready) hooks.renders += 1;
  }

  function currentRows() {
    if (!state.rowsCache || state.rowsCache.id !== state.cursor.id || state.rowsCache.vix !== state.vix) {
      state.rowsCache = { id: state.cursor.id, vix: state.vix, rows: rowsAt(state.vix, state.cursor) };
    }
    return state.rowsCache.rows;
  }

  function updateCursorLabel() {
    const c = state.cursor;
    const label = $("cursor-label");
    label.textContent = "";
    label.appendChild(el("code", null, c.exact ? c.id : "≤ " + c.ms));
    label.appendChild(document.createTextNode(" " + fmtTime(c.ms)));
    if (state.following) label.appendChild(el("span", { className: "tl-head-tag" }, "head"));
    label.classList.toggle("tl-following", state.following);
  }

  function updateSummary(rows) {
    const { counts, best } = summarize(rows, state.vix.optimizeMode || state.optimizeMode);
    const status = experimentStatusAt(state.vix, state.cursor) || (state.following ? state.status : null) || "—";
    const badge = $("exp-status");
    badge.textContent = status;
    badge.dataset.status = status;

    const box = $("counts");
    const frag = document.createDocumentFragment();
    const order = [...counts.keys()].sort((x, z) => rank(x) - rank(z) || (x < z ? -1 : 1));
    for (const s of order) frag.appendChild(el("span", { "data-status": s, className: "tl-count" }, s + " " + counts.get(s)));
    box.replaceChildren(frag);

    const bestEl = $("best");
    bestEl.textContent = "";
    if (best) {
      bestEl.appendChild(el("strong", null, fmtMetric(best.value)));
      bestEl.appendChild(document.createTextNode(" (" + best.trial + ")"));
      bestEl.dataset.trial = best.trial;
      bestEl.dataset.value = String(best.value);
    } else {
      bestEl.textContent = "—";
      delete bestEl.dataset.trial;
      delete bestEl.dataset.value;
    }
  }

  function rank(status) {
    const i = OUTCOMES.indexOf(status);
    return i < 0 ? OUTCOMES.length : i;
  }

  // ------------------------------------------------------------------------------------------------
  // The trial table

  function renderTable(rows, limit) {
    const q = $("trial-filter").value.trim();
    const qUpper = q.toUpperCase();
    const shown = q ? rows.filter((r) => r.trial.includes(q) || String(r.status).includes(qUpper)) : rows.slice();
    // Most recently changed first; only the first TABLE_LIMIT rows are put in the DOM.
    shown.sort((a, b) => b.ms - a.ms || b.seq - a.seq || (a.trial < b.trial ? -1 : 1));
    const bestTrial = $("best").dataset.trial;
    const tbody = $("trials").tBodies[0];
    const n = Math.min(shown.length, limit);
    // The rows' elements are kept and only rewritten where their content changed: while the cursor
    // is dragged this runs at every frame, and rebuilding 200 rows each time makes the page stutter.
    for (let i = 0; i < n; i++) {
      const tr = tbody.rows[i] || tbody.appendChild(newTableRow());
      fillTableRow(tr, shown[i], bestTrial);
    }
    while (tbody.rows.length > n) tbody.lastElementChild.remove();
    const more = $("trials-more");
    if (shown.length > limit) {
      more.hidden = false;
      more.textContent = shown.length - limit + " more";
    } else if (!shown.length) {
      more.hidden = false;
      more.textContent = rows.length ? "no trial matches the filter" : "no trial exists yet at the cursor";
    } else {
      more.hidden = true;
      more.textContent = "";
    }
  }

  function newTableRow() {
    const tr = el("tr");
    tr.appendChild(el("td", { className: "tl-mono" }));
    const st = el("td");
    st.appendChild(el("span", { className: "tl-status" }));
    tr.appendChild(st);
    tr.appendChild(el("td", { className: "num" }));
    tr.appendChild(el("td", { className: "num tl-mono" }));
    return tr;
  }

  function fillTableRow(tr, r, bestTrial) {
    const attempt = r.attempt === null || r.attempt === undefined ? "" : String(r.attempt);
    const metric = fmtMetric(r.metric);
    const selected = state.selectedKey === r.trial + "/" + r.attempt;
    const sig = r.trial + "\u0000" + r.status + "\u0000" + attempt + "\u0000" + metric + "\u0000" + (r.trial === bestTrial) + "\u0000" + selected;
    if (tr.tlSig === sig) return;
    tr.tlSig = sig;
    tr.dataset.trial = r.trial;
    tr.dataset.status = r.status;
    tr.dataset.attempt = attempt;
    tr.classList.toggle("tl-best-row", r.trial === bestTrial);
    tr.classList.toggle("tl-selected-row", selected);
    const cells = tr.cells;
    cells[0].textContent = r.trial;
    cells[1].firstChild.dataset.status = r.status;
    cells[1].firstChild.textContent = r.status;
    cells[2].textContent = attempt;
    cells[3].textContent = metric;
  }

  function onTableClick(event) {
    const tr = event.target.closest("tr[data-trial]");
    if (!tr) return;
    openDetail(tr.dataset.trial, Number(tr.dataset.attempt));
  }

  // ------------------------------------------------------------------------------------------------
  // The detail panel

  async function openDetail(trial, attempt) {
    const seq = ++state.detailSeq;
    const key = trial + "/" + attempt;
    state.selectedKey = key;
    redraw(false);
    scheduleCursorUpdate();

    const panel = $("detail");
    panel.hidden = false;
    $("detail-title").textContent = "trial " + trial + ", attempt " + attempt;
    $("detail-summary").textContent = detailSummary(state.byKey.get(key));
    $("detail-history").replaceChildren(el("li", { className: "tl-muted" }, "loading…"));
    $("detail-metrics-other").replaceChildren();
    $("detail-output").textContent = "";
    $("detail-output").classList.remove("tl-error");
    $("detail-output-note").textContent = "";
    setMetrics([], null);

    let answer;
    try {
      answer = await state.source.attempt(trial, attempt);
    } catch (err) {
      if (seq !== state.detailSeq) return;
      $("detail-history").replaceChildren(el("li", { className: "tl-error" }, err.message || String(err)));
      return;
    }
    if (seq !== state.detailSeq) return; // another attempt was clicked meanwhile
    fillHistory(answer.history || [], attempt);
    fillMetrics(answer.metrics || []);
    fillOutput(answer.output);
  }

  function detailSummary(p) {
    if (!p) return "";
    const a = p.a;
    const parts = [a.outcome];
    if (a.started !== null && a.started !== undefined && a.ended !== null && a.ended !== undefined) parts.push("ran " + fmtDuration(a.ended - a.started));
    parts.push([...new Set(p.segs.map((s) => laneLabel(s.lane)))].join(" → "));
    if (a.retryOf) parts.push("retry of " + a.retryOf);
    if (a.message) parts.push(String(a.message));
    return parts.join(" · ");
  }

  function fillHistory(history, attempt) {
    const frag = document.createDocumentFragment();
    for (const h of history) {
      const li = el("li", { "data-type": h.type, "data-id": h.id });
      if (h.attempt !== null && h.attempt !== undefined && h.attempt === attempt) li.classList.add("tl-this-attempt");
      li.appendChild(el("span", { className: "tl-h-time", title: fmtTime(h.time) }, fmtTime(h.time).slice(11, 23)));
      li.appendChild(el("span", { className: "tl-h-type" }, h.type));
      li.appendChild(el("span", { className: "tl-h-attempt" }, h.attempt === null || h.attempt === undefined ? "" : "#" + h.attempt));
      li.appendChild(el("span", { className: "tl-h-summary" }, [h.source, h.summary].filter(Boolean).join(" · ")));
      frag.appendChild(li);
    }
    if (!history.length) frag.appendChild(el("li", { className: "tl-muted" }, "no history"));
    $("detail-history").replaceChildren(frag);
  }

  function fillMetrics(metrics) {
    const periodical = [];
    let final = null;
    const other = [];
    for (const m of metrics) {
      const numeric = typeof m.value === "number" && isFinite(m.value);
      if (!numeric) other.push(m);
      else if (m.type === "FINAL") final = m;
      else if (m.type === "PERIODICAL") periodical.push(m);
    }
    periodical.sort((a, b) => a.sequence - b.sequence);
    setMetrics(periodical, final);
    const list = document.createDocumentFragment();
    for (const m of other) {
      list.appendChild(el("li", null, m.type + (m.sequence !== null && m.sequence !== undefined ? " #" + m.sequence : "") + ": " + String(m.data)));
    }
    $("detail-metrics-other").replaceChildren(list);
  }

  /** The metrics line chart: x = sequence, y = value; FINAL as a marked point after the last one. */
  function setMetrics(points, final) {
    const box = $("detail-metrics");
    box.dataset.points = String(points.length);
    if (!points.length && !final) {
      if (state.metricsChart) {
        state.metricsChart.dispose();
        state.metricsChart = null;
      }
      box.replaceChildren(el("p", { className: "tl-muted tl-empty" }, "no numeric metrics"));
      return;
    }
    if (!state.metricsChart) {
      box.replaceChildren();
      state.metricsChart = echarts.init(box, null, { renderer: "canvas" });
    }
    const finalX = final && typeof final.sequence === "number" ? final.sequence : points.length ? points[points.length - 1].sequence + 1 : 0;
    state.metricsChart.setOption({
      animation: false,
      textStyle: { fontFamily: FONT },
      grid: { left: 52, right: 18, top: 18, bottom: 28 },
      tooltip: {
        trigger: "item",
        formatter: (p) => esc(p.seriesName) + " #" + esc(p.value[0]) + ": <b>" + esc(fmtMetric(p.value[1])) + "</b>",
      },
      xAxis: { type: "value", minInterval: 1, name: "sequence", nameLocation: "middle", nameGap: 20, nameTextStyle: { color: "#64748b" }, axisLabel: { color: "#64748b" }, splitLine: { lineStyle: { color: "#eef1f5" } } },
      yAxis: { type: "value", scale: true, axisLabel: { color: "#64748b" }, splitLine: { lineStyle: { color: "#eef1f5" } } },
      series: [
        { name: "PERIODICAL", type: "line", showSymbol: points.length <= 60, symbolSize: 4, lineStyle: { width: 1.8, color: COLORS.RUNNING }, itemStyle: { color: COLORS.RUNNING }, data: points.map((m) => [m.sequence, m.value]) },
        {
          name: "FINAL", type: "scatter", symbol: "pin", symbolSize: 24, itemStyle: { color: COLORS.SUCCEEDED },
          label: { show: true, position: "left", color: "#166534", fontSize: 11, formatter: (p) => "final " + fmtMetric(p.value[1]) },
          data: final ? [[finalX, final.value]] : [],
        },
      ],
    }, true);
    state.metricsChart.resize();
  }

  function fillOutput(output) {
    const pre = $("detail-output");
    const note = $("detail-output-note");
    if (!output) {
      pre.textContent = "";
      note.textContent = "(none)";
    } else if (typeof output.error === "string") {
      pre.classList.add("tl-error");
      pre.textContent = output.error;
      note.textContent = "";
    } else {
      pre.textContent = output.text || "";
      note.textContent = output.truncated ? "(the end of it)" : "";
      pre.scrollTop = pre.scrollHeight; // the end of the output is what a person looks for
    }
  }

  function closeDetail() {
    $("detail").hidden = true;
    state.detailSeq += 1;
    state.selectedKey = null;
    if (state.metricsChart) {
      state.metricsChart.dispose();
      state.metricsChart = null;
    }
    redraw(false);
    scheduleCursorUpdate();
  }

  // ------------------------------------------------------------------------------------------------
  // Windowing: pan/zoom -> the window's attempts (server) or a local filter (file)

  function readView() {
    const g = gridRect();
    const from = xToTime(g.x);
    const to = xToTime(g.x + g.width);
    if (isFinite(from) && isFinite(to) && to > from) state.view = { from, to };
  }

  function isWholeSpan() {
    const pad = axisPadding();
    return state.view.from <= state.span.start + pad * 0.5 && state.view.to >= state.span.end - pad * 0.5;
  }

  async function loadWindow() {
    const seq = ++state.windowSeq;
    if (state.windowAbort) state.windowAbort.abort();
    const abort = typeof AbortController === "function" ? new AbortController() : null;
    state.windowAbort = abort;
    const whole = isWholeSpan();
    let answer;
    try {
      answer = await state.source.timeline(whole ? null : state.view.from, whole ? null : state.view.to, gridRect().width, abort && abort.signal);
    } catch (err) {
      if (err && err.name === "AbortError") return;
      if (seq === state.windowSeq) showError(err);
      return;
    }
    if (seq !== state.windowSeq) return; // a later pan/zoom superseded this answer
    const lanesBefore = JSON.stringify(state.lanes.map((l) => [l.id, l.label]));
    const spanBefore = state.span;
    applyTimeline(answer);
    const relayout = lanesBefore !== JSON.stringify(state.lanes.map((l) => [l.id, l.label])) ||
      spanBefore.start !== state.span.start || spanBefore.end !== state.span.end;
    redraw(relayout);
    return answer;
  }

  const loadWindowSoon = debounce(loadWindow, ZOOM_DEBOUNCE_MS);

  function onDataZoom() {
    readView();
    positionCursor();
    loadWindowSoon();
  }

  /** Pans (keeping the zoom) so that time t is in view. */
  function revealTime(t) {
    if (!state.chart) return;
    const { from, to } = state.view;
    if (t >= from && t <= to) return;
    const w = to - from;
    let nf = t - w / 2;
    nf = clamp(nf, state.span.start - axisPadding(), state.span.end + axisPadding() - w);
    // The slider follows: dataZoom components of the same axis are linked.
    state.chart.dispatchAction({ type: "dataZoom", dataZoomIndex: 0, startValue: nf, endValue: nf + w });
  }

  /** Zooms into a cluster; one as wide as half the view or more: 4x around the clicked time. */
  function zoomIntoCluster(c, clickX) {
    if (!state.chart) return;
    const viewWidth = state.view.to - state.view.from;
    let from = c.from;
    let to = c.to;
    if (to - from > viewWidth / 2) {
      const t = xToTime(clickX);
      from = t - viewWidth / 8;
      to = t + viewWidth / 8;
    } else {
      const pad = Math.max(to - from, 1) * 0.1;
      from -= pad;
      to += pad;
    }
    state.chart.dispatchAction({ type: "dataZoom", dataZoomIndex: 0, startValue: from, endValue: to });
  }

  // ------------------------------------------------------------------------------------------------
  // Play

  let playLast = 0;
  let playPos = 0;

  function togglePlay() {
    if (state.playing) stopPlay();
    else startPlay();
  }

  function startPlay() {
    if (!state.head || !state.cursor) return;
    // At the head there is nothing left to play: start over from the beginning.
    if (cmpCursor(state.cursor, state.head) >= 0) setCursor(timeCursor(state.span.start), false);
    state.playing = true;
    playPos = state.cursor.ms;
    playLast = performance.now();
    $("play").textContent = "Pause";
    $("play").classList.add("tl-playing");
    requestAnimationFrame(playStep);
  }

  function stopPlay() {
    const was = state.playing;
    state.playing = false;
    $("play").textContent = "Play";
    $("play").classList.remove("tl-playing");
    if (was) scheduleCursorUpdate(); // the whole table, now that the cursor stands still
  }

  function playStep(now) {
    if (!state.playing) return;
    const speed = Number($("speed").value) || 1;
    playPos += Math.max(0, now - playLast) * speed;
    playLast = now;
    if (playPos >= state.head.ms) {
      setCursorHead();
      stopPlay();
      return;
    }
    setCursor(timeCursor(playPos), false);
    if (state.cursor.ms > state.view.to) revealTime(state.cursor.ms);
    requestAnimationFrame(playStep);
  }

  // ------------------------------------------------------------------------------------------------
  // Live: follow the event stream (server mode)

  function startLive(head) {
    if (!state.source.follow || state.closeLive) return;
    const refresh = throttle(refreshLive, LIVE_REFRESH_MS);
    state.closeLive = state.source.follow(head, refresh);
    $("live").hidden = false;
  }

  function stopLive() {
    if (state.closeLive) state.closeLive();
    state.closeLive = null;
    $("live").hidden = true;
  }

  async function refreshLive() {
    const followEnd = state.view.to >= state.span.end;
    const whole = isWholeSpan();
    let views;
    try {
      views = await state.source.views();
    } catch (err) {
      showError(err);
      return;
    }
    setViews(views);
    const oldEnd = state.span.end;
    let answer = await loadWindow();
    if (!answer) return;
    if (followEnd && state.span.end > oldEnd) {
      // The view reached the end of the log: it keeps doing so as the log grows (the whole span
      // stays the whole span, a zoomed view slides with the same width).
      const pad = axisPadding();
      const to = state.span.end + pad;
      const from = whole ? state.span.start - pad : to - (state.view.to - state.view.from);
      state.view = { from, to };
      redraw(true);
      if (!whole) answer = (await loadWindow()) || answer;
    }
    if (answer.live === false) stopLive();
  }

  function setViews(views) {
    state.vix = indexViews(views);
    state.rowsCache = null;
    if (state.vix.head) state.head = idCursor(state.vix.head);
    if (views.optimizeMode) state.optimizeMode = views.optimizeMode;
    if (state.following || !state.cursor) setCursorHead();
    else scheduleCursorUpdate();
  }

  // ------------------------------------------------------------------------------------------------
  // Header, legend, status line

  function buildLegend() {
    const box = $("legend");
    const frag = document.createDocumentFragment();
    frag.appendChild(el("span", { className: "tl-legend-title" }, "Legend"));
    for (const o of OUTCOMES) {
      const item = el("span", { className: "tl-legend-item", "data-outcome": o });
      item.appendChild(el("span", { className: "tl-swatch", "data-status": o }));
      item.appendChild(document.createTextNode(o));
      frag.appendChild(item);
    }
    const extras = [
      ["tl-sym-wait", "waiting (submitted → started)"],
      ["tl-sym-unknown", "host unreachable (UNKNOWN period)"],
      ["tl-sym-reattach", "re-attached in another lane"],
      ["tl-sym-retry", "retry of a lost attempt"],
      ["tl-sym-tick", "metric reported"],
      ["tl-sym-marker", "experiment event"],
    ];
    for (const [cls, text] of extras) {
      const item = el("span", { className: "tl-legend-item" });
      item.appendChild(el("span", { className: "tl-sym " + cls }));
      item.appendChild(document.createTextNode(text));
      frag.appendChild(item);
    }
    box.replaceChildren(frag);
  }

  function setupLinks() {
    const c = state.config;
    const pairs = [["link-index", c.index], ["link-webui", c.webui]];
    for (const [id, url] of pairs) {
      const href = safeHref(url);
      const a = $(id);
      if (href) {
        a.href = href;
        a.hidden = false;
      }
    }
    const download = state.source.logDownload;
    if (download) {
      const a = $("download-log");
      a.download = download.name;
      a.hidden = false;
      // The log is decompressed on the first click only; the link then points at the Blob and is
      // clicked again (this time the browser downloads it).
      a.addEventListener("click", async (e) => {
        if (a.dataset.ready === "true") return;
        e.preventDefault();
        if (a.dataset.ready === "preparing") return;
        a.dataset.ready = "preparing";
        const label = a.textContent;
        a.textContent = "preparing the log…";
        try {
          a.href = URL.createObjectURL(await download.blob());
          a.dataset.ready = "true";
          a.textContent = label;
          a.click();
        } catch (err) {
          delete a.dataset.ready;
          a.textContent = label;
          showError(err);
        }
      });
    }
  }

  function updateStatusLine() {
    const clustered = state.clusters.reduce((s, c) => s + (c.count || 0), 0);
    const n = state.attempts.length + clustered;
    const line = $("status-line");
    line.classList.remove("tl-error");
    line.textContent = n + " attempts in " + state.lanes.length + " lanes";
    const notes = [];
    if (state.clusters.length) notes.push("zoomed out: " + clustered + " attempts shown as " + state.clusters.length + " clusters, zoom in to see them one by one");
    if (state.markersOmitted) notes.push(state.markersOmitted + " trial markers left out, zoom in to see them");
    if (state.source && state.source.mode === "file") notes.push("from a file");
    $("status-note").textContent = notes.join(" · ");
  }

  function showError(err) {
    const text = err && err.message ? err.message : String(err);
    hooks.error = text;
    const line = $("status-line");
    line.textContent = text;
    line.classList.add("tl-error");
  }

  // ------------------------------------------------------------------------------------------------
  // Hooks

  function installHooks() {
    hooks.pixelOf = (key) => {
      const p = state.byKey.get(key);
      if (!p || !p.segs.length || !state.chart) return null;
      const s = p.segs[p.segs.length - 1];
      const from = Math.max(s.from, state.view.from);
      const to = Math.min(s.to, state.view.to);
      if (from > to) return null;
      const xy = state.chart.convertToPixel({ gridIndex: 0 }, [(from + to) / 2, s.row]);
      const g = gridRect();
      if (!xy || xy[1] < g.y || xy[1] > g.y + g.height) return null;
      const box = $("chart").getBoundingClientRect();
      return [box.left + xy[0], box.top + xy[1]];
    };
    hooks.pixelOfTime = (ms) => {
      if (!state.chart) return null;
      return $("chart").getBoundingClientRect().left + timeToX(ms);
    };
    hooks.drawn = () => state.attempts.map((p) => ({
      key: p.key,
      outcome: p.a.outcome,
      lanes: p.segs.map((s) => laneLabel(s.lane)),
      retryOf: p.a.retryOf || null,
      unknown: (p.a.unknown || []).map((u) => [u[0], u[1] === undefined ? null : u[1]]),
    }));
    hooks.cursor = () => (state.cursor ? state.cursor.id : null);
  }

  // ------------------------------------------------------------------------------------------------
  // Controls

  function applyCursorInput() {
    const input = $("cursor-input");
    const cursor = parseCursorInput(input.value);
    if (!cursor) {
      input.classList.add("tl-invalid");
      input.title = "not an event id (1700000030000-0), an ISO time or epoch ms";
      return;
    }
    input.classList.remove("tl-invalid");
    input.title = "";
    stopPlay();
    const atHead = state.head && cmpCursor(cursor, state.head) === 0;
    setCursor(cursor, atHead);
    revealTime(Math.min(cursor.ms, state.span.end));
  }

  function bindControls() {
    $("cursor-go").addEventListener("click", applyCursorInput);
    $("cursor-input").addEventListener("keydown", (e) => {
      if (e.key === "Enter") {
        e.preventDefault();
        applyCursorInput();
      }
    });
    $("cursor-input").addEventListener("input", () => $("cursor-input").classList.remove("tl-invalid"));
    $("cursor-head").addEventListener("click", () => {
      stopPlay();
      setCursorHead();
      if (state.head) revealTime(Math.min(state.head.ms, state.span.end));
    });
    $("play").addEventListener("click", togglePlay);
    $("trial-filter").addEventListener("input", scheduleCursorUpdate);
    $("trials").addEventListener("click", onTableClick);
    $("detail-close").addEventListener("click", closeDetail);
    document.addEventListener("keydown", (e) => {
      if (e.key === "Escape" && !$("detail").hidden) closeDetail();
    });
    window.addEventListener("resize", debounce(() => {
      if (!state.chart) return;
      state.chart.resize();
      if (state.metricsChart) state.metricsChart.resize();
      readView();
      positionCursor();
      loadWindowSoon();
    }, 150));
  }

  function bindChart() {
    const chart = state.chart;
    chart.on("finished", onChartFinished);
    chart.on("datazoom", onDataZoom);
    chart.getZr().on("mousemove", (e) => {
      state.mouse = [e.offsetX, e.offsetY];
    });
    chart.on("click", (params) => {
      if (params.seriesId === "attempts" || params.seriesId === "dense") {
        const p = params.seriesId === "attempts" ? state.attempts[params.value[3]] : attemptAt(params.event.offsetX, params.event.offsetY);
        if (p) openDetail(p.a.trial, p.a.attempt);
      } else if (params.seriesId === "clusters") {
        const c = state.clusters[params.dataIndex];
        if (c) zoomIntoCluster(c, params.event.offsetX);
      } else if (params.seriesId === "markers") {
        const m = state.markers[params.dataIndex];
        if (m) {
          stopPlay();
          const c = idCursor(m.id);
          setCursor(c, state.head && cmpCursor(c, state.head) === 0);
        }
      }
    });
  }

  // ------------------------------------------------------------------------------------------------
  // Start

  function readJSON(id) {
    const node = $(id);
    const text = node ? node.textContent.trim() : "";
    return text ? JSON.parse(text) : null;
  }

  async function main() {
    let config;
    let data;
    try {
      config = readJSON("timeline-config") || {};
      data = readJSON("timeline-data");
    } catch (err) {
      showError(new Error("the page's configuration cannot be read: " + err.message));
      return;
    }
    state.config = config;
    state.source = config.mode === "file" ? fileSource(config, data || {}) : serverSource(config);
    $("experiment-id").textContent = config.experimentId || "";
    document.title = "timeline · " + (config.experimentId || "experiment") + " · trialstream";
    buildLegend();
    setupLinks();
    bindControls();
    installHooks();

    const container = $("chart");
    let timeline;
    let views;
    try {
      // The first request's px: the plot width, known from the container before the chart exists.
      const guessLayout = { left: 200, right: LAYOUT.right };
      [timeline, views] = await Promise.all([
        state.source.timeline(null, null, expectedPlotWidth(container, guessLayout)),
        state.source.views(),
      ]);
    } catch (err) {
      showError(err);
      return;
    }

    applyTimeline(timeline);
    if (!config.experimentId && timeline.experimentId) $("experiment-id").textContent = timeline.experimentId;
    const pad = axisPadding();
    state.view = { from: state.span.start - pad, to: state.span.end + pad };
    state.head = idCursor(views.head || timeline.head || state.span.end + "-0");
    state.layout = computeLayout();
    container.style.height = state.layout.height + "px";
    state.chart = echarts.init(container, null, { renderer: "canvas" });
    bindChart();
    createCursor();
    redraw(true);
    setViews(views);
    updateCursorViews(); // the first table synchronously, so that `ready` means everything is there

    await new Promise((resolve) => {
      // `ready` once the chart has painted (the first "finished" after the first redraw); the
      // deadline only guards against an event that never comes (a chart of no size).
      const deadline = performance.now() + 2000;
      const check = () => (state.pendingRender && performance.now() < deadline ? requestAnimationFrame(check) : resolve());
      check();
    });
    hooks.ready = true;
    if (timeline.live) startLive(timeline.head || views.head);
  }

  function boot() {
    if (typeof echarts === "undefined") {
      showError(new Error("echarts.min.js did not load"));
      return;
    }
    main().catch((err) => {
      showError(err);
      if (window.console) console.error(err);
    });
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", boot);
  else boot();
})();
