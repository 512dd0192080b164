"""PNG plots of a bench report, drawn without matplotlib (a small RGB raster, a 3x5
pixel font and zlib): one image, two panels.

    left:  acceptance by depth, one line per method that drafts (share of steps that
           accepted a draft token at depth d)
    right: speedup over hf-greedy against tree size (draft nodes) for engine-heads
           methods, one line per heads directory, plus each tuned directory's sweep
           (`specheads tune`, speedup over engine-plain); the dashed line is 1.0x, the other
           methods are listed with their speedup
"""

from __future__ import annotations

import os
import struct
import tempfile
import zlib
from pathlib import Path

# 3x5 glyphs, rows top to bottom, "1" = ink.
GLYPHS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001010010010",
    "8": "111101111101111", "9": "111101111001111", "A": "010101111101101", "B": "110101110101110",
    "C": "011100100100011", "D": "110101101101110", "E": "111100110100111", "F": "111100110100100",
    "G": "011100101101011", "H": "101101111101101", "I": "111010010010111", "J": "001001001101010",
    "K": "101101110101101", "L": "100100100100111", "M": "101111111101101", "N": "110101101101101",
    "O": "010101101101010", "P": "110101110100100", "Q": "010101101110011", "R": "110101110101101",
    "S": "011100010001110", "T": "111010010010010", "U": "101101101101111", "V": "101101101101010",
    "W": "101101111111101", "X": "101101010101101", "Y": "101101010010010", "Z": "111001010100111",
    ".": "000000000000010", ",": "000000000010100", "-": "000000111000000", "[": "110100100100110",
    "]": "011001001001011", "(": "010100100100010", ")": "010001001001010", ":": "000010000010000",
    "/": "001001010100100", " ": "000000000000000", "_": "000000000000111",
}
COLOURS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (23, 190, 207),
           (140, 86, 75), (227, 119, 194)]
BLACK, GREY, WHITE = (0, 0, 0), (170, 170, 170), (255, 255, 255)


class Canvas:
    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(WHITE * (width * height))

    def dot(self, x: int, y: int, colour, size: int = 1) -> None:
        for dx in range(size):
            for dy in range(size):
                px, py = x + dx, y + dy
                if 0 <= px < self.width and 0 <= py < self.height:
                    i = 3 * (py * self.width + px)
                    self.pixels[i:i + 3] = bytes(colour)

    def line(self, x0: int, y0: int, x1: int, y1: int, colour, size: int = 1, dash: int = 0) -> None:
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for s in range(steps + 1):
            if dash and (s // dash) % 2:
                continue
            self.dot(round(x0 + (x1 - x0) * s / steps), round(y0 + (y1 - y0) * s / steps), colour, size)

    def text(self, x: int, y: int, text: str, colour=BLACK, scale: int = 2) -> None:
        for char in text.upper():
            glyph = GLYPHS.get(char, GLYPHS[" "])
            for bit, ink in enumerate(glyph):
                if ink == "1":
                    self.dot(x + (bit % 3) * scale, y + (bit // 3) * scale, colour, scale)
            x += 4 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.pixels[3 * self.width * y:3 * self.width * (y + 1)])
                       for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        idat = zlib.compress(raw, 9)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


class Panel:
    """Axes in a rectangle of the canvas, mapping data (x, y) to pixels."""

    def __init__(self, canvas: Canvas, left: int, top: int, width: int, height: int,
                 x_range: tuple[float, float], y_range: tuple[float, float]):
        self.canvas, self.left, self.top, self.width, self.height = canvas, left, top, width, height
        self.x_range, self.y_range = x_range, y_range

    def xy(self, x: float, y: float) -> tuple[int, int]:
        (x0, x1), (y0, y1) = self.x_range, self.y_range
        px = self.left + (x - x0) / ((x1 - x0) or 1) * self.width
        py = self.top + self.height - (y - y0) / ((y1 - y0) or 1) * self.height
        return round(px), round(py)

    def axes(self, title: str, x_label: str, x_ticks: list[float], y_ticks: list[float]) -> None:
        c, bottom = self.canvas, self.top + self.height
        c.text(self.left, self.top - 24, title)
        for y in y_ticks:
            _, py = self.xy(self.x_range[0], y)
            c.line(self.left, py, self.left + self.width, py, (230, 230, 230))
            c.text(self.left - 40, py - 5, f"{y:.2f}")
        for x in x_ticks:
            px, _ = self.xy(x, self.y_range[0])
            c.line(px, bottom, px, bottom + 4, BLACK)
            label = f"{x:g}"
            c.text(px - 4 * len(label), bottom + 8, label)
        c.line(self.left, self.top, self.left, bottom, BLACK)
        c.line(self.left, bottom, self.left + self.width, bottom, BLACK)
        c.text(self.left + self.width // 2 - 4 * len(x_label), bottom + 24, x_label)

    def series(self, points: list[tuple[float, float]], colour) -> None:
        for (xa, ya), (xb, yb) in zip(points, points[1:]):
            self.canvas.line(*self.xy(xa, ya), *self.xy(xb, yb), colour, size=2)
        for x, y in points:
            px, py = self.xy(x, y)
            self.canvas.dot(px - 3, py - 3, colour, 7)


def _acceptance_panel(canvas: Canvas, methods: list[dict]) -> None:
    drafting = [m for m in methods if m["overall"]["acceptance_by_depth"]]
    depth = max((len(m["overall"]["acceptance_by_depth"]) for m in drafting), default=1)
    panel = Panel(canvas, 70, 50, 420, 300, (0.5, depth + 0.5), (0.0, 1.0))
    panel.axes("ACCEPTANCE BY DEPTH", "DEPTH", list(range(1, depth + 1)), [0.0, 0.25, 0.5, 0.75, 1.0])
    for i, m in enumerate(drafting):
        colour = COLOURS[i % len(COLOURS)]
        panel.series([(d + 1, a) for d, a in enumerate(m["overall"]["acceptance_by_depth"])], colour)
        canvas.text(70, 420 + 16 * i, m["name"], colour)


def _tuning_series(report: dict) -> dict[str, list[tuple[float, float]]]:
    """Per tuned heads dir: the best measured speedup over engine-plain per draft-node count."""
    series = {}
    for label, tuning in (report.get("tuning") or {}).items():
        best: dict[int, float] = {}
        for row in (tuning or {}).get("settings", []):
            if row.get("speedup_vs_plain") is not None:
                best[row["num_nodes"]] = max(best.get(row["num_nodes"], 0.0), row["speedup_vs_plain"])
        if best:
            series[label] = sorted(best.items())
    return series


def _speedup_panel(canvas: Canvas, methods: list[dict], tuning: dict[str, list[tuple[float, float]]]) -> None:
    heads = sorted((m for m in methods if m["kind"] == "engine-heads"), key=lambda m: m["tree"]["num_draft_nodes"])
    groups: dict[str, list[dict]] = {}
    for m in heads:
        groups.setdefault(m["tree"].get("heads", "heads"), []).append(m)
    speedups = [m["overall"]["speedup"] or 0.0 for m in methods] + [y for pts in tuning.values() for _, y in pts]
    y_max = max([1.5, *speedups]) * 1.1
    nodes = [m["tree"]["num_draft_nodes"] for m in heads] + [x for pts in tuning.values() for x, _ in pts] or [1]
    x_range = (0, max(nodes) * 1.1 + 1)
    panel = Panel(canvas, 620, 50, 420, 300, x_range, (0.0, y_max))
    ticks = sorted(set(nodes))
    panel.axes("SPEEDUP VS TREE SIZE", "DRAFT NODES", ticks, [y_max * k / 4 for k in range(5)])
    canvas.line(*panel.xy(x_range[0], 1.0), *panel.xy(x_range[1], 1.0), GREY, dash=6)
    for i, group in enumerate(groups.values()):
        panel.series([(m["tree"]["num_draft_nodes"], m["overall"]["speedup"] or 0.0) for m in group],
                     COLOURS[i % len(COLOURS)])
    lines = [f"{m['name']}: {m['overall']['speedup'] or 0.0:.2f}X" for m in methods]
    for j, (label, points) in enumerate(tuning.items(), start=len(groups)):
        panel.series(points, COLOURS[j % len(COLOURS)])
        lines.append(f"tune sweep {label} (vs engine-plain)")
    for i, text in enumerate(lines):
        canvas.text(620, 420 + 16 * i, text)


def render(report: dict) -> bytes:
    methods = report["methods"]
    tuning = _tuning_series(report)
    canvas = Canvas(1100, 440 + 16 * max(len(methods) + len(tuning), 1))
    _acceptance_panel(canvas, methods)
    _speedup_panel(canvas, methods, tuning)
    return canvas.png()


def write_plots(report: dict, path: str | Path) -> Path:
    """Write the PNG atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(render(report))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
