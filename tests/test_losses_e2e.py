"""End to end: a tiny random-init Qwen3 student trained with each loss moves toward a fixed tiny
teacher (its full-vocabulary KL to the teacher on fixed token sequences falls).

A plain AdamW loop over hidden states + lm_head (what the trainer feeds the chunked losses).
The sampled-k1 policy gradient trains on the student's own samples from the fixed prompts
(on-policy), so its KL is measured where it samples every step: the first response position
of each fixed prompt. Its one-sample gradient is far noisier than the full-vocabulary ones,
hence more samples per step, a higher learning rate and a looser margin.
Legend: B sequences, T positions, N selected tokens, V vocab, K top-k.
"""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from agentopd import losses as L

V, B, T, PROMPT = 96, 8, 16, 4


def _model(seed: int, hidden: int, init: float) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                      max_position_embeddings=64, initializer_range=init, tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).float()


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    teacher = _model(1, 48, 0.3).eval()  # a peaky teacher: large init
    g = torch.Generator().manual_seed(0)
    ids_BT = torch.randint(0, V, (B, T), generator=g)
    mask_BT = torch.zeros(B, T, dtype=torch.bool)
    mask_BT[:, PROMPT - 1 : T - 1] = True  # positions whose next token is a "response" token
    with torch.no_grad():
        t_hidden_BTH = teacher.model(input_ids=ids_BT).last_hidden_state
    return teacher, ids_BT, mask_BT, t_hidden_BTH


def _kl_to_teacher(student, teacher, ids_BT, mask_BT):
    with torch.no_grad():
        s = student(input_ids=ids_BT).logits[mask_BT]
        t = teacher(input_ids=ids_BT).logits[mask_BT]
    return L.divergence(s, t, "forward_kl").mean().item(), L.divergence(s, t, "reverse_kl").mean().item()


def _sample(student, prompts_BP, new_tokens, generator):
    ids = prompts_BP
    with torch.no_grad():
        for _ in range(new_tokens):
            probs = torch.softmax(student(input_ids=ids).logits[:, -1].float(), -1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], 1)
    return ids


def _step_loss(loss_name, student, teacher, ids_BT, mask_BT, t_hidden_BTH, generator):
    if loss_name == "sampled_k1":
        prompts = ids_BT[:, :PROMPT].repeat(16, 1)
        seq = _sample(student, prompts, T - PROMPT, generator)
        targets = seq[:, PROMPT:]
        logits = student(input_ids=seq).logits[:, PROMPT - 1 : -1].float()
        lp_N = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1).reshape(-1)
        with torch.no_grad():
            t_logits = teacher(input_ids=seq).logits[:, PROMPT - 1 : -1].float()
            t_lp_N = torch.log_softmax(t_logits, -1).gather(-1, targets[..., None]).squeeze(-1).reshape(-1)
        adv_N = L.opd_advantages(t_lp_N, lp_N.detach(), "k1")
        loss, _ = L.policy_gradient_loss(lp_N, lp_N.detach(), adv_N, mode="is")
        return L.normalize_by_tokens(loss, lp_N.numel())
    h_NH = student.model(input_ids=ids_BT).last_hidden_state[mask_BT]
    th_NH = t_hidden_BTH[mask_BT]
    n = int(mask_BT.sum())
    head = student.lm_head.weight
    if loss_name == "topk_forward_kl":
        t_lp = torch.log_softmax(teacher.lm_head(th_NH).float(), -1)
        vals, ids = t_lp.topk(8, -1)
        loss = L.topk_forward_kl_hidden(h_NH, head, ids, vals, chunk_size=32)
    else:
        loss = L.chunked_divergence(h_NH, head, teacher_hidden_NH=th_NH, teacher_head_VH=teacher.lm_head.weight,
                                    kind=loss_name, beta=0.5, chunk_size=32)
    return L.normalize_by_tokens(loss, n)


@pytest.mark.parametrize("loss_name", ["forward_kl", "reverse_kl", "jsd", "topk_forward_kl", "sampled_k1"])
def test_student_moves_toward_teacher(setup, loss_name):
    teacher, ids_BT, mask_BT, t_hidden_BTH = setup
    sampled = loss_name == "sampled_k1"
    eval_mask_BT = mask_BT
    if sampled:
        eval_mask_BT = torch.zeros_like(mask_BT)
        eval_mask_BT[:, PROMPT - 1] = True
    student = _model(2, 32, 0.02)
    opt = torch.optim.AdamW(student.parameters(), lr=3e-2 if sampled else 1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(3)
    fkl0, rkl0 = _kl_to_teacher(student, teacher, ids_BT, eval_mask_BT)
    for _ in range(30):
        opt.zero_grad()
        _step_loss(loss_name, student, teacher, ids_BT, mask_BT, t_hidden_BTH, gen).backward()
        opt.step()
    fkl1, rkl1 = _kl_to_teacher(student, teacher, ids_BT, eval_mask_BT)
    print(f"{loss_name}: forward KL {fkl0:.3f} -> {fkl1:.3f}, reverse KL {rkl0:.3f} -> {rkl1:.3f}")
    margin = 0.8 if sampled else 0.5
    assert fkl1 < margin * fkl0 and rkl1 < margin * rkl0
