"""Refuse a teacher whose vocabulary differs from the student's, before any training.

    shared = check_compatible(student_tok, teacher_tok, student_model.config, teacher_model.config)

Distillation compares the two models token id by token id, so the id -> token mapping must be
the same. We compare the tokenizers themselves (every id's token string, added and special
tokens included), not the models' `vocab_size`: Qwen2.5 checkpoints of different sizes have
embedding matrices of 151,936 and 152,064 rows over one identical tokenizer (TRL #2215).

Decisions:
- Identical tokenizers with embedding matrices of different row counts are accepted: rows past
  the tokenizer's size are padding that no token id reaches. The return value is the number
  of real tokens; full-vocabulary losses compare the first that many logits of both models
  (`HFTeacher.head_weight(num_rows=shared)` and the student's lm_head sliced alike).
- A model whose matrix has fewer rows than its tokenizer has tokens is refused.
- Only the id -> token mapping is compared. Special-token *roles* (which token is eos or pad)
  may differ, as between a base and an instruct checkpoint of one family: scoring works on
  ids, and the stop tokens are the student engine's business.

Works with `transformers` tokenizers (anything with `get_vocab()` and `len()`) and raw
`tokenizers.Tokenizer` objects.
"""

from __future__ import annotations

from typing import Any


def id_to_token(tokenizer: Any) -> dict[int, str]:
    """Every id of a tokenizer (added tokens included) mapped to its token string."""
    try:
        vocab = tokenizer.get_vocab(with_added_tokens=True)  # tokenizers.Tokenizer
    except TypeError:
        vocab = tokenizer.get_vocab()  # transformers tokenizers include added tokens
    out: dict[int, str] = {}
    for token, i in vocab.items():
        assert i not in out, f"tokenizer maps id {i} to both {out[i]!r} and {token!r}"
        out[i] = token
    return out


def _rows(config: Any) -> int | None:
    if config is None or isinstance(config, int):
        return config
    return config.get_text_config().vocab_size if hasattr(config, "get_text_config") else config.vocab_size


def check_compatible(
    student_tokenizer: Any,
    teacher_tokenizer: Any,
    student_model_config: Any = None,
    teacher_model_config: Any = None,
) -> int:
    """Raise ValueError unless both tokenizers map every id to the same token; returns the
    shared vocabulary size. Model configs (or their embedding row counts as ints) are
    optional and checked to cover the tokenizer."""
    student, teacher = id_to_token(student_tokenizer), id_to_token(teacher_tokenizer)
    if student != teacher:
        for i in range(max(max(student, default=-1), max(teacher, default=-1)) + 1):
            if student.get(i) != teacher.get(i):
                raise ValueError(
                    f"teacher tokenizer differs from the student's: student has {len(student):,} tokens, "
                    f"teacher {len(teacher):,}; first mismatch at id {i}: "
                    f"student {student.get(i, '<none>')!r} vs teacher {teacher.get(i, '<none>')!r}"
                )
    size = max(student, default=-1) + 1
    for who, config in (("student", student_model_config), ("teacher", teacher_model_config)):
        rows = _rows(config)
        if rows is not None and rows < size:
            raise ValueError(
                f"{who} model has {rows:,} vocabulary rows but its tokenizer has {size:,} token ids "
                f"(student rows {_rows(student_model_config)}, teacher rows {_rows(teacher_model_config)})"
            )
    return size
