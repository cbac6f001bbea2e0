"""The generated Grafana dashboards: JSON model checks, registry coverage, freshness, CLI."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from layerscope.dashboards import builder
from layerscope.dashboards.builder import (DS_INPUT, build_dashboards, default_dir, iter_queries, render_all,
                                           write_all)
from layerscope.probes.metrics import BASE_LABELS, METRICS, REQUEST_LAYER, MetricDef
from layerscope.probes.schema import LAYERS

DASHBOARDS = build_dashboards()
NAMES = sorted(DASHBOARDS)
# Grafana unit ids the builder may emit (a subset of Grafana's list)
GRAFANA_UNITS = {"s", "ms", "short", "percentunit", "reqps", "ops", "bytes", "none"}
BUILTIN_VARS = {"__rate_interval", "__interval", "__range"}


def test_two_dashboards_with_stable_uids():
    assert NAMES == ["layerscope-layers.json", "layerscope-overview.json"]
    for name, d in DASHBOARDS.items():
        assert d["uid"] == name.removesuffix(".json")
        assert len(d["uid"]) <= 40 and re.fullmatch(r"[a-z0-9-]+", d["uid"])
        assert d["id"] is None
        assert d["schemaVersion"] >= 39
        assert d["title"] and d["description"]
        assert "layerscope" in d["tags"]


@pytest.mark.parametrize("name", NAMES)
def test_panel_ids_unique(name):
    ids = [p["id"] for p in DASHBOARDS[name]["panels"]]
    assert len(ids) == len(set(ids)), ids
    assert all(isinstance(i, int) and i > 0 for i in ids)


@pytest.mark.parametrize("name", NAMES)
def test_grid_positions_do_not_overlap(name):
    cells: dict[tuple[int, int], int] = {}
    for p in DASHBOARDS[name]["panels"]:
        g = p["gridPos"]
        assert set(g) == {"h", "w", "x", "y"}, p["title"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0
        assert g["x"] + g["w"] <= 24, f"{p['title']} is wider than the 24-column grid"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                other = cells.setdefault((x, y), p["id"])
                assert other == p["id"], f"panel {p['id']} ({p['title']}) overlaps panel {other} at {(x, y)}"


@pytest.mark.parametrize("name", NAMES)
def test_panels_have_datasource_unit_description_and_queries(name):
    ds = {"type": "prometheus", "uid": "${" + DS_INPUT + "}"}
    panels = [p for p in DASHBOARDS[name]["panels"] if p["type"] != "row"]
    assert panels
    for p in panels:
        assert p["datasource"] == ds, p["title"]
        unit = p["fieldConfig"]["defaults"].get("unit")
        assert unit in GRAFANA_UNITS, (p["title"], unit)
        assert p["description"].strip(), p["title"]
        assert p["title"].strip()
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
        for t in p["targets"]:
            assert t["datasource"] == ds, p["title"]
            assert t["expr"].strip() and t["legendFormat"].strip(), p["title"]


@pytest.mark.parametrize("name", NAMES)
def test_rows_one_per_layer_and_panels_grouped_by_layer(name):
    panels = DASHBOARDS[name]["panels"]
    assert panels[0]["type"] == "row", "the first panel is a row"
    rows = [p for p in panels if p["type"] == "row"]
    layers = [r["title"].split(" ")[0] for r in rows]
    assert len(layers) == len(set(layers)), layers
    for layer in layers:
        assert layer == REQUEST_LAYER or layer in LAYERS, layer
    order = [REQUEST_LAYER, *LAYERS]
    assert layers == sorted(layers, key=order.index), "rows follow the taxonomy's order"
    # each panel's metrics belong to the layer of the row above it (first metric = primary)
    by_name = {m.name: m for m in METRICS}
    current = None
    for p in panels:
        if p["type"] == "row":
            current = p["title"].split(" ")[0]
            assert not p["collapsed"] and p["panels"] == []
            continue
        names = metric_names(p["targets"][0]["expr"])
        assert any(by_name[n].layer == current for n in names), (p["title"], current, names)


@pytest.mark.parametrize("name", NAMES)
def test_import_inputs_declared(name):
    d = DASHBOARDS[name]
    inputs = {i["name"]: i for i in d["__inputs"]}
    assert inputs[DS_INPUT]["type"] == "datasource" and inputs[DS_INPUT]["pluginId"] == "prometheus"
    used = set(re.findall(r"\$\{(\w+)\}", json.dumps(d)))
    assert used == set(inputs), f"used {used}, declared {set(inputs)}"
    assert {"type": "datasource", "id": "prometheus"}.items() <= next(
        r for r in d["__requires"] if r["id"] == "prometheus").items()


@pytest.mark.parametrize("name", NAMES)
def test_template_variables(name):
    d = DASHBOARDS[name]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert set(variables) == {"model_name", "replica"}
    for label, v in variables.items():
        assert v["type"] == "query" and v["multi"] and v["includeAll"] and v["allValue"] == ".*"
        assert v["datasource"] == {"type": "prometheus", "uid": "${" + DS_INPUT + "}"}
        assert re.fullmatch(rf"label_values\(layerscope_\w+(\{{.*\}})?, {label}\)", v["query"]["query"])
        assert v["definition"] == v["query"]["query"]
    # the replica list follows the chosen model
    assert '$model_name' in variables["replica"]["query"]["query"]
    used = {m for _, t in iter_queries(d) for m in re.findall(r"\$(\w+)", t["expr"])}
    assert used <= set(variables) | BUILTIN_VARS, used


def metric_names(expr: str) -> set[str]:
    names = set(re.findall(r"\b(layerscope_\w+?)(?:_bucket|_sum|_count)?(?=\{|\[)", expr))
    return {n for n in names if not n.endswith(("_bucket", "_sum", "_count")) or n in {m.name for m in METRICS}}


def test_every_registry_metric_is_on_a_dashboard():
    used = {n for d in DASHBOARDS.values() for _, t in iter_queries(d) for n in metric_names(t["expr"])}
    registry = {m.name for m in METRICS}
    assert registry - used == set(), f"metrics on no panel: {sorted(registry - used)}"
    assert used - registry == set(), f"queries name metrics the registry lacks: {sorted(used - registry)}"


def test_queries_follow_the_metric_type():
    by_name = {m.name: m for m in METRICS}
    for d in DASHBOARDS.values():
        for p, t in iter_queries(d):
            expr = t["expr"]
            for name, suffix in re.findall(r"\b(layerscope_\w+?)(_bucket|_sum|_count)?(?=\{|\[)", expr):
                m = by_name.get(name) or by_name[name + suffix]
                if m.name != name:  # a metric whose own name ends in _count etc.
                    suffix = ""
                if m.type == "histogram":
                    assert suffix, f"{p['title']}: histogram {name} queried without _bucket/_sum/_count"
                    if suffix == "_bucket":
                        assert "le" in expr
                elif m.type == "counter":
                    assert f"rate({name}" in expr, f"{p['title']}: counter {name} not under rate()"
                else:
                    assert f"rate({name}" not in expr, f"{p['title']}: rate() of gauge {name}"
            for label in re.findall(r"by \(([^)]*)\)", expr):
                for lab in label.split(", "):
                    assert lab == "le" or any(lab in by_name[n].labels for n in metric_names(expr)), (p["title"], lab)


def test_units_follow_the_registry():
    panels = [p for d in DASHBOARDS.values() for p in d["panels"] if p["type"] != "row"]
    units = {p["title"]: p["fieldConfig"]["defaults"]["unit"] for p in panels}
    assert units["Time to first token (TTFT)"] == "s"
    assert units["KV-cache usage"] == "percentunit"
    assert units["Prefix-cache hit rate"] == "percentunit"
    assert units["Request rate"] == "reqps"
    assert units["Tokens per step (batch tokens)"] == "short"


def test_overview_contents():
    titles = [p["title"] for p in DASHBOARDS["layerscope-overview.json"]["panels"] if p["type"] != "row"]
    for want in ("TTFT", "TPOT", "ITL", "E2E", "Throughput", "Goodput", "Error", "Request rate"):
        assert any(want in t for t in titles), want
    ttft = next(p for p in DASHBOARDS["layerscope-overview.json"]["panels"] if "TTFT" in p["title"])
    exprs = [t["expr"] for t in ttft["targets"]]
    for q in ("0.5", "0.9", "0.99"):
        assert any(e.startswith(f"histogram_quantile({q}, sum by (le) (rate(layerscope_time_to_first_token_"
                                f"seconds_bucket{{") for e in exprs)
    assert any("_sum{" in e and "_count{" in e for e in exprs), "mean = rate(_sum) / rate(_count)"


def test_layer_panels_mention_their_conditions():
    panels = {p["title"]: p for p in DASHBOARDS["layerscope-layers.json"]["panels"] if p["type"] != "row"}
    assert "--tp 2" in panels["Collective time by op"]["description"]
    assert "--probes full" in panels["Launch-gap ratio"]["description"]
    assert "preempt" in panels["Preemptions/s"]["description"].lower()
    hit = panels["Prefix-cache hit rate"]["targets"][0]["expr"]
    assert re.fullmatch(r"sum\(rate\(layerscope_prefix_cache_hits_total\{.*\}\[\$__rate_interval\]\)\) / "
                        r"sum\(rate\(layerscope_prefix_cache_queries_total\{.*\}\[\$__rate_interval\]\)\)", hit)


def test_committed_files_match_a_fresh_build():
    """dashboards/*.json and *.yml are generated: rebuild with `layerscope dashboards build`."""
    stale = []
    for name, text in render_all().items():
        path = default_dir() / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            stale.append(name)
    assert not stale, f"{stale} differ from a fresh build: run `layerscope dashboards build` and commit them"
    generated = {p.name for p in default_dir().iterdir() if p.suffix in (".json", ".yml")}
    assert generated == set(render_all()), "a stale generated file is left in dashboards/"


def test_build_is_deterministic():
    assert render_all() == render_all()
    text = render_all()["layerscope-overview.json"]
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def test_a_new_registry_metric_gets_a_panel():
    extra = (
        MetricDef("layerscope_test_widget_seconds", "histogram", "A test histogram.", "seconds", "kernel.compute",
                  BASE_LABELS + ("kind",), (0.1, 1.0)),
        MetricDef("layerscope_test_things_total", "counter", "A test counter.", "requests", "gateway.route"),
        MetricDef("layerscope_test_level", "gauge", "A test gauge.", "ratio", "hardware"),
    )
    d = build_dashboards(METRICS + extra)["layerscope-layers.json"]
    rows = [p["title"].split(" ")[0] for p in d["panels"] if p["type"] == "row"]
    assert "kernel.compute" in rows and "hardware" in rows
    exprs = [t["expr"] for _, t in iter_queries(d)]
    assert any("histogram_quantile(0.99, sum by (kind, le) (rate(layerscope_test_widget_seconds_bucket{" in e
               for e in exprs)
    assert any("sum(rate(layerscope_test_things_total{" in e for e in exprs)
    assert any(e.startswith("avg by (replica) (layerscope_test_level{") for e in exprs)


def test_layout_naming_an_unknown_metric_fails():
    metrics = tuple(m for m in METRICS if m.name != "layerscope_kv_cache_usage_perc")
    with pytest.raises(KeyError, match="layerscope_kv_cache_usage_perc.*not in the metric registry"):
        build_dashboards(metrics)


def test_slo_thresholds_are_bucket_bounds():
    by_name = {m.name: m for m in METRICS}
    for slo in builder.LATENCY_SLOS:
        assert slo.threshold_s in by_name[slo.metric].buckets
    bad = tuple(replace(m, buckets=(1.0, 10.0)) if m.name == builder.LATENCY_SLOS[0].metric else m for m in METRICS)
    with pytest.raises(ValueError, match="not a bucket bound"):
        build_dashboards(bad)


def _run_dashboards_cli(argv: list[str]) -> int:
    import argparse

    from layerscope.dashboards.cli import add_parser

    parser = argparse.ArgumentParser(prog="layerscope")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_is_registered(tmp_path: Path):
    """`layerscope dashboards build --out DIR` through the real entry point (a subprocess:
    layerscope.cli.main registers its optional subcommands once per process)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "layerscope", "dashboards", "build", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(render_all())
    for name in render_all():
        assert (tmp_path / name).read_text(encoding="utf-8") == (default_dir() / name).read_text(encoding="utf-8")


def test_cli_build_and_check(tmp_path: Path, capsys):
    assert _run_dashboards_cli(["dashboards", "build", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(render_all())
    assert _run_dashboards_cli(["dashboards", "build", "--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "layerscope-layers.json").write_text("{}", encoding="utf-8")
    assert _run_dashboards_cli(["dashboards", "build", "--out", str(tmp_path), "--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert _run_dashboards_cli(["dashboards", "build", "--check"]) == 0, "the committed files are stale"


def test_write_all_default_dir_is_the_package(tmp_path: Path):
    import layerscope.dashboards

    assert default_dir() == Path(layerscope.dashboards.__file__).resolve().parent
    written = write_all(tmp_path)
    assert {p.name for p in written} == set(render_all())
