"""DAPO's soft overlong penalty: responses running into the last `buffer` tokens before
`max_tokens` lose reward linearly, down to -factor at the limit."""


def overlong_penalty(length: int, max_tokens: int, buffer: int, factor: float) -> float:
    """0 up to max_tokens - buffer, then falling linearly to -factor at max_tokens."""
    expected = max_tokens - buffer
    return min(-min(length - expected, buffer) / buffer * factor, 0.0)
