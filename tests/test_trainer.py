"""Trainer (plain and FSDP2 world size 1): chunked logprobs, schedule, micro-batch independence,
resume in a new process, engine state dict, export. The 2-process test is test_trainer_dist.py."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist_worker import STEPS, batch, scenario
from _tiny import VOCAB, make_samples, one_thread, tiny_model  # noqa: F401  (one_thread: autouse fixture)

from agentopd.batch import TrainSample
from agentopd.trainer import (
    LossKind,
    Trainer,
    TrainerConfig,
    chunked_token_logprobs,
    export_checkpoint,
    lr_factor,
)

# eps=1: Adam's first update is -lr * g / (|g| + 1), a monotonic map of the gradient, so equal
# parameter deltas after one step mean equal gradients (plain eps=1e-8 turns ~1e-9 gradient noise
# on near-zero gradients into ~lr-sized sign flips).
CFG = dict(lr=1e-2, eps=1.0, micro_batch_tokens=64, warmup_steps=1, total_steps=STEPS, weight_decay=0.1)
TESTS = Path(__file__).parent


def _have_losses(*names: str) -> bool:
    try:
        from agentopd import losses
    except ImportError:
        return False
    return all(hasattr(losses, n) for n in names)


LOSS_NEEDS = {
    LossKind.SFT: (),
    LossKind.SAMPLED_K1: ("opd_advantages", "policy_gradient_loss"),
    LossKind.SAMPLED_K3: ("opd_advantages", "policy_gradient_loss"),
    LossKind.GRPO: ("grpo_advantages", "policy_gradient_loss"),
    LossKind.FORWARD_KL: ("chunked_divergence",),
    LossKind.REVERSE_KL: ("chunked_divergence",),
    LossKind.JSD: ("chunked_divergence",),
    LossKind.TOPK_FORWARD_KL: ("topk_forward_kl_hidden",),
    LossKind.XTOK_K1: ("opd_advantages", "policy_gradient_loss"),  # span advantages arrive as teacher logprobs
    LossKind.XTOK_FULL: ("cross_full_per_token",),  # make_samples' top-k rows read as mapped 1:1 span starts
}


def _params(trainer):
    return {k: v.clone() for k, v in trainer.state_dict_for_engine().items()}


def test_chunked_token_logprobs_match_log_softmax():
    g = torch.Generator().manual_seed(0)
    hidden_NH = torch.randn(11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    head_VH = torch.randn(20, 8, generator=g, dtype=torch.float64, requires_grad=True)
    targets_N = torch.randint(0, 20, (11,), generator=g)
    w_N = torch.randn(11, generator=g, dtype=torch.float64)
    logp_NV = torch.log_softmax(hidden_NH @ head_VH.T / 0.7, -1)
    ref_N = logp_NV.gather(-1, targets_N[:, None])[:, 0]
    ref_grads = torch.autograd.grad((ref_N * w_N).sum(), (hidden_NH, head_VH))
    got_N, entropy_N = chunked_token_logprobs(hidden_NH, head_VH, targets_N, temperature=0.7, chunk_size=3)
    grads = torch.autograd.grad((got_N * w_N).sum(), (hidden_NH, head_VH))
    torch.testing.assert_close(got_N, ref_N.float(), atol=1e-5, rtol=0)  # fp32 logits inside
    torch.testing.assert_close(entropy_N, -(logp_NV.exp() * logp_NV).sum(-1).float().detach(), atol=1e-5, rtol=0)
    for got, ref in zip(grads, ref_grads):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_lr_schedule_and_config_errors():
    cfg = TrainerConfig(lr=1.0, warmup_steps=3, total_steps=13, min_lr_ratio=0.1)
    assert [lr_factor(s, cfg) for s in range(3)] == pytest.approx([0.25, 0.5, 0.75])
    assert lr_factor(3, cfg) == pytest.approx(1.0)
    assert lr_factor(8, cfg) == pytest.approx(0.55)
    assert lr_factor(13, cfg) == lr_factor(50, cfg) == pytest.approx(0.1)
    assert lr_factor(9, TrainerConfig(warmup_steps=3, schedule="constant")) == 1.0
    with pytest.raises(ValueError, match="trainer.loss='kl'"):
        TrainerConfig(loss="kl")
    with pytest.raises(ValueError, match="trainer.lr"):
        TrainerConfig(lr=0)
    with pytest.raises(ValueError, match="cpu_offload"):
        Trainer(tiny_model(), TrainerConfig(cpu_offload=True))  # needs FSDP2 on CUDA


@pytest.mark.parametrize("kind", list(LossKind))
def test_gradient_independent_of_micro_batching(kind):
    if not _have_losses(*LOSS_NEEDS[kind]):
        pytest.skip(f"agentopd.losses lacks {LOSS_NEEDS[kind]}")
    samples = make_samples(6, seed=2, teacher_hidden=16)
    teacher_head_VH = torch.randn(VOCAB, 16, generator=torch.Generator().manual_seed(3))
    # the episode-level terms must not depend on micro-batching either
    extra = {
        LossKind.SFT: {"task_reward_coef": 0.5, "reward_beta": 0.5},
        LossKind.SAMPLED_K1: {"task_reward_coef": 0.5, "tcad_power": 1.0, "pg_mode": "ppo_clip"},
        LossKind.REVERSE_KL: {"task_reward_coef": 0.5, "reward_beta": 0.5, "tcad_power": 2.0},
        LossKind.JSD: {"reward_beta": 2.0, "beta": 0.3},
    }.get(kind, {})
    deltas, losses = [], []
    for budget in (1, 64, 10_000):  # one sample per micro-batch, a few, everything in one
        trainer = Trainer(tiny_model(), TrainerConfig(**CFG | extra | {"loss": kind, "micro_batch_tokens": budget}))
        before = _params(trainer)
        m = trainer.train_step(samples, teacher_head_VH=teacher_head_VH)
        after = _params(trainer)
        deltas.append({k: (after[k] - before[k]) / trainer.cfg.lr for k in before})
        losses.append(m["loss"])
    for d, loss in zip(deltas[1:], losses[1:]):
        assert loss == pytest.approx(losses[0], abs=1e-6)
        for k in d:
            torch.testing.assert_close(d[k], deltas[0][k], atol=1e-6, rtol=0, msg=k)
    assert max(v.abs().max() for v in deltas[0].values()) > 1e-3  # the step did move the weights


def test_fsdp_world_1_matches_plain(tmp_path):
    plain = scenario(TrainerConfig(**CFG, loss="sft"), str(tmp_path / "plain"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        sharded = scenario(TrainerConfig(**CFG, loss="sft"), str(tmp_path / "fsdp"))
        options = {}  # activation checkpointing: same numbers; bf16 compute: close
        for name, extra in {"ac": {"activation_checkpointing": True}, "bf16": {"mixed_precision": "bf16"}}.items():
            trainer = Trainer(tiny_model(), TrainerConfig(**CFG | extra, loss="sft"))
            options[name] = [trainer.train_step(batch(s))["loss"] for s in range(3)]
    finally:
        dist.destroy_process_group()
    assert sharded["losses"] == pytest.approx(plain["losses"], abs=1e-6)
    init = tiny_model().state_dict()
    for k in init:
        torch.testing.assert_close(sharded["params_1"][k] - init[k], plain["params_1"][k] - init[k], atol=1e-8, rtol=0)
    assert options["ac"] == pytest.approx(plain["losses"][:3], abs=1e-6)
    assert options["bf16"] == pytest.approx(plain["losses"][:3], abs=2e-2)
    assert options["bf16"] != pytest.approx(plain["losses"][:3], abs=1e-7)  # bf16 really was used
    assert sharded["resumed_losses"] == sharded["losses"]  # resume under FSDP: bit-identical
    assert plain["resumed_losses"] == plain["losses"]  # resume in one process: bit-identical
    assert sharded["step"] == STEPS


def test_resume_in_a_new_process_is_bit_identical(tmp_path):
    cfg_kwargs = CFG | {"loss": "sft"}
    trainer = Trainer(tiny_model(), TrainerConfig(**cfg_kwargs))
    straight = [trainer.train_step(batch(s))["loss"] for s in range(STEPS)]
    straight_params = trainer.state_dict_for_engine()
    trainer = Trainer(tiny_model(), TrainerConfig(**cfg_kwargs))
    first = [trainer.train_step(batch(s))["loss"] for s in range(3)]
    torch.manual_seed(1234)  # RNG state travels with the checkpoint
    trainer.save_checkpoint(tmp_path / "ckpt", extra={"next_step": 3})
    del trainer
    subprocess.run(
        [sys.executable, str(TESTS / "_dist_worker.py"), json.dumps(cfg_kwargs), str(tmp_path / "ckpt"),
         str(tmp_path / "out.pt")],
        check=True,
    )
    resumed = torch.load(tmp_path / "out.pt")
    assert first + resumed["losses"] == straight  # bit-identical on CPU
    for k, v in straight_params.items():
        assert torch.equal(resumed["params_6"][k], v), k
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    assert meta["step"] == 3 and meta["extra"] == {"next_step": 3}


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<unk>": VOCAB - 2, "<|im_end|>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} <|im_end|> {% endfor %}"
    return fast


def test_state_dict_for_engine_and_export_reload(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = Trainer(tiny_model(tie=False), TrainerConfig(**CFG, loss="sft"))
    trainer.train_step(make_samples(4))
    sd = trainer.state_dict_for_engine()
    assert set(sd) == set(trainer.hf.state_dict()) and all(v.device.type == "cpu" for v in sd.values())
    trainer.export(tmp_path / "final", _tokenizer())
    assert (tmp_path / "final" / "chat_template.jinja").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "final")
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "w1 w2 w3"}], tokenize=True)["input_ids"]])
    with torch.no_grad():
        trainer.hf.eval()
        torch.testing.assert_close(reloaded(ids).logits, trainer.hf(ids, use_cache=False).logits, atol=0, rtol=0)
    assert ids.shape[1] == 4
    # a checkpoint directory exports to the same folder contents (CLI `agentopd export`)
    trainer.save_checkpoint(tmp_path / "ckpt", extra={})
    export_checkpoint(tmp_path / "ckpt", tmp_path / "from_ckpt", _tokenizer())
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "from_ckpt").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, reloaded(ids).logits, atol=0, rtol=0)
    assert (tmp_path / "from_ckpt" / "chat_template.jinja").is_file()
    with pytest.raises(ValueError, match="not a trainer checkpoint"):
        export_checkpoint(tmp_path / "final", tmp_path / "x")


# ---- end to end: each distillation loss moves a student toward a tiny teacher --------------------
def _peaked_teacher():
    teacher = tiny_model(seed=7).eval()
    with torch.no_grad():
        teacher.lm_head.weight.mul_(8.0)  # tied with the embeddings: a distinct, peaked distribution
    return teacher


def _sample(model, prompts_BP, new_tokens, g):
    ids_BT = prompts_BP
    with torch.no_grad():
        for _ in range(new_tokens):
            logits_BV = model(ids_BT, use_cache=False).logits[:, -1]
            ids_BT = torch.cat([ids_BT, torch.multinomial(torch.softmax(logits_BV, -1), 1, generator=g)], 1)
    return ids_BT


def _reverse_kl(student, teacher, ids_BT, prompt_len):
    with torch.no_grad():
        s_BRV = torch.log_softmax(student(ids_BT, use_cache=False).logits[:, prompt_len - 1 : -1], -1)
        t_BRV = torch.log_softmax(teacher(ids_BT, use_cache=False).logits[:, prompt_len - 1 : -1], -1)
    return float((s_BRV.exp() * (s_BRV - t_BRV)).sum(-1).mean())


def _scored_rollouts(student, teacher, g, batch_size, prompt_len=4, new_tokens=12):
    """On-policy episodes of the student, scored by the teacher (logprobs, top-8, hidden states)."""
    ids_BT = _sample(student, torch.randint(0, VOCAB, (batch_size, prompt_len), generator=g), new_tokens, g)
    targets_BR = ids_BT[:, prompt_len:, None]
    with torch.no_grad():
        old_BR = torch.log_softmax(student(ids_BT, use_cache=False).logits[:, prompt_len - 1 : -1], -1)
        old_BR = old_BR.gather(-1, targets_BR)[..., 0]
        hidden_BRH = teacher.model(ids_BT, use_cache=False).last_hidden_state[:, prompt_len - 1 : -1]
        t_BRV = torch.log_softmax(teacher.lm_head(hidden_BRH), -1)
    top_lp, top_ids = t_BRV.topk(8, -1)
    return [
        TrainSample(ids_BT[b].tolist(), prompt_len, [1] * new_tokens, old_BR[b].tolist(),
                    teacher_logprobs=t_BRV[b].gather(-1, targets_BR[b])[:, 0].tolist(),
                    teacher_topk_ids=top_ids[b].tolist(), teacher_topk_logprobs=top_lp[b].tolist(),
                    teacher_hidden=hidden_BRH[b].clone(), group_id=b // 4)
        for b in range(batch_size)
    ]


@pytest.mark.parametrize(
    "kind, steps, batch_size, max_ratio",
    [
        ("sampled_k1", 25, 32, 0.9),  # REINFORCE on one sampled token: slow but steady
        pytest.param(
            "sampled_k3", 25, 32, 0.9,
            marks=pytest.mark.xfail(strict=True, reason=(
                "k3 as a per-token advantage is not a reverse-KL gradient: E_s[(r - 1) grad log p_s] = "
                "-grad KL(p_t||p_s), so the step descends KL_rev - KL_fwd (measured: KL 0.96 -> 1.23)")),
        ),
        ("forward_kl", 10, 8, 0.8),
        ("reverse_kl", 10, 8, 0.8),
        ("jsd", 10, 8, 0.8),
        ("topk_forward_kl", 10, 8, 0.9),
        ("sft", 10, 8, 0.95),  # on teacher samples
    ],
)
def test_each_loss_moves_the_student_toward_the_teacher(kind, steps, batch_size, max_ratio):
    if not _have_losses(*LOSS_NEEDS[LossKind(kind)]):
        pytest.skip(f"agentopd.losses lacks {LOSS_NEEDS[LossKind(kind)]}")
    teacher = _peaked_teacher()
    trainer = Trainer(tiny_model(), TrainerConfig(loss=kind, lr=1e-2, schedule="constant"))

    def on_policy_kl():  # reverse KL on fresh student samples (fixed seed)
        g = torch.Generator().manual_seed(123)
        ids_BT = _sample(trainer.hf, torch.randint(0, VOCAB, (64, 4), generator=g), 12, g)
        return _reverse_kl(trainer.hf, teacher, ids_BT, 4)

    before = on_policy_kl()
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        if kind == "sft":
            ids_BT = _sample(teacher, torch.randint(0, VOCAB, (batch_size, 4), generator=g), 12, g)
            samples = [TrainSample(ids_BT[b].tolist(), 4, [1] * 12, [0.0] * 12) for b in range(batch_size)]
        else:
            samples = _scored_rollouts(trainer.hf, teacher, g, batch_size)
        trainer.train_step(samples, teacher_head_VH=teacher.lm_head.weight.detach())
    after = on_policy_kl()
    assert after < max_ratio * before, (kind, before, after)


def test_selective_checkpointing_recomputes_every_kth_layer_and_changes_no_gradient():
    samples = make_samples(6, seed=4)
    deltas = []
    for opts in ({}, {"activation_checkpointing": True, "checkpoint_every": 2}):
        trainer = Trainer(tiny_model(), TrainerConfig(**CFG | opts, loss="sft"))
        if opts:
            assert [layer.gradient_checkpointing for layer in trainer.hf.model.layers] == [True, False]
        before = _params(trainer)
        metrics = trainer.train_step(samples)
        after = _params(trainer)
        deltas.append({k: after[k] - before[k] for k in before})
        assert "perf/mfu" not in metrics  # CPU: no known peak, so no MFU
    for k in deltas[0]:
        torch.testing.assert_close(deltas[1][k], deltas[0][k], atol=1e-7, rtol=0, msg=k)
    with pytest.raises(ValueError, match="checkpoint_every"):
        TrainerConfig(checkpoint_every=0)


def test_matmul_params_count_the_head_once_and_no_untied_embedding():
    from agentopd.trainer.core import matmul_params

    tied, untied = tiny_model(tie=True), tiny_model(tie=False)
    assert matmul_params(tied) == sum(p.numel() for p in tied.parameters())
    embed = untied.get_input_embeddings().weight.numel()
    assert matmul_params(untied) == sum(p.numel() for p in untied.parameters()) - embed
    assert matmul_params(untied) == matmul_params(tied)  # same shapes: the head counts once either way


def test_a_per_step_loss_trains_as_a_trainer_configured_with_it():
    """train_step(loss=, temperature=) (the SFT warm start of a sampled_k1 run at rollout T=0.5): the step equals
    one of a trainer built for that loss at that temperature, not at the configured loss's temperature."""
    samples = make_samples(6, seed=2)
    plain = Trainer(tiny_model(), TrainerConfig(**CFG | {"loss": LossKind.SFT, "temperature": 1.0}))
    switched = Trainer(tiny_model(), TrainerConfig(**CFG | {"loss": LossKind.SAMPLED_K1, "temperature": 0.5}))
    want = plain.train_step(samples)
    got = switched.train_step(samples, loss=LossKind.SFT, temperature=1.0)
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
    for k, v in _params(plain).items():
        torch.testing.assert_close(_params(switched)[k], v, atol=1e-6, rtol=0, msg=k)
    assert switched.cfg.loss == LossKind.SAMPLED_K1  # the next step trains with the configured loss again


@pytest.mark.parametrize("kind", ["forward_kl", "jsd"])
def test_each_sample_is_distilled_toward_its_own_teachers_head(kind):
    """A run routing episodes to two teachers (a mixed run) passes one lm_head per teacher; each sample's
    `teacher_index` picks its head. The step's loss is the token-weighted mean of each teacher's subset trained
    alone, swapping the heads changes it, and an index without a head is a clear error."""
    import dataclasses

    samples = make_samples(8, seed=4, teacher_hidden=16)
    samples = [dataclasses.replace(s, teacher_index=i % 2) for i, s in enumerate(samples)]
    g = torch.Generator().manual_seed(5)
    heads = [torch.randn(VOCAB, 16, generator=g), torch.randn(VOCAB, 16, generator=g) * 3]

    def loss_of(batch, head, budget=64):
        trainer = Trainer(tiny_model(), TrainerConfig(**CFG | {"loss": kind, "micro_batch_tokens": budget}))
        return trainer.train_step(batch, teacher_head_VH=head)["loss"]

    mixed = loss_of(samples, heads)
    parts = [[dataclasses.replace(s, teacher_index=0) for s in samples if s.teacher_index == t] for t in (0, 1)]
    counts = [sum(s.num_student_tokens for s in part) for part in parts]
    alone = [loss_of(part, heads[t]) for t, part in enumerate(parts)]
    assert mixed == pytest.approx((alone[0] * counts[0] + alone[1] * counts[1]) / sum(counts), rel=1e-5)
    assert loss_of(samples, heads, budget=10_000) == pytest.approx(mixed, rel=1e-5)  # never one micro-batch for two
    assert abs(loss_of(samples, heads[::-1]) - mixed) > 1e-3
    with pytest.raises(ValueError, match="teacher_index=1 but 1 teacher head"):
        loss_of(samples, heads[:1])

_COMPILE_SCRIPT = r"""
import json, os, sys, tempfile
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
from _tiny import make_samples, tiny_model
from agentopd.trainer import Trainer, TrainerConfig
losses = {}
for compiled in (False, True):
    cfg = TrainerConfig(loss="sft", lr=1e-3, compile=compiled)
    trainer = Trainer(tiny_model(), cfg, device="cpu")
    losses[compiled] = [trainer.train_step(make_samples(4, seed=s))["loss"] for s in (1, 2)]
cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
print(json.dumps({"losses": losses[False] + losses[True], "cache": cache,
                  "files": sum(len(f) for _, _, f in os.walk(cache)) if cache else 0}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("user_dir", [False, True])
def test_compiled_layers_train_like_eager_and_compile_into_a_fresh_cache(tmp_path, user_dir):
    """trainer.compile: the same losses as eager; the layers compile into an inductor cache directory of the
    process's own, removed at exit (cached layers trained ~20% slower on an H100), unless the user set
    TORCHINDUCTOR_CACHE_DIR, which is kept. In a subprocess: the choice is process-wide."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    if user_dir:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "mine")
    done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    eager, compiled = out["losses"][:2], out["losses"][2:]
    assert compiled == pytest.approx(eager, rel=1e-4, abs=1e-5)
    assert out["files"] > 0  # the compiled layers went through that directory
    if user_dir:
        assert out["cache"] == str(tmp_path / "mine") and (tmp_path / "mine").is_dir()
    else:
        assert Path(out["cache"]).name.startswith("agentopd-inductor-") and not Path(out["cache"]).exists()


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl"])
def test_teacher_temperature_divides_the_teachers_logits_alone(kind):
    """trainer.teacher_temperature=tau: the teacher's distribution is softmax(z_t / tau) while the student's stays at
    `temperature`. The step equals one with the teacher's head scaled by temperature / tau (its logits are linear in
    it); tau == temperature is the plain loss; a sharp teacher moves the student differently."""
    samples = make_samples(6, seed=2, teacher_hidden=16)
    head_VH = torch.randn(VOCAB, 16, generator=torch.Generator().manual_seed(3))

    def step(head, **extra):
        trainer = Trainer(tiny_model(), TrainerConfig(**CFG | {"loss": kind, "temperature": 0.8} | extra))
        return trainer.train_step(samples, teacher_head_VH=head)["loss"], _params(trainer)

    plain, plain_params = step(head_VH)
    assert step(head_VH, teacher_temperature=0.8)[0] == pytest.approx(plain, abs=1e-6)
    sharp, sharp_params = step(head_VH, teacher_temperature=0.2)
    scaled, scaled_params = step(head_VH * 4.0)
    assert sharp == pytest.approx(scaled, rel=1e-5)
    for k, v in scaled_params.items():
        torch.testing.assert_close(sharp_params[k], v, atol=1e-6, rtol=0, msg=k)
    assert abs(sharp - plain) > 1e-3


def test_teacher_temperature_needs_a_full_vocabulary_loss():
    with pytest.raises(ValueError, match="teacher_temperature must be > 0"):
        TrainerConfig(loss="forward_kl", teacher_temperature=0)
    with pytest.raises(ValueError, match="needs a full-vocabulary loss.*loss=sampled_k1"):
        TrainerConfig(loss="sampled_k1", teacher_temperature=0.5)
    TrainerConfig(loss="sft", teacher_temperature=0.5)  # an SFT warm start of a forward_kl run keeps the field


@pytest.mark.parametrize("kind", ["forward_kl", "sampled_k1", "sft"])
def test_a_shared_prefix_trains_like_full_rows(kind):
    """trainer.share_prefix: samples behind one system prompt train with the prefix run once per micro-batch (its
    K/V and their graph shared by the rows). The step's loss and the updated weights equal those of full rows;
    the decoder saw the prefix once per micro-batch."""
    from _tiny import with_shared_prefix

    samples = with_shared_prefix(make_samples(6, seed=2, teacher_hidden=16), length=24)
    head_VH = torch.randn(VOCAB, 16, generator=torch.Generator().manual_seed(3))

    def step(share: bool):
        trainer = Trainer(tiny_model(), TrainerConfig(**CFG | {"loss": kind, "micro_batch_tokens": 200, "share_prefix": share}))
        seen = []
        trainer.hf.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
        loss = trainer.train_step(samples, teacher_head_VH=head_VH)["loss"]
        return loss, _params(trainer), seen

    full, full_params, full_seen = step(False)
    shared, shared_params, shared_seen = step(True)
    assert shared == pytest.approx(full, abs=1e-6)
    for k, v in full_params.items():
        torch.testing.assert_close(shared_params[k], v, atol=1e-6, rtol=0, msg=k)
    prefixes = [shape for shape in shared_seen if shape == (1, 24)]
    assert len(prefixes) >= 2 and len(shared_seen) == 2 * len(prefixes)  # several micro-batches, a prefix pass each
    assert sum(b * t for b, t in shared_seen) < sum(b * t for b, t in full_seen)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_training_forward_builds_no_kv_cache(monkeypatch, request, packed):
    """A training forward must never build a transformers KV cache: under torch.compile the cache's guards recompile
    the layers and fall back to eager, and every layer's K/V stays alive (0.6B on an H200: 45k tok/s and 46.8 GiB
    with it, 77k and 36 GiB without). `packed` runs the varlen path (one packed row per micro-batch, what GPUs run)
    on CPU through a reference kernel."""
    from transformers.cache_utils import DynamicCache

    built = []
    init = DynamicCache.__init__
    monkeypatch.setattr(DynamicCache, "__init__", lambda self, *a, **k: (built.append(1), init(self, *a, **k))[1])
    extra = {}
    if packed:
        request.getfixturevalue("cpu_varlen")
        extra = {"mixed_precision": "bf16"}
    trainer = Trainer(tiny_model(), TrainerConfig(**CFG | {"loss": "forward_kl", "micro_batch_tokens": 200} | extra))
    assert trainer.varlen == packed
    head_VH = torch.randn(VOCAB, 16, generator=torch.Generator().manual_seed(3))
    metrics = trainer.train_step(make_samples(6, seed=2, teacher_hidden=16), teacher_head_VH=head_VH)
    assert math.isfinite(metrics["loss"])
    assert built == [], f"{len(built)} KV cache(s) built by a training step"


def test_compiled_layers_compile_once_across_uneven_steps(monkeypatch, cpu_varlen):
    """trainer.compile on the packed path GPUs run: steps of other token counts, sequence counts and longest
    sequences (varlen's cu_seq_lens and max_length) reuse the layers' first graphs. Compiled dynamic from the first
    call; torch's automatic dynamic shapes recompiled once per input that changed (0.6B on an H200: 18.5, 6.2 and
    5.4 s of compiling in the first three steps). Dynamo's graphs are counted under its eager backend (what
    recompiles is dynamo's choice, the same whatever backend then compiles the graph; inductor on 2 CPUs is minutes)."""
    import functools

    import torch._dynamo
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    try:
        cfg = TrainerConfig(**CFG | {"loss": "forward_kl", "micro_batch_tokens": 4096, "compile": True, "mixed_precision": "bf16"})
        trainer = Trainer(tiny_model(), cfg)
        assert trainer.varlen
        head_VH = torch.randn(VOCAB, 16, generator=torch.Generator().manual_seed(3))
        graphs = []
        for n, seed, longest in ((6, 2, 40), (9, 3, 24), (4, 4, 60)):  # other T, sequence counts and max_length each step
            samples = make_samples(n, seed=seed, max_len=longest, teacher_hidden=16)
            assert math.isfinite(trainer.train_step(samples, teacher_head_VH=head_VH)["loss"])
            graphs.append(counters["stats"]["unique_graphs"])
    finally:
        torch._dynamo.reset()
    assert graphs[0] > 0 and graphs == [graphs[0]] * 3, f"graphs compiled after each step: {graphs}"
