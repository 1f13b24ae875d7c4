#!/usr/bin/env bash
# Resume is exact (issue 12): a constant-lr run interrupted with SIGINT after step 2 and continued with
# --resume plays, token for token, the episodes of an uninterrupted run of the same config.
#
#   bash benchmarks/resume_replay.sh [WORKDIR]      # default WORKDIR: a fresh temporary folder
#
# Models: the tiny test models of tests/conftest.py (build_tiny_home: made in a second, not trained), so
# the whole check takes about a minute; with AGENTOPD_HOME set to a built home the embedded default is used.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${1:-$(mktemp -d)}"
mkdir -p "$work" && cd "$work"
if [[ -z "${AGENTOPD_HOME:-}" ]]; then
    export AGENTOPD_HOME="$work/home"
    python -c "import sys; sys.path.insert(0, '$root/tests'); from pathlib import Path; from conftest import build_tiny_home; build_tiny_home(Path('$AGENTOPD_HOME'))"
fi
ARGS=(steps=6 rollout.tasks_per_step=16 rollout.n=2 rollout.temperature=1.0 rollout.max_new_tokens=32
      trainer.schedule=constant trainer.warmup_steps=0 trainer.lr=1e-2 eval.every=0 eval.num_tasks=4
      eval.teacher=false run.checkpoint_every=1)
rm -rf straight interrupted
agentopd run --env sql_db --run-dir straight "${ARGS[@]}" > straight.log 2>&1
agentopd run --env sql_db --run-dir interrupted "${ARGS[@]}" > interrupted.log 2>&1 &
pid=$!
until grep -q '"step": 2' interrupted/metrics.jsonl 2>/dev/null; do sleep 0.05; done
kill -INT "$pid"
wait "$pid" || echo "interrupted run exited with $?"
grep -E "Ctrl-C|stopped|interrupted" interrupted.log || true
agentopd run --env sql_db --run-dir interrupted --resume > resumed.log 2>&1
grep -E "resumed" resumed.log
python - <<'PY'
import sqlite3
q = "select id, step, token_ids from episodes where split='train' order by id"
a = {i: (s, t) for i, s, t in sqlite3.connect("straight/trajectories.db").execute(q)}
b = {i: (s, t) for i, s, t in sqlite3.connect("interrupted/trajectories.db").execute(q)}
assert a.keys() == b.keys(), (len(a), len(b))
for step in sorted({s for s, _ in a.values()}):
    ids = [i for i in a if a[i][0] == step]
    same = sum(a[i][1] == b[i][1] for i in ids)
    print(f"step {step}: {same}/{len(ids)} episodes token-identical to the uninterrupted run")
PY
