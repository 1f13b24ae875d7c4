"""Server-side latency of the trajectory viewer against its targets (issue 6).

    python benchmarks/viewer.py --write benchmarks/results/viewer.md
    python benchmarks/viewer.py --episodes 20000 --repeats 5          # a quicker look

1. Episode detail: one 20-turn, ~8k-token episode (tests/viewer_fixtures.long_episode: token
   stream assembled by StreamBuilder, decoded by the run's tokenizer), HTML page and JSON,
   rendered through FastAPI's TestClient; median of --repeats after one warm-up request (the
   warm-up loads the tokenizer; its time is reported apart). Target <= 300 ms.
2. Episode list on a database of --episodes (100k) episodes: first, middle (a keyset cursor at
   the middle row), last and filtered pages (selective and rare filters, alone and combined),
   HTML page and JSON, median of --repeats. Target <= 200 ms for any page. Measured twice:
   with the indexes the Store creates (step; split, step) and after adding the covering index
   the viewer recommends (`RECOMMENDED_INDEX`), which turns every filter into an index-only walk.
   The database is built fast: the Store creates the table, rows go in with executemany in one
   transaction, most rows with 24-token arrays.
Ratios are measured / target (<= 1.0 meets it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fastapi.testclient import TestClient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from viewer_fixtures import long_episode, make_tokenizer  # noqa: E402

from agentopd.store import EPISODE_COLUMNS, Store  # noqa: E402
from agentopd.viewer import create_app  # noqa: E402

DETAIL_TARGET_MS = 300.0
LIST_TARGET_MS = 200.0
RECOMMENDED_INDEX = ["step", "id", "split", "env", "success", "reward", "num_turns", "stop_reason"]
STOPS = [("answer", 0.94), ("max_turns", 0.04), ("length", 0.015), ("timeout", 0.004), ("error", 0.001)]


def median_ms(client: TestClient, url: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = client.get(url)
        times.append((time.perf_counter() - t0) * 1000)
        assert r.status_code == 200, (url, r.status_code, r.text[:300])
    return statistics.median(times)


def bench_detail(root: Path, repeats: int) -> tuple[list[tuple[str, float, float]], dict]:
    run = root / "detail"
    tok = make_tokenizer(run / "tokenizer")
    ep = long_episode(tok, turns=20, tokens=8000)
    store = Store(run / "trajectories.db")
    store.add(ep, "000000-0000", teacher="t")
    store.close()
    client = TestClient(create_app(run))
    url = "/runs/detail/episodes/000000-0000"
    t0 = time.perf_counter()
    assert client.get(url).status_code == 200
    cold = (time.perf_counter() - t0) * 1000
    rows = [
        ("episode page (HTML)", median_ms(client, url, repeats), DETAIL_TARGET_MS),
        ("episode JSON (/api/...)", median_ms(client, "/api" + url, repeats), DETAIL_TARGET_MS),
    ]
    facts = {
        "turns": ep.num_turns,
        "tokens": len(ep.tokens.token_ids),
        "student_tokens": ep.tokens.num_llm_tokens,
        "html_bytes": len(client.get(url).content),
        "first_request_ms": cold,
    }
    return rows, facts


def _stop(rng: random.Random) -> str:
    u, acc = rng.random(), 0.0
    for name, p in STOPS:
        acc += p
        if u < acc:
            return name
    return STOPS[0][0]


def build_big_db(path: Path, n: int, per_step: int = 100, seed: int = 0) -> float:
    """n episodes (per_step per step, a tenth of every fifth step eval), small token arrays."""
    rng = random.Random(seed)
    t0 = time.perf_counter()
    store = Store(path)  # creates the table and the Store's own indexes
    cols = list(EPISODE_COLUMNS)
    sql = f"INSERT INTO episodes ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
    msgs = json.dumps([{"role": "user", "content": "How many orders?"}, {"role": "assistant", "content": "42"}])

    def rows():
        for i in range(n):
            step, slot = divmod(i, per_step)
            turns = rng.randint(1, 8)
            ok = rng.random() < 0.4
            length = 24 if rng.random() < 0.98 else 400
            ids = json.dumps([rng.randrange(2000) for _ in range(length)])
            zeros = json.dumps([0.0] * (length - 4))
            yield (
                f"{step:06d}-{slot:04d}", step, "calculator" if rng.random() < 0.2 else "sql_db", f"task-{rng.randrange(5000)}",
                "eval" if step % 5 == 4 and slot >= per_step - 10 else "train", float(ok) + rng.uniform(-0.1, 0.1), int(ok),
                turns, _stop(rng), 4, length, length // 2, rng.randrange(3), 0, 0, step, "t", rng.uniform(0, 0.5),
                time.time(), ids, json.dumps([1] * (length - 4)), zeros, json.dumps([0] * (length - 4)), zeros, msgs,
                "[]", "[]", "{}",
            )  # fmt: skip

    conn = store.db.conn
    conn.execute("PRAGMA synchronous = OFF")
    with conn:
        conn.executemany(sql, rows())
    store.close()
    return time.perf_counter() - t0


def list_urls(client: TestClient, run: str) -> list[tuple[str, str]]:
    base = f"/runs/{run}/episodes"
    total = client.get(f"/api/runs/{run}").json()["episodes"]
    step, slot = divmod(total // 2, 100)
    mid = f"{step}:{step:06d}-{slot:04d}"
    return [
        ("first page", ""),
        ("middle page (cursor)", f"after={mid}"),
        ("last page", "last=true"),
        ("oldest first, first page", "order=asc"),
        ("success=false", "success=false"),
        ("env=calculator", "env=calculator"),
        ("split=eval", "split=eval"),
        ("min_turns=8", "min_turns=8"),
        ("reward 0.2..0.4 (no match)", "reward_min=0.2&reward_max=0.4"),
        ("stop_reason=error (0.1%)", "stop_reason=error"),
        ("steps 400..600 & success", "step_min=400&step_max=600&success=true"),
        ("calculator & length & >=3 turns", "env=calculator&stop_reason=length&min_turns=3"),
        ("stop_reason=error, middle", f"stop_reason=error&after={mid}"),
        ("split=eval, last page", "split=eval&last=true"),
    ], base


def bench_list(root: Path, n: int, repeats: int) -> tuple[list[tuple[str, float, float, float]], dict, list]:
    run = root / "big"
    run.mkdir()
    db = run / "trajectories.db"
    build_s = build_big_db(db, n)
    facts = {"episodes": n, "build_s": build_s, "db_mb": db.stat().st_size / 2**20}
    results = []
    for label in ("Store indexes", "+ covering index"):
        if label != "Store indexes":
            store = Store(db)
            store.table.create_index(RECOMMENDED_INDEX, index_name="episodes_list", if_not_exists=True)
            store.db.execute("ANALYZE")
            store.close()
        client = TestClient(create_app(run))
        urls, base = list_urls(client, "big")
        for name, query in urls:
            html = median_ms(client, f"{base}?{query}", repeats)
            api = median_ms(client, f"/api{base}?{query}", repeats)
            results.append((label, name, html, api))
    return results, facts, urls


def report(detail, dfacts, lists, lfacts, repeats: int, cmd: str) -> str:
    out = [
        "# Viewer latency (server side, FastAPI TestClient)",
        "",
        f"Command: `{cmd}`  ",
        f"Date: {datetime.date.today()} · Python {platform.python_version()} · {platform.machine()} · "
        f"{platform.processor() or 'cpu'} · shared 2-core machine · median of {repeats} requests",
        "",
        f"## Episode detail ({dfacts['turns']} turns, {dfacts['tokens']} tokens, {dfacts['student_tokens']} student; "
        f"target <= {DETAIL_TARGET_MS:.0f} ms)",
        "",
        "| request | median ms | ratio to target |",
        "| --- | ---: | ---: |",
    ]
    for name, ms, target in detail:
        out.append(f"| {name} | {ms:.1f} | {ms / target:.2f} |")
    out += [
        "",
        f"HTML size {dfacts['html_bytes'] / 1024:.0f} KiB. First request (loads the tokenizer with "
        f"AutoTokenizer, once per run): {dfacts['first_request_ms']:.0f} ms.",
        "",
        f"## Episode list ({lfacts['episodes']:,} episodes, {lfacts['db_mb']:.0f} MiB; target <= {LIST_TARGET_MS:.0f} ms)",
        "",
        f"Database built in {lfacts['build_s']:.1f} s (Store schema, executemany). Pages hold 50 rows; every "
        "page also counts matches up to 10,000.",
        "",
        "| indexes | page | HTML ms | ratio | JSON ms | ratio |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for label, name, html, api in lists:
        out.append(f"| {label} | {name} | {html:.1f} | {html / LIST_TARGET_MS:.2f} | {api:.1f} | {api / LIST_TARGET_MS:.2f} |")
    worst = {label: max(max(h, a) for lab, _, h, a in lists if lab == label) for label in dict.fromkeys(x[0] for x in lists)}
    out += ["", "Worst page: " + "; ".join(f"{k}: {v:.1f} ms ({v / LIST_TARGET_MS:.2f} of target)" for k, v in worst.items())]
    out += ["", f"Covering index used for the second rows: `CREATE INDEX episodes_list ON episodes({', '.join(RECOMMENDED_INDEX)})`.", ""]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--write", type=Path, default=None, help="write the markdown report here")
    args = ap.parse_args()
    cmd = "python benchmarks/viewer.py " + " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        detail, dfacts = bench_detail(root, args.repeats)
        for name, ms, target in detail:
            print(f"detail  {name:28s} {ms:8.1f} ms  ratio {ms / target:.2f}", flush=True)
        lists, lfacts, _ = bench_list(root, args.episodes, args.repeats)
        for label, name, html, api in lists:
            print(f"list    {label:16s} {name:34s} html {html:7.1f} ms ({html / LIST_TARGET_MS:.2f})  json {api:7.1f} ms ({api / LIST_TARGET_MS:.2f})")
    text = report(detail, dfacts, lists, lfacts, args.repeats, cmd)
    print(text)
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
