"""`llm mlxs stats --plot` and `llm mlxs simulate --plot`: the SVG parses, the PNG opens,
and the numbers drawn equal the figures they were drawn from."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

from dashboard_support import dash_server, request
from llm_mlx_streaming.experts.traces import bundled_traces
from plugin_support import assert_ok

DEMO_TRACE = bundled_traces()["demo"]
SVG = "{http://www.w3.org/2000/svg}"


def drawn(svg_path: Path):
    """(root, {series: [values by index]}, cells by (layer, expert), figures) of an SVG."""
    root = ET.parse(svg_path).getroot()
    series: dict = {}
    for c in root.iter(f"{SVG}circle"):
        if "data-series" in c.attrib:
            series.setdefault(c.get("data-series"), []).append(
                (float(c.get("data-at") if "data-at" in c.attrib else c.get("data-slots")), float(c.get("data-value"))))
    cells = {(r.get("data-layer"), int(r.get("data-expert"))): r for r in root.iter(f"{SVG}rect")
             if "data-expert" in r.attrib}
    figures = json.loads(root.find(f"{SVG}metadata").text)
    return root, series, cells, figures


def opened_png(path: Path, svg_root):
    from llm_mlx_streaming.pictures import read_png

    pixels, texts = read_png(path.read_bytes())
    assert pixels.shape == (int(svg_root.get("height")), int(svg_root.get("width")), 3)
    assert len({tuple(p) for p in pixels.reshape(-1, 3)[::97]}) > 5  # drawn, not blank
    return pixels, json.loads(texts["mlxs-figures"])


def assert_cells_painted(pixels, cells):
    """Each heatmap cell's top-left pixel has the cell's fill colour."""
    for cell in cells.values():
        x, y = round(float(cell.get("x"))), round(float(cell.get("y")))
        fill = cell.get("fill").lstrip("#")
        assert tuple(pixels[y, x]) == tuple(int(fill[i:i + 2], 16) for i in (0, 2, 4)), cell.attrib


def test_stats_plot_draws_the_logged_responses_and_the_last_traced_routing(llm_env, tmp_path):
    from llm_mlx_streaming.experts.simulate import replay
    from llm_mlx_streaming.experts.traces import load_trace
    from llm_mlx_streaming.pictures.charts import CURVES, response_values

    assert_ok(llm_env.run("mlxs", "config", "trace", "on"))
    for prompt, n in (("first of three", 5), ("the second one", 7), ("and a third", 4)):
        assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_tokens", str(n), prompt))
    svg, png = tmp_path / "stats.svg", tmp_path / "stats.png"
    assert "Wrote" in assert_ok(llm_env.run("mlxs", "stats", "--plot", str(svg))).stderr
    assert_ok(llm_env.run("mlxs", "stats", "--plot", str(png)))

    root, series, cells, figures = drawn(svg)
    logged = [t["stats"] for t in llm_env.turns()]  # oldest first
    expected = response_values(logged)
    for key, *_ in CURVES:
        want = [(i, v) for i, v in enumerate(expected[key], start=1) if v is not None]
        assert series.get(key, []) == want, key  # exact: the values are written as repr()
    assert [x["hit_rate"] for x in logged] == expected["hit_rate"]

    # the heatmap: the last response's prefill and decode routing, replayed at its slots and policy
    lines = load_trace(llm_env.user_dir / "mlx-streaming" / "traces" / "small.jsonl", phase=None)
    last = lines[-2:]
    assert [s.phase for s in last] == ["prefill", "decode"]
    slots, policy = logged[-1]["expert_slots"], logged[-1]["policy"]
    for layer in range(2):
        steps = last[0].layer_seqs[layer] + last[1].layer_seqs[layer]
        hits, accesses = replay(steps, slots, policy)
        row = [cells[(str(layer), e)] for e in range(8)]
        assert sum(int(c.get("data-hits")) for c in row) == hits
        assert sum(int(c.get("data-hits")) + int(c.get("data-misses")) for c in row) == accesses

    pixels, png_figures = opened_png(png, root)
    assert png_figures == figures  # the same numbers in both formats
    assert_cells_painted(pixels, cells)


def test_stats_live_plot_draws_the_running_servers_pools(tmp_path, plugin_checkpoint):
    with dash_server(tmp_path / "llm", plugin_checkpoint) as env:
        for prompt in ("one for the pools", "and one more"):
            status, _, body = request(env, "POST", "/v1/chat/completions", {
                "model": "mlx-stream", "max_tokens": 5, "messages": [{"role": "user", "content": prompt}]})
            assert status == 200, body
        svg, png = tmp_path / "live.svg", tmp_path / "live.png"
        assert_ok(env.run("mlxs", "stats", "--live", "--plot", str(svg)))
        assert_ok(env.run("mlxs", "stats", "--live", "--plot", str(png)))
        layers = {str(x["layer"]): x for x in json.loads(request(env, "GET", "/api/stats")[2])["layers"]}
        recent = json.loads(request(env, "GET", "/dashboard/snapshot")[2])["recent"]
    root, series, cells, figures = drawn(svg)
    for name, layer in layers.items():
        row = [cells[(name, e)] for e in range(8)]
        assert sum(int(c.get("data-hits")) for c in row) == layer["hits"]
        assert sum(int(c.get("data-misses")) for c in row) == layer["misses"]
        assert sum(c.get("data-resident") == "1" for c in row) == 4
    assert [v for _, v in series["decode_tps"]] == [r["decode_tps"] for r in recent]
    assert [v for _, v in series["hit_rate"]] == [r["hit_rate"] for r in recent]
    pixels, png_figures = opened_png(png, root)
    assert png_figures == figures
    assert_cells_painted(pixels, cells)


def test_simulate_plot_draws_hit_rate_against_pool_size(llm_env, tmp_path):
    from llm_mlx_streaming.experts.simulate import replay, simulate
    from llm_mlx_streaming.experts.traces import load_trace

    svg, png = tmp_path / "sim.svg", tmp_path / "sim.png"
    out = assert_ok(llm_env.run("mlxs", "simulate", str(DEMO_TRACE), "--slots", "2,4,8", "--plot", str(svg)))
    assert "Belady" in out.stdout  # the table still printed
    assert_ok(llm_env.run("mlxs", "simulate", str(DEMO_TRACE), "--slots", "2,4,8", "--plot", str(png), "--json"))
    rows = simulate(DEMO_TRACE, [2, 4, 8])
    root, series, cells, figures = drawn(svg)
    for name in rows[0]["hit_rate"]:
        assert series[name] == [(r["slots"], r["hit_rate"][name]) for r in rows], name
    assert series["belady"] == [(r["slots"], r["belady"]) for r in rows]
    # the heatmap: the middle slot count (4), the first policy (LRU), each sequence from cold
    seqs = load_trace(DEMO_TRACE)
    for layer in range(4):
        hits = accesses = 0
        for seq in seqs:
            h, n = replay(seq.layer_seqs[layer], 4, "lru")
            hits, accesses = hits + h, accesses + n
        row = [cells[(str(layer), e)] for e in range(16)]
        assert sum(int(c.get("data-hits")) for c in row) == hits
        assert sum(int(c.get("data-hits")) + int(c.get("data-misses")) for c in row) == accesses
    pixels, png_figures = opened_png(png, root)
    assert png_figures == figures
    assert_cells_painted(pixels, cells)


def test_a_picture_is_svg_or_png(llm_env, tmp_path):
    bad = llm_env.run("mlxs", "simulate", str(DEMO_TRACE), "--plot", str(tmp_path / "x.jpg"))
    assert bad.exit_code == 2 and "FILE.svg or FILE.png" in bad.output
    assert llm_env.run("mlxs", "stats", "--plot", str(tmp_path / "x.pdf")).exit_code == 2


def test_the_png_font_has_every_glyph_it_draws():
    from llm_mlx_streaming.pictures import font

    for ch in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;%/-+()[]=<>_#'\"*!?|&":
        rows = font.glyph(ch)
        assert len(rows) in (7, 9) and all(len(r) == 5 for r in rows), ch
    assert font.glyph("\u00d7") == font.glyph("x")
