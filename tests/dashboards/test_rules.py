"""The generated Prometheus rules: ``promtool check rules``, and ``promtool test rules`` on
synthetic series proving each SLO alert fires when it should and stays quiet on a healthy
model. Every dashboard query is also parsed by promtool (as a recording rule)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from layerscope.dashboards.builder import build_dashboards, default_dir, iter_queries
from layerscope.dashboards.rules import KV_USAGE_MAX, QUEUE_MIN, RULES_FILE, build_rules, render_rules

RULES = build_rules()


def _promtool(promtool: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_promtool_check_rules_passes(promtool):
    path = default_dir() / RULES_FILE
    out = _promtool(promtool, "check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    n = sum(len(g["rules"]) for g in RULES["groups"])
    assert f"SUCCESS: {n} rules found" in out.stdout + out.stderr


def test_rules_cover_the_slos():
    alerts = {r["alert"]: r for g in RULES["groups"] for r in g["rules"] if "alert" in r}
    assert set(alerts) == {"LayerscopeTTFTP99High", "LayerscopeTPOTP99High", "LayerscopeErrorRatioHigh",
                           "LayerscopeKVCacheNearlyFull", "LayerscopeKVCacheExhausted",
                           "LayerscopeEngineQueueGrowing", "LayerscopeGatewayQueueGrowing"}
    for a in alerts.values():
        assert a["labels"]["severity"] in ("warning", "critical")
        assert a["labels"]["layer"]
        assert a["annotations"]["summary"] and a["annotations"]["description"]
        assert a["for"]
    records = {r["record"] for g in RULES["groups"] for r in g["rules"] if "record" in r}
    assert "model_name:layerscope_time_to_first_token_seconds:p99_rate5m" in records
    assert render_rules(RULES) == (default_dir() / RULES_FILE).read_text(encoding="utf-8")


def test_every_dashboard_query_parses(promtool, tmp_path: Path):
    """promtool parses each panel query (template variables substituted) as a recording rule."""
    rules = []
    for d in build_dashboards().values():
        for _, t in iter_queries(d):
            expr = (t["expr"].replace("$model_name", ".*").replace("$replica", ".*")
                    .replace("$__rate_interval", "15s"))
            rules.append({"record": f"dashboard:query:{len(rules)}", "expr": expr})
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard-queries", "rules": rules}]}), encoding="utf-8")
    out = _promtool(promtool, "check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    print(f"promtool parsed {len(rules)} dashboard queries")


# ---- alert logic on synthetic series ---------------------------------------------------------
def _hist(name: str, model: str, replica: str, per_min: dict[str, int]) -> list[dict]:
    """Cumulative bucket series growing by ``per_min`` per minute (le -> count), +Inf from the max."""
    total = max(per_min.values())
    series = [{"series": f'{name}_bucket{{model_name="{model}",replica="{replica}",le="{le}"}}',
               "values": f"0+{n}x40"} for le, n in per_min.items()]
    series.append({"series": f'{name}_bucket{{model_name="{model}",replica="{replica}",le="+Inf"}}',
                   "values": f"0+{total}x40"})
    series.append({"series": f'{name}_count{{model_name="{model}",replica="{replica}"}}', "values": f"0+{total}x40"})
    return series


def _series(name: str, model: str, values: str, replica: str = "0", **labels: str) -> dict:
    extra = "".join(f',{k}="{v}"' for k, v in labels.items())
    return {"series": f'{name}{{model_name="{model}",replica="{replica}"{extra}}}', "values": values}


def _healthy(model: str) -> list[dict]:
    return [
        *_hist("layerscope_time_to_first_token_seconds", model, "gateway", {"0.1": 10, "2.5": 10}),
        *_hist("layerscope_time_per_output_token_seconds", model, "gateway", {"0.05": 10, "0.1": 10}),
        *_hist("layerscope_e2e_request_latency_seconds", model, "gateway", {"1.0": 10, "20.0": 10}),
        _series("layerscope_request_success_total", model, "0+10x40", finished_reason="stop"),
        _series("layerscope_kv_cache_usage_perc", model, "0.5x40"),
        _series("layerscope_num_preemptions_total", model, "0x40"),
        _series("layerscope_num_requests_waiting", model, "2x40"),
        _series("layerscope_gateway_queue_length", model, "1x40", replica="gateway"),
    ]


def test_alerts_fire_on_synthetic_series(promtool, tmp_path: Path):
    rules_path = tmp_path / RULES_FILE
    rules_path.write_text(render_rules(RULES), encoding="utf-8")
    series = _healthy("healthy")
    # one model per alert, healthy except for what that alert watches
    slow = "LayerscopeTTFTP99High"
    series += [s for s in _healthy(slow) if "first_token" not in s["series"]]
    series += _hist("layerscope_time_to_first_token_seconds", slow, "gateway", {"2.5": 0, "5.0": 10})
    # the engines' own view of TTFT is fast for this model: the SLO reads the gateway's view
    series += _hist("layerscope_time_to_first_token_seconds", slow, "0", {"0.1": 10, "2.5": 10})
    slow_tpot = "LayerscopeTPOTP99High"
    series += [s for s in _healthy(slow_tpot) if "per_output" not in s["series"]]
    series += _hist("layerscope_time_per_output_token_seconds", slow_tpot, "gateway", {"0.1": 0, "0.15": 10})
    errs = "LayerscopeErrorRatioHigh"
    series += _healthy(errs) + [_series("layerscope_request_errors_total", errs, "0+1x40", replica="gateway",
                                        reason="invalid")]
    full = "LayerscopeKVCacheNearlyFull"
    series += [s for s in _healthy(full) if "kv_cache" not in s["series"]]
    series.append(_series("layerscope_kv_cache_usage_perc", full, f"{min(1.0, KV_USAGE_MAX + 0.04)}x40"))
    pre = "LayerscopeKVCacheExhausted"
    series += [s for s in _healthy(pre) if "preemptions" not in s["series"]]
    series.append(_series("layerscope_num_preemptions_total", pre, "0+3x40"))
    eq = "LayerscopeEngineQueueGrowing"
    series += [s for s in _healthy(eq) if "requests_waiting" not in s["series"]]
    series.append(_series("layerscope_num_requests_waiting", eq, f"{QUEUE_MIN}+1x40"))
    gq = "LayerscopeGatewayQueueGrowing"
    series += [s for s in _healthy(gq) if "gateway_queue" not in s["series"]]
    series.append(_series("layerscope_gateway_queue_length", gq, f"{QUEUE_MIN}+1x40", replica="gateway"))

    fired = [slow, slow_tpot, errs, full, pre, eq, gq]
    tests = {
        "rule_files": [RULES_FILE],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": series,
            "promql_expr_test": [
                {"expr": 'count by (alertname, model_name) (ALERTS{alertstate="firing"})', "eval_time": "30m",
                 "exp_samples": [{"labels": f'{{alertname="{a}",model_name="{a}"}}', "value": 1} for a in fired]},
                # the error ratio is 0, not absent, for a model without errors
                {"expr": 'model_name:layerscope_request_errors:ratio_rate5m{model_name="healthy"}',
                 "eval_time": "30m", "exp_samples": [{"labels": 'model_name:layerscope_request_errors:ratio_rate5m'
                                                                '{model_name="healthy"}', "value": 0}]},
                # 1 error a minute against 10 successes: 1/11
                {"expr": 'round(model_name:layerscope_request_errors:ratio_rate5m{model_name="LayerscopeErrorRatioHigh"}'
                         ', 0.001)',
                 "eval_time": "30m", "exp_samples": [{"labels": '{model_name="LayerscopeErrorRatioHigh"}',
                                                      "value": 0.091}]},
            ],
        }],
    }
    test_path = tmp_path / "rules_test.yml"
    test_path.write_text(yaml.safe_dump(tests, sort_keys=False), encoding="utf-8")
    out = _promtool(promtool, "test", "rules", test_path.name, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
