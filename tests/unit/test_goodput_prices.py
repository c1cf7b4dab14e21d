"""What an hour of a box costs: `onboxctl box add --price` kept in the inventory (a TOML float, shown by `box ls`),
a profile's price in prices.toml, the box's own winning; a bad price is one line, exit 2, nothing written. And the
report's grouping: a group's parts are its runs' parts on its boxes, money is hours times each box's price, hours
without a price counted apart, never guessed."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from controller.boxes.inventory import Inventory
from controller.cli import cli
from controller.goodput.prices import load_prices, price_of
from controller.goodput.report import group, parse_since, render
from onbox.errors import UsageError


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.setenv("ONBOX_CONFIG_DIR", str(tmp_path))
    return tmp_path


def test_a_box_keeps_its_price_as_a_number_and_ls_shows_it(cfg):
    r = CliRunner().invoke(cli, ["box", "add", "g1", "--host", "1.2.3.4", "--profile", "runpod", "--price", "0.44"])
    assert r.exit_code == 0 and "0.44 an hour" in r.output, r.output
    assert "price = 0.44\n" in (cfg / "boxes.toml").read_text()  # a TOML float, not the string "0.44"
    assert Inventory().load()["g1"].price == 0.44
    CliRunner().invoke(cli, ["box", "add", "g2", "--host", "h2"])
    out = CliRunner().invoke(cli, ["box", "ls"]).output
    assert "PRICE/H" in out and [line.split()[-1] for line in out.splitlines()[1:]] == ["0.44", "-"]
    assert json.loads(CliRunner().invoke(cli, ["box", "ls", "--json"]).output)["boxes"][0]["price"] == 0.44


def test_box_ls_without_prices_is_as_it_was(cfg):
    CliRunner().invoke(cli, ["box", "add", "g1", "--host", "h"])
    assert "PRICE" not in CliRunner().invoke(cli, ["box", "ls"]).output


@pytest.mark.parametrize("price,says", [("abc", "is not a number"), ("-1", "from 0 to"), ("nan", "from 0 to"),
                                        ("inf", "from 0 to"), ("1e9", "from 0 to")])
def test_a_bad_price_is_refused_and_nothing_is_written(cfg, price, says):
    r = CliRunner().invoke(cli, ["box", "add", "g1", "--host", "h", "--price", price], standalone_mode=False)
    assert isinstance(r.exception, UsageError) and says in r.exception.message and "--price" in r.exception.message
    assert not (cfg / "boxes.toml").exists()


@pytest.mark.parametrize("entry,says", [('price = "0.44"', "a price per hour is a number"),
                                        ("price = -2", "from 0 to"), ("price = true", "is a number")])
def test_an_inventory_price_that_is_no_price_names_the_box(cfg, entry, says):
    (cfg / "boxes.toml").write_text('[boxes.g1]\nhost = "h"\n%s\n' % entry)
    with pytest.raises(UsageError, match=says):
        Inventory().load()


def test_a_profiles_price_applies_unless_the_box_has_its_own(cfg):
    (cfg / "prices.toml").write_text("[profiles]\nrunpod = 0.5\nvastai = 0.31\n")
    prices = load_prices(str(cfg))
    assert prices == {"runpod": 0.5, "vastai": 0.31}
    assert price_of(None, "runpod", prices) == 0.5 and price_of(0.44, "runpod", prices) == 0.44
    assert price_of(None, "lambda", prices) is None and price_of(None, None, prices) is None


@pytest.mark.parametrize("text,says", [("runpod = 1\n", "expected one table"), ("[profiles]\nrunpod = 'x'\n", "number"),
                                       ("[profiles]\nrunpod = -1\n", "from 0 to"), ("[prices]\n", "unknown")])
def test_a_bad_price_list_names_the_file_and_the_key(cfg, text, says):
    (cfg / "prices.toml").write_text(text)
    with pytest.raises(UsageError, match=says):
        load_prices(str(cfg))


def entry(run, by_box, losses=(), overlap=None):
    return {"run": run, "by_box": {b: dict({"productive": 0.0, "recomputed": 0.0, "down": 0.0, "restoring": 0.0,
                                            "starting": 0.0, "stalled": 0.0}, **p) for b, p in by_box.items()},
            "losses": list(losses), "overlap_s": overlap or {}, "boxes": {}}


def test_groups_sum_their_runs_parts_and_price_each_box():
    runs = [entry("a", {"g1": {"productive": 3600.0, "down": 1800.0}, "s1": {"recomputed": 3600.0}},
                  losses=[{"box": "g1", "steps": 10}]),
            entry("b", {"g1": {"productive": 7200.0}})]
    boxes = {"g1": {"profile": "runpod", "pool": "p", "price": None}, "s1": {"profile": "vastai", "pool": "p",
                                                                            "price": 2.0}}
    prices = {"runpod": 1.0}
    by_run = {g.key: g for g in group(runs, "run", boxes, prices)}
    assert by_run["a"].wall == 9000.0 and by_run["a"].goodput == pytest.approx(0.4)
    assert by_run["a"].money == {"productive": 1.0, "recomputed": 2.0, "down": 0.5, "restoring": 0.0,
                                 "starting": 0.0, "stalled": 0.0}
    assert by_run["a"].losses == 1 and by_run["a"].recomputed_steps == 10
    by_profile = {g.key: g for g in group(runs, "profile", boxes, prices)}
    assert by_profile["runpod"].parts["productive"] == 10800.0 and by_profile["vastai"].parts["recomputed"] == 3600.0
    assert [g.key for g in group(runs, "pool", boxes, prices)] == ["p"]
    text = "\n".join(render(group(runs, "box", boxes, prices), "box", []))
    assert text.splitlines()[0].split()[:3] == ["BOX", "WALL", "GOODPUT"] and "total" in text


def test_hours_without_a_price_are_counted_apart_never_guessed():
    runs = [entry("a", {"g1": {"productive": 3600.0}, "x": {"productive": 3600.0}})]
    g = group(runs, "run", {"g1": {"price": 1.0}}, {})[0]
    assert g.money["productive"] == 1.0 and g.unpriced_s == 3600.0
    assert g.to_dict()["money"]["unpriced_s"] == 3600.0
    lines = render([g], "run", [])
    assert "1.00*" in lines[1] and lines[-1].startswith("* some hours are on boxes without a price")
    bare = render(group(runs, "run", {}, {}), "run", [])
    assert bare[1].split()[-2:] == ["-", "-"] and bare[-1].startswith("no prices known")


@pytest.mark.parametrize("text,seconds", [("90m", 5400.0), ("7d", 604800.0), ("12h", 43200.0), ("30", 30.0),
                                          ("2w", 1209600.0)])
def test_since_takes_a_duration(text, seconds):
    assert parse_since(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "-1d", "1y", "1e9d", "nan"])
def test_since_refuses_what_is_no_duration(text):
    with pytest.raises(UsageError, match="--since"):
        parse_since(text)


def test_a_total_over_priced_and_unpriced_groups_says_so():
    runs = [entry("a", {"g1": {"productive": 3600.0}}), entry("b", {"x": {"productive": 3600.0}})]
    lines = render(group(runs, "run", {"g1": {"price": 1.0}}, {}), "run", [])
    assert lines[-2].startswith("total") and lines[-2].split()[-2:] == ["1.00*", "0.00*"]
    assert lines[-1].startswith("* some hours are on boxes without a price")
