"""HFTeacher: a local Hugging Face causal LM that scores token streams, two-phase.

    teacher = HFTeacher("/models/Qwen3-8B", device="cuda", dtype=torch.bfloat16)
    scores = teacher.score(streams, mode="logprobs")   # loads to the device, scores, offloads
    # ... the student step runs with the GPU to itself ...

`score` moves the teacher to its device, runs it over the whole batch in micro-batches of at
most `max_tokens_per_batch` (padded) tokens, keeps on CPU only what the loss needs and, with
`offload_after_score` (the default), moves the teacher back to CPU and empties the CUDA cache,
so teacher and student never occupy the GPU at once. The teacher's weights are constant: on
CUDA they live in pinned host memory, `load` copies them in at PCIe speed and `offload` just
drops the device copy.

On CUDA with a bf16/fp16 teacher (torch's flash varlen kernel, `agentopd.attention`) streams are PACKED:
back to back in one row of at most `max_tokens_per_batch` tokens, positions restarting per
stream, each attending to itself only (cu_seqlens) — no padding computed at all. With `share_prefix`
the samples of one task share a row and their prompt is in it once, each sample's tokens attending to
it (`agentopd.prefix.pack_row`): in the README's GPU example ~26% of the tokens scored were those prompts. Elsewhere
(`pack=False`, CPU) micro-batches are right-padded: a padded position comes after every real
one, is masked out of attention and is never read, so padding counts as nothing; streams are
sorted by length so little padding is formed. There, the tokens every stream of a micro-batch
starts with (the shared system prompt and tool schemas) are run once, and their K/V serve every
stream (`share_prefix`, `agentopd.prefix`).

Logits are never built for the batch: the decoder's final hidden states are gathered at the
positions that predict response tokens (position p predicts token p+1, so response token i is
predicted by position prompt_len + i - 1) and the lm_head is applied `head_chunk` rows at a
time, in fp32 (`head_fp32`), as `log_softmax(logits / temperature)`. A bf16/fp16 head is never copied
to fp32 whole (for a Qwen3-8B head that copy was 2.3 GiB, what tipped a one-GPU run out of memory,
issue 30): its logits come from a half GEMM with fp32 output on CUDA where torch has one
(`torch.mm(..., out_dtype=float32)`), else from fp32 casts of `HEAD_BLOCK` rows of the head at a time;
either way exact products of the half inputs summed in fp32, as the TF32 matmul of an fp32 copy was.
In HIDDEN mode those
hidden rows themselves are kept (R x H per stream, about H/V of the memory of logits: 4096 /
151,936 = 2.7% for a Qwen3-8B teacher) and the loss recomputes teacher logits chunk by chunk
with `head_weight()`.
With `vocab_size` (the tokenizer's size; a run passes it) only the lm_head's first `vocab_size` rows are
used, there and in `head_weight()`: the embedding's padding rows past the tokenizer are left out of the
normalisation, as the engines leave them out of sampling (engines/base.py).

Legend: B = streams in a micro-batch, T = padded length, H = hidden size, V = vocab rows of
the lm_head, N = response positions gathered, K = top-k.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PreTrainedModel

from agentopd.losses.head_matmul import gemm_rows, upload_widened
from agentopd.prefix import MIN_SHARED_PREFIX, pack_row, packed_items, run_prefix, shared_prefix_len
from agentopd.teacher.base import TeacherMode, TeacherScores, as_mode, check_scorable
from agentopd.types import TokenStream
from agentopd.weights_dtype import cast_weights

HEAD_BLOCK = 16384  # head rows cast to fp32 at a time (256 MiB for H = 4,096) where no half GEMM gives fp32 out

# Config fields that make logits differ from lm_head(hidden); HFTeacher refuses them.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@contextmanager
def _tf32_matmuls(enabled: bool):
    """TF32 for fp32 matmuls while scoring. Exact for bf16/fp16 weights and activations (TF32's
    10-bit mantissa holds them; products accumulate in fp32), at about bf16 speed (H200, 0.6B-shaped
    teacher: 132k tok/s vs 130k with bf16 logits, whose logprobs were up to 0.56 off)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled or old
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


_MM_OUT_DTYPE: dict[str, bool] = {}  # device type -> torch.mm(..., out_dtype=) works there


def head_logits(h_nH: torch.Tensor, weight_VH: torch.Tensor, *, fp32: bool = True, block: int = HEAD_BLOCK) -> torch.Tensor:
    """fp32 logits h @ W^T. With `fp32` and a half W: products of the half inputs summed in fp32, with no fp32
    copy of W (module docstring); else in W's dtype, returned as fp32."""
    half = weight_VH.dtype in (torch.bfloat16, torch.float16)
    if not (fp32 and half):
        return F.linear(h_nH.to(weight_VH.dtype), weight_VH).float()
    h_nH = h_nH.to(weight_VH.dtype)
    kind = h_nH.device.type
    if _MM_OUT_DTYPE.get(kind, kind == "cuda"):
        try:
            return torch.mm(h_nH, weight_VH.t(), out_dtype=torch.float32)
        except (RuntimeError, NotImplementedError, TypeError):
            _MM_OUT_DTYPE[kind] = False
    h32_nH = h_nH.float()
    out_nV = torch.empty(h_nH.shape[0], weight_VH.shape[0], dtype=torch.float32, device=h_nH.device)
    for start in range(0, weight_VH.shape[0], block):
        out_nV[:, start : start + block] = F.linear(h32_nH, weight_VH[start : start + block].float())
    return out_nV


def plan_packed_rows(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group stream indices into packed rows of at most max_tokens tokens (first-fit decreasing;
    a stream longer than the budget gets a row of its own)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_batch must be >= 1, got {max_tokens}")
    rows: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((r for r, u in enumerate(used) if u + lengths[i] <= max_tokens), None)
        if slot is None:
            rows.append([i])
            used.append(lengths[i])
        else:
            rows[slot].append(i)
            used[slot] += lengths[i]
    return rows


def plan_shared_rows(streams: list[TokenStream], max_tokens: int, *, share: bool = True) -> list[list[int]]:
    """`plan_packed_rows` counting what a row computes: with `share`, the samples of one task go in one row together
    where they fit (`agentopd.prefix.packed_items`), their shared prompt computed once, next to one another."""
    if share:
        items = packed_items(streams, max_tokens)
    else:
        items = [(len(s.token_ids), [i]) for i, s in enumerate(streams)]
    return [[i for item in row for i in items[item][1]] for row in plan_packed_rows([n for n, _ in items], max_tokens)]


def plan_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group stream indices so that each group's padded size (count x longest) <= max_tokens.

    Longest first; a stream longer than the budget gets a micro-batch of its own.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_batch must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class HFTeacher:
    """A local transformers causal LM as the teacher (see the module docstring)."""

    def __init__(
        self,
        model: PreTrainedModel | str | Path,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        max_tokens_per_batch: int = 16384,
        temperature: float = 1.0,
        top_k: int = 20,
        head_chunk: int = 1024,
        head_fp32: bool = True,
        offload_after_score: bool = True,
        pack: bool | None = None,
        share_prefix: bool = True,
        vocab_size: int | None = None,
        compile: bool = False,
        linear_dtype: str = "auto",
    ):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        if head_chunk < 1:
            raise ValueError(f"head_chunk must be >= 1, got {head_chunk}")
        if linear_dtype not in ("auto", "fp8"):
            raise ValueError(f"linear_dtype must be auto or fp8, got {linear_dtype!r}")
        if isinstance(model, (str, Path)):
            model = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype or "auto")
        elif dtype is not None:  # the weights only (agentopd.weights_dtype: the rotary inv_freq stays fp32)
            model = cast_weights(model, dtype)
        for key in _LOGIT_TRANSFORMS:
            value = getattr(model.config, key, None)
            if value not in (None, 1, 1.0):
                raise ValueError(
                    f"teacher config has {key}={value}: HFTeacher computes logits as lm_head(hidden) "
                    "and does not apply that transform"
                )
        head = model.get_output_embeddings()
        if head is None or getattr(head, "bias", None) is not None:
            raise ValueError("the teacher needs an lm_head without bias (logits = hidden @ W.T)")
        model.eval()
        model.requires_grad_(False)
        if linear_dtype == "fp8":  # teacher.linear_dtype: the decoder's projections in float8 (agentopd.teacher.fp8)
            from agentopd.teacher.fp8 import to_fp8

            to_fp8(model)
        self.model = model
        self.device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.max_tokens_per_batch = max_tokens_per_batch
        self.temperature = temperature
        self.top_k = top_k
        self.head_chunk = head_chunk
        self._staging: torch.Tensor | None = None  # pinned host buffer of the hidden rows' copies (_to_host)
        if compile and self.device.type == "cuda":  # teacher.compile: each layer's bound forward, as the trainer does
            layers = getattr(self.model.base_model, "layers", None)
            if layers is None:
                raise ValueError(f"teacher.compile: {type(self.model).__name__} has no decoder `layers` to compile "
                                 "(a Llama/Qwen-style model has); set teacher.compile=false")  # fmt: skip
            for layer in layers:
                layer.forward = torch.compile(layer.forward, dynamic=True)
        self.head_fp32 = head_fp32
        self.offload_after_score = offload_after_score
        self.share_prefix = share_prefix
        from agentopd.kinds import sampled_vocab

        # the tokenizer's ids: log-probs are normalised over them, as the engines sample (engines/base.py)
        self.vocab_size = sampled_vocab(vocab_size, model.get_output_embeddings().weight.shape[0])
        from agentopd import attention

        half = model.dtype in (torch.bfloat16, torch.float16)  # the flash kernel's dtypes
        self.pack = attention.available(self.device) and half if pack is None else pack
        if self.pack and not (attention.available(self.device) and half):
            raise ValueError("pack=True needs CUDA, torch.nn.attention.varlen and a bf16/fp16 teacher (flash varlen)")
        self._host: dict[int, torch.Tensor] = {}  # id(parameter or buffer) -> its pinned CPU copy
        plan_micro_batches([], max_tokens_per_batch)  # validates the budget

    @property
    def config(self):
        return self.model.config

    @property
    def vocab_rows(self) -> int:
        """Rows of the teacher's lm_head (may exceed the tokenizer's size: padding rows)."""
        return self.model.get_output_embeddings().weight.shape[0]

    def head_weight(self, num_rows: int | None = None) -> torch.Tensor:
        """The lm_head weight (V x H) on CPU, without grad; `num_rows` keeps the first rows only
        (the vocabulary shared with the student, see `check_compatible`; default: `vocab_size`). On CUDA it is the
        pinned host copy `load` keeps (the weights never change): no device-to-host copy of the head a step where
        the teacher stays resident (for a 1.7B teacher, 0.6 GB), and the trainer's upload runs at pinned speed."""
        weight = self.model.get_output_embeddings().weight
        weight_VH = self._host.get(id(weight), weight).detach()
        num_rows = self.vocab_size if num_rows is None else num_rows
        if num_rows != weight_VH.shape[0]:
            if not 0 < num_rows <= weight_VH.shape[0]:
                raise ValueError(f"num_rows must be in [1, {weight_VH.shape[0]}], got {num_rows}")
            weight_VH = weight_VH[:num_rows]
        return upload_widened(weight_VH, "cpu")  # the rows up to an aligned count too: the trainer's loss GEMMs

    def _tensors(self) -> list[torch.Tensor]:
        """Every parameter and buffer once (tied weights are one tensor)."""
        seen: dict[int, torch.Tensor] = {}
        for module in self.model.modules():
            for t in (*module._parameters.values(), *module._buffers.values()):
                if t is not None:
                    seen.setdefault(id(t), t)
        return list(seen.values())

    def load(self) -> None:
        """Phase 1: put the teacher on its device. On CUDA the weights are copied from pinned
        host copies made once (the teacher's weights never change), so this runs at PCIe speed."""
        if self.device.type != "cuda":
            self.model.to(self.device)
            return
        for t in self._tensors():
            if t.device.type == "cuda" and self.device.index in (None, t.device.index):
                continue
            if t.device.type == "cpu" and id(t) not in self._host:
                self._host[id(t)] = t.data if t.data.is_pinned() else t.data.pin_memory()
            t.data = self._host.get(id(t), t.data).to(self.device, non_blocking=True)

    def offload(self) -> None:
        """Phase 2: drop the device copy (weights point back at their pinned host copies; nothing
        is copied back but what was never on the host) and release CUDA's cached memory."""
        if self.device.type != "cuda":
            return
        for t in self._tensors():
            if t.device.type == "cuda":
                if id(t) not in self._host:
                    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    host.copy_(t.data)
                    self._host[id(t)] = host
                t.data = self._host[id(t)]
        torch.cuda.empty_cache()

    @torch.inference_mode()
    def score(self, streams: list[TokenStream], *, mode: TeacherMode | str = TeacherMode.LOGPROBS) -> list[TeacherScores]:
        mode = as_mode(mode)
        check_scorable(streams)
        rows = self.vocab_size
        for n, s in enumerate(streams):
            bad = [t for t in s.token_ids if not 0 <= t < rows]
            if bad:
                raise ValueError(f"stream {n}: token id {bad[0]} is outside the teacher's vocabulary (0..{rows - 1})")
        self.load()
        try:
            out: list[TeacherScores | None] = [None] * len(streams)
            weight_VH = self.model.get_output_embeddings().weight[: self.vocab_size]
            half = weight_VH.dtype in (torch.bfloat16, torch.float16)
            if self.pack:
                groups = plan_shared_rows(streams, self.max_tokens_per_batch, share=self.share_prefix)
            else:
                groups = plan_micro_batches([len(s.token_ids) for s in streams], self.max_tokens_per_batch)
            with _tf32_matmuls(self.head_fp32 and half and self.device.type == "cuda"):
                for group in groups:
                    for i, scores in zip(group, self._score_group([streams[i] for i in group], mode, weight_VH)):
                        out[i] = scores
            assert all(s is not None for s in out)
            return out  # type: ignore[return-value]
        finally:
            if self.offload_after_score:
                self.offload()

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on the host. From a GPU through a pinned staging buffer kept across groups (grown as needed): a copy
        into pageable memory runs at a fraction of the link's speed (issue 52's profile: 2.8 s of the real-size
        teacher phase). The result is a view of that buffer, valid until the next group: callers copy out of it."""
        if t.device.type != "cuda":
            return t.to("cpu")
        n = t.numel()
        if self._staging is None or self._staging.numel() < n or self._staging.dtype != t.dtype:
            self._staging = None
            self._staging = torch.empty(max(n, 1), dtype=t.dtype, pin_memory=True)
        host = self._staging[:n].view(t.shape)
        host.copy_(t)
        return host

    def _hidden_packed(self, streams: list[TokenStream]) -> torch.Tensor:
        """Final hidden states at the response-predicting positions of streams packed in one row; with
        `share_prefix`, the prompt the samples of one task share is computed once (`agentopd.prefix.pack_row`)."""
        from agentopd import attention

        row = pack_row(streams, share=self.share_prefix)
        ids_1T = torch.tensor(row.ids, dtype=torch.long)[None]
        pos_1T = torch.tensor(row.positions, dtype=torch.long)[None]
        with attention.use_varlen(self.model):
            hidden_TH = self.model.base_model(
                input_ids=ids_1T.to(self.device, non_blocking=True), position_ids=pos_1T.to(self.device, non_blocking=True),
                use_cache=False, **attention.varlen_kwargs(row.seq_lens, self.device, row.continues),
            ).last_hidden_state[0]
        spans = [row.rows(j, s.prompt_len - 1, len(s.token_ids) - 1) for j, s in enumerate(streams)]
        rows = torch.cat([torch.arange(r.start, r.stop) for r in spans])  # ~700k rows a step of the README's example
        return hidden_TH[rows.to(self.device, non_blocking=True)]

    def _hidden_padded(self, streams: list[TokenStream]) -> torch.Tensor:
        decoder = self.model.base_model
        shared = shared_prefix_len(streams) if self.share_prefix and len(streams) > 1 else 0
        if shared >= MIN_SHARED_PREFIX:  # run the common prefix once; every stream attends to its K/V
            extra = run_prefix(decoder, torch.tensor([streams[0].token_ids[:shared]], device=self.device), len(streams))
        else:
            shared, extra = 0, {"use_cache": False}
        longest = max(len(s.token_ids) for s in streams) - shared
        ids_BT = torch.zeros(len(streams), longest, dtype=torch.long)
        for b, s in enumerate(streams):
            ids_BT[b, : len(s.token_ids) - shared] = torch.tensor(s.token_ids[shared:])
        # right padding under a causal mask: no real token attends to a pad, so no padding mask is needed,
        # and without one SDPA takes its causal kernel (~12% faster on CPU; the same hidden states)
        hidden_BTH = decoder(input_ids=ids_BT.to(self.device), **extra).last_hidden_state
        # Position prompt_len + i - 1 predicts response token i; row t of hidden_BTH is position shared + t.
        return torch.cat([hidden_BTH[b, s.prompt_len - 1 - shared : len(s.token_ids) - 1 - shared] for b, s in enumerate(streams)])

    def _score_group(self, streams: list[TokenStream], mode: TeacherMode, weight_VH: torch.Tensor) -> list[TeacherScores]:
        hidden_NH = self._hidden_packed(streams) if self.pack else self._hidden_padded(streams)
        targets_N = torch.cat([torch.tensor(s.response_ids, dtype=torch.long) for s in streams]).to(self.device)
        mask_N = torch.cat([torch.tensor(s.response_mask, dtype=torch.float32) for s in streams])
        assert hidden_NH.shape[0] == targets_N.shape[0] == mask_N.shape[0]

        logprob_chunks, ids_chunks, topk_chunks, entropy_chunks = [], [], [], []
        v = weight_VH.shape[0]
        k = min(self.top_k, v)
        gemm_VH = gemm_rows(weight_VH)  # the head GEMM over aligned rows where it has them (head_matmul)
        for start in range(0, hidden_NH.shape[0], self.head_chunk):
            h_nH = hidden_NH[start : start + self.head_chunk]
            logits_nV = head_logits(h_nH, gemm_VH, fp32=self.head_fp32)[:, :v] / self.temperature
            logprobs_nV = torch.log_softmax(logits_nV, dim=-1)
            logprob_chunks.append(logprobs_nV.gather(1, targets_N[start : start + self.head_chunk, None])[:, 0])
            if mode is TeacherMode.TOPK:
                top_nK = logprobs_nV.topk(k, dim=-1)
                ids_chunks.append(top_nK.indices)
                topk_chunks.append(top_nK.values)
                entropy_chunks.append(-(logprobs_nV.exp() * logprobs_nV).sum(-1))
        # one device-to-host copy per group (not per chunk and stream): the GPU is not stopped in between
        logprobs_N = torch.cat(logprob_chunks).cpu() if logprob_chunks else torch.zeros(0)
        logprobs_N = torch.where(mask_N > 0, logprobs_N, torch.zeros_like(logprobs_N))
        if mode is TeacherMode.TOPK:
            ids_NK = torch.cat(ids_chunks).cpu() if ids_chunks else torch.zeros(0, k, dtype=torch.long)
            top_NK = torch.cat(topk_chunks).cpu() if topk_chunks else torch.zeros(0, k)
            entropy_N = torch.cat(entropy_chunks).cpu() if entropy_chunks else torch.zeros(0)
        if mode is TeacherMode.HIDDEN:
            hidden_host_NH = self._to_host(hidden_NH)

        out, start = [], 0
        for s in streams:
            end = start + len(s.response_mask)
            scores = TeacherScores(logprobs=logprobs_N[start:end].tolist())
            if mode is TeacherMode.TOPK:
                scores.topk_ids = ids_NK[start:end].tolist()
                scores.topk_logprobs = top_NK[start:end].tolist()
                scores.entropy = entropy_N[start:end].tolist()
            if mode is TeacherMode.HIDDEN:
                scores.hidden = hidden_host_NH[start:end].clone()  # its own storage, not a view of the group's
            out.append(scores)
            start = end
        return out
