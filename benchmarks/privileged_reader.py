"""A student that can read privileged context: the built-in student, SFT'd further on oracle demonstrations of which
a share carry the env's privileged context in their prompt (agentopd.privileged's prompt, the same text a
`teacher.privileged` teacher reads). The embedded models were trained on one prompt format and are derailed by any
extra text (results/quality_privileged.md), so `teacher=self teacher.privileged=...` cannot be tested from them;
from this student it can: every method of the comparison then starts from it (`student=OUT`).

    python benchmarks/privileged_reader.py --env sql_db --kind solution --steps 150 --share 0.5 --out /tmp/reader
    python benchmarks/privileged_context.py --env sql_db --kind solution --model /tmp/reader
    python benchmarks/quality.py --env sql_db --methods opd,opd_self_privileged,sft ... student=/tmp/reader

The SFT is the embedded student's own (agentopd.bootstrap.sft: lr 3e-3 constant, batch 32), on fresh demonstrations
of training tasks (seeded apart from the bootstrap's).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch


def main() -> None:
    from dataclasses import replace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentopd.batch import TrainSample
    from agentopd.bootstrap import SFTSpec, default_spec, sft
    from agentopd.config import load_config
    from agentopd.engines.scripted import ScriptedEngine
    from agentopd.env import Privileged
    from agentopd.models import resolve_model
    from agentopd.privileged import privileged_stream
    from agentopd.rollout import Rollout, RolloutConfig
    from agentopd.splits import make_env_for_split, without_split

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", default="sql_db")
    ap.add_argument("--kind", default="solution", choices=("solution", "schema"))
    ap.add_argument("--steps", type=int, default=150, help="SFT steps")
    ap.add_argument("--share", type=float, default=0.5, help="share of the demonstrations with the privileged prompt")
    ap.add_argument("--demos", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    cfg = load_config(args.env)
    kwargs = without_split(cfg.env.kwargs)
    ref = resolve_model("builtin", cfg.env.name, "student", env_kwargs=cfg.env.kwargs)
    tokenizer = AutoTokenizer.from_pretrained(ref)

    env = make_env_for_split(cfg.env.name, "train", **kwargs).unwrapped
    rng = random.Random(args.seed)
    task_ids = [t.id for t in env.tasks]
    rng.shuffle(task_ids)
    specs = Rollout.specs_for(task_ids[: args.demos], n=1, split="demo")
    engine = ScriptedEngine(tokenizer)
    texts = {}
    for spec in specs:
        task = env.tasks[env.task_index(options={"task_id": spec.task_id})]
        engine.script(spec.episode_id, env.oracle(task))
        texts[spec.episode_id] = env.privileged_context(task, Privileged(args.kind))
    env.close()
    rollout = Rollout(lambda: make_env_for_split(cfg.env.name, "train", **kwargs), engine, tokenizer,
                      RolloutConfig(max_context=2048, max_new_tokens=2048))  # fmt: skip
    episodes = rollout.run_sync(specs)
    rollout.close()
    samples, privileged = [], 0
    for spec, ep in zip(specs, episodes, strict=True):
        assert ep.success, (spec.task_id, ep.stop_reason)
        stream = ep.tokens
        if rng.random() < args.share:
            stream, privileged = privileged_stream(tokenizer, ep, texts[spec.episode_id]), privileged + 1
        samples.append(TrainSample.from_stream(stream))
    print(f"{len(samples)} demonstrations, {privileged} with the privileged prompt")

    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
    student_spec = default_spec(cfg.env.name).student
    spec = replace(student_spec, max_steps=args.steps, warmup_steps=0, seed=args.seed)
    assert isinstance(spec, SFTSpec)
    report = sft(model, samples, spec, name="reader")
    print(f"SFT: {report['steps']} steps in {report['seconds']} s, final loss {report['final_loss']:.4f}")
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
