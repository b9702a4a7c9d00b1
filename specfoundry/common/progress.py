"""One progress-bar helper for every long stage (tqdm), silenced by --silent."""

from __future__ import annotations

import time

from tqdm.auto import tqdm


class Progress:
    """A bar over items (conversations, samples, steps) that also shows a token rate, and what
    `status()` says where given (the openai fleet: servers up of all)."""

    def __init__(self, total: int | None, unit: str, desc: str, silent: bool = False, initial: int = 0,
                 status=None, rate: bool = True):
        """rate: show the token rate (False: a bar over items that carry no tokens)."""
        self.bar = tqdm(total=total, unit=unit, desc=desc, disable=silent, initial=initial, dynamic_ncols=True)
        self.rate = rate
        self.tokens = 0
        self.start = time.perf_counter()
        self.status = status

    def update(self, items: int, tokens: int = 0) -> None:
        self.tokens += tokens
        if self.rate:
            elapsed = max(time.perf_counter() - self.start, 1e-9)
            extra = f", {self.status()}" if self.status is not None else ""
            self.bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tok/s{extra}", refresh=False)
        self.bar.update(items)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
