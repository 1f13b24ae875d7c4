"""TRL's side of benchmarks/vs_trl.py: `trl.DistillationTrainer` as a user runs it, timed. Runs in TRL's own venv.

    .venv-trl/bin/python benchmarks/vs_trl_trl_side.py SPEC.json OUT_DIR    # SPEC written by benchmarks/vs_trl.py

Needs only trl and its dependencies (no agentopd install): the sql_db task's `sql_query` tool is the env's own
`tools.sql.SqlDatabase.sql_query` (imported from this checkout) wrapped as a plain Python function, as a TRL user
would write it. TRL's trainer is used as shipped; its methods are wrapped only to time them and to record what it
generated (no behaviour changes):

- generation: `_generate_single_turn` (transformers `generate`, every turn, all prompts of the step);
- tool calls: the tool function itself;
- teacher: `_get_last_hidden_state` called on the teacher (TRL runs it inside the loss);
- train: the rest of the optimizer step (student forward/backward, chunked divergence, optimizer).

Writes OUT_DIR/trl_result.json (per-step records, peak memory, where the final student is) and OUT_DIR/final/.
With tools, OUT_DIR/trl_streams.json holds every step's conversations and the exact token ids TRL trained on
(prompt ids, completion ids, tool_mask) for agentopd's drift checker.
"""

from __future__ import annotations

import copy
import importlib.machinery
import json
import os
import resource
import sys
import time
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


class StandIn(types.ModuleType):
    """A module that is not installed: any attribute is an empty class (what isinstance checks and annotations
    read); calling one with arguments fails loudly (TypeError), so code that really uses the module cannot pass."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(name, (), {})
        setattr(self, name, cls)
        return cls


def datasets_or_stand_in() -> str:
    """TRL imports `datasets` and `pyarrow` at module level (trl/data_utils.py, trainer/*.py; pyarrow is a 52 MiB
    cp312 wheel), but with a list of prompts as train_dataset the distillation path uses only their classes, in
    isinstance checks. Where they are not installed (our GPU machines), stand-ins take their place.
    VS_TRL_NO_DATASETS=1 hides installed ones (to test this where they are installed). Returns what is in use."""
    names = ("datasets", "pyarrow", "pyarrow.compute", "pyarrow.types")
    if os.environ.get("VS_TRL_NO_DATASETS") == "1":
        for name in names:
            sys.modules[name] = None  # `import name` now raises ImportError
    try:
        import datasets
        import pyarrow

        return f"datasets {datasets.__version__}, pyarrow {pyarrow.__version__}"
    except ImportError:
        import pandas  # noqa: F401  first, so that it sees pyarrow missing (its optional import), not the stand-in

        for name in names:
            sys.modules[name] = StandIn(name)
            sys.modules[name].__spec__ = importlib.machinery.ModuleSpec(name, None)  # importlib.util.find_spec reads it
        sys.modules["pyarrow"].compute, sys.modules["pyarrow"].types = sys.modules["pyarrow.compute"], sys.modules["pyarrow.types"]
        return "stand-ins for datasets and pyarrow (not installed)"


class Clock:
    """Seconds per phase, reset at each optimizer step."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}
        self.generated = 0  # tokens the student sampled (tool_mask 1) this step
        self.trained = 0  # real (unpadded) tokens of prompt + completion forwarded this step

    def add(self, key: str, seconds: float) -> None:
        self.s[key] = self.s.get(key, 0.0) + seconds

    def timed(self, key: str, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(key, time.perf_counter() - t)

        return wrapper


def sql_tool(spec: dict, clock: Clock):
    """`sql_query` as a plain function over the env's database (same tool text as agentopd's env shows)."""
    sys.path.insert(0, str(REPO))
    from tools.sql import SqlDatabase

    db = SqlDatabase(spec["db_path"], **spec["db_kwargs"])

    def sql_query(query: str) -> str:
        """Run one read-only SQL SELECT statement on the database and return the result as a table.

        Args:
            query: One SQLite SELECT statement, e.g. "SELECT * FROM some_table LIMIT 5".
        """
        t = time.perf_counter()
        try:
            return db.sql_query(query)  # a ToolError goes to TRL, which shows the model {'error': message}
        finally:
            clock.add("tools", time.perf_counter() - t)

    return sql_query


def instrument(trainer, clock: Clock, streams: list) -> None:
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
    trainer._generate_single_turn = clock.timed("generation", trainer._generate_single_turn)
    hidden = trainer._get_last_hidden_state

    def last_hidden(model, *args, **kwargs):
        t = time.perf_counter()
        out = hidden(model, *args, **kwargs)
        if model is teacher:
            clock.add("teacher", time.perf_counter() - t)
        return out

    trainer._get_last_hidden_state = last_hidden
    generate = trainer._generate

    def record(prompts):
        prompt_ids, completion_ids, tool_mask, images, tool_images = generate(prompts)
        mask = tool_mask or [[1] * len(c) for c in completion_ids]
        clock.generated += sum(sum(m) for m in mask)
        clock.trained += sum(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids, strict=True))
        return prompt_ids, completion_ids, tool_mask, images, tool_images

    trainer._generate = record
    if trainer.tools:
        loop = trainer._tool_call_loop

        def tool_loop(prompts, prompt_ids, completion_ids, completions, images, multimodal_fields):
            asked = copy.deepcopy(prompts)  # the loop appends to `prompts` in place
            out = loop(prompts, prompt_ids, completion_ids, completions, images, multimodal_fields)
            tool_mask, completions, completion_ids = out[0], out[1], out[2]
            streams.extend(
                {"step": trainer.state.global_step + 1, "prompt": p, "completions": c, "prompt_ids": list(pi),
                 "completion_ids": list(ci), "tool_mask": m}
                for p, c, pi, ci, m in zip(asked, completions, prompt_ids, completion_ids, tool_mask, strict=True)
            )  # fmt: skip
            return out

        trainer._tool_call_loop = tool_loop


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    datasets_used = datasets_or_stand_in()
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    clock, streams, steps = Clock(), [], []
    cuda = spec["device"] == "cuda"
    dtype = torch.float32  # master weights; bf16 autocast on CUDA (TRL's default bf16=True)
    student = AutoModelForCausalLM.from_pretrained(spec["student"], dtype=dtype)
    teacher = AutoModelForCausalLM.from_pretrained(spec["teacher"], dtype=torch.bfloat16 if cuda else dtype)
    tok = AutoTokenizer.from_pretrained(spec["student"], padding_side="left")
    tools = [sql_tool(spec, clock)] if spec["task"] == "sql_db" else None
    args = DistillationConfig(
        output_dir=str(out / "trainer"), max_steps=spec["steps"], per_device_train_batch_size=spec["prompts_per_step"],
        gradient_accumulation_steps=1, learning_rate=spec["lr"], adam_beta1=spec["betas"][0], adam_beta2=spec["betas"][1],
        weight_decay=spec["weight_decay"], max_grad_norm=spec["grad_clip"], lr_scheduler_type="constant", warmup_steps=0,
        beta=spec["beta"], temperature=spec["temperature"], max_completion_length=spec["max_completion_length"],
        generation_kwargs={"max_new_tokens": spec["max_new_tokens"]},  # the per-turn cap (TRL's default: the whole budget)
        max_tool_calling_iterations=spec["max_turns"] - 1 if tools else None,
        bf16=cuda, use_cpu=not cuda, logging_steps=1, save_strategy="no", report_to="none", seed=spec["seed"],
        dataloader_num_workers=0,
    )  # fmt: skip

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            clock.s, clock.generated, clock.trained = {"generation": 0.0, "teacher": 0.0}, 0, 0
            if tools:
                clock.s["tools"] = 0.0
            if cuda:
                torch.cuda.synchronize()
            self.t, self.cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            wall, cpu = time.perf_counter() - self.t, time.process_time() - self.cpu
            s = dict(clock.s)
            rest = wall - sum(s.values())
            steps.append({"step": state.global_step, "wall_s": wall, "cpu_s": cpu, **{f"{k}_s": v for k, v in s.items()}, "train_s": rest,
                          "generated_tokens": clock.generated, "trained_tokens": clock.trained})  # fmt: skip

    trainer = DistillationTrainer(
        model=student, teacher_model=teacher, args=args, train_dataset=[{"prompt": p} for p in spec["prompts"]],
        processing_class=tok, tools=tools, callbacks=[StepTimer()],
    )  # fmt: skip
    instrument(trainer, clock, streams)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t
    trainer.save_model(str(out / "final"))
    AutoTokenizer.from_pretrained(spec["student"]).save_pretrained(out / "final")  # the plain tokenizer, for our evaluator
    result = {
        "steps": steps,
        "train_wall_s": total,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "peak_cuda_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_cuda_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        "final": str(out / "final"),
        "training_chat_template": trainer.chat_template is not None,  # TRL swapped in its prefix-preserving template
        "response_parser": getattr(tok, "response_template", None) is not None or getattr(tok, "response_schema", None) is not None,
        "datasets": datasets_used,
        "versions": {"trl": __import__("trl").__version__, "transformers": __import__("transformers").__version__,
                     "torch": torch.__version__},
    }  # fmt: skip
    (out / "trl_result.json").write_text(json.dumps(result, indent=1))
    if streams:
        (out / "trl_streams.json").write_text(json.dumps(streams, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}))


if __name__ == "__main__":
    main()
