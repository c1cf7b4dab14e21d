"""Names that become directory names, file names, variables and tracker keys are checked whole: a regex ending in
`$` also matches before a final newline, so every check here must refuse "name\\n"."""
from __future__ import annotations

import pytest

from onbox.checkpoints.formats.hf import HF_NAME_RE
from onbox.config import check_env_entry, parse_secret_spec
from onbox.errors import UsageError
from onbox.multinode.role import check_addr
from onbox.paths import valid_run_name, valid_secret_name


@pytest.mark.parametrize("name", ["exp1", "a.b_c-d", "x" * 128])
def test_good_names_pass(name):
    assert valid_run_name(name)
    assert valid_secret_name(name[:64])


@pytest.mark.parametrize("name", ["exp1\n", "exp1\r", "\nexp1", "-x", ".x", "a/b", "", "x" * 129])
def test_a_run_name_is_checked_whole(name):
    assert not valid_run_name(name)


@pytest.mark.parametrize("name", ["tok\n", "../tok", ".tok", "x" * 65])
def test_a_secret_name_is_checked_whole(name):
    assert not valid_secret_name(name)
    with pytest.raises(UsageError):
        parse_secret_spec(name)


def test_an_environment_name_with_a_final_newline_is_refused():
    with pytest.raises(UsageError):
        check_env_entry("HF_TOKEN\n", "x", "--env")
    check_env_entry("HF_TOKEN", "x", "--env")


def test_a_node_address_with_a_final_newline_is_refused():
    assert check_addr("gpu1.internal", "addr") == "gpu1.internal"
    with pytest.raises(UsageError):
        check_addr("gpu1.internal\n", "addr")


def test_an_hf_checkpoint_name_is_matched_whole():
    assert HF_NAME_RE.fullmatch("checkpoint-500")
    assert not HF_NAME_RE.fullmatch("checkpoint-500\n")
