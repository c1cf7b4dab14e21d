"""onbox.untrusted: bounded reads of regular files only, bounded nesting, relative paths kept under their root."""
from __future__ import annotations

import os

import pytest

from onbox import untrusted
from onbox.errors import UsageError
from onbox.tomlread import load_toml


def test_a_character_device_is_refused_not_read_until_memory_runs_out():
    with pytest.raises(untrusted.UntrustedInput, match="character device"):
        untrusted.read_bytes("/dev/zero", 1024, "run file")


def test_a_fifo_is_refused_at_once_instead_of_hanging_on_the_open(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(untrusted.UntrustedInput, match="FIFO"):
        untrusted.read_bytes(fifo, 1024)


def test_a_symlink_to_a_device_is_judged_by_what_it_points_at(tmp_path):
    link = tmp_path / "profile.toml"
    link.symlink_to("/dev/zero")
    with pytest.raises(UsageError, match="character device"):
        load_toml(str(link), "profile")


def test_a_file_over_the_bound_is_refused_with_both_sizes(tmp_path):
    big = tmp_path / "boxes.toml"
    big.write_bytes(b"#" * 2049)
    with pytest.raises(untrusted.UntrustedInput, match=r"too large \(2.0 KiB, the limit is 2 KiB\)"):
        untrusted.read_bytes(big, 2048)
    assert untrusted.read_bytes(big, 2049) == b"#" * 2049


def test_a_directory_and_a_missing_file_keep_their_os_errors(tmp_path):
    with pytest.raises(IsADirectoryError):
        untrusted.read_bytes(tmp_path, 10)
    with pytest.raises(FileNotFoundError):
        untrusted.read_bytes(tmp_path / "nope", 10)


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a":' * 5000 + "1" + "}" * 5000,
                                  "[" * 65 + "]" * 65])
def test_json_nested_too_deep_is_refused_never_a_recursion_error(text):
    with pytest.raises(untrusted.UntrustedInput, match="nests more than 64 levels"):
        untrusted.loads_json(text, "pulls.json")


def test_json_within_the_bound_parses_and_a_bom_is_dropped():
    assert untrusted.loads_json("[" * 64 + "]" * 64) is not None
    assert untrusted.loads_json(b'\xef\xbb\xbf{"a": 1}') == {"a": 1}


def test_toml_with_a_bom_parses_and_a_deep_one_is_a_usage_error(tmp_path):
    ok = tmp_path / "run.toml"
    ok.write_bytes(b"\xef\xbb\xbf[run]\nname = 'x'\n")
    assert load_toml(str(ok)) == {"run": {"name": "x"}}
    deep = tmp_path / "deep.toml"
    deep.write_text("a = " + "[" * 50_000 + "]" * 50_000)
    with pytest.raises(UsageError, match="nests too deeply"):
        load_toml(str(deep), "run file")


@pytest.mark.parametrize("rel, why", [
    ("../../evilsrc/payload", "'..'"), ("/etc/passwd", "absolute"), ("a/../../b", "'..'"), ("a//b", "empty part"),
    ("./a", "'.'"), ("a\x00b", "NUL"), ("", "empty"), (5, "not a string"), (None, "not a string"),
    (["a"], "not a string"), ("x" * 256, "255 bytes"),
])
def test_relpath_problem_names_what_is_wrong(rel, why):
    assert why in (untrusted.relpath_problem(rel) or "")


def test_relpath_problem_accepts_ordinary_relative_paths():
    for rel in ("ckpt.pt", "checkpoint-100/model.safetensors", "a/b/c/d.bin", "..hidden", "x..y", "a b/ü.pt"):
        assert untrusted.relpath_problem(rel) is None, rel


def test_name_problem_refuses_a_path_where_one_name_is_expected():
    assert "single name" in untrusted.name_problem("a/b")
    assert untrusted.name_problem("../victim")
    assert untrusted.name_problem("ckpt.pt") is None


def test_join_under_refuses_an_escape_through_a_symlink_inside_the_root(tmp_path):
    root = tmp_path / "ck"
    root.mkdir()
    (root / "lnk").symlink_to("/etc")
    with pytest.raises(untrusted.UntrustedInput, match="outside"):
        untrusted.join_under(root, "lnk/passwd")
    with pytest.raises(untrusted.UntrustedInput, match=r"'\.\.'"):
        untrusted.join_under(root, "../x")
    assert untrusted.join_under(root, "not/yet/there.pt") == os.path.join(str(root), "not/yet/there.pt")


def test_depth_counts_iteratively_and_stops_past_the_bound():
    assert untrusted.depth(5) == 0
    assert untrusted.depth({"a": [1, {"b": []}]}) == 4
    deep: list = []
    node = deep
    for _ in range(100_000):
        node.append([])
        node = node[0]
    assert untrusted.depth(deep, bound=10) == 11


def test_printable_shows_every_control_character_as_an_escape_and_keeps_the_rest():
    from onbox.untrusted import printable

    title = "gpu1\x1b]0;PWNED-TITLE\x07\x1b[2J"
    assert printable(title) == "gpu1\\x1b]0;PWNED-TITLE\\x07\\x1b[2J"
    assert printable("step_1\nverified: forged") == "step_1\\x0averified: forged"  # no line of its own
    assert printable("a\rb\x00c\x7fd\x9be") == "a\\x0db\\x00c\\x7fd\\x9be"
    assert printable("tab\there, ünïcode ok") == "tab\there, ünïcode ok"
    assert printable("line 1\nline 2\x1b[K", keep_newlines=True) == "line 1\nline 2\\x1b[K"
    assert printable(42) == "42"
