"""The documentation stands alone: every relative link in README.md, docs/**/*.md and
bench/README.md points at a file of this repository (and, into a markdown file, at one of its
headings), no document names the design notes that live outside the repository, and the
LICENSE the package metadata declares is there. And it cannot drift from the code: every
`sat <command>` quoted in code is a command, every `--option` after it one of that command's
options, every `section.key=` of a `sat` config section a key of the schema, every file of
the repository quoted in code (`sat_cli/x.py`, `tests/test_x.py::test_name`) there; defaults
quoted beside a key are the composed config's; the config groups README.md lists are `conf/`'s;
and the figures quoted in several places (venv sizes, the kernel build time, the inventory's
counts, the fuzz profiles) agree with bench/README.md's record or the code."""

from __future__ import annotations

import glob
import re
import sys
import unicodedata
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").rglob("*.md")])
# folders whose text files must not send a reader outside the repository
TEXT_DIRS = ("docs", "sweeps", "bench")
TEXT_SUFFIXES = {".md", ".yaml", ".yml", ".py", ".csv", ".txt", ".json"}
OUTSIDE_NOTES = ("ALGORITHMS.md", "STACK.md")

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
# [text](target "title") and ![alt](target); the text may span lines, the target has no spaces
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFDEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _strip_code(text: str) -> str:
    """The text without fenced blocks and code spans (links there are not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lower-cased, every character but
    letters, marks, digits, connector punctuation (``_``), spaces and hyphens dropped, spaces
    turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.replace("`", "").replace("*", "").lower()
    keep = [
        c
        for c in text
        if c in " -" or unicodedata.category(c)[0] in "LMN" or unicodedata.category(c) == "Pc"
    ]
    return "".join(keep).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every heading anchor of a markdown file (repeated headings get -1, -2, … as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for _, title in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def links(path: Path) -> list[str]:
    text = _strip_code(path.read_text(encoding="utf-8"))
    return INLINE.findall(text) + REFDEF.findall(text)


def broken_links(path: Path) -> list[str]:
    """``"target: why"`` for every relative link of ``path`` that does not resolve."""
    bad = []
    for target in links(path):
        if SCHEME.match(target):  # https:, mailto:, …: not a file of this repository
            continue
        file_part, _, anchor = target.partition("#")
        if file_part.startswith("/"):
            bad.append(f"{target}: an absolute path")
            continue
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.is_relative_to(ROOT):
            bad.append(f"{target}: leaves the repository")
        elif not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(doc):
    assert broken_links(doc) == []


def test_no_document_names_notes_outside_the_repository():
    files = [ROOT / "README.md"]
    for d in TEXT_DIRS:
        files += [p for p in (ROOT / d).rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()]
    hits = [
        f"{p.relative_to(ROOT)}: {name}"
        for p in files
        for name in OUTSIDE_NOTES
        if name in p.read_text(encoding="utf-8", errors="replace")
    ]
    assert hits == []


def test_license_is_the_apache_license_with_the_projects_copyright():
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("Copyright 2026 The sat authors\n")
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply" in text
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()


def test_the_checker_catches_what_it_should(tmp_path, monkeypatch):
    """A broken file, a bad anchor and a link out of the repository are reported; links in code,
    external URLs and a good anchor are not."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title: one, two\n\n## 4. SAT: the `q` scope\n")
    doc = tmp_path / "README.md"
    doc.write_text(
        "[ok](docs/a.md#4-sat-the-q-scope) [top](docs/a.md#title-one-two) [web](https://x.y/z)\n"
        "[multi\nline](docs/a.md) `[code](missing.md)`\n```\n[fenced](missing.md)\n```\n"
        "[gone](docs/b.md) [anchor](docs/a.md#nope) [out](../elsewhere.md) [abs](/abs/x.md)\n"
    )
    anchors.cache_clear()
    try:
        bad = broken_links(doc)
    finally:
        anchors.cache_clear()
    assert [b.split(":")[0] for b in bad] == [
        "docs/b.md",
        "docs/a.md#nope",
        "../elsewhere.md",
        "/abs/x.md",
    ]


# keys quoted on purpose as what `sat` refuses (docs/reliability.md: a typo added with '+')
QUOTED_ON_PURPOSE = {"trainer.lrr"}
KEY = re.compile(r"(?<![\w.$/{-])([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)=")
SAT_CMD = re.compile(r"\bsat ([a-z][a-z-]*)((?: [^`\n|;&]*)?)")


def _code(text: str) -> list[str]:
    spans = [m.group(0) for m in FENCE.finditer(text)]
    return spans + [m.group(0) for m in CODE_SPAN.finditer(FENCE.sub("", text))]


def drift(path: Path) -> list[str]:
    """``"what: why"`` for every command, option or config key quoted in ``path``'s code that
    the code does not have."""
    import dataclasses

    from typer.main import get_command

    from sat_cli.cli import app
    from sat_cli.config.grammar import _schema_has
    from sat_cli.config.schema import SatConfig

    top = {f.name for f in dataclasses.fields(SatConfig)}
    commands = get_command(app).commands
    bad = []
    for span in _code(path.read_text(encoding="utf-8")):
        for m in KEY.finditer(span):
            key = m.group(1)
            if key.split(".")[0] in top and key not in QUOTED_ON_PURPOSE and not _schema_has(key):
                bad.append(f"{key}=: not a key of the schema")
        for m in SAT_CMD.finditer(span):
            cmd = m.group(1)
            if cmd not in commands:
                bad.append(f"sat {cmd}: not a command")
                continue
            opts = {o for p in commands[cmd].params for o in getattr(p, "opts", [])}
            for o in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(2)):
                if o not in opts | {"--help"}:
                    bad.append(f"sat {cmd} {o}: not an option of sat {cmd}")
    return sorted(set(bad))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_options_keys_and_files_quoted_in_docs_exist(doc):
    assert drift(doc) + missing_paths(doc) == []


def test_the_drift_check_catches_what_it_should(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text(
        "`sat trian` `sat report x --pairs A` `trainer.lrx=1` `sat sweep f.yaml && sat report x"
        " --pair A@1:B@1` `verl.thing.x=1` `sat ui --port 5000`\n"
    )
    assert drift(doc) == [
        "sat report --pairs: not an option of sat report",
        "sat trian: not a command",
        "trainer.lrx=: not a key of the schema",
    ]


def test_the_venv_size_quoted_agrees_with_the_bench_record():
    """README.md and docs/stack.md quote the venv size of bench/README.md's newest install."""
    readme = re.search(r"(\d+\.\d) GB on the reference machine", (ROOT / "README.md").read_text())
    stack = re.search(r"venv of about (\d+\.\d) GB", (ROOT / "docs" / "stack.md").read_text())
    bench = (ROOT / "bench" / "README.md").read_text()
    install = bench[bench.index("- **Install**") :].split("\n- **")[0]
    newest = re.findall(r"a (\d+\.\d) GB venv", install)[-1]
    assert readme and stack and readme.group(1) == stack.group(1) == newest
    disk = re.search(r"about (\d+\.\d) GB of disk for the environment", _read("README.md"))
    assert disk and disk.group(1) == newest  # the quick start's figure too
    sglang = re.search(r"builds `\.venv-sglang` \(about (\d+\.\d) GB", _read("docs/sglang.md"))
    recorded = re.search(r"`\.venv-sglang` of `make sglang-cpu` took\s+(\d+\.\d) GB", install)
    assert sglang and recorded and sglang.group(1) == recorded.group(1)


def _read(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def test_the_kernel_build_time_quoted_agrees_with_the_bench_record():
    """README.md and the Makefile's help quote the whole `make sglang-kernel` script's wall time
    of bench/README.md (they said 15 and 11 minutes; the record is 16 min 39 s)."""
    rec = re.search(
        r"the whole script, build venv\s+#?\s*included .*?, (\d+) min (\d+) s wall",
        _read("bench/README.md"),
        re.S,
    )
    assert rec
    minutes = round(int(rec.group(1)) + int(rec.group(2)) / 60)
    readme = re.search(r"the network; about (\d+) min on 2 cores", _read("README.md"))
    make = re.search(r"^sglang-kernel:.*about (\d+) min on 2 cores", _read("Makefile"), re.M)
    assert readme and make and int(readme.group(1)) == int(make.group(1)) == minutes


# paths quoted on purpose that are not this repository's files: another project's (slime's
# example), a file a study's rule writes later, a user's file in an example
NOT_OURS = {
    "examples/train_infer_mismatch_helper/mis.py",
    "sweeps/collapse_confirm_cpu.yaml",
    "sweeps/example.yaml",
}
QUOTED_PATH = re.compile(
    r"(?<![\w./-])((?:sat_cli|tests|bench|scripts|conf|sweeps|examples|docs)/[\w./-]*\w)"
    r"(?:::(\w+))?"
)


def missing_paths(path: Path, root: Path = ROOT) -> list[str]:
    """Every file of this repository quoted in ``path``'s code (``sat_cli/x.py``,
    ``tests/test_x.py::test_name``) that does not exist, or whose test is not defined."""
    bad = []
    for span in _code(path.read_text(encoding="utf-8")):
        for m in QUOTED_PATH.finditer(span):
            quoted, test = m.groups()
            if quoted in NOT_OURS:
                continue
            if quoted.endswith("_"):  # a name prefix (`sweeps/collapse_pilot2_`)
                folder, prefix = (root / quoted).parent, (root / quoted).name
                if not any(folder.glob(f"{glob.escape(prefix)}*")):
                    bad.append(f"{quoted}: no file starts so")
            elif not (root / quoted).exists():
                bad.append(f"{quoted}: no such file")
            elif test and not re.search(rf"^\s*def {test}\b", (root / quoted).read_text(), re.M):
                bad.append(f"{quoted}::{test}: no such test")
    return sorted(set(bad))


def test_the_path_check_catches_what_it_should(tmp_path):
    for name, text in {"tests/test_a.py": "def test_here():\n    pass\n", "docs/x.md": ""}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    doc = tmp_path / "docs" / "x.md"  # quotes itself, two good paths and two gone
    doc.write_text(
        "`sat_cli/sweep/safe_yaml.py` `tests/test_a.py::test_here` `tests/test_a.py::test_gone`"
        " sat_cli/not_code.py `see docs/x.md` `tests/test_` `tests/nope_`\n"
    )
    assert missing_paths(doc, tmp_path) == [
        "sat_cli/sweep/safe_yaml.py: no such file",
        "tests/nope_: no file starts so",
        "tests/test_a.py::test_gone: no such test",
    ]


def test_the_readme_names_every_config_group_and_its_options():
    """README.md's "Config groups" paragraph lists each group of `conf/` with all its options
    (it lacked `reward`, `eval=heldout` and `experiment=sum_digits_example`)."""
    from sat_cli.config import GROUPS, group_options

    text = _read("README.md")
    para = " ".join(text[text.index("Config groups (`conf/`):") :].split("\n\n")[0].split())
    listed = {}
    for m in re.finditer(r"`(\w+)`(?: overlays)? \(([^)]*)\)", para):
        names = re.sub(r" or any .*", "", m.group(2).split(";")[0])
        listed[m.group(1)] = sorted(n.strip() for n in names.split(","))
    assert listed == {g: group_options(g) for g in GROUPS}


# `key` (30 s), `key` (default 0.1), `key=value` (the default): a default quoted in a doc
QUOTED_DEFAULT = re.compile(
    r"`([a-z_]+(?:\.[a-z_]+)+)` \((?:default:? )?(-?[0-9][0-9.e+-]*)(?: s)?\)"
    r"|`([a-z_]+(?:\.[a-z_]+)+)=([^`\s]+)` \(the default\)"
)


def quoted_defaults(text: str) -> list[tuple[str, str]]:
    return [(m[0] or m[2], m[1] or m[3]) for m in QUOTED_DEFAULT.findall(" ".join(text.split()))]


def test_defaults_quoted_in_docs_are_the_configs():
    """Every default a doc quotes (`tracking.outage_timeout_s` (1800 s), `reward.timeout_s`
    (default 10 s), `engine.weight_sync=disk` (the default)) is the composed config's, with the
    option that has the key (`launcher=ray` for `launcher.placement_timeout_s`)."""
    import input_surfaces as inv
    from omegaconf import OmegaConf

    from sat_cli.config import compose

    quoted = [(d, *q) for d in DOCS for q in quoted_defaults(d.read_text(encoding="utf-8"))]
    assert len(quoted) >= 10  # the pattern still finds them
    wrong, composed = [], {}
    for doc, key, value in quoted:
        needs = tuple(inv.option_needs(key))  # one composition per option chosen
        cfg = composed[needs] = composed.get(needs) or compose(list(needs))
        actual = OmegaConf.select(cfg, key)
        same = str(actual) == value
        if not same and isinstance(actual, int | float) and not isinstance(actual, bool):
            same = float(value) == float(actual)
        if not same:
            wrong.append(f"{doc.relative_to(ROOT)}: {key} quoted as {value}, is {actual}")
    assert wrong == []


def test_the_default_check_reads_what_it_should():
    text = "`a.b_s` (30 s) and `a.c` (default 0.1), `a.d=disk` (the default); `a.e` (x)"
    assert quoted_defaults(text) == [("a.b_s", "30"), ("a.c", "0.1"), ("a.d", "disk")]


def test_the_inventory_figures_quoted_are_the_inventorys():
    """docs/reliability.md's counts of schema keys and durations and the fuzz profiles' sizes
    are what tests/input_surfaces.py and tests/test_input_surfaces.py have (it said 165 keys and
    11 durations after the settings classes had moved keys out of the walk)."""
    import input_surfaces as inv
    import test_input_surfaces as fuzz

    text = " ".join(_read("docs/reliability.md").split())
    keys = inv.config_options()
    assert re.search(r"option: (\d+) keys\)", text).group(1) == str(len(keys))
    durations = [k for k in keys if k.endswith("_s")]
    assert re.search(r"ending in `_s`: (\d+) of them", text).group(1) == str(len(durations))
    runs = re.search(
        r"default suite runs (\d+) examples per property .*? variants with (\d+)", text
    )
    assert runs.groups() == (str(fuzz.DEFAULT), str(fuzz.FULL))
