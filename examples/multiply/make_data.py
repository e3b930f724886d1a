"""Write the example's data: 2-digit by 1-digit multiplications "47*6=" as JSON Lines files.

    python examples/multiply/make_data.py examples/multiply/data

Every problem ``a*b=`` with ``a`` in 10..99 and ``b`` in 2..9 (720 problems), shuffled with a
fixed seed: ``heldout.jsonl`` takes 120 of them and ``train.jsonl`` the other 600 (disjoint),
each row ``{"question": "47*6=", "product": "282"}``. Deterministic: the same files on every
machine. The characters (digits, ``*``, ``=``) are all in the tiny model's character set.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HELDOUT = 120


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pairs = [(a, b) for a in range(10, 100) for b in range(2, 10)]
    random.Random(2026).shuffle(pairs)
    for name, part in (("heldout", pairs[:HELDOUT]), ("train", pairs[HELDOUT:])):
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for a, b in part:
                f.write(json.dumps({"question": f"{a}*{b}=", "product": str(a * b)}) + "\n")
    print(f"wrote {out / 'train.jsonl'} and {out / 'heldout.jsonl'}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "data"))
