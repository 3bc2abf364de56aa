"""Per-request constrained-decoding state over a TokenIndex (the engine's TokenConstraint protocol).

The state is a byte-FSM state, so it tracks exactly the bytes emitted so far, including a token that
stopped in the middle of a UTF-8 character. Jump-forward + retokenization is driven by text:
after the engine appends the forced string (and possibly re-splits the output into different
tokens), only the characters appended matter, and `advance_text` / `reset` move the state along
them.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from jsgl.fsm.regex_fsm import DEAD
from jsgl.fsm.token_index import TokenIndex


class RegexConstraint:
    def __init__(
        self,
        index: TokenIndex,
        eos_ids: Iterable[int] | None = None,
        *,
        jump_trailing_space: bool = False,
    ) -> None:
        """`eos_ids` default to the tokenizer's stop ids recorded in the index. With
        `jump_trailing_space=False` a forced string's trailing spaces are left for the model: BPE
        vocabularies glue a leading space to the next word (" John"), so jumping over `": "` and
        then forcing the model into a space-less token would push it off its usual tokenization."""
        self.index = index
        self.eos_ids = frozenset(int(i) for i in (index.eos_ids if eos_ids is None else eos_ids))
        self.jump_trailing_space = jump_trailing_space
        eos_mask = np.zeros(index.num_words, dtype=np.uint32)
        for i in self.eos_ids:
            if 0 <= i < index.vocab_size:
                eos_mask[i >> 5] |= np.uint32(1 << (i & 31))
        eos_mask.setflags(write=False)
        self._eos_mask = eos_mask
        self.state = index.start_state
        self._eos_taken = False

    # ---- the engine protocol ----
    def allowed_token_bitmask(self) -> np.ndarray:
        """Packed uint32 [ceil(V/32)]: bit i of word i>>5 set = token i allowed. Read-only."""
        if self._eos_taken:
            return self._eos_mask  # keep asking for EOS if the engine steps a finished request
        mask = self.index.mask(self.state)
        if self.index.accepting[self.state]:
            return mask | self._eos_mask
        return mask

    def advance(self, token_id: int) -> None:
        token_id = int(token_id)
        if self._eos_taken:
            raise ValueError("constraint already terminated by EOS")
        if token_id in self.eos_ids:
            if not self.index.accepting[self.state]:
                raise ValueError(f"EOS token {token_id} sampled in non-accepting state {self.state}")
            self._eos_taken = True
            return
        nxt = self.index.next_state(self.state, token_id)
        if nxt == DEAD:
            raise ValueError(f"token {token_id} is not allowed in state {self.state} of {self.index.pattern!r}")
        self.state = nxt

    def is_terminated(self) -> bool:
        """EOS taken, or no regular token can follow (a finished match with nothing more allowed)."""
        return self._eos_taken or not self.index.has_tokens(self.state)

    def is_accepting(self) -> bool:
        """The output so far is a complete match (the request may end here)."""
        return bool(self.index.accepting[self.state])

    def jump_forward_text(self) -> str:
        """Text every valid continuation starts with ("" mid-character, after EOS, or when the
        model has a choice). The engine appends it, then calls `advance_text` (or `reset`)."""
        if self._eos_taken:
            return ""
        text = self.index.jump_forward_string(self.state)
        return text if self.jump_trailing_space else text.rstrip(" ")

    def advance_text(self, text: str) -> None:
        """Move through characters appended outside sampling (jump-forward). ValueError if they
        leave the language (the state is then unchanged)."""
        nxt = self.index.state_after_text(text, self.state)
        if nxt == DEAD:
            raise ValueError(f"text {text!r} does not continue a match of {self.index.pattern!r}")
        self.state = nxt

    # ---- retokenization helpers ----
    def state_after_text(self, text: str) -> int:
        """State reached by the whole output `text` from the start (DEAD if not a valid prefix)."""
        return self.index.state_after_text(text)

    def reset(self, output_text: str = "") -> None:
        """Resynchronise to the full output text, e.g. after the engine retokenized
        output + jump string and rolled back / replaced its last tokens."""
        s = self.index.state_after_text(output_text)
        if s == DEAD:
            raise ValueError(f"output {output_text!r} is not a prefix of a match of {self.index.pattern!r}")
        self.state = s
        self._eos_taken = False

    def copy(self) -> RegexConstraint:
        """Independent state over the same (shared, read-only) index, e.g. for parallel samples."""
        other = object.__new__(RegexConstraint)
        other.__dict__.update(self.__dict__)
        return other
