"""60 SFT steps of the sql_db teacher (agentopd.bootstrap.sft) on 600 oracle demonstrations, twice: run it with
PYTHONPATH pointing at two checkouts to compare the trainer's CPU speed across commits (default_run.md).
Argument: an AGENTOPD_HOME whose tokenizer is built (default /tmp/fresh_home)."""
import dataclasses, sys, time
from pathlib import Path
import torch
from transformers import Qwen3ForCausalLM
from agentopd.bootstrap import BootstrapSpec, demonstrations, ensure_tokenizer, preset_env_kwargs, sft
import agentopd; print(agentopd.__file__)
spec = BootstrapSpec()
tok = ensure_tokenizer(spec, home=Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/fresh_home"))
demos = demonstrations("sql_db", tok, 600, 2048, env_kwargs=preset_env_kwargs("sql_db"))
# the teacher's SFT settings at 60 steps, built without naming their class (SFTPlan before, SFTSpec now): any checkout
sft_spec = dataclasses.replace(spec.teacher, max_steps=60, lr=5e-3, target_success=None)
for rep in range(2):
    torch.manual_seed(0)
    m = Qwen3ForCausalLM(sft_spec.size.config(tok, 2048))
    t = time.perf_counter(); r = sft(m, demos, sft_spec); dt = time.perf_counter() - t
    print(f"rep {rep}: 60 SFT steps {dt:.1f} s ({dt/60:.3f} s/step), final loss {r['final_loss']:.4f}")
