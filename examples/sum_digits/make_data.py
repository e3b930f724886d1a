"""Write the example's data: 3-digit additions "123+456=" in the layout the tiny default model
was warm-started on, as a JSON Lines file with the columns of your own choosing.

    python examples/sum_digits/make_data.py examples/sum_digits/data

``train.jsonl`` (2,000 rows) and ``heldout.jsonl`` (200 rows, disjoint), each row
``{"question", "sum", "carries"}``: ``carries`` is an extra column the reward receives in its
``row`` argument (here only logged). Deterministic: the same files on every machine.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path


def carries(a: int, b: int) -> int:
    n, c = 0, 0
    for _ in range(3):
        c = (a % 10 + b % 10 + c) // 10
        n += c
        a, b = a // 10, b // 10
    return n


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(2026)
    seen: set[tuple[int, int]] = set()
    for name, size in (("train", 2000), ("heldout", 200)):
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            while size:
                a, b = rng.randrange(1000), rng.randrange(1000)
                if (a, b) in seen:
                    continue
                seen.add((a, b))
                row = {"question": f"{a:03d}+{b:03d}=", "sum": str(a + b), "carries": carries(a, b)}
                f.write(json.dumps(row) + "\n")
                size -= 1
    print(f"wrote {out / 'train.jsonl'} and {out / 'heldout.jsonl'}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "data"))
