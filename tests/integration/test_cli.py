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
    # (a short story: the default one is replayed by tests/workflows/test_scenarios.py)
    scenario = tmp_path / "short.yaml"
    scenario.write_text(
        "pools: [{name: p5, service: sagemaker, instance_type: ml.p5.48xlarge, instances: 2, gpus_per_instance: 8}]\n"
        "jobs:\n"
        "  - {name: experiment, team: research, priority: low, pool: p5, instances: 2, submit_at: 0, duration: 900, checkpoint_every: 300}\n"
        "  - {name: production-finetune, team: production, priority: critical, pool: p5, instances: 2, submit_at: 600, duration: 600}\n"
    )
    report = tmp_path / "out" / "report.json"
    assert main(["demo", "--quiet", "--scenario", str(scenario), "--report", str(report)]) == 0
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
    "scenario-two-pools-one-name": (
        "scenario.yaml", "pools: [{name: p5, service: batch, gpus: 8}, {name: p5, service: batch, gpus: 16}]\njobs: []\n",
        ["demo", "--scenario", "{f}"], "scenario: field (the whole document): one pool per name; repeated: p5",
    ),
    # A fallback onto another pool's own: that pool's capacity taken by runs it may not stop
    "scenario-fallback-onto-another-pools-queue": (
        "scenario.yaml",
        "pools: [{name: a, service: batch, gpus: 8, job_queue: qa, fallback_job_queues: [qb]}, {name: b, service: batch, gpus: 8, job_queue: qb}]\njobs: []\n",
        ["demo", "--scenario", "{f}"], "scenario: field (the whole document): pool 'a' falls back to job queue qb, which is pool 'b''s own",
    ),
    "scenario-not-yaml": ("scenario.yaml", "pools: [\n", ["demo", "--scenario", "{f}"], "not valid YAML at line 2"),
    "scenario-absent": (None, None, ["demo", "--scenario", "{f}"], "cannot read the scenario: No such file"),
    # A key given twice: YAML and JSON readers keep the last, silently dropping the first
    "scenario-key-twice": (
        "scenario.yaml", "pools: [{name: p5, service: batch, gpus: 8}]\njobs: []\nhorizon: 60\nhorizon: 600\n",
        ["demo", "--scenario", "{f}"], "not valid YAML at line 4, column 1: the key 'horizon' is given twice",
    ),
    "policy-key-twice": (
        "policy.json", '{"aging": {"rate_per_hour": 1}, "aging": {"rate_per_hour": 50}}',
        ["plan", "--snapshot", "{snapshot}", "--policy", "{f}"], "the policy gives the key 'aging' twice in one object",
    ),
    "snapshot-wrong-type": ("snap.json", '{"now": "soon", "pools": [], "running": [], "pending": []}', ["plan", "--snapshot", "{f}"], "snapshot: field now:"),
    "snapshot-job-in-no-pool": (
        "snap.json", '{"now": 1, "pools": [{"name": "p5", "gpus": 8}], "pending": [{"name": "j", "priority": 50, "pool": "p4", "gpus": 8, "submitted_at": 0}]}',
        ["plan", "--snapshot", "{f}"], "snapshot: field pending.0.pool: job 'j' is in pool 'p4', which pools does not list",
    ),
    "snapshot-not-json": ("snap.json", '{"now": 1,', ["plan", "--snapshot", "{f}"], "not valid JSON at line 1"),
    "snapshot-not-an-object": ("snap.json", "[1, 2]", ["plan", "--snapshot", "{f}"], "snapshot: the document must be an object"),
    "policy-wrong-type": ("policy.json", '{"tiers": "x"}', ["explain", "j", "--snapshot", "{snapshot}", "--policy", "{f}"], "policy: field tiers:"),
    # What explain formats is checked: these were a ValueError from inside a sentence, or a KeyError
    "history-figure-not-a-number": (
        "history.json", '[{"at": 5, "kind": "preemption-started", "extra": {"checkpoint_age_s": "old"}}]',
        ["explain", "j", "--snapshot", "{snapshot}", "--history", "{f}"], "history: field 0.extra.checkpoint_age_s: Input should be a valid number",
    ),
    "history-fresh-not-a-bool": (
        "history.json", '[{"at": 5, "kind": "preemption-started"}, {"at": 9, "kind": "requeued", "extra": {"fresh_checkpoint": "maybe"}}]',
        ["explain", "j", "--snapshot", "{snapshot}", "--history", "{f}"], "history: field 1.extra.fresh_checkpoint: Input should be a valid boolean",
    ),
    "history-infinite-time": (
        "history.json", '[{"at": 1e999, "kind": "requeued"}]',
        ["explain", "j", "--snapshot", "{snapshot}", "--history", "{f}"], "history: field 0.at: Input should be a finite number",
    ),
    "history-no-kind": ("history.json", '[{"at": 5}]', ["explain", "j", "--snapshot", "{snapshot}", "--history", "{f}"], "history: field 0.kind: Field required"),
    "history-not-a-list": ("history.json", '{"kind": "x"}', ["explain", "j", "--snapshot", "{snapshot}", "--history", "{f}"], "history: the decision log must be a list"),
    "request-missing-team": ("job.json", '{"name": "j", "priority": 50, "pool": "p5", "service": "sagemaker", "request": {}}', ["submit", "--file", "{f}", "--bus", "b"], "job request: field team:"),
    "replay-policy": ("policy.json", '{"teams": 3}', ["replay-events", "--policy", "{f}", str(EVENTS_DIR)], "policy: field teams:"),
    "trace-columns": ("trace.csv", "job_id,submit_s\n1,2\n", ["sim", "--trace", "{f}", "--gpus", "8", "--policy", "fifo"], "trace: missing column(s)"),
    # JSON's 1e999 is valid JSON and reads as an infinity; Python's reader also takes NaN. A
    # plan at time NaN, or aging at an infinite rate (every plan an OverflowError), is refused.
    "snapshot-nan-clock": ("snap.json", '{"now": NaN, "pools": [], "running": [], "pending": []}', ["plan", "--snapshot", "{f}"], "snapshot: field now: Input should be a finite number"),
    "snapshot-infinite-submission": (
        "snap.json", '{"now": 1, "pools": [{"name": "p5", "gpus": 8}], "pending": [{"name": "j", "priority": 50, "pool": "p5", "gpus": 8, "submitted_at": -1e999}]}',
        ["plan", "--snapshot", "{f}"], "snapshot: field pending.0.submitted_at: Input should be a finite number",
    ),
    "policy-infinite-aging": (
        "policy.json", '{"aging": {"rate_per_hour": 1e999}}', ["plan", "--snapshot", "{snapshot}", "--policy", "{f}"], "policy: field aging.rate_per_hour: Input should be a finite number",
    ),
    "policy-team-role-not-an-arn": (
        "policy.json", '{"teams": {"nlp": {"training_role_arn": "nlp-training"}}}', ["plan", "--snapshot", "{snapshot}", "--policy", "{f}"],
        "policy: field teams.nlp.training_role_arn: expected an IAM role ARN",
    ),
    "scenario-infinite-time": (
        "scenario.yaml", "pools: [{name: p5, service: sagemaker, instance_type: ml.p5.48xlarge, instances: 1}]\n"
        "jobs: [{name: j, team: t, priority: 50, pool: p5, gpus: 8, submit_at: .inf, duration: 60}]\n",
        ["demo", "--scenario", "{f}"], "scenario: field jobs.0.submit_at: Input should be a finite number",
    ),
    "trace-nan-time": (
        "trace.csv", "job_id,submit_s,duration_s,gpus,team,priority\na,0,60,1,t,50\nb,nan,60,1,t,50\n",
        ["sim", "--trace", "{f}", "--gpus", "8", "--policy", "fifo"], "trace: 3: submit_s must be finite seconds in 0..3153600000, got 'nan'",
    ),
    "trace-submitted-in-1e19-s": (
        "trace.csv", "job_id,submit_s,duration_s,gpus,team,priority\na,1e19,60,1,t,50\n",
        ["sim", "--trace", "{f}", "--gpus", "8", "--policy", "fifo"], "trace: 2: submit_s must be finite seconds in 0..3153600000, got '1e19'",
    ),
    "trace-endless-job": (
        "trace.csv", "job_id,submit_s,duration_s,gpus,team,priority\na,0,inf,1,t,50\n",
        ["sim", "--trace", "{f}", "--gpus", "8", "--policy", "fifo"], "trace: 2: duration_s must be finite seconds in 0..3153600000, got 'inf'",
    ),
}


def test_a_trace_and_a_policy_written_with_a_byte_order_mark_are_read(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_bytes(b"\xef\xbb\xbfjob_id,submit_s,duration_s,gpus,team,priority\na,0,60,1,t,50\n")
    assert main(["sim", "--trace", str(trace), "--gpus", "8", "--policy", "fifo"]) == 0
    snapshot, policy = tmp_path / "snap.json", tmp_path / "policy.json"
    snapshot.write_text(json.dumps({"now": 1, "pools": [{"name": "p5", "gpus": 8}], "running": [], "pending": []}))
    policy.write_bytes(b"\xef\xbb\xbf" + json.dumps({"aging": {"rate_per_hour": 1}}).encode())
    assert main(["plan", "--snapshot", str(snapshot), "--policy", str(policy)]) == 0


def test_a_trace_that_is_not_utf8_is_refused_in_one_line(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_bytes(b"job_id,submit_s,duration_s,gpus,team,priority\na,0,60,1,\xe9quipe,50\n")
    assert main(["sim", "--trace", str(trace), "--gpus", "8", "--policy", "fifo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(trace) in err[0] and "not UTF-8" in err[0], err


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


def test_a_decision_log_as_the_history_command_prints_it_is_explained(tmp_path, capsys):
    # Given a log in the shape `preemptor history JOB --json` prints (missing fields as null)
    log = [
        {"at": 78000.0, "job": "a", "kind": "preemption-started", "reason": "lower-priority-victim", "detail": None,
         "extra": {"preemptor": "x", "checkpoint_age_s": 900.0, "lost_gpu_seconds": 14400.0, "note": "kept"}},
        {"at": 78100.0, "job": "a", "kind": "requeued", "reason": None, "detail": None, "extra": {"fresh_checkpoint": True, "lost_gpu_seconds": 1920}},
    ]
    (tmp_path / "h.json").write_text(json.dumps(log))
    (tmp_path / "s.json").write_text(json.dumps({"now": 1, "pools": [{"name": "p5", "gpus": 8}], "running": [], "pending": []}))
    # When a job is explained with it, Then its preemption is told with the log's figures
    assert main(["explain", "a", "--snapshot", str(tmp_path / "s.json"), "--history", str(tmp_path / "h.json")]) == 0
    out = capsys.readouterr().out
    assert "preemption 1 at 78000: by x under lower-priority; checkpoint age 900 s, 1920 GPU-seconds lost, stopped after a fresh checkpoint" in out, out


# -- the operator's commands without a stack to talk to: exit codes, one line on stderr -------
def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_local_command_with_no_local_stack_running(tmp_path, capsys):
    state = tmp_path / "local.json"
    # `local down` and `local status` find nothing: not found
    assert main(["local", "down", "--state-file", str(state)]) == 1
    assert main(["local", "status", "--state-file", str(state)]) == 1
    # a query for the local stack cannot reach it: an AWS-side error
    assert main(["queue", "--local", "--state-file", str(state)]) == 3
    assert "no local stack is running" in _one_line(capsys.readouterr().err.splitlines()[-1])


def test_a_local_stack_that_does_not_answer_is_an_aws_error_in_one_line(tmp_path, capsys):
    # Given a state file naming a live process and a port nobody listens on
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = tmp_path / "local.json"
    state.write_text(json.dumps({
        "pid": os.getpid(), "port": port, "region": "us-east-1", "stack": "preemptor",
        "outputs": {"JobsTableName": "preemptor-JobsTable", "SubmissionBusName": "preemptor-SubmissionBus"},
        "parameters": {"PoolsConfig": '[{"name": "p5", "gpus": 8}]'},
        "speed": 1.0, "sim_now": 0.0, "real_at": 0.0, "started_at": 0.0, "stops_at": 0.0,
    }))
    # When the operator asks for the queue, Then: exit 3, one line naming the failure
    assert main(["queue", "--local", "--state-file", str(state)]) == 3
    assert _one_line(capsys.readouterr().err).startswith("preemptor: AWS error: Could not connect to the endpoint URL")


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["queue"], "which stack?"),
        (["history", "--limit", "0", "--local"], "history: argument --limit: must be an integer >= 1, got '0'"),
        (["local", "up", "--speed", "0"], "local up: argument --speed: must be a finite number > 0, got '0'"),
        (["local", "up", "--speed", "inf"], "argument --speed: must be a finite number > 0, got 'inf'"),
        (["local", "up", "--port", "70000"], "argument --port: must be an integer >= 0 and <= 65535, got '70000'"),
        (["submit", "--file", "job.json", "--bus", "b", "--wait", "--timeout", "nan"], "argument --timeout: must be a finite number > 0, got 'nan'"),
        (["nosuch"], "argument command: invalid choice: 'nosuch'"),
    ],
    ids=["no-stack", "history-limit", "local-speed", "local-speed-infinite", "local-port", "wait-timeout-nan", "unknown-command"],
)
def test_bad_operator_input_exits_2(monkeypatch, capsys, argv, expected):
    monkeypatch.delenv("PREEMPTOR_STACK", raising=False)
    assert main(argv) == 2
    assert expected in _one_line(capsys.readouterr().err)


SIM = ["sim", "--trace", "trace.csv", "--policy", "fifo"]


@pytest.mark.parametrize(
    "options, expected",
    [
        (["--gpus", "0"], "argument --gpus: must be an integer >= 1, got '0'"),
        (["--gpus", "8", "--stop-grace-s", "-5"], "argument --stop-grace-s: must be a finite number >= 0, got '-5'"),
        (["--gpus", "8", "--checkpoint-write-s", "inf"], "argument --checkpoint-write-s: must be a finite number >= 0, got 'inf'"),
        (["--gpus", "8", "--restart-overhead-s", "nan"], "argument --restart-overhead-s: must be a finite number >= 0, got 'nan'"),
        (["--gpus", "8", "--relaunch-delay-s", "inf"], "argument --relaunch-delay-s: must be a finite number >= 0, got 'inf'"),
        (["--gpus", "8", "--cooperative-fraction", "nan"], "argument --cooperative-fraction: must be a finite number >= 0 and <= 1, got 'nan'"),
        (["--gpus", "8", "--cooperative-fraction", "1.5"], "argument --cooperative-fraction: must be a finite number >= 0 and <= 1, got '1.5'"),
        (["--gpus", "8", "--checkpoint-interval", "abc"], "argument --checkpoint-interval: must be MIN:MAX or one value in seconds, got 'abc'"),
        (["--gpus", "8", "--checkpoint-interval", "600:inf"], "argument --checkpoint-interval: must be finite seconds with 0 < MIN <= MAX, got '600:inf'"),
        (["--gpus", "8", "--checkpoint-interval", "3600:600"], "argument --checkpoint-interval: must be finite seconds with 0 < MIN <= MAX, got '3600:600'"),
        (["--gpus", "8", "--pending-window", "0"], "argument --pending-window: must be an integer >= 1, got '0'"),
        (["--gpus", "8", "--start-s", "nan"], "argument --start-s: must be a finite number, got 'nan'"),
        ([], "sim: the following arguments are required: --gpus"),
    ],
    ids=[
        "no-gpus", "negative-grace", "endless-write", "nan-restart", "endless-relaunch", "nan-cooperative",
        "cooperative-above-one", "interval-not-a-number", "interval-endless", "interval-reversed", "no-window", "nan-start", "missing",
    ],
)
def test_a_simulator_option_out_of_range_is_refused_in_one_line_before_the_replay(tmp_path, monkeypatch, capsys, options, expected):
    # Given a good trace, and an option NaN, infinite, out of range or missing (a NaN or an
    # infinite time used to make the replay run forever; the others a traceback)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trace.csv").write_text("job_id,submit_s,duration_s,gpus,team,priority\na,0,60,1,t,50\n")
    # When the replay is asked for, Then: exit 2, one line naming the option and the value
    assert main([*SIM, *options]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("preemptor: sim: ") and expected in line, line
    # and the same trace with good options replays
    assert main([*SIM, "--gpus", "8", "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["jobs"] == 1


def test_a_simulator_policy_that_is_neither_a_name_nor_a_file_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trace.csv").write_text("job_id,submit_s,duration_s,gpus,team,priority\na,0,60,1,t,50\n")
    assert main(["sim", "--trace", "trace.csv", "--gpus", "8", "--policy", "nosuch"]) == 2
    assert "--policy: 'nosuch' is neither a policy" in _one_line(capsys.readouterr().err)


def test_tables_are_coloured_only_for_a_terminal_without_no_color():
    import io

    from preemptor_tools.tables import Painter, render_queue, use_colour

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert use_colour(Terminal(), env={}) and not use_colour(io.StringIO(), env={})
    assert not use_colour(Terminal(), env={"NO_COLOR": "1"}) and use_colour(Terminal(), env={"NO_COLOR": ""})
    data = {"pools": [{"pool": "p5", "capacity_gpus": 8, "used_gpus": 8, "drained": True, "drained_note": "upgrade", "jobs": [
        {"rank": None, "job": "a", "team": "t", "priority": 50, "gpus": 8, "state": "RUNNING", "wait_s": 3.0,
         "running_s": 4000.0, "checkpoint_age_s": 65.0, "waiting_reason": None, "preempted_by": None},
    ]}]}
    plain, coloured = render_queue(data, Painter(False)), render_queue(data, Painter(True))
    assert "\x1b[" not in plain and "\x1b[32mRUNNING\x1b[0m" in coloured
    assert "DRAINED (upgrade)" in plain and "running 1h06m, checkpoint 1m05s ago" in plain
    # columns line up whatever the colour
    assert [len(line) for line in plain.splitlines()[1:]] == [
        len(line.replace("\x1b[32m", "").replace("\x1b[0m", "").replace("\x1b[1m", "").replace("\x1b[1;31m", ""))
        for line in coloured.splitlines()[1:]
    ]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["priority", "sweep", "high", "--note", "x" * 501], "priority: argument --note: must be at most 500 characters, got 501"),
        (["priority", "sweep", "high", "--note", "two\nlines"], "priority: argument --note: must be one line of printable text"),
        (["drain", "p5", "--note", "bell\a"], "drain: argument --note: must be one line of printable text"),
    ],
    ids=["priority-note-too-long", "priority-note-two-lines", "drain-note-control-character"],
)
def test_an_operator_note_that_would_not_fit_a_log_line_is_refused_before_any_aws_call(capsys, argv, expected):
    # Given no stack at all: the note is refused before the CLI looks for one
    assert main([*argv, "--stack", "nowhere"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("preemptor: ") and expected in line, line


@pytest.mark.parametrize("changed", [True, False], ids=["lowered", "asked again"])
def test_priority_says_which_stops_a_lowering_called_off(monkeypatch, capsys, changed):
    from preemptor_tools import cli, ops

    # Given the operator's lowering of a waiting job that called off the stop of its victim
    answer = {
        "job": "prod", "from": 500 if changed else 50, "to": 50, "state": "PENDING", "note": None, "changed": changed,
        "at": 1.0 if changed else None, "schedule_execution": "arn:cycle" if changed else None,
        "preemption_called_off": False, "victims_spared": ["sweep"],
    }
    monkeypatch.setattr(cli, "_target", lambda args: None)
    monkeypatch.setattr(ops, "set_priority", lambda target, job, priority, note: answer)
    # When it is told in text
    assert main(["priority", "prod", "low"]) == 0
    # Then its one line names the job no longer stopped
    [line] = capsys.readouterr().out.strip().splitlines()
    assert line.startswith("prod: priority ") and "no longer stops sweep (no stop was sent)" in line
