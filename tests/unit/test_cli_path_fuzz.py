"""Property: whatever value a shell hands a path option of `onbox run` (an unset variable, an option, blanks, control
characters, a real path of any shape), the options' validation never raises anything but onbox's or click's own
refusal, never takes a value that looks like an option for a path, and accepts every legit path; and a checkpoint
or durable dir anywhere in a system tree is refused while one anywhere under a user's place is not (issue 30.12,
30.14). The validation is the one `onbox sbatch` runs before it submits (parse, then RunConfig.validate), and the
launch's path check (checks.check_paths) on the absolute paths."""
from __future__ import annotations

import os
from typing import Any

import click
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from onbox.clikit import option_like
from onbox.commands.run import check_run_options
from onbox.config import RunConfig
from onbox.errors import OnboxError, UsageError
from onbox.launch.checks import SYSTEM_TREES, check_paths

FLAGS = ["--run-file", "--ckpt-dir", "--durable", "--workdir", "--env-file", "--tracker-token-file",
         "--heartbeat-file", "--mlflow-token-file", "--node-group", "-f"]
LONG = {"-f": "--run-file"}
NEVER = "/nonexistent-onbox-fuzz"  # no such dir: click.Path's existence checks have nothing to refuse
segment = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="/\0"),
                  min_size=1, max_size=12).filter(lambda s: s not in (".", ".."))
legit = st.one_of(
    st.lists(segment, min_size=1, max_size=4).map(lambda parts: NEVER + "/" + "/".join(parts)),
    st.lists(segment, min_size=1, max_size=3).map(lambda parts: "./" + "/".join(parts)),
    st.lists(segment.filter(lambda s: not s.startswith(("-", "~")) and s.strip()), min_size=1, max_size=3).map(
        "/".join),
)
option_ish = st.one_of(st.sampled_from(["--", "-", "-x", "--durable", "--ckpt-dir=x", "-f", "--help", "-1"]),
                       st.text(max_size=10).map(lambda s: "-" + s))
blank = st.text(alphabet=" \t\n\r\x0b\x0c", max_size=4)
values = st.one_of(st.tuples(st.just("legit"), legit), st.tuples(st.just("option"), option_ish),
                   st.tuples(st.just("blank"), blank), st.tuples(st.just("any"), st.text(max_size=24)))


def _validate(argv: Any) -> Any:
    """None when the options pass, else the refusal (OnboxError or click's own); anything else propagates."""
    try:
        check_run_options(list(argv))
    except (OnboxError, click.ClickException) as e:
        return e
    return None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(flag=st.sampled_from(FLAGS), drawn=values)
def test_a_path_options_value_is_refused_as_an_option_and_accepted_as_a_path(flag, drawn):
    kind, value = drawn
    event(kind)
    refusal = _validate([flag, value])
    name = LONG.get(flag, flag)
    if option_like(value, stdin_dash=name == "--node-group"):
        assert isinstance(refusal, UsageError), (flag, value, refusal)
        assert refusal.message == "%s needs a value: got %r (an unset variable?)" % (name, value)
    elif kind == "legit":
        assert refusal is None, (flag, value, refusal)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(flags=st.lists(st.tuples(st.sampled_from(FLAGS), values), min_size=2, max_size=4))
def test_several_options_never_let_one_take_anothers_flag_for_its_path(flags):
    """`--ckpt-dir $UNSET --durable D`: whatever sits around it, an option's value is never another flag. A flag
    given twice keeps its last value (click's rule; --env-file keeps every one): only what is kept counts."""
    argv = [word for flag, (_kind, value) in flags for word in (flag, value)]
    kept = {}
    for flag, (_kind, value) in flags:
        name = LONG.get(flag, flag)
        kept[name] = [*kept.get(name, []), value] if name == "--env-file" else [value]
    bad = {name for name, vals in kept.items() if any(option_like(v, stdin_dash=name == "--node-group")
                                                      for v in vals)}
    refusal = _validate(argv)
    if bad:  # refused (another bad value, a NUL, may be named first), never accepted
        assert refusal is not None, argv
    if isinstance(refusal, UsageError) and " needs a value: " in refusal.message:
        assert refusal.message.split(" needs a value")[0] in bad, (argv, refusal)  # never a good value's flag


tree_path = st.tuples(st.sampled_from(SYSTEM_TREES), st.lists(segment, max_size=3)).map(
    lambda t: os.path.join(t[0], "onbox-fuzz-" + "-".join(t[1])) if t[1] else t[0])
user_root = st.sampled_from(["/tmp", "/var/tmp", "/dev/shm", "/workspace", "/root/autodl-tmp", "/home/user/datadisk",
                             "/lambda/nfs/fs", "/storage", "/hy-tmp", "/mnt/data", "/data"])
user_path = st.tuples(user_root, st.lists(segment, min_size=1, max_size=3)).map(
    lambda t: os.path.join(t[0], "onbox-fuzz", *t[1]))


@settings(max_examples=300, deadline=None)
@given(path=st.one_of(st.tuples(st.just("system"), tree_path), st.tuples(st.just("user"), user_path)),
       which=st.sampled_from(["ckpt_dir", "durable"]))
def test_a_dir_in_a_system_tree_is_refused_and_one_in_a_users_place_is_not(path, which):
    kind, value = path
    event(kind)
    cfg = RunConfig(name="x", command=["true"], **{which: value})
    try:
        check_paths(cfg, "/nonexistent-onbox-home/runs/x")
        refused = None
    except UsageError as e:
        refused = e
    if kind == "system" and not value.startswith(("/var/tmp/", "/dev/shm/")):
        assert refused is not None and "system directory" in refused.message, (which, value)
        assert refused.message.startswith("--%s %s " % (which.replace("_", "-"), value))
    elif kind == "user" and len(value.encode()) < 4000:
        assert refused is None or "too long" in refused.message, (which, value, refused)
