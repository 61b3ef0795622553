"""Data-dependent errors (SPEC §4): the flag bits of the device error word and their decoding."""
from __future__ import annotations

import re
from typing import List, Optional

# Bit order matches csrc/core/errors.h (error_flag_message); the extension is the source of
# truth and gqa_torch.__init__ checks at import that the two agree.
FLAG_MESSAGES: List[str] = [
    "seqlens_k + 1 overflows int32",
    "past length (seqlens_k + 1 - new tokens) is negative",
    "query start (seqlens_k + 1 - query tokens) is negative",
    "past length exceeds the past_key/past_value capacity",
    "total length (seqlens_k + 1) exceeds the cache capacity",
    "a rotary position is outside the cos_cache/sin_cache rows",
]

TOTAL_OVERFLOW = 1
PAST_NEGATIVE = 2
QUERY_NEGATIVE = 4
PAST_CAPACITY = 8
CAPACITY = 16
POSITION = 32

_TAG = re.compile(r"\[gqa-error-flags=(\d+)\]\s*")


def decode_flags(flags: int) -> List[str]:
    """The violated bounds named by an error word value, in bit order."""
    names = [message for bit, message in enumerate(FLAG_MESSAGES) if flags & (1 << bit)]
    unknown = flags & ~((1 << len(FLAG_MESSAGES)) - 1)
    if unknown:
        names.append(f"unknown flags 0x{unknown:x}")
    return names


class GQAError(ValueError, RuntimeError):
    """A call whose seqlens_k or position_ids break the contract.

    ``flags`` holds the SPEC §4 bits (see ``decode_flags``). On CPU it is raised before anything
    is written; on CUDA the violating rows wrote nothing and their outputs are NaN.
    """

    def __init__(self, flags: int, detail: Optional[str] = None):
        self.flags = int(flags)
        self.violations = decode_flags(self.flags)
        text = detail if detail else "gqa: " + "; ".join(self.violations)
        super().__init__(f"{text} (flags={self.flags})")


def translate(exc: BaseException) -> Optional[GQAError]:
    """Turns an operator exception tagged with error flags into a GQAError, else None."""
    match = _TAG.search(str(exc))
    if match is None:
        return None
    message = _TAG.sub("", str(exc)).strip()
    # Keep the first line: torch appends C++ frames to extension errors.
    first = message.splitlines()[0] if message else None
    return GQAError(int(match.group(1)), first)
