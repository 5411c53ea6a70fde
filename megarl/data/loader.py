"""Endless, resumable iteration over prompt batches: one seeded shuffle per epoch."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from megarl.errors import UserError

T = TypeVar("T")


class PromptLoader(Generic[T]):
    """Yields batches of `batch_size` items forever, epoch after epoch.

    Epoch e visits the items in the order of a permutation seeded by (seed, e), so any epoch can be
    rebuilt from the state alone. The tail of an epoch that cannot fill a batch is skipped (every step
    gets the same number of prompts); shuffling moves different items into it each epoch. Without shuffling the
    items are a cycle instead: a batch that reaches the end goes on from the start (a skipped tail would be the
    same items every epoch, never trained on).
    state_dict() after k batches, loaded into a fresh loader, makes it yield batch k + 1 onwards, over the same
    items: ``key(item)`` (JSON values; default: its repr) names what makes an item itself, and a digest of the keys
    in order travels with the state.
    """

    def __init__(self, items: Sequence[T], batch_size: int, shuffle: bool = True, seed: int = 0,
                 key: Callable[[T], Any] = repr) -> None:
        if batch_size > len(items):
            raise UserError(
                f"data.num_prompts_per_step = {batch_size}, but the dataset has only {len(items)} prompts "
                "(after dropping over-long ones). Fix: lower data.num_prompts_per_step or use more data."
            )
        self.items = items
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0  # items of this epoch's order already yielded
        self._order = self._permutation()
        digest = hashlib.sha256()
        for item in items:
            digest.update(json.dumps(key(item)).encode())
            digest.update(b"\0")
        self.digest = digest.hexdigest()[:16]

    def _permutation(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.items))
        # SeedSequence takes non-negative integers only.
        return np.random.default_rng([self.seed % 2**64, self.epoch]).permutation(len(self.items))

    def __iter__(self) -> Iterator[list[T]]:
        return self

    def __next__(self) -> list[T]:
        if not self.shuffle:
            n = len(self.items)
            cycled = [self.items[(self.position + i) % n] for i in range(self.batch_size)]
            self.position += self.batch_size
            if self.position >= n:
                self.epoch, self.position = self.epoch + 1, self.position - n
            return cycled
        if self.position + self.batch_size > len(self.items):
            self.epoch += 1
            self.position = 0
            self._order = self._permutation()
        picked = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return [self.items[i] for i in picked]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_items": len(self.items),
                "digest": self.digest}

    def load_state_dict(self, state: dict[str, Any], allow_other_items: bool = False) -> None:
        """Continue where `state` left off; the checkpoint's seed replaces this loader's (``check_state`` first)."""
        self.check_state(state, allow_other_items)
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        self.position = state["position"]
        self._order = self._permutation()

    def check_state(self, state: dict[str, Any], allow_other_items: bool = False) -> None:
        """Refuse a state saved over another number of items, or over as many other ones (another file, the same
        one edited, another prompt template) unless ``allow_other_items``; a state of a megarl before digests is
        not compared. Cheap: a resume asks it before anything is built."""
        if state["num_items"] != len(self.items):
            raise UserError(
                f"the checkpoint's prompt loader was over {state['num_items']} prompts, but data.train_path now "
                f"gives {len(self.items)}, so the resumed order would differ. Fix: use the same data (and "
                "rollout.max_prompt_tokens) as the checkpointed run, or start fresh in another checkpoint.dir."
            )
        if state.get("digest", self.digest) != self.digest and not allow_other_items:
            raise UserError(
                f"the checkpoint's prompt loader was over {state['num_items']} prompts, and the data now gives as "
                "many, but not the same ones (their digests differ: data.train_path's file was replaced or edited, "
                "or the prompt template or keys changed), so the resumed order would visit other prompts than the "
                "saved one meant. Fix: restore the checkpointed run's data and prompt settings, or start fresh in "
                "another checkpoint.dir (an RL run continues on other prompts deliberately with "
                "checkpoint.allow_changes naming the field that changed, e.g. data.train_path)."
            )
