"""The prompts of the step being generated, kept for a phase that reads each sample's prompt as text: a reward model
with a tokenizer of its own renders the conversation again, a judge reads it (sync runs only: start-up refuses the
others)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from megarl.data.batching import TokenizedPrompt
from megarl.data.prompts import PromptRecord
from megarl.errors import UserError


class StepPrompts:
    def __init__(self, section: str, need: str) -> None:
        self.section, self.need = section, need
        """The config section and what it does with the text, for the error of a batch out of order."""
        self.prompts: list[TokenizedPrompt] = []
        """In the batch's order: each prompt's samples are contiguous in it."""

    def remembering(self, next_prompts: Callable[[], list[TokenizedPrompt]]
                    ) -> Callable[[], list[TokenizedPrompt]]:
        """``next_prompts``, keeping what it gives; each call of this starts a step."""
        self.prompts = []

        def take() -> list[TokenizedPrompt]:
            prompts = next_prompts()
            self.prompts += prompts
            return prompts

        return take

    def records(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], n: int) -> list[PromptRecord]:
        """Each sample's prompt record (n samples a prompt); a ``UserError`` where the samples do not begin with their
        prompts' tokens in that order, which would pair a response with another prompt's text."""
        if len(self.prompts) * n != len(sequences) or any(
                list(seq[:length]) != self.prompts[i // n].tokens
                for i, (seq, length) in enumerate(zip(sequences, prompt_lens, strict=True))):
            raise UserError(f"{self.section}: the step's samples are not in the order of its prompts, so {self.need}. "
                            "This is a fault in megarl, not in the data: report it with the run's config.yaml.")
        return [self.prompts[i // n].record for i in range(len(sequences))]
