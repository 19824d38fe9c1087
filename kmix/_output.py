"""Output helpers every command shares: aligned text tables, markdown tables and progress lines."""

import sys


def format_table(headers, rows):
    """A plain-text table: one header line, a rule, then one line per row (numbers to 4 digits)."""
    cells = [[str(h) for h in headers]] + [[format_cell(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(headers, rows):
    """A GitHub markdown table, its cells written as `format_table` writes them."""
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(format_cell(c) for c in row) + " |" for row in rows])


def format_cell(c):
    """A table cell: a float to 4 significant digits (scientific outside [1e-3, 1e5)), anything else as `str`."""
    if isinstance(c, float):
        return f"{c:.4g}" if c == 0 or 1e-3 <= abs(c) < 1e5 else f"{c:.3e}"
    return str(c)


def progress(message):
    """Prints one progress line to stderr, so tables on stdout stay clean."""
    print(message, file=sys.stderr, flush=True)
