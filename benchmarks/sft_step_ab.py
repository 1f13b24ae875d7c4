"""60 SFT steps of the sql_db teacher (agentopd.bootstrap.sft) on 600 oracle demonstrations, twice: run it with
PYTHONPATH pointing at two checkouts to compare the trainer's CPU speed across commits (default_run.md).
Argument: an AGENTOPD_HOME whose tokenizer is built (default /tmp/fresh_home)."""
import sys, time
from pathlib import Path
import torch
from transformers import Qwen3ForCausalLM
from agentopd.bootstrap import BootstrapSpec, SFTPlan, demonstrations, ensure_tokenizer, preset_env_kwargs, sft
import agentopd; print(agentopd.__file__)
spec = BootstrapSpec()
tok = ensure_tokenizer(spec, home=Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/fresh_home"))
demos = demonstrations("sql_db", tok, 600, 2048, env_kwargs=preset_env_kwargs("sql_db"))
plan = SFTPlan(spec.teacher.size, max_steps=60, lr=5e-3)
for rep in range(2):
    torch.manual_seed(0)
    m = Qwen3ForCausalLM(plan.size.config(tok, 2048))
    t = time.perf_counter(); r = sft(m, demos, plan); dt = time.perf_counter() - t
    print(f"rep {rep}: 60 SFT steps {dt:.1f} s ({dt/60:.3f} s/step), final loss {r['final_loss']:.4f}")
