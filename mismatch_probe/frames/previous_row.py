"""The router row of the forward that scored a token: row p − 1 for the token at position p.

Rows stream in (sample_id, position) order and a sequence may be cut between chunks, so the last row of
each chunk is carried into the next.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class PreviousRow:
    sample: int = -1
    position: int = -1
    values: tuple | None = None  # the last row's value of each column

    def shift(self, sample_id: np.ndarray, position: np.ndarray, *columns: np.ndarray):
        """(has, shifted columns): at row i, whether row i's sample holds position p − 1 just before it, and
        each column's value there (meaningless where `has` is False)."""
        n = len(sample_id)
        has = np.zeros(n, dtype=bool)
        if n == 0:
            return has, [c.copy() for c in columns]
        has[1:] = (sample_id[1:] == sample_id[:-1]) & (position[1:].astype(np.int64) == position[:-1] + 1)
        carried = self.values is not None and self.sample == int(sample_id[0]) and self.position + 1 == position[0]
        shifted = []
        for j, column in enumerate(columns):
            out = np.empty_like(column)
            out[1:] = column[:-1]
            if carried:
                out[0] = self.values[j]
            shifted.append(out)
        has[0] = carried
        self.sample, self.position = int(sample_id[-1]), int(position[-1])
        self.values = tuple(column[-1].copy() for column in columns)
        return has, shifted
