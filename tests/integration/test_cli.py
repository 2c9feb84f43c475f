"""The `preemptor` command: replay-events, plan and demo, as a user runs them."""

from __future__ import annotations

import json

import pytest

from eventfiles import EVENTS_DIR, all_event_files

from preemptor_tools.cli import main


def test_replay_events_prints_one_verdict_per_file(capsys):
    files = all_event_files()
    assert main(["replay-events", *map(str, files)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    verdicts, summary = lines[:-1], lines[-1]
    assert len(verdicts) == len(files)
    for path, line in zip(files, verdicts):
        name, outcome, reason = line.split(": ", 2)
        assert name == path.name and outcome in {"accepted", "ignored", "rejected", "duplicate"} and reason
        if path.parent.name == "malformed":
            assert outcome == "rejected" and reason.startswith("invalid-json")
    assert summary.endswith("duplicate") and "rejected" in summary


def test_replay_of_a_submission_accepts_it(capsys):
    main(["replay-events", str(EVENTS_DIR / "preemptor" / "job-submitted-sagemaker.json")])
    assert "job-submitted-sagemaker.json: accepted: job-submitted" in capsys.readouterr().out


def test_plan_prints_the_decision_for_a_snapshot(tmp_path, capsys):
    snapshot = {
        "now": 10000,
        "pools": [{"name": "p5", "gpus": 64}],
        "running": [
            {"name": "a", "team": "t1", "priority": 50, "pool": "p5", "gpus": 32, "started_at": 1000, "last_checkpoint_at": 9990},
            {"name": "b", "team": "t1", "priority": 50, "pool": "p5", "gpus": 32, "started_at": 1000, "last_checkpoint_at": 5000},
        ],
        "pending": [{"name": "x", "team": "t2", "priority": 1000, "pool": "p5", "gpus": 32, "submitted_at": 9900}],
    }
    path = tmp_path / "snapshot.json"
    path.write_text(json.dumps(snapshot))
    assert main(["plan", "--snapshot", str(path)]) == 0
    decision = json.loads(capsys.readouterr().out)
    assert decision["admit"] == []
    assert [(p["victim"], p["preemptor"]) for p in decision["preempt"]] == [("a", "x")]
    assert decision["preempt"][0]["reason"]


def test_demo_writes_the_report(tmp_path, capsys):
    report = tmp_path / "out" / "report.json"
    assert main(["demo", "--quiet", "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert {j["name"]: j["state"] for j in data["jobs"]} == {"experiment": "Completed", "production-finetune": "Completed"}
    assert set(data) >= {"jobs", "preemptions", "relaunches", "lost_gpu_seconds", "stops_without_fresh_checkpoint"}
    assert "Summary" in capsys.readouterr().out


# -- a wrong file: one line naming the file and the field, exit 2, no traceback -----------

BAD_FILES = {
    "scenario-missing-field": (
        "scenario.yaml", "pools: [{name: p5, service: sagemaker}]\njobs: []\n",
        ["demo", "--scenario", "{f}"], "scenario: field pools.0: pool 'p5' needs 'instances' or 'gpus'",
    ),
    "scenario-not-yaml": ("scenario.yaml", "pools: [\n", ["demo", "--scenario", "{f}"], "not valid YAML at line 2"),
    "scenario-absent": (None, None, ["demo", "--scenario", "{f}"], "cannot read the scenario: No such file"),
    "snapshot-wrong-type": ("snap.json", '{"now": "soon", "pools": [], "running": [], "pending": []}', ["plan", "--snapshot", "{f}"], "snapshot: field now:"),
    "snapshot-not-json": ("snap.json", '{"now": 1,', ["plan", "--snapshot", "{f}"], "not valid JSON at line 1"),
    "snapshot-not-an-object": ("snap.json", "[1, 2]", ["plan", "--snapshot", "{f}"], "snapshot: the document must be an object"),
    "policy-wrong-type": ("policy.json", '{"tiers": "x"}', ["explain", "j", "--snapshot", "{snapshot}", "--policy", "{f}"], "policy: field tiers:"),
    "history-not-a-list": ("history.json", '{"kind": "x"}', ["explain", "j", "--snapshot", "{snapshot}", "--history", "{f}"], "history: the decision log must be a list"),
    "request-missing-team": ("job.json", '{"name": "j", "priority": 50, "pool": "p5", "service": "sagemaker", "request": {}}', ["submit", "--file", "{f}", "--bus", "b"], "job request: field team:"),
    "replay-policy": ("policy.json", '{"teams": 3}', ["replay-events", "--policy", "{f}", str(EVENTS_DIR)], "policy: field teams:"),
    "trace-columns": ("trace.csv", "job_id,submit_s\n1,2\n", ["sim", "--trace", "{f}", "--gpus", "8", "--policy", "fifo"], "trace: missing column(s)"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_wrong_file_gets_one_line_naming_the_file_and_the_field(tmp_path, capsys, case):
    # Given a file a user hands the CLI that is wrong in one way
    name, text, argv, expected = BAD_FILES[case]
    path = tmp_path / (name or "absent.yaml")
    if text is not None:
        path.write_text(text)
    snapshot = tmp_path / "good-snapshot.json"
    snapshot.write_text(json.dumps({"now": 1, "pools": [{"name": "p5", "gpus": 8}], "running": [], "pending": []}))
    # When the command runs
    code = main([a.format(f=path, snapshot=snapshot) for a in argv])
    # Then it exits 2 with one line on stderr that names the file and what is wrong
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith(f"preemptor: {path}: ") and expected in err[0], err[0]
