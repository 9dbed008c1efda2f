"""The chart's rendered manifests stay as recorded (tests/assets/chart-snapshot.json): a restructure of the
templates changes no value of what Helm renders, for the chart's values and every overlay, in both modes."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import chart_snapshot  # noqa: E402


def test_every_rendered_file_is_as_recorded():
    recorded = json.loads(chart_snapshot.SNAPSHOT.read_text(encoding="utf-8"))
    current = chart_snapshot.digests(chart_snapshot.render_all(chart_snapshot.CHART))
    assert len(current) >= 100  # 6 value sets x 2 modes x the chart's documents
    assert chart_snapshot.changes(recorded, current) == [], \
        "the rendered chart changed: `python scripts/chart_snapshot.py --diff HEAD` shows how, `--write` records it"


def test_a_changed_template_is_named(tmp_path):
    chart = shutil.copytree(chart_snapshot.CHART, tmp_path / "sapd")
    stages = chart / "templates" / "stages" / "_train.tpl"
    text = stages.read_text(encoding="utf-8")
    old = "  clusterIP: None\n"
    assert text.count(old) == 1
    stages.write_text(text.replace(old, "  clusterIP: None\n  sessionAffinity: ClientIP\n"), encoding="utf-8")
    recorded = json.loads(chart_snapshot.SNAPSHOT.read_text(encoding="utf-8"))
    found = chart_snapshot.changes(recorded, chart_snapshot.digests(chart_snapshot.render_all(chart)))
    assert "changed: base-manual/NOTES.txt" not in found
    assert "changed: base-manual/Service/sapd-test-train" in found
    # the Service and, in pipeline mode, the driver's copy of it in the stage templates: nothing else
    assert {line.split("/", 1)[1] for line in found} == {"Service/sapd-test-train",
                                                         "ConfigMap/sapd-test-pipeline-templates"}, found
    assert all(line.startswith("changed: ") for line in found)
