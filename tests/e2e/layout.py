"""Layout and contrast measures the e2e test asserts on: element boxes, their overlap, WCAG contrast."""

from __future__ import annotations


def element_box(page, selector: str) -> dict[str, float]:
    """The bounding box (x, y, width, height in CSS pixels) of the first element ``selector`` finds."""
    return page.locator(selector).bounding_box()


def overlap(a: dict[str, float], b: dict[str, float]) -> bool:
    """Whether two bounding boxes share any area."""
    return a["x"] < b["x"] + b["width"] and b["x"] < a["x"] + a["width"] and a["y"] < b["y"] + b["height"] and b["y"] < a["y"] + a["height"]


# WCAG contrast ratio of an element's text colour against the background it is drawn on (its own,
# or the nearest ancestor's that is not transparent).
CONTRAST_JS = """
(el) => {
  const rgb = (c) => c.match(/[\\d.]+/g).slice(0, 3).map(Number);
  const opaque = (c) => { const v = c.match(/[\\d.]+/g).map(Number); return v.length < 4 || v[3] > 0; };
  const lum = (c) => {
    const [r, g, b] = rgb(c).map((v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  };
  let bg = el;
  while (bg.parentElement && !opaque(getComputedStyle(bg).backgroundColor)) bg = bg.parentElement;
  const [a, b] = [lum(getComputedStyle(el).color), lum(getComputedStyle(bg).backgroundColor)].sort((x, y) => y - x);
  return (a + 0.05) / (b + 0.05);
}
"""
