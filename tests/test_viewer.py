"""Viewer routes through FastAPI's TestClient against a run directory built by
tests/viewer_fixtures.py (Store + StreamBuilder + step_metrics; swap in a real run's directory
once the main job exists): pages, JSON API, filters and keyset pages, token view, escaping,
404s, path traversal, read-only access, live reload."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
from html import unescape

import pytest
from fastapi.testclient import TestClient
from viewer_fixtures import HOSTILE, RunFixture, add_hostile_episode, build_run, from_real_run

from agentopd.store import Store
from agentopd.viewer import create_app, queries
from agentopd.viewer.runs import RunCatalog, RunNotFound, connect_readonly


@pytest.fixture(scope="module", params=["synthetic", "real"])
def built(request, tmp_path_factory) -> RunFixture:
    """The synthetic fixture run (varied on purpose: many steps, turns, errors) and a directory
    written by a real short `agentopd run` (conftest's `real_run`), each with a hostile episode."""
    if request.param == "synthetic":
        return build_run(tmp_path_factory.mktemp("built") / "demo")
    real = tmp_path_factory.mktemp("real") / "demo"
    shutil.copytree(request.getfixturevalue("real_run"), real)
    return from_real_run(real)


@pytest.fixture
def runs(built, tmp_path):
    """A private copy: <tmp>/runs/demo plus a sibling outside the served folder."""
    root = tmp_path / "runs"
    shutil.copytree(built.path, root / "demo")
    shutil.copytree(built.path, tmp_path / "secret")
    return root, RunFixture(root / "demo", list(built.ids), built.hostile_id, built.steps)


@pytest.fixture
def client(runs):
    return TestClient(create_app(runs[0]))


def all_rows(path):
    conn = sqlite3.connect(path / "trajectories.db")
    conn.row_factory = sqlite3.Row
    rows = [dict(r) for r in conn.execute("SELECT * FROM episodes ORDER BY step, id")]
    conn.close()
    return rows


def test_index_and_run_info(client, runs):
    _, fx = runs
    html = client.get("/").text
    assert 'href="/runs/demo"' in html
    (info,) = client.get("/api/runs").json()
    assert info["name"] == "demo" and info["env"] == "sql_db" and info["last_step"] == fx.steps - 1
    assert info["episodes"] == len(fx.ids) and info["splits"]["eval"] > 0
    metrics = [json.loads(line) for line in (fx.path / "metrics.jsonl").read_text().splitlines()]
    assert info["success_rate"] == metrics[-1]["success_rate"]
    assert info["eval_success_rate"] == [m for m in metrics if "eval/success_rate" in m][-1]["eval/success_rate"]
    assert info["has_tokenizer"] and info["has_trajectories"] and info["has_metrics"]


def test_single_run_directory(runs):
    _, fx = runs
    c = TestClient(create_app(fx.path))
    assert [r["name"] for r in c.get("/api/runs").json()] == ["demo"]
    assert c.get(f"/runs/demo/episodes/{fx.ids[0]}").status_code == 200
    assert c.get("/runs/other").status_code == 404


def synthetic_only(fx) -> None:
    """Checks written against the synthetic run's known shape (many turns, folded outputs)."""
    if (fx.path / "config.yaml").exists():
        pytest.skip("relies on the synthetic run's shape; the real run is checked by test_real_run_episode")


def test_run_page_charts(client, runs):
    synthetic_only(runs[1])
    html = client.get("/runs/demo").text
    assert html.count("<polyline") >= 4  # loss, kl/mean, success_rate, eval/success_rate, reward/mean
    heat_titles = re.findall(r"<title>(turn \d+, step \d+: kl [^<]+)</title>", html)
    assert heat_titles and {t.split(",")[0] for t in heat_titles} >= {"turn 0", "turn 1"}
    metrics = client.get("/api/runs/demo/metrics").json()["rows"]
    assert {"loss", "kl/mean", "kl/turn_0", "success_rate", "tool_mask/tool_ratio"} <= set(metrics[0])


def test_run_page_shows_the_teacher_selftest(client, runs):
    """The real run's pre-flight (teacher/selftest_* at step 1) as its own panel; the synthetic run has none."""
    html = client.get("/runs/demo").text
    real = "teacher/selftest_signal" in (runs[1].path / "metrics.jsonl").read_text()  # every real run has one
    assert ("teacher self-test" in html) == real
    if real:
        panel = html.split("teacher self-test", 1)[1].split("</section>", 1)[0]
        assert "before step 1" in panel
        for key in ("signal", "noise_share", "repeat_max_diff", "entropy_share", "score_temperature", "loss_temperature"):
            assert f"<code>{key}</code>" in panel, key


def walk(client, limit, order, start="first"):
    """Every id by following cursors from the first (or last) page; checks page sizes."""
    params = {"limit": limit, "order": order}
    if start == "last":
        params["last"] = "true"
    seen = []
    while True:
        page = client.get("/api/runs/demo/episodes", params=params).json()
        assert 0 < len(page["items"]) <= limit
        ids = [e["id"] for e in page["items"]]
        seen = seen + ids if start == "first" else ids + seen
        cursor = page["next_cursor"] if start == "first" else page["prev_cursor"]
        if cursor is None:
            return seen
        params = {"limit": limit, "order": order, ("after" if start == "first" else "before"): cursor}


def test_keyset_pages_cover_every_episode_once(client, runs):
    _, fx = runs
    assert walk(client, 5, "asc") == fx.ids
    assert walk(client, 4, "desc") == fx.ids[::-1]
    assert walk(client, 5, "asc", start="last") == fx.ids
    assert walk(client, 3, "desc", start="last") == fx.ids[::-1]
    last = client.get("/api/runs/demo/episodes", params={"limit": 5, "order": "asc", "last": "true"}).json()
    assert [e["id"] for e in last["items"]] == fx.ids[-5:] and last["next_cursor"] is None


FILTERS = [
    ({"success": "false"}, lambda r: not r["success"]),
    ({"split": "eval"}, lambda r: r["split"] == "eval"),
    ({"step_min": 1, "step_max": 2}, lambda r: 1 <= r["step"] <= 2),
    ({"reward_min": 0.5}, lambda r: r["reward"] >= 0.5),
    ({"reward_max": 0.5, "split": "train"}, lambda r: r["reward"] <= 0.5 and r["split"] == "train"),
    ({"stop_reason": "max_turns"}, lambda r: r["stop_reason"] == "max_turns"),
    ({"min_turns": 4}, lambda r: r["num_turns"] >= 4),
    ({"env": "sql_db", "success": "true"}, lambda r: r["env"] == "sql_db" and r["success"]),
    ({"env": "calculator"}, lambda r: False),
]


@pytest.mark.parametrize(("params", "keep"), FILTERS, ids=[json.dumps(p) for p, _ in FILTERS])
def test_filters_match_sql_truth(client, runs, params, keep):
    _, fx = runs
    want = [r["id"] for r in all_rows(fx.path) if keep(r)]
    page = client.get("/api/runs/demo/episodes", params={**params, "order": "asc", "limit": 500}).json()
    assert [e["id"] for e in page["items"]] == want and page["matches"] == len(want)
    html = client.get("/runs/demo/episodes", params=params).text
    assert len(re.findall(r'<tr class="(?:ok|fail)">', html)) == len(want)
    if params.get("success") == "false":  # the filter stays in the form and in page links
        assert '<option value="false" selected>' in html


def test_blank_form_fields_mean_no_filter_and_bad_values_are_400(client, runs):
    _, fx = runs
    page = client.get("/api/runs/demo/episodes?step_min=&env=&success=&limit=500").json()
    assert len(page["items"]) == len(fx.ids)
    assert client.get("/api/runs/demo/episodes?step_min=abc").status_code == 422
    assert client.get("/api/runs/demo/episodes?after=nocursor").status_code == 422
    assert client.get("/api/runs/demo/episodes?stop_reason=exploded").status_code == 422
    r = client.get("/runs/demo/episodes?step_min=abc")
    assert r.status_code == 400 and "step_min" in r.text and "<h1>400" in r.text


def test_match_count_is_capped(client, monkeypatch):
    monkeypatch.setattr(queries, "COUNT_CAP", 5)
    page = client.get("/api/runs/demo/episodes").json()
    assert page["matches"] == 5 and page["matches_capped"]
    assert "5+ matching" in client.get("/runs/demo/episodes").text


def test_episode_json(client, runs):
    _, fx = runs
    synthetic_only(fx)
    row = next(r for r in all_rows(fx.path) if r["id"] == fx.ids[3])
    d = client.get(f"/api/runs/demo/episodes/{fx.ids[3]}").json()
    assert d["token_ids"] == json.loads(row["token_ids"]) and d["messages"] == json.loads(row["messages"])
    assert (d["prev_id"], d["next_id"]) == (fx.ids[2], fx.ids[4])
    mask, lp, tlp, turn = (json.loads(row[k]) for k in ("response_mask", "logprobs", "teacher_logprobs", "turn_index"))
    for k, kl in enumerate(d["turn_kl"]):
        diffs = [a - b for m, a, b, t in zip(mask, lp, tlp, turn) if m and t == k]
        assert kl == pytest.approx(sum(diffs) / len(diffs))
    first = client.get(f"/api/runs/demo/episodes/{fx.ids[0]}").json()
    assert first["prev_id"] is None


def test_episode_page_turns_and_token_view(client, runs):
    from transformers import AutoTokenizer

    _, fx = runs
    synthetic_only(fx)
    eid = fx.ids[4]
    d = client.get(f"/api/runs/demo/episodes/{eid}").json()
    html = client.get(f"/runs/demo/episodes/{eid}").text
    n_turns = max(d["turn_index"]) + 1
    assert len(re.findall(r'<section class="turn[^"]*" id="turn-\d+"', html)) == n_turns == d["num_turns"]
    for kl in d["turn_kl"]:
        assert f"KL {kl:.4g}</span>" in html  # per-turn KL beside each turn
    spans = re.findall(r'<span class="t ([^"]+)" title="([^"]*)"( tabindex="0")?>(.*?)</span>', html, re.S)
    assert len(spans) == len(d["token_ids"])  # prompt + every response token, none dropped by folding
    student = [s for s in spans if s[0].startswith("s")]
    assert len(student) == sum(d["response_mask"]) and all(s[2] for s in student)  # focusable
    assert not any(s[2] for s in spans if not s[0].startswith("s"))
    i = d["response_mask"].index(1)  # the first student token: exact numbers in its title
    lp, tlp = d["logprobs"][i], d["teacher_logprobs"][i]
    assert student[0][1] == f"#{d['token_ids'][d['prompt_len'] + i]} student logp {lp:.4f} | teacher logp {tlp:.4f} | log-ratio {lp - tlp:+.4f}"
    tok = AutoTokenizer.from_pretrained(str(fx.path / "tokenizer"))
    text = "".join(unescape(s[3]) for s in spans).replace("↵\n", "\n")
    assert text == tok.decode(d["token_ids"], skip_special_tokens=False)
    assert html.count('class="fold tokfold"') >= 1 and "40 lines" in html  # long tool output folded
    assert f'href="/api/runs/demo/episodes/{eid}"' in html  # raw JSON
    assert f'href="/runs/demo/episodes/{fx.ids[3]}"' in html and f'href="/runs/demo/episodes/{fx.ids[5]}"' in html


def test_token_ids_without_tokenizer(runs):
    root, fx = runs
    synthetic_only(fx)
    shutil.rmtree(fx.path / "tokenizer")
    c = TestClient(create_app(root))
    d = c.get(f"/api/runs/demo/episodes/{fx.ids[0]}").json()
    html = c.get(f"/runs/demo/episodes/{fx.ids[0]}").text
    assert "token ids shown" in html
    shown = re.findall(r'<span class="t [^"]+" title="[^"]*"(?: tabindex="0")?>(\d+) </span>', html)
    assert [int(x) for x in shown] == d["token_ids"]


def test_hostile_text_is_escaped_everywhere(client, runs):
    root, fx = runs
    with (fx.path / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 99, "<script>window.__pwned=3</script>": 1.0, "loss": 0.1}) + "\n")
    (root / "<img src=x onerror=alert(4)>").mkdir()
    (root / "<img src=x onerror=alert(4)>" / "metrics.jsonl").write_text('{"step": 0, "loss": 1}\n')
    pages = [
        "/",
        "/runs/demo",
        "/runs/demo/episodes",
        f"/runs/demo/episodes/{fx.hostile_id}",
        f"/runs/demo/episodes/{fx.ids[-2]}",  # its next-episode neighbour is the hostile one
    ]
    for url in pages:
        html = client.get(url).text
        for bad in ("<script>window", "<script>alert", "<img src=x", "</textarea>", "<b>bold"):
            assert bad not in html, (url, bad)
    html = client.get(f"/runs/demo/episodes/{fx.hostile_id}").text
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in html
    assert html.count("&lt;/textarea&gt;") >= 5
    page_text = unescape(re.sub(r"<[^>]+>", "", html))
    assert HOSTILE in page_text  # shown literally
    assert "&lt;script&gt;window.__pwned=3&lt;/script&gt;" in client.get("/runs/demo").text
    assert 'href="/runs/%3Cimg%20src%3Dx%20onerror%3Dalert%284%29%3E"' in client.get("/").text


def test_security_headers_and_no_external_assets(client, runs):
    _, fx = runs
    r = client.get(f"/runs/demo/episodes/{fx.hostile_id}")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    for url in ("/", "/runs/demo", "/runs/demo/episodes", f"/runs/demo/episodes/{fx.ids[0]}", "/api-docs"):
        html = client.get(url).text
        assert not re.search(r'(src|href)="(https?:)?//', html), url
    for asset in ("/static/viewer.css", "/static/viewer.js"):
        body = client.get(asset).text
        assert "http://" not in body and "https://" not in body
    assert client.get("/docs").status_code == 404  # Swagger UI would load from a CDN


def test_trusted_hosts(runs):
    c = TestClient(create_app(runs[0], allowed_hosts=["127.0.0.1", "localhost"]), base_url="http://127.0.0.1")
    assert c.get("/").status_code == 200
    assert c.get("/", headers={"host": "evil.example"}).status_code == 400


def test_unknown_runs_and_episodes_are_404(client):
    for url in ("/runs/nope", "/runs/nope/episodes", "/runs/demo/episodes/nope", "/runs/nope/episodes/x"):
        r = client.get(url)
        assert r.status_code == 404 and "<h1>404" in r.text and "text/html" in r.headers["content-type"], url
    for url in ("/api/runs/nope", "/api/runs/nope/episodes", "/api/runs/nope/metrics", "/api/runs/demo/episodes/nope"):
        r = client.get(url)
        assert r.status_code == 404 and "detail" in r.json(), url


TRAVERSALS = ["%2e%2e", "%2e", "..%2Fsecret", "%2E%2E%2Fsecret", "..%5Csecret", "%2Fetc", "secret", ".hidden"]


@pytest.mark.parametrize("name", TRAVERSALS)
def test_run_names_cannot_escape_the_served_folder(client, name):
    for url in (f"/runs/{name}", f"/api/runs/{name}/metrics", f"/api/runs/{name}/episodes"):
        r = client.get(url)
        assert r.status_code == 404, (url, r.status_code)
        assert "loss" not in r.text


def test_catalog_lookup(runs, tmp_path):
    root, _ = runs
    cat = RunCatalog(root)
    assert cat.names() == ["demo"]
    for bad in ("..", "../secret", str(tmp_path / "secret"), "demo/..", "", ".", "de\0mo", "demo\\..\\..\\secret"):
        with pytest.raises(RunNotFound):
            cat.get(bad)
    with pytest.raises(ValueError, match="run directory or a folder"):
        RunCatalog(tmp_path / "missing")


def test_database_is_read_only(client, runs):
    _, fx = runs
    db = fx.path / "trajectories.db"
    before = db.stat().st_mtime_ns
    for url in ("/", "/runs/demo", "/runs/demo/episodes", f"/runs/demo/episodes/{fx.ids[0]}"):
        assert client.get(url).status_code == 200
    assert db.stat().st_mtime_ns == before
    conn = connect_readonly(db)
    with pytest.raises(sqlite3.OperationalError):
        conn.execute("DELETE FROM episodes")
    conn.close()


def test_live_run_shows_new_episodes_and_metrics_on_reload(client, runs):
    _, fx = runs
    assert client.get("/api/runs/demo").json()["episodes"] == len(fx.ids)
    writer = Store(fx.path / "trajectories.db")  # a run still writing, WAL mode
    new_id = add_hostile_episode(fx.path, step=fx.steps)
    with (fx.path / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": fx.steps, "loss": 0.01, "success_rate": 0.875}) + "\n")
    info = client.get("/api/runs/demo").json()
    assert info["episodes"] == len(fx.ids) + 1 and info["last_step"] == fx.steps and info["success_rate"] == 0.875
    assert new_id in client.get("/runs/demo/episodes").text
    assert client.get("/api/runs/demo/metrics").json()["rows"][-1]["loss"] == 0.01
    writer.close()


def test_openapi_documents_the_api(client):
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/api/runs", "/api/runs/{run}/episodes", "/api/runs/{run}/episodes/{episode_id}", "/api/runs/{run}/metrics"} <= set(paths)
    params = {p["name"] for p in paths["/api/runs/{run}/episodes"]["get"]["parameters"]}
    assert {"step_min", "step_max", "env", "split", "success", "reward_min", "reward_max", "stop_reason", "min_turns", "after", "before"} <= params
    assert "/api/runs/{run}/episodes" in client.get("/api-docs").text


def test_metrics_with_nan_and_partial_lines(runs, client):
    _, fx = runs
    with (fx.path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 50, "loss": NaN, "kl/mean": Infinity}\n{"step": 51, "lo')  # a writer mid-line
    rows = client.get("/api/runs/demo/metrics").json()["rows"]
    assert rows[-1]["step"] == 50 and rows[-1]["loss"] is None and rows[-1]["kl/mean"] is None
    assert client.get("/runs/demo").status_code == 200


def test_real_run_episode(client, runs):
    """A scored training episode of the real run: JSON, per-turn KL, token view, metrics rows."""
    _, fx = runs
    if not (fx.path / "config.yaml").exists():
        pytest.skip("real run only")
    row = next(r for r in all_rows(fx.path) if r["split"] == "train" and r["teacher_logprobs"])
    d = client.get(f"/api/runs/demo/episodes/{row['id']}").json()
    mask, lp, tlp, turn = (json.loads(row[k]) for k in ("response_mask", "logprobs", "teacher_logprobs", "turn_index"))
    for k, kl in enumerate(d["turn_kl"]):
        diffs = [a - b for m, a, b, t in zip(mask, lp, tlp, turn) if m and t == k]
        assert kl == pytest.approx(sum(diffs) / len(diffs))
    html = client.get(f"/runs/demo/episodes/{row['id']}").text
    spans = re.findall(r'<span class="t ([^"]+)" title="([^"]*)"( tabindex="0")?>(.*?)</span>', html, re.S)
    assert len(spans) == len(d["token_ids"])
    assert len([s for s in spans if s[0].startswith("s")]) == sum(mask)
    rows = client.get("/api/runs/demo/metrics").json()["rows"]
    train_rows = [r for r in rows if "loss" in r]
    assert train_rows and {"loss", "kl/mean", "kl/turn_0", "success_rate", "tool_mask/tool_ratio"} <= set(train_rows[-1])
    html = client.get("/runs/demo").text
    assert html.count("<polyline") >= 3
