"""Output helpers every command shares: aligned text tables and progress lines."""

import sys


def format_table(headers, rows):
    """A plain-text table: one header line, a rule, then one line per row."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def progress(message):
    """Prints one progress line to stderr, so tables on stdout stay clean."""
    print(message, file=sys.stderr, flush=True)


def _fmt(c):
    if isinstance(c, float):
        if c == 0 or 1e-3 <= abs(c) < 1e5:
            return f"{c:.4g}"
        return f"{c:.3e}"
    return str(c)
