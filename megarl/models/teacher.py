"""What a distillation teacher (distill.teacher) must share with the student: the tokenizer, token for token, so
that a token id means the same text to both; and a shape the trainer's layout can split."""

from __future__ import annotations

from typing import Any

from megarl.errors import UserError
from megarl.models.spec import ModelSpec, load_spec


def check_teacher(teacher_dir: str, student_dir: str, student_tokenizer: Any, student: ModelSpec) -> ModelSpec:
    """The teacher's spec, after refusing a teacher whose tokenizer maps any token to another id than the student's,
    or whose output layer has fewer rows than the student's (which can sample any of them)."""
    from megarl.data.tokenizer import load_tokenizer

    spec = load_spec(teacher_dir)
    theirs, ours = load_tokenizer(teacher_dir, "distill.teacher").get_vocab(), student_tokenizer.get_vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda kv: kv[1])[:3]
        raise UserError(f"distill.teacher = {teacher_dir!r} has another tokenizer than model.hf_path = "
                        f"{student_dir!r}: {len(theirs)} tokens against {len(ours)}, and they differ at "
                        f"{len(set(theirs.items()) ^ set(ours.items()))} (token, id) pairs, e.g. {differ}. The "
                        "teacher scores the student's token ids, which must mean the same text to both. Fix: use a "
                        "teacher of the student's family (the same tokenizer files).")
    if spec.vocab_size < student.vocab_size:
        raise UserError(f"distill.teacher = {teacher_dir!r} has {spec.vocab_size} output rows (vocab_size in its "
                        f"config.json), fewer than the student's {student.vocab_size}: it cannot score every token the "
                        "student samples. Fix: use a teacher of the student's family.")
    return spec
