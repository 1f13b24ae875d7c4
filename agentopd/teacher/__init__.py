"""Teachers: score the student's token streams (docs/design.md 2, TRAIN_API).

    from agentopd.teacher import HFTeacher, ServerTeacher, TeacherMode, check_compatible
    check_compatible(student_tok, teacher_tok, student.config, teacher.model.config)  # before training
    scores = HFTeacher(path).score(streams, mode=TeacherMode.LOGPROBS)

base.py    TeacherScores, TeacherMode, the Teacher protocol and the index convention
hf.py      HFTeacher: a local transformers model, two-phase (load, score the batch, offload)
server.py  ServerTeacher: a vLLM server's prompt logprobs over HTTP (httpx)
compat.py  check_compatible: refuse a teacher whose tokenizer differs from the student's
"""

from agentopd.teacher.base import Teacher, TeacherMode, TeacherScores
from agentopd.teacher.compat import check_compatible
from agentopd.teacher.hf import HFTeacher, plan_micro_batches
from agentopd.teacher.server import ServerTeacher, parse_prompt_logprobs

__all__ = [
    "HFTeacher",
    "ServerTeacher",
    "Teacher",
    "TeacherMode",
    "TeacherScores",
    "check_compatible",
    "parse_prompt_logprobs",
    "plan_micro_batches",
]
