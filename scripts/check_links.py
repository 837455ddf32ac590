#!/usr/bin/env python3
"""Fails on a broken internal link in the manual (docs/src, an mdBook) or in README.md.

mdBook itself renders a link to a missing page or heading without a word, so this checks:
- every relative link of README.md and of each page resolves to a file that exists, and a
  `#anchor` into a Markdown file names one of its headings (ids made as mdBook and GitHub make
  them: the heading's text lowercased, whitespace as '-', other punctuation dropped, repeats
  numbered -1, -2, ...);
- a page links only inside docs/src (the built book holds nothing else);
- SUMMARY.md lists every page, and every page it lists exists.
Links with a scheme (https:, mailto:) are not followed. Usage: scripts/check_links.py
"""
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
SRC = os.path.join(ROOT, "docs", "src")

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
INLINE_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def prose_lines(path):
    """(line number, text) of the lines outside fenced code blocks."""
    fence = None
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            m = FENCE.match(line)
            if m:
                if fence is None:
                    fence = m.group(1)
                elif m.group(1) == fence:
                    fence = None
                continue
            if fence is None:
                yield n, line.rstrip("\n")


def heading_id(text):
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's label only
    # Emphasis markers go, outside code spans only (`lora_finetune` keeps its underscores).
    parts = []
    last = 0
    for m in CODE_SPAN.finditer(text):
        parts.append(re.sub(r"(?<!\w)[*_]{1,3}|[*_]{1,3}(?!\w)", "", text[last:m.start()]))
        parts.append(m.group(2))
        last = m.end()
    parts.append(re.sub(r"(?<!\w)[*_]{1,3}|[*_]{1,3}(?!\w)", "", text[last:]))
    text = "".join(parts)
    out = []
    for ch in text.strip().lower():
        if ch.isalnum() or ch in "_-":
            out.append(ch)
        elif ch.isspace():
            out.append("-")
    return "".join(out)


_ids = {}


def anchors(path):
    if path not in _ids:
        seen = set()
        for _, line in prose_lines(path):
            m = HEADING.match(line)
            if not m:
                continue
            base = heading_id(m.group(2))
            cand, k = base, 0
            while cand in seen:
                k += 1
                cand = "%s-%d" % (base, k)
            seen.add(cand)
        _ids[path] = seen
    return _ids[path]


def links(path):
    for n, line in prose_lines(path):
        bare = CODE_SPAN.sub("code", line)
        for m in INLINE_LINK.finditer(bare):
            yield n, m.group(1)
        m = REF_DEF.match(bare)
        if m:
            yield n, m.group(1)


def check(path, inside_book):
    errors, count = [], 0
    for n, target in links(path):
        if SCHEME.match(target) or target.startswith("//"):
            continue
        count += 1
        where = "%s:%d: link '%s'" % (os.path.relpath(path, ROOT), n, target)
        file_part, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        if not os.path.exists(dest):
            errors.append("%s: no such file %s" % (where, os.path.relpath(dest, ROOT)))
            continue
        if inside_book and os.path.commonpath([dest, SRC]) != SRC:
            errors.append("%s: points outside docs/src, which the built book does not hold" % where)
            continue
        if anchor and dest.endswith(".md") and anchor not in anchors(dest):
            errors.append("%s: %s has no heading '#%s'" % (where, os.path.relpath(dest, ROOT), anchor))
    return errors, count


def main():
    pages = []
    for d, _, files in os.walk(SRC):
        pages += [os.path.join(d, f) for f in files if f.endswith(".md")]
    pages.sort()
    errors, count = [], 0
    for path in [os.path.join(ROOT, "README.md")] + pages:
        e, c = check(path, path != os.path.join(ROOT, "README.md"))
        errors += e
        count += c
    summary = os.path.join(SRC, "SUMMARY.md")
    listed = {os.path.normpath(os.path.join(SRC, t.partition("#")[0])) for _, t in links(summary)}
    for p in pages:
        if p != summary and p not in listed:
            errors.append("%s: not listed in docs/src/SUMMARY.md" % os.path.relpath(p, ROOT))
    for e in errors:
        print(e, file=sys.stderr)
    if errors:
        print("check_links: %d broken of %d links" % (len(errors), count), file=sys.stderr)
        return 1
    print("check_links: %d internal links in README.md and %d pages, all resolve" % (count, len(pages)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
