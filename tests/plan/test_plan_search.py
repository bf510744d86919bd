"""search: only layouts that validate and fit, fastest first; the CLI prints them."""

from __future__ import annotations

import pytest

import fshard.plan as plan
from fshard.plan.__main__ import main


@pytest.fixture(scope="module")
def llama():
    return plan.get_model("llama3-8b", seq_len=4096)


def test_search_returns_only_layouts_that_validate_and_fit(llama):
    h100 = plan.get_machine("h100")
    limit = 60 * 2**30
    res = plan.search(llama, h100, 8, 32, limit,
                      config=plan.SearchConfig(schedules=("1f1b", "interleaved"), max_microbatch_choices=4))
    assert len(res) > 10 and res.considered >= len(res)
    times = [e.step_s for e in res]
    assert times == sorted(times)
    for est in res:
        plan.check_layout(est.layout, llama, 8)  # raises if not
        assert est.layout.n_devices == 8 and est.layout.batch == 32
        assert est.fits and est.peak_bytes <= limit
        assert est.layout.tp in (1, 2, 4, 8)
    assert res.rejected.get("memory", 0) > 0  # some layouts did not fit in 60 GiB
    assert res.best_unfit is not None and res.best_unfit.peak_bytes > limit


def test_nothing_fits_a_tiny_limit(llama):
    res = plan.search(llama, plan.get_machine("h100"), 8, 16, 1e9,
                      config=plan.SearchConfig(schedules=("1f1b",), max_microbatch_choices=2))
    assert len(res) == 0 and res.best is None
    assert res.best_unfit is not None and res.best_unfit.peak_bytes > 1e9


def test_search_respects_the_axes_it_is_given(llama):
    res = plan.search(llama, plan.get_machine("h100"), 8, 16,
                      config=plan.SearchConfig(axes=("fsdp", "tp"), max_microbatch_choices=2))
    assert len(res) and all(set(e.layout.shape) <= {"fsdp", "tp"} for e in res)


def test_the_deprecated_keywords_warn_and_give_the_config_s_result(llama):
    """The options as keywords (before SearchConfig) still work for one release: each warns,
    naming itself and its replacement, and the result is the config's, layout for layout."""
    h100 = plan.get_machine("h100")
    kw = {"axes": ("fsdp", "tp", "pp"), "schedules": ["1f1b"], "max_microbatch_choices": 2, "top": 5}
    with pytest.warns(DeprecationWarning) as caught:
        old = plan.search(llama, h100, 8, 16, 60 * 2**30, **kw)
    (message,) = [str(w.message) for w in caught]  # one warning naming every keyword
    assert "search: the keyword(s) axes, schedules, max_microbatch_choices, top are deprecated" in message
    assert "config=SearchConfig(axes=..., schedules=..., max_microbatch_choices=..., top=...)" in message
    new = plan.search(llama, h100, 8, 16, 60 * 2**30, config=plan.SearchConfig(**kw))
    assert len(new) == len(old) == 5
    assert [(e.layout, e.step_s, e.peak_bytes) for e in old] == [(e.layout, e.step_s, e.peak_bytes) for e in new]
    assert (old.considered, old.rejected) == (new.considered, new.rejected)


def test_config_and_keywords_together_are_refused(llama):
    h100 = plan.get_machine("h100")
    with pytest.raises(TypeError, match=r"both config= and the old keyword\(s\) top=\.\.\. were given"):
        plan.search(llama, h100, 8, 16, config=plan.SearchConfig(top=1), top=2)
    with pytest.raises(TypeError, match="unexpected keyword.*'topp'"):
        plan.search(llama, h100, 8, 16, topp=2)


def test_search_config_checks_its_fields():
    with pytest.raises(ValueError, match=r"SearchConfig.axes: unknown axes \['xp'\]"):
        plan.SearchConfig(axes=("fsdp", "xp"))
    with pytest.raises(ValueError, match="SearchConfig.max_microbatch_choices must be an int >= 1, got 0"):
        plan.SearchConfig(max_microbatch_choices=0)
    with pytest.raises(ValueError, match="SearchConfig.top must be an int >= 0, got -1"):
        plan.SearchConfig(top=-1)
    assert plan.SearchConfig(axes=["tp"]).axes == ("tp",)  # lists become tuples (hashable, frozen)


def test_cli_prints_a_table_and_the_best(capsys):
    assert main(["--model", "llama3-8b", "--devices", "8", "--machine", "h100", "--batch", "16", "--seq", "2048",
                 "--top", "3", "--plain", "--schedules", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert "layout" in out and "best:" in out and "tok/s/dev" in out
    assert main(["--model", "llama3-8b", "--devices", "8", "--machine", "h100", "--batch", "16", "--seq", "2048",
                 "--layout", "fsdp=8", "--remat"]) == 0
    assert "fsdp=8 remat" in capsys.readouterr().out


def test_cli_rich_table(capsys):
    import rich  # noqa: F401  (in the test extra; the plain fallback is tested above)

    assert main(["--model", "llama3-8b", "--devices", "8", "--machine", "a100", "--batch", "16", "--seq", "1024",
                 "--top", "2", "--schedules", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert "─" in out  # rich's rule under the header (plain text draws it with "-")


def test_cli_errors_name_the_choices(capsys):
    assert main(["--model", "gpt-17"]) == 2
    assert "llama3-8b" in capsys.readouterr().err
    assert main(["--machine", "tpu"]) == 2
    assert "h100" in capsys.readouterr().err
