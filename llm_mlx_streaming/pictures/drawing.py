"""One drawing, written as SVG or PNG: the same shapes, the same numbers.

A `Drawing` collects rectangles, polylines, circles and text; `svg()` writes them as
SVG elements (each may carry `data-*` attributes: the number it shows, so a test or a
script can read the picture back), `png()` rasterises them with numpy onto a white
canvas (text in the 5x7 font of font.py) and writes the PNG with zlib, with the
picture's figures as JSON in a `tEXt` chunk. No dependency beyond numpy.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from xml.sax.saxutils import escape, quoteattr

import numpy as np

from . import font

PNG_KEYWORD = "mlxs-figures"  # the tEXt chunk holding the figures drawn


def hex_rgb(colour: str) -> tuple[int, int, int]:
    colour = colour.lstrip("#")
    return int(colour[0:2], 16), int(colour[2:4], 16), int(colour[4:6], 16)


@dataclass
class Mark:
    """One thing drawn (rect, line, circle or text), kept until the drawing is written."""

    kind: str  # rect | line | circle | text
    args: dict
    data: dict = field(default_factory=dict)


class Drawing:
    def __init__(self, width: int, height: int, background: str = "#ffffff") -> None:
        self.width, self.height, self.background = int(width), int(height), background
        self.marks: list[Mark] = []
        self.figures: dict = {}  # what the picture was drawn from (the PNG's tEXt, the SVG's metadata)

    # -- marks --------------------------------------------------------------------------
    def rect(self, x, y, w, h, fill: str, **data) -> None:
        self.marks.append(Mark("rect", {"x": x, "y": y, "w": w, "h": h, "fill": fill}, data))

    def line(self, points, stroke: str, width: float = 1.5, dash: bool = False, **data) -> None:
        if len(points) >= 2:
            self.marks.append(Mark("line", {"points": [(float(x), float(y)) for x, y in points],
                                              "stroke": stroke, "width": width, "dash": dash}, data))

    def circle(self, x, y, r, fill: str, **data) -> None:
        self.marks.append(Mark("circle", {"x": x, "y": y, "r": r, "fill": fill}, data))

    def text(self, x, y, text: str, size: int = 11, fill: str = "#1d2733", anchor: str = "start",
             bold: bool = False) -> None:
        """`y` is the text's baseline; `anchor` start, middle or end."""
        self.marks.append(Mark("text", {"x": x, "y": y, "text": str(text), "size": size, "fill": fill,
                                          "anchor": anchor, "bold": bold}))

    # -- SVG ----------------------------------------------------------------------------
    def svg(self) -> str:
        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" '
               f'viewBox="0 0 {self.width} {self.height}" font-family="system-ui, Helvetica, Arial, sans-serif">',
               f"<metadata id=\"{PNG_KEYWORD}\">{escape(json.dumps(self.figures, sort_keys=True))}</metadata>",
               f'<rect width="100%" height="100%" fill="{self.background}"/>']
        for s in self.marks:
            a, data = s.args, "".join(f" data-{k.replace('_', '-')}={quoteattr(_attr(v))}" for k, v in s.data.items())
            if s.kind == "rect":
                out.append(f'<rect x="{a["x"]:g}" y="{a["y"]:g}" width="{a["w"]:g}" height="{a["h"]:g}" '
                           f'fill="{a["fill"]}"{data}/>')
            elif s.kind == "line":
                pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in a["points"])
                dash = ' stroke-dasharray="5 3"' if a["dash"] else ""
                out.append(f'<polyline points="{pts}" fill="none" stroke="{a["stroke"]}" stroke-width="{a["width"]:g}" '
                           f'stroke-linejoin="round"{dash}{data}/>')
            elif s.kind == "circle":
                out.append(f'<circle cx="{a["x"]:.1f}" cy="{a["y"]:.1f}" r="{a["r"]:g}" fill="{a["fill"]}"{data}/>')
            else:
                anchor = {"start": "start", "middle": "middle", "end": "end"}[a["anchor"]]
                weight = ' font-weight="bold"' if a["bold"] else ""
                out.append(f'<text x="{a["x"]:g}" y="{a["y"]:g}" font-size="{a["size"]}" fill="{a["fill"]}" '
                           f'text-anchor="{anchor}"{weight}>{escape(a["text"])}</text>')
        out.append("</svg>")
        return "\n".join(out) + "\n"

    # -- PNG ----------------------------------------------------------------------------
    def pixels(self) -> np.ndarray:
        """The drawing rasterised: (height, width, 3) uint8."""
        img = np.empty((self.height, self.width, 3), dtype=np.uint8)
        img[:] = hex_rgb(self.background)
        for s in self.marks:
            a = s.args
            if s.kind == "rect":
                _fill(img, a["x"], a["y"], a["w"], a["h"], hex_rgb(a["fill"]))
            elif s.kind == "line":
                _polyline(img, a["points"], hex_rgb(a["stroke"]), max(1, round(a["width"])), a["dash"])
            elif s.kind == "circle":
                _disc(img, a["x"], a["y"], a["r"], hex_rgb(a["fill"]))
            else:
                _text(img, a)
        return img

    def png(self) -> bytes:
        img = self.pixels()
        raw = b"".join(b"\x00" + img[y].tobytes() for y in range(self.height))  # filter 0 per row
        text = PNG_KEYWORD.encode("latin-1") + b"\x00" + json.dumps(self.figures, sort_keys=True).encode("latin-1",
                                                                                                      "replace")
        return (b"\x89PNG\r\n\x1a\n"
                + _chunk(b"IHDR", struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0))
                + _chunk(b"tEXt", text)
                + _chunk(b"IDAT", zlib.compress(raw, 9))
                + _chunk(b"IEND", b""))

    def write(self, path) -> str:
        """Write SVG or PNG by the file's suffix; returns the format written."""
        from pathlib import Path

        path = Path(path)
        suffix = path.suffix.lower()
        if suffix == ".svg":
            path.write_text(self.svg(), encoding="utf-8")
            return "svg"
        if suffix == ".png":
            path.write_bytes(self.png())
            return "png"
        raise ValueError(f"{path.name}: a picture is written as .svg or .png")


def read_png(data: bytes) -> tuple[np.ndarray, dict]:
    """(pixels, tEXt chunks) of a PNG this module wrote (8-bit RGB, filter 0): for tests
    and for anyone reading the figures back."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    pos, idat, texts, width, height = 8, b"", {}, 0, 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        crc = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0]
        if zlib.crc32(kind + body) & 0xFFFFFFFF != crc:
            raise ValueError(f"bad CRC in {kind!r}")
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        elif kind == b"tEXt":
            key, _, value = body.partition(b"\x00")
            texts[key.decode("latin-1")] = value.decode("latin-1")
        pos += 12 + length
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, 1 + width * 3)
    if raw[:, 0].any():
        raise ValueError("only filter 0 is read")
    return raw[:, 1:].reshape(height, width, 3), texts


def _attr(v) -> str:
    if isinstance(v, float):
        return repr(v)
    return str(v)


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def _fill(img, x, y, w, h, rgb) -> None:
    H, W = img.shape[:2]
    x0, y0 = max(0, int(round(x))), max(0, int(round(y)))
    x1, y1 = min(W, int(round(x + w))), min(H, int(round(y + h)))
    if x1 > x0 and y1 > y0:
        img[y0:y1, x0:x1] = rgb


def _disc(img, cx, cy, r, rgb) -> None:
    H, W = img.shape[:2]
    x0, y0 = max(0, int(cx - r - 1)), max(0, int(cy - r - 1))
    x1, y1 = min(W, int(cx + r + 2)), min(H, int(cy + r + 2))
    if x1 <= x0 or y1 <= y0:
        return
    ys, xs = np.ogrid[y0:y1, x0:x1]
    img[y0:y1, x0:x1][(xs - cx) ** 2 + (ys - cy) ** 2 <= r * r] = rgb


def _polyline(img, points, rgb, width: int, dash: bool) -> None:
    """Segments drawn as squares of `width` along each (dashed: 5 on, 3 off)."""
    H, W = img.shape[:2]
    half, walked = width // 2, 0.0
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        n = max(1, int(max(abs(x1 - x0), abs(y1 - y0)) * 2))
        step = ((x1 - x0) ** 2 + (y1 - y0) ** 2) ** 0.5 / n
        for i in range(n + 1):
            walked += step if i else 0
            if dash and walked % 8 >= 5:
                continue
            x = int(round(x0 + (x1 - x0) * i / n)) - half
            y = int(round(y0 + (y1 - y0) * i / n)) - half
            img[max(0, y):max(0, min(H, y + width)), max(0, x):max(0, min(W, x + width))] = rgb


def _text(img, a) -> None:
    scale = 2 if a["size"] >= 16 else 1
    text = a["text"]
    width = font.text_width(text, scale)
    x = a["x"] - {"start": 0, "middle": width / 2, "end": width}[a["anchor"]]
    top = a["y"] - font.HEIGHT * scale
    rgb = hex_rgb(a["fill"])
    for i, ch in enumerate(text):
        gx = int(round(x)) + i * (font.WIDTH + 1) * scale
        for r, row in enumerate(font.glyph(ch)):
            for c, on in enumerate(row):
                if on:
                    _fill(img, gx + c * scale, int(round(top)) + r * scale, scale, scale, rgb)
                    if a["bold"]:
                        _fill(img, gx + c * scale + 1, int(round(top)) + r * scale, scale, scale, rgb)
