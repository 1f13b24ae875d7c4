"""Trainer (plain and FSDP2 world size 1): chunked logprobs, schedule, micro-batch independence,
resume in a new process, engine state dict, export. The 2-process test is test_trainer_dist.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist_worker import STEPS, batch, scenario
from _tiny import VOCAB, make_samples, one_thread, tiny_model  # noqa: F401  (one_thread: autouse fixture)

from agentopd.trainer import LossKind, Trainer, TrainerConfig, chunked_token_logprobs, lr_factor

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
        Trainer(tiny_model(), TrainerConfig(cpu_offload=True))


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
    finally:
        dist.destroy_process_group()
    assert sharded["losses"] == pytest.approx(plain["losses"], abs=1e-6)
    init = tiny_model().state_dict()
    for k in init:
        torch.testing.assert_close(sharded["params_1"][k] - init[k], plain["params_1"][k] - init[k], atol=1e-8, rtol=0)
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
