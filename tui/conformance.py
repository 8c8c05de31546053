"""The conformance view of live mode: what a `workbench watch` proxy's `/watch/status` says, as text.

Owns: `status_url` (a watch proxy's URL, or the `--live` URL built on it, to its `/watch/status`),
`read_status` (one GET, bounded: the reply must be a watch's JSON object under `MAX_STATUS_BYTES`)
and the drawings the conformance screen shows: the summary with the floor beside the figures
(`summary_text`), conformance over time (`over_time_text`: a bar a minute, positions by verdict),
the latest real divergences (`latest_rows`) and one divergence's tokens beside the reference's
(`divergence_text`). Pure Python and rich, no Textual: every drawing is testable on its own. Does
not own polling or widgets (screens/conformance.py), nor the status itself (workbench/watch/metrics.py).
"""

from __future__ import annotations

import math
import time
import urllib.parse
from typing import Any

from rich.text import Text

from tui.fmt import quote
from tui.live import EVENTS_PATH

STATUS_PATH = "/watch/status"
MAX_STATUS_BYTES = 8 << 20  # a watch's status is tens of KB; anything far bigger is not one
VERDICT_STYLE = {"ok": "green", "floor": "cyan", "near_tie": "yellow", "real": "bold red", "logprob": "bold magenta"}
VERDICT_NAME = {"ok": "ok", "floor": "inside the floor", "near_tie": "near tie", "real": "real",
                "logprob": "logprob beyond"}
BARS = " ▁▂▃▄▅▆▇█"


def status_url(url: str) -> str:
    """`http://host:port` (a watch proxy; any path on it, `/debug/events` or `/watch` too) -> its
    `/watch/status`; ValueError for anything but an http(s) URL."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"a watch proxy's URL must be http(s), such as http://127.0.0.1:8100, got {url!r}")
    path = parts.path.rstrip("/")
    for tail in (EVENTS_PATH, STATUS_PATH, "/watch"):
        if path.endswith(tail):
            path = path[: -len(tail)]
            break
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path + STATUS_PATH, "", ""))


def read_status(url: str, api_key: str | None = None, timeout: float = 5.0) -> dict[str, Any]:
    """GET a watch's `/watch/status`; ValueError (with the reason) when it is not one or cannot be read."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(timeout=timeout) as client, client.stream("GET", url, headers=headers) as r:
            if r.status_code != 200:
                raise ValueError(f"{url} answered HTTP {r.status_code}: not a workbench watch proxy")
            body = b""
            for chunk in r.iter_bytes():
                body += chunk
                if len(body) > MAX_STATUS_BYTES:
                    raise ValueError(f"{url} sent over {MAX_STATUS_BYTES} bytes: not a watch's status")
    except httpx.HTTPError as exc:
        raise ValueError(f"{url} did not answer: {type(exc).__name__}") from None
    import json

    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{url} did not send JSON: not a workbench watch proxy") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("totals"), dict) or "latest_real" not in obj:
        raise ValueError(f"{url} sent JSON without totals and latest_real: not a workbench watch proxy")
    return obj


def _f(value: Any, digits: int = 3) -> str:
    """A number with `digits` decimals; — for anything else (the status is another process's JSON)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return f"{value:.{digits}f}" if ok else "—"


def _g(value: Any, digits: int = 3) -> str:
    """A number with `digits` significant digits (floor bounds run from 1e-7 to 1); — otherwise."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return f"{value:.{digits}g}" if ok else "—"


def _positions(d: Any) -> dict[str, int]:
    return {k: v for k, v in (d or {}).items() if isinstance(v, int)} if isinstance(d, dict) else {}


def verdict_counts(positions: dict[str, int], floor: bool) -> Text:
    """`ok 120 · near tie 2 · real 1` in the verdicts' colours (`inside the floor` only with a floor)."""
    out = Text()
    for v in ("ok", "floor", "near_tie", "real", "logprob"):
        if v == "floor" and not floor:
            continue
        if out:
            out.append(" · ", "dim")
        n = positions.get(v, 0)
        out.append(f"{VERDICT_NAME[v]} {n}", VERDICT_STYLE[v] if n else "dim")
    return out


def floor_text(status: dict[str, Any]) -> Text:
    """The floor beside the figures: where it was measured and its bounds, or the constant tolerance."""
    f = status.get("floor")
    if not isinstance(f, dict):
        return Text(f"floor      none measured: constant tolerance {status.get('tolerance')} nats "
                    "(workbench floor measures the engine's own spread; watch --floor FILE)", style="dim")
    src = f.get("source") if isinstance(f.get("source"), dict) else {}
    bands = " · ".join(f"{b.get('band')} ≤{_g(b.get('bound'), 2)}" for b in f.get("bands") or [] if isinstance(b, dict))
    totals = status.get("totals") or {}
    out = Text.assemble(("floor      ", "bold"), f"measured at {src.get('url') or '?'} ({f.get('positions')} positions, "
                        f"{f.get('flips')} flips): max |Δlogprob| {_g(f.get('max_abs'))}, flip margin "
                        f"{_g(f.get('max_flip_margin'))}; by |logprob| {bands}\n")
    out.append("           inside the floor ", "bold")
    out.append(str(_positions(totals.get("positions")).get("floor", 0)), VERDICT_STYLE["floor"])
    out.append(" greedy flips the engine's own noise can make · ")
    out.append("beyond the floor ", "bold")
    out.append(f"{totals.get('beyond_floor', 0)} positions (|Δlogprob| above the engine's own spread)")
    return out


def summary_text(status: dict[str, Any]) -> Text:
    """Upstream, reference, conformance and totals, the floor, the checker's queue, rate and notes."""
    totals = status.get("totals") or {}
    positions = _positions(totals.get("positions"))
    conf = status.get("conformance")
    real = totals.get("requests_real", 0)
    queue = status.get("queue") or {}
    checker = status.get("checker") or {}
    out = Text.assemble(("watch      ", "bold"), f"{status.get('upstream', '?')} · reference ",
                        (str(status.get("reference", "?")), "bold"), f" ({status.get('reference_state', '?')}) · "
                        f"sample {status.get('sample')} · tolerance {status.get('tolerance')} nats\n",
                        ("conformance ", "bold"),
                        ("—" if not isinstance(conf, (int, float)) else f"{100 * conf:.2f}%", "bold"),
                        f" of positions ok · {totals.get('requests_checked', 0)} requests checked · ",
                        (f"{real} with a real divergence", "bold red" if real else "green"), "\n",
                        ("positions  ", "bold"))
    out.append_text(verdict_counts(positions, isinstance(status.get("floor"), dict)))
    out.append("\n")
    out.append_text(floor_text(status))
    rate = checker.get("positions_per_s")
    out.append(Text.assemble("\n", ("checker    ", "bold"),
                             f"queue {queue.get('depth', '?')}/{queue.get('capacity', '?')} · dropped "
                             f"{queue.get('dropped', 0)} · {_g(rate)} positions/s · "
                             f"lag {_g(checker.get('lag_s'))} s"))
    for note in status.get("notes") or []:
        out.append(f"\nnote       {note}", "bold red")
    return out


def over_time_text(status: dict[str, Any], minutes: int = 12, show_times: bool = True) -> Text:
    """Conformance by minute: a bar a minute (its height the share of positions ok; red where a real
    divergence fell), then the latest `minutes` minutes as rows of positions by verdict."""
    buckets = [b for b in status.get("over_time") or [] if isinstance(b, dict)]
    floor = isinstance(status.get("floor"), dict)
    if not buckets:
        return Text("no request checked yet", style="dim")
    bars = Text("by minute  ", style="bold")
    for b in buckets[-90:]:
        pos = _positions(b.get("positions"))
        n = sum(pos.values())
        share = pos.get("ok", 0) / n if n else 0.0
        bars.append(BARS[round(share * (len(BARS) - 1))], "red" if b.get("requests_real") else "green")
    bars.append("  (height: share ok; red: a minute with a real divergence)", "dim")
    out = Text.assemble(bars, "\n", (f"  {'minute':<9} {'requests':>8} {'real':>5}  positions", "bold"))
    for b in reversed(buckets[-minutes:]):
        t = b.get("t")
        when = time.strftime("%H:%M", time.localtime(t)) if show_times and isinstance(t, (int, float)) else "—"
        real = b.get("requests_real", 0)
        out.append(f"\n  {when:<9} {b.get('requests', 0):>8} ")
        out.append(f"{real:>5}", "bold red" if real else "")
        out.append("  ")
        out.append_text(verdict_counts(_positions(b.get("positions")), floor))
    return out


def latest_rows(status: dict[str, Any], show_times: bool = True) -> list[tuple[str, ...]]:
    """One row per latest real divergence: time, request, position, engine token, reference argmax,
    gap, verdict, trace file name."""
    rows = []
    for d in status.get("latest_real") or []:
        if not isinstance(d, dict):
            continue
        t = d.get("time")
        when = time.strftime("%H:%M:%S", time.localtime(t)) if show_times and isinstance(t, (int, float)) else "—"
        eng, ref = d.get("engine") or {}, d.get("reference") or {}
        rows.append((when, str(d.get("req_id")), str(d.get("position")), quote(str(eng.get("text", "")), 16),
                     quote(str(ref.get("text", "")), 16), _f(ref.get("gap"), 3), VERDICT_NAME.get(
                         str(d.get("verdict")), str(d.get("verdict"))), str(d.get("trace", "")).rsplit("/", 1)[-1]))
    return rows


def divergence_text(d: dict[str, Any]) -> Text:
    """A divergent request's tokens around its first real divergence, each beside the reference's
    argmax, with Δlogprob, the floor's bound where one was given, and the verdict."""
    floor = any(isinstance(t, dict) and t.get("floor") is not None for t in d.get("tokens") or [])
    out = Text.assemble((f"request {d.get('req_id')}", "bold"), f": first real divergence at position "
                        f"{d.get('position')} ({VERDICT_NAME.get(str(d.get('verdict')), d.get('verdict'))}, "
                        f"{d.get('real_positions')} real position(s))\n",
                        (f"  open it: workbench tui {d.get('trace')} --request {d.get('req_id')}  (t)", "dim"), "\n",
                        (f"  {'pos':>4} {'engine token':<16} {'logprob':>9} {'reference argmax':<16} "
                         f"{'ref lp':>9} {'Δlogprob':>9}" + (f" {'floor':>8}" if floor else "") + "  verdict", "bold"))
    for t in d.get("tokens") or []:
        if not isinstance(t, dict):
            continue
        eng, ref = t.get("engine") or {}, t.get("reference") or {}
        verdict = str(t.get("verdict", "ok"))
        mark = "▸" if t.get("position") == d.get("position") else " "
        style = VERDICT_STYLE.get(verdict, "") if verdict != "ok" else ""
        line = (f"\n{mark} {t.get('position', '?'):>4} {quote(str(eng.get('text', '')), 16):<16} "
                f"{_f(eng.get('logprob')):>9} {quote(str(ref.get('text', '')), 16):<16} "
                f"{_f(ref.get('logprob_of_engine_token')):>9} {_f(t.get('delta'), 3):>9}"
                + (f" {_g(t.get('floor'), 2):>8}" if floor else "") + "  ")
        out.append(line, style if verdict in ("real", "logprob") else "")
        out.append(VERDICT_NAME.get(verdict, verdict), VERDICT_STYLE.get(verdict, ""))
    return out
