"""The generated alert rules carry the layerscope commands for the alert's window, and those
commands parse with layerscope's own command line once Prometheus fills the template."""

from __future__ import annotations

import shlex

from layerscope.cli import _register_optional, build_parser
from layerscope.dashboards.rules import AT, build_rules


def _filled(cmd: str) -> str:
    return (cmd.replace("{{ $externalURL }}", "http://prom.example:9090").replace(AT, "1796400000")
            .replace("{{ $labels.model_name }}", "tiny").replace("{{ $labels.replica }}", "1"))


def test_every_alert_has_a_diagnose_command_that_parses():
    _register_optional()
    parser = build_parser()
    alerts = [r for g in build_rules()["groups"] for r in g["rules"] if "alert" in r]
    assert alerts
    for a in alerts:
        cmd = _filled(a["annotations"]["diagnose"])
        assert "{{" not in cmd, cmd
        args = parser.parse_args(shlex.split(cmd)[1:])
        assert (args.prometheus, args.around, args.at, args.by) == ("http://prom.example:9090", "1h", "1796400000",
                                                                      "replica")
        assert args.selector.startswith('{model_name="tiny"')
        assert args.runs == []
    per_replica = [a for a in alerts if "replica" in a["expr"] and "fleet" not in a["annotations"]]
    assert {a["alert"] for a in per_replica} >= {"LayerscopeKVCacheNearlyFull", "LayerscopeKVCacheExhausted"}
    fleet = [a for a in alerts if "fleet" in a["annotations"]]
    assert fleet and all(parser.parse_args(shlex.split(_filled(a["annotations"]["fleet"]))[1:]).last
                         == "1h" for a in fleet)
