"""The hostile-client sweep of issue 19, rerunnable: hundreds of cases, each with the behaviour it must show.

Categories (each case passes or is listed as a failure with what happened):
- bad inputs on /v1/completions and /v1/chat/completions: a 4xx with an OpenAI-shaped error body
  naming a parameter, never a 500, and the server answers a good request afterwards;
- web-page reach: foreign Host headers, non-JSON content types, too many headers;
- traversal on /debug/traces/{id}: 404/400, never a file's contents;
- auth (a server with --api-key): the key only in `Authorization`, never in a URL or a cookie alone;
- broken traces: every kind of damage through every reader method, diff and export: success or one
  TraceError line naming the file, never another exception; and the hostile traces of issue 36
  (tests/helpers/hostile_traces.py: huge values, a million rows, JSON nested 100,000 deep, long
  strings), read or refused by the name of the limit they are over;
- hostile structured output (issue 36), against a real `workbench serve` process: the issue's six
  requests and a few hundred neighbours (schema size, depth, fan-out, references, pattern features,
  quantifier bounds), each a 400 naming the parameter or a correct 200 within its budget, and after
  each an ordinary request with the fresh server's greedy text within a second; a table of case ->
  status, time, server RSS growth, next request unaffected. `--fresh-six` also sends each of the six
  alone to a fresh server.

    python benchmarks/hardening_sweep.py [--json out.json] [--only structured|traces] [--fresh-six]
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.helpers.hostile_cases import SIX, nested, pattern, props, schema, variants  # noqa: E402
from tests.helpers.hostile_traces import HOSTILE, LIMITS_ENV  # noqa: E402  (crafted to cost memory or time)
from tests.helpers.trace_damage import DAMAGES  # noqa: E402  (the one catalogue, shared with the tests)

MODEL = "tiny-random"
C, CH = "/v1/completions", "/v1/chat/completions"
KEY = "sweep-secret-key"
SECRET = "contents-that-must-not-leak"
Results = dict[str, list[tuple[str, bool, str]]]


def _bad_fields() -> list[tuple[str, dict]]:
    """(name, fields) that must each be refused; applied to both endpoints."""
    values: dict[str, list] = {
        "temperature": [-1, 3.5, "hot", [1], {"a": 1}, 1e300],
        "top_p": [0, -0.5, 1.5, "x", [0.5]],
        "top_k": [-2, 0.5, "k", [1]],
        "min_p": [-0.1, 1.5, "p"],
        "max_tokens": [0, -1, 10**9, 4096, "ten", 1.5, [2], True],
        "n": [0, -1, 17, 1000, "two", 1.5],
        "seed": ["s", 1.5, [1]],
        "stop": [5, [1, 2], {"a": "b"}, ["a"] * 100],
        "frequency_penalty": [-3, 3, "f"],
        "presence_penalty": [-3, 3, "p"],
        "repetition_penalty": [0, -1, "r"],
        "logit_bias": [{"x": 1}, {"999999999": 1}, {"1": 500}, [1], "b"],
        "stream": ["yes", 2, [True]],
        "stream_options": [{"include_usage": "yes"}, "u", [1]],
        "model": ["other-model", 5, None, ""],
        "response_format": [{"type": "xml"}, {"type": "json_schema"}, "json", {"type": "json_schema",
                                                                               "json_schema": {"name": "x", "schema": {"type": 5}}}],
        "regex": ["(unclosed", 5],
        "unknown_field": [1],
    }
    out = []
    for field, vals in values.items():
        for v in vals:
            out.append((f"{field}={json.dumps(v)[:30]}", {field: v}))
    return out


def _completion_only() -> list[tuple[str, dict]]:
    return [(f"prompt={json.dumps(p)[:30]}", {"prompt": p}) for p in
            ["", [], [[]], [-1], [10**9], [1.5], [[1], ["a"]], 5, None, {"a": 1}, "word " * 2600, ["hi"] * 3000]] + \
        [("logprobs=21", {"logprobs": 21}), ("logprobs=-1", {"logprobs": -1}), ("suffix", {"suffix": "x"}),
         ("best_of=3", {"best_of": 3}), ("echo+logprobs", {"echo": True, "logprobs": 1})]


def _chat_only() -> list[tuple[str, dict]]:
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
    return [(f"messages={json.dumps(m)[:30]}", {"messages": m}) for m in
            [[], "hi", [{"role": "user"}], [{"role": "wizard", "content": "x"}], [{"content": "x"}], [5], None,
             [{"role": "user", "content": 5}]]] + \
        [(f"tools broken, tool_choice={tc}", {"tools": bad_tool, **({"tool_choice": tc} if tc else {})})
         for tc in (None, "auto", "none", "required")] + \
        [("tool_choice without tools", {"tool_choice": "required"}),
         ("tool_choice unknown function", {"tools": [{"type": "function", "function": {"name": "f"}}],
                                           "tool_choice": {"type": "function", "function": {"name": "g"}}}),
         ("top_logprobs=21", {"logprobs": True, "top_logprobs": 21}),
         ("max_completion_tokens=4096", {"max_completion_tokens": 4096})]


def sweep_inputs(url: str, res: Results) -> None:
    base = {C: {"model": MODEL, "prompt": "hi", "max_tokens": 2}, CH: {"model": MODEL, "max_tokens": 2,
                                                                    "messages": [{"role": "user", "content": "hi"}]}}
    raw_bodies = [("not JSON", b"{nope"), ("JSON array", b"[1,2]"), ("JSON string", b'"x"'), ("empty", b""),
                  ("bad UTF-8", b'{"model": "\xff"}'), ("NaN", b'{"model": "tiny-random", "prompt": "x", "temperature": NaN}'),
                  ("huge", b'{"prompt": "' + b"a" * (5 << 20) + b'"}')]
    with httpx.Client(base_url=url, timeout=120) as http:
        for path in (C, CH):
            cases = _bad_fields() + (_completion_only() if path == C else _chat_only())
            for name, fields in cases:
                body = {**base[path], **fields}
                if fields.get("model", "x") is None:
                    body.pop("model")
                resp = http.post(path, json=body)
                ok, note = _is_api_error(resp, (400, 404, 413, 422))
                res[f"bad input {path}"].append((name, ok, note))
            for name, raw in raw_bodies:
                resp = http.post(path, content=raw, headers={"content-type": "application/json"})
                ok, note = _is_api_error(resp, (400, 413))
                res[f"bad input {path}"].append((f"raw {name}", ok, note))
            good = http.post(path, json=base[path])
            res[f"bad input {path}"].append(("a good request afterwards", good.status_code == 200, str(good.status_code)))


def _is_api_error(resp: httpx.Response, statuses: tuple[int, ...]) -> tuple[bool, str]:
    try:
        err = resp.json()["error"]
        shaped = set(err) == {"message", "type", "param", "code"} and bool(err["message"])
    except Exception:
        shaped = False
    return resp.status_code in statuses and shaped, f"HTTP {resp.status_code} {resp.text[:120]!r}"


def sweep_reach(url: str, port: int, res: Results) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil",
                     "10.0.0.1", "", "[::2]"):
            resp = http.get("/debug/traces", headers={"Host": host})
            res["web-page reach"].append((f"Host {host!r}", resp.status_code == 400, str(resp.status_code)))
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
            resp = http.get("/debug/traces", headers={"Host": host})
            res["web-page reach"].append((f"Host {host!r} allowed", resp.status_code == 200, str(resp.status_code)))
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                      "", "application/jsonx", "text/json"):
            resp = http.post(C, content=body, headers={"content-type": ctype} if ctype else {})
            ok, note = _is_api_error(resp, (415,))
            res["web-page reach"].append((f"Content-Type {ctype!r}", ok, note))
        for count in (150, 1000, 10_000):
            resp = http.get("/health", headers=[(f"x-h{i}", "v") for i in range(count)])
            res["web-page reach"].append((f"{count} headers", resp.status_code in (400, 431), str(resp.status_code)))
        resp = http.get("/debug/traces/kept")
        res["web-page reach"].append(("download nosniff", resp.headers.get("x-content-type-options") == "nosniff",
                                      str(dict(resp.headers))[:80]))


def sweep_traversal(url: str, res: Results) -> None:
    ids = ["../secret.txt", "..%2Fsecret.txt", "%2e%2e%2fsecret.txt", "..%252Fsecret.txt", "/etc/passwd",
           "..\\secret.txt", "kept/../../secret.txt", "....//secret.txt", "%00", "kept%00.txt", "secret.txt",
           "secret", ".", "..", "kept.wbtrace/..", "~", "%2Fetc%2Fpasswd", "a" * 5000]
    with httpx.Client(base_url=url, timeout=60) as http:
        for tid in ids:
            resp = http.get(f"/debug/traces/{tid}")
            leaked = SECRET in resp.text or "root:" in resp.text
            # httpx normalises "x/." and "x/.." itself: those reach the listing, which is fine
            listing = resp.status_code == 200 and resp.headers.get("content-type", "").startswith("application/json") \
                and resp.json().get("object") == "list"
            res["traversal"].append((tid[:40], (resp.status_code in (400, 404, 414) or listing) and not leaked,
                                     f"HTTP {resp.status_code}"))


def sweep_auth(url: str, res: Results) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    with httpx.Client(base_url=url, timeout=60) as http:
        checks: list[tuple[str, httpx.Response, int]] = []
        for path in ("/v1/models", "/metrics", "/debug/traces", "/debug/events"):
            checks += [(f"GET {path} no key", http.get(path), 401),
                       (f"GET {path} ?api_key=", http.get(path, params={"api_key": KEY}), 401),
                       (f"GET {path} wrong key", http.get(path, headers={"Authorization": "Bearer nope"}), 401),
                       (f"GET {path} Basic", http.get(path, headers={"Authorization": f"Basic {KEY}"}), 401),
                       (f"GET {path} forged cookie", http.get(path, headers={"Cookie": "workbench_session=x"}), 401)]
        for path in (C, CH):
            checks += [(f"POST {path} no key", http.post(path, json=body), 401),
                       (f"POST {path} ?api_key=", http.post(path, json=body, params={"api_key": KEY}), 401)]
        checks += [("GET /health open", http.get("/health"), 200), ("GET / open (the page)", http.get("/"), 200),
                   ("session with a wrong key", http.post("/debug/session", headers={"Authorization": "Bearer x"}), 401)]
        good = http.post("/debug/session", headers={"Authorization": f"Bearer {KEY}"})
        checks += [("session with the key", good, 204), ("GET /debug/traces with the session", http.get("/debug/traces"), 200),
                   ("POST with the session cookie only", http.post(C, json=body), 401)]
        http.cookies.clear()
        checks.append(("POST with the key", http.post(C, json=body, headers={"Authorization": f"Bearer {KEY}"}), 200))
        for name, resp, want in checks:
            res["auth"].append((name, resp.status_code == want, f"HTTP {resp.status_code}"))


def slow_subscribers(url: str, count: int = 100) -> dict:
    """16 concurrent requests with no debug subscriber, then with `count` that subscribe and never read."""
    import asyncio

    async def burst() -> float:
        body = {"model": MODEL, "prompt": "tell me a story", "max_tokens": 64, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            t0 = time.perf_counter()
            resps = await asyncio.gather(*(http.post(C, json=body) for _ in range(16)))
            assert all(r.status_code == 200 for r in resps)
            return time.perf_counter() - t0

    quiet = asyncio.run(burst())
    clients = [httpx.Client(base_url=url, timeout=300) for _ in range(count)]
    streams = [c.stream("GET", "/debug/events") for c in clients]
    refused = sum(st.__enter__().status_code == 503 for st in streams)  # subscribed; nobody reads what arrives
    try:
        loaded = asyncio.run(burst())
    finally:
        for st, c in zip(streams, clients):
            st.__exit__(None, None, None)
            c.close()
    return {"without_s": quiet, "with_s": loaded, "subscribers": count, "refused": refused}


# --- broken traces --------------------------------------------------------------------------------


def _readers() -> dict[str, Callable]:
    return {"steps": lambda t: t.steps(), "step(n)": lambda t: [t.step(s.step) for s in t.steps()],
            "events": lambda t: sum(1 for _ in t.events()), "requests": lambda t: t.requests(),
            "timeline": lambda t: [t.timeline(r.req_id) for r in t.requests()],
            "steps_frame": lambda t: t.steps_frame(), "tokens_frame": lambda t: t.tokens_frame(),
            "events_frame": lambda t: t.events_frame(), "tensors": lambda t: [t.tensor(n) for n in t.tensor_names()],
            "check": lambda t: t.check(), "last_complete_step": lambda t: t.last_complete_step}


def sweep_traces(good: Path, work: Path, res: Results) -> None:
    """Damaged traces (any one-line TraceError will do) and hostile ones (issue 36: read, or refused by
    the name of the limit they are over, under the small limits of LIMITS_ENV)."""
    import os

    cases = [(kind, damage, None, False) for kind, damage in DAMAGES.items()]
    cases += [(f"hostile: {kind}", craft, limit, True) for kind, (craft, limit) in HOSTILE.items()]
    saved = {var: os.environ.get(var) for var in LIMITS_ENV}
    for kind, damage, limit, hostile in cases:
        os.environ.update(LIMITS_ENV if hostile else {})
        try:
            _sweep_trace(good, work, res, kind, damage, limit)
        finally:
            for var, value in saved.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value


def _sweep_trace(good: Path, work: Path, res: Results, kind: str, damage: Callable, limit: str | None) -> None:
    from workbench.cli import main as cli_main
    from workbench.trace.reader import TraceError, open_trace

    def clear(exc: Exception) -> bool:
        text = str(exc)
        return isinstance(exc, TraceError) and text.startswith(path.name) and "\n" not in text and \
            (limit is None or limit in text)

    path = work / (kind.replace(" ", "-").replace("(", "").replace(")", "").replace(":", "").replace(",", "")
                   + ".wbtrace")
    shutil.copy(good, path)
    damage(path)
    try:
        trace = open_trace(path)
    except Exception as exc:
        res["broken traces"].append((f"{kind}: open", clear(exc), f"{type(exc).__name__}: {exc}"[:120]))
        return
    with trace:
        for name, read in _readers().items():
            try:
                read(trace)
                ok, note = True, "read"
            except Exception as exc:
                ok, note = clear(exc), f"{type(exc).__name__}: {exc}"[:120]
            res["broken traces"].append((f"{kind}: {name}", ok, note))
    for argv in (["diff", str(good), str(path)], ["export", str(path), "--perfetto", str(work / "p.json"),
                                                   "--tokens", str(work / "t.csv")]):
        err = io.StringIO()
        try:
            with redirect_stderr(err), redirect_stdout(io.StringIO()):
                code = cli_main(argv)
            text = err.getvalue().strip()
            ok = code in (0, 1) or (code == 2 and len(text.splitlines()) == 1 and path.name in text)
            note = f"exit {code}: {text[:100]}"
        except Exception as exc:
            ok, note = False, f"{type(exc).__name__}: {exc}"[:120]
        res["broken traces"].append((f"{kind}: workbench {argv[0]}", ok, note))


# --- hostile structured output (issue 36) ---------------------------------------------------------


def structured_cases() -> list[tuple[str, dict, int, str | None]]:
    """The issue's six, the test suite's variants, and sweeps over each limit on both sides of it."""
    cases = list(SIX) + variants()
    for n in list(range(25, 500, 25)) + [499, 500]:
        cases.append((f"sweep {n} properties", schema(props(n)), 200, None))
    for n in (501, 750, 3000, 7500, 15_000, 20_000, 25_000):
        cases.append((f"sweep {n} properties", schema(props(n)), 400, "response_format"))
    for d in range(1, 64, 4):
        cases.append((f"sweep nesting {d}", schema(nested(d)), 200 if 2 * d + 1 <= 64 else 400,
                      None if 2 * d + 1 <= 64 else "response_format"))
    for k in (1, 10, 100, 1000, 5000, 9999, 10_000, 10_001, 20_000, 65_536, 100_000, 10**6, 10**12):
        ok = k <= 1000
        cases.append((f"sweep pattern a{{1,{k}}}", pattern(f"^a{{1,{k}}}$"), 200 if ok else 400,
                      None if ok else "response_format"))
        cases.append((f"sweep regex a{{{k}}}", {"regex": f"a{{{k}}}"}, 400 if not ok else 200, None if ok else "regex"))
        cases.append((f"sweep maxLength {k}", schema({"type": "string", "maxLength": k}), 200 if ok else 400,
                      None if ok else "response_format"))
    for feature in ("(?=", "(?!", "(?<=", "(?<!", "(?>"):
        for body in ("a)b", "ab)c", "[x])y"):
            cases.append((f"sweep regex {feature}{body}", {"regex": feature + body}, 400, "regex"))
            cases.append((f"sweep pattern {feature}{body}", pattern(feature + body), 400, "response_format"))
    for i in range(1, 10):
        cases.append((f"sweep back-reference \\{i}", {"regex": "(a)" * i + f"\\{i}"}, 400, "regex"))
    for n in (10, 100, 1000, 25_000):  # 25,000 values: over --grammar-max-nodes
        cases.append((f"sweep enum of {n}", schema({"enum": [f"v{i}" for i in range(n)]}), 200 if n <= 1000 else 400,
                      None if n <= 1000 else "response_format"))
    for scheme in ("http", "https", "file", "ftp", "gopher", "data", "jar", "urn", "mailto", "ws"):
        cases.append((f"sweep $ref {scheme}:", schema({"$ref": f"{scheme}://example.com/s.json"}), 400,
                      "response_format"))
    return cases


def sweep_structured(res: Results, rows: list[tuple], fresh_six: bool) -> None:
    from workbench.server.background import ServerProcess

    ordinary = {"model": MODEL, "prompt": "hello there", "max_tokens": 8, "temperature": 0}
    cases = structured_cases()
    with ServerProcess(["--model", MODEL, "--log-level", "warning"], start_timeout=300) as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as http:
        fresh_text = http.post(C, json=ordinary).json()["choices"][0]["text"]
        http.post(C, json={**ordinary, **schema({"type": "object", "properties": {"x": {"type": "integer"}}})})
        base_rss = _rss_mb(srv.proc.pid)
        for name, fields, status, param in cases:
            rss0 = _rss_mb(srv.proc.pid)
            t0 = time.perf_counter()
            try:
                resp = http.post(C, json={**ordinary, **fields})
                got, note = resp.status_code, resp.text[:100]
                named = status != 400 or resp.json().get("error", {}).get("param") == param
            except httpx.HTTPError as exc:
                got, note, named = 0, type(exc).__name__, False
            elapsed = time.perf_counter() - t0
            t1 = time.perf_counter()
            nxt = http.post(C, json=ordinary)
            unaffected = nxt.status_code == 200 and nxt.json()["choices"][0]["text"] == fresh_text \
                and time.perf_counter() - t1 < 1.0
            grown = _rss_mb(srv.proc.pid) - rss0
            ok = got == status and named and unaffected
            res["hostile structured output"].append((name, ok, f"HTTP {got} {note}"))
            rows.append((name, got, elapsed, grown, unaffected))
        time.sleep(3.0)
        http.post(C, json=ordinary)
        rows.append(("(server RSS after all, vs after warm-up)", 0, 0.0, _rss_mb(srv.proc.pid) - base_rss, True))
    if fresh_six:
        for name, fields, status, _ in SIX:
            with ServerProcess(["--model", MODEL, "--log-level", "warning"], start_timeout=300) as srv, \
                    httpx.Client(base_url=srv.url, timeout=120) as http:
                fresh_text = http.post(C, json=ordinary).json()["choices"][0]["text"]
                rss0 = _rss_mb(srv.proc.pid)
                t0 = time.perf_counter()
                resp = http.post(C, json={**ordinary, **fields})
                elapsed = time.perf_counter() - t0
                t1 = time.perf_counter()
                nxt = http.post(C, json=ordinary)
                unaffected = nxt.json()["choices"][0]["text"] == fresh_text and time.perf_counter() - t1 < 1.0
                rows.append((f"fresh server: {name}", resp.status_code, elapsed, _rss_mb(srv.proc.pid) - rss0,
                             unaffected))
                res["hostile structured output"].append((f"fresh server: {name}",
                                                         resp.status_code == status and unaffected, resp.text[:100]))


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def print_structured(rows: list[tuple]) -> None:
    print(f"{'case':48s} {'status':>6s} {'time s':>7s} {'RSS +MB':>8s}  next request unaffected")
    for name, status, elapsed, grown, unaffected in rows:
        print(f"{name[:48]:48s} {status:6d} {elapsed:7.2f} {grown:8.1f}  {'yes' if unaffected else 'NO'}")


def _traces_only(res: Results, json_path: str | None) -> int:
    from workbench.engine.engine import Engine
    from workbench.engine.sample.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        good = root / "good.wbtrace"
        with Engine(MODEL, trace=str(good), trace_level="summary") as engine:
            engine.generate(["one", "two two", "three three three"],
                            SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True, logprobs=True))
        sweep_traces(good, root, res)
    return _report(res, json_path, None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", choices=("structured", "traces"), default=None, help="run one category only")
    parser.add_argument("--fresh-six", action="store_true", help="also send the issue's six to fresh servers")
    args = parser.parse_args()
    res: Results = defaultdict(list)
    rows: list[tuple] = []
    if args.only == "traces":
        return _traces_only(res, args.json)
    sweep_structured(res, rows, args.fresh_six)
    print_structured(rows)
    if args.only == "structured":
        return _report(res, args.json, None)
    from workbench.engine.engine import Engine
    from workbench.engine.sample.sampling_params import SamplingParams
    from workbench.models.loader import load_model
    from workbench.server.app import create_app
    from workbench.server.background import BackgroundServer
    from workbench.server.event_hub import EventHub
    from workbench.trace.store import TraceWriter

    loaded = load_model(MODEL, device="cpu", huge_pages=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "secret.txt").write_text(SECRET)
        traces = root / "traces"
        traces.mkdir()
        with TraceWriter(traces / "kept.wbtrace"):
            pass
        for api_key in (None, KEY):
            engine = Engine(loaded, trace_level="summary", trace_sinks=[EventHub()])
            app = create_app(engine, model_name=MODEL, trace_dir=traces, api_key=api_key, max_body_bytes=1 << 20)
            with BackgroundServer(app) as srv:
                if api_key is None:
                    sweep_inputs(srv.url, res)
                    sweep_reach(srv.url, srv.port, res)
                    sweep_traversal(srv.url, res)
                    subs = slow_subscribers(srv.url)
                else:
                    sweep_auth(srv.url, res)
            engine.close()
        good = root / "good.wbtrace"
        with Engine(loaded, trace=str(good), trace_level="summary") as engine:
            engine.generate(["one", "two two", "three three three"],
                            SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True, logprobs=True))
        sweep_traces(good, root, res)
    return _report(res, args.json, subs)


def _report(res: Results, json_path: str | None, subs: dict | None) -> int:
    total = sum(len(v) for v in res.values())
    passed = sum(ok for v in res.values() for _, ok, _ in v)
    for category, cases in res.items():
        bad = [(n, note) for n, ok, note in cases if not ok]
        print(f"{category:28s} {len(cases) - len(bad):4d} / {len(cases):4d} behaved")
        for name, note in bad:
            print(f"    FAILED {name}: {note}")
    print(f"{'total':28s} {passed:4d} / {total:4d} behaved")
    if subs is not None:
        print(f"16 requests x 64 tokens: {subs['without_s']:.2f} s with no debug subscriber, {subs['with_s']:.2f} s "
              f"with {subs['subscribers']} that subscribe and never read ({subs['refused']} of them refused with 503)")
    if json_path:
        Path(json_path).write_text(json.dumps({k: [list(c) for c in v] for k, v in res.items()}, indent=1))
    return 0 if passed == total else 1


if __name__ == "__main__":
    sys.exit(main())
