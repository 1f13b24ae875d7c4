"""The Trainer: an FSDP2 (or plain single-process) student, one optimizer step per batch.

    trainer = Trainer(model_or_path, TrainerConfig(lr=1e-5, loss="reverse_kl"))
    metrics = trainer.train_step(samples, teacher_head_VH=teacher.head_weight())
    engine_sd = trainer.state_dict_for_engine()           # full HF-named weights, CPU, rank 0
    trainer.save_checkpoint("runs/x/checkpoints/step_10", extra={"data_pos": 10})
    extra = trainer.load_checkpoint("runs/x/checkpoints/step_10")
    trainer.export("runs/x/final", tokenizer)

Distributed: when torch.distributed is initialised (torchrun; gloo on CPU, NCCL on GPU) each
decoder layer is its own `fully_shard` unit and the root unit holds the embeddings, final norm
and lm_head (tied embeddings stay in one unit); every rank passes its own share of the batch to
`train_step`. Otherwise the model trains as a plain module in this process.

The root module is `StudentLoss`: its forward runs the decoder to FINAL HIDDEN STATES, gathers the
rows at the loss positions and applies the chunked loss with the lm_head weight — inside the
root forward, so FSDP has the root parameters gathered and never a (T, V) logits tensor exists.
`vocab_size` (the tokenizer's size; a run passes it): the loss uses the lm_head's first `vocab_size` rows,
so the student's log-probs are normalised over the ids the engines sample from (engines/base.py) and the
embedding's padding rows past them take no part.

Normalisation: every loss is a sum over student tokens divided by the student-token count of
the GLOBAL batch (all micro-batches, all ranks: an all_reduce before the step), so gradients do
not depend on micro-batching or world size. Ranks with fewer micro-batches run empty ones so
FSDP collectives line up.

Speed: under FSDP2 the micro-batches before the last accumulate unsharded gradients (in the fp32
reduce dtype) with parameters kept gathered (`set_requires_gradient_sync(False)`,
`set_reshard_after_backward(False)`), so a step reduce-scatters once, not once per micro-batch.
With `cfg.share_prefix` on the packed (varlen) path, a step whose samples of one task share their prompt takes a
layout that computes it once per micro-batch (`agentopd.prefix.pack_row`) where that needs fewer micro-batches than
whole streams: the README's GPU example 20.7 -> 17.9 s a train phase, but at a 0.6B student's 2 micro-batches a
step the same count of micro-batches ran ~10% slower shared (benchmarks/results/prefix_share_gpu.md).
`cfg.compile` compiles each decoder layer's forward (afresh in each process: `_fresh_inductor_cache`);
`cfg.checkpoint_every` = k recomputes only
every k-th layer under activation checkpointing; AdamW is fused on CUDA. The full-vocabulary
losses take the fused Triton path on CUDA (agentopd/losses/fused.py).

`perf/mfu` = 6 * N * tokens/s / (world size * the GPU's dense bf16 peak), N = parameters that do
matmul work per token (decoder + lm_head; an untied input embedding is a lookup and not counted),
tokens = real (unpadded) tokens; attention and the teacher's head are not counted. It is reported
on GPUs whose peak is known (`_BF16_PEAK`) and omitted on CPU.

Legend: T = packed tokens, N = loss tokens, H = hidden, V = vocab, E = episodes.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from agentopd.batch import MicroBatch, TrainSample, collate, dummy_micro_batch, micro_batch_rows, micro_batch_slots
from agentopd.prefix import MIN_SHARED_PREFIX, run_prefix, shared_prefix_len
from agentopd import attention
from agentopd.heap import release_freed_memory
from agentopd.losses.head_matmul import padded_cols, upload_widened
from agentopd.trainer import checkpoint as ckpt
from agentopd.trainer.config import LossKind, Precision, TrainerConfig, lr_factor
from agentopd.trainer.loss import MAXIMA, WEIGHTED_BY_PG, micro_batch_loss


class StudentLoss(nn.Module):
    """Root module: decoder -> final hidden states at the loss positions -> chunked loss."""

    def __init__(self, hf: PreTrainedModel, vocab_size: int) -> None:
        super().__init__()
        self.hf = hf
        self.vocab_size = vocab_size  # the lm_head rows the losses use: the tokenizer's ids (engines/base.py)

    def forward(self, mb: MicroBatch, cfg: TrainerConfig, teacher_head_VH: torch.Tensor | None, autocast_dtype=None,
                varlen: bool = False):
        # autocast (plain bf16 mode) covers the decoder only: the losses pick their own fp32 accumulation
        device_type = mb.input_ids_BT.device.type
        # use_cache=False on every path: a training forward that builds a KV cache recompiles on the cache's guards
        # under torch.compile and keeps every layer's K/V (0.6B on an H200: 45k tok/s and 46.8 GiB, not 77k and 36)
        extra = {"use_cache": False}
        if varlen:
            extra |= attention.varlen_kwargs(mb.seq_lens[0], mb.input_ids_BT.device, mb.seq_continues)
        with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            if mb.prefix_ids_1P is not None:  # the rows' shared prefix once; its K/V (with their graph) serve every row
                extra = run_prefix(self.hf.model, mb.prefix_ids_1P, mb.input_ids_BT.shape[0])
            hidden_BTH = self.hf.model(input_ids=mb.input_ids_BT, position_ids=mb.position_ids_BT, **extra).last_hidden_state
        weight = self.hf.lm_head.weight
        # the embedding's padding rows are never sampled: the losses use the first vocab_size rows, as a view of
        # the rows up to an aligned count (where the head has them), which the loss GEMMs run on (head_matmul)
        head_PH = weight[: min(padded_cols(self.vocab_size), weight.shape[0])]
        if autocast_dtype is not None:  # the loss matmuls in bf16 too (fp32 accumulation inside the losses)
            head_PH = head_PH.to(autocast_dtype)
        head_VH = head_PH[: self.vocab_size]
        if teacher_head_VH is not None and teacher_head_VH.shape[0] != head_VH.shape[0]:
            # a pair whose vocabularies differ by padding rows only (teacher.check_compatible, e.g. 151,936
            # vs 152,064): both distributions over the shared rows
            rows = min(head_VH.shape[0], teacher_head_VH.shape[0])
            head_VH, teacher_head_VH = head_VH[:rows], teacher_head_VH[:rows]
        # the loss rows by index (from the host), not by mask: a mask would make the host wait for the forward
        hidden_NH = hidden_BTH.flatten(0, 1).index_select(0, mb.loss_index_N)
        if autocast_dtype is not None:
            hidden_NH = hidden_NH.to(autocast_dtype)
        if mb.num_loss_tokens == 0:  # still touch every parameter so every rank reduces the same grads
            return (hidden_BTH.sum() + head_VH.sum()) * 0.0, {}
        return micro_batch_loss(hidden_NH, head_VH, mb, cfg, teacher_head_VH=teacher_head_VH)


log = logging.getLogger(__name__)
_USER_INDUCTOR_DIR = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # read before anything compiles


def _fresh_inductor_cache() -> None:
    """Point torch.compile at an empty cache directory of this process's own (removed at exit), unless the user
    set TORCHINDUCTOR_CACHE_DIR (to anything but torch's default).

    On an H100 the 0.6B student's layers loaded from a cache that an earlier process wrote trained ~20% slower
    than freshly compiled ones: 43-58k tokens/s in eleven runs against 61-73k in six (32k tokens a step).
    Turning off only the FX-graph and autograd caches did not help; a fresh directory did
    (benchmarks/results/trainer_gpu.md). The price is compiling every run: ~10 s on that card instead of ~3 s."""
    try:  # torch sets the variable itself, to this default, the first time anything asks for the directory
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        default = os.path.abspath(default_cache_dir())
    except ImportError:
        default = None
    if _USER_INDUCTOR_DIR is not None and os.path.abspath(_USER_INDUCTOR_DIR) != default:
        return
    path = tempfile.mkdtemp(prefix="agentopd-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    log.info("trainer.compile: compiling into a fresh inductor cache %s (set TORCHINDUCTOR_CACHE_DIR to reuse one)", path)


# dense bf16 tensor-core peak FLOP/s by device-name substring (vendor datasheets, no sparsity)
_BF16_PEAK = (("H200", 989.4e12), ("H100 PCIe", 756.5e12), ("H100", 989.4e12), ("H800", 989.4e12),
              ("A100", 312e12), ("L40S", 362e12))


def _bf16_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in _BF16_PEAK if key in name), None)


def matmul_params(hf: PreTrainedModel) -> int:
    """Parameters doing matmul work per token: all, less an untied input embedding (a lookup)."""
    total = sum(p.numel() for p in hf.parameters())
    embed, head = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
    return total if embed is head else total - embed.numel()


def _load(model: PreTrainedModel | str | Path) -> PreTrainedModel:
    if isinstance(model, (str, Path)):
        return AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    return model


class Trainer:
    def __init__(
        self, model: PreTrainedModel | str | Path, cfg: TrainerConfig, *, device: torch.device | str | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        if device is None:
            local = torch.cuda.current_device() if torch.cuda.is_available() else None
            device = torch.device("cuda", local) if local is not None else torch.device("cpu")
        self.device = torch.device(device)
        if cfg.mixed_precision == Precision.AUTO:
            self.precision = Precision.BF16 if self.device.type == "cuda" else Precision.FP32
        else:
            self.precision = cfg.mixed_precision
        if cfg.cpu_offload and (not self.distributed or self.device.type != "cuda"):
            raise ValueError(
                "trainer.cpu_offload=True needs FSDP2 on a CUDA device (torchrun; it pins host memory), "
                f"got distributed={self.distributed}, device={self.device}"
            )
        torch.manual_seed(cfg.seed + self.rank)

        hf = _load(model).float()  # fp32 master weights; bf16 is a compute policy
        self.matmul_params = matmul_params(hf)
        self._peak_flops = _bf16_peak(self.device)
        if cfg.activation_checkpointing:
            if hasattr(hf, "activation_checkpointing_enable"):  # transformers >= 5.2x
                hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            for i, layer in enumerate(hf.model.layers):  # selective: keep every k-th layer's recompute
                if i % cfg.checkpoint_every:
                    layer.gradient_checkpointing = False
        # flash varlen computes in bf16: only where the step computes in bf16 anyway
        self.varlen = cfg.varlen_attention and attention.available(self.device) and self.precision == Precision.BF16
        self._attn_implementation = hf.config._attn_implementation  # what checkpoints and exports carry
        if self.varlen:  # one packed row per micro-batch, no padding, no dense mask
            attention.set_varlen(hf)
        if cfg.compile:  # the bound forward, not the module: FSDP2's hooks stay eager, names stay the same
            _fresh_inductor_cache()
            # dynamic from the first call: a step's token count, its sequences and their longest (varlen's
            # cu_seq_lens and max_length) differ every micro-batch, and torch's automatic dynamic shapes recompiled
            # the layers once for each of them that changed (~6 s each; 0.6B on an H200: 18.5, 6.2, 5.4 s of
            # compiling in the first three steps, benchmarks/results/small_batch.md)
            for layer in hf.model.layers:
                layer.forward = torch.compile(layer.forward, dynamic=True)
        hf.train()
        self.hf = hf
        from agentopd.kinds import sampled_vocab

        self.student = StudentLoss(hf, sampled_vocab(vocab_size, hf.get_output_embeddings().weight.shape[0]))
        if self.distributed:
            self._shard()
        else:
            self.student.to(self.device)

        params = [p for p in self.student.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        fused = self.device.type == "cuda" and not cfg.cpu_offload
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused or None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, cfg))
        self.step = 0

    def _shard(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.precision == Precision.BF16
            else MixedPrecisionPolicy()
        )
        offload = CPUOffloadPolicy() if self.cfg.cpu_offload else OffloadPolicy()
        if not self.cfg.cpu_offload:
            self.student.to(self.device)
        for layer in self.hf.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
        # the root unit: embeddings, final norm and (tied or not) lm_head
        fully_shard(self.student, mesh=mesh, mp_policy=mp, offload_policy=offload)

    # ---- one step -------------------------------------------------------------------------
    def _all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
        return t

    def _episode_terms(self, samples: list[TrainSample], cfg: TrainerConfig) -> list[TrainSample]:
        """Episode weights (reward_beta, TCAD teacher confidence) and GRPO advantages, computed over
        the GLOBAL batch (all ranks' episodes: groups may span ranks), then this rank's share."""
        need_adv = cfg.loss == LossKind.GRPO or cfg.task_reward_coef > 0
        if cfg.reward_beta is None and cfg.tcad_power is None and not need_adv:
            return samples
        from agentopd import losses

        def teacher_lp(s: TrainSample) -> list[float]:
            if cfg.tcad_power is None:
                return []
            if s.teacher_logprobs is None:
                raise ValueError("trainer.tcad_power needs teacher_logprobs on every TrainSample")
            return [lp for lp, m in zip(s.teacher_logprobs, s.response_mask) if m]

        local = [(s.reward, s.group_id, teacher_lp(s)) for s in samples]
        offset, everything = 0, local
        if self.distributed:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, local)
            offset = sum(len(g) for g in gathered[: self.rank])
            everything = [x for g in gathered for x in g]
        rewards_E = torch.tensor([e[0] for e in everything], dtype=torch.float32)
        groups_E = torch.tensor([e[1] for e in everything], dtype=torch.long)
        weights_E = torch.ones(len(everything))
        advantages_E = torch.zeros(len(everything))
        if cfg.reward_beta is not None:
            per_group = groups_E if cfg.reward_per_group else None
            weights_E = weights_E * losses.reward_weights(rewards_E, per_group, beta=cfg.reward_beta)
        if cfg.tcad_power is not None:
            teacher = [torch.tensor(e[2], dtype=torch.float64) for e in everything]
            weights_E = weights_E * losses.teacher_confidence_weights(teacher, groups_E, power=cfg.tcad_power).float()
        if need_adv:
            advantages_E = losses.grpo_advantages(rewards_E, groups_E)
        mine = slice(offset, offset + len(samples))
        return [
            dataclasses.replace(s, weight=s.weight * float(w), advantage=float(a))
            for s, w, a in zip(samples, weights_E[mine], advantages_E[mine])
        ]

    def train_step(
        self,
        samples: list[TrainSample],
        *,
        teacher_head_VH: torch.Tensor | list[torch.Tensor] | None = None,
        loss: LossKind | None = None,
        temperature: float | None = None,
    ) -> dict[str, float]:
        """One optimizer step on this rank's `samples` (with `loss` at `temperature` instead of the configured
        ones for this step, e.g. an SFT warm start); returns global metrics (same on every rank).

        `teacher_head_VH`: the teacher's lm_head for the full-vocabulary losses, or one per teacher of a run that
        routes episodes to several, indexed by each sample's `teacher_index` (a micro-batch holds one teacher's)."""
        t0 = time.perf_counter()
        heads = [teacher_head_VH] if isinstance(teacher_head_VH, torch.Tensor) else teacher_head_VH
        if heads is not None:
            if not heads:
                raise ValueError("teacher_head_VH: an empty list (give None, one head, or one per teacher)")
            if (top := max((s.teacher_index for s in samples), default=0)) >= len(heads):
                raise ValueError(f"a sample has teacher_index={top} but {len(heads)} teacher head(s) were given")
            heads = [upload_widened(h, self.device) for h in heads]  # padding rows kept: aligned loss GEMMs
        cfg = self.cfg
        if loss is not None:
            cfg = dataclasses.replace(cfg, loss=LossKind(loss), temperature=cfg.temperature if temperature is None else temperature)
        samples = self._episode_terms(samples, cfg)
        share = self._shares_prefix(samples)
        groups = micro_batch_rows(samples, cfg.micro_batch_tokens, row_tokens=1 if share else self._row_tokens(samples))
        varlen_prefix = False
        if cfg.share_prefix and self.varlen:  # one packed row per micro-batch: each task's prompt once in it, where
            shared = micro_batch_rows(samples, cfg.micro_batch_tokens, varlen_prefix=True)  # that saves micro-batches
            varlen_prefix = len(shared) < len(groups)
            groups = shared if varlen_prefix else groups
        counts = torch.tensor(
            [
                sum(s.num_student_tokens for s in samples),
                sum(s.num_tokens for s in samples),
                sum(micro_batch_slots(samples, g, varlen_prefix=varlen_prefix) for g in groups),
            ],
            dtype=torch.float64,
        )
        n_student, n_tokens, n_slots = self._all_reduce(counts.to(self._comm_device)).tolist()
        n_micro = torch.tensor([len(groups)], device=self._comm_device)
        n_micro = int(self._all_reduce(n_micro, dist.ReduceOp.MAX if self.distributed else None).item())
        lr = self.optimizer.param_groups[0]["lr"]
        if n_student == 0:
            return {"loss": 0.0, "grad_norm": 0.0, "lr": lr, "train/skipped": 1.0}

        # FSDP averages gradients over ranks; scale so the result is sum / global count
        scale = self.world_size / n_student
        sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64, device=self.device))
        pin = self.device.type == "cuda"

        def micro_batch(i: int) -> MicroBatch:
            if i >= len(groups):
                return dummy_micro_batch().to(self.device)
            mb = collate(samples, groups[i], pin_memory=pin, share_prefix=share, varlen_prefix=varlen_prefix)
            return mb.to(self.device)

        following = micro_batch(0)
        for i in range(n_micro):
            mb = following
            if self.distributed:  # reduce-scatter (and reshard) after the last micro-batch only
                last = i == n_micro - 1
                self.student.set_requires_gradient_sync(last)
                self.student.set_reshard_after_backward(last)
            head = None if heads is None else heads[samples[groups[i][0][0]].teacher_index if i < len(groups) else 0]
            loss_sum, stats = self.student(mb, cfg, head, self._autocast_dtype, self.varlen)
            (loss_sum * scale).backward()
            if self.device.type == "cpu":  # the micro-batch's activations, back to the kernel (agentopd.memory_host)
                release_freed_memory()
            if i + 1 < n_micro:  # built while the GPU still runs this backward
                following = micro_batch(i + 1)
            sums["loss"] += loss_sum.detach().double()
            for k, v in stats.items():
                v = v.detach().double().to(self.device)
                sums[k] = torch.maximum(sums[k], v) if k in MAXIMA and k in sums else sums[k] + v

        grad_norm = self._clip_grad_norm(cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1

        metrics = self._reduce_stats(sums, n_student)
        elapsed = time.perf_counter() - t0
        metrics |= {
            "grad_norm": float(grad_norm),
            "lr": lr,
            "train/student_tokens": n_student,
            "train/tokens": n_tokens,
            "train/micro_batches": float(n_micro),
            # a packed row has no padding (with varlen_prefix it computes fewer slots than the samples have tokens)
            "train/padding_ratio": 0.0 if varlen_prefix else 1.0 - n_tokens / max(n_slots, 1.0),
            "perf/train_step_s": elapsed,
            "perf/train_tokens_per_s": n_tokens / elapsed,
        }
        if self._peak_flops is not None:
            metrics["perf/mfu"] = 6 * self.matmul_params * n_tokens / elapsed / (self._peak_flops * self.world_size)
        return metrics

    def _clip_grad_norm(self, max_norm: float) -> float:
        """Global grad norm (pre-clip), and grads scaled to at most max_norm. Under FSDP2 every parameter
        is a Shard(0) DTensor: the squared norms of the local shards sum (all_reduce) to the global one —
        done by hand because the shards may live on CPU (cpu_offload) while the collective is NCCL."""
        params = [p for p in self.student.parameters() if p.grad is not None]
        if not self.distributed:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        grads = [p.grad.to_local() for p in params]
        sq = torch.zeros((), device=self._comm_device)
        for g in grads:
            sq += g.detach().float().pow(2).sum().to(self._comm_device)
        total = self._all_reduce(sq).sqrt()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef.to(g.device, g.dtype))
        return float(total)

    def _shares_prefix(self, samples: list[TrainSample]) -> bool:
        """trainer.share_prefix: where the decoder runs padded rows (sdpa/eager) in one process, without
        recomputation or compilation, and the step's samples start alike, each sample gets a row of its own and
        every micro-batch runs their common prefix once (collate's share_prefix)."""
        cfg = self.cfg
        if not cfg.share_prefix or self.distributed or cfg.activation_checkpointing or cfg.compile:
            return False
        return self._row_tokens(samples) is not None and shared_prefix_len(samples) >= MIN_SHARED_PREFIX

    def _row_tokens(self, samples: list[TrainSample]) -> int | None:
        """Flash-attention kernels take one packed row (varlen); dense-mask kernels (sdpa, eager)
        get rows about as long as the longest sample (batch.py: their cost is B x T^2)."""
        if self.varlen or "flash" in str(self.hf.config._attn_implementation):
            return None
        return max((s.num_tokens for s in samples), default=1)

    def _reduce_stats(self, sums: dict[str, torch.Tensor], n_student: float) -> dict[str, float]:
        """Global statistics: sums / global student tokens, pg means / pg weight, maxima (trainer/loss.py)."""
        names = sorted(sums)
        if self.distributed:  # a rank that ran only empty micro-batches lacks the loss-specific keys
            all_names: list[Any] = [None] * self.world_size
            dist.all_gather_object(all_names, names)
            names = sorted(set().union(*all_names))
        summed = [k for k in names if k not in MAXIMA]
        maxed = [k for k in names if k in MAXIMA]
        totals = self._all_reduce(torch.stack([sums[k] for k in summed]).to(self._comm_device)).cpu().tolist()
        totals = dict(zip(summed, totals))
        metrics = {k: v / n_student for k, v in totals.items() if k not in WEIGHTED_BY_PG and k != "pg/weight"}
        metrics |= {k: totals[k] / max(totals["pg/weight"], 1e-12) for k in summed if k in WEIGHTED_BY_PG}
        if maxed:
            # stats >= 0 here (ratios), so 0 is the identity of the max for a rank without them
            op = dist.ReduceOp.MAX if self.distributed else None
            maxima = self._all_reduce(torch.stack([sums[k] for k in maxed]).to(self._comm_device), op).cpu()
            metrics |= dict(zip(maxed, maxima.tolist()))
        return metrics

    @property
    def _comm_device(self) -> torch.device:
        """Where small collective tensors live: the GPU under NCCL, CPU under gloo / no process group."""
        return self.device if self.distributed and self.device.type == "cuda" else torch.device("cpu")

    @property
    def _autocast_dtype(self) -> torch.dtype | None:
        """bf16 without FSDP is autocast over fp32 weights; under FSDP the MixedPrecisionPolicy does it."""
        return torch.bfloat16 if not self.distributed and self.precision == Precision.BF16 else None

    def model_config(self):
        """A copy of the student's config as loaded (the attention implementation it came with)."""
        import copy

        config = copy.deepcopy(self.hf.config)
        config._attn_implementation = self._attn_implementation
        return config

    # ---- weights out and back in ---------------------------------------------------------------
    def state_dict_for_engine(self) -> dict[str, torch.Tensor]:
        """Full, unsharded HF-named state dict on CPU (rank 0; other ranks get {}); every rank must call it."""
        return ckpt.full_state_dict(self)

    def full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights unsharded on this trainer's device, one tensor at a time (tied names once); every rank
        must iterate it to the end (a collective under FSDP); rank 0 sends them (weight sync)."""
        return ckpt.full_tensors(self)

    def save_checkpoint(self, directory: str | Path, extra: dict[str, Any] | None = None) -> None:
        """Resumable checkpoint (model, optimizer, scheduler, RNG, step, `extra`); every rank must call it."""
        ckpt.save(self, Path(directory), extra or {})

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Restore a checkpoint written by save_checkpoint; returns its `extra`."""
        return ckpt.load(self, Path(directory))

    def export(self, out_dir: str | Path, tokenizer=None) -> None:
        """The student as a Hugging Face folder (+ tokenizer and chat template); every rank must call it."""
        ckpt.export(self, Path(out_dir), tokenizer)
