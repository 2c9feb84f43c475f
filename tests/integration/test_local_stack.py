"""The operator's CLI against `preemptor local up`, run as a user runs it: one local stack in a
subprocess on a free port (shared by the module's tests, which tell one story in order), and
the CLI talking to it over HTTP, as it talks to AWS.

The story on the local stack's pools (p5: 32 GPUs, quotas research 16 / production 16):
research fills p5 (24 + 8 GPUs, 16 of them borrowed), production's critical job reclaims
the borrowed GPUs (a preemption, explained), the operator drains p5 and cancels the critical
job: the preempted job stays pending for the drain, then runs once p5 is undrained.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest

from preemptor_tools.cli import main
from preemptor_tools.local.state import FAKE_CREDENTIALS, LocalStackError, LocalState, stop
from preemptor_tools.paths import REPO_ROOT

pytestmark = pytest.mark.xdist_group("local_stack")

JOBS = REPO_ROOT / "examples" / "jobs"
SPEED = "120"  # simulated seconds per real second: a SageMaker start (120 s) takes one
BOUND_S = 60.0  # real seconds any step may take before the test gives up (a bound, not a measure)


@dataclass
class Local:
    state_file: Path
    process: subprocess.Popen
    logs: Path

    def state(self) -> LocalState:
        return LocalState.read(self.state_file)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    root = tmp_path_factory.mktemp("local-stack")
    state_file = root / "local.json"
    env = {k: v for k, v in os.environ.items() if k != "PREEMPTOR_LOCAL_STATE"}
    with open(root / "out.log", "w") as out, open(root / "err.log", "w") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "preemptor_tools.cli", "local", "up", "--port", "0", "--speed", SPEED,
             "--max-lifetime", "300", "--state-file", str(state_file)],
            stdout=out, stderr=err, cwd=root, env=env,
        )
        try:
            deadline = time.monotonic() + 90
            while not state_file.exists():
                if process.poll() is not None:
                    pytest.fail(f"local up exited {process.returncode}: {(root / 'err.log').read_text()}")
                if time.monotonic() > deadline:
                    pytest.fail("local up wrote no state file within 90 s")
                time.sleep(0.1)
            yield Local(state_file, process, root)
        finally:
            with contextlib.suppress(LocalStackError):
                stop(state_file)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def cli(capsys, local: Local, *argv: str) -> tuple[int, object, str]:
    """Run `preemptor ARGV --local --json`; (exit code, parsed stdout, stderr)."""
    capsys.readouterr()
    code = main([*argv, "--local", "--state-file", str(local.state_file), "--json"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def eventually(check, what: str):
    deadline = time.monotonic() + BOUND_S
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {BOUND_S:g} s: {what}")
        time.sleep(0.2)


def status(capsys, local: Local, job: str) -> dict:
    code, view, err = cli(capsys, local, "status", job)
    assert code == 0, err
    return view


def pool(capsys, local: Local, name: str) -> dict:
    code, data, err = cli(capsys, local, "queue")
    assert code == 0, err
    return next(p for p in data["pools"] if p["pool"] == name)


# -- the story ---------------------------------------------------------------------------------
def test_the_local_stack_listens_on_loopback_only_and_says_where(local):
    state = local.state()
    assert state.pid == local.process.pid and state.port > 0
    assert state.endpoint_url == f"http://127.0.0.1:{state.port}"
    assert {"JobsTableName", "SubmissionBusName", "ScheduleStateMachineArn"} <= set(state.outputs)
    # Loopback only: the port answers on 127.0.0.1 and nowhere else
    with socket.create_connection(("127.0.0.1", state.port), timeout=2):
        pass
    with contextlib.suppress(OSError):
        outside = socket.gethostbyname(socket.gethostname())
        if not outside.startswith("127."):
            with pytest.raises(OSError):
                socket.create_connection((outside, state.port), timeout=2).close()


def test_submitted_jobs_run_and_show_in_the_queue(capsys, local):
    # Given the example research jobs, as they are in examples/jobs/
    # When they are submitted and waited for
    code, result, err = cli(capsys, local, "submit", "--file", str(JOBS / "research-pretrain.json"), "--wait")
    assert code == 0, err
    assert result["job"] == "llm-pretrain-7b" and result["status"]["state"] == "RUNNING"
    assert "llm-pretrain-7b: RUNNING" in err  # the progress lines go to stderr beside --json
    code, result, err = cli(capsys, local, "submit", "--file", str(JOBS / "research-ablation.json"), "--wait")
    assert code == 0, err
    # And submitting one of them again is refused in one line before it is sent: the
    # intake would drop it as a duplicate, and `--wait` would follow the first one
    code, result, err = cli(capsys, local, "submit", "--file", str(JOBS / "research-pretrain.json"))
    assert code == 2 and result is None and len(err.strip().splitlines()) == 1 and "duplicate: job 'llm-pretrain-7b' already exists" in err, err
    # Then the queue shows both running in p5, which they fill
    p5 = pool(capsys, local, "p5")
    assert {j["job"]: j["state"] for j in p5["jobs"]} == {"llm-pretrain-7b": "RUNNING", "tokenizer-ablation": "RUNNING"}
    assert p5["used_gpus"] == p5["capacity_gpus"] == 32 and not p5["drained"]
    # And the pools say research runs 16 GPUs above its nominal 16: borrowed
    code, pools, _ = cli(capsys, local, "pools")
    research = next(t for t in pools["pools"][0]["teams"] if t["team"] == "research")
    assert (research["used_gpus"], research["nominal_gpus"], research["borrowed_gpus"]) == (32, 16, 16)


def test_an_event_put_with_plain_boto3_reaches_the_intake(capsys, local):
    # Given a team that talks to the endpoint with boto3, as to AWS (any credentials)
    state = local.state()
    events = boto3.client(
        "events", endpoint_url=state.endpoint_url, region_name=state.region,
        aws_access_key_id="x", aws_secret_access_key="x",
    )
    request = json.loads((JOBS / "batch-eval-sweep.json").read_text())
    # When it puts its submission on the stack's bus itself
    out = events.put_events(Entries=[{
        "Source": "preemptor.platform", "DetailType": "Job Submitted",
        "Detail": json.dumps(request), "EventBusName": state.outputs["SubmissionBusName"],
    }])
    assert out["FailedEntryCount"] == 0
    # Then the intake took it and the Batch pool runs it
    view = eventually(lambda: main_ok_status(capsys, local, "eval-sweep-42"), "eval-sweep-42 running")
    assert view["pool"] == "g5" and view["service"] == "batch"


def test_a_dead_letter_is_redriven_by_the_cli_and_its_job_runs(capsys, local):
    # Given a submission EventBridge could not deliver to the intake (its dead letter: the
    # event, and its target in the message's attributes), and a message that is no dead letter
    state = local.state()
    sqs = boto3.client(
        "sqs", endpoint_url=state.endpoint_url, region_name=state.region,
        aws_access_key_id="x", aws_secret_access_key="x",
    )
    queue = state.outputs["EventsDeadLetterQueueUrl"]
    [intake] = [a for a in state.outputs["RedriveFunctionArns"].split(",") if "Intake" in a]
    request = {**json.loads((JOBS / "batch-eval-sweep.json").read_text()), "name": "eval-sweep-43"}
    event = {
        "version": "0", "id": "0d1e2a3d-redriven", "detail-type": "Job Submitted", "source": "preemptor.platform",
        "account": "123456789012", "time": "2026-12-05T00:00:00Z", "region": state.region, "resources": [],
        "detail": request,
    }
    attributes = {"RULE_ARN": "arn:aws:events:us-east-1:123456789012:rule/submissions", "TARGET_ARN": intake,
                  "ERROR_CODE": "SDK_CLIENT_ERROR", "ERROR_MESSAGE": "Rate Exceeded. (Service: Lambda, Status Code: 429)"}
    sqs.send_message(QueueUrl=queue, MessageBody=json.dumps(event),
                     MessageAttributes={k: {"DataType": "String", "StringValue": v} for k, v in attributes.items()})
    sqs.send_message(QueueUrl=queue, MessageBody="not a dead letter")
    # When the operator lists the queue, then redrives it
    code, listed, err = cli(capsys, local, "redrive", "--dry-run")
    assert code == 6 and [d["event_id"] for d in listed["listed"]] == ["0d1e2a3d-redriven"], err
    assert cli(capsys, local, "status", "eval-sweep-43")[0] == 1  # a dry run hands nothing back
    code, result, err = cli(capsys, local, "redrive")
    # Then the dead letter went back to the intake and its job runs; the other message is
    # refused with its reason, left in the queue, and the exit code says something was left
    assert code == 6, err
    assert [d["event_id"] for d in result["redriven"]] == ["0d1e2a3d-redriven"]
    [refused] = result["refused"]
    assert refused["why"] == "its body is not JSON"
    view = eventually(lambda: main_ok_status(capsys, local, "eval-sweep-43"), "eval-sweep-43 running")
    assert view["pool"] == "g5"
    code, again, _ = cli(capsys, local, "redrive")
    assert again["redriven"] == [] and len(again["refused"]) == 1
    # When the operator discards what the redrive refuses (a dry run discards nothing)
    code, listed, _ = cli(capsys, local, "redrive", "--discard-refused", "--dry-run")
    assert code == 6 and [r["discarded"] for r in listed["refused"]] == [False]
    code, result, err = cli(capsys, local, "redrive", "--discard-refused")
    # Then it is gone, said so, and the queue is empty (its alarm can fire for the next one)
    assert code == 0, err
    assert [(r["why"], r["discarded"]) for r in result["refused"]] == [("its body is not JSON", True)]
    assert sqs.receive_message(QueueUrl=queue, VisibilityTimeout=0).get("Messages", []) == []


def main_ok_status(capsys, local, job):
    code, view, _ = cli(capsys, local, "status", job)
    return view if code == 0 and view["state"] in ("RUNNING", "COMPLETED") else None


def test_a_critical_job_preempts_and_the_preemption_is_explained(capsys, local):
    # When production's critical job arrives in the full pool
    code, result, err = cli(capsys, local, "submit", "--file", str(JOBS / "production-finetune.json"), "--wait")
    # Then it runs, on GPUs reclaimed from research's borrowed ones
    assert code == 0, err
    assert result["status"]["state"] == "RUNNING"
    victim = status(capsys, local, "llm-pretrain-7b")
    assert victim["state"] == "PENDING" and victim["preemptions"] == 1 and victim["incarnation"] == 2
    # And explain names who preempted it, under which rule, and what it cost
    code, answer, err = cli(capsys, local, "explain", "llm-pretrain-7b")
    assert code == 0, err
    [episode] = answer["preemptions"]
    assert episode["preemptor"] == "support-bot-finetune" and episode["rule"]
    assert "support-bot-finetune" in answer["text"]
    # And the decision log has the preemption, in order
    code, entries, _ = cli(capsys, local, "history", "llm-pretrain-7b")
    kinds = [e["kind"] for e in entries]
    assert kinds.index("admitted") < kinds.index("preemption-started") < kinds.index("requeued")
    # And the queue ranks it first among p5's pending jobs
    ranked = [(j["rank"], j["job"]) for j in pool(capsys, local, "p5")["jobs"] if j["state"] == "PENDING"]
    assert ranked == [(1, "llm-pretrain-7b")]


def test_a_drained_pool_admits_nothing_until_undrained(capsys, local):
    # Given p5 drained by the operator
    code, result, err = cli(capsys, local, "drain", "p5", "--note", "maintenance")
    assert code == 0 and result["drained"], err
    # When the critical job is cancelled, freeing what the preempted job needs
    code, result, err = cli(capsys, local, "cancel", "support-bot-finetune", "--wait")
    assert code == 0, err
    assert result["status"]["state"] == "CANCELLED"
    # Then the preempted job still waits, for the drain, and every view says so
    p5 = eventually(
        lambda: (p := pool(capsys, local, "p5"))["jobs"][0].get("waiting_reason") == "pool-drained" and p,
        "llm-pretrain-7b waiting for the drained pool",
    )
    assert p5["drained"] and p5["drained_note"] == "maintenance"
    assert p5["jobs"][0]["job"] == "llm-pretrain-7b" and p5["jobs"][0]["state"] == "PENDING"
    code, pools, _ = cli(capsys, local, "pools")
    assert [p["drained"] for p in pools["pools"]] == [True, False]
    code, answer, _ = cli(capsys, local, "explain", "llm-pretrain-7b")
    assert answer["pool_drained"] and "drained" in answer["text"]
    # When it is undrained
    code, result, err = cli(capsys, local, "undrain", "p5")
    assert code == 0 and result["schedule_execution"], err
    # Then the preempted job runs again, from its checkpoint (its next incarnation)
    view = eventually(
        lambda: (v := status(capsys, local, "llm-pretrain-7b"))["state"] == "RUNNING" and v, "llm-pretrain-7b running"
    )
    assert view["run"] == "llm-pretrain-7b-r2"


def test_the_operators_word_that_a_quota_was_raised_is_refused_in_one_line_where_none_is_noted(capsys, local):
    # A pool planned at its size: nothing to say it of (exit 2); a pool the stack lacks (exit 1)
    code, out, err = cli(capsys, local, "quota-raised", "p5")
    assert code == 2 and out is None and len(err.strip().splitlines()) == 1 and "no quota noted" in err
    code, out, err = cli(capsys, local, "quota-raised", "p9")
    assert code == 1 and out is None and len(err.strip().splitlines()) == 1 and "no such pool" in err


def test_the_operator_gives_a_job_another_priority_and_the_decision_log_tells_it(capsys, local):
    # When the operator raises research's running medium job to high, with a note
    code, result, err = cli(capsys, local, "priority", "tokenizer-ablation", "high", "--note", "demo tomorrow")
    # Then it is high at once, a cycle of p5 started, and its decision log says who and why
    assert code == 0, err
    assert (result["changed"], result["from"], result["to"], result["state"]) == (True, 200, 500, "RUNNING")
    assert result["schedule_execution"]
    assert status(capsys, local, "tokenizer-ablation")["priority"] == 500
    code, entries, _ = cli(capsys, local, "history", "tokenizer-ablation")
    [line] = [e for e in entries if e["kind"] == "priority-changed"]
    assert line["reason"] == "operator" and "demo tomorrow" in line["detail"]
    # And a priority the stack does not know is refused in one line, exit 2, nothing changed
    code, out, err = cli(capsys, local, "priority", "tokenizer-ablation", "urgent")
    assert code == 2 and out is None
    assert len(err.strip().splitlines()) == 1 and "bad-priority" in err
    assert status(capsys, local, "tokenizer-ablation")["priority"] == 500


def test_a_team_lowers_its_own_job_and_may_not_raise_it(capsys, local):
    # When research lowers its job (raised to high by the operator above) to low, as its team
    code, result, err = cli(capsys, local, "lower", "tokenizer-ablation", "low", "--note", "after the demo")
    assert code == 0 and result["event_id"] and (result["from"], result["to"]) == (500, 50), err
    # Then the intake lowers it, and the decision log says the team did, and why
    eventually(lambda: status(capsys, local, "tokenizer-ablation")["priority"] == 50, "tokenizer-ablation lowered")
    code, entries, _ = cli(capsys, local, "history", "tokenizer-ablation")
    line = [e for e in entries if e["kind"] == "priority-changed"][-1]
    assert line["reason"] == "team" and "after the demo" in line["detail"]
    # And raising it back is refused in one line, exit 2, before any event is sent
    code, out, err = cli(capsys, local, "lower", "tokenizer-ablation", "high")
    assert code == 2 and out is None
    assert len(err.strip().splitlines()) == 1 and "not-a-lowering" in err
    assert status(capsys, local, "tokenizer-ablation")["priority"] == 50


def test_a_team_with_only_the_bus_lowers_and_cancels_its_job(capsys, local, monkeypatch):
    # Given a principal that may only put its team's events on the bus (TeamSubmitPolicy):
    # no stack outputs, no table, just the bus's name (its SDK pointed at the local stack)
    state = json.loads(local.state_file.read_text())
    monkeypatch.setenv("AWS_ENDPOINT_URL", state["endpoint_url"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", state["region"])
    for key, value in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(key.upper(), value)
    bus = state["outputs"]["SubmissionBusName"]
    base = ["--bus", bus, "--team", "research", "--json"]
    # When research lowers its job, then cancels it, through the bus alone
    capsys.readouterr()
    code = main(["lower", "tokenizer-ablation", "0", "--note", "not needed", *base])
    out, err = capsys.readouterr()
    assert code == 0 and json.loads(out)["event_id"], err
    # Then the intake applied it, as the team's
    eventually(lambda: status(capsys, local, "tokenizer-ablation")["priority"] == 0, "tokenizer-ablation lowered to 0")
    assert main(["cancel", "tokenizer-ablation", *base]) == 0
    eventually(lambda: status(capsys, local, "tokenizer-ablation")["state"] == "CANCELLED", "tokenizer-ablation cancelled")
    # And the bus path asks for what it needs, in one line, exit 2
    capsys.readouterr()
    assert main(["lower", "tokenizer-ablation", "0", "--bus", bus]) == 2
    assert main(["cancel", "tokenizer-ablation", "--team", "research"]) == 2
    assert main(["cancel", "tokenizer-ablation", "--bus", bus, "--team", "research", "--wait"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "--bus needs --team" in err[0] and "--team goes with --bus" in err[1] and "--wait" in err[2]


# -- exit codes a script relies on -------------------------------------------------------------
@pytest.mark.parametrize(
    "argv",
    [["status", "nobody"], ["explain", "nobody"], ["cancel", "nobody"], ["history", "nobody"], ["drain", "nowhere"],
     ["priority", "nobody", "high"], ["lower", "nobody", "low"]],
    ids=["status", "explain", "cancel", "history", "drain", "priority", "lower"],
)
def test_what_does_not_exist_exits_1(capsys, local, argv):
    code, out, err = cli(capsys, local, *argv)
    assert code == 1 and out is None
    assert len(err.strip().splitlines()) == 1 and "no such" in err


REFUSED = {
    "unknown-pool": ({"pool": "a100"}, "unknown-pool"),
    "wrong-instance-type": (
        {"request": {**json.loads((JOBS / "research-ablation.json").read_text())["request"],
                     "ResourceConfig": {"InstanceType": "ml.g5.48xlarge", "InstanceCount": 1}}},
        "bad-demand",
    ),
    "role-set-by-team": (
        {"request": {**json.loads((JOBS / "research-ablation.json").read_text())["request"], "RoleArn": "arn:aws:iam::1:role/x"}},
        "set-by-pool",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_request_the_stack_would_refuse_exits_2_before_it_is_sent(capsys, local, tmp_path, case):
    # Given an example job changed in one way the stack refuses
    changes, expected = REFUSED[case]
    job = {**json.loads((JOBS / "research-ablation.json").read_text()), "name": f"refused-{case}", **changes}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    # When it is submitted
    code, out, err = cli(capsys, local, "submit", "--file", str(path))
    # Then the CLI says why in one line and exits 2; nothing reached the stack
    assert code == 2 and out is None
    assert len(err.strip().splitlines()) == 1 and expected in err, err
    assert cli(capsys, local, "status", f"refused-{case}")[0] == 1


def test_the_local_stack_stops_on_local_down(local):
    # (last: the fixture's teardown then finds nothing to stop)
    state = local.state()
    assert main(["local", "down", "--state-file", str(local.state_file)]) == 0
    assert local.process.wait(timeout=20) == 0
    assert not local.state_file.exists()
    # And a command for it now says no local stack runs: one line, exit 3
    assert main(["queue", "--local", "--state-file", str(local.state_file)]) == 3
    assert main(["local", "down", "--state-file", str(local.state_file)]) == 1
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", state.port), timeout=2).close()


def _state_file(tmp_path: Path, **changes) -> Path:
    state = {
        "pid": os.getpid(), "port": 4599, "region": "us-east-1", "stack": "preemptor", "outputs": {}, "parameters": {},
        "speed": 60.0, "sim_now": 0.0, "real_at": 0.0, "started_at": 0.0, "stops_at": 0.0, **changes,
    }
    path = tmp_path / "local.json"
    path.write_text(json.dumps(state))
    return path


@pytest.mark.parametrize(
    "changes, named",
    [
        pytest.param({"pid": -1}, "field pid", id="pid-minus-one-would-signal-every-process"),
        pytest.param({"pid": 0}, "field pid", id="pid-zero-would-signal-the-process-group"),
        pytest.param({"pid": "1234"}, "field pid", id="pid-a-string"),
        pytest.param({"pid": True}, "field pid", id="pid-a-boolean"),
        pytest.param({"port": "http"}, "field port", id="port-a-string"),
        pytest.param({"speed": None}, "field speed", id="speed-null"),
    ],
)
def test_local_down_refuses_a_state_file_with_wrong_values_in_one_line_and_signals_nothing(capsys, tmp_path, monkeypatch, changes, named):
    signalled: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: signalled.append((pid, sig)))
    path = _state_file(tmp_path, **changes)
    # When `local down` reads it
    code = main(["local", "down", "--state-file", str(path)])
    # Then it says which file and which field, in one line, and signals no process
    err = capsys.readouterr().err
    assert code != 0 and len(err.strip().splitlines()) == 1 and str(path) in err and named in err, err
    assert signalled == []
    with pytest.raises(LocalStackError, match=named):
        LocalState.read(path)


def test_a_state_file_that_is_a_directory_is_refused_in_one_line(capsys, tmp_path):
    code = main(["queue", "--local", "--state-file", str(tmp_path)])
    err = capsys.readouterr().err
    assert code != 0 and len(err.strip().splitlines()) == 1 and str(tmp_path) in err, err
