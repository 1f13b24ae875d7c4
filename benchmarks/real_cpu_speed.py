"""Real checkpoints on a CPU: the rollout engine and the teacher's scoring against transformers on the same prompts.

    python benchmarks/real_cpu_speed.py --model $(agentopd fetch-model qwen2.5-coder-0.5b) --env calculator --prompts 8

Prompts: the env's first held-out tasks rendered by the model's own chat template (with the env's tool schemas).
- rollout: greedy, `--new-tokens` new tokens a prompt (stop ids off, so both sides generate exactly that many): our
  engine (`--engine`, fast by default: the one a run uses) over all prompts at once, against transformers'
  `generate` on the same left-padded batch (`position_ids` from the mask, KV cache on). Ratio = ours / generate.
- teacher: HFTeacher.score of the prompts plus the generated continuations (the run's scoring: log-probs of every
  response token, hidden states for the loss) against one plain padded forward of the same ids that computes the
  same log-probs. Ratio = ours / forward.
Both in the checkpoint's stored dtype (bf16 for real ones: RunContext.inference_dtype) and torch's 2 threads. Prints a
table and one JSON line; a figure taken beside other work is contended: say so where it is recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentopd import make_env
from agentopd.chat import encode, render
from agentopd.engines import make_engine
from agentopd.engines.base import GenerateRequest, SamplingParams
from agentopd.shape import stored_in_bf16
from agentopd.teacher import HFTeacher, TeacherMode
from agentopd.types import TokenStream


def prompts_of(tok, env_name: str, n: int) -> list[list[int]]:
    env = make_env(env_name, split="eval")
    out = []
    for task in env.unwrapped.tasks[:n]:
        messages, info = env.reset(seed=0, options={"task_id": task.id})
        out.append(encode(tok, render(tok, messages, info["tools"] or None, add_generation_prompt=True)))
    env.close()
    return out


def engine_rollout(engine, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=new, temperature=0.0, stop_token_ids=())

    async def go():
        return await asyncio.gather(*(engine.generate(GenerateRequest(p, params, f"b{i}")) for i, p in enumerate(prompts)))

    t0 = time.perf_counter()
    results = asyncio.run(go())
    return time.perf_counter() - t0, [list(r.token_ids) for r in results]


def hf_generate(model, tok, prompts: list[list[int]], new: int) -> float:
    longest = max(map(len, prompts))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=pad)  # fmt: skip
    assert out.shape[1] == longest + new
    return time.perf_counter() - t0


def plain_scores(model, streams: list[TokenStream]) -> float:
    longest = max(len(s.token_ids) for s in streams)
    ids = torch.tensor([s.token_ids + [0] * (longest - len(s.token_ids)) for s in streams])
    mask = torch.tensor([[1] * len(s.token_ids) + [0] * (longest - len(s.token_ids)) for s in streams])
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
        for b, s in enumerate(streams):  # the response tokens' log-probs, as the teacher returns them
            rows = logits[b, s.prompt_len - 1 : len(s.token_ids) - 1]
            torch.log_softmax(rows, -1).gather(-1, torch.tensor(s.response_ids)[:, None])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--env", default="calculator")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--engine", default="fast")
    args = ap.parse_args()
    torch.set_num_threads(2)
    dtype = torch.bfloat16 if stored_in_bf16(args.model) else torch.float32
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = prompts_of(tok, args.env, args.prompts)
    engine = make_engine(args.engine, args.model, device="cpu", dtype=dtype, max_batch_size=len(prompts), seed=0, vocab_size=len(tok))
    engine_rollout(engine, prompts[:1], 4)  # warm-up (first-call set-up)
    ours_s, generated = engine_rollout(engine, prompts, args.new_tokens)
    asyncio.run(engine.close())
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    hf_generate(model, tok, prompts[:1], 4)
    gen_s = hf_generate(model, tok, prompts, args.new_tokens)
    n_new = args.new_tokens * len(prompts)
    streams = [TokenStream(p + g, len(p), [1] * len(g), [0.0] * len(g), [0] * len(g)) for p, g in zip(prompts, generated)]
    teacher = HFTeacher(model, device="cpu", dtype=dtype, offload_after_score=False, vocab_size=len(tok))
    teacher.score(streams[:1], mode=TeacherMode.HIDDEN)
    t0 = time.perf_counter()
    teacher.score(streams, mode=TeacherMode.HIDDEN)
    score_s = time.perf_counter() - t0
    plain_scores(model, streams[:1])
    plain_s = plain_scores(model, streams)
    n_tok = sum(len(s.token_ids) for s in streams)
    row = {"model": args.model, "env": args.env, "dtype": str(dtype), "prompts": len(prompts), "mean_prompt": sum(map(len, prompts)) / len(prompts),
           "new_tokens": args.new_tokens, "engine": args.engine, "rollout_tok_s": n_new / ours_s, "generate_tok_s": n_new / gen_s,
           "rollout_ratio": gen_s / ours_s, "teacher_tok_s": n_tok / score_s, "forward_tok_s": n_tok / plain_s,
           "teacher_ratio": plain_s / score_s}  # fmt: skip
    print(f"rollout ({args.engine})  {row['rollout_tok_s']:8.1f} tok/s   transformers generate {row['generate_tok_s']:8.1f}   ratio {row['rollout_ratio']:.2f}")
    print(f"teacher score  {row['teacher_tok_s']:8.1f} tok/s   plain forward         {row['forward_tok_s']:8.1f}   ratio {row['teacher_ratio']:.2f}")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
