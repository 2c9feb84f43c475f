"""The `preemptor` command: replay-events, plan and demo, as a user runs them."""

from __future__ import annotations

import json

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
