#!/usr/bin/env python3
"""Generate ferrotune's demo fine-tuning dataset: dates in many surface forms -> ISO 8601.

Writes `data/iso_dates_train.jsonl` and `data/iso_dates_heldout.jsonl` (one JSON object per line,
columns `input` and `output`), deterministically from a fixed seed. No calendar date appears in
both files, so the held-out split measures generalisation rather than recall.

Usage: python3 scripts/make_demo_dataset.py [--out-dir data] [--train 320] [--heldout 40] [--seed 1234]
"""

import argparse
import calendar
import datetime
import json
import pathlib
import random

PREFIX = "Convert to ISO date: "

MONTHS = [calendar.month_name[m] for m in range(1, 13)]
# "Sept" is common in prose; the other abbreviations are the usual three letters.
MONTH_ABBR = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sept", "Oct", "Nov", "Dec"]
WEEKDAYS = [calendar.day_name[d] for d in range(7)]

_ONES = ["", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
_ORD_ONES = ["", "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth"]
_ORD_TEENS = {
    10: "tenth", 11: "eleventh", 12: "twelfth", 13: "thirteenth", 14: "fourteenth",
    15: "fifteenth", 16: "sixteenth", 17: "seventeenth", 18: "eighteenth", 19: "nineteenth",
}


def ordinal_word(n: int) -> str:
    """1 -> 'first', 22 -> 'twenty-second', 30 -> 'thirtieth' (days of a month only)."""
    if n < 10:
        return _ORD_ONES[n]
    if n < 20:
        return _ORD_TEENS[n]
    tens = {2: "twenty", 3: "thirty"}[n // 10]
    if n % 10 == 0:
        return tens[:-1] + "ieth"
    return f"{tens}-{_ORD_ONES[n % 10]}"


def ordinal_suffix(n: int) -> str:
    """1 -> '1st', 2 -> '2nd', 11 -> '11th', 23 -> '23rd'."""
    if 10 <= n % 100 <= 20:
        return f"{n}th"
    return f"{n}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th') }"


# Each format renders one date; the weights favour the forms a reader meets most often while
# keeping every form frequent enough in 320 examples to be learned.
def _formats():
    return [
        (3, lambda d: f"{MONTHS[d.month - 1]} {d.day}, {d.year}"),
        (3, lambda d: f"{d.day} {MONTHS[d.month - 1]} {d.year}"),
        (3, lambda d: f"{MONTHS[d.month - 1]} {ordinal_suffix(d.day)}, {d.year}"),
        (3, lambda d: f"the {ordinal_word(d.day)} of {MONTHS[d.month - 1]}, {d.year}"),
        (2, lambda d: f"the {ordinal_suffix(d.day)} of {MONTHS[d.month - 1]} {d.year}"),
        (2, lambda d: f"{d.day} {MONTH_ABBR[d.month - 1]} {d.year}"),
        (2, lambda d: f"{MONTH_ABBR[d.month - 1]} {d.day}, {d.year}"),
        (2, lambda d: f"{MONTH_ABBR[d.month - 1]}. {ordinal_suffix(d.day)} {d.year}"),
        (2, lambda d: f"{MONTHS[d.month - 1]} {ordinal_word(d.day)}, {d.year}"),
        (2, lambda d: f"{WEEKDAYS[d.weekday()]}, {MONTHS[d.month - 1]} {d.day}, {d.year}"),
        (2, lambda d: f"{WEEKDAYS[d.weekday()]} {d.day} {MONTHS[d.month - 1]} {d.year}"),
        (2, lambda d: f"{d.month}/{d.day}/{d.year} (month/day/year)"),
        (2, lambda d: f"{d.day}/{d.month}/{d.year} (day/month/year)"),
        (2, lambda d: f"{d.day:02d}.{d.month:02d}.{d.year}"),
        (1, lambda d: f"{d.year}/{d.month:02d}/{d.day:02d}"),
        (1, lambda d: f"{d.year}, {MONTHS[d.month - 1]} {d.day}"),
        (1, lambda d: f"{MONTHS[d.month - 1].lower()} {d.day} {d.year}"),
        (1, lambda d: f"{d.day} {MONTHS[d.month - 1].upper()} {d.year}"),
    ]


def random_date(rng: random.Random) -> datetime.date:
    """A uniformly drawn valid calendar date between 1950-01-01 and 2035-12-31."""
    start = datetime.date(1950, 1, 1).toordinal()
    end = datetime.date(2035, 12, 31).toordinal()
    return datetime.date.fromordinal(rng.randint(start, end))


def make_examples(n: int, dates, rng: random.Random):
    formats = _formats()
    weights = [w for w, _ in formats]
    out = []
    for d in dates[:n]:
        (_, render), = rng.choices(formats, weights=weights, k=1)
        out.append({"input": PREFIX + render(d), "output": d.isoformat()})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=str(pathlib.Path(__file__).resolve().parent.parent / "data"))
    ap.add_argument("--train", type=int, default=320)
    ap.add_argument("--heldout", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    # Distinct dates, then a split: the two files never share a calendar date.
    dates, seen = [], set()
    while len(dates) < args.train + args.heldout:
        d = random_date(rng)
        if d not in seen:
            seen.add(d)
            dates.append(d)
    train = make_examples(args.train, dates[: args.train], rng)
    heldout = make_examples(args.heldout, dates[args.train :], rng)
    assert not {e["output"] for e in train} & {e["output"] for e in heldout}

    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("iso_dates_train.jsonl", train), ("iso_dates_heldout.jsonl", heldout)):
        with open(out_dir / name, "w", encoding="utf-8", newline="\n") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"wrote {len(rows)} examples to {out_dir / name}")


if __name__ == "__main__":
    main()
